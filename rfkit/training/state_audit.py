"""Close the states that turn a quote away: a trained hybrid's state audit.

A trained hybrid's recurrent state can outweigh what its exact window holds: asked for a key
written in the sentence before the question, the window alone quotes it and the state, adding
what it read of the text before, answers "the" instead (docs/comparing.md, "Needles of other
shapes"). Which layer's state does it moves from one training run to the next, so no fixed list
of stateless layers serves. The audit measures it on the trained model itself, on calibration
prompts that no evaluation asks:

1. build needle prompts of one shape (:mod:`rfkit.data.needle_prompts`, the shapes of ``rfkit
   eval needles``) from the **train** split of their filler (other sentences and other keys than
   ``rfkit eval needles`` asks);
2. for each prompt, the first answer token's *margin*: the log-probability of the key's first
   token minus the best other token's (above 0, the greedy answer starts with the key), with every
   state on, every state off and each layer's state alone off;
3. the *targets* are the prompts the window alone quotes (every state off: margin above
   ``min_margin``, 0.5 by default). Close the layers whose state lowers the targets' margins most,
   one at a time (a layer's effect is its mean change over the targets when its state alone is
   off; only layers with a positive effect are candidates), measuring the targets again after
   each, until every target's margin is above ``min_margin`` or ``max_layers`` are closed.

Closing a layer's state sets its gates to 0 (the "state off" ablation of ``rfkit eval context``,
made permanent): its replaced heads keep the trained window and nothing else. The cache keeps its
shape. The audit asks ``2 + (layers with a state)`` forwards per prompt, then one per prompt per
closed layer.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from rfkit.errors import RFKitError
from rfkit.models.mixer import ablatable_mixers, ablate_states
from rfkit.models.modeling import decoder_layers


@dataclass
class StateAuditConfig:
    """What the audit asks (module docstring).

    Args:
        shape: A one-key needle shape (:mod:`rfkit.data.needle_prompts`) whose filler is running text
            (``plays``, ``prose``): its sentences come from ``split``.
        lengths: Prompt lengths in tokens.
        depths: Where the key sits in the filler (1: the sentence before the question).
        trials: Prompts per length and depth.
        seed: Draws the prompts' keys and starting sentences.
        split: The filler's split the prompts read (``train`` or ``calibration``; never the
            ``validation`` split that ``rfkit eval needles`` reads).
        max_layers: Most states closed.
        min_margin: The margin a quote must exceed (0: the greedy answer starts with the key;
            0.5, the default: the key's first token at least 1.6 times as likely as any other, a
            quote that the change from these prompts to others does not flip).
    """

    shape: str = "plays"
    lengths: list[int] = field(default_factory=lambda: [2048, 4096])
    depths: list[float] = field(default_factory=lambda: [1.0])
    trials: int = 4
    seed: int = 0
    split: str = "train"
    max_layers: int = 3
    min_margin: float = 0.5

    def __post_init__(self):
        from rfkit.data.needle_prompts import SHAPES

        running = [name for name, s in SHAPES.items() if s.needles == 1 and s.filler is not None]
        if self.shape not in running:
            raise RFKitError(f"state_audit.shape: allowed: {', '.join(running)} (one key in running text); got {self.shape!r}")
        if self.split not in ("train", "calibration"):
            raise RFKitError(f"state_audit.split: allowed: train, calibration (rfkit eval needles reads validation); got {self.split!r}")
        if not self.lengths or any(int(n) < 64 for n in self.lengths):
            raise RFKitError(f"state_audit.lengths: give prompt lengths of at least 64 tokens; got {self.lengths!r}")
        if not self.depths or any(not 0.0 <= float(d) <= 1.0 for d in self.depths):
            raise RFKitError(f"state_audit.depths: give depths between 0 and 1; got {self.depths!r}")
        if isinstance(self.min_margin, bool) or not isinstance(self.min_margin, (int, float)) or not math.isfinite(self.min_margin):
            raise RFKitError(f"state_audit.min_margin: must be a finite number, got {self.min_margin!r}")
        for name in ("trials", "max_layers"):
            if int(getattr(self, name)) < 1:
                raise RFKitError(f"state_audit.{name}: must be an integer >= 1, got {getattr(self, name)!r}")


def key_token(tokenizer, text: str, key: int) -> int:
    """The first token the model must produce after ``text`` to answer ``key`` (the key's
    leading space merged as the tokenizer merges it)."""
    full = tokenizer(text + f" {key}")["input_ids"]
    prompt = tokenizer(text)["input_ids"]
    if full[: len(prompt)] != prompt:
        raise RFKitError("the prompt's tokens change when the key follows it; cannot name the answer's first token")
    return full[len(prompt)]


def prompt_pairs(tokenizer, records: list[dict]) -> list[tuple[torch.Tensor, int]]:
    """``(ids (1, L), key's first token)`` for each needle record, tokenized as ``rfkit eval
    needles`` tokenizes it."""
    return [(tokenizer(r["text"], return_tensors="pt").input_ids, key_token(tokenizer, r["text"], r["key"])) for r in records]


@torch.no_grad()
def margins(model: nn.Module, prompts: list[tuple[torch.Tensor, int]]) -> list[dict]:
    """Per prompt: ``{"margin", "top"}``, the key token's log-probability minus the best other
    token's at the answering position, and the best token's id."""
    device = next(model.parameters()).device
    out = []
    for ids, key in prompts:
        logp = model(input_ids=ids.to(device), use_cache=False).logits[0, -1].float().log_softmax(-1)
        other = logp.clone()
        other[key] = float("-inf")
        out.append({"margin": round(float(logp[key] - other.max()), 4), "top": int(logp.argmax())})
    return out


def stateful_layers(model: nn.Module) -> dict[int, list[nn.Module]]:
    """Decoder layer index -> the mixers in it that can switch their state off."""
    mixers = {id(m) for m in ablatable_mixers(model)}
    found: dict[int, list[nn.Module]] = {}
    for i, layer in enumerate(decoder_layers(model)):
        here = [m for m in layer.modules() if id(m) in mixers]
        if here:
            found[i] = here
    return found


@contextlib.contextmanager
def states_off(mixers):
    """Within the block, the listed mixers (one layer's, from :func:`stateful_layers`) run
    without their states; exactly as before after it."""
    with contextlib.ExitStack() as stack:
        for mixer in mixers:
            stack.enter_context(mixer.state_ablation())
        yield


def close_states(model: nn.Module, layers) -> None:
    """Set the gates of the listed decoder layers' state mixers to 0: their window alone, for
    good (the state-off ablation made permanent)."""
    found = stateful_layers(model)
    for i in layers:
        if i not in found:
            raise RFKitError(f"state_audit: layer {i} has no state to close; layers with one: {', '.join(map(str, found))}")
        for mixer in found[i]:
            gate = getattr(mixer, "gate", None)
            if not isinstance(gate, nn.Parameter):
                raise RFKitError(f"state_audit: {type(mixer).__name__} has no gate to close")
            with torch.no_grad():
                gate.zero_()


def calibration_records(tokenizer, config: StateAuditConfig) -> list[dict]:
    """The audit's needle prompts (records as :func:`rfkit.data.needle_prompts.prompts` makes
    them); a length too short for the template is one line naming ``state_audit.lengths``."""
    from rfkit.data import needle_prompts as needles

    shape = needles.SHAPES[config.shape]
    records = []
    for length in config.lengths:  # length by length, in the order prompts() would give them
        try:
            records += needles.prompts(
                tokenizer, [shape], [int(length)], [float(d) for d in config.depths], int(config.trials),
                int(config.seed), split=config.split,
            )  # fmt: skip
        except needles.PromptError:
            raise RFKitError(
                f"state_audit.lengths: {length} tokens cannot hold the {shape.name} prompt and its "
                f"{shape.new_tokens}-token answer with this tokenizer; give longer lengths"
            ) from None
    return records


def choose(effect: dict[int, float], now: list[float], max_layers: int, close_and_measure, min_margin: float = 0.0) -> tuple[list[dict], list[float]]:
    """The greedy closing (module docstring, step 3). ``effect``: each layer's mean change of the
    targets' margins when its state alone is off; ``now``: the targets' margins with every state
    on; ``close_and_measure(layer)`` closes that layer's state and returns the targets' margins.
    Returns the steps taken (``{"layer", "effect", "target_margins"}`` each) and the margins at
    the end. Stops when every target is quoted (margin above ``min_margin``), when no layer with a positive
    effect is left, or after ``max_layers`` closings."""
    candidates = sorted((layer for layer, e in effect.items() if e > 0), key=lambda layer: (-effect[layer], layer))
    steps: list[dict] = []
    for layer in candidates[:max_layers]:
        if all(m > min_margin for m in now):
            break
        now = close_and_measure(layer)
        steps.append({"layer": layer, "effect": round(effect[layer], 4), "target_margins": now})
    return steps, now


def audit(
    model: nn.Module, tokenizer, config: StateAuditConfig, close: bool = True, progress: bool = True,
    records: list[dict] | None = None,
) -> dict:
    """Measure (module docstring) and, with ``close``, close the chosen layers' states in
    ``model``. Returns the report: the prompts, the margins with every state on and off, each
    layer's change, the layers closed in order with the targets' margins after each, and whether
    every target is quoted at the end. ``records``: :func:`calibration_records` already written
    for ``config`` (None: written here)."""
    layers = stateful_layers(model)
    if not layers:
        raise RFKitError("state_audit: the model has no mixer with a state to close (the hybrid operators have one)")
    if records is None:
        records = calibration_records(tokenizer, config)
    prompts = prompt_pairs(tokenizer, records)
    was_training = model.training
    saved = {layer: [m.gate.detach().clone() for m in mixers] for layer, mixers in layers.items() if all(hasattr(m, "gate") for m in mixers)}
    model.eval()
    try:
        on = [m["margin"] for m in margins(model, prompts)]
        with ablate_states(model):
            off = [m["margin"] for m in margins(model, prompts)]
        floor = float(config.min_margin)
        targets = [i for i, m in enumerate(off) if m > floor]
        changes = {}
        for layer, mixers in tqdm(layers.items(), desc="state audit", unit="layer", disable=not progress):
            with states_off(mixers):
                got = margins(model, [prompts[i] for i in targets]) if targets else []
            changes[layer] = [round(g["margin"] - on[i], 4) for g, i in zip(got, targets)]
        effect = {layer: (sum(c) / len(c) if c else 0.0) for layer, c in changes.items()}

        def close_and_measure(layer: int) -> list[float]:
            close_states(model, [layer])
            return [m["margin"] for m in margins(model, [prompts[i] for i in targets])]

        steps, now = choose(effect, [on[i] for i in targets], config.max_layers, close_and_measure, floor)
    finally:
        if not close:  # measured only (or stopped by an error): every gate as it was
            with torch.no_grad():
                for layer, gates in saved.items():
                    for mixer, gate in zip(layers[layer], gates):
                        mixer.gate.copy_(gate)
        model.train(was_training)
    return {
        "config": asdict(config),
        "prompts": [{"length": r["length"], "depth": r["depth"], "trial": r["trial"], "key": r["key"]} for r in records],
        "every_state_on": on,
        "every_state_off": off,
        "targets": targets,
        "layer_changes": {str(k): v for k, v in changes.items()},
        "closed": [s["layer"] for s in steps],
        "steps": steps,
        "all_targets_quoted": all(m > floor for m in now),
        "applied": bool(close),
    }

