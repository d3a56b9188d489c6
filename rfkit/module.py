"""The LightningModule, under the import path recipes and checkpoints name
(``model: class_path: rfkit.module.RecurFormerModule``).

The code lives in :mod:`rfkit.training.module`; this module keeps the public path stable.
"""

from rfkit.training.module import RecurFormerModule

__all__ = ["RecurFormerModule"]
