"""The DSpark drafter's greedy Markov loop in K + 1 launches (`ops.markov_greedy`).

In torch, each of the K draft positions is ~10 small kernels (embedding gather, casts, the (B, r) × (r, V)
bias GEMM, the add, the confidence concat and dot, the argmax): ~50 launches in the proposal's CUDA graph,
each a few µs of latency for microseconds of work. Here one kernel per position i, grid
(cdiv(B, BLOCK_B), cdiv(V, BLOCK_V)):

* every program first finds its rows' prev: the anchor at i = 0, else the argmax of position i − 1 reduced
  from that position's per-block partials (max, lowest argmax) — redundantly in every program, NB values a
  row; the programs of V-block 0 write token i − 1 and the confidence logit of position i,
  w[:dim] · hidden[b, i] + w[dim:] · embed[prev];
* then its V-block of logits = base[b, i, block] + head[block] · embed[prev] (fp32 products, r in BLOCK_R
  chunks: `tl.dot` in IEEE fp32 for a tile of rows, a broadcast product for one row), and the block's
  (max, lowest argmax) of each row into the partials of position i.
A last small kernel reduces position K − 1's partials into token K − 1. Each position has its own partials
(programs of kernel i read i − 1's while they write i's), allocated per call from the caching allocator:
no host sync, fixed shapes, capturable in a CUDA graph.

Argmax semantics are torch.argmax's: ties → the lowest index, a NaN counts as larger than everything (the
first NaN wins). The products are summed in another order than torch's GEMM, so logits agree to fp32
rounding: tokens equal the twin's except where the top two logits of a row are within that rounding (and
confidence logits agree to fp32 rounding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from dsv41.kernels.triton.common import interpreting, jit_sizes, runnable

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _max_lowest(values, index):
    """Per row of (ROWS, N) values with their int32 indices: (max, its lowest index), NaN the largest value
    (the first NaN's index), as torch.argmax. Masked lanes carry −inf and index 2^31 − 1 (past every id)."""
    nan = values != values
    any_nan = tl.max(nan.to(tl.int32), axis=1) > 0
    first_nan = tl.min(tl.where(nan, index, 2147483647), axis=1)
    clean = tl.where(nan, float("-inf"), values)
    top = tl.max(clean, axis=1)
    first_top = tl.min(tl.where(clean == top[:, None], index, 2147483647), axis=1)
    return tl.where(any_nan, float("nan"), top), tl.where(any_nan, first_nan, first_top)


@triton.jit
def _previous_tokens(part_max_ptr, part_idx_ptr, rows, row_ok, n_rows, NB, step,
                     BLOCK_NB: tl.constexpr):
    """The tokens of position `step` of these rows, reduced from its partials (step, row, NB)."""
    j = tl.arange(0, BLOCK_NB)
    off = (step * n_rows + rows).to(tl.int64)[:, None] * NB + j[None, :]
    ok = row_ok[:, None] & (j < NB)[None, :]
    values = tl.load(part_max_ptr + off, mask=ok, other=float("-inf"))
    index = tl.load(part_idx_ptr + off, mask=ok, other=2147483647)
    _, token = _max_lowest(values, index)
    return tl.where(row_ok, token, 0).to(tl.int64)  # rows past n_rows gather row 0, harmlessly


@jit_sizes("n_rows", "step", "K")
def _markov_step_kernel(base_ptr, hidden_ptr, anchor_ptr, embed_ptr, head_ptr, w_ptr, tokens_ptr, conf_ptr,
                        part_max_ptr, part_idx_ptr, n_rows, step, K, V, NB, s_bb, s_bk, s_hb, s_hk, s_e, s_h,
                        R: tl.constexpr, DIM: tl.constexpr, FIRST: tl.constexpr, BLOCK_B: tl.constexpr,
                        BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_NB: tl.constexpr):
    pid_v = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    row_ok = rows < n_rows
    rows64 = rows.to(tl.int64)
    if FIRST:
        prev = tl.load(anchor_ptr + rows64, mask=row_ok, other=0).to(tl.int64)
    else:
        prev = _previous_tokens(part_max_ptr, part_idx_ptr, rows, row_ok, n_rows, NB, step - 1, BLOCK_NB)
    e_rows = prev * s_e  # (BLOCK_B,) offsets of the rows' Markov embeddings

    if pid_v == 0:  # one program per row tile: token step − 1 and the confidence logit of position step
        if not FIRST:
            tl.store(tokens_ptr + rows64 * K + step - 1, prev, mask=row_ok)
        conf = tl.zeros([BLOCK_B], dtype=tl.float32)
        for d0 in tl.range(0, DIM, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            x = tl.load(hidden_ptr + rows64[:, None] * s_hb + step * s_hk + d[None, :],
                        mask=row_ok[:, None] & (d < DIM)[None, :], other=0.0).to(tl.float32)
            w_x = tl.load(w_ptr + d, mask=d < DIM, other=0.0).to(tl.float32)
            conf += tl.sum(x * w_x[None, :], axis=1)
        for c0 in tl.range(0, R, BLOCK_D):
            c = c0 + tl.arange(0, BLOCK_D)
            markov = tl.load(embed_ptr + e_rows[:, None] + c[None, :], mask=row_ok[:, None] & (c < R)[None, :],
                             other=0.0).to(tl.float32)
            w_e = tl.load(w_ptr + DIM + c, mask=c < R, other=0.0).to(tl.float32)
            conf += tl.sum(markov * w_e[None, :], axis=1)
        tl.store(conf_ptr + rows64 * K + step, conf, mask=row_ok)

    v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = v < V
    bias = tl.zeros([BLOCK_B, BLOCK_V], dtype=tl.float32)
    for k0 in tl.range(0, R, BLOCK_R):
        k = k0 + tl.arange(0, BLOCK_R)
        k_ok = k < R
        e = tl.load(embed_ptr + e_rows[:, None] + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)  # (BLOCK_B, BLOCK_R)
        h = tl.load(head_ptr + v.to(tl.int64)[:, None] * s_h + k[None, :], mask=v_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)  # (BLOCK_V, BLOCK_R)
        if BLOCK_B >= 16:
            bias = tl.dot(e, tl.trans(h), bias, input_precision="ieee")
        else:
            bias += tl.sum(e[:, None, :] * h[None, :, :], axis=2)
    ok = row_ok[:, None] & v_ok[None, :]
    base = tl.load(base_ptr + rows64[:, None] * s_bb + step * s_bk + v[None, :], mask=ok, other=0.0)
    logits = tl.where(ok, base + bias, float("-inf"))
    index = tl.where(ok, v[None, :], 2147483647)
    top, arg = _max_lowest(logits, index)
    off = (step * n_rows + rows).to(tl.int64) * NB + pid_v
    tl.store(part_max_ptr + off, top, mask=row_ok)
    tl.store(part_idx_ptr + off, arg, mask=row_ok)


@jit_sizes("n_rows", "step", "K")
def _markov_last_kernel(part_max_ptr, part_idx_ptr, tokens_ptr, n_rows, step, K, NB,
                        BLOCK_B: tl.constexpr, BLOCK_NB: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    row_ok = rows < n_rows
    token = _previous_tokens(part_max_ptr, part_idx_ptr, rows, row_ok, n_rows, NB, step, BLOCK_NB)
    tl.store(tokens_ptr + rows.to(tl.int64) * K + step, token, mask=row_ok)


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Outputs and partials (tests poison them through this)."""
    return torch.empty(shape, dtype=dtype, device=device)


def markov_greedy(base: Tensor, hidden: Tensor, anchors: Tensor, embed: Tensor, head: Tensor, conf_weight: Tensor,
                  *, block_b: int | None = None, block_v: int | None = None, num_warps: int | None = None
                  ) -> tuple[Tensor, Tensor]:
    """See `dsv41.kernels.ops.markov_greedy`; knobs: rows per program (1, or >= 16 for `tl.dot`), vocabulary
    entries per program, warps."""
    if base.dim() != 3 or base.dtype != torch.float32:
        raise ValueError(f"markov_greedy: base (B, K, V) fp32, got {tuple(base.shape)} {base.dtype}")
    B, K, V = base.shape
    R = embed.size(-1)
    dim = hidden.size(-1)
    if hidden.shape[:2] != (B, K) or hidden.dim() != 3 or anchors.shape != (B,) or anchors.is_floating_point():
        raise ValueError(f"markov_greedy: hidden (B, K, dim) and integer anchors (B,) for base {tuple(base.shape)}, "
                         f"got {tuple(hidden.shape)} and {tuple(anchors.shape)} {anchors.dtype}")
    if embed.shape != (V, R) or head.shape != (V, R) or conf_weight.numel() != dim + R:
        raise ValueError(f"markov_greedy: embed and head (V, r) = ({V}, r) and conf_weight (dim + r,), got "
                         f"{tuple(embed.shape)}, {tuple(head.shape)}, {tuple(conf_weight.shape)} (dim {dim})")
    if any(t.dtype not in _FLOATS for t in (hidden, embed, head, conf_weight)):
        raise ValueError("markov_greedy: hidden and weights must be fp32, bf16 or fp16")
    if not runnable(base):
        raise ValueError(f"markov_greedy: Triton needs CUDA tensors or TRITON_INTERPRET=1, got {base.device}")
    tokens = _empty((B, K), torch.long, base.device)
    conf = _empty((B, K), torch.float32, base.device)
    if B == 0 or K == 0:
        return tokens, conf
    if base.stride(-1) != 1:
        base = base.contiguous()
    if hidden.stride(-1) != 1:
        hidden = hidden.contiguous()
    embed, head = embed.contiguous(), head.contiguous()  # no copies for the model's parameters
    w = conf_weight.reshape(-1).contiguous()

    block_b = block_b or (1 if B == 1 else 16)  # one row: a broadcast product; a tile of rows: tl.dot
    block_v = block_v or (64 if block_b == 1 else 128)
    block_r = min(64, triton.next_power_of_2(R)) if block_b >= 16 else min(64 // block_b, triton.next_power_of_2(R))
    n_blocks = triton.cdiv(V, block_v)
    block_nb = triton.next_power_of_2(n_blocks)
    num_warps = num_warps or 4
    part_max = _empty((K, B, n_blocks), torch.float32, base.device)  # per position, row and V-block
    part_idx = _empty((K, B, n_blocks), torch.int32, base.device)
    grid = (triton.cdiv(B, block_b), n_blocks)
    for step in range(K):
        _markov_step_kernel[grid](base, hidden, anchors, embed, head, w, tokens, conf, part_max, part_idx,
                                  B, step, K, V, n_blocks, base.stride(0), base.stride(1), hidden.stride(0),
                                  hidden.stride(1), embed.stride(0), head.stride(0), R=R, DIM=dim, FIRST=step == 0,
                                  BLOCK_B=block_b, BLOCK_V=block_v, BLOCK_R=block_r, BLOCK_D=64, BLOCK_NB=block_nb,
                                  num_warps=num_warps)
    last_rows = min(16, triton.next_power_of_2(B)) if interpreting() else 16
    _markov_last_kernel[(triton.cdiv(B, last_rows),)](part_max, part_idx, tokens, B, K - 1, K, n_blocks,
                                                      BLOCK_B=last_rows, BLOCK_NB=block_nb, num_warps=num_warps)
    return tokens, conf
