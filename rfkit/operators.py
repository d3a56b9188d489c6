"""Replacement operators: what the replaced heads of a layer become.

An operator is any subclass of :class:`ReplacementOperator`, named in recipes by
``class_path``. :meth:`ReplacementOperator.build` returns the mixer module of one layer. A
mixer takes the values of the replaced heads' KV heads ``(B, L, d_in)`` and returns the
replaced heads' outputs ``(B, L, d_out)`` in their original head order. Its call signature::

    out = mixer(x)                                   # training / full forward
    out, state = mixer(x, *state, return_states=True)  # prefill or continue from a state
    out, *state = mixer.step(x, *state)              # one decode token

``state`` is a tuple of tensors whose size does not grow with the sequence. When a chunk
holds padding (a left-padded batch), the two forward calls also get ``mask=`` (B, L), 1 for
real tokens; pad tokens must leave the state untouched. Unpadded input never sends a mask.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod

from torch import nn

from rfkit.errors import RFKitError


class OperatorError(RFKitError):
    """A bad operator setting. One line for the user, naming the field."""


class ReplacementOperator(ABC):
    """Base class for operators."""

    @abstractmethod
    def build(self, d_in: int, d_out: int, layer_idx: int) -> nn.Module:
        """Implemented by every subclass."""

    def init_args(self) -> dict:
        """The keyword arguments that rebuild this operator (saved in converted model configs)."""
        return {}

    def to_dict(self) -> dict:
        return {"class_path": f"{type(self).__module__}.{type(self).__qualname__}", "init_args": self.init_args()}

    @staticmethod
    def from_dict(spec: dict) -> "ReplacementOperator":
        module_name, _, cls_name = spec["class_path"].rpartition(".")
        cls = getattr(importlib.import_module(module_name), cls_name)
        if not (isinstance(cls, type) and issubclass(cls, ReplacementOperator)):
            raise OperatorError(f"model.operator: {spec['class_path']} is not a ReplacementOperator subclass")
        return cls(**spec.get("init_args", {}))


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise OperatorError(f"model.operator.{name}: {value!r} is not allowed; must be an integer >= 1")
    return value


class MambaOperator(ReplacementOperator):
    """One Mamba block per layer, fed with the values of all the layer's replaced heads.

    The paper's settings are d_state 16, d_conv 4, expand 2, dt_rank 256. ``dt_rank="auto"``
    uses ceil(d_in / 16), which suits small blocks (one 64-wide KV group gives 4).

    Args:
        d_state: SSM state size per channel (N).
        d_conv: Width of the causal depthwise convolution.
        expand: Inner width multiplier: d_inner = expand * d_in.
        dt_rank: Rank of the time-step projection, or "auto".
        use_fast_path: "auto" uses mamba-ssm's fused CUDA kernels when installed and on CUDA,
            "always" requires them, "never" uses the pure-PyTorch scan.
        zero_init_output: Start with ``out_proj`` at zero, so the converted model begins as the
            original with the replaced heads silenced rather than with random noise in their
            place; training then grows the block's contribution. ``false`` is the paper's
            plain random initialisation.
    """

    def __init__(
        self,
        d_state: int = 16,
        d_conv: int = 4,
        expand: int = 2,
        dt_rank: int | str = "auto",
        use_fast_path: str = "auto",
        zero_init_output: bool = True,
    ):
        self.d_state = _positive_int("d_state", d_state)
        self.d_conv = _positive_int("d_conv", d_conv)
        self.expand = _positive_int("expand", expand)
        if dt_rank != "auto":
            _positive_int("dt_rank", dt_rank)
        self.dt_rank = dt_rank
        if use_fast_path not in ("auto", "always", "never"):
            raise OperatorError(
                f"model.operator.use_fast_path: {use_fast_path!r} is not allowed; allowed: auto, always, never"
            )
        self.use_fast_path = use_fast_path
        self.zero_init_output = bool(zero_init_output)

    def init_args(self) -> dict:
        return {
            "d_state": self.d_state,
            "d_conv": self.d_conv,
            "expand": self.expand,
            "dt_rank": self.dt_rank,
            "use_fast_path": self.use_fast_path,
            "zero_init_output": self.zero_init_output,
        }

    def build(self, d_in: int, d_out: int, layer_idx: int) -> nn.Module:
        from rfkit.mamba import MambaBlock

        args = self.init_args()
        zero = args.pop("zero_init_output")
        block = MambaBlock(d_in, d_out, layer_idx=layer_idx, **args)
        if zero:
            nn.init.zeros_(block.out_proj.weight)
        return block
