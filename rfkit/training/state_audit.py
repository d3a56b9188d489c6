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
2. for each prompt, the key's *margin*: with the key's tokens following the prompt (teacher
   forced), at each of them the log-probability of the key's token minus the best other token's,
   and the smallest of these (above 0: the greedy answer is the whole key), with every state on,
   every state off and each layer's state alone off;
3. the *targets* are the prompts the window alone quotes (every state off: margin above
   ``min_margin``, 0.5 by default). Close the layers whose state lowers the targets' margins most,
   one at a time (a layer's effect is its mean change over the targets when its state alone is
   off; only layers with a positive effect are candidates), measuring the targets again after
   each, until every target's margin is above ``min_margin`` or ``max_layers`` are closed;
4. *guards* keep what the states hold: prompts of other shapes (``guards``: by default the
   20-digit key of the ``long`` shape at depths 0 and 0.5, far outside the window) that the model
   quotes with every state on. A closing that leaves a guard's margin at or below
   ``min(min_margin, its margin before / 2)`` is undone and the next candidate tried (at most
   ``2 * max_layers`` tries): a state that carries a far key is not closed to quote a near one;
5. with ``heads`` (the default), a layer whose closing a guard refused is tried head by head: each
   open head's effect on the targets alone, then the heads with a positive effect closed one at a
   time, strongest first, each kept when no guard falls (one head of a layer may carry the far
   key while another turns the near one away). A layer with any head closed counts as one of the
   ``max_layers``.

Closing a layer's state sets its gates to 0 (the "state off" ablation of ``rfkit eval context``,
made permanent): its replaced heads keep the trained window and nothing else. The cache keeps its
shape. The audit asks ``2 + (layers with a state)`` forwards per target prompt and one per guard,
then, per closing tried, one per guard until a guard falls (the guards with the smallest margins
first) and, when none falls, one per target (in a refused layer, one per target per open head
too). A forward after a change in layer L replays the layers below L from the prompt's last
forward with the gates as they stand (:class:`Measure`; the same numbers, about half the work).
The logits are computed in float32 (:func:`float32_logits`).
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
from rfkit.training.key_margins import Measure, answer_tokens, float32_logits, margins, prompt_pairs

__all__ = [  # the margins and prompts live in rfkit.training.key_margins; named here too
    "Measure", "StateAuditConfig", "answer_tokens", "audit", "calibration_records", "choose", "close_states", "closing",
    "float32_logits", "gate_slots", "guard_floor", "margins", "is_hybrid", "prompt_pairs", "read_sharper", "require_gated", "require_hybrid", "stateful_layers", "states_off",
    "try_closing", "try_heads", "zero_heads",
]


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
        min_margin: The margin a quote must exceed (0: the greedy answer is the key; 0.5, the
            default: each of the key's tokens at least 1.6 times as likely as any other, a quote
            that the change from these prompts to others does not flip).
        guards: One-key shapes whose prompts guard what the states hold (module docstring, step
            4); their running text reads ``split`` too; ``passkey`` is not allowed (its keys are
            the evaluation's). Empty: no guard.
        guard_depths: Where the guards' keys sit (0: the start of the filler).
        heads: When a guard refuses a layer's closing, try that layer's heads one by one (module
            docstring, step 5).
    """

    shape: str = "plays"
    lengths: list[int] = field(default_factory=lambda: [2048, 4096])
    depths: list[float] = field(default_factory=lambda: [1.0])
    trials: int = 4
    seed: int = 0
    split: str = "train"
    max_layers: int = 3
    min_margin: float = 0.5
    guards: list[str] = field(default_factory=lambda: ["long"])
    guard_depths: list[float] = field(default_factory=lambda: [0.0, 0.5])
    heads: bool = True

    def __post_init__(self):
        from rfkit.data.needle_prompts import SHAPES

        running = [name for name, s in SHAPES.items() if s.needles == 1 and s.filler is not None]
        if self.shape not in running:
            raise RFKitError(f"state_audit.shape: allowed: {', '.join(running)} (one key in running text); got {self.shape!r}")
        guarding = [name for name, s in SHAPES.items() if s.needles == 1 and name != "passkey"]
        if isinstance(self.guards, str) or any(g not in guarding for g in self.guards):
            raise RFKitError(f"state_audit.guards: a list of: {', '.join(guarding)} (one key; passkey's keys are the evaluation's), or []; got {self.guards!r}")
        if (self.guards and not self.guard_depths) or any(not 0.0 <= float(d) <= 1.0 for d in self.guard_depths):
            raise RFKitError(f"state_audit.guard_depths: give depths between 0 and 1; got {self.guard_depths!r}")
        if self.split not in ("train", "calibration"):
            raise RFKitError(f"state_audit.split: allowed: train, calibration (rfkit eval needles reads validation); got {self.split!r}")
        if not self.lengths or any(int(n) < 64 for n in self.lengths):
            raise RFKitError(f"state_audit.lengths: give prompt lengths of at least 64 tokens; got {self.lengths!r}")
        if not self.depths or any(not 0.0 <= float(d) <= 1.0 for d in self.depths):
            raise RFKitError(f"state_audit.depths: give depths between 0 and 1; got {self.depths!r}")
        if isinstance(self.min_margin, bool) or not isinstance(self.min_margin, (int, float)) or not math.isfinite(self.min_margin):
            raise RFKitError(f"state_audit.min_margin: must be a finite number, got {self.min_margin!r}")
        if not isinstance(self.heads, bool):
            raise RFKitError(f"state_audit.heads: true or false, got {self.heads!r}")
        for name in ("trials", "max_layers"):
            if int(getattr(self, name)) < 1:
                raise RFKitError(f"state_audit.{name}: must be an integer >= 1, got {getattr(self, name)!r}")


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


def gate_slots(mixers) -> list[tuple[nn.Module, int]]:
    """One layer's heads with a state, in order: ``(mixer, index into its gate)``; a head's number
    in the report is its place in this list (the layer's query heads the mixers replace)."""
    return [(mixer, h) for mixer in mixers for h in range(mixer.gate.numel())]


def closing(model: nn.Module, layers, heads: dict | None = None, field: str = "state_audit") -> list[tuple[list[nn.Module], list[int] | None]]:
    """What :func:`close_states` would close, checked and nothing changed: one ``(mixers, heads)``
    per listed decoder layer (``heads`` None: all of them). Raises RFKitError naming ``field`` for
    a layer without a state or a gate, or a head number that layer does not have."""
    found = stateful_layers(model)
    heads = {int(k): v for k, v in (heads or {}).items()}
    chosen = []
    for i in layers:
        if i not in found:
            raise RFKitError(f"{field}: layer {i} has no state to close; layers with one: {', '.join(map(str, found)) or 'none'}")
        for mixer in found[i]:
            gate = getattr(mixer, "gate", None)
            if not isinstance(gate, nn.Parameter):
                raise RFKitError(f"{field}: {type(mixer).__name__} has no gate to close")
        slots = gate_slots(found[i])
        picked = heads.get(i)
        if picked is not None and any(not 0 <= h < len(slots) for h in picked):
            raise RFKitError(f"{field}: layer {i} has {len(slots)} heads with a state (0 to {len(slots) - 1}); got heads {list(picked)}")
        chosen.append((found[i], picked))
    return chosen


def close_states(model: nn.Module, layers, heads: dict | None = None, field: str = "state_audit") -> None:
    """Set the gates of the listed decoder layers' state mixers to 0: their window alone, for
    good (the state-off ablation made permanent). ``heads``: layer -> the heads
    (:func:`gate_slots`' numbers) to close there instead of all. Every layer is checked
    (:func:`closing`) before any gate changes."""
    for mixers, picked in closing(model, layers, heads, field):
        zero_heads(mixers, picked)


HYBRID = "rfkit.operators.HybridOperator"
GATED = (HYBRID, "rfkit.operators.HybridMambaOperator")  # the operators whose blocks have a state gate


def is_hybrid(path) -> bool:
    """Whether ``path`` (an operator's class path, as a recipe or a saved record names it) is
    :class:`rfkit.operators.HybridOperator`, the one operator whose blocks have a sharpness."""
    from rfkit.classpath import public_path

    return isinstance(path, str) and public_path(path) == HYBRID


def require_gated(path, field: str) -> None:
    """Raise RFKitError naming ``field`` unless ``path`` (an operator's class path) is one of
    :data:`GATED`, whose blocks have a state gate to close."""
    from rfkit.classpath import public_path

    if not isinstance(path, str) or public_path(path) not in GATED:
        raise RFKitError(f"{field}: only {' and '.join(GATED)} have a state gate to close; model.operator is {path} (use [])")


def require_hybrid(path, field: str = "read sharpness") -> None:
    """Raise RFKitError naming ``field`` unless :func:`is_hybrid` ``(path)``."""
    if not is_hybrid(path):
        raise RFKitError(f"{field}: only {HYBRID} reads its state with a sharpness; model.operator is {path} (use 1)")


def read_sharper(model: nn.Module, sharpness: float) -> int:
    """Read every hybrid block of a converted model at ``sharpness`` (``tau`` in the state's
    weight ``g e^{-tau m}``, :mod:`rfkit.models.hybrid`) and write it into the model's operator
    record (``config.rf_operator``), so a save and every later load read it too; returns the
    number of blocks. Nothing trains: the window, state and gates keep their weights. Raises
    RFKitError unless the operator is the hybrid (:func:`require_hybrid`) or for a value below 1."""
    from rfkit.models.hybrid import HybridWindowAttention
    from rfkit.models.operators import HybridOperator

    record = getattr(model.config, "rf_operator", None) or {}
    require_hybrid(record.get("class_path"))
    operator = HybridOperator(**{**record.get("init_args", {}), "sharpness": sharpness})
    blocks = [m for m in model.modules() if isinstance(m, HybridWindowAttention)]
    for block in blocks:
        block.sharpness = operator.sharpness
    model.config.rf_operator = operator.to_dict()
    return len(blocks)


def zero_heads(mixers, heads: list[int] | None = None) -> None:
    """Set the gate of each listed head (:func:`gate_slots`' numbers; None: every head) to 0."""
    slots = gate_slots(mixers)
    with torch.no_grad():
        for h in range(len(slots)) if heads is None else heads:
            mixer, at = slots[h]
            mixer.gate[at] = 0.0


def calibration_records(tokenizer, config: StateAuditConfig) -> list[dict]:
    """The audit's needle prompts (records as :func:`rfkit.data.needle_prompts.prompts` makes
    them): the targets' shape, then each guard shape (``"guard": True``); a length too short for a
    template is one line naming ``state_audit.lengths``."""
    from rfkit.data import needle_prompts as needles

    asked = [(config.shape, config.depths, False)] + [(g, config.guard_depths, True) for g in config.guards]
    records = []
    for name, depths, guard in asked:
        shape = needles.SHAPES[name]
        for length in config.lengths:  # length by length, in the order prompts() would give them
            try:
                made = needles.prompts(
                    tokenizer, [shape], [int(length)], [float(d) for d in depths], int(config.trials),
                    int(config.seed), split=config.split,
                )  # fmt: skip
            except needles.PromptError:
                raise RFKitError(
                    f"state_audit.lengths: {length} tokens cannot hold the {shape.name} prompt and its "
                    f"{shape.new_tokens}-token answer with this tokenizer; give longer lengths"
                ) from None
            records += [{**r, "guard": guard} for r in made]
    return records


def guard_floor(before: float, min_margin: float) -> float:
    """The margin a guard must keep after a closing: ``min(min_margin, before / 2)`` (module
    docstring, step 4)."""
    return min(min_margin, before / 2)


def try_closing(
    measure: Measure, layer: int, mixers, targets: list[int], guards: list[int], before: list[float], min_margin: float,
    heads: list[int] | None = None,
) -> dict:
    """Close one layer's state (decoder layer ``layer``'s ``mixers``, from
    :func:`stateful_layers`; ``heads``: only those of :func:`gate_slots`) and measure the guards,
    the one with the smallest margin ``before`` first; at the first whose margin falls to
    :func:`guard_floor` or below, give the gates back and stop (the rest are not measured: None).
    Kept: the targets measured too (indices into the prompts). ``{"kept", "target_margins"
    (None when refused), "guard_margins" (in ``guards``' order), "guards_lost"}``."""
    gates = [m.gate.detach().clone() for m in mixers]
    zero_heads(mixers, heads)
    guarded: dict[int, float] = {}
    lost = []
    for i in sorted(guards, key=lambda i: (before[i], i)):
        [guarded[i]] = measure([i], start=layer, record=True)
        if guarded[i] <= guard_floor(before[i], min_margin):  # a state that carries a far key stays open
            lost.append(i)
            break
    aimed = None
    if lost:
        measure.discard()
        with torch.no_grad():
            for mixer, gate in zip(mixers, gates):
                mixer.gate.copy_(gate)
    else:
        aimed = measure(targets, start=layer, record=True)
        measure.commit()
    return {"kept": not lost, "target_margins": aimed, "guard_margins": [guarded.get(i) for i in guards], "guards_lost": lost}


def try_heads(
    measure: Measure, layer: int, mixers, targets: list[int], guards: list[int], before: list[float], min_margin: float,
    now: list[float] | None = None,
) -> dict:
    """A layer whose whole closing a guard refused, head by head (module docstring, step 5): each
    open head's effect on the targets (its gate alone at 0), then each head with a positive effect
    closed in turn, strongest first, kept when no guard falls. ``now``: the targets' margins as
    the gates stand (measured when None). ``{"kept", "heads" (closed), "head_effects",
    "target_margins", "guard_margins", "guards_lost"}`` (after the last kept head; when none is
    kept, the last refused try's: no target margins, the guards measured until one fell)."""
    slots = gate_slots(mixers)
    if now is None:
        now = measure(targets, start=layer)
    effects = {}
    for h, (mixer, at) in enumerate(slots):
        if float(mixer.gate.detach()[at]) <= 0:  # already closed (clamped at 0 in the operator)
            continue
        saved = mixer.gate.detach().clone()
        zero_heads(mixers, [h])
        got = measure(targets, start=layer)
        with torch.no_grad():
            mixer.gate.copy_(saved)
        effects[h] = round(sum(g - n for g, n in zip(got, now)) / len(now), 4) if now else 0.0
    closed, last = [], {"target_margins": now, "guard_margins": [], "guards_lost": []}
    for h in sorted((h for h, e in effects.items() if e > 0), key=lambda h: (-effects[h], h)):
        step = try_closing(measure, layer, mixers, targets, guards, before, min_margin, [h])
        if step["kept"]:
            closed.append(h)
        if step["kept"] or not closed:
            last = step
    return {"kept": bool(closed), "heads": closed, "head_effects": {str(h): e for h, e in effects.items()}, **{k: last[k] for k in ("target_margins", "guard_margins", "guards_lost")}}


def choose(
    effect: dict[int, float], now: list[float], max_layers: int, try_close, min_margin: float = 0.0, max_tries: int | None = None,
) -> tuple[list[dict], list[float]]:
    """The greedy closing (module docstring, steps 3 and 4). ``effect``: each layer's mean change
    of the targets' margins when its state alone is off; ``now``: the targets' margins with every
    state on; ``try_close(layer)`` closes that layer's state and returns ``{"kept", "target_margins",
    ...}`` (``kept`` False: a guard fell, the closing undone). Returns every step tried
    (``{"layer", "effect", **try_close's}``) and the targets' margins at the end. Stops when every
    target is quoted (margin above ``min_margin``), when no layer with a positive effect is left,
    after ``max_layers`` kept closings or ``max_tries`` tries (``2 * max_layers`` by default)."""
    candidates = sorted((layer for layer, e in effect.items() if e > 0), key=lambda layer: (-effect[layer], layer))
    steps: list[dict] = []
    kept = 0
    for layer in candidates[: 2 * max_layers if max_tries is None else max_tries]:
        if kept >= max_layers or all(m > min_margin for m in now):
            break
        step = try_close(layer)
        steps.append({"layer": layer, "effect": round(effect[layer], 4), **step})
        if step["kept"]:
            now, kept = step["target_margins"], kept + 1
    return steps, now


def audit(
    model: nn.Module, tokenizer, config: StateAuditConfig, close: bool = True, progress: bool = True,
    records: list[dict] | None = None, replay: bool = True,
) -> dict:
    """Measure (module docstring) and, with ``close``, close the chosen layers' states in
    ``model``. Returns the report: the prompts, each state's gates before the audit (layer -> one
    value per :func:`gate_slots` head: what ``benchmarks/state_audit.py --gates-from`` reopens),
    the margins with every state on and (targets' shape) off, each layer's change, every closing tried in order with the margins after it and whether it
    was kept, the layers closed, and whether every target is quoted at the end. ``records``:
    :func:`calibration_records` already written for ``config`` (None: written here). ``replay``:
    replay the layers a forward does not change (:class:`Measure`; False: every forward whole, the
    same report)."""
    layers = stateful_layers(model)
    if not layers:
        raise RFKitError("state_audit: the model has no mixer with a state to close (the hybrid operators have one)")
    gateless = sorted({type(m).__name__ for mixers in layers.values() for m in mixers if not isinstance(getattr(m, "gate", None), nn.Parameter)})
    if gateless:
        raise RFKitError(f"state_audit: {', '.join(gateless)} has no gate to close")
    if records is None:
        records = calibration_records(tokenizer, config)
    prompts = prompt_pairs(tokenizer, records)
    aimed = [i for i, r in enumerate(records) if not r.get("guard")]
    was_training = model.training
    saved = {layer: [m.gate.detach().clone() for m in mixers] for layer, mixers in layers.items()}
    gates_before = {str(layer): [float(m.gate.detach()[at]) for m, at in gate_slots(mixers)] for layer, mixers in layers.items()}
    model.eval()
    measure = Measure(model, prompts, replay)
    try:
        on = measure(range(len(prompts)), record=True)
        measure.commit()
        with ablate_states(model):
            off_aimed = measure(aimed)
        off = [None] * len(records)
        for i, m in zip(aimed, off_aimed):
            off[i] = m
        floor = float(config.min_margin)
        targets = [i for i in aimed if off[i] > floor]
        guards = [i for i, r in enumerate(records) if r.get("guard") and on[i] > 0]
        measure.forget(targets + guards)  # the other prompts are not asked again
        changes = {}
        for layer, mixers in tqdm(layers.items(), desc="state audit", unit="layer", disable=not progress):
            with states_off(mixers):
                got = measure(targets, start=layer)
            changes[layer] = [round(g - on[i], 4) for g, i in zip(got, targets)]
        effect = {layer: (sum(c) / len(c) if c else 0.0) for layer, c in changes.items()}

        bar = tqdm(total=2 * config.max_layers, desc="state audit: closings", unit="try", disable=not progress)
        now = [on[i] for i in targets]  # the targets' margins as the gates stand

        def try_close(layer: int) -> dict:
            nonlocal now
            bar.set_postfix_str(f"layer {layer}")
            whole = try_closing(measure, layer, layers[layer], targets, guards, on, floor)
            if whole["kept"] or not config.heads:
                step = {**whole, "heads": None}
            else:
                bar.set_postfix_str(f"layer {layer}: a guard refused it; head by head")
                step = {**try_heads(measure, layer, layers[layer], targets, guards, on, floor, now), "whole_layer": whole}
            if step["kept"]:
                now = step["target_margins"]
            bar.update(1)
            return step

        with bar:
            steps, now = choose(effect, now, config.max_layers, try_close, floor)
    finally:
        if not close:  # measured only (or stopped by an error): every gate as it was
            with torch.no_grad():
                for layer, gates in saved.items():
                    for mixer, gate in zip(layers[layer], gates):
                        mixer.gate.copy_(gate)
        model.train(was_training)
    return {
        "config": asdict(config),
        "prompts": [
            {"shape": r["shape"], "length": r["length"], "depth": r["depth"], "trial": r["trial"], "key": r["key"], "guard": bool(r.get("guard"))}
            for r in records
        ],
        "gates_before": gates_before,
        "every_state_on": on,
        "every_state_off": off,
        "targets": targets,
        "guards": guards,
        "layer_changes": {str(k): v for k, v in changes.items()},
        "closed": [s["layer"] for s in steps if s["kept"]],
        "closed_heads": {str(s["layer"]): s["heads"] for s in steps if s["kept"] and s["heads"] is not None},
        "refused": [s["layer"] for s in steps if not s["kept"] or s["heads"] is not None],
        "steps": steps,
        "all_targets_quoted": all(m > floor for m in now),
        "applied": bool(close),
    }
