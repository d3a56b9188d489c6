"""Checks of parsed ``rfkit fit`` / ``validate`` / ``test`` / ``profile`` / ``convert``
settings that run before any class is built, any model loads or anything is written (see
:func:`preflight`). Each failure is one line naming the field.
"""

from __future__ import annotations

import os
from pathlib import Path

from rfkit.errors import RFKitError, one_line
from rfkit.validate import is_int as _is_int

_CKPT_KEYWORDS = ("last", "best", "hpc", "registry")



def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_trainer_settings(trainer) -> None:
    """Trainer values Lightning refuses only when it builds the trainer (with a traceback)."""

    def bad(field: str, value, allowed: str) -> RFKitError:
        return RFKitError(f"trainer.{field}: {value!r} is not allowed; {allowed}")

    max_steps = trainer.get("max_steps")
    if max_steps is not None and (not _is_int(max_steps) or max_steps < -1):
        raise bad("max_steps", max_steps, "give an integer >= 0, or -1 for no limit")
    max_epochs = trainer.get("max_epochs")
    if max_epochs is not None and (not _is_int(max_epochs) or max_epochs < -1):
        raise bad("max_epochs", max_epochs, "give an integer >= 0, -1 for no limit, or null")
    for field in ("min_steps", "min_epochs"):
        value = trainer.get(field)
        if value is not None and (not _is_int(value) or value < 0):
            raise bad(field, value, "give an integer >= 0 or null")
    accumulate = trainer.get("accumulate_grad_batches")
    if accumulate is not None and (not _is_int(accumulate) or accumulate < 1):
        raise bad("accumulate_grad_batches", accumulate, "give an integer >= 1")
    interval = trainer.get("val_check_interval")
    if _is_number(interval) and interval <= 0:
        raise bad("val_check_interval", interval, "give a fraction of an epoch in (0, 1] or a number of steps >= 1")
    for field in ("limit_train_batches", "limit_val_batches", "limit_test_batches"):
        value = trainer.get(field)
        if _is_number(value) and value < 0:
            raise bad(field, value, "give a fraction in [0, 1] or a number of batches >= 0")
    accelerator = trainer.get("accelerator")
    if isinstance(accelerator, str):
        from lightning.pytorch.accelerators import AcceleratorRegistry

        names = sorted(set(AcceleratorRegistry.available_accelerators()) | {"auto", "gpu"})
        if accelerator.lower() not in names:
            raise bad("accelerator", accelerator, f"allowed: {', '.join(names)}")


def check_ckpt_path(ckpt) -> None:
    """``--ckpt_path``: Lightning's keywords and URLs pass; a local path must be a checkpoint
    file (a zip archive or a pickle, as ``torch.save`` writes them)."""
    if ckpt is None:
        return
    text = str(ckpt)
    if text in _CKPT_KEYWORDS or text.startswith("registry:") or "://" in text:
        return
    path = Path(text).expanduser()
    if not path.exists():
        raise RFKitError(f"--ckpt_path: '{text}' does not exist; give a checkpoint file written by rfkit fit, or last")
    if path.is_dir():
        raise RFKitError(f"--ckpt_path: '{text}' is a directory; give a checkpoint file (for example {path / 'last.ckpt'})")
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as err:
        raise RFKitError(f"--ckpt_path: cannot read '{text}' ({err.strerror or one_line(err)})") from None
    if not head:
        raise RFKitError(f"--ckpt_path: '{text}' is empty (0 bytes), not a checkpoint")
    if not (head.startswith(b"PK\x03\x04") or head[:1] == b"\x80"):
        raise RFKitError(
            f"--ckpt_path: '{text}' is not a PyTorch checkpoint (neither a zip archive nor a pickle); "
            "give a .ckpt file written by rfkit fit"
        )


def is_text_data(class_path) -> bool:
    """Whether the data section builds a :class:`rfkit.data.TextDataModule` (or a subclass)."""
    from rfkit.data import TextDataModule

    if class_path is None:
        return True
    import importlib

    module, _, name = str(class_path).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module or "rfkit.data"), name)
    except (ImportError, AttributeError, ValueError):
        return False
    return isinstance(cls, type) and issubclass(cls, TextDataModule)


def check_model_fits_data(base_model: str, seq_len, tokenizer) -> None:
    """Model against data from files alone (no weights, no tokenizer built): ``data.seq_len``
    within the model's ``max_position_embeddings``; the tokenizer's ids within its ``vocab_size``.
    Skipped when the model's config is not on disk yet (a hub model before its download)."""
    from rfkit.hub import (
        SourceError,
        config_vocab_size,
        context_length,
        local_model_dir,
        read_model_config,
        tokenizer_size,
    )

    found = read_model_config(base_model)
    if found is None:
        return
    config, path = found
    limit = context_length(config)
    if limit and _is_int(seq_len) and seq_len > limit:
        raise SourceError(
            f"data.seq_len: {seq_len} tokens is beyond the context of model.base_model "
            f"(max_position_embeddings {limit} in {path}); give data.seq_len <= {limit}"
        )
    vocab = config_vocab_size(config)
    directory = local_model_dir(str(tokenizer)) if tokenizer else None
    size = tokenizer_size(directory) if directory is not None else None
    if vocab and size and size > vocab:
        raise SourceError(
            f"model.base_model / data.tokenizer: the tokenizer of '{tokenizer}' has {size} token ids but the model "
            f"has vocab_size {vocab} ({path}), so ids {vocab}..{size - 1} would be out of range; use the tokenizer "
            f"that belongs to the model (or a model with vocab_size >= {size})"
        )


def check_long_source(section, base_model, prefix: str = "model.transfer.") -> None:
    """A long-document source as ``data.source`` is checked, for ``model.transfer`` (attention
    transfer's long blocks) and ``data`` (long blocks mixed into training), named by
    ``prefix``: ``long_source``'s name (:func:`rfkit.data.check_source`) and, for local files,
    some text (:meth:`rfkit.data.TextDataModule.check_text`, the ``text`` field); and
    ``long_seq_len`` within the model's context when its config is on disk."""
    from rfkit.data import TextDataModule, check_source
    from rfkit.data.long import long_source_message
    from rfkit.hub import SourceError, context_length, read_model_config
    from rfkit.training.transfer import TransferError

    source = section.get("long_source") if section is not None else None
    if source is None:
        return
    error = TransferError if prefix == "model.transfer." else SourceError
    field = f"{prefix}long_source"
    check_source(source, field, error=error)
    try:
        TextDataModule.check_text(source, "text", field=field)
    except SourceError as err:  # a bad row names data.source or data.text_field
        raise error(long_source_message(str(err), field)) from None
    length = section.get("long_seq_len", 2048)
    found = read_model_config(base_model) if isinstance(base_model, str) else None
    limit = context_length(found[0]) if found else None
    if limit and _is_int(length) and length > limit:
        raise error(
            f"{prefix}long_seq_len: {length} tokens is beyond the context of model.base_model "
            f"(max_position_embeddings {limit} in {found[1]}); give {prefix}long_seq_len <= {limit}"
        )


def check_recall_weight(model, data) -> None:
    """``model.distill.recall`` weighs the answers that ``data.long_recall`` plants: a weight
    with nothing planted would silently do nothing."""
    from rfkit.training.distill import DistillError

    distill = model.get("distill") if model is not None else None
    weight = distill.get("recall") if hasattr(distill, "get") else None
    if _is_number(weight) and weight > 0 and not data.get("long_recall"):
        raise DistillError(
            f"model.distill.recall: {weight} weighs the answers planted by data.long_recall, which is 0; "
            "set data.long_recall > 0 (with data.long_source) or use 0"
        )


def check_state_audit(section, model=None) -> None:
    """The ``state_audit`` section's settings (the audit's when it is on, ``max_layers`` above 0),
    a ``read_sharpness`` other than 1 only with the hybrid operator (``model.operator``), and
    ``close_layers`` only with an operator whose blocks have a state gate."""
    from rfkit.callbacks.state_audit import StateAudit

    audit = StateAudit(**{k: v for k, v in dict(section).items() if k in StateAudit.FIELDS})
    operator = model.get("operator") if model is not None and hasattr(model, "get") else None
    path = operator.get("class_path") if operator is not None and hasattr(operator, "get") else None
    if audit.read_sharpness != 1.0 and isinstance(path, str):
        from rfkit.training.state_audit import require_hybrid

        require_hybrid(path, "state_audit.read_sharpness")
    if audit.close_layers and isinstance(path, str):
        from rfkit.training.state_audit import require_gated

        require_gated(path, "state_audit.close_layers")


def preflight(subcommand: str | None, config) -> None:
    """Checks that need only the parsed settings: they run before any class is built, any
    model loads or anything is written, and each failure is one line naming the field.

    * the model source (:func:`rfkit.models.source.check_model_source`: path, config, layout,
      weights, the hub cache offline), ahead of the data section whose tokenizer it links;
    * trainer settings that Lightning would refuse only once it builds the trainer;
    * the data text (:meth:`rfkit.data.TextDataModule.check_text`: not empty, some text);
    * cross-checks of model and data, from ``config.json`` and ``tokenizer.json`` alone:
      ``data.seq_len`` within the model's context (``max_position_embeddings``), and the
      tokenizer's ids within the model's ``vocab_size``;
    * the long-document sources (:func:`check_long_source`): attention transfer's
      ``model.transfer.long_source`` (fit and convert, which run transfer) and the training
      mix's ``data.long_source`` (fit), each a known name with some text, its ``long_seq_len``
      within the model's context;
    * the ``state_audit`` section's settings (fit): the audit's when it is on, ``read_sharpness``;
    * the outputs: ``trainer.default_root_dir`` (fit, validate, test) or ``--output``
      (profile, convert) writable, created by nothing here; ``--ckpt_path`` a checkpoint;
    * ``--device`` of profile and convert (cpu, cuda or cuda:N; CUDA present when asked for).
    """
    from rfkit.atomic import check_writable
    from rfkit.models.source import check_model_source

    model, data, trainer = config.get("model"), config.get("data"), config.get("trainer")
    base_model = model.get("base_model") if model is not None else None
    if isinstance(base_model, str):
        check_model_source(base_model, bool(model.get("trust_remote_code")))
    if trainer is not None:
        check_trainer_settings(trainer)
    if model is not None and hasattr(model.get("transfer"), "get") and subcommand in ("fit", "convert"):
        check_long_source(model.get("transfer"), base_model)  # the commands whose transfer reads it
    init = data.get("init_args") if data is not None and data.get("class_path") else data
    if init is not None and is_text_data(data.get("class_path") if data is not None else None):
        from rfkit.data import TextDataModule

        source, text_field = init.get("source"), init.get("text_field", "text")
        TextDataModule.check_text(source, text_field)
        if isinstance(base_model, str):
            check_model_fits_data(base_model, init.get("seq_len"), init.get("tokenizer") or base_model)
        if subcommand == "fit":  # the one command that trains on them
            check_long_source(init, base_model, prefix="data.")
            check_recall_weight(model, init)
    if subcommand in ("fit", "validate", "test"):
        root = trainer.get("default_root_dir") if trainer is not None else None
        check_writable(root or os.getcwd(), "trainer.default_root_dir", "directory")
        checkpoint = config.get("checkpoint")
        dirpath = checkpoint.get("dirpath") if checkpoint is not None else None
        if subcommand == "fit" and dirpath:
            check_writable(dirpath, "checkpoint.dirpath", "directory")
        check_ckpt_path(config.get("ckpt_path"))
        audit = config.get("state_audit")
        if subcommand == "fit" and audit is not None:
            check_state_audit(audit, model)
    elif subcommand in ("profile", "convert"):
        output = config.get("output")
        if output:
            check_writable(output, "--output", "file" if subcommand == "profile" else "directory")
        from rfkit.devices import torch_device

        torch_device(config.get("device"))  # cpu, cuda or cuda:N, and CUDA there when asked for


#: the weight dtype each pinned ``trainer.precision`` implies for ``model.dtype: auto``
_PRECISION_DTYPE = {"bf16-true": "bfloat16", "bf16": "bfloat16", "16-true": "float16", "half": "float16"}


def choose_precision(config) -> str | None:
    """Resolve ``model.dtype: auto`` in place, before anything is built, and say what was chosen.

    * ``trainer.precision`` left unset: bf16 where the device the trainer runs on computes it
      natively (:func:`rfkit.devices.native_bf16`: a CPU with AMX or AVX512-BF16, a GPU with bf16),
      as the GPU recipes run (``model.dtype: bfloat16`` under ``trainer.precision: bf16-true``: the
      frozen base in bf16, new weights and recurrent sums float32); float32 (``32-true``) elsewhere.
    * ``trainer.precision`` pinned: ``model.dtype`` follows it (bf16-true: bfloat16; 16-true: float16;
      anything else, mixed precision included, keeps float32 weights).

    Returns the line the run prints (``None`` when ``model.dtype`` was not ``auto``); a user pins
    either with ``--model.dtype float32`` or ``--trainer.precision 32-true``."""
    from rfkit.devices import accelerator_device_type, native_bf16

    model, trainer = config.get("model"), config.get("trainer")
    if model is None or model.get("dtype") != "auto":
        return None
    pinned = trainer.get("precision") if trainer is not None else None
    if pinned is not None:
        dtype = _PRECISION_DTYPE.get(str(pinned), "float32")
        model["dtype"] = dtype
        return f"precision     {pinned}, base weights {dtype} (model.dtype auto follows the pinned trainer.precision)"
    device = accelerator_device_type(trainer.get("accelerator") if trainer is not None else None)
    native, why = native_bf16(device)
    dtype, precision = ("bfloat16", "bf16-true") if native else ("float32", "32-true")
    model["dtype"] = dtype
    if trainer is not None:
        trainer["precision"] = precision
    pin = "float32" if native else "bfloat16"
    return f"precision     {precision}, base weights {dtype}: {why} (model.dtype auto; pin with --model.dtype {pin})"
