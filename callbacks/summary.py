"""Writes the run's summary.json, head map and converted model (with its model card) at the end of ``rfkit fit``.

Distributed runs (DDP, FSDP): every rank takes part in what needs all ranks (summing the
training tokens, ``trainer.log_dir``, which broadcasts, and, under FSDP, gathering the sharded
weights into one unsharded copy on rank 0); only global rank 0 writes files.
"""

from __future__ import annotations

import contextlib
import copy
import time
from pathlib import Path

import lightning as L
import torch

from rfkit.conversion.headmap import atomic_write_json
from rfkit.training.report import final_screen, shown_path

SUMMARY_FIELDS = (
    "ppl_original",
    "ppl_converted",
    "cache_bytes_per_token_original",
    "cache_bytes_per_token_converted",
    "params_added",
    "params_removed",
    "replaced_heads",
    "total_heads",
    "train_tokens",
    "wall_seconds",
)


def run_dir(trainer) -> Path:
    """The run directory. ``trainer.log_dir`` is a broadcast under DDP/FSDP: call on every rank."""
    return Path(trainer.log_dir or trainer.default_root_dir)


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


class RunSummary(L.Callback):
    """Collects what the other callbacks and the module measured into ``summary.json``.

    Args:
        save_model: Also save the converted model (HF format) to ``<run dir>/model``.
    """

    def __init__(self, save_model: bool = True):
        self.save_model = save_model
        self._written = False

    def summary(self, trainer, pl_module) -> dict:
        """The summary dict; sums the training tokens over ranks, so call it on every rank."""
        metrics = dict(pl_module.run_metrics)
        # on the strategy's device: NCCL reduces CUDA tensors only, and by on_fit_end the
        # strategy's teardown has moved the module itself to the CPU
        tokens = torch.tensor(float(pl_module.train_tokens), dtype=torch.float64, device=trainer.strategy.root_device)
        metrics["train_tokens"] = int(trainer.strategy.reduce(tokens, reduce_op="sum"))  # summed over ranks
        metrics["wall_seconds"] = round(getattr(pl_module, "_wall_before", 0.0) + time.time() - pl_module.started, 1)  # resumed runs included
        ordered = {key: metrics.get(key) for key in SUMMARY_FIELDS}
        ordered.update({k: v for k, v in metrics.items() if k not in ordered})
        if ordered.get("ppl_original") and ordered.get("ppl_converted"):
            ordered["ppl_ratio"] = ordered["ppl_converted"] / ordered["ppl_original"]
        return ordered

    def on_fit_start(self, trainer, pl_module) -> None:
        self._written = False

    def on_train_end(self, trainer, pl_module) -> None:
        # A sharded model must be gathered while its shards are still where FSDP put them: the
        # strategy's teardown (before on_fit_end) moves them to the CPU.
        if fsdp_root(trainer) is not None:
            self._write(trainer, pl_module)

    def on_fit_end(self, trainer, pl_module) -> None:
        if not self._written:
            self._write(trainer, pl_module)

    def _write(self, trainer, pl_module) -> None:
        # collectives first, on every rank (a collective on rank 0 alone would wait forever)
        out = run_dir(trainer)
        summary = self.summary(trainer, pl_module)
        self._written = True
        saving = self.save_model and pl_module.head_map is not None
        root = fsdp_root(trainer)
        model = gathered_model(trainer, pl_module, root) if saving and root is not None else pl_module.model
        if not trainer.is_global_zero:
            return
        if pl_module.head_map is not None:
            pl_module.head_map.save(out / "head_map.json")
        saved = None
        if saving:
            from rfkit.conversion.convert import save_converted
            from rfkit.training.progress import phase

            tokenizer = getattr(trainer.datamodule, "tokenizer", None)
            with phase(pl_module, "save", shown_path(out / "model")):
                saved = save_converted(model, pl_module.head_map, out / "model", tokenizer, config_text(trainer, out), metrics=summary)
            summary["model_dir"] = str(saved)
        phases = getattr(getattr(pl_module, "phases", None), "seconds", None)
        if phases:
            summary["phases"] = dict(phases)
        from rfkit.provenance import stamp

        atomic_write_json(out / "summary.json", stamp(summary, wall_seconds=summary.get("wall_seconds")))
        print(final_screen(summary, "fit", saved, out / "summary.json"))


def config_text(trainer, out: Path) -> str | None:
    """The run's resolved recipe: what the rfkit CLI handed the trainer, else the log dir's config.yaml."""
    text = getattr(trainer, "rf_config_text", None)
    if text is None and (out / "config.yaml").is_file():
        text = (out / "config.yaml").read_text()
    return text

