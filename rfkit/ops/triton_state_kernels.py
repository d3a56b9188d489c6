"""The Triton kernels of :mod:`rfkit.ops.triton_state` (imported only when that backend serves:
``import rfkit`` never imports Triton). Plain functions, made kernels by
:func:`rfkit.ops.triton_state._kernels`: compiled (``triton.jit``) for CUDA, interpreted for the CPU
(so only Triton's builtins are called here: ``tl.zeros`` and ``tl.cdiv`` are Triton functions of
their own, which the interpreter cannot call from an uncompiled kernel). For the same reason each
kernel spells out its own index set-up (positions, slice of ``D``, decay powers) instead of calling
a shared helper: a helper would have to be a compiled Triton function for the GPU and a plain one
for the interpreter, and one module's name cannot be both.

Two walks in order over the chunks, one per (row, group, slice of D), carry a state; everything
else is one program per (row, group[, query head], chunk, slice of D), all chunks at once:

- ``states``: ``S_c``, the state before chunk ``c`` (``S_0 = S0``), for every chunk;
- ``outputs``: ``o = (gamma^(u+1) q) S_c + (q k^T * gamma^(u_i - u_t), causal) v``;
- ``grad_q``: ``dq = gamma^(u+1) do S_c^T + (do v^T * gamma^(u_i - u_t), causal) k``;
- ``grad_states``: in reverse, ``dS_c``, what the queries after chunk ``c`` read of a key at its
  end (``dS_{last} = 0``, ``dS_{c-1} = gamma^C dS_c + sum_r (gamma^(u+1) q_r)^T do_r``), and the
  last, ``dS_{-1}``, the gradient of ``S0``;
- ``grad_kv``: ``dk = gamma^(C-1-u) v dS_c^T + sum_r (do_r v^T * decay)^T q_r``,
  ``dv = gamma^(C-1-u) k dS_c + sum_r (q_r k^T * decay)^T do_r``.

Layouts (every tensor contiguous): q, do, o (B, G, R, L, *); k (B, G, L, F); v (B, G, L, D);
states (B, G, N, F, D) with N the chunk count; S0, dS0 (B, G, F, D); dq, dk (J, B, G, [R,] L, F)
with J the slices of D, summed by the caller. Offsets in int64 (the program id cast first): at
Llama-2-7B's shape (32 query heads, 128 + 1 columns) a batch of 16 at 32k tokens passes 2^31
elements in the per-query layouts.
"""

import triton.language as tl


def states(k_ptr, v_ptr, s0_ptr, lam_ptr, s_ptr, G, L, D, N, F: tl.constexpr, C: tl.constexpr, BD: tl.constexpr):
    bg = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    lam = tl.load(lam_ptr + bg % G)
    u = tl.arange(0, C)
    f = tl.arange(0, F)
    d = j * BD + tl.arange(0, BD)
    dm = d < D
    k_dec = tl.exp(lam * (C - 1 - u).to(tl.float32))
    chunk_dec = tl.exp(lam * C)
    S = tl.load(s0_ptr + bg * F * D + f[:, None] * D + d[None, :], mask=dm[None, :], other=0.0)
    for c in range(0, N):
        tl.store(s_ptr + (bg * N + c) * F * D + f[:, None] * D + d[None, :], S, mask=dm[None, :])
        t = c * C + u
        tm = t < L
        k = tl.load(k_ptr + bg * L * F + t[:, None] * F + f[None, :], mask=tm[:, None], other=0.0)
        v = tl.load(v_ptr + bg * L * D + t[:, None] * D + d[None, :], mask=tm[:, None] & dm[None, :], other=0.0)
        S = S * chunk_dec + tl.dot(tl.trans(k * k_dec[:, None]), v, input_precision="ieee")


def outputs(q_ptr, k_ptr, v_ptr, s_ptr, lam_ptr, o_ptr, G, R, L, D, N, F: tl.constexpr, C: tl.constexpr, BD: tl.constexpr):
    pc = tl.program_id(0).to(tl.int64)  # ((b * G + g) * R + r) * N + c
    j = tl.program_id(1)
    c = pc % N
    p = pc // N
    bg = p // R
    lam = tl.load(lam_ptr + bg % G)
    u = tl.arange(0, C)
    f = tl.arange(0, F)
    d = j * BD + tl.arange(0, BD)
    dm = d < D
    diff = u[:, None] - u[None, :]
    intra = tl.where(diff >= 0, tl.exp(lam * tl.maximum(diff, 0).to(tl.float32)), 0.0)
    q_dec = tl.exp(lam * (u + 1).to(tl.float32))
    t = c * C + u
    tm = t < L
    q = tl.load(q_ptr + p * L * F + t[:, None] * F + f[None, :], mask=tm[:, None], other=0.0)
    k = tl.load(k_ptr + bg * L * F + t[:, None] * F + f[None, :], mask=tm[:, None], other=0.0)
    v = tl.load(v_ptr + bg * L * D + t[:, None] * D + d[None, :], mask=tm[:, None] & dm[None, :], other=0.0)
    S = tl.load(s_ptr + (bg * N + c) * F * D + f[:, None] * D + d[None, :], mask=dm[None, :], other=0.0)
    o = tl.dot(q * q_dec[:, None], S, input_precision="ieee")
    att = tl.dot(q, tl.trans(k), input_precision="ieee") * intra
    o += tl.dot(att, v, input_precision="ieee")
    tl.store(o_ptr + p * L * D + t[:, None] * D + d[None, :], o, mask=tm[:, None] & dm[None, :])


def grad_q(do_ptr, k_ptr, v_ptr, s_ptr, lam_ptr, dq_ptr, P, G, R, L, D, N, F: tl.constexpr, C: tl.constexpr, BD: tl.constexpr):
    pc = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    c = pc % N
    p = pc // N
    bg = p // R
    lam = tl.load(lam_ptr + bg % G)
    u = tl.arange(0, C)
    f = tl.arange(0, F)
    d = j * BD + tl.arange(0, BD)
    dm = d < D
    diff = u[:, None] - u[None, :]
    intra = tl.where(diff >= 0, tl.exp(lam * tl.maximum(diff, 0).to(tl.float32)), 0.0)
    q_dec = tl.exp(lam * (u + 1).to(tl.float32))
    t = c * C + u
    tm = t < L
    do = tl.load(do_ptr + p * L * D + t[:, None] * D + d[None, :], mask=tm[:, None] & dm[None, :], other=0.0)
    k = tl.load(k_ptr + bg * L * F + t[:, None] * F + f[None, :], mask=tm[:, None], other=0.0)
    v = tl.load(v_ptr + bg * L * D + t[:, None] * D + d[None, :], mask=tm[:, None] & dm[None, :], other=0.0)
    S = tl.load(s_ptr + (bg * N + c) * F * D + f[:, None] * D + d[None, :], mask=dm[None, :], other=0.0)
    dq = tl.dot(do, tl.trans(S), input_precision="ieee") * q_dec[:, None]
    datt = tl.dot(do, tl.trans(v), input_precision="ieee") * intra
    dq += tl.dot(datt, k, input_precision="ieee")
    tl.store(dq_ptr + (j * P + p) * L * F + t[:, None] * F + f[None, :], dq, mask=tm[:, None])


def grad_states(q_ptr, do_ptr, lam_ptr, ds_ptr, ds0_ptr, G, R, L, D, N, F: tl.constexpr, C: tl.constexpr, BD: tl.constexpr):
    bg = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    lam = tl.load(lam_ptr + bg % G)
    u = tl.arange(0, C)
    f = tl.arange(0, F)
    d = j * BD + tl.arange(0, BD)
    dm = d < D
    q_dec = tl.exp(lam * (u + 1).to(tl.float32))
    chunk_dec = tl.exp(lam * C)
    dS = tl.full((F, BD), 0.0, tl.float32)
    for back in range(0, N):
        c = N - 1 - back
        tl.store(ds_ptr + (bg * N + c) * F * D + f[:, None] * D + d[None, :], dS, mask=dm[None, :])
        t = c * C + u
        tm = t < L
        dS = dS * chunk_dec
        for r in range(0, R):
            p = bg * R + r
            q = tl.load(q_ptr + p * L * F + t[:, None] * F + f[None, :], mask=tm[:, None], other=0.0)
            do = tl.load(do_ptr + p * L * D + t[:, None] * D + d[None, :], mask=tm[:, None] & dm[None, :], other=0.0)
            dS += tl.dot(tl.trans(q * q_dec[:, None]), do, input_precision="ieee")
    tl.store(ds0_ptr + bg * F * D + f[:, None] * D + d[None, :], dS, mask=dm[None, :])


def grad_kv(q_ptr, k_ptr, v_ptr, do_ptr, ds_ptr, lam_ptr, dk_ptr, dv_ptr, BG, G, R, L, D, N,
            F: tl.constexpr, C: tl.constexpr, BD: tl.constexpr):  # fmt: skip
    pc = tl.program_id(0).to(tl.int64)  # (b * G + g) * N + c
    j = tl.program_id(1)
    c = pc % N
    bg = pc // N
    lam = tl.load(lam_ptr + bg % G)
    u = tl.arange(0, C)
    f = tl.arange(0, F)
    d = j * BD + tl.arange(0, BD)
    dm = d < D
    diff = u[:, None] - u[None, :]
    intra = tl.where(diff >= 0, tl.exp(lam * tl.maximum(diff, 0).to(tl.float32)), 0.0)  # [i, t]
    k_dec = tl.exp(lam * (C - 1 - u).to(tl.float32))
    t = c * C + u
    tm = t < L
    k = tl.load(k_ptr + bg * L * F + t[:, None] * F + f[None, :], mask=tm[:, None], other=0.0)
    v = tl.load(v_ptr + bg * L * D + t[:, None] * D + d[None, :], mask=tm[:, None] & dm[None, :], other=0.0)
    dS = tl.load(ds_ptr + (bg * N + c) * F * D + f[:, None] * D + d[None, :], mask=dm[None, :], other=0.0)
    # what the later chunks' queries read of these keys, through dS
    dk = tl.dot(v, tl.trans(dS), input_precision="ieee") * k_dec[:, None]
    dv = tl.dot(k * k_dec[:, None], dS, input_precision="ieee")
    # what this chunk's own queries read, every query head of the group
    for r in range(0, R):
        p = bg * R + r
        q = tl.load(q_ptr + p * L * F + t[:, None] * F + f[None, :], mask=tm[:, None], other=0.0)
        do = tl.load(do_ptr + p * L * D + t[:, None] * D + d[None, :], mask=tm[:, None] & dm[None, :], other=0.0)
        datt = tl.dot(do, tl.trans(v), input_precision="ieee") * intra
        dk += tl.dot(tl.trans(datt), q, input_precision="ieee")
        att = tl.dot(q, tl.trans(k), input_precision="ieee") * intra
        dv += tl.dot(tl.trans(att), do, input_precision="ieee")
    tl.store(dk_ptr + (j * BG + bg) * L * F + t[:, None] * F + f[None, :], dk, mask=tm[:, None])
    tl.store(dv_ptr + bg * L * D + t[:, None] * D + d[None, :], dv, mask=tm[:, None] & dm[None, :])


# The interpreter check (rfkit.ops.triton_state.interpreter_problem): a loop to a bound passed at
# run time, as every kernel above has; adds N to each of the two values.
def probe(x_ptr, N):
    i = tl.arange(0, 2)
    acc = tl.load(x_ptr + i)
    for _ in range(0, N):
        acc += 1.0
    tl.store(x_ptr + i, acc)
