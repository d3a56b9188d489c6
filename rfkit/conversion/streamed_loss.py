"""Head selection by measured loss: stream one unit at a time and keep the units that cost most.

The recency ratio (:class:`~rfkit.conversion.policies.RecencyRatioPolicy`) asks how local a
head *looks*. When few heads stay exact (beta 0.75 and above), the question that matters is what
the model *loses* when a head stops seeing the whole sequence. :class:`StreamedLossPolicy` asks
it directly: for every unit (a KV group, or a query head) it measures the model's next-token
loss on calibration blocks with that unit alone restricted to a sink + recent window (the
training-free streaming head of DuoAttention and StreamingLLM, the exact part of rfkit's hybrid),
every other head untouched, and replaces the units whose streaming costs least.

For unit ``u`` of layer ``l``::

    delta_u = loss(model with u streamed) - loss(model)        (mean over the same tokens)

The measurement swaps in an attention function (registered with transformers'
``AttentionInterface``, as profiling does) that runs every layer with causal SDPA and gives the
probed heads of layer ``l`` the mask ``j <= i and (j < sink or i - j < recent)``, the mask of
``SinkRecentOperator(sink, window=recent)``. The layers before ``l`` are not run again for each
unit: their outputs on the original model are kept from the first pass and replayed, so one unit
costs the layers from ``l`` on (about half a forward on average). Memory: the outputs of every
layer for the measured blocks (``blocks x seq_len x hidden x layers`` in the model's dtype; 140 MB
for SmolLM2-135M at 8 x 512 tokens, about 1 GB for a 7B model).

The deltas are first-order: each unit is streamed alone, so interactions between units are not
measured (DuoAttention trains gates jointly for that). The policy also profiles the recency
ratio with the same calibration data, so the head map holds both rankings side by side
(``rr_mean``, ``rai`` and ``measured.delta``) and the two policies can be compared head by head.
"""

from __future__ import annotations

import copy
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from rfkit.conversion.policies import PolicyError, RecencyRatioPolicy
from rfkit.conversion.profile import HeadProfile, _all_reduce, capture_attention, collective_device, dist_rank_world, profile_heads
from rfkit.models.layout import AttentionLayout
from rfkit.validate import in_range, positive_int


STREAM_ATTENTION = "rfkit_streamed_probe"
MEASURE = "streamed_loss"


def streaming_mask(length: int, sink: int, recent: int, device=None) -> torch.Tensor:
    """(L, L) boolean: query ``i`` sees key ``j`` when ``j <= i`` and (``j < sink`` or
    ``i - j < recent``): the first ``sink`` tokens and the last ``recent`` ones, itself included."""
    i = torch.arange(length, device=device)[:, None]
    j = torch.arange(length, device=device)[None, :]
    return (j <= i) & ((j < sink) | (i - j < recent))


class _StreamProbe:
    """Causal attention everywhere, except the probed query heads of the probed layer, which see
    a sink + recent window only (the collector :func:`capture_attention` hands every layer to)."""

    def __init__(self, sink: int, recent: int):
        self.sink, self.recent = sink, recent
        self.layer: int | None = None
        self.heads: list[int] = []

    def attend(self, module, query, key, value, scaling: float):
        heads, kv_heads, length = query.shape[1], key.shape[1], query.shape[2]
        if kv_heads != heads:
            key = key.repeat_interleave(heads // kv_heads, dim=1)
            value = value.repeat_interleave(heads // kv_heads, dim=1)
        if module.layer_idx != self.layer or not self.heads:
            out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
        else:
            mask = torch.ones(heads, length, length, dtype=torch.bool, device=query.device).tril()
            mask[self.heads] = streaming_mask(length, self.sink, self.recent, query.device)
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask[None], scale=scaling)
        return out.transpose(1, 2).contiguous()


class _Replay(torch.nn.Module):
    """Stands in for a decoder layer already run: returns that layer's recorded output."""

    def __init__(self, output):
        super().__init__()
        self.output = output

    def forward(self, *args, **kwargs):
        return self.output


def _token_loss(model, ids: torch.Tensor, answers: torch.Tensor | None = None) -> tuple[float, float]:
    """Summed next-token cross-entropy of ``ids`` (B, L) under ``model``, in float32 (float64
    for a float64 model), and the part of it on the tokens ``answers`` (B, L) marks (0 without)."""
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    each = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
    answer = float(each[answers[:, 1:].reshape(-1)].sum()) if answers is not None else 0.0
    return float(each.sum()), answer


class StreamedLosses(NamedTuple):
    """What :func:`streamed_losses` measured: mean next-token loss of the model (``base``) and
    with each unit streamed (``losses``) over ``tokens`` predicted tokens, and the same means
    over the ``answers`` tokens the batches' ``answer_mask`` marks (0.0 each when none)."""

    base: float
    losses: list[float]
    tokens: int
    answer_base: float
    answer_losses: list[float]
    answers: int


@torch.no_grad()
def streamed_losses(model, batches, units: list[tuple[int, list[int]]], sink: int, recent: int, progress: bool = True) -> StreamedLosses:
    """Mean next-token loss of ``model`` on ``batches`` (dicts with ``input_ids`` (B, L) and
    optionally ``answer_mask`` (B, L)), and for every unit ``(layer, query heads)`` the mean loss
    with those heads alone streamed; the same on the answer tokens alone where batches mark them.
    """
    from rfkit.models.modeling import decoder_layers

    layers = decoder_layers(model)
    device = next(model.parameters()).device
    probe = _StreamProbe(sink, recent)
    ids_list = [b["input_ids"].to(device) for b in batches]
    masks = [b["answer_mask"].to(device) if "answer_mask" in b else None for b in batches]
    tokens = sum(ids.shape[0] * (ids.shape[1] - 1) for ids in ids_list)
    answers = sum(int(m[:, 1:].sum()) for m in masks if m is not None)
    was_training = model.training
    model.eval()
    outputs: list[list] = [[None] * len(layers) for _ in ids_list]  # per batch, per layer
    hooks = []
    current = {"batch": 0}

    def keep(index):
        def hook(_module, _args, output):
            outputs[current["batch"]][index] = output

        return hook

    losses, answer_losses = [], []
    try:
        with capture_attention(model, probe, STREAM_ATTENTION, "rfkit streamed-loss attention called outside a measurement"):
            hooks = [layer.register_forward_hook(keep(i)) for i, layer in enumerate(layers)]
            base = answer_base = 0.0
            for b, ids in enumerate(ids_list):
                current["batch"] = b
                loss, answer = _token_loss(model, ids, masks[b])
                base, answer_base = base + loss, answer_base + answer
            for h in hooks:
                h.remove()
            hooks = []
            bar = tqdm(units, desc="streaming each unit", unit="unit", disable=not progress)
            for layer, heads in bar:
                probe.layer, probe.heads = layer, list(heads)
                total = answer_total = 0.0
                for b, ids in enumerate(ids_list):
                    originals = [layers[i] for i in range(layer)]
                    for i in range(layer):
                        layers[i] = _Replay(outputs[b][i])
                    try:
                        loss, answer = _token_loss(model, ids, masks[b])
                        total, answer_total = total + loss, answer_total + answer
                    finally:
                        for i, original in enumerate(originals):
                            layers[i] = original
                losses.append(total / tokens)
                answer_losses.append(answer_total / answers if answers else 0.0)
    finally:
        for h in hooks:
            h.remove()
        probe.layer, probe.heads = None, []
        model.train(was_training)
    return StreamedLosses(base / tokens, losses, tokens, answer_base / answers if answers else 0.0, answer_losses, answers)


def sharded_increases(model, batches, units: list[tuple[int, list[int]]], sink: int, recent: int, progress: bool = True) -> StreamedLosses:
    """:func:`streamed_losses` with each unit's *increase* in ``losses`` and ``answer_losses``.
    Under ``torch.distributed`` (more than one rank, the same arguments on each) rank r measures
    units r, r + world_size, ... against its own baseline and the increases are all-reduced: every
    rank ranks on the same numbers; ``base`` and ``answer_base`` are the ranks' mean baselines."""
    rank, world = dist_rank_world()
    mine = list(range(rank, len(units), world))
    got = streamed_losses(model, batches, [units[i] for i in mine], sink, recent, progress and rank == 0)
    increases = torch.zeros(2, len(units), dtype=torch.float64)
    for i, loss, answer in zip(mine, got.losses, got.answer_losses):
        increases[0, i], increases[1, i] = loss - got.base, answer - got.answer_base
    bases = torch.tensor([got.base, got.answer_base], dtype=torch.float64)
    if world > 1:  # every rank reaches this, also one with no unit of its own
        increases, bases = _all_reduce([increases, bases], collective_device(next(model.parameters()).device))
        bases = bases / world
    return StreamedLosses(float(bases[0]), increases[0].tolist(), got.tokens, float(bases[1]), increases[1].tolist(), got.answers)


class StreamedLossPolicy(RecencyRatioPolicy):
    """Replace the units whose streaming alone costs the model the least loss.

    Every unit (KV group or query head) is restricted in turn to a sink + recent window on
    ``blocks`` calibration blocks, every other head untouched, and the increase in next-token
    loss is measured (:func:`streamed_losses`). The ``beta`` fraction of units with the smallest
    increase is replaced. The recency profile is collected too (``window``, ``alpha``,
    ``exclude_first_token`` as in :class:`RecencyRatioPolicy`), so the head map holds both
    rankings; RA-I breaks exact ties.

    Args:
        sink: First tokens the probed heads keep (default 4).
        recent: Last tokens the probed heads keep, the current one included (default 64: the
            bytes of rfkit's default hybrid state, see ``rfkit eval context --baseline matched``).
        blocks: Blocks the loss is measured on: the first ones of the calibration set (all of
            them when fewer), or with ``long_source`` that many blocks spread evenly over its
            train split. Cost: one pass over them per unit, from the unit's layer on, the units
            split over the ranks under DDP / FSDP (:func:`sharded_increases`). With
            several ``long_seq_len``, one count per length (or one for all).
        long_source: Measure on long documents instead (a data source such as
            ``embedded:shakespeare``, read in the recipe's tokenisation, train split): a head
            that averages over the whole context can be streamed for free in a 512-token block
            and still be needed at 8k. None (default): the calibration blocks.
        long_seq_len: Tokens per block of ``long_source``, or a list of lengths (e.g. ``[2048,
            8192]``): each length is measured on its own (and cached as a one-length
            measurement would be), and units are ranked by the sum over lengths of their
            increase divided by the mean increase of all units at that length, so that no
            length outweighs another because its increases run larger. A group needed only at
            8k and one needed only at 2k then compete on equal terms.
        recall: Records planted in each measured block (0, the default: none), each recalled at
            least ``recall_gap`` tokens later (:mod:`rfkit.data.recall`, the training mix's
            ``data.long_recall``). The loss increase on the recalled numbers' tokens is
            measured beside the text's: a head that copies from far back costs little on
            ordinary text and everything on a passkey (DuoAttention ranks its heads on synthetic
            retrieval for this reason). Needs the recipe's data section and a fast tokenizer.
        recall_gap: Fewest tokens between a record and its recall line (default 256).
        recall_weight: How the two increases add up when units are ranked: text increase +
            ``recall_weight`` x answer increase (mean nats per token each; default 0.1). Read
            at selection time, so another weight reuses a cached measurement.
        window, alpha, beta, exclude_first_token, granularity, scope, keep_layers,
        allow_all_heads: as in :class:`RecencyRatioPolicy`.
    """

    def __init__(
        self,
        sink: int = 4,
        recent: int = 64,
        blocks: int | list[int] = 8,
        long_source: str | None = None,
        long_seq_len: int | list[int] = 2048,
        recall: int = 0,
        recall_gap: int = 256,
        recall_weight: float = 0.1,
        window: int = 51,
        alpha: float = 0.5,
        beta: float = 0.5,
        exclude_first_token: bool = True,
        granularity: Literal["kv_group", "query_head"] = "kv_group",
        scope: Literal["global", "per_layer"] = "global",
        keep_layers: list[int] | None = None,
        allow_all_heads: bool = False,
    ):
        super().__init__(window, alpha, beta, exclude_first_token, granularity, scope, keep_layers, allow_all_heads)
        positive_int("model.policy.sink", sink, 0, error=PolicyError, message="{field}: {value!r} is not allowed; sink must be an integer >= {minimum}")
        positive_int("model.policy.recent", recent, error=PolicyError, message="{field}: {value!r} is not allowed; recent must be an integer >= {minimum}")
        lengths, counts = _lengths_and_counts(long_seq_len, blocks)
        if long_source is not None and (not isinstance(long_source, str) or not long_source.strip()):
            raise PolicyError(f"model.policy.long_source: {long_source!r} is not allowed; give a data source (a path, URL or embedded:NAME) or null")
        if len(lengths) > 1 and long_source is None:
            raise PolicyError(f"model.policy.long_seq_len: {long_seq_len!r} needs long_source; several lengths are measured on long documents (e.g. long_source: embedded:shakespeare)")
        positive_int("model.policy.recall", recall, 0, error=PolicyError, message="{field}: {value!r} is not allowed; recall must be an integer >= {minimum} (records per measured block)")
        positive_int("model.policy.recall_gap", recall_gap, 0, error=PolicyError, message="{field}: {value!r} is not allowed; recall_gap must be an integer >= {minimum}")
        in_range("model.policy.recall_weight", recall_weight, 0, finite=True, error=PolicyError, message="{field}: {value!r} is not allowed; recall_weight must be a finite number >= 0")
        self.sink, self.recent = int(sink), int(recent)
        # one length: plain integers, as before (so cached one-length measurements keep their key)
        self.blocks = counts[0] if len(lengths) == 1 else counts
        self.long_source, self.long_seq_len = long_source, lengths[0] if len(lengths) == 1 else lengths
        self.recall, self.recall_gap, self.recall_weight = int(recall), int(recall_gap), float(recall_weight)

    def profile_settings(self) -> dict:
        return {
            **super().profile_settings(),
            "measure": MEASURE,
            "sink": self.sink,
            "recent": self.recent,
            "blocks": self.blocks,
            "granularity": self.granularity,
            **({"long_source": self.long_source, "long_seq_len": self.long_seq_len} if self.long_source else {}),
            **({"recall": self.recall, "recall_gap": self.recall_gap} if self.recall else {}),
        }

    def describe(self) -> dict:
        # the weight decides the ranking but not the measurement (not in profile_settings)
        return {**super().describe(), **({"recall_weight": self.recall_weight} if self.recall else {})}

    def lengths(self) -> list[tuple[int, int]]:
        """``(long_seq_len, blocks)`` of every length measured (one unless a list was given)."""
        if isinstance(self.long_seq_len, list):
            return list(zip(self.long_seq_len, self.blocks))
        return [(self.long_seq_len, self.blocks)]

    def at_length(self, long_seq_len: int, blocks: int) -> "StreamedLossPolicy":
        """This policy measuring one length only (the settings of its one-length profile)."""
        one = copy.copy(self)
        one.long_seq_len, one.blocks = int(long_seq_len), int(blocks)
        return one

    def make_profile(self, model, batches, progress: bool = True, datamodule=None, profile_cache=None) -> HeadProfile:
        """The recency profile plus the measured losses (``meta["measured"]``). With several
        lengths each is measured by :meth:`at_length`'s policy, through ``profile_cache(settings,
        make)`` when given (the pipeline's profile cache: a length measured before, alone or in
        another list, is read back), and :func:`combine_lengths` ranks them together."""
        batches = list(batches)
        if len(self.lengths()) == 1:
            return self._with_measurement(self._recency(model, batches, progress), model, batches, progress, datamodule)
        recency = []  # the recency profile is the same for every length: made once, when a part is made

        def make(one):
            if not recency:
                recency.append(self._recency(model, batches, progress))
            return one._with_measurement(copy.copy(recency[0]), model, batches, progress, datamodule)

        parts = []
        for length, count in self.lengths():
            one = self.at_length(length, count)
            parts.append(profile_cache(one.profile_settings(), lambda one=one: make(one)) if profile_cache else make(one))
        profile = copy.copy(parts[0])
        profile.meta = {**parts[0].meta, "measured": combine_lengths([p.meta["measured"] for p in parts], self.recall_weight)}
        return profile

    def _recency(self, model, batches: list, progress: bool) -> HeadProfile:
        return profile_heads(model, batches, progress=progress, **super().profile_settings())

    def _with_measurement(self, profile: HeadProfile, model, batches: list, progress: bool, datamodule) -> HeadProfile:
        """``profile`` (the recency profile) with this policy's measured losses in ``meta["measured"]``."""
        layout = AttentionLayout.from_config(model.config)
        measured = self._measured_batches(batches, datamodule)
        total = sum(b["input_ids"].shape[0] for b in measured)
        per_layer = layout.num_kv_heads if self.granularity == "kv_group" else layout.num_heads
        units = [
            (layer, layout.query_heads_of(u) if self.granularity == "kv_group" else [u])
            for layer in range(layout.num_layers)
            for u in range(per_layer)
        ]
        got = sharded_increases(model, measured, units, self.sink, self.recent, progress)
        delta = [[0.0] * per_layer for _ in range(layout.num_layers)]
        delta_recall = [[0.0] * per_layer for _ in range(layout.num_layers)]
        for (layer, heads), increase, answer in zip(units, got.losses, got.answer_losses):
            unit = layout.kv_head_of(heads[0]) if self.granularity == "kv_group" else heads[0]
            delta[layer][unit] = round(increase, 7)
            delta_recall[layer][unit] = round(answer, 7)
        recall = {
            "recall": {"records": self.recall, "gap": self.recall_gap, "answers": got.answers,
                       "baseline_loss": round(got.answer_base, 7), "delta": delta_recall},
        } if self.recall else {}  # fmt: skip
        profile.meta = {**profile.meta, "measured": {
            "name": MEASURE,
            "what": "increase of mean next-token loss (nats) when the unit alone keeps only its sink + recent tokens",
            "granularity": self.granularity,
            "sink": self.sink,
            "recent": self.recent,
            "source": self.long_source or "calibration",
            "seq_len": int(measured[0]["input_ids"].shape[1]),
            "blocks": total,
            "tokens": got.tokens,
            "baseline_loss": round(got.base, 7),
            "delta": delta,
            **recall,
        }}  # fmt: skip
        return profile

    def _measured_batches(self, batches: list, datamodule) -> list[dict]:
        """The blocks the loss is measured on: the first ``blocks`` calibration blocks, or
        ``blocks`` long blocks spread evenly over ``long_source``'s train split (one per batch)."""
        if self.long_source is None:
            out, total = [], 0
            for batch in batches:  # cut inside a batch when needed
                if total >= self.blocks:
                    break
                ids = batch["input_ids"][: self.blocks - total]
                out.append((ids, range(total, total + ids.shape[0])))
                total += ids.shape[0]
        else:
            if datamodule is None:
                raise PolicyError("model.policy.long_source: reading long blocks needs the recipe's data section (its tokeniser)")
            blocks = datamodule.other_train_blocks(self.long_source, self.long_seq_len, "model.policy.")
            # float64: under bf16-true the default dtype is bf16, which rounds 295 to 296 (past the end)
            picks = torch.linspace(0, len(blocks) - 1, min(self.blocks, len(blocks)), dtype=torch.float64).round().long().unique()
            out = [(blocks[i : i + 1], [i]) for i in picks.tolist()]
        if not self.recall:
            return [{"input_ids": ids} for ids, _rows in out]
        if datamodule is None:
            raise PolicyError("model.policy.recall: planting records needs the recipe's data section (its tokeniser)")
        planter = datamodule.recall_planter(self.recall, self.recall_gap, "model.policy.recall")
        planted = [planter.batch(ids, rows) for ids, rows in out]
        if not any(bool(b["answer_mask"].any()) for b in planted):
            length = out[0][0].shape[1]
            raise PolicyError(f"model.policy.recall: no record fits a measured block of {length} tokens with recall_gap {self.recall_gap}; measure on longer blocks (long_source, long_seq_len) or lower recall_gap")
        return planted

    def unit_scores(self, layout: AttentionLayout, profile: HeadProfile) -> dict[tuple[int, int], tuple[float, float]]:
        delta = measured_cost(profile, self.recall_weight)
        recency = super().unit_scores(layout, profile)
        # highest score replaced first: the smallest loss increase, then the most recency-aware
        return {key: (-delta[key[0]][key[1]], recency[key][0]) for key in recency}


def _lengths_and_counts(long_seq_len, blocks) -> tuple[list[int], list[int]]:
    """``long_seq_len`` and ``blocks`` as equal-length lists, checked (one clear line each)."""
    several = isinstance(long_seq_len, (list, tuple))
    lengths = list(long_seq_len) if several else [long_seq_len]
    if not lengths:
        raise PolicyError("model.policy.long_seq_len: [] is not allowed; give one length or a list of them")
    for length in lengths:
        positive_int("model.policy.long_seq_len", length, 2, error=PolicyError, message="{field}: {value!r} is not allowed; long_seq_len must be an integer >= {minimum} or a list of them")
    if len(set(lengths)) != len(lengths):
        raise PolicyError(f"model.policy.long_seq_len: {long_seq_len!r} is not allowed; each length once")
    counts = list(blocks) if isinstance(blocks, (list, tuple)) else [blocks] * len(lengths)
    if len(counts) != len(lengths):
        raise PolicyError(f"model.policy.blocks: {blocks!r} is not allowed; give one count, or one per long_seq_len ({len(lengths)})")
    for count in counts:
        positive_int("model.policy.blocks", count, error=PolicyError, message="{field}: {value!r} is not allowed; blocks must be an integer >= {minimum} or one per long_seq_len")
    return [int(x) for x in lengths], [int(x) for x in counts]


def combine_lengths(parts: list[dict], recall_weight: float = 0.1) -> dict:
    """One ``measured`` record from one per length: each unit's cost (:func:`measured_cost`) at
    each length divided by the mean absolute cost of all units at that length, summed over the
    lengths. Unitless; ``by_length`` keeps every length's own record."""
    total = None
    for part in parts:
        cost = measured_cost(part, recall_weight)
        flat = [abs(x) for row in cost for x in row]
        scale = sum(flat) / len(flat) or 1.0
        scaled = [[x / scale for x in row] for row in cost]
        total = scaled if total is None else [[a + b for a, b in zip(r, s)] for r, s in zip(total, scaled)]
    first = parts[0]
    return {
        "name": MEASURE,
        "what": "sum over the measured lengths of the unit's loss increase divided by the mean absolute increase of all units at that length",
        "granularity": first["granularity"],
        "sink": first["sink"],
        "recent": first["recent"],
        "source": first["source"],
        "seq_len": [p["seq_len"] for p in parts],
        "blocks": [p["blocks"] for p in parts],
        "tokens": sum(p["tokens"] for p in parts),
        "delta": [[round(x, 7) for x in row] for row in total],
        "by_length": {str(p["seq_len"]): p for p in parts},
    }


def measured_delta(profile) -> list[list[float]]:
    """The per-unit loss increases a :class:`StreamedLossPolicy` measured, from its profile
    (``meta["measured"]``) or from a head map it made (``measured``)."""
    measured = getattr(profile, "measured", None) or (getattr(profile, "meta", None) or {}).get("measured")
    if not measured or measured.get("name") != MEASURE:
        raise PolicyError("StreamedLossPolicy needs a profile with its measured losses (made by its own make_profile)")
    return measured["delta"]


def measured_cost(profile, recall_weight: float) -> list[list[float]]:
    """What the ranking reads per unit: the text loss increase, plus ``recall_weight`` times the
    answer tokens' increase where records were planted (the text increase alone otherwise); for
    several lengths, their combination at this weight (:func:`combine_lengths`)."""
    if isinstance(profile, dict):  # one ``measured`` record (combine_lengths)
        delta, measured = profile["delta"], profile
    else:
        delta = measured_delta(profile)
        measured = getattr(profile, "measured", None) or profile.meta["measured"]
    if "by_length" in measured:  # several lengths: combined again at this weight
        return combine_lengths(list(measured["by_length"].values()), recall_weight)["delta"]
    recall = (measured.get("recall") or {}).get("delta")
    if not recall:
        return delta
    return [[d + recall_weight * r for d, r in zip(row, rrow)] for row, rrow in zip(delta, recall)]


def disagreement(layout: AttentionLayout, profile, beta: float, recall_weight: float = 0.1) -> dict:
    """Where the recency ranking and the measured-loss ranking part at ``beta`` (KV groups, one
    global ranking): the groups each replaces that the other keeps, with their RA-I, mean RR and
    loss increase. ``profile`` is a :class:`StreamedLossPolicy` profile or a head map it made
    (both hold the recency profile and the measured losses); ``recall_weight`` as the policy's
    when records were planted."""
    settings = {"window": profile.window, "alpha": profile.alpha, "beta": beta, "exclude_first_token": profile.exclude_first_token}
    by_loss = _groups(layout, StreamedLossPolicy(**settings, recall_weight=recall_weight).select(layout, profile))
    by_rr = _groups(layout, RecencyRatioPolicy(**settings).select(layout, profile))
    scores = RecencyRatioPolicy(**settings).unit_scores(layout, profile)
    delta = measured_delta(profile)

    def row(key):
        return {"layer": key[0], "group": key[1], "rai": scores[key][0], "rr_mean": round(scores[key][1], 4), "delta": delta[key[0]][key[1]]}

    return {"beta": beta, "replaced": len(by_loss), "agree": len(by_loss & by_rr),
            "only_streamed_loss": [row(k) for k in sorted(by_loss - by_rr)], "only_recency": [row(k) for k in sorted(by_rr - by_loss)]}  # fmt: skip


def _groups(layout: AttentionLayout, selected) -> set[tuple[int, int]]:
    """The (layer, KV group) pairs a selection replaces whole."""
    return {(layer, g) for layer, heads in enumerate(selected) for g in range(layout.num_kv_heads) if set(layout.query_heads_of(g)) <= set(heads)}
