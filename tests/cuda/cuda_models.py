"""What the CUDA tests share: a tiny converted model of every operator kind, loud enough that its
mixers matter, its float64 CPU reference, the relative error the tolerances are written in, and
the greedy check that holds for bf16 too.

Imported by name (``from cuda_models import converted``): pytest puts tests/cuda on sys.path
(rootdir conftest, prepend import mode).
"""

from __future__ import annotations

import copy

import torch
from helpers import loud_mixers, tiny_model

from rfkit.models.modeling import to_recurformer
from rfkit.models.operators import (
    HybridMambaOperator,
    HybridOperator,
    MambaOperator,
    SinkRecentOperator,
    SlidingWindowOperator,
)

#: every built-in operator, at windows the test sequences leave (sink + window <= 6 tokens)
OPERATORS = {
    "mamba": lambda: MambaOperator(d_state=4, zero_init_output=False),
    "sliding_window": lambda: SlidingWindowOperator(window=5),
    "sink_recent": lambda: SinkRecentOperator(sink=2, window=4),
    "hybrid": lambda: HybridOperator(sink=2, window=4, feature_dim=4, decay_horizon=8.0),
    "hybrid_mamba": lambda: HybridMambaOperator(sink=2, window=4, state_dim=4),
}
WINDOW_KINDS = [kind for kind in OPERATORS if kind != "mamba"]
#: relative-norm error allowed against the float64 reference, by the model's base dtype
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 3e-2}
DTYPES = {"float32": torch.float32, "bf16": torch.bfloat16}


def loud_original():
    """The tiny GQA Llama (4 heads, 2 KV heads, head_dim 16) that :func:`converted` converts, its
    values and attention outputs made loud, float32 on the CPU."""
    model = tiny_model("llama", 4, 2)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.v_proj.weight.mul_(4.0)
            layer.self_attn.o_proj.weight.mul_(4.0)
    return model


def converted(kind: str, dtype: torch.dtype = torch.float32):
    """A tiny GQA Llama (4 heads, 2 KV heads, head_dim 16) in ``dtype`` on the CPU, one KV group
    per layer replaced by operator ``kind``. The values and outputs are made loud and the hybrids'
    gates open, so that the mixers move the logits (a random tiny model barely uses them). A
    bf16 model is converted as ``model.dtype: bfloat16`` loads one: the base in bf16, the new
    weights float32 (rfkit.models.precision)."""
    model = loud_mixers(to_recurformer(loud_original().to(dtype), [[0, 1], [2, 3]], OPERATORS[kind]()))
    return model.eval()


def reference(model):
    """The same weights in float64 on the CPU (bf16 and float32 weights are exact in float64)."""
    return copy.deepcopy(model).to("cpu", torch.float64).eval()


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """``|got - want| / |want|`` over all entries (Frobenius norms), in float64 on the CPU."""
    got, want = got.detach().to("cpu", torch.float64), want.detach().to("cpu", torch.float64)
    return float((got - want).norm() / want.norm())


def assert_greedy(full: torch.Tensor, steps: torch.Tensor, tokens: torch.Tensor, tol: float, clear: float) -> None:
    """Greedy ``tokens`` (B, T) from ``generate``, its raw logits at each step ``steps`` (B, T, V)
    and one full forward's logits over the result at the positions before them ``full``: the
    step logits are the full forward's (relative error below ``tol``), each token is its step's
    argmax, and so it is the full forward's argmax wherever the full forward's top two are further
    apart than twice the largest gap between the two (near-ties within the dtype's rounding may go
    either way). At least a fraction ``clear`` of the positions must be so, or the check proves
    nothing."""
    full, steps = full.detach().float(), steps.detach().float()
    assert rel_err(steps, full) < tol, rel_err(steps, full)
    assert torch.equal(tokens, steps.argmax(-1))
    gap = float((steps - full).abs().max())
    top = full.topk(2, dim=-1).values
    sure = top[..., 0] - top[..., 1] > 2 * gap
    assert torch.equal(tokens[sure], full.argmax(-1)[sure])
    share = float(sure.float().mean())
    assert share >= clear, f"only {int(sure.sum())} of {sure.numel()} positions are clear of {2 * gap:.2g}"
