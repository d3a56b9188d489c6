"""How much the ``rfkit`` commands print.

rfkit's own lines always show: one line per phase, its warnings (a slow fallback, a missing
kernel, an unreadable cache) and its errors. Other libraries' chatter is off by default:
Lightning's info lines (accelerator found, tips advertising other products), deprecation and
future warnings raised inside Lightning, jsonargparse, transformers, torch and peft, Lightning's
tensorboardX notice, and transformers' weight-loading bars; and on ``rfkit fit``'s screen,
Lightning's model summary table (``| Name | Type | Params ...``, ``Total FLOPs``), its
``Training`` / ``Epoch 0`` bar lines before rfkit's step bar, and its ``Sanity Checking`` /
``Validation DataLoader 0`` bars (the step bar shows ``val_loss``) (:mod:`rfkit.config.lightning_cli`
and :class:`rfkit.training.progress.StepProgressBar` ask :func:`verbose`). ``rfkit --verbose
COMMAND`` (or ``RFKIT_VERBOSE=1``) shows all of it again; ``RFKIT_LOG=DEBUG`` sets rfkit's own
log level.

:mod:`rfkit.cli` calls :func:`configure_output` once per command.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

THIRD_PARTY = r"(lightning|lightning_fabric|pytorch_lightning|jsonargparse|transformers|torch|torchmetrics|peft)(\.|$)"
QUIET_LOGGERS = ("lightning.pytorch", "lightning.fabric", "lightning_fabric", "pytorch_lightning")


class _Format(logging.Formatter):
    """rfkit's info lines as ``rfkit: message``; anything else as ``LEVEL logger: message``."""

    def format(self, record: logging.LogRecord) -> str:
        if record.levelno == logging.INFO and record.name.split(".")[0] == "rfkit":
            return f"rfkit: {record.getMessage()}"
        return f"{record.levelname} {record.name}: {record.getMessage()}"


_verbose = False


def configure_output(verbose: bool) -> None:
    """Set up logging and warning filters for one ``rfkit`` command."""
    global _verbose
    _verbose = verbose
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_Format())
        root.addHandler(handler)
        root.setLevel(logging.INFO)
    logging.getLogger("rfkit").setLevel(os.environ.get("RFKIT_LOG", "INFO"))
    quiet_lightning()
    if verbose:
        return
    if "transformers" in sys.modules:  # weight loading / writing bars; rfkit's own bars stay
        sys.modules["transformers"].utils.logging.disable_progress_bar()
    for category in (DeprecationWarning, PendingDeprecationWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=category, module=THIRD_PARTY)
    warnings.filterwarnings("ignore", message=r"Starting from v1\.9\.0, `tensorboardX` has been removed")
    warnings.filterwarnings("ignore", message=r".*does not have many workers")  # CPU runs read packed blocks in-process


def verbose() -> bool:
    """Whether this command runs with ``--verbose`` (``RFKIT_VERBOSE=1``)."""
    return _verbose


def quiet_lightning() -> None:
    """Lightning's loggers at WARNING unless verbose. Lightning sets its logger to INFO when it is
    imported, so :mod:`rfkit.config.lightning_cli` calls this again once it has imported it."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO if _verbose else logging.WARNING)
