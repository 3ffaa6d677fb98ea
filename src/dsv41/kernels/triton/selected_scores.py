"""The indexer's scores of its selected entries, forward and backward, in Triton (issue 18, SPEC §3).

Per query t: s_k = Σ_h w_h · relu(q_h · k_{idx_k}) over its K selected index keys (idx −1 reads row 0, as the
twin's `gather_rows` does). The twin, `model.sparse_attention._SelectedScores`, gathers the keys into a
(B, T, K, Di) fp32 tensor twice (forward and backward), makes (B, T, K, Di) key gradients and scatters them with
`index_add_` — ~5 ms a layer of `small` at 16 × 1024 on the H100 (benchmarks/train_profile.py: the largest
gathers of the step). Here the keys are read by index straight from the (B, N, Di) pool, nothing (B, T, K, ·) is
written but the (B, T, K) scores, and the backward recomputes the dot products:

  * `_scores_fwd_kernel` (one query per program): dots = q · keysᵀ (Hp × BLOCK_K, the heads padded to Hp ≥ 16
    MMA rows), s = Σ_h w_h relu(dots);
  * `_scores_bwd_kernel` (one query per program): with g = ∂L/∂s, d_dots = g · w_h · [dots > 0];
    ∂w_h = Σ_k g_k relu(dots_hk), ∂q = d_dots · keys, and ∂k_{idx_k} += d_dotsᵀ · q atomically added (fp32) at
    the gathered rows.

Every dot is an IEEE fp32 dot (the twin's einsums run in fp32 on the inputs' values; bf16 inputs are exact in
fp32): the kernels agree with the twin to fp32 rounding in any input dtype. Limits: Di a power of two in
[16, 256], Hi ≤ 64. Under TRITON_INTERPRET=1 the kernels run on CPU tensors (the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from dsv41.kernels.triton.common import interpreting, runnable


@triton.jit
def _query(q_ptr, w_ptr, T, H, s_qb, s_qt, s_qh, s_wb, s_wt, D: tl.constexpr, HP: tl.constexpr):
    """The program's query: (b, t, its heads' rows (HP, D) fp32 — padding rows 0 —, their weights (HP,) fp32)."""
    bt = tl.program_id(0)
    b, t = bt // T, bt % T
    h = tl.arange(0, HP)
    h_ok = h < H
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b.to(tl.int64) * s_qb + t * s_qt + h[:, None] * s_qh + d[None, :],
                mask=h_ok[:, None], other=0.0).to(tl.float32)
    w = tl.load(w_ptr + b.to(tl.int64) * s_wb + t * s_wt + h, mask=h_ok, other=0.0).to(tl.float32)
    return b, t, q, w


@triton.jit
def _keys(k_ptr, idx_ptr, b, t, j, K, s_kb, s_kn, s_ib, s_it, D: tl.constexpr, BLOCK_K: tl.constexpr):
    """Tile j of the query's picks: (positions e, e < K, rows idx (−1 → 0: the twin's clamp), keys (BLOCK_K, D))."""
    e = j * BLOCK_K + tl.arange(0, BLOCK_K)
    e_ok = e < K
    idx = tl.maximum(tl.load(idx_ptr + b.to(tl.int64) * s_ib + t * s_it + e, mask=e_ok, other=0), 0).to(tl.int64)
    d = tl.arange(0, D)
    k = tl.load(k_ptr + b.to(tl.int64) * s_kb + idx[:, None] * s_kn + d[None, :], mask=e_ok[:, None],
                other=0.0).to(tl.float32)
    return e, e_ok, idx, k


@triton.jit
def _scores_fwd_kernel(q_ptr, w_ptr, k_ptr, idx_ptr, out_ptr, T, H, K,
                       s_qb, s_qt, s_qh, s_wb, s_wt, s_kb, s_kn, s_ib, s_it,
                       D: tl.constexpr, HP: tl.constexpr, BLOCK_K: tl.constexpr, N_KTILES: tl.constexpr):
    b, t, q, w = _query(q_ptr, w_ptr, T, H, s_qb, s_qt, s_qh, s_wb, s_wt, D, HP)
    out_row = out_ptr + (b.to(tl.int64) * T + t) * K
    for j in range(N_KTILES):
        e, e_ok, idx, k = _keys(k_ptr, idx_ptr, b, t, j, K, s_kb, s_kn, s_ib, s_it, D, BLOCK_K)
        dots = tl.dot(q, tl.trans(k), input_precision="ieee")  # (HP, BLOCK_K)
        s = tl.sum(tl.maximum(dots, 0.0) * w[:, None], 0)  # (BLOCK_K,)
        tl.store(out_row + e, s, mask=e_ok)


@triton.jit
def _scores_bwd_kernel(q_ptr, w_ptr, k_ptr, idx_ptr, g_ptr, dq_ptr, dw_ptr, dk_ptr, T, H, K,
                       s_qb, s_qt, s_qh, s_wb, s_wt, s_kb, s_kn, s_ib, s_it, s_gb, s_gt, s_dkb,
                       D: tl.constexpr, HP: tl.constexpr, BLOCK_K: tl.constexpr, N_KTILES: tl.constexpr):
    b, t, q, w = _query(q_ptr, w_ptr, T, H, s_qb, s_qt, s_qh, s_wb, s_wt, D, HP)
    d = tl.arange(0, D)
    g_row = g_ptr + b.to(tl.int64) * s_gb + t * s_gt
    dk_b = dk_ptr + b.to(tl.int64) * s_dkb
    dq = tl.zeros([HP, D], dtype=tl.float32)
    dw = tl.zeros([HP], dtype=tl.float32)
    for j in range(N_KTILES):
        e, e_ok, idx, k = _keys(k_ptr, idx_ptr, b, t, j, K, s_kb, s_kn, s_ib, s_it, D, BLOCK_K)
        g = tl.load(g_row + e, mask=e_ok, other=0.0).to(tl.float32)  # (BLOCK_K,)
        dots = tl.dot(q, tl.trans(k), input_precision="ieee")  # (HP, BLOCK_K)
        dw += tl.sum(tl.maximum(dots, 0.0) * g[None, :], 1)
        d_dots = tl.where(dots > 0, g[None, :] * w[:, None], 0.0)  # (HP, BLOCK_K)
        dq = tl.dot(d_dots, k, input_precision="ieee") + dq
        dk = tl.dot(tl.trans(d_dots), q, input_precision="ieee")  # (BLOCK_K, D)
        tl.atomic_add(dk_b + idx[:, None] * D + d[None, :], dk, mask=e_ok[:, None], sem="relaxed")
    h = tl.arange(0, HP)
    row = (b.to(tl.int64) * T + t) * H + h
    tl.store(dq_ptr + row[:, None] * D + d[None, :], dq, mask=(h < H)[:, None])
    tl.store(dw_ptr + row, dw, mask=h < H)


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Outputs (a function so that tests can poison them)."""
    return torch.empty(shape, dtype=dtype, device=device)


def supported(iq: Tensor, index_k: Tensor) -> bool:
    """Shapes and dtypes the kernels take: iq (B, T, Hi, Di), index_k (B, N, Di), Di a power of two in [16, 256],
    Hi ≤ 64, fp32 / bf16 / fp16."""
    floats = (torch.float32, torch.bfloat16, torch.float16)
    D = iq.size(-1)
    return (iq.dim() == 4 and index_k.dim() == 3 and iq.dtype in floats and index_k.dtype in floats
            and 16 <= D <= 256 and D & (D - 1) == 0 and 1 <= iq.size(2) <= 64 and index_k.size(-1) == D)


def _config(H: int, K: int) -> dict:
    block = 16 if interpreting() else 32
    return dict(HP=max(16, triton.next_power_of_2(H)), BLOCK_K=block, N_KTILES=triton.cdiv(K, block))


class _SelectedScoresKernel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, iq: Tensor, weights: Tensor, index_k: Tensor, topk: Tensor) -> Tensor:
        B, T, H, D = iq.shape
        K = topk.size(-1)
        iq, weights, index_k, topk = (x.contiguous() for x in (iq, weights, index_k, topk))
        cfg = _config(H, K)
        out = _empty((B, T, K), torch.float32, iq.device)
        _scores_fwd_kernel[(B * T,)](
            iq, weights, index_k, topk, out, T, H, K, iq.stride(0), iq.stride(1), iq.stride(2),
            weights.stride(0), weights.stride(1), index_k.stride(0), index_k.stride(1), topk.stride(0),
            topk.stride(1), D=D, num_warps=4, **cfg)
        ctx.save_for_backward(iq, weights, index_k, topk)
        ctx.cfg = cfg
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        iq, weights, index_k, topk = ctx.saved_tensors
        B, T, H, D = iq.shape
        K = topk.size(-1)
        grad = grad.float().contiguous()
        dq = _empty((B, T, H, D), torch.float32, iq.device)
        dw = _empty((B, T, H), torch.float32, iq.device)
        dk = torch.zeros(index_k.shape, dtype=torch.float32, device=iq.device)  # atomics add into it
        _scores_bwd_kernel[(B * T,)](
            iq, weights, index_k, topk, grad, dq, dw, dk, T, H, K, iq.stride(0), iq.stride(1), iq.stride(2),
            weights.stride(0), weights.stride(1), index_k.stride(0), index_k.stride(1), topk.stride(0),
            topk.stride(1), grad.stride(0), grad.stride(1), dk.stride(0), D=D, num_warps=4, **ctx.cfg)
        need = ctx.needs_input_grad
        return (dq.to(iq.dtype) if need[0] else None, dw.to(weights.dtype) if need[1] else None,
                dk.to(index_k.dtype) if need[2] else None, None)


def selected_index_scores(iq: Tensor, weights: Tensor, index_k: Tensor, topk: Tensor) -> Tensor:
    """See `dsv41.kernels.ops.selected_index_scores`: iq (B, T, Hi, Di), weights (B, T, Hi), index_k (B, N, Di),
    topk (B, T, K) int (−1 reads row 0) → (B, T, K) fp32, with autograd for iq, weights and index_k."""
    if not runnable(iq):
        raise ValueError("selected_index_scores: tensors must be on CUDA (or TRITON_INTERPRET=1)")
    if not supported(iq, index_k):
        raise ValueError(f"selected_index_scores: unsupported shapes or dtypes: iq {tuple(iq.shape)} {iq.dtype}, "
                         f"index_k {tuple(index_k.shape)} {index_k.dtype} (Di a power of two in [16, 256], "
                         "Hi ≤ 64, fp32 / bf16 / fp16)")
    B, T, H, _ = iq.shape
    if weights.shape != (B, T, H) or topk.shape[:2] != (B, T) or topk.dim() != 3 or index_k.size(0) != B:
        raise ValueError(f"selected_index_scores: weights {tuple(weights.shape)} must be {(B, T, H)}, topk "
                         f"{tuple(topk.shape)} (B, T, K) and index_k {tuple(index_k.shape)} (B, N, Di)")
    return _SelectedScoresKernel.apply(iq, weights, index_k, topk)
