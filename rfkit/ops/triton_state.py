"""The hybrid's state part as chunked Triton kernels, forward and backward, for GPUs.

The hybrid mixer (:mod:`rfkit.models.hybrid`) reads, for every replaced query head, a decayed
linear-attention state over the tokens that have left its window. In the tiled path that part is,
per query group ``g`` (a KV head, or a query head where groups are not shared), a causal linear
attention with a scalar decay ``gamma_g = e^{lambda_g}`` (``lambda_g <= 0``) and a starting state::

    o_i = gamma^(i+1) q_i S0 + sum_{t <= i} gamma^(i-t) (q_i . k_t) v_t

with ``q`` the feature-mapped queries ``(B, G, R, L, f)`` (``R`` query heads read one group's keys),
``k`` the feature-mapped old keys ``(B, G, L, f)``, ``v`` their values with a column of ones
appended (so the normaliser ``zl`` comes out as the last column) ``(B, G, L, D)`` and ``S0`` the
state before the chunk ``(B, G, f, D)``. The PyTorch twin (``HybridWindowAttention._combine``)
runs it as a few batched products over chunks of ``TILE`` tokens, every intermediate written to
memory. Here, in chunks of :data:`CHUNK` tokens (:mod:`rfkit.ops.triton_state_kernels`): one walk
in order per (row, group, slice of ``D``) writes the state before every chunk,
``S <- gamma^C S + sum_t gamma^(C-1-u_t) k_t v_t^T`` (the query heads of a group share it); then
one program per (row, group, query head, chunk, slice of ``D``), all at once, computes the chunk's
output, ``q S`` for what came before plus a masked ``C x C`` product for the chunk itself.

The backward likewise: ``dq`` per chunk from the saved states; one walk in reverse per (row,
group, slice) for ``dS``, what the later chunks' queries read of a key (``S0``'s gradient is its
last value); then ``dk`` and ``dv`` per chunk. The decay's gradient needs no kernel: with ``i``,
``t`` the positions, ``dL/dlambda = sum_i i (q_i . dq_i) - sum_t t (k_t . dk_t) + <S0, dS0>`` (the
powers are ``e^{lambda (i - t)}``; ``S0`` stands at position -1), reduced in float64 from the
kernels' gradients.

Float32 throughout (the precision policy computes the hybrid in float32 under bf16 activations),
``tl.dot`` at IEEE precision (no TF32), so the kernels agree with the PyTorch path to float32
rounding. Opt-in (``RFKIT_STATE_BACKEND=triton``, or ``HybridWindowAttention.state_backend``) until
the GPU check (``benchmarks/gpu/window_backends.py``) has shown it correct and faster on a GPU.
Triton ships with CUDA builds of PyTorch; it is imported only when this backend serves. On a CPU
the kernels run only in Triton's interpreter, for the tests and the rehearsal (:data:`CPU_INTERPRET`).
"""

from __future__ import annotations

import logging
import os
import sys

from rfkit.errors import RFKitError

log = logging.getLogger(__name__)

#: the backends the hybrid's state part can run on (``HybridWindowAttention.state_backend``)
BACKENDS = ("torch", "triton")
ENV = "RFKIT_STATE_BACKEND"
#: The kernels serve CPU tensors too, through Triton's interpreter (numpy, one program at a time):
#: off by default, far slower than the PyTorch path. The CPU tests and the GPU check's rehearsal
#: turn it on, to hold these kernels to the PyTorch path where no GPU is.
CPU_INTERPRET = False
#: forward passes the kernels served in this process: tests and the GPU check read its change
served = 0
#: tokens per chunk (a power of two, at least 16: ``tl.dot``'s smallest side)
CHUNK = 64
_told: set = set()
_KERNELS: dict = {}
_PROBED: dict = {}  # interpreter_problem's answer, once per process


class StateBackendError(RFKitError):
    """An unknown state backend (the environment variable or the class attribute)."""


def resolve(backend: str | None, field: str = ENV) -> str:
    """``backend`` checked, or when None the one ``RFKIT_STATE_BACKEND`` names (``torch`` when
    unset); one line naming ``field`` for anything else (the ``rfkit`` console script asks before
    any command runs)."""
    if backend is None:
        backend = os.environ.get(ENV, "").strip() or "torch"
    if backend not in BACKENDS:
        raise StateBackendError(f"{field}: {backend!r} is not allowed; allowed: {', '.join(BACKENDS)}")
    return backend


def importable() -> bool:
    """Whether Triton imports here (CUDA builds of torch bring it; the test extra installs it)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def serves(device, feature_dim: int) -> bool:
    """Whether the kernels serve tensors on ``device`` with ``feature_dim`` features: a CUDA device
    (or the CPU with :data:`CPU_INTERPRET`), Triton importable, ``f`` a power of two from 16 to
    128. Each refusal's reason is one warning line per process."""
    kind = getattr(device, "type", str(device))
    if kind == "cuda" or (kind == "cpu" and CPU_INTERPRET):
        if not importable():
            return _refuse("triton", f"{ENV}=triton: Triton is not installed; the hybrid's state part stays on PyTorch")
        if kind == "cpu" and (problem := interpreter_problem()) is not None:
            return _refuse("interpreter", f"{ENV}=triton: Triton's interpreter cannot run the kernels here ({problem}); "
                           "the hybrid's state part stays on PyTorch")  # fmt: skip
        if feature_dim < 16 or feature_dim > 128 or feature_dim & (feature_dim - 1):
            return _refuse(f"f{feature_dim}", f"{ENV}=triton: the kernels take 16, 32, 64 or 128 features, not "
                           f"{feature_dim}; the hybrid's state part stays on PyTorch")  # fmt: skip
        return True
    return _refuse(kind, f"{ENV}=triton: the Triton kernels serve CUDA devices; the hybrid's state part stays on PyTorch on {kind}")


def interpreter_problem() -> str | None:
    """Why Triton's interpreter cannot run the kernels in this environment, or None; asked once per
    process, by running a one-program kernel that loops to a bound passed at run time, as every
    kernel does. Known case: Triton 3.6 and older pass such a bound to ``range`` as a one-element
    NumPy array and take ``int()`` of it, which NumPy 2.5 refuses ("only 0-dimensional arrays can
    be converted to Python scalars"); the GPU machine's image pairs Triton 3.6 with NumPy 2.5. Only
    the CPU twin meets it: on a GPU the kernels are compiled, not interpreted."""
    if "interpreter" not in _PROBED:
        _PROBED["interpreter"] = _probe_interpreter()
    return _PROBED["interpreter"]


def _probe_interpreter() -> str | None:
    try:
        import numpy
        import torch
        import triton
        from triton.runtime.interpreter import InterpretedFunction

        from rfkit.ops.triton_state_kernels import probe

        x = torch.zeros(2)
        InterpretedFunction(probe)[(1,)](x, 3)
        if x.tolist() != [3.0, 3.0]:
            return f"Triton {triton.__version__}'s interpreter counted {x.tolist()} in a loop to 3"
    except Exception as err:  # noqa: BLE001 - whatever stops it, the twin cannot run here
        versions = ", ".join(f"{name} {getattr(sys.modules.get(module), '__version__', '?')}"
                             for name, module in (("Triton", "triton"), ("NumPy", "numpy")))  # fmt: skip
        return f"{versions}: {type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}"
    return None


def _refuse(key: str, message: str) -> bool:
    if key not in _told:
        _told.add(key)
        log.warning(message)
    return False


def _kernels(interpret: bool) -> dict:
    """The kernels, compiled (``triton.jit``) or, on the CPU, interpreted; made once each."""
    if interpret not in _KERNELS:
        import triton

        from rfkit.ops import triton_state_kernels as source

        def make(fn):
            if interpret:
                from triton.runtime.interpreter import InterpretedFunction

                return InterpretedFunction(fn)
            return triton.jit(fn)

        names = ("states", "outputs", "grad_q", "grad_states", "grad_kv")
        _KERNELS[interpret] = {name: make(getattr(source, name)) for name in names}
    return _KERNELS[interpret]


def block_d(D: int, F: int) -> int:
    """The slice of ``D`` per program: the least work counting the padding of the last slice
    and the ``q k^T`` products each slice recomputes (``F`` wide); ties to the wider slice.
    (65 = 64 values and the normaliser's column, 16 features: 32, three slices.)"""
    return min((64, 32, 16), key=lambda bd: -(-D // bd) * (bd + F))


def _shapes(q, v):
    B, G, R, L, F = q.shape
    D = v.shape[-1]
    BD = block_d(D, F)
    return B, G, R, L, F, D, BD, -(-L // CHUNK), -(-D // BD)


def _forward_launch(q, k, v, S0, lam):
    """``(o, states)``: the output and the state before every chunk (kept for the backward)."""
    global served
    B, G, R, L, F, D, BD, N, J = _shapes(q, v)
    kernels = _kernels(q.device.type != "cuda")
    states = q.new_empty(B, G, N, F, D)
    kernels["states"][(B * G, J)](k, v, S0, lam, states, G, L, D, N, F=F, C=CHUNK, BD=BD)
    o = q.new_empty(B, G, R, L, D)
    kernels["outputs"][(B * G * R * N, J)](q, k, v, states, lam, o, G, R, L, D, N, F=F, C=CHUNK, BD=BD)
    served += 1
    return o, states


def _backward_launch(q, k, v, states, lam, do):
    """``(dq, dk, dv, dS0)``."""
    B, G, R, L, F, D, BD, N, J = _shapes(q, v)
    kernels = _kernels(q.device.type != "cuda")
    dq = q.new_empty(J, B, G, R, L, F)
    kernels["grad_q"][(B * G * R * N, J)](do, k, v, states, lam, dq, B * G * R, G, R, L, D, N, F=F, C=CHUNK, BD=BD)
    d_states, dS0 = states.new_empty(states.shape), q.new_empty(B, G, F, D)
    kernels["grad_states"][(B * G, J)](q, do, lam, d_states, dS0, G, R, L, D, N, F=F, C=CHUNK, BD=BD)
    dk, dv = q.new_empty(J, B, G, L, F), v.new_empty(B, G, L, D)
    kernels["grad_kv"][(B * G * N, J)](q, k, v, do, d_states, lam, dk, dv, B * G, G, R, L, D, N, F=F, C=CHUNK, BD=BD)
    return dq.sum(0), dk.sum(0), dv, dS0


def _decay_grad(q, dq, k, dk, S0, dS0):
    """``dL/dlambda`` per group (G,): ``sum_i i q_i.dq_i - sum_t t k_t.dk_t + <S0, dS0>``, in float64."""
    import torch

    pos = torch.arange(q.shape[-2], device=q.device, dtype=torch.float64)
    qq = (q.double() * dq.double()).sum(-1)  # (B, G, R, L)
    kk = (k.double() * dk.double()).sum(-1)  # (B, G, L)
    s = (S0.double() * dS0.double()).sum((-1, -2))  # (B, G)
    return (qq @ pos).sum((0, 2)) - (kk @ pos).sum(0) + s.sum(0)


def _function():
    import torch

    class DecayedLinearState(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, S0, lam):
            ctx.dtypes = [t.dtype for t in (q, k, v, S0, lam)]
            q, k, v, S0, lam = (t.float().contiguous() for t in (q, k, v, S0, lam))
            o, states = _forward_launch(q, k, v, S0, lam)
            ctx.save_for_backward(q, k, v, S0, lam, states)
            return o

        @staticmethod
        def backward(ctx, do):
            q, k, v, S0, lam, states = ctx.saved_tensors
            dq, dk, dv, dS0 = _backward_launch(q, k, v, states, lam, do.float().contiguous())
            dlam = _decay_grad(q, dq, k, dk, S0, dS0) if ctx.needs_input_grad[4] else None
            grads = (dq, dk, dv, dS0, dlam)
            return tuple(None if g is None else g.to(dtype) for g, dtype in zip(grads, ctx.dtypes))

    return DecayedLinearState


_FUNCTION = None


def decayed_linear_state(q, k, v, S0, log_gamma):
    """``o`` ``(B, G, R, L, D)``: ``o_i = gamma^(i+1) q_i S0 + sum_{t <= i} gamma^(i-t) (q_i . k_t) v_t``
    per group (module docstring), differentiable in every input, ``log_gamma`` ``(G,)`` included
    (zeros: no decay). Float32 in and out."""
    global _FUNCTION
    if _FUNCTION is None:
        _FUNCTION = _function()
    return _FUNCTION.apply(q, k, v, S0, log_gamma)
