"""The LightningCLI behind ``rfkit fit | validate | test | profile | convert``.

:func:`make_cli` builds it (the commands above, and ``bench`` / ``eval`` / ``sweep`` when they read a
recipe); :func:`run` is the entry the command table (:mod:`rfkit.cli`) calls.

This is the one module that overrides Lightning's private API, so that a Lightning release that
changes it breaks here and in ``tests/cli/test_lightning_api.py``, nowhere else:

* ``Trainer._run(model, ckpt_path, weights_only)``: read a checkpoint's rfkit entry before any hook
  writes to the run directory (``weights_only`` exists from Lightning 2.6).
* ``LightningCLI._instantiate_trainer(config, callbacks)``: rfkit's checkpointing defaults.
* ``LightningCLI._parser(subcommand)``: the parser that dumps the resolved config.
* ``LightningCLI._parse_ckpt_path``: named by :mod:`rfkit.cli` to recognise an unreadable ``--ckpt_path``.
"""

from __future__ import annotations

import logging
import warnings

from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from rfkit.config.parse_errors import PARSE_ARGS, tidy_parse_error
from rfkit.errors import ParseError, one_line
from rfkit.output import quiet_lightning, verbose

log = logging.getLogger("rfkit")

#: Lightning's private methods overridden or named here, with the parameters rfkit relies on
#: (checked against the installed Lightning by tests/cli/test_lightning_api.py)
PRIVATE_API = {
    "lightning.pytorch.Trainer._run": ("self", "model", "ckpt_path", "weights_only"),
    "lightning.pytorch.cli.LightningCLI._instantiate_trainer": ("self", "config", "callbacks"),
    "lightning.pytorch.cli.LightningCLI._parser": ("self", "subcommand"),
    "lightning.pytorch.cli.LightningCLI._parse_ckpt_path": ("self",),
}


class RFArgumentParser(LightningArgumentParser):
    """Raises parse errors as one line (no usage dump); :mod:`rfkit.cli` prints it and exits 2."""

    def error(self, message, *args, **kwargs):
        raise ParseError(tidy_parse_error(message))


class RFTrainer(Trainer):
    """Lightning's Trainer plus the subcommands that convert without training; they dispatch to
    :mod:`rfkit.pipeline`, whose steps ``fit`` runs too."""

    rf_ckpt_path: str | None = None
    rf_ckpt_meta: dict | None = None

    def _run(self, model, ckpt_path=None, weights_only=None):
        # Lightning has resolved --ckpt_path ("last" -> a file) and restores the weights after
        # configure_model. The checkpoint's rfkit entry is read (weights_only) and checked
        # against the recipe here, before any hook writes to the run directory; the module then
        # rebuilds the converted architecture from it instead of profiling again.
        self.rf_ckpt_path, self.rf_ckpt_meta = None, None
        if ckpt_path is not None and hasattr(model, "check_checkpoint"):
            from rfkit.training.checkpointing import read_meta

            self.rf_ckpt_meta = model.check_checkpoint(str(ckpt_path), read_meta(ckpt_path))
            self.rf_ckpt_path = str(ckpt_path)
        return super()._run(model, ckpt_path=ckpt_path, weights_only=weights_only)

    def profile(self, model, datamodule=None, output: str = "head_map.json", report: bool = True, device: str | None = None):
        """Profile the heads on calibration data, select with the policy, write the head map.

        Args:
            output: Where to write head_map.json (the resolved config goes beside it, as config.yaml).
            report: Also write the head pictures beside it: RA-I heatmap, mean attention maps
                of high/mid/low RA-I heads, and the first-token contribution table (JSON, MD).
            device: Where the model runs: cpu, cuda or cuda:N (default: cuda when available).
        """
        from rfkit import pipeline
        from rfkit.devices import torch_device

        config_text = getattr(self, "rf_config_text", None)
        return pipeline.run_profile(model, datamodule, output, report, torch_device(device), config_text)

    def convert(self, model, datamodule=None, output: str = "converted", device: str | None = None):
        """Profile, select, replace and run the recipe's attention transfer (no end-to-end training);
        save the converted model in HF format.

        Args:
            output: Directory for the converted model (written atomically), with its model card
                (README.md) and the resolved config (config.yaml).
            device: Where profiling, conversion and transfer run: cpu, cuda or cuda:N (default:
                cuda when available).
        """
        from rfkit import pipeline
        from rfkit.devices import torch_device

        return pipeline.run_convert(self, model, datamodule, output, torch_device(device))


class RFKitCLI(LightningCLI):
    def __init__(self, *args, only_subcommand: str | None = None, **kwargs):
        """``only_subcommand``: build the parser of that subcommand alone. LightningCLI builds a
        whole parser (every class signature of the model, data, trainer and callbacks) for each
        of the five subcommands before it reads the first argument; ``rfkit fit`` needs one, and
        building the other four took 0.4 s of a bad-input run's 1.05 s on a 2-core CPU."""
        if only_subcommand is not None:
            chosen = {only_subcommand: self.subcommands()[only_subcommand]}
            self.subcommands = lambda: chosen  # LightningCLI asks self.subcommands() for the list
        super().__init__(*args, **kwargs)

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        base = dict(LightningCLI.subcommands())
        base.pop("predict", None)
        base["profile"] = {"model", "datamodule"}
        base["convert"] = {"model", "datamodule"}
        return base

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        from rfkit.callbacks import CacheMonitor, PerplexityMonitor, RunSummary, StateAudit

        # the audit first: it may close states that the final perplexity and the saved model then lack
        parser.add_lightning_class_args(StateAudit, "state_audit")
        parser.add_lightning_class_args(PerplexityMonitor, "perplexity")
        parser.add_lightning_class_args(CacheMonitor, "cache")
        parser.add_lightning_class_args(RunSummary, "summary")
        from rfkit.training.checkpointing import RunCheckpoint

        parser.add_lightning_class_args(RunCheckpoint, "checkpoint")
        from jsonargparse import lazy_instance

        from rfkit.data import TextDataModule

        # data: any TextDataModule subclass; without a class_path it is TextDataModule itself,
        # so recipes keep writing `data: {source: ..., seq_len: ...}`
        parser.set_defaults({"data": lazy_instance(TextDataModule)})
        parser.link_arguments("model.base_model", "data.init_args.tokenizer")

    def before_instantiate_classes(self) -> None:
        """Check the parsed settings (:func:`rfkit.config.preflight.preflight`) before any class is
        built, any model loads or anything is written; resolve ``model.dtype: auto``
        (:func:`rfkit.config.preflight.choose_precision`); the line saying what it chose waits for
        the classes to build (:meth:`after_instantiate_classes`), so a bad value's one line comes alone."""
        from rfkit.config.preflight import choose_precision, preflight

        config = self.config.get(str(self.subcommand), self.config) if self.subcommand else self.config
        preflight(self.subcommand, config)
        public_class_paths(config)
        self.rf_precision = choose_precision(config)  # model.dtype: auto, resolved before anything is built

    def _instantiate_trainer(self, config: dict, callbacks: list):
        """rfkit's checkpointing: the ``checkpoint`` section (:class:`RunCheckpoint`) writes
        ``<default_root_dir>/checkpoints/last.ckpt`` unless checkpointing is off or the recipe
        lists its own ``ModelCheckpoint``; checkpoints are written atomically and read with
        ``weights_only=True`` (:class:`AtomicCheckpointIO`). The progress bar counts optimizer
        steps (:class:`~rfkit.training.progress.StepProgressBar`) unless the recipe lists its own.
        Lightning's model summary table is off unless the recipe sets ``enable_model_summary`` or
        the command runs with ``--verbose``."""
        from lightning.pytorch.callbacks import ModelCheckpoint
        from lightning.pytorch.callbacks.progress import ProgressBar
        from lightning.pytorch.plugins.io import TorchCheckpointIO

        from rfkit.training.checkpointing import AtomicCheckpointIO, RunCheckpoint
        from rfkit.training.progress import StepProgressBar

        listed = config.get("callbacks") or []
        listed = listed if isinstance(listed, list) else [listed]
        own = any(isinstance(cb, ModelCheckpoint) for cb in listed)
        if config.get("enable_checkpointing") is False or own:
            callbacks = [cb for cb in callbacks if not isinstance(cb, RunCheckpoint)]
        if config.get("enable_progress_bar") is not False and not any(isinstance(cb, ProgressBar) for cb in listed):
            callbacks = [*callbacks, StepProgressBar()]  # steps done / max_steps, not "Epoch 0/-2"
        if config.get("enable_model_summary") is None and not verbose():
            config = {**config, "enable_model_summary": False}  # its table (and "Total FLOPs: 0"): --verbose
        trainer = super()._instantiate_trainer(config, callbacks)
        for cb in trainer.callbacks:
            if isinstance(cb, RunCheckpoint):
                cb.place(trainer.default_root_dir)
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # single device, DDP
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        return trainer

    def after_instantiate_classes(self) -> None:
        """Hand the trainer the resolved config as YAML (``trainer.rf_config_text``), dumped as
        LightningCLI's SaveConfigCallback saves ``config.yaml`` for fit/validate/test; ``rfkit
        profile`` and ``rfkit convert`` write it beside their outputs, the run summary into the
        model card."""
        import inspect

        if getattr(self, "rf_precision", None):
            log.info(self.rf_precision)  # every class built: the settings are valid, no model loaded yet
        config = self.config.get(str(self.subcommand), self.config) if self.subcommand else self.config
        parser = self._parser(self.subcommand)
        # keep null values (reproducible); jsonargparse >= 4.49 calls skip_none skip_unset
        keep_nulls = {"skip_unset" if "skip_unset" in inspect.signature(parser.dump).parameters else "skip_none": False}
        try:
            text = parser.dump(config, **keep_nulls)
        except Exception as err:  # never fail a run over its record; say so
            log.warning("could not dump the resolved config: %s", one_line(err))
            text = None
        self.trainer.rf_config_text = text
        if getattr(self, "rf_precision", None) and hasattr(self.model, "run_metrics"):
            self.model.run_metrics["precision"] = self.rf_precision.split(None, 1)[1]  # summary.json says why


def public_class_paths(config) -> None:
    """Name the built-in policy and operator in the resolved config as recipes write them and saved
    models record them (``rfkit.policies.X``, ``rfkit.operators.X``: :mod:`rfkit.classpath`).
    jsonargparse records a class given by its short name under its shortest import path
    (``rfkit.X``) and keeps the implementation path a recipe may write; a plugin's path is kept."""
    import importlib

    from jsonargparse import Namespace

    from rfkit.classpath import PUBLIC_MODULES, class_path

    for key in ("model.policy", "model.operator"):
        spec = config.get(key) if isinstance(config, Namespace) else None
        path = getattr(spec, "class_path", None) if isinstance(spec, Namespace) else None
        if not isinstance(path, str) or "." not in path:
            continue
        module, _, name = path.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), name, None)
        except ImportError:
            continue
        if isinstance(cls, type) and cls.__module__ in PUBLIC_MODULES:
            spec.class_path = class_path(cls)


def make_cli(args: list[str] | None, run: bool = True, **kwargs) -> RFKitCLI:
    """The ``rfkit`` LightningCLI: RecurFormerModule plus any TextDataModule subclass (the
    plain one by default). ``rfkit fit`` and the recipe-reading commands all build it here."""
    from rfkit.data import TextDataModule
    from rfkit.training.module import RecurFormerModule

    options = dict(
        trainer_class=RFTrainer,
        parser_class=RFArgumentParser,
        subclass_mode_data=True,
        seed_everything_default=0,
        args=args,
        run=run,
        auto_configure_optimizers=False,
    )
    if run and args and args[0] in RFKitCLI.subcommands():
        options["only_subcommand"] = args[0]  # `rfkit fit ...`: the other subcommands' parsers are not built
    options.update(kwargs)
    _quiet_seed_message()  # bad input is one line on stderr: no "Seed set to 0" before it
    quiet_lightning()  # Lightning set its loggers to INFO when it was imported
    with warnings.catch_warnings():
        # args is passed explicitly (rewritten by main, or a recipe read by bench / eval / sweep);
        # Lightning would warn on stderr that sys.argv holds arguments too
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
        return RFKitCLI(RecurFormerModule, TextDataModule, **options)


class _DropSeedMessage(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Seed set to")


def _quiet_seed_message() -> None:
    """Drop Lightning's "Seed set to N" line (the seed is in the saved config.yaml): it would
    come before a one-line error on stderr."""
    seed_log = logging.getLogger("lightning.fabric.utilities.seed")
    if not any(isinstance(f, _DropSeedMessage) for f in seed_log.filters):
        seed_log.addFilter(_DropSeedMessage())


def resolve_config_args(args: list[str]) -> list[str]:
    """``args`` with every ``--config VALUE`` / ``--config=VALUE`` / ``-c VALUE`` resolved by
    :func:`rfkit.config.catalog.resolve_config`: a file stays as given, a catalogue name
    (``smollm2_b05``) becomes the packaged recipe's path, anything else is a one-line error."""
    from rfkit.config.catalog import resolve_config

    resolved = list(args)
    command = args[0] if args and not args[0].startswith("-") else "fit"
    for i, arg in enumerate(args):
        if arg in ("--config", "-c") and i + 1 < len(args):
            resolved[i + 1] = resolve_config(args[i + 1], flag=arg, command=command)
        elif arg.startswith("--config="):
            resolved[i] = "--config=" + resolve_config(arg.split("=", 1)[1], command=command)
    return resolved


def run(argv: list[str]) -> int:
    """``rfkit fit|validate|test|profile|convert ...`` (``argv`` starts with the subcommand)."""
    argv = resolve_config_args(argv)  # --config smollm2_b05 -> the packaged recipe's path
    PARSE_ARGS[:] = argv  # lets a parse error name the full field (tidy_parse_error)
    try:
        make_cli(argv, save_config_kwargs={"overwrite": True})
    finally:
        PARSE_ARGS.clear()
    return 0
