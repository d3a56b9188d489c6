"""The conversion's building blocks as plain functions: load, profile, select, replace, save.

:mod:`rfkit.pipeline`'s named steps call them; ``rfkit fit``, ``rfkit convert`` and ``rfkit profile``
run those steps.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import logging
from pathlib import Path

import torch

from rfkit.atomic import atomic_write_text
from rfkit.conversion.headmap import HeadMap, load_profile, model_fingerprint, save_profile
from rfkit.conversion.policies import FromHeadMap, HeadSelectionPolicy
from rfkit.hub import ModelSource, cache_dir, resolve_source
from rfkit.models.layout import AttentionLayout
from rfkit.models.operators import ReplacementOperator

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _cannot_load(what: str, name: str, err: BaseException):
    from rfkit.hub import SourceError

    reason = " ".join(str(err).split())
    return SourceError(f"model.base_model: cannot load the {what} of '{name}': {reason[:300]}")


def load_config(source: str | ModelSource, trust_remote_code: bool = False):
    """The HF config of a model (no weights); a config that cannot be fetched or read (no
    network for a hub id, a broken file) is a one-line error naming ``model.base_model``.
    ``source``: a spec, resolved here, or a :class:`~rfkit.hub.ModelSource` resolved already."""
    from transformers import AutoConfig

    source = resolve_source(source)
    try:
        return AutoConfig.from_pretrained(source.path, trust_remote_code=trust_remote_code)
    except OSError as err:
        raise _cannot_load("config", source.name, err) from None


def load_base_model(source: str | ModelSource, dtype: str = "float32", trust_remote_code: bool = False):
    """Load a causal LM (weights from safetensors only) and check its attention layout.
    Weights that cannot be fetched or read (no network, a truncated or foreign file) are a
    one-line error naming ``model.base_model``. ``source`` is resolved once (a spec) or not at
    all (a :class:`~rfkit.hub.ModelSource`), and the config is read from the same resolution."""
    from transformers import AutoModelForCausalLM

    source = resolve_source(source)
    name, path = source.name, source.path
    config = load_config(source, trust_remote_code)
    AttentionLayout.from_config(config)  # fail on an unknown layout before loading weights
    try:
        from safetensors import SafetensorError
    except ImportError:  # older safetensors
        SafetensorError = OSError  # noqa: N806
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=DTYPES[dtype], use_safetensors=True, trust_remote_code=trust_remote_code
        )
    except (OSError, SafetensorError) as err:
        raise _cannot_load("weights", name, err) from None
    return model


def profile_cache_path(model_name: str, data_fingerprint: str, settings: dict, samples: int) -> Path:
    # "stats": bump when profile_heads collects new statistics (2: attention entropy), so older
    # cached profiles, which lack them, are not reused
    key = json.dumps({"model": model_name, "data": data_fingerprint, "samples": samples, "stats": 2, **settings}, sort_keys=True)
    return cache_dir() / "profiles" / f"{hashlib.sha1(key.encode()).hexdigest()[:16]}.json"


def profile_for(model, model_name: str, policy: HeadSelectionPolicy, datamodule=None, reuse: bool = True, progress: bool = True):
    """The calibration profile ``policy`` needs (reused from the cache when the model, data
    and settings match), and the data's provenance: ``(profile or None, data_info)``.

    Under ``torch.distributed`` (more than one rank) every rank must call this: the ranks agree
    to reuse the cached profile only if every one of them finds it (a cache that is not on
    shared storage may exist on one node only), profile together otherwise (see
    :func:`rfkit.conversion.profile.profile_heads`), and only global rank 0 writes the cache file."""
    settings = policy.profile_settings()
    if settings is None:
        return None, {}
    if datamodule is None:
        raise ValueError(f"{type(policy).__name__} needs calibration data (a data section)")
    datamodule.setup("fit")
    data_info = datamodule.describe()
    fingerprint, samples = datamodule.fingerprint(), len(datamodule.calibration)

    def cached(part_settings: dict, make):  # a policy's part measured alone (several lengths), cached alike
        return _cached_profile(profile_cache_path(model_name, fingerprint, part_settings, samples), make, reuse, model)

    takes_cache = "profile_cache" in inspect.signature(policy.make_profile).parameters  # plugins need not
    extra = {"profile_cache": cached} if takes_cache else {}
    loader = datamodule.calibration_dataloader
    make = lambda: policy.make_profile(model, loader(), progress=progress, datamodule=datamodule, **extra)  # noqa: E731
    return cached(settings, make), data_info


def _cached_profile(path: Path, make, reuse: bool, model):
    """The profile at ``path`` when every rank finds it, else ``make()`` (saved by rank 0)."""
    from rfkit.conversion.profile import _all_reduce, collective_device, dist_rank_world

    rank, world = dist_rank_world()
    found = reuse and path.exists()
    if reuse and world > 1:  # one decision for all ranks, or they would not meet in profile_heads
        device = collective_device(next(model.parameters()).device)
        (flag,) = _all_reduce([torch.tensor([int(found)])], device, torch.distributed.ReduceOp.MIN)
        found = bool(flag.item())
    if found:
        log.info("reusing head profile %s", path)
        return load_profile(path)
    profile = make()
    if rank == 0:
        save_profile(profile, path)
    return profile


def fingerprint_model(model, model_name: str) -> dict:
    """``{"config_sha256", "weights"}`` of a loaded model (see :func:`rfkit.conversion.headmap.model_fingerprint`)."""
    from rfkit.hub import local_model_dir

    # the directory already holding the weight files (local, embedded copy or cached hub
    # snapshot), found without downloading anything; None leaves the weights unknown
    return model_fingerprint(model.config, local_model_dir(model_name))


def reuse_head_map(model_name: str, layout: AttentionLayout, policy: FromHeadMap, fingerprint: dict) -> HeadMap:
    """The map a :class:`FromHeadMap` policy gives: the source map's profile and provenance,
    applied to ``model_name``, with ``source`` naming the file. Warns when the layout matches
    but the source was made on a model with another config."""
    selected = policy.select(layout, None)  # checks the layout
    source = policy.head_map
    made_on = (source.model_fingerprint or {}).get("config_sha256")
    if made_on and made_on != fingerprint["config_sha256"]:
        log.warning(
            "%s: head map '%s' was made for %s, whose config (sha256 %s) differs from %s's (sha256 %s); "
            "the layout matches, so its selection is used",
            policy.field, policy.path, source.model, made_on[:12], model_name, fingerprint["config_sha256"][:12],
        )  # fmt: skip
    return dataclasses.replace(source, model=model_name, selected=selected, source=dict(policy.source))


def build_head_map(
    model,
    model_name: str,
    policy: HeadSelectionPolicy,
    datamodule=None,
    reuse: bool = True,
    progress: bool = True,
) -> HeadMap:
    """Profile the heads (or reuse a cached profile) and apply ``policy``: :func:`profile_for`
    then :func:`select_heads`. A :class:`FromHeadMap` policy profiles nothing (see
    :func:`reuse_head_map`)."""
    if isinstance(policy, FromHeadMap):
        return select_heads(model, model_name, policy)
    profile, data_info = profile_for(model, model_name, policy, datamodule, reuse, progress)
    return select_heads(model, model_name, policy, profile, data_info)


def select_heads(model, model_name: str, policy: HeadSelectionPolicy, profile=None, data_info=None) -> HeadMap:
    """The head map ``policy`` selects from ``profile`` (:func:`profile_for`'s, with its data
    provenance ``data_info``), recording the model's fingerprint. A :class:`FromHeadMap` policy
    needs no profile (see :func:`reuse_head_map`)."""
    layout = AttentionLayout.from_config(model.config)
    fingerprint = fingerprint_model(model, model_name)
    if isinstance(policy, FromHeadMap):
        return reuse_head_map(model_name, layout, policy, fingerprint)
    selected = policy.select(layout, profile)
    return HeadMap.build(model_name, layout, profile, selected, policy, data_info or {}, fingerprint)


# An attention layer's query / key / value projections, separate in the original and packed into
# qkv_proj in a converted layer (mq_proj / mk_proj: the layout saved before the packing)
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "mq_proj", "mk_proj")


def _projections_summed(counts: dict) -> dict:
    """``counts`` with each attention layer's Q/K/V projections summed under one name per field,
    so that packing them is neither an addition nor a removal (only rows gained or lost count)."""
    out: dict = {}
    for name, numel in counts.items():
        module, _, field = name.rpartition(".")
        parent, _, proj = module.rpartition(".")
        key = f"{parent}.<q/k/v>.{field}" if proj in _PROJECTIONS else name
        out[key] = out.get(key, 0) + numel
    return out


def parameter_delta(model_before_counts: dict, model_after) -> tuple[int, int]:
    """Parameters (added, removed) between two ``{name: numel}`` maps of the same model; a
    layer's Q/K/V projections count as one (:func:`_projections_summed`)."""
    model_before_counts = _projections_summed(model_before_counts)
    after = _projections_summed({n: p.numel() for n, p in model_after.named_parameters()})
    added = sum(v for n, v in after.items() if n not in model_before_counts)
    removed = sum(v for n, v in model_before_counts.items() if n not in after)
    for n in after.keys() & model_before_counts.keys():
        delta = after[n] - model_before_counts[n]
        added, removed = added + max(delta, 0), removed + max(-delta, 0)
    return added, removed


def convert(model, head_map: HeadMap, operator: ReplacementOperator):
    """Replace the selected heads in place; returns the converted (``rf_*``) model."""
    from rfkit.models.modeling import to_recurformer

    head_map.check_layout(AttentionLayout.from_config(model.config))
    return to_recurformer(model, head_map.selected, operator)


def param_counts(model) -> dict:
    return {n: p.numel() for n, p in model.named_parameters()}


def save_converted(
    model,
    head_map: HeadMap,
    out_dir: str | Path,
    tokenizer=None,
    config_text: str | None = None,
    metrics: dict | None = None,
) -> Path:
    """Save a converted model as an HF directory (safetensors + config + head map + tokenizer),
    with the code of its model classes and ``auto_map`` (so transformers loads it without rfkit,
    ``trust_remote_code=True``: :mod:`rfkit.models.export`), a model card (``README.md``, see
    :mod:`rfkit.conversion.model_card`) and, when ``config_text`` (the resolved rfkit recipe) is
    given, ``config.yaml``. ``metrics`` (a run summary) go into the card. A model whose operator is
    a plugin's gets no code of its own (it loads where the plugin is installed), with a warning.

    LoRA adapters, if any, are merged into the model in place first.
    Written into a temporary sibling directory and renamed into place, so a crash never
    leaves a half-written model; an existing directory at ``out_dir`` is replaced.
    """
    from rfkit.atomic import atomic_directory
    from rfkit.models.export import exportable, write_remote_code
    from rfkit.models.lora import merge_lora

    merged = merge_lora(model)  # LoRA adapters folded into their base weights: no peft needed to load
    if merged:
        log.info("merged %d LoRA adapters before saving", merged)
    from rfkit.conversion.model_card import model_card

    reason = exportable(model.config.to_dict())
    if reason:
        log.warning("the saved model carries no code of its own (%s); it loads where rfkit and that plugin are installed", reason)
    card = model_card(head_map, config_text, metrics, getattr(model.config, "rf_operator", None), self_contained=reason is None)
    with atomic_directory(out_dir) as tmp:
        model.save_pretrained(str(tmp), safe_serialization=True)
        if reason is None:
            write_remote_code(tmp)  # modeling_rfkit.py and the modules it needs, auto_map in config.json
        head_map.save(tmp / "head_map.json")
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        atomic_write_text(tmp / "README.md", card)  # after the tokenizer, which may write its own
        if config_text is not None:
            atomic_write_text(tmp / "config.yaml", config_text)
    return Path(out_dir)
