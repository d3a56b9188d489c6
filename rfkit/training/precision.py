"""How ``rfkit fit`` keeps the precision policy of :mod:`rfkit.models.precision` under Lightning.

The mechanism is a **per-module dtype under** ``bf16-true``: the recipe's ``model.dtype: bfloat16``
loads the frozen base in bf16 and ``trainer.precision: bf16-true`` runs it in bf16 with no autocast
and no float32 copy of the 7B base; the new weights (mixers, LoRA adapters) are float32 tensors of
their own, so the optimizer's master weights for everything that trains are float32. Why not the
alternatives:

- ``bf16-mixed`` over bf16 weights adds autocast, which runs the float32 mixers' matmuls in bf16
  (the precision their sums are kept out of) and changes nothing for the bf16 base; Lightning keeps
  the dtypes as loaded there too, so the new weights would need the same handling anyway.
- FSDP's own mixed precision (float32 parameters, bf16 compute) keeps a float32 sharded copy of
  every parameter, the frozen base included: twice the base's memory for weights that never change.

Lightning casts the LightningModule to bf16 (``precision_plugin.convert_module``, before wrapping
and before the optimizer exists); :class:`rfkit.training.module.RecurFormerModule` puts the new
weights back to float32 right after any such cast (:func:`rfkit.models.precision.keep_new_weights_float32`).

Under FSDP every unit must hold weights of one dtype (FSDP flattens a unit's parameters into one
tensor). :func:`fsdp_wrap_policy` therefore makes every module that holds only new weights (each
mixer, each LoRA adapter's layers) a unit of its own, without mixed precision (its float32 weights
are gathered and computed in float32; the mixers take the bf16 activations as they are), beside the
recipe's own units (one per decoder layer).

That leaves units whose own weights are all frozen (the decoder layers' pretrained projections)
around units that train. PyTorch's FSDP (``use_orig_params=True``, as Lightning sets it) then has a
flaw: in backward it re-registers a frozen unit's original parameters as plain tensors for the
recomputation and, with no gradient to finish, never registers them back as parameters, so a later
``state_dict()`` (the checkpoint, the saved model) misses them. :func:`restore_frozen_parameters`
registers them back after every backward (``RecurFormerModule.on_after_backward``) and before the
save step gathers the model; it reads FSDP's per-unit handle (``FullyShardedDataParallel._handle``),
the one place rfkit relies on FSDP internals (tests/test_recipe_dry_runs.py runs it).
"""

from __future__ import annotations

import logging

from torch import nn

from rfkit.models.precision import new_weight_modules

log = logging.getLogger(__name__)


def uses_fsdp(strategy) -> bool:
    """Whether ``strategy`` shards the model with FSDP (then the module tree is wrapped before the
    optimizer sees it, whatever the number of processes)."""
    try:
        from lightning.pytorch.strategies import FSDPStrategy
    except ImportError:  # pragma: no cover - lightning is a dependency
        return False
    return isinstance(strategy, FSDPStrategy)


def _wrap_classes(policy) -> tuple:
    """The module classes an FSDP wrap policy names (a ModuleWrapPolicy or a collection of
    classes); () for anything else."""
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    if isinstance(policy, ModuleWrapPolicy):
        return tuple(policy._module_classes)
    if isinstance(policy, (set, list, tuple)) and policy and all(isinstance(c, type) for c in policy):
        return tuple(policy)
    return ()


def model_layer_classes(classes: tuple, model: nn.Module, field: str) -> tuple:
    """``classes`` (a recipe's decoder-layer class, named for its family), or the model's own
    decoder-layer class when none of them occurs in ``model``: a recipe written for Llama wraps a
    Mistral model's layers, not nothing (logged once per field)."""
    if not classes or any(isinstance(m, classes) for m in model.modules()):
        return classes
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers:
        return classes
    own = type(layers[0])
    log.warning(
        "FSDP: %s names %s, which this %s model does not have; using its own %s",
        field, ", ".join(c.__name__ for c in classes), getattr(model.config, "rf_base_model_type", None) or getattr(model.config, "model_type", "?"), own.__name__,
    )  # fmt: skip
    return (own,)


def fsdp_wrap_policy(model: nn.Module, policy=None):
    """An FSDP auto-wrap policy for the converted ``model``: ``policy`` (the recipe's, usually one
    unit per decoder layer, :func:`model_layer_classes`; None: no other unit) plus one unit per
    module of :func:`rfkit.models.precision.new_weight_modules`, whose mixed precision is switched off."""
    from torch.distributed.fsdp.wrap import CustomPolicy

    own = {id(m) for m in new_weight_modules(model)}
    classes = model_layer_classes(_wrap_classes(policy), model, "trainer.strategy.auto_wrap_policy")
    if policy is not None and not classes:
        log.warning("FSDP: the strategy's auto_wrap_policy is not a list of module classes; "
                    "rfkit wraps the new weights on their own and every other module in the root unit")

    def unit(module: nn.Module):
        if id(module) in own:
            return {"mixed_precision": None}  # float32 weights, gathered and computed as they are
        return bool(classes) and isinstance(module, classes)

    return CustomPolicy(unit)


def prepare_fsdp(strategy, model: nn.Module) -> int:
    """Give an FSDP ``strategy`` the wrap policy of :func:`fsdp_wrap_policy` for ``model`` (before it
    wraps the model), and its activation checkpointing the model's decoder layers
    (:func:`model_layer_classes`); returns the number of new-weight units (0: not FSDP, nothing changed)."""
    if not uses_fsdp(strategy):
        return 0
    strategy.kwargs["auto_wrap_policy"] = fsdp_wrap_policy(model, strategy.kwargs.get("auto_wrap_policy"))
    checkpointing = getattr(strategy, "_activation_checkpointing_kwargs", None) or {}  # Lightning's parsed policy
    named = _wrap_classes(checkpointing.get("auto_wrap_policy"))
    classes = model_layer_classes(named, model, "trainer.strategy.activation_checkpointing_policy")
    if classes != named:
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        checkpointing["auto_wrap_policy"] = ModuleWrapPolicy(set(classes))
    return len(new_weight_modules(model))


def restore_frozen_parameters(model: nn.Module) -> int:
    """Register the original parameters of every frozen FSDP unit in ``model`` back as parameters
    (module docstring), as views of the unit's current flat parameter: the shard when the unit is
    sharded, the whole when it is not (one process, or ``NO_SHARD``). Returns the units fixed; 0
    for a model without FSDP units."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch without distributed support
        return 0
    fixed = 0
    for unit in FullyShardedDataParallel.fsdp_modules(model):
        handle = getattr(unit, "_handle", None)
        if handle is None or handle.flat_param.requires_grad or not handle._use_orig_params:
            continue  # trainable units finish their backward and register their parameters themselves
        if not handle.uses_sharded_strategy:
            handle._use_unsharded_views(as_params=True)
        elif handle.is_sharded(handle.flat_param):
            handle._use_sharded_views()
        else:
            continue  # gathered right now (inside a forward): FSDP restores it when it reshards
        fixed += 1
    return fixed
