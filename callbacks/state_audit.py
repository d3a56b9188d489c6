"""The state audit at the end of ``rfkit fit`` (the recipe's ``state_audit`` section): close the
hybrid states that turn a quote away (:mod:`rfkit.training.state_audit`).

It runs when training ends, before the converted model's perplexity is measured and before the
model is saved, so the summary's perplexity, the saved weights and every later evaluation are the
audited model's. Off unless ``max_layers`` is set (0 by default). One process only: a sharded
(FSDP) run is refused before anything loads.

``read_sharpness`` (1 by default: off) is the other remedy for a state that talks over the
window: when training ends, every hybrid block is set to read its state at that sharpness
(``tau`` in ``g e^{-tau m}``, :mod:`rfkit.models.hybrid`), trained at the operator's own (1 by
default), and the saved model's operator record says so. Training at the higher value lets the
gates grow back to it; reading sharper than trained is what brings the near quotes back
(docs/comparing.md, "Reading sharper than trained"). With both on, the sharpness is set first and
the audit measures the model as it will be read.

``close_layers`` and ``close_heads`` close states chosen beforehand, measuring nothing: an audit's
report names what it closed (``closed`` and ``closed_heads`` in ``summary.json``), and a recipe
that copies them closes the same states after a training like the one audited, without the audit's
forwards. They are applied when training ends, after ``read_sharpness`` and before the audit (which,
when on too, measures the model with them closed and adds its own).
"""

from __future__ import annotations

import lightning as L

from rfkit.errors import RFKitError


class StateAudit(L.Callback):
    """Close up to ``max_layers`` layers' states that lower the window's quotes (off at 0).

    Args:
        max_layers: Most layers whose states are closed (0: no audit).
        shape: Needle shape of the calibration prompts (``plays`` or ``prose``).
        lengths: Their lengths in tokens.
        depths: Where their key sits (1: the sentence before the question).
        trials: Prompts per length and depth.
        seed: Draws their keys and filler.
        split: The filler's split (``train`` or ``calibration``; never what ``rfkit eval needles`` reads).
        min_margin: The margin a quote must exceed (0: the greedy answer is the key).
        guards: Shapes whose quotes with every state on a closing must keep (``long``, ``prose``,
            ``plays``; ``[]``: none): far keys the states carry.
        guard_depths: Where the guards' keys sit.
        heads: When a guard refuses a layer's closing, try its heads one by one.
        read_sharpness: ``tau >= 1``: the saved model reads its hybrid states at this sharpness,
            set when training ends (module docstring); 1 (the default): as trained.
        close_layers: Decoder layers whose states are closed when training ends, measuring nothing
            (module docstring; an audit's ``closed``); checked against the converted model before
            training.
        close_heads: Layer -> the heads (numbered as the audit's report numbers them) closed there
            instead of all of the layer's (an audit's ``closed_heads``); every layer named must be
            in ``close_layers``.
            Defaults: the settings measured in docs/hybrid.md.
    """

    FIELDS = ("max_layers", "shape", "lengths", "depths", "trials", "seed", "split", "min_margin", "guards", "guard_depths", "heads", "read_sharpness", "close_layers", "close_heads")

    def __init__(
        self,
        max_layers: int = 0,
        shape: str = "plays",
        lengths: list[int] | None = None,
        depths: list[float] | None = None,
        trials: int = 4,
        seed: int = 0,
        split: str = "train",
        min_margin: float = 0.5,
        guards: list[str] | None = None,
        guard_depths: list[float] | None = None,
        heads: bool = True,
        read_sharpness: float = 1.0,
        close_layers: list[int] | None = None,
        close_heads: dict[int, list[int]] | None = None,
    ):
        from rfkit.validate import in_range

        if isinstance(max_layers, bool) or not isinstance(max_layers, int) or max_layers < 0:
            raise RFKitError(f"state_audit.max_layers: must be an integer >= 0 (0: no audit), got {max_layers!r}")
        self.max_layers = max_layers
        self.read_sharpness = float(in_range("state_audit.read_sharpness", read_sharpness, 1, finite=True))
        self.close_layers, self.close_heads = fixed_closing(close_layers, close_heads)
        self.settings = None
        self._records = None  # the calibration prompts, written in setup
        if max_layers:
            from rfkit.training.state_audit import StateAuditConfig

            self.settings = StateAuditConfig(
                shape=shape, lengths=list([2048, 4096] if lengths is None else lengths),
                depths=list([1.0] if depths is None else depths), trials=trials,
                seed=seed, split=split, max_layers=max_layers, min_margin=min_margin,
                guards=list(["long"] if guards is None else guards),
                guard_depths=list([0.0, 0.5] if guard_depths is None else guard_depths), heads=heads,
            )  # fmt: skip

    def on_fit_start(self, trainer, pl_module) -> None:
        if self.settings is not None and trainer.world_size > 1:
            raise RFKitError(f"state_audit.max_layers: the audit runs in one process; this run has {trainer.world_size} (use 0)")

    def setup(self, trainer, pl_module, stage: str) -> None:
        """Write the calibration prompts before anything trains (the data module's tokenizer is set
        up by now, the model not yet converted), kept for the audit at the end: lengths that cannot
        hold the template fail here, not after training."""
        if self.settings is None or stage != "fit":
            return
        tokenizer = getattr(trainer.datamodule, "tokenizer", None)
        if tokenizer is None:
            raise RFKitError("state_audit: the data module has no tokenizer to write the calibration prompts with")
        from rfkit.training.state_audit import calibration_records

        self._records = calibration_records(tokenizer, self.settings)

    def on_train_start(self, trainer, pl_module) -> None:
        """Refuse a model without a state to close (or to read sharper) before training, not after it."""
        if self.close_layers:  # no head map (nothing replaced): closing() names the field, no layer has a state
            from rfkit.training.state_audit import closing

            closing(pl_module.model, self.close_layers, self.close_heads, "state_audit.close_layers")
        if pl_module.head_map is None:
            return
        if self.read_sharpness != 1.0:
            from rfkit.training.state_audit import require_hybrid

            require_hybrid((getattr(pl_module.model.config, "rf_operator", None) or {}).get("class_path"), "state_audit.read_sharpness")
        if self.settings is None:
            return
        from rfkit.training.state_audit import stateful_layers

        layers = stateful_layers(pl_module.model)
        if not layers:
            raise RFKitError("state_audit.max_layers: the converted model has no state to close (the hybrid operators have one); use 0")
        gateless = {type(m).__name__ for mixers in layers.values() for m in mixers if not hasattr(m, "gate")}
        if gateless:
            raise RFKitError(f"state_audit.max_layers: {', '.join(sorted(gateless))} has no gate to close; use 0")

    def on_train_end(self, trainer, pl_module) -> None:
        if pl_module.head_map is None:
            return
        if self.read_sharpness != 1.0:
            from rfkit.training.state_audit import read_sharper

            trained = float(((pl_module.model.config.rf_operator or {}).get("init_args") or {}).get("sharpness", 1.0))
            blocks = read_sharper(pl_module.model, self.read_sharpness)
            pl_module.run_metrics["read_sharpness"] = {"trained": trained, "read": self.read_sharpness, "blocks": blocks}
            print(f"read sharpness: the {blocks} hybrid blocks, trained at sharpness {trained:g}, are read and saved at {self.read_sharpness:g}")
        if self.close_layers:
            from rfkit.conversion.model_card import describe_closed
            from rfkit.training.state_audit import close_states

            close_states(pl_module.model, self.close_layers, self.close_heads, "state_audit.close_layers")
            fixed = {"closed": list(self.close_layers), "closed_heads": {str(k): list(v) for k, v in self.close_heads.items()}}
            pl_module.run_metrics["closed_states"] = fixed
            print(f"closed states: layers {describe_closed(fixed)} (state_audit.close_layers, chosen before training; nothing measured)")
        if self.settings is None:
            return
        from rfkit.conversion.model_card import describe_closed
        from rfkit.training.state_audit import audit
        from rfkit.training.progress import phase

        tokenizer = trainer.datamodule.tokenizer
        with phase(pl_module, "audit", "the states"):
            report = audit(pl_module.model, tokenizer, self.settings, records=self._records)
        pl_module.run_metrics["state_audit"] = report
        closed = describe_closed(report)
        quoted = "every" if report["all_targets_quoted"] else "not every"
        print(f"state audit: closed the states of layers {closed}; {quoted} calibration key the window alone quotes is quoted")


def fixed_closing(layers, heads, names=("state_audit.close_layers", "state_audit.close_heads")) -> tuple[list[int], dict[int, list[int]]]:
    """``close_layers`` and ``close_heads`` checked (types and shape only; the model checks the
    numbers): raises RFKitError naming the field (``names``: what the two are called where they
    were given, e.g. a script's options)."""
    layers_name, heads_name = names

    def integers(value) -> bool:
        return isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)

    layers = [] if layers is None else layers
    if not integers(layers) or len(set(layers)) != len(layers):
        raise RFKitError(f"{layers_name}: a list of distinct decoder layer numbers (integers >= 0), got {layers!r}")
    heads = {} if heads is None else heads
    if not isinstance(heads, dict):
        raise RFKitError(f"{heads_name}: layer -> a list of head numbers (e.g. {{5: [0, 3]}}), got {heads!r}")
    checked = {}
    for layer, picked in heads.items():
        try:
            number = int(layer)
        except (TypeError, ValueError):
            number = None
        if number is None or number not in layers:
            raise RFKitError(f"{heads_name}: layer {layer!r} is not in {layers_name} {list(layers)}; name each layer there too")
        if not integers(picked) or not picked or len(set(picked)) != len(picked):
            raise RFKitError(f"{heads_name}: layer {number}: a non-empty list of distinct head numbers (integers >= 0), got {picked!r}")
        checked[number] = list(picked)
    return list(layers), checked
