"""The MoE router after its matmul in one kernel (`ops.moe_route`): score function, the biased top-k
choice, the chosen weights (normalized, scaled) and, for the dense MoE, the (N, E) routing matrix.

In torch this is ~12 small kernels per MoE layer (divide, softplus, sqrt, bias add, topk, gather, sum,
add, divide, multiply, zeros, scatter): 144 of the ~914 launches of a `small` decode step. Here one
program takes BLOCK_N tokens with all E experts in registers; the top-k is k rounds of (max, lowest index
holding it, mask it out). Arithmetic follows the twin: IEEE divisions and square root, softplus with
torch's threshold (x > 20 → x) and an accurate log1p (Kahan's: log(u)·y/(u − 1), u = 1 + y). The expert
order of a tie may differ from `torch.topk`'s (which leaves it unspecified); distinct scores choose the
same experts. Measured on the H200 (2026-12-04): the `small` decode step 914 → 770 kernels, replay
2.84 → 2.51 ms at batch 64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from dsv41.kernels.triton.common import jit_sizes, runnable

SCORE_FUNCS = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}


@jit_sizes("N")
def _route_kernel(logit_ptr, bias_ptr, w_ptr, idx_ptr, score_ptr, route_ptr, N, E, s_l, s_b, gate_temp,
                  route_scale, SCORE: tl.constexpr, K: tl.constexpr, NORM: tl.constexpr,
                  BIAS_ROWS: tl.constexpr, DENSE: tl.constexpr, ONES: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_E: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < N
    col_ok = cols < E
    ok = row_ok[:, None] & col_ok[None, :]
    r64 = rows.to(tl.int64)[:, None]
    z = tl.math.div_rn(tl.load(logit_ptr + r64 * s_l + cols[None, :], mask=ok, other=0.0).to(tl.float32),
                       gate_temp)
    if SCORE == 0:  # softmax over the experts
        z = tl.where(col_ok[None, :], z, float("-inf"))
        e = tl.exp(z - tl.max(z, axis=1)[:, None])
        s = tl.math.div_rn(e, tl.sum(e, axis=1)[:, None])
    elif SCORE == 1:
        s = tl.math.div_rn(tl.full(z.shape, 1.0, tl.float32), 1.0 + tl.exp(-z))
    else:  # sqrt(softplus(z)), softplus(z) = log1p(exp(z)), = z above torch's threshold 20
        y = tl.exp(tl.minimum(z, 20.0))
        u = 1.0 + y
        log1p = tl.where(u == 1.0, y, tl.log(u) * tl.math.div_rn(y, tl.where(u == 1.0, 1.0, u - 1.0)))  # Kahan
        s = tl.sqrt_rn(tl.where(z > 20.0, z, log1p))
    s = tl.where(ok, s, 0.0)
    tl.store(score_ptr + r64 * E + cols[None, :], s, mask=ok)
    if BIAS_ROWS:
        b = tl.load(bias_ptr + r64 * s_b + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    else:
        b = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    choice = tl.where(ok, s + b, float("-inf"))
    rank = tl.zeros([BLOCK_N, BLOCK_E], dtype=tl.int32)  # j + 1 where the j-th choice is, else 0
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(K):
        best = tl.max(choice, axis=1)
        first = tl.min(tl.where(choice == best[:, None], cols[None, :], BLOCK_E), axis=1)  # lowest index of the max
        hit = cols[None, :] == first[:, None]
        tl.store(idx_ptr + rows.to(tl.int64) * K + j, first.to(tl.int64), mask=row_ok)
        total += tl.sum(tl.where(hit, s, 0.0), axis=1)
        rank = tl.where(hit, j + 1, rank)
        choice = tl.where(hit, float("-inf"), choice)
    picked = rank > 0
    if NORM:
        denom = total + 1e-20
    for j in tl.static_range(K):  # the weights once their sum is known, from the registers
        w = tl.sum(tl.where(rank == j + 1, s, 0.0), axis=1)
        if NORM:
            w = tl.math.div_rn(w, denom)
        tl.store(w_ptr + rows.to(tl.int64) * K + j, w * route_scale, mask=row_ok)
    if DENSE:
        if NORM:
            dense = tl.math.div_rn(s, denom[:, None]) * route_scale
        else:
            dense = s * route_scale
        s_r = E + ONES  # the routing matrix's row: E weights, then ONES columns of 1
        tl.store(route_ptr + r64 * s_r + cols[None, :], tl.where(picked, dense, 0.0), mask=ok)
        for j in tl.static_range(ONES):
            tl.store(route_ptr + rows.to(tl.int64) * s_r + E + j, tl.full([BLOCK_N], 1.0, tl.float32), mask=row_ok)


def moe_route(logits: Tensor, bias: Tensor, gate_temp: float, score_func: str, k: int, norm: bool,
              route_scale: float, dense: bool = False, dense_ones: int = 0
              ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """See `dsv41.kernels.ops.moe_route`."""
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"moe_route: logits must be (N, E) float32, got {tuple(logits.shape)} {logits.dtype}")
    N, E = logits.shape
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"moe_route: score_func must be one of {sorted(SCORE_FUNCS)}, got {score_func!r}")
    if not 1 <= k <= E:
        raise ValueError(f"moe_route: k must be in [1, {E}], got {k}")
    if bias.shape not in ((E,), (N, E)):
        raise ValueError(f"moe_route: bias must be ({E},) or ({N}, {E}), got {tuple(bias.shape)}")
    if not runnable(logits):
        raise ValueError(f"moe_route: Triton needs CUDA tensors or TRITON_INTERPRET=1, got {logits.device}")
    dev = logits.device
    weights = torch.empty(N, k, dtype=torch.float32, device=dev)
    indices = torch.empty(N, k, dtype=torch.int64, device=dev)
    scores = torch.empty(N, E, dtype=torch.float32, device=dev)
    if dense_ones < 0:
        raise ValueError(f"moe_route: dense_ones must be >= 0, got {dense_ones}")
    route = torch.empty(N, E + dense_ones, dtype=torch.float32, device=dev) if dense else None
    if N == 0:
        return weights, indices, scores, route
    lg = logits if logits.stride(1) == 1 else logits.contiguous()
    b = bias.float() if bias.stride(-1) == 1 else bias.float().contiguous()
    block_e = triton.next_power_of_2(E)
    block_n = max(1, min(16, 2048 // block_e))
    _route_kernel[(triton.cdiv(N, block_n),)](
        lg, b, weights, indices, scores, route if dense else scores, N, E, lg.stride(0),
        b.stride(0) if b.dim() == 2 else 0, float(gate_temp), float(route_scale),
        SCORE=SCORE_FUNCS[score_func], K=int(k), NORM=bool(norm and k > 1), BIAS_ROWS=b.dim() == 2, DENSE=dense,
        ONES=int(dense_ones) if dense else 0, BLOCK_N=block_n, BLOCK_E=block_e, num_warps=4)
    return weights, indices, scores, route
