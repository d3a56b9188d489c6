"""Mamba (S6) block used to replace attention heads.

:class:`MambaBlock` (``in_proj`` -> causal conv -> selective scan -> ``out_proj``) and the choice
of the path its scan runs on. The scans themselves are in :mod:`rfkit.ops`: the pure-PyTorch
ones in :mod:`rfkit.ops.scan` (:func:`~rfkit.ops.scan.selective_scan_prefix` is the default) and
the compiled CPU kernel for inference in :mod:`rfkit.ops.cpu_kernels`.

When the optional CUDA packages are installed (``pip install rfkit[cuda]``: ``mamba_ssm`` and
``causal_conv1d``) and the tensors live on a GPU, :class:`MambaBlock` can use their fused
kernels instead. Importing this module never requires them.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

from rfkit.models.mixer import ReplacementMixer
from rfkit.ops import cpu_kernels
from rfkit.ops.cpu_kernels import mamba_step_cpu, selective_scan_cpu, selective_scan_cpu_train
from rfkit.ops.scan import _finish_output, check_positive_int, compute_dtype, selective_scan_prefix

log = logging.getLogger(__name__)

# Optional fused kernels. Any failure while importing them (missing package, CUDA/ABI mismatch
# of the compiled extension, broken triton) only disables the fast path.
_FUSED_IMPORT_ERRORS: list[str] = []
try:
    from mamba_ssm.ops.selective_scan_interface import selective_scan_fn
except Exception as exc:  # noqa: BLE001 - an optional accelerator must never break the import
    selective_scan_fn = None
    _FUSED_IMPORT_ERRORS.append(f"mamba_ssm.selective_scan_fn: {type(exc).__name__}: {exc}")
try:
    from causal_conv1d import causal_conv1d_fn, causal_conv1d_update
except Exception as exc:  # noqa: BLE001
    causal_conv1d_fn = None
    causal_conv1d_update = None
    _FUSED_IMPORT_ERRORS.append(f"causal_conv1d: {type(exc).__name__}: {exc}")
try:
    from mamba_ssm.ops.triton.selective_state_update import selective_state_update
except Exception as exc:  # noqa: BLE001
    selective_state_update = None
    _FUSED_IMPORT_ERRORS.append(f"mamba_ssm.selective_state_update: {type(exc).__name__}: {exc}")

FAST_PATH_CHOICES = ("auto", "always", "never")

_LOGGED_PATHS: set[str] = set()
_MSG_FUSED = "mamba: fused CUDA kernels (mamba_ssm)"
_MSG_TORCH = "mamba: pure-PyTorch scan"
_MSG_CPU = "mamba: compiled CPU scan kernel (inference)"
_MSG_CPU_TRAIN = "mamba: compiled CPU scan kernel (training, with its backward)"


def fused_kernels_available() -> bool:
    """True when every optional fused kernel imported."""
    return (
        selective_scan_fn is not None
        and causal_conv1d_fn is not None
        and causal_conv1d_update is not None
        and selective_state_update is not None
    )


def _log_path_once(message: str) -> None:
    # One info line per process for each path that actually runs.
    if message not in _LOGGED_PATHS:
        _LOGGED_PATHS.add(message)
        log.info(message)


def _check_positive_float(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


class MambaBlock(ReplacementMixer):
    """Mamba (S6) mixer mapping (B, L, d_in) -> (B, L, d_out).

    Layout and initialisation follow the reference Mamba block (``in_proj`` -> depthwise causal
    ``conv1d`` + SiLU -> ``x_proj`` -> ``dt_proj`` -> selective scan gated by SiLU(z) ->
    ``out_proj``), with separate input and output widths so a block can stand in for a subset of
    attention heads.

    Args:
        d_in, d_out: input / output feature sizes.
        d_state: SSM state size N. d_conv: causal conv kernel size. expand: d_inner = expand * d_in.
        dt_rank: rank of the delta projection, or "auto" = ceil(d_in / 16).
        dt_min, dt_max, dt_init_floor: range of the initial step sizes (log-uniform) and floor.
        conv_bias: bias of the conv. bias: bias of in_proj / out_proj.
        use_fast_path: "auto" (fused kernels when installed and on CUDA), "always" (fused or a
            RuntimeError), "never" (pure PyTorch).
        layer_idx: optional index of the layer (for caches).
        chunk_size: chunk length of the PyTorch scan (default :data:`rfkit.ops.scan.DEFAULT_CHUNK_SIZE`).
        device, dtype: factory arguments for the parameters.

    Dtypes (:mod:`rfkit.models.precision`): the block takes activations of any dtype and returns its
    output in theirs; its projections run in its weights' dtype, the scan in float32 (float64 for a
    float64 block), and the SSM state is kept in that compute dtype whatever the weights' dtype.
    """

    handles_dtype = True

    def __init__(
        self,
        d_in: int,
        d_out: int,
        d_state: int = 16,
        d_conv: int = 4,
        expand: int = 2,
        dt_rank: int | str = "auto",
        dt_min=0.001,
        dt_max=0.1,
        dt_init_floor=1e-4,
        conv_bias=True,
        bias=False,
        use_fast_path: str = "auto",
        layer_idx: int | None = None,
        *,
        chunk_size: int | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.d_in = check_positive_int("d_in", d_in)
        self.d_out = check_positive_int("d_out", d_out)
        self.d_state = check_positive_int("d_state", d_state)
        self.d_conv = check_positive_int("d_conv", d_conv)
        self.expand = check_positive_int("expand", expand)
        if dt_rank == "auto":
            dt_rank = math.ceil(d_in / 16)
        elif isinstance(dt_rank, str):
            raise ValueError(f"dt_rank must be a positive int or 'auto', got {dt_rank!r}")
        self.dt_rank = check_positive_int("dt_rank", dt_rank)
        dt_min = _check_positive_float("dt_min", dt_min)
        dt_max = _check_positive_float("dt_max", dt_max)
        if dt_min > dt_max:
            raise ValueError(f"dt_min must be <= dt_max, got dt_min={dt_min!r} > dt_max={dt_max!r}")
        dt_init_floor = _check_positive_float("dt_init_floor", dt_init_floor)
        if use_fast_path not in FAST_PATH_CHOICES:
            raise ValueError(f"use_fast_path must be one of {FAST_PATH_CHOICES}, got {use_fast_path!r}")
        if layer_idx is not None and (isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or layer_idx < 0):
            raise ValueError(f"layer_idx must be None or a non-negative int, got {layer_idx!r}")
        if chunk_size is not None:
            check_positive_int("chunk_size", chunk_size)
        self.use_fast_path = use_fast_path
        self.layer_idx = layer_idx
        self.chunk_size = chunk_size
        self.d_inner = self.expand * self.d_in
        fk = {"device": device, "dtype": dtype}

        self.in_proj = nn.Linear(self.d_in, 2 * self.d_inner, bias=bias, **fk)
        self.conv1d = nn.Conv1d(
            self.d_inner,
            self.d_inner,
            kernel_size=self.d_conv,
            groups=self.d_inner,
            padding=self.d_conv - 1,
            bias=conv_bias,
            **fk,
        )
        self.x_proj = nn.Linear(self.d_inner, self.dt_rank + 2 * self.d_state, bias=False, **fk)
        self.dt_proj = nn.Linear(self.dt_rank, self.d_inner, bias=True, **fk)
        self.out_proj = nn.Linear(self.d_inner, self.d_out, bias=bias, **fk)

        # A = -exp(A_log) with A_log[d, n] = log(n + 1): the S4D-real initialisation.
        a = torch.arange(1, self.d_state + 1, dtype=torch.float32, device=device)
        self.A_log = nn.Parameter(torch.log(a).repeat(self.d_inner, 1))  # (d_inner, d_state)
        self.A_log._no_weight_decay = True
        self.D = nn.Parameter(torch.ones(self.d_inner, device=device))  # (d_inner,)
        self.D._no_weight_decay = True

        self._init_dt_proj(dt_min, dt_max, dt_init_floor)

    @torch.no_grad()
    def _init_dt_proj(self, dt_min: float, dt_max: float, dt_init_floor: float) -> None:
        std = self.dt_rank**-0.5
        nn.init.uniform_(self.dt_proj.weight, -std, std)
        # dt log-uniform in [dt_min, dt_max], floored; bias = softplus^-1(dt) = dt + log(1 - exp(-dt))
        w = self.dt_proj.weight
        u = torch.rand(self.d_inner, device=w.device, dtype=torch.float32)
        dt = torch.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        dt = dt.clamp(min=dt_init_floor)
        inv_dt = dt + torch.log(-torch.expm1(-dt))
        self.dt_proj.bias.copy_(inv_dt)
        self.dt_proj.bias._no_reinit = True

    def extra_repr(self) -> str:
        return (
            f"d_in={self.d_in}, d_out={self.d_out}, d_inner={self.d_inner}, d_state={self.d_state}, "
            f"d_conv={self.d_conv}, dt_rank={self.dt_rank}, use_fast_path={self.use_fast_path!r}"
        )

    # ------------------------------------------------------------------ path choice
    def _fast(self, ref: torch.Tensor) -> bool:
        """Whether the fused kernels run for a tensor on ref's device; logs the path once."""
        if self.use_fast_path == "never":
            fast = False
        elif self.use_fast_path == "auto":
            fast = fused_kernels_available() and ref.is_cuda
        else:  # "always"
            if not fused_kernels_available():
                raise RuntimeError(
                    "MambaBlock(use_fast_path='always') needs the fused Mamba kernels, which could not be "
                    "imported (" + "; ".join(_FUSED_IMPORT_ERRORS) + "). Install them with "
                    "`pip install rfkit[cuda]` (mamba-ssm, causal-conv1d; needs a CUDA GPU) or use "
                    "use_fast_path='auto' or 'never'."
                )
            if not ref.is_cuda:
                raise RuntimeError(
                    f"MambaBlock(use_fast_path='always') needs CUDA tensors for the fused kernels "
                    f"(`pip install rfkit[cuda]`), got a tensor on {ref.device}; move the model to a GPU or "
                    f"use use_fast_path='auto' or 'never'."
                )
            fast = True
        if fast:
            _log_path_once(_MSG_FUSED)
        return fast

    def _cpu_kernel(self, ref: torch.Tensor, *needs: torch.Tensor) -> bool:
        """Whether the compiled CPU scan runs: CPU, float32/16 (not float64), no gradient needed by
        any of ``needs`` (the tensors the kernel reads: asked of the tensors themselves, since
        under FSDP a block's weights are plain tensors during its forward, not parameters),
        use_fast_path != "never", and the kernel built (see :mod:`rfkit.ops.cpu_kernels`)."""
        if self.use_fast_path == "never" or ref.device.type != "cpu" or ref.dtype == torch.float64:
            return False
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in needs):
            return False
        if not cpu_kernels.available():
            return False
        _log_path_once(_MSG_CPU)
        return True

    def _cpu_train_kernel(self, ref: torch.Tensor) -> bool:
        """Whether the compiled CPU training scan runs (when :meth:`_cpu_kernel` does not because a
        gradient is needed): CPU, not float64, at least one token, use_fast_path != "never" and
        the kernel built. Its forward is the sequential recurrence and its backward recomputes
        the states of each chunk, where the PyTorch prefix scan holds (batch, d_inner, length,
        d_state) tensors for autograd."""
        if self.use_fast_path == "never" or ref.device.type != "cpu" or ref.dtype == torch.float64:
            return False
        if ref.shape[-1] == 0 or not torch.is_grad_enabled() or not cpu_kernels.available():
            return False
        _log_path_once(_MSG_CPU_TRAIN)
        return True

    def _cpu_step(self, ref: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor) -> bool:
        """Whether the compiled CPU decode step runs: as :meth:`_cpu_kernel`, plus float32
        weights and contiguous float32 states (the kernel updates them in place)."""
        tensors = (
            conv_state, ssm_state, self.conv1d.weight, self.x_proj.weight, self.dt_proj.weight, self.dt_proj.bias,
            self.A_log, self.D,
        )  # fmt: skip
        for t in tensors:
            if t.dtype != torch.float32 or not t.is_contiguous():
                return False
        bias = self.conv1d.bias
        if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
            return False
        return self._cpu_kernel(ref, ref, bias, self.in_proj.weight, self.out_proj.weight, *tensors[2:])

    # ------------------------------------------------------------------ caches
    def allocate_inference_cache(self, batch_size: int, dtype=None, device=None):
        """Zero (conv_state (B, d_inner, d_conv), ssm_state (B, d_inner, d_state)).

        The conv state (the last inputs) takes ``dtype``, default the conv weight's; the SSM state
        (a running sum) takes the compute dtype of ``dtype`` or of the weights: float32, float64 for
        float64. device defaults to the parameters' device.
        """
        device = self.conv1d.weight.device if device is None else device
        conv_dtype = self.conv1d.weight.dtype if dtype is None else dtype
        ssm_dtype = self._state_dtype() if dtype is None else compute_dtype(dtype)  # a sum: never half precision
        conv_state = torch.zeros(batch_size, self.d_inner, self.d_conv, device=device, dtype=conv_dtype)
        ssm_state = torch.zeros(batch_size, self.d_inner, self.d_state, device=device, dtype=ssm_dtype)
        return conv_state, ssm_state

    def cache_dtype(self, kv_dtype: torch.dtype) -> torch.dtype:
        """A model's forward keeps the conv inputs in the conv weight's dtype (float32 new weights
        beside a bf16 base), whatever the model's K/V dtype."""
        return self.conv1d.weight.dtype

    def state_bytes(self, batch_size: int, dtype=torch.float32) -> int:
        """Bytes of one (conv_state, ssm_state) pair for batch_size sequences: the conv state in
        ``dtype``, the SSM state in its compute dtype (float32 beside half precision)."""
        conv = torch.empty((), dtype=dtype).element_size()
        ssm = torch.empty((), dtype=compute_dtype(dtype)).element_size()
        return int(batch_size) * self.d_inner * (self.d_conv * conv + self.d_state * ssm)

    def _state_dtype(self) -> torch.dtype:
        """The SSM state's dtype: the scan's compute dtype for these weights."""
        return compute_dtype(self.dt_proj.weight.dtype)

    # ------------------------------------------------------------------ forward
    def _conv_weight(self) -> torch.Tensor:
        return self.conv1d.weight[:, 0, :]  # (d_inner, d_conv)

    def forward(self, hidden_states, conv_state=None, ssm_state=None, mask=None, return_states=False):
        """hidden_states (B, L, d_in) -> (B, L, d_out) [, (conv_state, ssm_state)].

        conv_state (B, d_inner, d_conv) / ssm_state (B, d_inner, d_state): continue from a previous
        chunk (not modified in place). mask (B, L), 1/True for real tokens: masked positions
        (left padding) feed zeros to the conv and use delta = 0, so they leave the state untouched;
        their outputs are meaningless. Only left padding gives the same states as the unpadded
        sequence (a masked position in the middle still shifts the conv window).
        With return_states, also returns the new states: conv_state = the last d_conv conv inputs
        (zero-padded on the left / continued from the old conv_state), ssm_state = last h, in the
        dtype of the given states (else the parameters' dtype).
        """
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != self.d_in:
            raise ValueError(f"hidden_states must be (batch, length, {self.d_in}), got {tuple(hidden_states.shape)}")
        bsz, length, _ = hidden_states.shape
        if mask is not None and tuple(mask.shape) != (bsz, length):
            raise ValueError(f"mask must be (batch, length) = {(bsz, length)}, got {tuple(mask.shape)}")
        for name, st, last in (("conv_state", conv_state, self.d_conv), ("ssm_state", ssm_state, self.d_state)):
            if st is not None and tuple(st.shape) != (bsz, self.d_inner, last):
                raise ValueError(f"{name} must be {(bsz, self.d_inner, last)}, got {tuple(st.shape)}")
        fast = self._fast(hidden_states)
        out_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(self.in_proj.weight.dtype)  # activations of any dtype

        xz = self.in_proj(hidden_states).transpose(1, 2)  # (B, 2*d_inner, L)
        x, z = xz.chunk(2, dim=1)  # (B, d_inner, L) each
        m = None
        if mask is not None:
            m = mask.to(device=x.device, dtype=x.dtype)[:, None, :]  # (B, 1, L)
            x = x * m  # masked positions feed zeros to the conv

        # --- causal depthwise conv + SiLU
        weight = self._conv_weight()  # (d_inner, d_conv)
        if fast and conv_state is None:
            xc = causal_conv1d_fn(x.contiguous(), weight, self.conv1d.bias, activation="silu")  # (B, d_inner, L)
        else:
            if conv_state is None:
                prev = x.new_zeros((bsz, self.d_inner, self.d_conv - 1))
            else:
                prev = conv_state[:, :, 1:].to(x.dtype)  # (B, d_inner, d_conv-1)
            xpad = torch.cat([prev, x], dim=-1)  # (B, d_inner, d_conv-1+L)
            xc = F.silu(F.conv1d(xpad, self.conv1d.weight, self.conv1d.bias, groups=self.d_inner))  # (B, d_inner, L)
        new_conv_state = None
        if return_states:
            old = conv_state.to(x.dtype) if conv_state is not None else x.new_zeros((bsz, self.d_inner, self.d_conv))
            new_conv_state = torch.cat([old, x[:, :, -self.d_conv :]], dim=-1)[:, :, -self.d_conv :].contiguous()
            new_conv_state = new_conv_state.to(conv_state.dtype if conv_state is not None else self.conv1d.weight.dtype)

        # --- input-dependent SSM parameters
        x_dbl = self.x_proj(xc.transpose(1, 2))  # (B, L, dt_rank + 2N)
        dt, Bm, Cm = torch.split(x_dbl, [self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt = F.linear(dt, self.dt_proj.weight, self.dt_proj.bias)  # (B, L, d_inner)
        cdt = compute_dtype(dt.dtype)  # float32 (float64 for a float64 block)
        delta = F.softplus(dt.to(cdt)).transpose(1, 2)  # (B, d_inner, L)
        if m is not None:
            delta = delta * m.to(cdt)  # delta = 0: exp(0*A) = 1 and no input -> state passes through
        Bm = Bm.transpose(1, 2).contiguous()  # (B, N, L)
        Cm = Cm.transpose(1, 2).contiguous()  # (B, N, L)
        A = -torch.exp(self.A_log.to(cdt))  # (d_inner, N)
        D = self.D.to(cdt)

        if fast and ssm_state is None:
            res = selective_scan_fn(
                xc.contiguous(),
                delta.to(xc.dtype).contiguous(),
                A,
                Bm,
                Cm,
                D,
                z=z.contiguous(),
                delta_bias=None,
                delta_softplus=False,
                return_last_state=return_states,
            )
        elif self._cpu_kernel(xc, xc, delta, A, Bm, Cm, D, z):
            y, last = selective_scan_cpu(xc, delta, A, Bm, Cm, D, z=z, initial_state=ssm_state)
            res = (y.to(xc.dtype), last) if return_states else y.to(xc.dtype)
        elif self._cpu_train_kernel(xc):
            y, last = selective_scan_cpu_train(xc, delta, A, Bm, Cm, initial_state=ssm_state)
            y = _finish_output(y, xc.to(cdt), D, z, cdt).to(xc.dtype)
            res = (y, last) if return_states else y
        else:
            _log_path_once(_MSG_TORCH)
            res = selective_scan_prefix(
                xc,
                delta,
                A,
                Bm,
                Cm,
                D,
                z=z,
                initial_state=ssm_state,
                return_last_state=return_states,
                chunk_size=self.chunk_size,
            )
        if return_states:
            y, last = res
            last = last.to(self._state_dtype())  # float32 whatever the weights' dtype
        else:
            y = res
        out = self.out_proj(y.to(hidden_states.dtype).transpose(1, 2)).to(out_dtype)  # (B, L, d_out)
        if return_states:
            return out, (new_conv_state, last)
        return out

    # ------------------------------------------------------------------ decoding
    def step(self, hidden_states, conv_state, ssm_state):
        """Decode one token: hidden_states (B, 1, d_in) or (B, d_in) -> (out (B, 1, d_out), conv_state, ssm_state).

        conv_state (B, d_inner, d_conv) and ssm_state (B, d_inner, d_state) are updated in place
        (as the fused kernels do) and returned.
        """
        if hidden_states.dim() == 3:
            if hidden_states.shape[1] != 1:
                raise ValueError(f"step() takes one token, got hidden_states of shape {tuple(hidden_states.shape)}")
            hidden_states = hidden_states[:, 0]
        if hidden_states.dim() != 2 or hidden_states.shape[-1] != self.d_in:
            raise ValueError(f"hidden_states must be (batch, 1, {self.d_in}) or (batch, {self.d_in}), got {tuple(hidden_states.shape)}")
        bsz = hidden_states.shape[0]
        if tuple(conv_state.shape) != (bsz, self.d_inner, self.d_conv):
            raise ValueError(f"conv_state must be {(bsz, self.d_inner, self.d_conv)}, got {tuple(conv_state.shape)}")
        if tuple(ssm_state.shape) != (bsz, self.d_inner, self.d_state):
            raise ValueError(f"ssm_state must be {(bsz, self.d_inner, self.d_state)}, got {tuple(ssm_state.shape)}")
        fast = self._fast(hidden_states)
        out_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(self.in_proj.weight.dtype)  # activations of any dtype

        xz = self.in_proj(hidden_states)  # (B, 2*d_inner)
        if not fast and self._cpu_step(hidden_states, conv_state, ssm_state):
            y = mamba_step_cpu(self, xz, conv_state, ssm_state)  # (B, d_inner); states updated in place
            return self.out_proj(y.to(hidden_states.dtype))[:, None, :].to(out_dtype), conv_state, ssm_state
        x, z = xz.chunk(2, dim=-1)  # (B, d_inner) each
        weight = self._conv_weight()  # (d_inner, d_conv)
        cdt = compute_dtype(x.dtype)
        A = -torch.exp(self.A_log.to(cdt))  # (d_inner, N)

        if not fast:
            _log_path_once(_MSG_TORCH)
        if fast:
            x = causal_conv1d_update(x, conv_state, weight, self.conv1d.bias, activation="silu")  # (B, d_inner)
        else:
            conv_state.copy_(torch.roll(conv_state, shifts=-1, dims=-1))
            conv_state[:, :, -1] = x.to(conv_state.dtype)
            x = (conv_state.to(weight.dtype) * weight).sum(-1)  # (B, d_inner)
            if self.conv1d.bias is not None:
                x = x + self.conv1d.bias
            x = F.silu(x).to(z.dtype)

        x_db = self.x_proj(x)  # (B, dt_rank + 2N)
        dt, Bm, Cm = torch.split(x_db, [self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt = F.linear(dt, self.dt_proj.weight)  # (B, d_inner), bias added with the softplus

        if fast:
            y = selective_state_update(
                ssm_state, x, dt, A, Bm, Cm, self.D, z=z, dt_bias=self.dt_proj.bias, dt_softplus=True
            )  # (B, d_inner)
        else:
            delta = F.softplus(dt.to(cdt) + self.dt_proj.bias.to(cdt))  # (B, d_inner)
            xf = x.to(cdt)
            dA = torch.exp(delta[:, :, None] * A)  # (B, d_inner, N)
            dBx = (delta * xf)[:, :, None] * Bm.to(cdt)[:, None, :]  # (B, d_inner, N)
            h = ssm_state.to(cdt) * dA + dBx  # (B, d_inner, N)
            ssm_state.copy_(h)
            y = (h * Cm.to(cdt)[:, None, :]).sum(-1) + self.D.to(cdt) * xf  # (B, d_inner)
            y = (y * F.silu(z.to(cdt))).to(z.dtype)
        out = self.out_proj(y.to(hidden_states.dtype))[:, None, :].to(out_dtype)  # (B, 1, d_out)
        return out, conv_state, ssm_state
