"""Loading the models that ``rfkit bench``, ``rfkit eval`` and ``rfkit sweep`` compare.

A model spec is either a directory (the output of ``rfkit convert`` / ``rfkit fit``, or for the
evaluations any HF causal-LM directory) or a recipe YAML, whose base model is converted on the
spot without training. Every check that needs no weights runs first, so bad input exits with
one line before anything loads.

A command holds its ``--model`` as one :class:`ModelSpec`: checked once, a recipe parsed once,
and the base model's spec resolved at most once, which serves the base's config, weights and
tokenizer and the data's tokenizer. Models load through :mod:`rfkit.pipeline`'s steps only: a
saved directory with :func:`~rfkit.pipeline.load_saved`, a recipe with
:func:`~rfkit.pipeline.prepare`, the original base model with :func:`~rfkit.pipeline.load`.
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


class ModelSpec:
    """A ``--model`` value as one command sees it: a saved model directory or a recipe.

    Checked once when made (:func:`check_model_spec`, nothing loaded); a recipe is parsed once
    (:attr:`recipe`); the base model's spec is resolved at most once, the first time its config,
    weights or tokenizer are needed (:meth:`source`, :func:`rfkit.pipeline.resolve`), and that
    one :class:`~rfkit.hub.ModelSource` serves all of them, the recipe's conversion and the data
    whose tokenizer is the base model (:meth:`share`). A converted directory whose tokenizer is
    saved with it needs its base only for the original model, so it may resolve nothing."""

    def __init__(self, spec: str, require_converted: bool = False, flag: str = "--model"):
        self.spec = str(spec)
        self.path = Path(spec)
        self.kind = check_model_spec(self.spec, require_converted, flag)
        self._recipe = None
        self._head_map = None
        self._source: ModelSource | None = None
        self._config = None
        self._tokenizer = None

    @classmethod
    def of(cls, spec, require_converted: bool = False) -> ModelSpec:
        """``spec`` itself when it is a :class:`ModelSpec` already, else one made from it."""
        return spec if isinstance(spec, ModelSpec) else cls(spec, require_converted)

    def __str__(self) -> str:
        return self.spec

    @property
    def recipe(self):
        """``(RecurFormerModule, TextDataModule)`` of a recipe (:func:`parse_recipe`, once); None
        for a directory."""
        if self.kind == "recipe" and self._recipe is None:
            self._recipe = parse_recipe(self.spec)
        return self._recipe

    @property
    def head_map(self):
        """A converted directory's head map, else None."""
        if self._head_map is None and self.kind == "directory" and (self.path / "head_map.json").exists():
            from rfkit.conversion.headmap import HeadMap

            self._head_map = HeadMap.load(self.path / "head_map.json")
        return self._head_map

    @property
    def base_model(self) -> str:
        """The base model's spec as given (resolves nothing): the head map's model for a
        converted directory, the directory itself for a plain HF one, a recipe's ``model.base_model``."""
        if self.kind == "recipe":
            return self.recipe[0].base_model
        return self.head_map.model if self.head_map is not None else str(self.path)

    @property
    def trust_remote_code(self) -> bool:
        return bool(self.recipe[0].trust_remote_code) if self.kind == "recipe" else False

    def source(self) -> ModelSource:
        """The base model's spec resolved, once (:func:`rfkit.pipeline.resolve`); a recipe's
        module and data module share it."""
        if self._source is None:
            from rfkit import pipeline

            if self.kind == "recipe":
                module, datamodule = self.recipe
                if module.source is None:
                    module.source = pipeline.resolve(module.base_model, datamodule)
                self._source = module.source
            else:
                self._source = pipeline.resolve(self.base_model)
        return self._source

    def share(self, datamodule) -> None:
        """``datamodule`` reads its tokenizer through this resolution when it names the base
        model and the base is resolved already, so the data resolves nothing again."""
        known = self._source
        if known is not None and getattr(datamodule, "model_source", None) is None and datamodule.tokenizer_name == known.name:
            datamodule.model_source = known

    def config(self):
        """The HF config of the model evaluated (config files only, no weights): a directory's
        own, a recipe's base model's (:func:`rfkit.pipeline.load_config`)."""
        if self._config is None:
            if self.kind == "directory":
                from transformers import AutoConfig

                self._config = AutoConfig.from_pretrained(str(self.path))
            else:
                from rfkit import pipeline

                self._config = pipeline.load_config(self.source(), self.trust_remote_code)
        return self._config

    def tokenizer(self):
        """The tokenizer saved in the directory, else the base model's (:func:`load_tokenizer`),
        loaded once; its pad token is its EOS token when it has none."""
        if self._tokenizer is None:
            saved = self.kind == "directory" and (self.path / "tokenizer_config.json").exists()
            self._tokenizer = load_tokenizer(self.path, None) if saved else load_tokenizer(None, self.source())
        return self._tokenizer

    def converted(self, device: torch.device | str | None = None, improve_model: bool = True) -> torch.nn.Module:
        """The model the spec names, on ``device``: a directory as saved
        (:func:`rfkit.pipeline.load_saved`), a recipe's base converted on the spot without
        training, profiling and transfer included (:func:`rfkit.pipeline.prepare`); with
        ``improve_model=False`` a recipe's conversion stops at the architecture a fit saves (no
        transfer, no LoRA adapters), for measurements that weights do not change."""
        from rfkit import pipeline

        if self.kind == "directory":
            return pipeline.load_saved(self.path, device)
        module, datamodule = self.recipe
        module.prepare(datamodule, callbacks=[], device=device, improve_model=improve_model)  # resolves through source()
        return module.model

    def original(self, device: torch.device | str | None = None, dtype: str | None = None) -> torch.nn.Module:
        """The unconverted base model on ``device`` (:func:`rfkit.pipeline.load`), in ``dtype``
        (default: the dtype the directory's config declares, or the recipe's ``model.dtype``)."""
        from rfkit import pipeline

        if dtype is None:
            dtype = self.recipe[0].dtype_name if self.kind == "recipe" else DTYPE_NAMES.get(dir_dtype(self.path), "float32")
        return pipeline.load(self.source(), dtype, self.trust_remote_code, device)

    def load(self, original: bool = False, device: torch.device | str = "cpu") -> LoadedModel:
        """The model the spec names in eval mode on ``device``, with its tokenizer (see
        :func:`load_model`)."""
        notes: list[str] = []
        if original and (self.kind == "recipe" or self.head_map is not None):
            model, converted = self.original(device), False
        else:
            model = self.converted(device)
            converted = self.kind == "recipe" or self.head_map is not None
            if self.kind == "recipe":
                notes.append("converted from the recipe without training")
        tokenizer = self.tokenizer()
        model.to(device).eval()
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        name = f"{self.spec} (original)" if original else self.spec
        return LoadedModel(model, tokenizer, name, self.base_model, converted, notes)


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
    resolved only then, or a :class:`~rfkit.hub.ModelSource` resolved already
    (:func:`rfkit.pipeline.load_tokenizer`). Its pad token is its EOS token when it has none."""
    from rfkit import pipeline

    tok = pipeline.load_tokenizer(base_model, spec_dir)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(spec: str | ModelSpec, original: bool = False, device: torch.device | str = "cpu") -> LoadedModel:
    """The model a spec names, in eval mode on ``device``, with its tokenizer.

    ``original=True`` loads the unconverted base model instead (for a converted directory, the
    base model named in its head map; for a recipe, the recipe's ``model.base_model``). The base
    model's spec is resolved once (:meth:`ModelSpec.source`) and that resolution serves its
    config, weights and tokenizer; ``spec`` may be the command's :class:`ModelSpec`, which keeps
    what it resolved and loaded already.
    """
    return ModelSpec.of(spec).load(original, device)


def dir_dtype(path: Path):
    """The weight dtype a saved model directory declares (float32 when it does not say)."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return torch.float32
    text = config.get("dtype") or config.get("torch_dtype")
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(text, torch.float32)
