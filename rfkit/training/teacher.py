"""The original model as a teacher, sharing every module it has in common with the converted one.

A converted model differs from its original only in the attention modules of converted layers
(and in LoRA adapters, when a recipe adds them). :class:`SharedTeacher` therefore holds just
those original attention modules (``model.rf_originals``, kept aside by
:func:`rfkit.models.modeling.to_recurformer`) and runs the original model by swapping them back in for
one forward, with LoRA adapters switched off: embeddings, norms, MLPs and untouched layers are
the student's own tensors, never copied.

The teacher is exact as long as the shared modules stay as they were: train only the new
blocks and adapters (``freeze: pretrained`` or ``mixers``). A recipe that trains shared
weights directly (``freeze: none``) must set ``share_modules: false`` (a frozen full copy).
"""

from __future__ import annotations

import copy
from contextlib import contextmanager

import torch
from torch import nn

from rfkit.errors import RFKitError

#: why a teacher that shares modules cannot be built: the student trains some of them
SHARED_TEACHER_FROZEN = (
    "model.distill.share_modules: the teacher shares the pretrained weights that model.freeze trains; "
    "freeze them (freeze: pretrained, mixers or lora) or set share_modules: false"
)


class TeacherError(RFKitError):
    """The teacher cannot be built as asked; one line for the user."""


def tensor_bytes(modules) -> int:
    """Bytes of the parameters and buffers of ``modules`` (each tensor counted once)."""
    seen, total = set(), 0
    for module in modules:
        for t in list(module.parameters()) + list(module.buffers()):
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total


def _lora_layers(model) -> list[nn.Module]:
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # peft is a core dependency; tolerate its absence for plain models
        return []
    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


def decoder_layer(layer: nn.Module) -> nn.Module:
    """The decoder layer itself, inside any FSDP / activation-checkpointing wrappers. Those
    wrappers forward attribute reads to it but not assignments, so the attention swap must
    happen on the layer they wrap."""
    while True:
        inner = layer._modules.get("_fsdp_wrapped_module") or layer._modules.get("_checkpoint_wrapped_module")
        if inner is None:
            return layer
        layer = inner


class SharedTeacher:
    """Runs the original model inside the converted one (see the module docstring).

    Args:
        model: A converted model with ``rf_originals`` (from :func:`rfkit.conversion.convert.convert`).
        share_modules: ``False`` keeps a frozen deep copy of the original instead (needed when
            shared weights are trained); costs a whole second model.
    """

    def __init__(self, model, share_modules: bool = True):
        originals = getattr(model, "rf_originals", None)
        if originals is None:
            raise TeacherError("distill: the model has no original attention modules (was it converted by rfkit?)")
        self.model = model
        self.share_modules = share_modules
        self.originals: dict[int, nn.Module] = originals
        for module in originals.values():
            module.requires_grad_(False)
        self.copy = None
        if not share_modules:
            self.copy = self._full_copy()

    def _full_copy(self):
        with self.active():
            teacher = copy.deepcopy(self.model)
        teacher.requires_grad_(False).eval()
        return teacher

    # -- memory -------------------------------------------------------------------------------
    def memory(self) -> dict:
        """Bytes the teacher holds beyond the student, and what a full copy would hold."""
        full = tensor_bytes([self.model]) - sum(tensor_bytes([m]) for m in self._student_attention()) + tensor_bytes(
            self.originals.values()
        )
        held = full if self.copy is not None else tensor_bytes(self.originals.values())
        return {"teacher_bytes": held, "full_copy_bytes": full, "shared": self.copy is None}

    def _student_attention(self):
        layers = self.model.get_decoder().layers
        return [decoder_layer(layers[i]).self_attn for i in self.originals]

    # -- running ------------------------------------------------------------------------------
    @contextmanager
    def active(self):
        """Inside this block ``self.model`` is the original model (no LoRA, original attention)."""
        layers = [decoder_layer(layer) for layer in self.model.get_decoder().layers]
        swapped = {}
        device = next(self.model.parameters()).device
        lora = [m for m in _lora_layers(self.model) if not m.disable_adapters]
        # peft's enable_adapters(True) also sets requires_grad on the adapters: remember and
        # restore the flags, so a freeze stage that holds the adapters still keeps holding them.
        flags = [(p, p.requires_grad) for m in lora for p in m.parameters()]
        try:
            for i, original in self.originals.items():
                ref = layers[i].self_attn.o_proj.weight
                if original.v_proj.weight.device != device or original.v_proj.weight.dtype != ref.dtype:
                    original.to(device=device, dtype=ref.dtype)
                swapped[i] = layers[i].self_attn
                layers[i].self_attn = original
            for m in lora:
                m.enable_adapters(False)
            yield self.model
        finally:
            for i, student in swapped.items():
                layers[i].self_attn = student
            for m in lora:
                m.enable_adapters(True)
            for p, flag in flags:
                p.requires_grad_(flag)

    @torch.no_grad()
    def __call__(self, **inputs):
        """A forward of the original model (no gradient), with the model's ``forward`` keywords."""
        if self.copy is not None:
            device = next(self.model.parameters()).device
            if next(self.copy.parameters()).device != device:
                self.copy.to(device)
            return self.copy(**inputs)
        with self.active() as model:
            was_training = model.training
            model.eval()
            try:
                return model(**inputs)
            finally:
                model.train(was_training)
