"""``rfkit``: LightningCLI with the conversion subcommands.

    rfkit fit      --config R.yaml     profile, select, replace, train, measure, save
    rfkit validate --config R.yaml     convert and validate (add --ckpt_path for a trained run)
    rfkit test     --config R.yaml
    rfkit profile  --config R.yaml --output head_map.json
    rfkit convert  --config R.yaml --output DIR       (attention transfer if the recipe has it; no end-to-end training)
    rfkit bench    cache|speed --model DIR|R.yaml     cache bytes and tokens/s, original vs converted
    rfkit eval     hashhop|passkey|ppl|mqar|lm-eval   the paper's and the reviewers' evaluations
    rfkit data     hashhop --n N --out FILE.jsonl     write evaluation / fine-tuning samples
    rfkit sweep    --config R.yaml --betas 0,0.5,1    profile once, then quality vs cache per beta
    rfkit recipes  list | show NAME | cp NAME DEST    the recipes packaged with rfkit (rfkit.catalog)

Recipes are LightningCLI YAML files; every Lightning override (``--trainer.max_steps 10``)
works. ``--config`` (of fit, validate, test, profile, convert and sweep) takes a file or a
catalogue name: ``rfkit fit --config smollm2_b05``. Bad input gets one line on stderr naming
the field, and exit code 2, before any model loads.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from importlib.metadata import entry_points
from pathlib import Path

from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from rfkit.errors import RFKitError, one_line
from rfkit.parse_errors import PARSE_ARGS, tidy_parse_error

log = logging.getLogger("rfkit")

PLUGIN_GROUP = "rfkit.plugins"


def user_error(err: BaseException) -> RFKitError | None:
    """The RFKitError behind ``err`` (jsonargparse wraps errors raised in __init__), if any."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, RFKitError):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


class RFArgumentParser(LightningArgumentParser):
    """Prints parse errors as one line (no usage dump) and exits 2."""

    def error(self, message, *args, **kwargs):
        sys.stderr.write(f"rfkit: error: {tidy_parse_error(message)}\n")
        raise SystemExit(2)


class RFTrainer(Trainer):
    """Lightning's Trainer plus the subcommands that convert without training."""

    rf_ckpt_path: str | None = None
    rf_ckpt_meta: dict | None = None

    def _run(self, model, ckpt_path=None, weights_only=None):
        # Lightning has resolved --ckpt_path ("last" -> a file) and restores the weights after
        # configure_model. The checkpoint's rfkit entry is read (weights_only) and checked
        # against the recipe here, before any hook writes to the run directory; the module then
        # rebuilds the converted architecture from it instead of profiling again.
        self.rf_ckpt_path, self.rf_ckpt_meta = None, None
        if ckpt_path is not None and hasattr(model, "check_checkpoint"):
            from rfkit.checkpointing import read_meta

            self.rf_ckpt_meta = model.check_checkpoint(str(ckpt_path), read_meta(ckpt_path))
            self.rf_ckpt_path = str(ckpt_path)
        return super()._run(model, ckpt_path=ckpt_path, weights_only=weights_only)

    def profile(self, model, datamodule=None, output: str = "head_map.json", report: bool = True):
        """Profile the heads on calibration data, select with the policy, write the head map.

        Args:
            output: Where to write head_map.json (the resolved config goes beside it, as config.yaml).
            report: Also write the head pictures beside it: RA-I heatmap, mean attention maps
                of high/mid/low RA-I heads, and the first-token contribution table (JSON, MD).
        """
        from rfkit.convert import build_head_map, load_base_model
        from rfkit.headmap import atomic_write_text

        base = load_base_model(model.base_model, model.dtype_name, model.trust_remote_code)
        head_map = build_head_map(base, model.base_model, model.policy, datamodule, reuse=model.reuse_profile)
        head_map.save(output)
        print(f"head map: {head_map.replaced_heads} of {head_map.total_heads} query heads selected -> {output}")
        config_text = getattr(self, "rf_config_text", None)
        if config_text is not None:  # the resolved recipe beside the map
            atomic_write_text(Path(output).parent / "config.yaml", config_text)
            print(f"resolved config -> {Path(output).parent / 'config.yaml'}")
        if report and datamodule is not None:
            from rfkit.head_report import write_head_report

            paths = write_head_report(base, head_map, datamodule.calibration_dataloader(), Path(output).parent)
            print("head report: " + ", ".join(str(p) for p in paths.values()))
        return head_map

    def convert(self, model, datamodule=None, output: str = "converted"):
        """Profile, select, replace and run the recipe's attention transfer (no end-to-end training);
        save the converted model in HF format.

        Args:
            output: Directory for the converted model (written atomically), with its model card
                (README.md) and the resolved config (config.yaml).
        """
        from rfkit.convert import save_converted

        model.prepare(datamodule, callbacks=self.callbacks)
        tokenizer = getattr(datamodule, "tokenizer", None)
        # what conversion measured (parameters, transfer MSE, and whatever the callbacks' convert
        # hooks filled in); the end-to-end numbers come with rfkit fit
        out = save_converted(
            model.model, model.head_map, output, tokenizer, getattr(self, "rf_config_text", None), dict(model.run_metrics)
        )
        print(f"converted model ({model.head_map.replaced_heads} of {model.head_map.total_heads} heads replaced) -> {out}")
        return out


class RFKitCLI(LightningCLI):
    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        base = dict(LightningCLI.subcommands())
        base.pop("predict", None)
        base["profile"] = {"model", "datamodule"}
        base["convert"] = {"model", "datamodule"}
        return base

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        from rfkit.callbacks import CacheMonitor, PerplexityMonitor, RunSummary

        parser.add_lightning_class_args(PerplexityMonitor, "perplexity")
        parser.add_lightning_class_args(CacheMonitor, "cache")
        parser.add_lightning_class_args(RunSummary, "summary")
        from rfkit.checkpointing import RunCheckpoint

        parser.add_lightning_class_args(RunCheckpoint, "checkpoint")
        from jsonargparse import lazy_instance

        from rfkit.data import TextDataModule

        # data: any TextDataModule subclass; without a class_path it is TextDataModule itself,
        # so recipes keep writing `data: {source: ..., seq_len: ...}`
        parser.set_defaults({"data": lazy_instance(TextDataModule)})
        parser.link_arguments("model.base_model", "data.init_args.tokenizer")

    def before_instantiate_classes(self) -> None:
        """Check the parsed settings (:func:`rfkit.preflight.preflight`) before any class is
        built, any model loads or anything is written."""
        from rfkit.preflight import preflight

        config = self.config.get(str(self.subcommand), self.config) if self.subcommand else self.config
        preflight(self.subcommand, config)

    def _instantiate_trainer(self, config: dict, callbacks: list):
        """rfkit's checkpointing: the ``checkpoint`` section (:class:`RunCheckpoint`) writes
        ``<default_root_dir>/checkpoints/last.ckpt`` unless checkpointing is off or the recipe
        lists its own ``ModelCheckpoint``; checkpoints are written atomically and read with
        ``weights_only=True`` (:class:`AtomicCheckpointIO`)."""
        from lightning.pytorch.callbacks import ModelCheckpoint
        from lightning.pytorch.plugins.io import TorchCheckpointIO

        from rfkit.checkpointing import AtomicCheckpointIO, RunCheckpoint

        listed = config.get("callbacks") or []
        listed = listed if isinstance(listed, list) else [listed]
        own = any(isinstance(cb, ModelCheckpoint) for cb in listed)
        if config.get("enable_checkpointing") is False or own:
            callbacks = [cb for cb in callbacks if not isinstance(cb, RunCheckpoint)]
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


def make_cli(args: list[str] | None, run: bool = True, **kwargs) -> RFKitCLI:
    """The ``rfkit`` LightningCLI: RecurFormerModule plus any TextDataModule subclass (the
    plain one by default). ``rfkit fit`` and the recipe-reading commands all build it here."""
    from rfkit.data import TextDataModule
    from rfkit.module import RecurFormerModule

    options = dict(
        trainer_class=RFTrainer,
        parser_class=RFArgumentParser,
        subclass_mode_data=True,
        seed_everything_default=0,
        args=args,
        run=run,
        auto_configure_optimizers=False,
    )
    options.update(kwargs)
    _quiet_seed_message()  # bad input is one line on stderr: no "Seed set to 0" before it
    with warnings.catch_warnings():
        # args is passed explicitly (rewritten by main, or a recipe read by bench / eval / sweep);
        # Lightning would warn on stderr that sys.argv holds arguments too
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
        return RFKitCLI(RecurFormerModule, TextDataModule, **options)


def load_plugins() -> None:
    """Import every module registered under the ``rfkit.plugins`` entry-point group, so that
    their policies and operators can be named by short class name in recipes."""
    for ep in entry_points(group=PLUGIN_GROUP):
        try:
            ep.load()
        except Exception as err:  # a broken plugin is the user's to fix: name it
            dist = getattr(ep.dist, "name", "?")
            raise RFKitError(f"plugin '{ep.name}' from package '{dist}' failed to import: {one_line(err)}") from None


def _resolve_config_args(args: list[str]) -> list[str]:
    """``args`` with every ``--config VALUE`` / ``--config=VALUE`` / ``-c VALUE`` resolved by
    :func:`rfkit.catalog.resolve_config`: a file stays as given, a catalogue name
    (``smollm2_b05``) becomes the packaged recipe's path, anything else is a one-line error."""
    from rfkit.catalog import resolve_config

    resolved = list(args)
    for i, arg in enumerate(args):
        if arg in ("--config", "-c") and i + 1 < len(args):
            resolved[i + 1] = resolve_config(args[i + 1], flag=arg)
        elif arg.startswith("--config="):
            resolved[i] = "--config=" + resolve_config(arg.split("=", 1)[1])
    return resolved


def main(args: list[str] | None = None) -> None:
    argv = sys.argv[1:] if args is None else list(args)
    logging.basicConfig(level=os.environ.get("RFKIT_LOG", "INFO"), format="%(levelname)s %(name)s: %(message)s")
    if os.getcwd() not in sys.path:  # class_path: my_policies.EvenLayers from the working directory
        sys.path.insert(0, os.getcwd())
    if argv[:1] == ["bench"]:
        raise SystemExit(_bench(argv[1:]))
    if argv[:1] in (["eval"], ["data"]):
        from rfkit.evals.cli import dispatch

        load_plugins()
        raise SystemExit(dispatch(argv[0], argv[1:]))
    if argv[:1] == ["sweep"]:
        from rfkit.sweep import main as sweep_main

        load_plugins()
        raise SystemExit(sweep_main(argv[1:]))
    if argv[:1] == ["recipes"]:
        from rfkit.catalog import main as recipes_main

        raise SystemExit(recipes_main(argv[1:]))
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from rfkit.atomic import disk_full_error, is_disk_full

    try:
        argv = _resolve_config_args(argv)  # --config smollm2_b05 -> the packaged recipe's path
        load_plugins()
        PARSE_ARGS[:] = argv  # lets a parse error name the full field (tidy_parse_error)
        make_cli(argv, save_config_kwargs={"overwrite": True})
    except ValueError as err:
        found = user_error(err)
        if found is None:
            raise
        sys.stderr.write(f"rfkit: error: {one_line(found)}\n")
        raise SystemExit(getattr(found, "exit_code", 2)) from None  # 2: bad input; 1: a run that failed
    except OSError as err:  # a full disk outside rfkit.atomic's writers (those raise DiskFullError)
        if not is_disk_full(err):
            raise
        sys.stderr.write(f"rfkit: error: {one_line(disk_full_error(err.filename or 'the output'))}\n")
        raise SystemExit(2) from None
    except MisconfigurationException as err:  # Lightning's word on a trainer setting the preflight let through
        sys.stderr.write(f"rfkit: error: trainer: {one_line(err)}\n")
        raise SystemExit(2) from None
    except Exception as err:  # LightningCLI reads --ckpt_path's hyperparameters before any rfkit check
        if not _raised_in(err, "_parse_ckpt_path"):
            raise
        sys.stderr.write(f"rfkit: error: {_unreadable_checkpoint(argv, err)}\n")
        raise SystemExit(2) from None
    finally:
        PARSE_ARGS.clear()


def _raised_in(err: BaseException, function: str) -> bool:
    """Whether ``function`` is on the traceback of ``err``."""
    tb = err.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name == function:
            return True
        tb = tb.tb_next
    return False


def _unreadable_checkpoint(argv: list[str], err: BaseException) -> str:
    """The one line for a ``--ckpt_path`` that ``torch.load`` cannot read."""
    from rfkit.preflight import check_ckpt_path

    path = None
    for i, arg in enumerate(argv):
        if arg == "--ckpt_path" and i + 1 < len(argv):
            path = argv[i + 1]
        elif arg.startswith("--ckpt_path="):
            path = arg.split("=", 1)[1]
    try:
        check_ckpt_path(path)
    except RFKitError as found:
        return one_line(found)
    reason = one_line(err).split(". ")[0][:160]
    return f"--ckpt_path: cannot read '{path}' as a checkpoint ({reason}); it may be truncated or corrupt"


class _DropSeedMessage(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Seed set to")


def _quiet_seed_message() -> None:
    """Drop Lightning's "Seed set to N" line (the seed is in the saved config.yaml): it would
    come before a one-line error on stderr."""
    seed_log = logging.getLogger("lightning.fabric.utilities.seed")
    if not any(isinstance(f, _DropSeedMessage) for f in seed_log.filters):
        seed_log.addFilter(_DropSeedMessage())


def _bench(argv: list[str]) -> int:
    """``rfkit bench cache|speed`` (see :mod:`rfkit.bench`): one-line errors, exit code 2."""
    from rfkit import bench

    try:
        load_plugins()
        return bench.main(argv)
    except (RFKitError, ValueError) as err:
        found = err if isinstance(err, RFKitError) else user_error(err)
        if found is None:
            raise
        sys.stderr.write(f"rfkit bench: error: {one_line(found)}\n")
        return 2


if __name__ == "__main__":
    main()
