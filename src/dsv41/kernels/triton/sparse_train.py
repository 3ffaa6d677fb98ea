"""Sparse training attention in Triton, forward and backward (issue 18, SPEC §3).

Per query t and head h, one softmax over its window keys (u ∈ (t − W, t], same document, u ≥ the
bounded-replay start) ∪ its K selected entries (index −1 = none) ∪ the per-head sink logit, which
only adds to the denominator; K = V = the latent rows (MQA). Window keys are read from (B, T, D),
entries by index from the (B, N, D) pool — no (B, T, W + K, D) tensor is ever built. The twin is
`model.sparse_attention.attend_sparse` (band + gathered rows, plain autograd).

FlashAttention-2 layout, log2 domain, fp32 softmax and accumulators:
  * window kernels take BLOCK_M consecutive (query, head) rows, g = t·H + h: the heads of a token
    are adjacent MMA rows with no padding (`small` has H = 6), and the ~BLOCK_M / H consecutive
    queries of a tile share its window key tiles;
  * entry kernels take one query per program, its heads padded to HP ≥ 16 as the MMA rows (each
    query has its own entries: nothing to share);
  * the two halves meet through the log-sum-exp: the entry pass writes its normalized partial
    (o_e, lse_e) and the window pass, which starts its running max at the sink, folds it in.
Only O and the LSE (sink included) are saved; the backward recomputes P:
  1. `_window_dq_kernel` (per row tile): Δ = rowsum(dO ⊙ O), dQ of the window keys;
  2. `_entry_bwd_kernel` (per query): dQ of the entries, and d(entry rows) = dSᵀ·Q + Pᵀ·dO summed
     over the heads, atomically added at the gathered rows;
  3. `_window_dkv_kernel` (per key tile): dK + dV of the window keys from the ≤ BLOCK_N + W − 1
     queries that see them — a second pass, no atomics;
  4. d(sink) = −Σ_t exp(sink − LSE)·Δ in torch ((B, T, H) tensors).
The forward can also write the entries' scaled logits (B, T, H, K), fp32: the detached target of
the indexer's top-k KL (`model.sparse_attention.indexer_kl_topk`).

Limits: D a power of two in [16, 256], H ≤ 64 (the entry pass holds an (HP, D) accumulator); q,
window keys and entries of one dtype (fp32: IEEE fp32 dots; bf16 / fp16: tensor-core dots with fp32
accumulation). Under TRITON_INTERPRET=1 the dots run in fp32 (the interpreter's bf16 dot is wrong,
`common.py`). Every loop has a compile-time trip count (the interpreter cannot take runtime bounds);
tiles past the sequence are masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from dsv41.kernels.triton.common import interpreting, runnable

LOG2E = 1.4426950408889634
_LOG2E = tl.constexpr(LOG2E)


# ---------------------------------------------------------------------------------------------
# forward


@triton.jit
def _entry_fwd_kernel(q_ptr, pool_ptr, idx_ptr, oe_ptr, lse_e_ptr, logit_ptr,
                      T, H, K, scale, qk_scale,
                      s_qb, s_qt, s_qh, s_pb, s_pn, s_ib, s_it,
                      D: tl.constexpr, HP: tl.constexpr, BLOCK_E: tl.constexpr, N_ETILES: tl.constexpr,
                      STORE_LOGITS: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr):
    """One query's heads against its K entries: the normalized partial (o_e, lse_e in log2 units)."""
    bt = tl.program_id(0)
    b, t = bt // T, bt % T
    h = tl.arange(0, HP)
    h_ok = h < H
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b.to(tl.int64) * s_qb + t * s_qt + h[:, None] * s_qh + d[None, :],
                mask=h_ok[:, None], other=0.0).to(DT)  # (HP, D)
    m_i = tl.full([HP], -1.0e30, dtype=tl.float32)  # finite: no −inf − −inf
    l_i = tl.zeros([HP], dtype=tl.float32)
    acc = tl.zeros([HP, D], dtype=tl.float32)
    idx_row = idx_ptr + b.to(tl.int64) * s_ib + t * s_it
    pool_b = pool_ptr + b.to(tl.int64) * s_pb
    row = bt.to(tl.int64) * H + h  # (HP,) row of (B·T·H)
    for j in range(N_ETILES):
        e = j * BLOCK_E + tl.arange(0, BLOCK_E)
        idx = tl.load(idx_row + e, mask=e < K, other=-1).to(tl.int64)
        ok = idx >= 0
        k = tl.load(pool_b + tl.where(ok, idx, 0)[:, None] * s_pn + d[None, :], mask=ok[:, None],
                    other=0.0).to(DT)  # (BLOCK_E, D)
        s = tl.dot(q, tl.trans(k), input_precision=PREC)  # (HP, BLOCK_E) raw q·k
        if STORE_LOGITS:
            tl.store(logit_ptr + row[:, None] * K + e[None, :], s * scale, mask=h_ok[:, None] & (e < K)[None, :])
        s = tl.where(ok[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(DT), k, input_precision=PREC) + acc * alpha[:, None]
        m_i = m_new
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(oe_ptr + row[:, None] * D + d[None, :], o, mask=h_ok[:, None])
    lse_e = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))  # −inf: no valid entry
    tl.store(lse_e_ptr + row, lse_e, mask=h_ok)


@triton.jit
def _window_fwd_kernel(q_ptr, kv_ptr, doc_ptr, ws_ptr, sink_ptr, oe_ptr, lse_e_ptr, o_ptr, lse_ptr,
                       T, H, window, qk_scale,
                       s_qb, s_qt, s_qh, s_kb, s_kt, s_db, s_wb,
                       D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, N_WTILES: tl.constexpr,
                       HAS_WS: tl.constexpr, HAS_ENTRIES: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr):
    """BLOCK_M (query, head) rows against their window keys, the sink, then the entries' partial."""
    b = tl.program_id(1)
    g0 = tl.program_id(0) * BLOCK_M
    g = g0 + tl.arange(0, BLOCK_M)
    row_ok = g < T * H
    t, h = g // H, g % H  # row g = t·H + h
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b.to(tl.int64) * s_qb + (t.to(tl.int64) * s_qt + h * s_qh)[:, None] + d[None, :],
                mask=row_ok[:, None], other=0.0).to(DT)  # (BLOCK_M, D)
    doc_q = tl.load(doc_ptr + b * s_db + t, mask=row_ok, other=-2)
    low = t - window + 1  # the window's lowest key, or the replay start
    if HAS_WS:
        low = tl.maximum(low, tl.load(ws_ptr + b * s_wb + t, mask=row_ok, other=0))
    m_i = tl.load(sink_ptr + h, mask=row_ok, other=0.0).to(tl.float32) * _LOG2E  # the sink starts the max
    l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)  # … and adds exp2(sink − m) = 1
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    kv_b = kv_ptr + b.to(tl.int64) * s_kb
    u0 = tl.maximum(g0 // H - window + 1, 0)
    for j in range(N_WTILES):
        u = u0 + j * BLOCK_N + tl.arange(0, BLOCK_N)
        u_ok = u < T
        k = tl.load(kv_b + u.to(tl.int64)[:, None] * s_kt + d[None, :], mask=u_ok[:, None], other=0.0).to(DT)
        doc_k = tl.load(doc_ptr + b * s_db + u, mask=u_ok, other=-3)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale  # (BLOCK_M, BLOCK_N)
        vis = ((u[None, :] >= low[:, None]) & (u[None, :] <= t[:, None]) & u_ok[None, :]
               & (doc_k[None, :] == doc_q[:, None]))  # window (t − W, t], replay start, same document
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(DT), k, input_precision=PREC) + acc * alpha[:, None]
        m_i = m_new
    row = b.to(tl.int64) * T * H + g  # (BLOCK_M,) row of (B·T·H)
    if HAS_ENTRIES:  # fold in the entries' normalized partial: weight exp2(lse_e − m)
        lse_e = tl.load(lse_e_ptr + row, mask=row_ok, other=float("-inf"))
        o_e = tl.load(oe_ptr + row[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
        m_new = tl.maximum(m_i, lse_e)
        alpha = tl.exp2(m_i - m_new)
        w = tl.exp2(lse_e - m_new)
        l_i = l_i * alpha + w
        acc = acc * alpha[:, None] + w[:, None] * o_e
        m_i = m_new
    tl.store(o_ptr + row[:, None] * D + d[None, :], (acc / l_i[:, None]).to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None])
    tl.store(lse_ptr + row, m_i + tl.log2(l_i), mask=row_ok)


# ---------------------------------------------------------------------------------------------
# backward


@triton.jit
def _window_dq_kernel(q_ptr, kv_ptr, doc_ptr, ws_ptr, o_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
                      T, H, window, scale, qk_scale,
                      s_qb, s_qt, s_qh, s_kb, s_kt, s_db, s_wb,
                      D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, N_WTILES: tl.constexpr,
                      HAS_WS: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr):
    """Δ = rowsum(dO ⊙ O) and dQ (fp32) of BLOCK_M rows from their window keys."""
    b = tl.program_id(1)
    g0 = tl.program_id(0) * BLOCK_M
    g = g0 + tl.arange(0, BLOCK_M)
    row_ok = g < T * H
    t, h = g // H, g % H  # row g = t·H + h
    d = tl.arange(0, D)
    row = b.to(tl.int64) * T * H + g
    q = tl.load(q_ptr + b.to(tl.int64) * s_qb + (t.to(tl.int64) * s_qt + h * s_qh)[:, None] + d[None, :],
                mask=row_ok[:, None], other=0.0).to(DT)
    do = tl.load(do_ptr + row[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
    o = tl.load(o_ptr + row[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)  # (BLOCK_M,)
    tl.store(delta_ptr + row, delta, mask=row_ok)
    do = do.to(DT)
    lse = tl.load(lse_ptr + row, mask=row_ok, other=0.0)
    doc_q = tl.load(doc_ptr + b * s_db + t, mask=row_ok, other=-2)
    low = t - window + 1  # the window's lowest key, or the replay start
    if HAS_WS:
        low = tl.maximum(low, tl.load(ws_ptr + b * s_wb + t, mask=row_ok, other=0))
    dq = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    kv_b = kv_ptr + b.to(tl.int64) * s_kb
    u0 = tl.maximum(g0 // H - window + 1, 0)
    for j in range(N_WTILES):
        u = u0 + j * BLOCK_N + tl.arange(0, BLOCK_N)
        u_ok = u < T
        k = tl.load(kv_b + u.to(tl.int64)[:, None] * s_kt + d[None, :], mask=u_ok[:, None], other=0.0).to(DT)
        doc_k = tl.load(doc_ptr + b * s_db + u, mask=u_ok, other=-3)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        vis = ((u[None, :] >= low[:, None]) & (u[None, :] <= t[:, None]) & u_ok[None, :] & row_ok[:, None]
               & (doc_k[None, :] == doc_q[:, None]))
        s = tl.where(vis, s, float("-inf"))
        p = tl.exp2(s - lse[:, None])
        dp = tl.dot(do, tl.trans(k), input_precision=PREC)  # V = K
        ds = p * (dp - delta[:, None]) * scale
        dq = tl.dot(ds.to(DT), k, input_precision=PREC) + dq
    tl.store(dq_ptr + row[:, None] * D + d[None, :], dq, mask=row_ok[:, None])


@triton.jit
def _entry_bwd_kernel(q_ptr, pool_ptr, idx_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dpool_ptr,
                      T, H, K, scale, qk_scale,
                      s_qb, s_qt, s_qh, s_pb, s_pn, s_ib, s_it, s_dpb,
                      D: tl.constexpr, HP: tl.constexpr, BLOCK_E: tl.constexpr, N_ETILES: tl.constexpr,
                      DT: tl.constexpr, PREC: tl.constexpr):
    """One query: dQ of its entries (added to the window's dQ) and its entries' row gradients (atomics)."""
    bt = tl.program_id(0)
    b, t = bt // T, bt % T
    h = tl.arange(0, HP)
    h_ok = h < H
    d = tl.arange(0, D)
    row = bt.to(tl.int64) * H + h
    q = tl.load(q_ptr + b.to(tl.int64) * s_qb + t * s_qt + h[:, None] * s_qh + d[None, :],
                mask=h_ok[:, None], other=0.0).to(DT)
    do = tl.load(do_ptr + row[:, None] * D + d[None, :], mask=h_ok[:, None], other=0.0).to(DT)
    lse = tl.load(lse_ptr + row, mask=h_ok, other=0.0)
    delta = tl.load(delta_ptr + row, mask=h_ok, other=0.0)
    dq = tl.zeros([HP, D], dtype=tl.float32)
    idx_row = idx_ptr + b.to(tl.int64) * s_ib + t * s_it
    pool_b = pool_ptr + b.to(tl.int64) * s_pb
    dpool_b = dpool_ptr + b.to(tl.int64) * s_dpb
    for j in range(N_ETILES):
        e = j * BLOCK_E + tl.arange(0, BLOCK_E)
        idx = tl.load(idx_row + e, mask=e < K, other=-1).to(tl.int64)
        ok = idx >= 0
        idx = tl.where(ok, idx, 0)
        k = tl.load(pool_b + idx[:, None] * s_pn + d[None, :], mask=ok[:, None], other=0.0).to(DT)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale  # (HP, BLOCK_E)
        p = tl.exp2(tl.where(h_ok[:, None] & ok[None, :], s, float("-inf")) - lse[:, None])
        dp = tl.dot(do, tl.trans(k), input_precision=PREC)
        ds = p * (dp - delta[:, None]) * scale
        dq = tl.dot(ds.to(DT), k, input_precision=PREC) + dq
        # K = V: the row's gradient is dSᵀ·Q (as a key) + Pᵀ·dO (as a value), summed over the heads
        dk = (tl.dot(tl.trans(ds).to(DT), q, input_precision=PREC)
              + tl.dot(tl.trans(p).to(DT), do, input_precision=PREC))  # (BLOCK_E, D)
        tl.atomic_add(dpool_b + idx[:, None] * D + d[None, :], dk, mask=ok[:, None], sem="relaxed")
    dq_rows = dq_ptr + row[:, None] * D + d[None, :]
    tl.store(dq_rows, dq + tl.load(dq_rows, mask=h_ok[:, None], other=0.0), mask=h_ok[:, None])


@triton.jit
def _window_dkv_kernel(q_ptr, kv_ptr, doc_ptr, ws_ptr, do_ptr, lse_ptr, delta_ptr, dkv_ptr,
                       T, H, window, scale, qk_scale,
                       s_qb, s_qt, s_qh, s_kb, s_kt, s_db, s_wb,
                       D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, N_QTILES: tl.constexpr,
                       HAS_WS: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr):
    """dK + dV (fp32) of BLOCK_N window keys from the rows of the queries whose windows hold them."""
    b = tl.program_id(1)
    u = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    u_ok = u < T
    d = tl.arange(0, D)
    kv_b = kv_ptr + b.to(tl.int64) * s_kb
    k = tl.load(kv_b + u.to(tl.int64)[:, None] * s_kt + d[None, :], mask=u_ok[:, None], other=0.0).to(DT)
    doc_k = tl.load(doc_ptr + b * s_db + u, mask=u_ok, other=-3)
    acc = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    g_start = tl.program_id(0) * BLOCK_N * H  # first row of query u0: queries u0 .. u0 + BLOCK_N + W − 2 see the tile
    for j in range(N_QTILES):
        g = g_start + j * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = g < T * H
        t, h = g // H, g % H  # row g = t·H + h
        row = b.to(tl.int64) * T * H + g
        q = tl.load(q_ptr + b.to(tl.int64) * s_qb + (t.to(tl.int64) * s_qt + h * s_qh)[:, None] + d[None, :],
                    mask=row_ok[:, None], other=0.0).to(DT)  # (BLOCK_M, D)
        do = tl.load(do_ptr + row[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0).to(DT)
        lse = tl.load(lse_ptr + row, mask=row_ok, other=0.0)
        delta = tl.load(delta_ptr + row, mask=row_ok, other=0.0)
        doc_q = tl.load(doc_ptr + b * s_db + t, mask=row_ok, other=-2)
        low = t - window + 1
        if HAS_WS:
            low = tl.maximum(low, tl.load(ws_ptr + b * s_wb + t, mask=row_ok, other=0))
        vis = ((u[:, None] >= low[None, :]) & (u[:, None] <= t[None, :]) & u_ok[:, None] & row_ok[None, :]
               & (doc_k[:, None] == doc_q[None, :]))  # (BLOCK_N, BLOCK_M): the transposed window mask
        s = tl.dot(k, tl.trans(q), input_precision=PREC) * qk_scale  # Sᵀ
        p = tl.exp2(tl.where(vis, s, float("-inf")) - lse[None, :])
        dp = tl.dot(k, tl.trans(do), input_precision=PREC)
        ds = p * (dp - delta[None, :]) * scale
        acc = tl.dot(ds.to(DT), q, input_precision=PREC) + tl.dot(p.to(DT), do, input_precision=PREC) + acc
    tl.store(dkv_ptr + (b.to(tl.int64) * T + u.to(tl.int64))[:, None] * D + d[None, :], acc, mask=u_ok[:, None])


# ---------------------------------------------------------------------------------------------
# launcher and autograd


_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _dot_types(q: Tensor) -> tuple[tl.dtype, str]:
    """Dot operand dtype and precision: IEEE fp32 for fp32 inputs and in the interpreter (whose bf16
    dot is wrong), else the inputs' 16-bit type on the tensor cores (fp32 accumulation)."""
    if interpreting() or q.dtype == torch.float32:
        return tl.float32, "ieee"
    return _DTYPES[q.dtype], "tf32"  # the precision flag only applies to fp32 operands


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Outputs and scratch (a function so that tests can poison them)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(f"sparse_train_attention: {msg}")


def supported(q: Tensor, window_kv: Tensor, entries: Tensor | None) -> bool:
    """Shapes and dtypes the kernels take (see the module docstring's limits; the caller casts the three
    to one dtype)."""
    D, H = q.size(-1), q.size(-2)
    floats = all(t is None or t.dtype in _DTYPES for t in (q, window_kv, entries))
    return q.dim() == 4 and floats and 16 <= D <= 256 and D & (D - 1) == 0 and 1 <= H <= 64


def _config(H: int, T: int, window: int, K: int, block_m: int | None, block_n: int | None,
            block_e: int | None) -> dict:
    interp = interpreting()
    block_m = block_m or (32 if interp else 64)
    block_n = block_n or (32 if interp else 64)
    block_e = block_e or (16 if interp else 32)
    span = min(window, T)  # keys (t − W, t] of the tile's queries, clipped at the sequence start
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_E=block_e, HP=max(16, triton.next_power_of_2(H)),
                N_WTILES=triton.cdiv(span + (H + block_m - 2) // H, block_n),
                N_QTILES=triton.cdiv((block_n + span - 1) * H, block_m),
                N_ETILES=triton.cdiv(K, block_e) if K else 0)


def _strides(q: Tensor, kv: Tensor, doc: Tensor, ws: Tensor | None) -> tuple[int, ...]:
    return (q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1), doc.stride(0),
            ws.stride(0) if ws is not None else 0)


def _forward(q, kv, doc, ws, sink, pool, idx, scale, window, want_logits, cfg, num_warps):
    B, T, H, D = q.shape
    dev = q.device
    K = idx.size(-1) if pool is not None else 0
    dt, prec = _dot_types(q)
    o = _empty((B, T, H, D), q.dtype, dev)
    lse = _empty((B, T, H), torch.float32, dev)
    logits = _empty((B, T, H, K), torch.float32, dev) if want_logits and K else None
    oe = lse_e = None
    if K:
        oe = _empty((B, T, H, D), torch.float32, dev)
        lse_e = _empty((B, T, H), torch.float32, dev)
        _entry_fwd_kernel[(B * T,)](
            q, pool, idx, oe, lse_e, logits if logits is not None else lse_e,
            T, H, K, float(scale), float(scale) * LOG2E,
            q.stride(0), q.stride(1), q.stride(2), pool.stride(0), pool.stride(1), idx.stride(0), idx.stride(1),
            D=D, HP=cfg["HP"], BLOCK_E=cfg["BLOCK_E"], N_ETILES=cfg["N_ETILES"], STORE_LOGITS=logits is not None,
            DT=dt, PREC=prec, num_warps=4)
    _window_fwd_kernel[(triton.cdiv(T * H, cfg["BLOCK_M"]), B)](
        q, kv, doc, ws if ws is not None else doc, sink, oe if K else o, lse_e if K else lse, o, lse,
        T, H, int(window), float(scale) * LOG2E, *_strides(q, kv, doc, ws),
        D=D, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], N_WTILES=cfg["N_WTILES"], HAS_WS=ws is not None,
        HAS_ENTRIES=bool(K), DT=dt, PREC=prec, num_warps=num_warps)
    return o, lse, logits


def _backward(q, kv, doc, ws, sink, pool, idx, o, lse, do, scale, window, cfg, num_warps):
    B, T, H, D = q.shape
    dev = q.device
    K = idx.size(-1) if pool is not None else 0
    dt, prec = _dot_types(q)
    do = do.contiguous()
    delta = _empty((B, T, H), torch.float32, dev)
    dq = _empty((B, T, H, D), torch.float32, dev)
    dkv = _empty((B, T, D), torch.float32, dev)
    strides = _strides(q, kv, doc, ws)
    ws_arg = ws if ws is not None else doc
    _window_dq_kernel[(triton.cdiv(T * H, cfg["BLOCK_M"]), B)](
        q, kv, doc, ws_arg, o, do, lse, delta, dq, T, H, int(window), float(scale), float(scale) * LOG2E, *strides,
        D=D, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], N_WTILES=cfg["N_WTILES"], HAS_WS=ws is not None,
        DT=dt, PREC=prec, num_warps=num_warps)
    dpool = None
    if K:
        dpool = torch.zeros(pool.shape, dtype=torch.float32, device=dev)  # atomics add into it
        _entry_bwd_kernel[(B * T,)](
            q, pool, idx, do, lse, delta, dq, dpool, T, H, K, float(scale), float(scale) * LOG2E,
            q.stride(0), q.stride(1), q.stride(2), pool.stride(0), pool.stride(1), idx.stride(0), idx.stride(1),
            dpool.stride(0), D=D, HP=cfg["HP"], BLOCK_E=cfg["BLOCK_E"], N_ETILES=cfg["N_ETILES"],
            DT=dt, PREC=prec, num_warps=4)
    _window_dkv_kernel[(triton.cdiv(T, cfg["BLOCK_N"]), B)](
        q, kv, doc, ws_arg, do, lse, delta, dkv, T, H, int(window), float(scale), float(scale) * LOG2E, *strides,
        D=D, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], N_QTILES=cfg["N_QTILES"], HAS_WS=ws is not None,
        DT=dt, PREC=prec, num_warps=num_warps)
    # the sink only adds to the denominator: ∂L/∂sink_h = −Σ_t P(sink)·Δ
    dsink = -(torch.exp2(sink.float() * LOG2E - lse) * delta).sum((0, 1))
    return dq.to(q.dtype), dkv.to(kv.dtype), (dpool.to(pool.dtype) if dpool is not None else None), dsink.to(sink.dtype)


class _SparseTrainAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, pool, sink, doc, ws, idx, scale, window, want_logits, cfg, num_warps):
        o, lse, logits = _forward(q, kv, doc, ws, sink, pool, idx, scale, window, want_logits, cfg, num_warps)
        ctx.save_for_backward(q, kv, pool, sink, doc, ws, idx, o, lse)
        ctx.scale, ctx.window, ctx.cfg, ctx.num_warps = scale, window, cfg, num_warps
        outs = (o, lse) + ((logits,) if logits is not None else ())
        ctx.mark_non_differentiable(*outs[1:])
        return outs

    @staticmethod
    def backward(ctx, do, *_):
        q, kv, pool, sink, doc, ws, idx, o, lse = ctx.saved_tensors
        dq, dkv, dpool, dsink = _backward(q, kv, doc, ws, sink, pool, idx, o, lse, do, ctx.scale, ctx.window,
                                          ctx.cfg, ctx.num_warps)
        return dq, dkv, dpool, dsink, None, None, None, None, None, None, None, None


def sparse_train_attention(q: Tensor, window_kv: Tensor, doc_ids: Tensor, window_start: Tensor | None,
                           window: int, entries: Tensor | None, index: Tensor | None, sink: Tensor, scale: float,
                           *, entry_logits: bool = False, block_m: int | None = None, block_n: int | None = None,
                           block_e: int | None = None, num_warps: int | None = None
                           ) -> tuple[Tensor, Tensor, Tensor | None]:
    """See `dsv41.kernels.ops.sparse_train_attention`. Knobs: (query, head) rows per window tile
    (block_m), keys per window tile (block_n), entries per tile (block_e), warps of the window kernels."""
    _check(q.dim() == 4 and q.is_floating_point(), f"q must be (B, T, H, D) float, got {tuple(q.shape)} {q.dtype}")
    B, T, H, D = q.shape
    _check(runnable(q), "tensors must be on CUDA (or TRITON_INTERPRET=1)")
    _check(supported(q, window_kv, entries), f"unsupported shape or dtype: q {tuple(q.shape)} {q.dtype}, window "
           f"{window_kv.dtype}, entries {None if entries is None else entries.dtype} (D a power of two in "
           "[16, 256], H ≤ 64, fp32 / bf16 / fp16)")
    _check(all(t is None or t.dtype == q.dtype for t in (window_kv, entries)),
           f"q, window_kv and entries must have one dtype, got {q.dtype}, {window_kv.dtype}, "
           f"{None if entries is None else entries.dtype}")
    _check(window_kv.shape == (B, T, D), f"window_kv must be {(B, T, D)}, got {tuple(window_kv.shape)}")
    _check(doc_ids.shape == (B, T) and not doc_ids.is_floating_point(), f"doc_ids must be ({B}, {T}) integer")
    _check(window_start is None or window_start.shape == (B, T), f"window_start must be ({B}, {T})")
    _check(sink.shape == (H,), f"sink must be ({H},), got {tuple(sink.shape)}")
    _check(window >= 1, f"window must be >= 1, got {window}")
    has_entries = entries is not None and index is not None and index.size(-1) > 0 and entries.size(1) > 0
    if has_entries:
        _check(entries.dim() == 3 and entries.shape[0] == B and entries.size(2) == D,
               f"entries must be ({B}, N, {D}), got {tuple(entries.shape)}")
        _check(index.shape[:2] == (B, T) and index.dim() == 3 and not index.is_floating_point(),
               f"index must be ({B}, {T}, K) integer, got {tuple(index.shape)}")
        entries = entries.contiguous()
        index = index.to(torch.int32).contiguous()
    else:
        entries = index = None
    q = q if q.stride(-1) == 1 else q.contiguous()
    window_kv = window_kv.contiguous()
    doc_ids = doc_ids.to(torch.int32).contiguous()
    window_start = window_start.to(torch.int32).contiguous() if window_start is not None else None
    cfg = _config(H, T, window, index.size(-1) if has_entries else 0, block_m, block_n, block_e)
    if B * T == 0:
        o = q * 0  # keeps autograd connected
        return o, q.new_zeros(B, T, H, dtype=torch.float32), None
    outs = _SparseTrainAttention.apply(q, window_kv, entries, sink.contiguous(), doc_ids, window_start, index,
                                       float(scale), int(min(window, 1 << 30)), bool(entry_logits and has_entries),
                                       cfg, num_warps or 4)
    o, lse2 = outs[0], outs[1]
    return o, lse2 / LOG2E, (outs[2] if len(outs) > 2 else None)
