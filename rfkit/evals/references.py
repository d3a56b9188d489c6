"""The reference models' results in ``rfkit eval needles`` and ``rfkit eval context``, kept for the next run.

Both commands measure the converted model beside references that do not depend on its training:
the original model and the training-free baseline built from it on the same head map. Evaluating
several trained models of one base (three seeds of a recipe, a recipe before and after a change)
measured those references again on every run, on the same prompts: 349 of the 486 seconds of a
needles run of the beta 0.9 recipe (docs/evaluations.md). A reference's result is now stored
under ``$RFKIT_CACHE/eval_references/`` and reused when everything that could change it is the
same (:func:`key`): the command and its settings, the exact prompts or token blocks, the
reference's weights (:func:`weights_digest`), the training-free operator and the heads it
streams, the dtype, the device, the machine (its processor, bf16 features and thread count:
float sums round differently elsewhere), the torch, transformers and rfkit versions and rfkit's
own source (:func:`code_digest`). ``--no-reuse`` measures them again (and stores the new result).

A reused row says so (``"reused": true``) and keeps the seconds its measurement took when it ran.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

#: the stored format's version (a change of rfkit's code is in the key already: :func:`code_digest`)
CACHE_VERSION = 1
#: elements of each tensor read into its digest (evenly spaced; all of a smaller tensor)
SAMPLES = 4096


def weights_digest(model: torch.nn.Module) -> str:
    """A digest of ``model``'s parameters and buffers: every name, shape and dtype, and up to
    :data:`SAMPLES` evenly spaced elements of each (two checkpoints of one architecture differ in
    nearly every element of every tensor, so sampled elements tell them apart; hashing every byte
    of a 7B model would take longer than some of the evaluations it saves)."""
    h = hashlib.sha1()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        flat = tensor.detach().reshape(-1)
        picked = flat[:: max(1, flat.numel() // SAMPLES)][:SAMPLES]
        h.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        h.update(picked.to(device="cpu", dtype=torch.float64).numpy().tobytes())
    return h.hexdigest()


def inputs_digest(payload) -> str:
    """A digest of the prompts or token blocks: JSON-able values and tensors, nested in lists / dicts."""
    h = hashlib.sha1()

    def feed(x) -> None:
        if isinstance(x, torch.Tensor):
            h.update(f"tensor{tuple(x.shape)}{x.dtype}".encode())
            h.update(x.detach().cpu().contiguous().numpy().tobytes())
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                h.update(f"<{k}>".encode())
                feed(x[k])
        elif isinstance(x, (list, tuple)):
            h.update(b"[")
            for item in x:
                feed(item)
            h.update(b"]")
        else:
            h.update(json.dumps(x).encode())

    feed(payload)
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """A digest of rfkit's own source (every ``.py`` and kernel file of the package): a stored
    result is only reused by the code that computed it, whatever the change (a prompt template,
    an answer's parsing, the training-free operator's attention)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha1()
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".c", ".h") and p.is_file()):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def key(command: str, settings: dict, inputs: str, model: torch.nn.Module, reference: str, heads=None) -> str:
    """The cache key of one reference's result: ``reference`` is ``"original"`` or the
    training-free operator's spec; ``heads``, the head map's selection, for the latter."""
    import transformers

    from rfkit.provenance import machine
    from rfkit.version import __version__

    weight = next(model.parameters())
    parts = {
        "command": command, "settings": settings, "inputs": inputs, "weights": weights_digest(model),
        "reference": reference, "heads": heads, "dtype": str(weight.dtype), "device": weight.device.type,
        "machine": machine(), "torch": torch.__version__, "transformers": transformers.__version__,
        "rfkit": __version__, "code": code_digest(), "version": CACHE_VERSION,
    }  # fmt: skip
    return hashlib.sha1(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def path_for(cache_key: str) -> Path:
    from rfkit.hub import cache_dir

    return cache_dir() / "eval_references" / f"{cache_key}.json"


def reuse_or_measure(cache_key: str, measure: Callable[[], dict], reuse: bool = True) -> tuple[dict, bool]:
    """``(result, reused)``: the stored result under ``cache_key`` when there is one and
    ``reuse``, else ``measure()``, stored for the next run (through :func:`pairs`: keys that are
    not strings survive JSON)."""
    from rfkit.atomic import atomic_write_json

    path = path_for(cache_key)
    if reuse and path.is_file():
        try:
            stored = json.loads(path.read_text())
            result = unpairs(stored["result"])
            log.info("reusing a reference's result from an earlier run: %s", path)
            return result, True
        except (OSError, ValueError, KeyError, TypeError) as err:  # unreadable: measured and written again
            log.warning("ignoring %s (%s); measuring again", path, err)
    result = measure()
    try:
        atomic_write_json(path, {"key": cache_key, "result": pairs(result)})
    except OSError as err:  # a read-only cache costs the next run its time, never this run
        log.warning("could not store %s: %s", path, err)
    return result, False


def measure_models(models, measure_one, command: str, settings: dict, inputs, heads, reuse: bool = True):
    """Each of :func:`rfkit.evals.context.models_to_measure`'s ``(name, model, state_off,
    training_free)`` measured by ``measure_one(name, model, state_off)``, the original and the
    training-free model through the cache (``inputs``: the prompts or blocks, digested once;
    ``heads``: the head map's selection). Returns ``{name: (result, seconds, reused)}``."""
    import time

    digest = inputs_digest(inputs)
    out = {}
    for name, model, state_off, training_free in models:

        def timed(name=name, model=model, state_off=state_off) -> dict:
            t0 = time.time()
            result = measure_one(name, model, state_off)
            return {"result": result, "seconds": round(time.time() - t0, 1)}

        if name == "original" or training_free:
            reference = "original" if name == "original" else name
            cache_key = key(command, settings, digest, model, reference, heads if training_free else None)
            done, reused = reuse_or_measure(cache_key, timed, reuse)
        else:
            done, reused = timed(), False
        out[name] = (done["result"], done["seconds"], reused)
    return out


def pairs(value):
    """``value`` with every dict whose keys are not all strings as ``{"__pairs__": [[k, v], ...]}``
    (JSON keeps only string keys); :func:`unpairs` undoes it."""
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {k: pairs(v) for k, v in value.items()}
        return {"__pairs__": [[k, pairs(v)] for k, v in value.items()]}
    if isinstance(value, list):
        return [pairs(v) for v in value]
    return value


def unpairs(value):
    if isinstance(value, dict):
        if set(value) == {"__pairs__"}:
            return {k: unpairs(v) for k, v in value["__pairs__"]}
        return {k: unpairs(v) for k, v in value.items()}
    if isinstance(value, list):
        return [unpairs(v) for v in value]
    return value
