"""The pipeline's last step, **save**: the converted model in HF format, as a named phase.

:func:`save_model` is the step: under FSDP it first gathers the sharded weights into one
unsharded copy on global rank 0 (:func:`gathered_model`; every rank takes part), then global
rank 0 writes the model with :func:`rfkit.conversion.convert.save_converted` (LoRA merged,
safetensors, config, head map, tokenizer, model card, written to a temporary directory and
renamed into place) inside the ``save`` phase, which logs its line and its seconds. ``rfkit fit``
runs it from the :class:`~rfkit.callbacks.RunSummary` callback at the end of training (the
gather must happen before the strategy's teardown moves the shards), ``rfkit convert`` right
after conversion.
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import torch

from rfkit.training.progress import phase
from rfkit.training.report import shown_path


def fsdp_root(trainer):
    """The strategy's root ``FullyShardedDataParallel`` module, or None when the run is not sharded."""
    model = getattr(trainer.strategy, "model", None)
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # torch without distributed support
        return None
    return model if isinstance(model, FullyShardedDataParallel) else None


def gathered_model(trainer, pl_module, root):
    """Under FSDP: an unsharded copy of ``pl_module.model`` on global rank 0 (None elsewhere), for
    saving. Every rank must call it: the full state dict is gathered with FSDP's
    ``FULL_STATE_DICT`` (``rank0_only``, offloaded to CPU memory when the shards live on a GPU).
    The copy is built from the model's config (the converted architecture), with the recipe's
    LoRA adapters, and takes the gathered tensors as they are (``assign``: same dtypes). The
    trained model itself is left alone: merging LoRA into it in place would change the module
    names FSDP tracks. Must run before the strategy's teardown moves the shards to the CPU."""
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from rfkit.training.precision import restore_frozen_parameters

    restore_frozen_parameters(root)  # frozen units' parameters registered again (an FSDP flaw)
    on_gpu = trainer.strategy.root_device.type != "cpu"
    config = FullStateDictConfig(offload_to_cpu=on_gpu, rank0_only=True)
    with FSDP.state_dict_type(root, StateDictType.FULL_STATE_DICT, config):
        state = root.state_dict()  # keys of the LightningModule: "model." + the HF model's names
    if not trainer.is_global_zero:
        return None
    state = {key[len("model.") :]: value for key, value in state.items() if key.startswith("model.")}
    model = pl_module.model
    dtypes = [t.dtype for t in state.values() if t.is_floating_point()]
    dtype = max(set(dtypes), key=dtypes.count) if dtypes else torch.get_default_dtype()
    try:
        from transformers.initialization import no_init_weights  # the weights are replaced next
    except ImportError:  # older transformers
        no_init_weights = contextlib.nullcontext
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with no_init_weights():
            # a converted class: its __init__ converts the attention as config.rf_selected says
            clone = type(model)(copy.deepcopy(model.config))
            lora = getattr(pl_module, "lora", None)
            if lora is not None:
                from rfkit.models.lora import apply_lora

                apply_lora(clone, lora)
    finally:
        torch.set_default_dtype(previous)
    missing, unexpected = clone.load_state_dict(state, strict=False, assign=True)
    if getattr(clone.config, "tie_word_embeddings", False):
        clone.tie_weights()
    loaded = {p.data_ptr() for p in state.values()}
    named = dict(clone.named_parameters(remove_duplicate=False))
    untied = [k for k in missing if k not in named or named[k].data_ptr() not in loaded]  # not a tied alias
    if unexpected or untied:
        raise RuntimeError(
            f"summary: the gathered FSDP state does not fit the converted model (missing {untied[:5]}, "
            f"unexpected {unexpected[:5]}); the model was not saved"
        )
    return clone.eval()


def save_model(
    trainer, pl_module, directory, tokenizer=None, config_text: str | None = None, metrics: dict | None = None
) -> Path | None:
    """The **save** step: gather (FSDP; call on every rank), then on global rank 0 write
    ``pl_module.model`` with ``pl_module.head_map`` to ``directory`` inside the ``save`` phase.
    Returns the saved directory on global rank 0, None on the other ranks.

    ``tokenizer`` is saved beside the model, ``config_text`` (the resolved recipe) goes into the
    model card, and ``metrics`` (what the run measured) onto it."""
    root = fsdp_root(trainer)
    model = gathered_model(trainer, pl_module, root) if root is not None else pl_module.model
    if not trainer.is_global_zero:
        return None
    from rfkit.conversion.convert import save_converted

    with phase(pl_module, "save", shown_path(directory)):
        return save_converted(model, pl_module.head_map, directory, tokenizer, config_text, metrics=metrics)
