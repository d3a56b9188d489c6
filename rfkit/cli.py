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
import re
import sys
from importlib.metadata import entry_points
from pathlib import Path

from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from rfkit.errors import RFKitError

log = logging.getLogger("rfkit")

PLUGIN_GROUP = "rfkit.plugins"


def one_line(message) -> str:
    return " ".join(str(message).split())


_KEY = re.compile(r'Parser key "([^"]+)"')
_CLASS_PROBLEM = re.compile(r"Problem with given class_path '([^']+)': (.*?)(?: - Expected| Given value|$)")
_NOT_SUBCLASS = re.compile(r"Import path (\S+) does not correspond to a subclass of (\w+)")


def tidy_parse_error(message) -> str:
    """jsonargparse's messages, shortened to one line that names the field and what is allowed."""
    text = one_line(message)
    key = _KEY.search(text)
    field = key.group(1) if key else None
    for pattern, fmt in (
        (_CLASS_PROBLEM, "class '{0}' cannot be used: {1}"),
        (_NOT_SUBCLASS, "'{0}' is not a subclass of {1}"),
    ):
        found = pattern.search(text)
        if found:
            detail = fmt.format(*found.groups())
            return f"{field}: {detail}" if field else detail
    if key:
        rest = text[key.end() :].lstrip(": ")
        return f"{field}: {rest}"
    return text


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
        from jsonargparse import lazy_instance

        from rfkit.data import TextDataModule

        # data: any TextDataModule subclass; without a class_path it is TextDataModule itself,
        # so recipes keep writing `data: {source: ..., seq_len: ...}`
        parser.set_defaults({"data": lazy_instance(TextDataModule)})
        parser.link_arguments("model.base_model", "data.init_args.tokenizer")

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
    try:
        argv = _resolve_config_args(argv)  # --config smollm2_b05 -> the packaged recipe's path
        load_plugins()
        import warnings

        with warnings.catch_warnings():
            # the rewritten argv is passed explicitly; Lightning would warn that sys.argv is set too
            warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
            make_cli(argv, save_config_kwargs={"overwrite": True})
    except ValueError as err:
        found = user_error(err)
        if found is None:
            raise
        sys.stderr.write(f"rfkit: error: {one_line(found)}\n")
        raise SystemExit(2) from None


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
