"""Loading the models that ``rfkit bench``, ``rfkit eval`` and ``rfkit sweep`` compare.

A model spec is either a directory (the output of ``rfkit convert`` / ``rfkit fit``, or for the
evaluations any HF causal-LM directory) or a recipe YAML, whose base model is converted on the
spot without training. Every check that needs no weights runs first, so bad input exits with
one line before anything loads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from rfkit.devices import torch_device  # noqa: F401  (the commands import it from here)
from rfkit.errors import RFKitError
from rfkit.hub import ModelSource


class ModelSpecError(RFKitError):
    """A bad ``--model`` (or other command-line) value; the message is one line for the user."""


def check_model_spec(spec: str, require_converted: bool = True, flag: str = "--model") -> str:
    """Cheap checks before anything loads: returns ``"directory"`` or ``"recipe"``."""
    path = Path(spec).expanduser()
    if path.is_dir():
        config = path / "config.json"
        if not config.exists():
            raise ModelSpecError(f"{flag}: '{spec}' is not a model directory (no config.json)")
        try:
            model_type = json.loads(config.read_text()).get("model_type")
        except (OSError, ValueError) as err:
            raise ModelSpecError(f"{flag}: cannot read {config}: {' '.join(str(err).split())}") from None
        converted = str(model_type).startswith("rf_")
        if require_converted and not converted:
            raise ModelSpecError(
                f"{flag}: '{spec}' holds a '{model_type}' model, not an rfkit-converted one; "
                "give the output of `rfkit convert` / `rfkit fit`, or a recipe"
            )
        if converted and not (path / "head_map.json").exists():
            raise ModelSpecError(f"{flag}: '{spec}' has no head_map.json, so its base model is unknown")
        return "directory"
    if path.is_file():
        if path.suffix.lower() not in (".yaml", ".yml"):
            raise ModelSpecError(f"{flag}: '{spec}' is a file but not a recipe (.yaml); give a recipe or a model directory")
        return "recipe"
    raise ModelSpecError(f"{flag}: '{spec}' does not exist; give a model directory or a recipe YAML")


def parse_recipe(spec: str, overrides: list[str] | None = None):
    """A recipe parsed like ``rfkit fit`` parses it: ``(RecurFormerModule, TextDataModule)``,
    nothing loaded yet."""
    from rfkit.config.lightning_cli import make_cli

    cli = make_cli(["--config", spec, *(overrides or [])], run=False)
    return cli.model, cli.datamodule


def converted_from_recipe(spec: str, device: torch.device | str | None = None) -> tuple[torch.nn.Module, str, str, bool]:
    """Parse a recipe and convert its base model (no training), profiling and transfer included,
    on ``device`` (default: the CPU): ``(model, base_model, dtype, trust_remote_code)``."""
    module, datamodule = parse_recipe(spec)
    module.prepare(datamodule, callbacks=[], device=device)
    return module.model, module.base_model, module.dtype_name, module.trust_remote_code


def base_model_name(spec: str) -> str:
    """The base model a spec starts from (the head map's model for a converted directory)."""
    from rfkit.conversion.headmap import HeadMap

    path = Path(spec)
    if path.is_dir():
        if (path / "head_map.json").exists():
            return HeadMap.load(path / "head_map.json").model
        return str(path)
    module, _ = parse_recipe(spec)
    return module.base_model


def model_config(spec: str):
    """The HF config of the model a spec evaluates (config files only, no weights)."""
    from transformers import AutoConfig

    from rfkit.conversion.convert import load_config

    path = Path(spec)
    if path.is_dir():
        return AutoConfig.from_pretrained(str(path))
    module, _ = parse_recipe(spec)
    return load_config(module.base_model, module.trust_remote_code)


def max_context(config) -> int | None:
    """The longest input the model was built for (``max_position_embeddings``), if it says."""
    from rfkit.hub import context_length

    return context_length(config.to_dict())


def check_lengths_fit(lengths: list[int], config, flag: str, extra: int = 0) -> None:
    """A length beyond the model's context is one clear line (``extra``: tokens generated on top)."""
    limit = max_context(config)
    if limit is None:
        return
    for length in lengths:
        if length + extra > limit:
            more = f" plus {extra} generated" if extra else ""
            raise ModelSpecError(
                f"{flag}: {length} tokens{more} is beyond what the model can take "
                f"(max_position_embeddings {limit}); give lengths up to {limit - extra}"
            )


def check_output_file(path: str | None, flag: str = "--json") -> None:
    if path is None:
        return
    parent = Path(path).expanduser().resolve().parent
    if not parent.is_dir():
        raise ModelSpecError(f"{flag}: directory '{parent}' does not exist")


DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    name: str  # what was loaded, for reports: the spec, plus "(original)" when asked
    base_model: str
    converted: bool
    notes: list[str]


def load_tokenizer(spec_dir: Path | None, base_model):
    """The tokenizer saved in ``spec_dir``, else the base model's: ``base_model`` is a spec,
    resolved only then, or a :class:`~rfkit.hub.ModelSource` resolved already."""
    from transformers import AutoTokenizer

    from rfkit.hub import resolve_source

    if spec_dir is not None and (spec_dir / "tokenizer_config.json").exists():
        tok = AutoTokenizer.from_pretrained(str(spec_dir))
    else:
        tok = AutoTokenizer.from_pretrained(resolve_source(base_model).path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(spec: str, original: bool = False, device: torch.device | str = "cpu") -> LoadedModel:
    """The model a spec names, in eval mode on ``device``, with its tokenizer.

    ``original=True`` loads the unconverted base model instead (for a converted directory, the
    base model named in its head map; for a recipe, the recipe's ``model.base_model``). The base
    model's spec is resolved once (:func:`rfkit.pipeline.resolve`) and that resolution serves its
    config, weights and tokenizer.
    """
    from transformers import AutoModelForCausalLM

    from rfkit import pipeline
    from rfkit.conversion.headmap import HeadMap

    kind = check_model_spec(spec, require_converted=False)
    notes: list[str] = []
    path = Path(spec)
    if kind == "directory":
        has_map = (path / "head_map.json").exists()
        base = HeadMap.load(path / "head_map.json").model if has_map else str(path)
        if original and has_map:
            base = pipeline.resolve(base)
            model = pipeline.load(base, DTYPE_NAMES.get(dir_dtype(path), "float32"))
            converted = False
        else:
            model = AutoModelForCausalLM.from_pretrained(str(path), use_safetensors=True)
            converted = has_map
        tokenizer = load_tokenizer(path, base)
    else:
        module, datamodule = parse_recipe(spec)
        if original:
            module.source = pipeline.resolve(module.base_model, datamodule)
            model = pipeline.load(module.source, module.dtype_name, module.trust_remote_code)
            converted = False
        else:
            module.prepare(datamodule, callbacks=[], device=device)  # profiled and converted on the device
            model, converted = module.model, True
            notes.append("converted from the recipe without training")
        base = module.source
        tokenizer = load_tokenizer(None, base)
    model.to(device).eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    name = f"{spec} (original)" if original else spec
    base_name = base.name if isinstance(base, ModelSource) else base
    return LoadedModel(model, tokenizer, name, base_name, converted, notes)


def dir_dtype(path: Path):
    """The weight dtype a saved model directory declares (float32 when it does not say)."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return torch.float32
    text = config.get("dtype") or config.get("torch_dtype")
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(text, torch.float32)
