"""RMSNorm in one pass: fp32 mean of squares, rsqrt, × weight, cast to x's dtype (`ops.rms_norm`).

One program normalizes ROWS rows of D channels held in registers (D ≤ 8192 after padding to a power
of two). The twin (`kernels.ref.norm`) computes the same function with torch's reduction order;
the two agree to fp32 rounding (the sum of squares is reduced in a different order), not bit for bit.
Memory-bound: one read of x and one write; at decode sizes it is one launch instead of eight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from dsv41.kernels.triton.common import interpreting, jit_sizes, runnable


@jit_sizes("n_rows")
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_rows, D, stride_x, stride_o, eps,
                     BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, BLOCK_D)
    ok = (r < n_rows)[:, None] & (d < D)[None, :]
    r64 = r.to(tl.int64)
    x = tl.load(x_ptr + r64[:, None] * stride_x + d[None, :], mask=ok, other=0.0).to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(x * x, axis=1) / D + eps)  # (ROWS,)
    w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    y = (x * inv[:, None]) * w[None, :]
    tl.store(out_ptr + r64[:, None] * stride_o + d[None, :], y.to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: Tensor, weight: Tensor, eps: float, *, rows: int | None = None, num_warps: int | None = None
             ) -> Tensor:
    """See `dsv41.kernels.ops.rms_norm`; knobs: rows per program, warps."""
    if not x.is_floating_point() or weight.dim() != 1 or x.size(-1) != weight.numel():
        raise ValueError(f"rms_norm: x (..., D) float and weight (D,), got {tuple(x.shape)} {x.dtype} and "
                         f"{tuple(weight.shape)}")
    if not runnable(x):
        raise ValueError(f"rms_norm: Triton needs CUDA tensors or TRITON_INTERPRET=1, got {x.device}")
    D = x.size(-1)
    if D > 8192:
        raise ValueError(f"rms_norm: at most 8192 channels, got {D}")
    x2 = x.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    n = x2.size(0)
    if n == 0:
        return out.view(x.shape)
    block_d = triton.next_power_of_2(D)
    rows = rows or (min(16, triton.next_power_of_2(n)) if interpreting() else max(1, min(8, 2048 // block_d)))
    num_warps = num_warps or max(1, min(8, rows * block_d // 512))
    _rms_norm_kernel[(triton.cdiv(n, rows),)](x2, weight, out, n, D, x2.stride(0), out.stride(0), float(eps),
                                              BLOCK_D=block_d, ROWS=rows, num_warps=num_warps)
    return out.view(x.shape)
