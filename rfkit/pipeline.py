"""The pipeline as named steps: resolve, load, profile, select, convert, improve, train, measure, save.

Every command that loads or converts a model runs these functions, and only these, and resolves
its model spec once:

* ``rfkit fit``: :meth:`RecurFormerModule.configure_model <rfkit.training.module.RecurFormerModule.configure_model>`
  calls :func:`prepare` (or :func:`rebuild` and :func:`improve` when it resumes a checkpoint);
  Lightning's ``Trainer.fit`` is the **train** step; the ``RunSummary`` callback calls :func:`save`.
* ``rfkit convert``: :func:`run_convert` (:func:`prepare`, then :func:`save`).
* ``rfkit profile``: :func:`run_profile` (resolve, load, profile, select, :func:`save_head_map`).
* ``rfkit eval`` (``ppl``, ``passkey``, ``hashhop``, ``lm-eval``, ``context``) and ``rfkit bench``
  (``cache``, ``speed``), through :class:`rfkit.config.loading.ModelSpec`: :func:`load_saved` for
  a saved directory, :func:`prepare` for a recipe converted on the spot, :func:`resolve` and
  :func:`load` for the original base model, :func:`load_config` and :func:`load_tokenizer` for
  what validation reads first; ``rfkit eval context`` builds its training-free baseline with
  :func:`convert`.
* ``rfkit sweep``: :func:`resolve` and :func:`load` once, :func:`profile` once per setting; every
  row selects its beta's heads from that profile (so the selections nest) and runs :func:`convert`
  on a copy of the base, or with ``--fit`` runs ``rfkit fit`` inside :func:`sharing` (it resolves
  nothing again); ``--trained`` directories :func:`load_saved`.

:class:`~rfkit.config.lightning_cli.RFTrainer`'s ``profile`` and ``convert`` only dispatch here.
The steps in order:

1. :func:`resolve`: the model spec (``model.base_model``) resolved once, into a
   :class:`~rfkit.hub.ModelSource` that the config, weight and tokenizer loads share
   (:func:`sharing` hands it to a command run inside another).
2. :func:`load`: the base model's config and weights, on the device where conversion runs;
   :func:`load_config` and :func:`load_tokenizer` read the config or tokenizer alone, and
   :func:`load_saved` loads a model :func:`save` wrote (a directory: nothing to resolve).
3. :func:`profile`: the calibration statistics the policy needs (cached).
4. :func:`select`: the policy's choice of heads, as a :class:`~rfkit.conversion.headmap.HeadMap`.
5. :func:`convert`: the selected heads replaced by the operator's blocks.
6. :func:`improve`: init from attention, attention transfer, LoRA, freezing, the teacher.
7. **train**: Lightning's ``Trainer.fit`` over :class:`~rfkit.training.module.RecurFormerModule`
   (``training_step``); no function here.
8. :func:`measure`: the callbacks' ``on_before_convert`` / ``on_after_convert`` hooks (the
   callbacks measure the trained model themselves, at the end of ``fit``).
9. :func:`save`: the converted model in HF format (:func:`save_head_map` for ``rfkit profile``).

``module`` below is a :class:`~rfkit.training.module.RecurFormerModule` (the recipe's ``model``
section); ``datamodule`` a :class:`~rfkit.data.TextDataModule` or None.
"""

from __future__ import annotations

import contextlib
import logging
from contextvars import ContextVar
from pathlib import Path

from rfkit.conversion import convert as conversion
from rfkit.conversion.headmap import HeadMap
from rfkit.conversion.policies import FromHeadMap, HeadSelectionPolicy, PolicyError
from rfkit.hub import ModelSource, resolve_source
from rfkit.models.layout import AttentionLayout
from rfkit.models.precision import keep_new_weights_float32
from rfkit.training.freeze import init_from_attention, trains_shared
from rfkit.training.teacher import SHARED_TEACHER_FROZEN

log = logging.getLogger(__name__)

_SHARED: ContextVar[tuple[ModelSource, ...]] = ContextVar("rfkit_shared_sources", default=())


# -- the steps --------------------------------------------------------------------------------
def resolve(spec: str | ModelSource, datamodule=None) -> ModelSource:
    """Step 1: ``spec`` resolved once (:func:`rfkit.hub.resolve_source`). When the datamodule's
    tokenizer is the same spec the two share one resolution: the datamodule's, if it resolved
    first (``rfkit fit`` sets the data up before the model), or this one, handed to it. Inside
    :func:`sharing`, a spec resolved by the command that opened it is not resolved again."""
    known = getattr(datamodule, "model_source", None)
    if isinstance(known, ModelSource) and known.name == str(spec):
        return known
    source = next((s for s in _SHARED.get() if s.name == str(spec)), None) or resolve_source(spec)
    shares = hasattr(datamodule, "model_source") and getattr(datamodule, "tokenizer_name", None) == source.name
    if known is None and shares:
        datamodule.model_source = source
    return source


@contextlib.contextmanager
def sharing(*sources: ModelSource):
    """Within the block, :func:`resolve` answers a spec named by one of ``sources`` with it
    instead of resolving again: a command that runs another in process (``rfkit sweep --fit``
    runs ``rfkit fit`` for every row) hands it the resolution it holds."""
    token = _SHARED.set(_SHARED.get() + tuple(sources))
    try:
        yield
    finally:
        _SHARED.reset(token)


def load(source: str | ModelSource, dtype: str = "float32", trust_remote_code: bool = False, device=None):
    """Step 2: the base model of ``source`` (config, then safetensors weights, in ``dtype``; its
    attention layout checked), moved to ``device`` when given. Returns the HF model."""
    model = conversion.load_base_model(source, dtype, trust_remote_code)  # looked up here: tests replace it
    return model if device is None else model.to(device)


def load_config(source: str | ModelSource, trust_remote_code: bool = False):
    """Part of step 2, before any weights: the HF config of ``source`` (a spec is resolved here, a
    :class:`ModelSource` is not resolved again), for the checks that read it first."""
    return conversion.load_config(source, trust_remote_code)


def load_tokenizer(source: str | ModelSource | None, directory=None):
    """Part of step 2: the tokenizer saved in ``directory`` (a model :func:`save` wrote) when it
    holds one, else that of ``source`` (a spec is resolved here, a :class:`ModelSource` is not)."""
    from transformers import AutoTokenizer

    if directory is not None and (Path(directory) / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(str(directory))
    return AutoTokenizer.from_pretrained(resolve_source(source).path)


def load_saved(directory, device=None):
    """Step 2 for a model :func:`save` wrote (or any HF causal-LM directory): its safetensors
    weights as saved, moved to ``device`` when given. A directory is read as it is: nothing is
    resolved. Returns the HF model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(directory), use_safetensors=True)
    return model if device is None else model.to(device)


def profile(model, name: str, policy: HeadSelectionPolicy, datamodule=None, reuse: bool = True) -> tuple:
    """Step 3: the calibration profile ``policy`` needs, reused from the cache when model ``name``,
    data and settings match (:func:`rfkit.conversion.convert.profile_for`). Returns
    ``(profile or None, data provenance)``; a :class:`FromHeadMap` policy profiles nothing."""
    if isinstance(policy, FromHeadMap):
        return None, {}
    return conversion.profile_for(model, name, policy, datamodule, reuse)


def select(model, name: str, policy: HeadSelectionPolicy, profiled: tuple) -> HeadMap:
    """Step 4: the heads ``policy`` selects from ``profiled`` (:func:`profile`'s result), as the
    :class:`HeadMap` that records them with the model's fingerprint and the data's provenance."""
    return conversion.select_heads(model, name, policy, *profiled)


def convert(model, head_map: HeadMap, operator) -> tuple:
    """Step 5: the heads of ``head_map`` replaced by ``operator``'s blocks, in place. Returns
    ``(converted model, (parameters added, parameters removed))``."""
    before = conversion.param_counts(model)
    converted = conversion.convert(model, head_map, operator)
    return converted, conversion.parameter_delta(before, converted)


def improve(module, datamodule=None, restoring: bool = False) -> None:
    """Step 6: the quality methods that act on ``module.model`` once it is converted, in order:
    init from attention, attention transfer (:func:`transfer`), LoRA, the float32 new weights,
    gradient checkpointing, freezing (:meth:`RecurFormerModule.place_freezing`, which knows the
    trainer's strategy) and the teacher for distillation (:func:`teacher`). ``restoring`` (a
    checkpoint's weights follow) skips init and transfer."""
    if module.init == "from_attention" and not restoring:
        init_from_attention(module.model, module.operator)
    transfer(module, datamodule, restoring)
    if module.lora is not None:
        from rfkit.models.lora import apply_lora

        module.run_metrics["lora_layers"] = apply_lora(module.model, module.lora)
    keep_new_weights_float32(module.model)  # mixers and adapters: float32 beside a bf16 base
    if module.gradient_checkpointing:
        module.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    module.place_freezing()
    teacher(module)


def transfer(module, datamodule=None, restoring: bool = False) -> dict | None:
    """Part of step 6: attention transfer (``model.transfer``) on the calibration blocks and the
    recipe's long blocks, as the ``transfer`` phase. Returns its report (also in
    ``module.run_metrics["transfer"]``), or None when it does not run."""
    config = module.transfer_config
    trainable = getattr(module.operator, "trainable", True)
    if config is not None and not trainable:
        log.info("model.transfer: skipped, %s has no weights to learn", type(module.operator).__name__)
    if config is None or not trainable or not module.model.rf_originals or restoring:
        return None
    from rfkit.training.transfer import load_long_blocks, transfer as run_transfer

    if datamodule is None or getattr(datamodule, "calibration", None) is None:
        raise PolicyError("model.transfer: attention transfer needs calibration data (a data section)")
    with module.phases("transfer", f"{config.steps} steps"):
        long = load_long_blocks(config, _tokenizer_spec(module, datamodule), seed=getattr(datamodule, "seed", 0))
        report = run_transfer(module.model, datamodule.calibration, config, long_blocks=long)
    module.run_metrics["transfer"] = {k: v for k, v in report.items() if k != "losses"}
    return module.run_metrics["transfer"]


def teacher(module):
    """Part of step 6: the teacher that ``model.distill`` compares against (the original model,
    sharing the frozen modules with the student when ``share_modules``), or None."""
    distill = module.distill
    if distill is None or not distill.needs_teacher:
        return None
    from rfkit.training.teacher import SharedTeacher

    if distill.share_modules and any(trains_shared(module.model, f) for f in module.freeze_stages()):
        raise PolicyError(SHARED_TEACHER_FROZEN)
    module.teacher = SharedTeacher(module.model, distill.share_modules)
    module.run_metrics.update(module.teacher.memory())
    return module.teacher


def measure(module, datamodule, callbacks, hook: str, detail: str | None = None) -> None:
    """Step 8 around conversion: each callback's ``hook`` (``on_before_convert``: the original
    model; ``on_after_convert``: the converted one) called with ``(module, datamodule)``; inside
    a ``measure`` phase named ``detail`` when given and some callback has the hook."""
    hooked = [getattr(cb, hook) for cb in callbacks if hasattr(cb, hook)]
    if not hooked:
        return
    with module.phases("measure", detail) if detail else contextlib.nullcontext():
        for call in hooked:
            call(module, datamodule)


def save(trainer, module, directory, tokenizer=None, config_text: str | None = None, metrics: dict | None = None):
    """Step 9: ``module.model`` and its head map saved in HF format to ``directory`` as the
    ``save`` phase (:func:`rfkit.training.saving.save_model`: the FSDP gather, LoRA merged, model
    card, tokenizer, ``config.yaml``). Call on every rank; returns the directory on global rank 0,
    None elsewhere."""
    from rfkit.training.saving import save_model

    return save_model(trainer, module, directory, tokenizer, config_text, metrics)


def save_head_map(base, head_map: HeadMap, output, datamodule=None, config_text=None, report: bool = True) -> None:
    """Step 9 of ``rfkit profile``: ``head_map`` written to ``output``, the resolved recipe
    (``config_text``) beside it as ``config.yaml``, and with ``report`` the head pictures of
    :func:`rfkit.conversion.head_report.write_head_report` (needs ``datamodule``), made on the
    unconverted ``base`` model."""
    from rfkit.atomic import atomic_write_text

    head_map.save(output)
    print(f"head map: {head_map.replaced_heads} of {head_map.total_heads} query heads selected -> {output}")
    if config_text is not None:  # the resolved recipe beside the map
        atomic_write_text(Path(output).parent / "config.yaml", config_text)
        print(f"resolved config -> {Path(output).parent / 'config.yaml'}")
    if report and datamodule is not None:
        from rfkit.conversion.head_report import write_head_report

        paths = write_head_report(base, head_map, datamodule.calibration_dataloader(), Path(output).parent)
        print("head report: " + ", ".join(str(p) for p in paths.values()))


# -- the steps in the order each command runs them --------------------------------------------
def load_for(module, datamodule=None, device=None):
    """Steps 1 and 2 for ``module``: its ``base_model`` resolved once (kept as ``module.source``)
    and loaded on ``device`` (default: the trainer's device, else the CPU), which
    ``module.run_metrics["device"]`` records. Returns the base model."""
    if module.source is None:
        module.source = resolve(module.base_model, datamodule)
    model = load(module.source, module.dtype_name, module.trust_remote_code, module.conversion_device(device))
    module.run_metrics["device"] = str(next(model.parameters()).device)
    return model


def prepare(module, datamodule=None, callbacks=(), device=None, improve_model: bool = True) -> None:
    """``module.model`` converted and ready to train (``rfkit fit``, ``rfkit convert``): load,
    profile, select, measure the original model, convert, improve, then the callbacks'
    ``on_after_convert``; each step a phase with its own line. Sets ``module.model``,
    ``module.head_map`` and the conversion's entries of ``module.run_metrics``.

    ``improve_model=False``: the architecture a fit saves and nothing else (``rfkit bench`` on a
    recipe, where weights change neither cache size nor speed): no init from attention, no
    attention transfer, no LoRA adapters (a saved fit has them merged), no freezing and no
    teacher; the new weights float32 beside the base, as saved."""
    with module.phases("load", module.base_model):
        model = load_for(module, datamodule, device)
    policy = module.selection_policy()
    module.phases.start("profile")
    profiled = profile(model, module.base_model, policy, datamodule, module.reuse_profile)
    head_map = select(model, module.base_model, policy, profiled)
    module.phases.end("profile", f"{head_map.replaced_heads} of {head_map.total_heads} query heads selected")
    module.model = model
    measure(module, datamodule, callbacks, "on_before_convert", "the original model")
    with module.phases("convert", type(module.operator).__name__):
        module.model, (added, removed) = convert(model, head_map, module.operator)
    module.head_map = head_map
    module.run_metrics.update(
        params_added=added,
        params_removed=removed,
        replaced_heads=head_map.replaced_heads,
        total_heads=head_map.total_heads,
    )
    log.info("replaced %d of %d query heads; parameters +%d -%d", head_map.replaced_heads, head_map.total_heads, added, removed)
    if improve_model:
        improve(module, datamodule)
    else:
        keep_new_weights_float32(module.model)
    module.model.train()  # from_pretrained returns eval mode; Lightning switches modes per loop
    measure(module, datamodule, callbacks, "on_after_convert")


def rebuild(module, head_map: HeadMap, where: str, datamodule=None) -> None:
    """The converted architecture of a checkpoint (``--ckpt_path`` ``where``): load, and convert
    the heads of its ``head_map`` (checked against the model's layout first); no profiling.
    The caller runs :func:`improve` with ``restoring=True`` next."""
    model = load_for(module, datamodule)
    head_map.check_layout(AttentionLayout.from_config(model.config), "--ckpt_path", where)
    module.model, _ = convert(model, head_map, module.operator)
    module.head_map = head_map


def run_profile(module, datamodule=None, output="head_map.json", report: bool = True, device=None, config_text=None) -> HeadMap:
    """``rfkit profile``: load on ``device``, profile, select with the module's selection policy
    (``model.policy``, or the map of ``model.head_map``, as ``rfkit fit`` and ``convert`` do), and
    :func:`save_head_map`. Returns the head map."""
    base = load_for(module, datamodule, device)
    policy = module.selection_policy()
    if not isinstance(policy, FromHeadMap):
        print(f"profiling on {device}")
    profiled = profile(base, module.base_model, policy, datamodule, module.reuse_profile)
    head_map = select(base, module.base_model, policy, profiled)
    save_head_map(base, head_map, output, datamodule, config_text, report)
    return head_map


def run_convert(trainer, module, datamodule=None, output="converted", device=None) -> Path | None:
    """``rfkit convert``: :func:`prepare` on ``device`` (no training), then :func:`save` with the
    datamodule's tokenizer, the resolved recipe and what conversion measured, then the end
    screen. Returns the saved directory."""
    from rfkit.training.report import final_screen

    prepare(module, datamodule, callbacks=trainer.callbacks, device=device)
    tokenizer = getattr(datamodule, "tokenizer", None)
    # what conversion measured (parameters, transfer MSE, and whatever the callbacks' convert
    # hooks filled in); the end-to-end numbers come with rfkit fit
    metrics = dict(module.run_metrics)
    out = save(trainer, module, output, tokenizer, getattr(trainer, "rf_config_text", None), metrics)
    print(final_screen(dict(module.run_metrics), "convert", out, None))
    return out


def _tokenizer_spec(module, datamodule):
    """The tokenizer the long transfer blocks use: the datamodule's (the model's), resolved
    already where it is known, so it is not resolved again."""
    if hasattr(datamodule, "tokenizer_spec"):
        spec = datamodule.tokenizer_spec() or module.base_model
    else:
        spec = getattr(datamodule, "tokenizer_name", None) or module.base_model
    source = module.source
    return source if isinstance(spec, str) and source is not None and source.name == spec else spec
