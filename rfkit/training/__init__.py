"""Training a converted model: the LightningModule, freezing, distillation from the original,
attention transfer, LoRA and checkpoints.
"""
