"""Cheap checks that a model source (``model.base_model``) can be converted, run before anything
loads: the files :mod:`rfkit.hub` resolves, and a config of an attention layout rfkit knows
(:class:`~rfkit.models.layout.AttentionLayout`). Used by the LightningModule and the preflight.
"""

from __future__ import annotations

import json
from pathlib import Path

from rfkit.hub import (
    EMBEDDED_MODEL,
    SourceError,
    check_hub_model,
    check_weight_files,
    is_embedded,
    looks_like_path,
    missing_weights,
)
from rfkit.models.layout import AttentionLayout, LayoutError


def check_model_source(name: str, trust_remote_code: bool = False) -> None:
    """Cheap checks before anything loads (config files only, never weights):

    * a local directory exists, holds a readable ``config.json`` of a supported attention
      layout, and safetensors weights (all shards of an index), none of them truncated;
    * a hub id is well formed; offline (``HF_HUB_OFFLINE=1``) it must be complete in the
      Hugging Face cache (not missing, not a half-finished download); a cached config is
      checked for its layout as a local one is;
    * the embedded name is the one rfkit ships.
    """
    if is_embedded(name):
        if name != EMBEDDED_MODEL:
            raise SourceError(f"model.base_model: unknown embedded model '{name}'; allowed: {EMBEDDED_MODEL}")
        return
    if looks_like_path(name):
        path = Path(name).expanduser()
        if not path.exists():
            raise SourceError(f"model.base_model: path '{name}' does not exist")
        if not path.is_dir():
            raise SourceError(f"model.base_model: '{name}' is a file; give a HF model directory (with config.json)")
        if not (path / "config.json").exists():
            raise SourceError(f"model.base_model: '{name}' has no config.json (not a HF model directory)")
        _check_config_dir(path, name, trust_remote_code)
        missing = missing_weights(path)
        if missing:
            raise SourceError(
                f"model.base_model: '{name}' has no weights ({', '.join(missing)} missing); "
                "rfkit loads safetensors (save the model with save_pretrained)"
            )
        check_weight_files(path, name)
        return
    snapshot = check_hub_model(name)
    if snapshot is not None:
        _check_config_dir(snapshot, name, trust_remote_code)
        check_weight_files(snapshot, name)


def _check_config_dir(path: Path, name: str, trust_remote_code: bool) -> None:
    """``path/config.json`` is JSON that transformers reads, of an attention layout rfkit knows."""
    from transformers import AutoConfig

    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise SourceError(f"model.base_model: cannot read {path / 'config.json'}: {' '.join(str(err).split())}") from None
    if not isinstance(raw, dict):
        raise SourceError(f"model.base_model: {path / 'config.json'} holds a {type(raw).__name__}, not a config object")
    model_type = raw.get("model_type")
    try:
        config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except (ValueError, KeyError, OSError, TypeError) as err:
        raise LayoutError(
            f"model.base_model: cannot read the config of '{name}' (model_type {model_type!r}): {' '.join(str(err).split())}"
        ) from None
    AttentionLayout.from_config(config)
