"""CPU kernels (Mamba scan and step, window-mixer step): C compiled once with the system
compiler, called via ctypes.

One module because it owns the one compiled library: its build and cache, the ctypes signatures
of every function in it and the wrappers that lay tensors out for them share the load state.

On CPU, a selective scan written in PyTorch ops pays for several passes over a
(batch, dim, length, d_state) tensor, which is memory-bound and ate more time than the
attention it replaces at 8k context. ``kernels/mamba_cpu.c`` runs the recurrence token by
token with the state in registers and the d_state loop vectorised (glibc's vector ``expf``),
which is more than 10x faster on the dev CPU. The same file has the whole decode step between
``in_proj`` and ``out_proj`` in one call, instead of about 25 small PyTorch ops per layer and
token (their dispatch overhead, not their arithmetic, was the cost). ``kernels/window_cpu.c`` does
the same for the decode step of the window and hybrid mixers (write the ring slot, fold the
evicted key, attend, add the state), about 35 PyTorch ops per layer and token in one call, in
float32 or, for a bf16 model, over its bf16 activations and window K/V (``rf_window_step_bf16``:
bf16 loaded exactly, float32 arithmetic and sums, the output rounded as torch rounds it).

* Built on first use with ``$CC`` (default ``cc``), cached under
  ``<rfkit cache>/kernels`` (or ``$RFKIT_KERNELS_DIR``, :func:`kernels_dir`) keyed by the source,
  the flags and the machine, and renamed into place, so concurrent builds never see a
  half-written library.
* No compiler, a failed build or ``RFKIT_CPU_KERNEL=0`` only switches it off: the block then
  uses the pure-PyTorch scan (:func:`rfkit.ops.scan.selective_scan_prefix`), and says so once.
* ``kernels/loss_cpu.c`` is the exception to "inference only" below: the training loss on the
  logits (CE and KL per position, and their gradient, :func:`rfkit.training.distill.rowwise_loss`)
  in three passes over each row instead of about a dozen PyTorch passes; it makes the gradient
  itself, so it needs no autograd either.
* The Mamba training scan (:func:`selective_scan_cpu_train`) is the other exception: an
  autograd function whose forward keeps the state every :data:`TRAIN_CHUNK` tokens and whose
  backward (in C) recomputes each chunk's states from it and runs the recurrence backwards.
* The window mixers' training forward (:func:`window_train_cpu`) is the third: an autograd
  function over one whole block from an empty state (every training and attention-transfer
  forward), ``kernels/hybrid_train_cpu.c``: the forward keeps each query's highest window score
  and normaliser, the backward recomputes the window's probabilities and the state from them and
  runs the state's adjoint backwards, so it keeps no ``L x window`` tensor and no per-token state.
* Everything else is inference only (no autograd); the block uses it when no gradient is
  needed. The scans and the window prefill compute in float32 (a bf16 model's mixers reach them in their float32
  compute dtype, :mod:`rfkit.models.precision`); the window step also takes bf16 (above).
* Prefill work (the scan's channels, the window prefill's rows or pieces of its chunk) is split
  over ``torch.get_num_threads()`` threads. Built with ``-fopenmp``, the library shares
  ``libgomp.so.1`` with PyTorch, so the threads are PyTorch's own warm OpenMP pool; a Python
  thread pool (ctypes releases the GIL) raced the spin-wait of those idle threads and was no
  faster than one thread on 2 cores. A compiler without OpenMP gets a build without it (the
  Python pool then), and is not asked again.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCES = [Path(__file__).with_name("kernels") / name for name in ("mamba_cpu.c", "window_cpu.c", "hybrid_train_cpu.c", "loss_cpu.c")]
_HEADERS = [Path(__file__).with_name("kernels") / name for name in ("bf16.h", "phi.h")]  # part of the build key, not compiled alone
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-shared", "-fPIC"]
# Tried in this order: with OpenMP (the window prefill's jobs then run in the process's OpenMP
# pool, which is PyTorch's own where PyTorch uses GNU OpenMP, as its Linux wheels do), then
# without (a compiler without OpenMP, or a library that does not load: the jobs then run on a
# Python thread pool, racing the spin-wait of PyTorch's idle OpenMP threads).
_VARIANTS = (["-fopenmp"], ["-fopenmp-simd"])

_lock = threading.Lock()
_state: dict = {"lib": None, "tried": False, "error": None, "openmp": False}
_pool: ThreadPoolExecutor | None = None
_pool_size = 0


def kernels_dir() -> Path:
    """Where the compiled library is kept: ``$RFKIT_KERNELS_DIR`` when set (one build shared by
    several caches, as ``TORCH_EXTENSIONS_DIR`` is for PyTorch's), else ``<rfkit cache>/kernels``."""
    from rfkit.hub import cache_dir

    override = os.environ.get("RFKIT_KERNELS_DIR")
    return Path(override) if override else cache_dir() / "kernels"


def _library_path(variant: list[str]) -> Path:
    cc = os.environ.get("CC", "cc")
    key = hashlib.sha1(
        "\0".join([*(src.read_text() for src in _SOURCES + _HEADERS), cc, *_FLAGS, *variant, platform.machine(), platform.node(), _cpu_flags()]).encode()
    ).hexdigest()[:16]
    return kernels_dir() / f"mamba_cpu-{key}.so"


def _cpu_flags() -> str:
    """The CPU's feature flags (:func:`rfkit.devices.cpu_flags`) as one string for the build key,
    or the processor's name where Linux does not list them."""
    from rfkit.devices import cpu_flags

    return " ".join(sorted(cpu_flags())) or platform.processor()


class CompileError(RuntimeError):
    """The compiler ran and rejected the sources or the flags (not retried for the same ones)."""


def _build(path: Path, variant: list[str]) -> None:
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        raise RuntimeError(f"no C compiler '{cc}' on PATH")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        proc = subprocess.run(
            [cc, *_FLAGS, *variant, "-o", str(tmp), *map(str, _SOURCES), "-lm"], capture_output=True, text=True, timeout=120
        )
        if proc.returncode != 0:
            raise CompileError(f"{cc} failed: {' '.join(proc.stderr.split())[:300]}")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _load():
    if os.environ.get("RFKIT_CPU_KERNEL", "1") == "0":
        return None
    with _lock:
        if _state["tried"]:
            return _state["lib"]
        _state["tried"] = True
        errors = []
        for variant in _VARIANTS:
            try:
                lib = _open(variant)
            except Exception as exc:  # noqa: BLE001 - an optional accelerator must never break a run
                errors.append(f"{' '.join(variant)}: {type(exc).__name__}: {exc}")
                continue
            _state["lib"], _state["openmp"] = lib, bool(lib.rf_openmp())
            break
        else:
            _state["error"] = "; ".join(errors)
            log.warning("CPU selective-scan kernel unavailable (%s); using the PyTorch scan", _state["error"])
        return _state["lib"]


def _open(variant: list[str]):
    """Build (once per source, flags and machine) and load the library with these flags."""
    path = _library_path(variant)
    failed = path.with_name(path.name + ".failed")  # flags this compiler rejected once (no OpenMP)
    if failed.exists():
        raise CompileError(failed.read_text().strip())
    if not path.exists():
        log.info("building the CPU kernels (%s) -> %s", " ".join(variant), path)
        try:
            _build(path, variant)
        except CompileError as exc:
            tmp = failed.with_name(f".{failed.name}.{os.getpid()}.tmp")
            tmp.write_text(f"{exc}\n")
            os.replace(tmp, failed)  # whole or absent, as the library itself
            raise
    lib = ctypes.CDLL(str(path))
    lib.rf_selective_scan_f32.restype = None
    lib.rf_selective_scan_f32.argtypes = [ctypes.c_void_p] * 9 + [ctypes.c_int64] * 5
    lib.rf_selective_scan_rows_f32.restype = None
    lib.rf_selective_scan_rows_f32.argtypes = [ctypes.c_void_p] * 9 + [ctypes.c_int64] * 5
    lib.rf_scan_train_fwd_f32.restype = None
    lib.rf_scan_train_fwd_f32.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 6
    lib.rf_scan_train_fwd_rows_f32.restype = None
    lib.rf_scan_train_fwd_rows_f32.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 6
    lib.rf_scan_train_bwd_f32.restype = ctypes.c_int
    lib.rf_scan_train_bwd_f32.argtypes = [ctypes.c_void_p] * 14 + [ctypes.c_int64] * 6
    lib.rf_scan_train_bwd_batches_f32.restype = ctypes.c_int
    lib.rf_scan_train_bwd_batches_f32.argtypes = [ctypes.c_void_p] * 14 + [ctypes.c_int64] * 6
    lib.rf_mamba_step_f32.restype = ctypes.c_int
    lib.rf_mamba_step_f32.argtypes = [ctypes.c_void_p] * 11 + [ctypes.c_int64] * 5
    for step in (lib.rf_window_step_f32, lib.rf_window_step_bf16):
        step.restype = ctypes.c_int
        step.argtypes = [ctypes.c_void_p] * 13 + [ctypes.c_int64] * 7 + [ctypes.c_float] * 2 + [ctypes.c_void_p] * 2
    lib.rf_f32_to_bf16.restype = None
    lib.rf_f32_to_bf16.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64]
    prefill = [ctypes.c_void_p] * 12 + [ctypes.c_int64] * 11 + [ctypes.c_float] * 2
    lib.rf_window_prefill_f32.restype = ctypes.c_int
    lib.rf_window_prefill_f32.argtypes = prefill + [ctypes.c_int64] * 4
    lib.rf_window_prefill_jobs_f32.restype = ctypes.c_int
    lib.rf_window_prefill_jobs_f32.argtypes = prefill + [ctypes.c_void_p] + [ctypes.c_int64] * 3
    lib.rf_window_train_fwd_f32.restype = ctypes.c_int
    lib.rf_window_train_fwd_f32.argtypes = [ctypes.c_void_p] * 10 + [ctypes.c_int64] * 8 + [ctypes.c_float] * 2
    lib.rf_window_train_bwd_f32.restype = ctypes.c_int
    lib.rf_window_train_bwd_f32.argtypes = [ctypes.c_void_p] * 18 + [ctypes.c_int64] * 8 + [ctypes.c_float] * 2
    lib.rf_rowwise_loss.restype = ctypes.c_int
    lib.rf_rowwise_loss.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] * 2 + [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [
        ctypes.c_void_p
    ] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_float, ctypes.c_int64]
    lib.rf_openmp.restype = ctypes.c_int
    lib.rf_openmp.argtypes = []
    return lib


def openmp() -> bool:
    """Whether the loaded library runs the window prefill's jobs on OpenMP threads."""
    return _load() is not None and _state["openmp"]


def available() -> bool:
    """True when the compiled kernel loads (building it on first call)."""
    return _load() is not None


def unavailable_reason() -> str | None:
    _load()
    return _state["error"]


def _executor(threads: int) -> ThreadPoolExecutor:
    """A pool of at least ``threads`` workers (grown when asked for more, never shrunk)."""
    global _pool, _pool_size
    if _pool is None or _pool_size < threads:
        if _pool is not None:
            _pool.shutdown(wait=False)
        _pool, _pool_size = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="rfkit-scan"), threads
    return _pool


def _ptr(t: torch.Tensor | None):
    return None if t is None else ctypes.c_void_p(t.data_ptr())


def _scan_library():
    """The loaded library, or RuntimeError saying why the scan kernels are unavailable."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"CPU selective-scan kernel unavailable: {_state['error'] or 'disabled'}")
    return lib


def _scan_layout(u, delta, A, B, C):
    """The scan kernels' inputs: u, delta (B, D, L), A (D, N) and B, C transposed to (B, L, N),
    float32, contiguous, detached."""
    u, delta, A = (t.detach().to(torch.float32).contiguous() for t in (u, delta, A))
    Bt, Ct = (t.detach().to(torch.float32).transpose(1, 2).contiguous() for t in (B, C))
    return u, delta, A, Bt, Ct


@torch.no_grad()
def selective_scan_cpu(u, delta, A, B, C, D=None, z=None, initial_state=None):
    """Inference selective scan on CPU float32 tensors; returns (y (B, D, L), last state (B, D, N)).

    Shapes as in :func:`rfkit.ops.scan.selective_scan_ref`, with ``delta`` already biased and
    passed through softplus. Raises RuntimeError when the kernel is not available.
    """
    lib = _scan_library()
    f32 = torch.float32
    bsz, dim, length = u.shape
    n = A.shape[1]
    u, delta, A, Bt, Ct = _scan_layout(u, delta, A, B, C)
    D = None if D is None else D.to(f32).contiguous()
    z = None if z is None else z.to(f32).contiguous()
    if initial_state is None:
        h = torch.zeros(bsz, dim, n, dtype=f32)
    else:
        h = initial_state.to(f32).clone().contiguous()
    y = torch.empty(bsz, dim, length, dtype=f32)
    rows = bsz * dim
    args = [_ptr(t) for t in (u, delta, A, Bt, Ct, D, z, h, y)]
    _split(lib.rf_selective_scan_rows_f32, lib.rf_selective_scan_f32, args, [dim, length, n], rows, _threads(rows, length))
    return y, h


def _threads(rows: int, length: int) -> int:
    """Threads for a scan over ``rows`` channels of ``length`` tokens: at most PyTorch's, one per
    row, and one per 4,096 row-tokens (below that a thread costs more than it saves)."""
    return max(1, min(torch.get_num_threads(), rows, (rows * length) // 4096 or 1))


def _split(whole, part, args: list, sizes: list[int], total: int, threads: int) -> int:
    """Run a kernel over ``total`` rows (or batch rows) in ``threads`` runs: ``whole`` (the
    library's OpenMP loop, or one run) takes ``(*args, *sizes, total, threads)``; without OpenMP
    ``part`` takes ``(*args, *sizes, begin, end)`` on Python threads (ctypes releases the GIL).
    Returns the kernels' status: 0, or the first non-zero (a kernel with no status returns 0)."""
    if threads == 1 or _state["openmp"]:
        return whole(*args, *sizes, total, threads) or 0
    step = -(-total // threads)
    futures = [_executor(threads).submit(part, *args, *sizes, r0, min(r0 + step, total)) for r0 in range(0, total, step)]
    codes = [f.result() or 0 for f in futures]
    return next((c for c in codes if c), 0)


#: tokens between the states the training scan keeps for its backward, which recomputes the rest
TRAIN_CHUNK = 32


class _TrainScan(torch.autograd.Function):
    """The selective scan without D and z (PyTorch applies them) and its backward, in C."""

    @staticmethod
    def forward(ctx, u, delta, A, B, C, h0):
        lib = _scan_library()
        f32 = torch.float32
        bsz, dim, length = u.shape
        n = A.shape[1]
        ctx.dtypes = tuple(t.dtype for t in (u, delta, A, B, C, h0))
        u, delta, A, Bt, Ct = _scan_layout(u, delta, A, B, C)
        h = h0.detach().to(f32).clone().contiguous()
        chunks = -(-length // TRAIN_CHUNK)
        hck = torch.empty(bsz, dim, chunks, n, dtype=f32)
        y = torch.empty(bsz, dim, length, dtype=f32)
        rows = bsz * dim
        args = [_ptr(t) for t in (u, delta, A, Bt, Ct, h, hck, y)]
        sizes = [dim, length, n, TRAIN_CHUNK]
        _split(lib.rf_scan_train_fwd_rows_f32, lib.rf_scan_train_fwd_f32, args, sizes, rows, _threads(rows, length))
        ctx.save_for_backward(u, delta, A, Bt, Ct, hck)
        return y, h

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy, dh_last):
        lib = _load()
        u, delta, A, Bt, Ct, hck = ctx.saved_tensors
        bsz, dim, length = u.shape
        n = A.shape[1]
        f32 = torch.float32
        dy = torch.zeros_like(u) if dy is None else dy.to(f32).contiguous()
        dh_last = None if dh_last is None else dh_last.to(f32).contiguous()
        du, ddelta = torch.empty_like(u), torch.empty_like(u)
        dA_part, dh0 = torch.empty(bsz, dim, n, dtype=f32), torch.empty(bsz, dim, n, dtype=f32)
        dBt, dCt = torch.zeros_like(Bt), torch.zeros_like(Ct)
        args = [_ptr(t) for t in (u, delta, A, Bt, Ct, hck, dy, dh_last, du, ddelta, dA_part, dBt, dCt, dh0)]
        sizes = [dim, length, n, TRAIN_CHUNK]
        threads = max(1, min(torch.get_num_threads(), bsz))
        if _split(lib.rf_scan_train_bwd_batches_f32, lib.rf_scan_train_bwd_f32, args, sizes, bsz, threads):
            raise MemoryError("CPU selective-scan backward: could not allocate its work buffer")
        grads = (du, ddelta, dA_part.sum(0), dBt.transpose(1, 2), dCt.transpose(1, 2), dh0)
        return tuple(g.to(dtype) for g, dtype in zip(grads, ctx.dtypes))


def selective_scan_cpu_train(u, delta, A, B, C, initial_state=None):
    """The selective scan for training on CPU: (y (B, D, L), last state (B, D, N)), float32, both
    differentiable with respect to every input, **without** the skip ``D`` and the gate ``z``
    (apply them in PyTorch, as :func:`rfkit.ops.scan._finish_output` does).

    Shapes as in :func:`rfkit.ops.scan.selective_scan_ref`, ``delta`` already biased and passed
    through softplus. The forward is the sequential recurrence (the inference kernel's); it keeps
    the state before every :data:`TRAIN_CHUNK` tokens, and the backward recomputes each chunk's
    states from it and runs the recurrence backwards, so memory is one state per chunk, not per
    token. Raises RuntimeError when the kernel is not available.
    """
    if initial_state is None:
        initial_state = torch.zeros(u.shape[0], u.shape[1], A.shape[1], dtype=torch.float32)
    return _TrainScan.apply(u, delta, A, B, C, initial_state)


#: the logits' dtypes :func:`rowwise_loss_cpu` reads (other dtypes take the PyTorch twin)
LOSS_DTYPES = (torch.float32, torch.bfloat16)


def rowwise_loss_ready(*logits: torch.Tensor | None) -> bool:
    """Whether :func:`rowwise_loss_cpu` can take these (rows, vocab) logits: CPU, a dtype of
    :data:`LOSS_DTYPES`, unit stride along the vocabulary, and the library built."""
    given = [x for x in logits if x is not None]
    fit = all(x.device.type == "cpu" and x.dtype in LOSS_DTYPES and x.dim() == 2 and x.stride(-1) == 1 for x in given)
    return fit and _load() is not None


@torch.no_grad()
def rowwise_loss_cpu(student, teacher, targets, ga, gb, grad, inv_t: float) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Per-row CE and KL of ``student`` (rows, vocab) against ``targets`` (rows,) and ``teacher``
    (either may be None), writing the gradient into ``grad`` (rows, vocab; None: none) with the row
    weights ``ga`` and ``gb`` (float32, rows); ``kernels/loss_cpu.c`` says what each is. The caller
    checks :func:`rowwise_loss_ready`. Returns (ce, kl), float32 (rows,) or None."""
    rows, vocab = student.shape
    f32 = torch.float32
    ce = None if targets is None else torch.empty(rows, dtype=f32)
    kl = None if teacher is None else torch.empty(rows, dtype=f32)
    targets = None if targets is None else targets.to(torch.int64).clamp_min(0).contiguous()
    ga = None if ga is None else ga.to(f32).contiguous()
    gb = None if gb is None else gb.to(f32).contiguous()

    def logits(x):
        return (None, 0, 0) if x is None else (_ptr(x), int(x.dtype == torch.bfloat16), x.stride(0))

    threads = max(1, min(torch.get_num_threads(), rows))
    rc = _load().rf_rowwise_loss(
        *logits(student), *logits(teacher), *(_ptr(x) for x in (targets, ga, gb)), *logits(grad), _ptr(ce), _ptr(kl),
        rows, vocab, float(inv_t), threads,
    )  # fmt: skip
    if rc != 0:
        raise MemoryError("rowwise loss kernel: could not allocate its row buffers")
    return ce, kl


@torch.no_grad()
def mamba_step_cpu(block, xz: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor) -> torch.Tensor:
    """One decode token of ``block`` (a :class:`rfkit.models.mamba.MambaBlock`) from its ``in_proj``
    output ``xz`` (B, 2 * d_inner); returns y (B, d_inner) before ``out_proj`` and updates
    ``conv_state`` / ``ssm_state`` in place.

    The caller guarantees float32, contiguous CPU weights and states (``MambaBlock._cpu_step``
    checks); this runs once per layer and token, so it checks nothing twice.
    """
    lib = _load()
    if lib is None:
        raise RuntimeError(f"CPU Mamba kernel unavailable: {_state['error'] or 'disabled'}")
    xz = xz.to(torch.float32).contiguous()
    y = torch.empty(xz.shape[0], block.d_inner, dtype=torch.float32)
    conv_bias = block.conv1d.bias
    rc = lib.rf_mamba_step_f32(
        xz.data_ptr(), conv_state.data_ptr(), ssm_state.data_ptr(), block.conv1d.weight.data_ptr(),
        None if conv_bias is None else conv_bias.data_ptr(), block.x_proj.weight.data_ptr(),
        block.dt_proj.weight.data_ptr(), block.dt_proj.bias.data_ptr(), block.A_log.data_ptr(),
        block.D.data_ptr(), y.data_ptr(), xz.shape[0], block.d_inner, block.d_conv, block.d_state, block.dt_rank,
    )  # fmt: skip
    if rc != 0:
        raise MemoryError("rf_mamba_step_f32 could not allocate its work buffer")
    return y


#: the compiled window step for each dtype of the activations and the window's K/V (the sums and
#: the weights are float32 with both)
WINDOW_STEP_ENTRIES = {torch.float32: "rf_window_step_f32", torch.bfloat16: "rf_window_step_bf16"}


@torch.no_grad()
def to_bf16(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to bf16 by the kernels' own conversion (what the bf16 step stores its output
    with), for the tests to hold it to ``x.to(torch.bfloat16)``."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"CPU window kernel unavailable: {_state['error'] or 'disabled'}")
    x = x.to(torch.float32).contiguous()
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    lib.rf_f32_to_bf16(x.data_ptr(), out.data_ptr(), x.numel())
    return out


def window_step_plan(block, state) -> dict:
    """What every decode step of one state passes to the compiled window step besides the token:
    the entry for the window's dtype (:data:`WINDOW_STEP_ENTRIES`), the state's and the weights'
    pointers, the sizes and the tensors they point into (kept alive). Made once per state by
    ``WindowAttention._step_plan``, which has checked dtypes, devices and layouts (activations and
    K/V of one dtype of :data:`WINDOW_STEP_ENTRIES`, float32 sums, contiguous, on CPU)."""
    keys, values, seen = state[0], state[1], state[2]
    hybrid = len(state) > 3
    keep = [keys, values, seen, block.kernel_index()]
    if hybrid:
        keep += [state[3], state[4], block.feature_map.detach(), block.kernel_weights(), block.kernel_decay()]
    pointers = [_ptr(t) for t in keep[:3]]
    pointers += [_ptr(keep[4]), _ptr(keep[5]), _ptr(keep[6]), _ptr(keep[7]), _ptr(keep[8])] if hybrid else [None] * 5
    sizes = [keys.shape[0], block.num_heads, block.num_kv_heads, block.head_dim, block.sink, block.window]
    sizes += [block.feature_dim if hybrid else 0, block.scaling, block.sharpness if hybrid else 1.0]
    lib = _load()
    if lib is None:
        raise RuntimeError(f"CPU window kernel unavailable: {_state['error'] or 'disabled'}")
    entry = WINDOW_STEP_ENTRIES[keys.dtype]
    return {
        "keep": keep, "pointers": pointers, "index": _ptr(keep[3]), "sizes": sizes,
        "out_shape": (keys.shape[0], 1, block.d_out), "dtype": keys.dtype, "entry": entry, "call": getattr(lib, entry),
    }  # fmt: skip


#: the last token's rotary ``cos`` / ``sin`` as the step reads them: (weak references to the
#: model's pair, rows, dtype, the prepared tensors and their pointers); a token's layers share one pair, so the first
#: converted layer prepares it and the others find it (replaced whole, never half-updated)
_LAST_ROTARY: list = [None]


def _rotary_rows(rotation, rows: int, dtype: torch.dtype) -> tuple:
    """The token's rotary ``cos`` / ``sin`` (B or 1, 1, hd) as the step reads them: contiguous, in
    ``dtype``, one row per batch row (a model called without position ids shares one row between
    rows). Returns ``(tensors, pointers)``: the caller holds the tensors while the step runs (the
    cache may meanwhile be replaced by another thread's token)."""
    cos, sin = rotation
    last = _LAST_ROTARY[0]
    if last is not None and last[0]() is cos and last[1]() is sin and last[2] == rows and last[3] == dtype:
        return last[4]
    kept = tuple(t.to(dtype).expand(rows, -1, -1).contiguous() for t in (cos, sin))
    prepared = (kept, (kept[0].data_ptr(), kept[1].data_ptr()))
    _LAST_ROTARY[0] = (weakref.ref(cos), weakref.ref(sin), rows, dtype, prepared)
    return prepared


def window_step_planned(plan: dict, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotation=None) -> torch.Tensor:
    """One decode token of a window mixer (:class:`rfkit.models.window.WindowAttention` or its
    hybrid subclass) with the state of ``plan`` (:func:`window_step_plan`): ``q`` (B, Hq, 1, hd),
    ``k`` / ``v`` (B, Hkv, 1, hd) in the dtype of the state's K/V (float32 or bf16); the state is
    updated in place. With ``rotation``, the token's rotary ``(cos, sin)`` (B, 1, hd), ``q`` and ``k`` come
    unrotated and the step rotates them (as :func:`rfkit.models.rotary.rotation_matrix` does,
    rounded once). Returns (B, 1, Hq * hd) in that dtype. The plan holds the library's entry, so a
    step reads no environment and takes no lock."""
    # (B, H, 1, hd) laid out as (B, H, hd): views of the packed projection are, at batch 1
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty(plan["out_shape"], dtype=plan["dtype"])
    keys, values, seen, S, z, fmap, weights, decay = plan["pointers"]
    rotary = None if rotation is None else _rotary_rows(rotation, plan["out_shape"][0], plan["dtype"])  # held while the step runs
    cos, sin = (None, None) if rotary is None else rotary[1]
    rc = plan["call"](
        q.data_ptr(), k.data_ptr(), v.data_ptr(), keys, values, seen, S, z, fmap, weights, decay, plan["index"],
        out.data_ptr(), *plan["sizes"], cos, sin,
    )  # fmt: skip
    if rc != 0:
        raise MemoryError(f"{plan['entry']} could not allocate its work buffer")
    return out


# A piece of a chunk shorter than this is not worth a thread of its own.
MIN_PIECE_TOKENS = 128


def prefill_jobs(rows: int, length: int, threads: int, query_cost: float, fold_cost: float) -> list[tuple[int, int, int, int]]:
    """How the window prefill splits over ``threads``: ``(row_begin, row_end, i_begin, i_end)``
    per job. Either the rows (batch x KV heads) are split and each job takes the whole chunk, or
    the chunk is cut into pieces over all rows: a piece first folds the tokens before it into its
    own copy of the state, so its boundaries make the pieces cost the same (piece p costs
    ``b_p * fold_cost + (b_{p+1} - b_p) * query_cost``, costs per token and row). The split whose
    longest job costs less is taken: pieces when there are fewer rows than threads (batch 1 and
    one replaced KV head per layer, as in the default model) or when the rows do not divide
    evenly (3 rows on 2 threads)."""
    row_step = -(-rows // max(1, min(threads, rows)))
    by_rows = [(r0, min(r0 + row_step, rows), 0, length) for r0 in range(0, rows, row_step)]
    pieces = min(threads, length // MIN_PIECE_TOKENS)
    if pieces < 2:
        return by_rows
    a = 1.0 - min(fold_cost / query_cost, 0.9)  # each piece's fold shortens the next one by this factor
    first = length * (1.0 - a) / (1.0 - a**pieces) if a < 1.0 else length / pieces
    if rows * first >= row_step * length:  # the longest piece costs no less than the largest share of rows
        return by_rows
    bounds, width = [0], first
    for _ in range(pieces - 1):
        bounds.append(min(length, max(bounds[-1] + 1, round(bounds[-1] + width))))
        width *= a
    bounds.append(length)
    return [(0, rows, i0, i1) for i0, i1 in zip(bounds, bounds[1:]) if i1 > i0]


def _prefill_costs(block, hybrid: bool) -> tuple[float, float]:
    """Rough work per token and row of the prefill (multiply-adds; an exp counted as 8): the
    queries of one KV head's query heads, and folding one token into the state."""
    hd, f = block.head_dim, block.feature_dim if hybrid else 0
    feature = hd * f / 2 + 8 * f
    fold = (feature + f * hd * (2 if block.kernel_decay() is not None else 1)) if hybrid else 0.0
    per_query = 2 * (block.sink + block.window) * hd + 8 * (block.sink + block.window) + (feature + f * hd if hybrid else 0)
    return fold + block.num_heads / block.num_kv_heads * per_query, fold


@torch.no_grad()
def window_prefill_cpu(block, q: torch.Tensor, ctx: dict, state, seen: int):
    """Prefill of one chunk through a window mixer: ``q`` (B, Hq, L, hd) float32 (any strides
    with contiguous channels), ``ctx`` the block's context of the chunk (sink keys, recent keys
    in rank order), ``state`` the state before it, every row at ``seen`` tokens. Returns
    ``(y (B, L, Hq * hd), (S, z))`` for the hybrid (the linear-attention state after the
    chunk), ``(y, ())`` for plain window attention. The work is split over
    ``torch.get_num_threads()`` threads by :func:`prefill_jobs`."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"CPU window kernel unavailable: {_state['error'] or 'disabled'}")
    f32 = torch.float32
    hybrid = len(state) > 3
    B, _, L, _ = q.shape
    q = q.to(f32)
    if q.stride(-1) != 1:
        q = q.contiguous()
    parts = [ctx[name].to(f32).contiguous() for name in ("rec_k", "rec_v", "sink_k", "sink_v")]
    out = torch.empty(B, L, block.num_heads * block.head_dim, dtype=f32)
    rows = B * block.num_kv_heads
    jobs = prefill_jobs(rows, L, torch.get_num_threads(), *_prefill_costs(block, hybrid))
    pieces = jobs[0][3] < L  # the chunk cut into pieces: a copy of the state per piece
    if hybrid:
        copies = len(jobs) if pieces else 1
        S = state[3].to(f32).unsqueeze(0).repeat(copies, *[1] * state[3].dim())
        z = state[4].to(f32).unsqueeze(0).repeat(copies, *[1] * state[4].dim())
        strides = (S[0].numel(), z[0].numel()) if pieces else (0, 0)
    else:
        S = z = None
        strides = (0, 0)
    args = [q.data_ptr(), *(t.data_ptr() for t in parts), _ptr(S), _ptr(z),
            _ptr(block.feature_map.detach().to(f32).contiguous()) if hybrid else None,
            block.kernel_weights().data_ptr() if hybrid else None, _ptr(block.kernel_decay()) if hybrid else None,
            block.kernel_index().data_ptr(), out.data_ptr(),
            block.num_heads, block.num_kv_heads, block.head_dim, block.sink, block.window,
            block.feature_dim if hybrid else 0, L, seen, q.stride(0), q.stride(1), q.stride(2), block.scaling,
            block.sharpness if hybrid else 1.0]  # fmt: skip
    if len(jobs) == 1 or _state["openmp"]:
        table = torch.tensor(jobs, dtype=torch.int64)
        codes = [lib.rf_window_prefill_jobs_f32(*args, table.data_ptr(), len(jobs), *strides)]
    else:  # a library without OpenMP: one Python thread per job (ctypes releases the GIL)
        def job(n: int, rows_and_tokens) -> int:
            own = pieces and hybrid  # a piece of the hybrid's chunk has its own copy of the state
            at = args[:5] + [_ptr(S[n]) if own else args[5], _ptr(z[n]) if own else args[6]] + args[7:]
            return lib.rf_window_prefill_f32(*at, *rows_and_tokens)

        pool = _executor(len(jobs))
        codes = [f.result() for f in [pool.submit(job, n, rows_and_tokens) for n, rows_and_tokens in enumerate(jobs)]]
    if any(codes):
        raise MemoryError("rf_window_prefill_f32 could not allocate its work buffer")
    if not hybrid:
        return out, ()
    # the last piece's state is the chunk's (a copy of its own, so no other piece's stays alive)
    return out, ((S[-1].clone(), z[-1].clone()) if pieces else (S[0], z[0]))


class _WindowTrain(torch.autograd.Function):
    """A window mixer's forward over one block from an empty state, and its backward, in C
    (``kernels/hybrid_train_cpu.c``). ``fmap``, ``g`` and ``log_gamma`` are None for plain window
    attention (no state); ``log_gamma`` is None for a hybrid without decay."""

    @staticmethod
    def forward(ctx, q, k, v, fmap, g, log_gamma, block, window: int):
        lib = _scan_library()
        f32 = torch.float32
        B, hq, L, hd = q.shape
        hkv = k.shape[1]
        ctx.dtypes = tuple(t.dtype for t in (q, k, v))
        q, k, v = (t.detach().to(f32).contiguous() for t in (q, k, v))
        hybrid = fmap is not None
        fm = fmap.detach().to(f32).contiguous() if hybrid else None
        gw = g.detach().to(f32).contiguous() if hybrid else None
        decay = log_gamma.detach().to(f32).exp().contiguous() if log_gamma is not None else None
        kvq = block.kernel_index()
        out = torch.empty(B, L, hq, hd, dtype=f32)
        m, D = torch.empty(B, hq, L, dtype=f32), torch.empty(B, hq, L, dtype=f32)
        consts = [B, hq, hkv, hd, L, block.sink, window, block.feature_dim if hybrid else 0]
        scalars = [block.scaling, getattr(block, "sharpness", 1.0)]
        ctx.call = consts + scalars
        ctx.hybrid, ctx.decayed = hybrid, log_gamma is not None
        if lib.rf_window_train_fwd_f32(*[_ptr(t) for t in (q, k, v, fm, gw, decay, kvq, out, m, D)], *ctx.call):
            raise MemoryError("rf_window_train_fwd_f32 could not allocate its work buffer")
        ctx.save_for_backward(q, k, v, fm, gw, decay, kvq, out, m, D)
        return out.view(B, L, hq * hd)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        lib = _load()
        q, k, v, fm, gw, decay, kvq, out, m, D = ctx.saved_tensors
        B, hq, L, hd = q.shape
        hkv = k.shape[1]
        f32 = torch.float32
        dy = dy.to(f32).contiguous()
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        half = fm.shape[-1] if ctx.hybrid else 0
        dpq = torch.zeros(B, hq, L, half, dtype=f32) if ctx.hybrid else None  # d(x W) of every query
        dpk = torch.zeros(B, hkv, L, half, dtype=f32) if ctx.hybrid else None  # and of every folded key
        dg = torch.zeros(B, hq, dtype=f32) if ctx.hybrid else None
        dlg = torch.zeros(B, hkv, dtype=f32) if ctx.decayed else None
        tensors = (q, k, v, fm, gw, decay, kvq, out, m, D, dy, dq, dk, dv, dpq, dpk, dg, dlg)
        if lib.rf_window_train_bwd_f32(*[_ptr(t) for t in tensors], *ctx.call):
            raise MemoryError("rf_window_train_bwd_f32 could not allocate its work buffer")
        dfm = None
        if ctx.hybrid:  # the feature map's products, as matrix products: dx += W dp, dW += x^T dp
            per_query = fm.index_select(0, kvq)  # (Hq, hd, half)
            dq += torch.einsum("bhlj,hdj->bhld", dpq, per_query)
            dk += torch.einsum("bklj,kdj->bkld", dpk, fm)
            dfm = torch.einsum("bkld,bklj->kdj", k, dpk).index_add_(0, kvq, torch.einsum("bhld,bhlj->hdj", q, dpq))
        dq, dk, dv = (grad.to(dtype) for grad, dtype in zip((dq, dk, dv), ctx.dtypes))
        return (
            dq, dk, dv,
            dfm,
            dg.sum(0) if ctx.hybrid else None,
            dlg.sum(0) if ctx.decayed else None,
            None, None,
        )  # fmt: skip


def window_train_cpu(block, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
    """A window mixer's (plain or hybrid) training forward over one block that starts from an
    empty state: ``q`` (B, Hq, L, hd), ``k``, ``v`` (B, Hkv, L, hd), any float dtype (computed in
    float32, gradients returned in their dtypes) -> ``(B, L, Hq * hd)`` float32, differentiable
    with respect to the inputs and the block's weights (the feature map, the gate and scale
    through ``g``, the decay horizon through ``log gamma``) at the drawn ``window``. Raises
    RuntimeError when the kernel is not available."""
    if hasattr(block, "feature_map"):
        log_gamma = block.log_decay()
        return _WindowTrain.apply(q, k, v, block.feature_map, block.old_weight(), log_gamma, block, window)
    return _WindowTrain.apply(q, k, v, None, None, None, block, window)
