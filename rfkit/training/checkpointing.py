"""Checkpoints that survive a crash and resume without re-profiling.

* :class:`RunCheckpoint`: Lightning's ``ModelCheckpoint`` with rfkit's defaults. ``rfkit fit``
  adds it as the ``checkpoint`` section: ``last.ckpt`` every ``every_n_train_steps`` steps
  (and after each validation) in ``<trainer.default_root_dir>/checkpoints``, a directory that
  does not change between runs, so ``rfkit fit ... --ckpt_path last`` finds it after a crash.
* :class:`AtomicCheckpointIO`: writes every checkpoint to a temporary file beside its target,
  flushes it to disk, then renames it (a ``kill -9`` leaves the previous checkpoint whole), and
  reads checkpoints with ``torch.load(weights_only=True)`` unless told otherwise.
* :func:`random_states` / :func:`restore_random_states`: every random stream training reads
  (torch's global and CUDA generators, Python's ``random``, and each mixer's own stream, such
  as the hybrid's window dropout), saved in each checkpoint and restored on resume, so a
  resumed fit draws what the uninterrupted one drew.
* :func:`read_meta`: the ``"rfkit"`` entry that :class:`rfkit.training.module.RecurFormerModule` puts
  into each checkpoint: the head map, the operator, what the callbacks measured before
  training, and the data position. A resumed run rebuilds the converted architecture from it
  (no profiling, no attention transfer) before Lightning loads the weights.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO

from rfkit.atomic import atomic_write
from rfkit.errors import RFKitError
from rfkit.validate import positive_int

META_KEY = "rfkit"
META_FORMAT = 1
RNG_KEY = "rfkit_random_states"


class CheckpointError(RFKitError):
    """A checkpoint that cannot be resumed by this recipe; one line for the user."""


class TrainingDiverged(RFKitError):
    """The loss or the gradients stopped being finite; the run stops (exit code 1)."""

    exit_code = 1


class RunCheckpoint(ModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` with defaults for resumable conversion runs.

    Args:
        dirpath: Where checkpoints go; default ``<trainer.default_root_dir>/checkpoints``
            (the same for every run of a recipe, so ``--ckpt_path last`` finds the last one).
        every_n_train_steps: Save ``last.ckpt`` every this many optimizer steps (it is also
            saved after each validation). None: only after validations.
        save_top_k: Also keep this many step-named checkpoints (``-1``: all); 0 keeps only
            ``last.ckpt``.
        save_last: Write ``last.ckpt``; keep it on for ``--ckpt_path last``.
    """

    def __init__(
        self,
        dirpath: str | None = None,
        every_n_train_steps: int | None = 50,
        save_top_k: int = 0,
        save_last: bool = True,
    ):
        positive_int("checkpoint.every_n_train_steps", every_n_train_steps, optional=True, error=CheckpointError)
        positive_int("checkpoint.save_top_k", save_top_k, -1, error=CheckpointError)
        super().__init__(
            dirpath=dirpath, every_n_train_steps=every_n_train_steps, save_top_k=save_top_k, save_last=save_last
        )

    def place(self, default_root_dir: str | os.PathLike) -> None:
        """Use ``<default_root_dir>/checkpoints`` unless ``dirpath`` was given."""
        if self.dirpath is None:
            self.dirpath = os.path.realpath(os.path.join(str(default_root_dir), "checkpoints"))


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class AtomicCheckpointIO(TorchCheckpointIO):
    """``torch.save`` into a temporary file beside the target, fsync, rename.

    Lightning's own writer stages the file in the system temp directory and moves it across
    file systems, which is a copy: a crash then can leave a truncated ``last.ckpt``. Loading
    defaults to ``weights_only=True`` (rfkit checkpoints hold only tensors and plain data).
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options")

        def write(tmp: str) -> None:
            torch.save(checkpoint, tmp)
            _fsync_file(tmp)

        atomic_write(path, write)

    def load_checkpoint(self, path, map_location=lambda storage, loc: storage, weights_only: bool | None = None):
        return super().load_checkpoint(path, map_location=map_location, weights_only=True if weights_only is None else weights_only)


def read_meta(path: str | os.PathLike, field: str = "--ckpt_path") -> dict:
    """The ``"rfkit"`` entry of checkpoint ``path`` (read with ``weights_only=True``, memory-mapped)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{field}: '{path}' is not a checkpoint file")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # truncated, foreign, or holding pickled objects
        raise CheckpointError(f"{field}: cannot read '{path}' as a checkpoint ({' '.join(str(err).split())[:200]})") from None
    meta = checkpoint.get(META_KEY) if isinstance(checkpoint, dict) else None
    if not isinstance(meta, dict) or "head_map" not in meta:
        raise CheckpointError(
            f"{field}: '{path}' holds no rfkit head map (not written by rfkit fit, or by an older rfkit); "
            "start a new run without --ckpt_path"
        )
    if meta.get("format", 0) > META_FORMAT:
        raise CheckpointError(f"{field}: '{path}' was written by a newer rfkit (format {meta['format']}); upgrade rfkit")
    return meta


def random_states(module: torch.nn.Module) -> dict:
    """The random streams a fit reads, as plain data and tensors (``weights_only`` loads them):
    torch's global generator, the CUDA ones, Python's ``random``, and every submodule's own
    generator (``_generator``, e.g. the hybrid's window dropout) by module name."""
    import random

    version, internal, gauss = random.getstate()
    states = {
        "torch": torch.get_rng_state(),
        "python": [version, list(internal), gauss],
        "modules": {
            name: sub._generator.get_state()
            for name, sub in module.named_modules()
            if isinstance(getattr(sub, "_generator", None), torch.Generator)
        },
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_random_states(module: torch.nn.Module, states: dict) -> None:
    """Put back what :func:`random_states` saved; a submodule whose generator was saved gets one
    (``dropout_generator()`` creates it) set to the saved state."""
    import random

    torch.set_rng_state(states["torch"])
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    subs = dict(module.named_modules())
    for name, state in states.get("modules", {}).items():
        sub = subs.get(name)
        if sub is not None and hasattr(sub, "dropout_generator"):
            sub.dropout_generator().set_state(state)
