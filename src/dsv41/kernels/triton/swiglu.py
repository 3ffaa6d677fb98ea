"""Clamped SwiGLU in one pass (`ops.swiglu`): fp32 math, the routing weight, one rounding to the output.

The model's expert hidden is silu(min(g, limit)) · clamp(u, ±limit), scaled by the routing weight and
cast to the GEMM dtype before w2 — seven elementwise kernels in torch, one here. Memory-bound: reads g
and u, writes h once. Agrees with the twin (`kernels.ref.swiglu`) to fp32 rounding (silu's exp), and
so to at most one unit in the last place of a bf16 output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from dsv41.kernels.triton.common import interpreting, jit_sizes, runnable


@jit_sizes("M")
def _swiglu_kernel(g_ptr, u_ptr, w_ptr, out_ptr, M, C, s_g, s_u, s_w, s_o, limit, group,
                   CLAMP: tl.constexpr, HAS_W: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = (r < M)[:, None] & (c < C)[None, :]
    r64 = r.to(tl.int64)[:, None]
    g = tl.load(g_ptr + r64 * s_g + c[None, :], mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + r64 * s_u + c[None, :], mask=ok, other=0.0).to(tl.float32)
    if CLAMP:
        u = tl.minimum(tl.maximum(u, -limit), limit)
        g = tl.minimum(g, limit)
    h = g / (1.0 + tl.exp(-g)) * u
    if HAS_W:
        w = tl.load(w_ptr + r64 * s_w + (c // group)[None, :], mask=ok, other=0.0).to(tl.float32)
        h = w * h
    tl.store(out_ptr + r64 * s_o + c[None, :], h.to(out_ptr.dtype.element_ty), mask=ok)


def swiglu(gate: Tensor, up: Tensor, limit: float, weight: Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> Tensor:
    """See `dsv41.kernels.ops.swiglu`."""
    if gate.shape != up.shape or gate.dim() != 2 or not gate.is_floating_point():
        raise ValueError(f"swiglu: gate and up must be (M, C) float of one shape, got {tuple(gate.shape)}, "
                         f"{tuple(up.shape)}")
    if not runnable(gate):
        raise ValueError(f"swiglu: Triton needs CUDA tensors or TRITON_INTERPRET=1, got {gate.device}")
    M, C = gate.shape
    if weight is not None and (weight.dim() != 2 or weight.size(0) != M or C % weight.size(1)):
        raise ValueError(f"swiglu: weight must be (M, G) with C % G == 0, got {tuple(weight.shape)} for {(M, C)}")
    g = gate if gate.stride(-1) == 1 else gate.contiguous()
    u = up if up.stride(-1) == 1 else up.contiguous()
    out = torch.empty(M, C, dtype=out_dtype or gate.dtype, device=gate.device)
    if M * C == 0:
        return out
    w = weight if weight is not None else g
    if weight is not None and w.stride(-1) != 1:
        w = w.contiguous()
    block_c = min(1024, triton.next_power_of_2(C))
    block_m = max(1, min(16 if interpreting() else 8, 4096 // block_c))
    _swiglu_kernel[(triton.cdiv(M, block_m), triton.cdiv(C, block_c))](
        g, u, w, out, M, C, g.stride(0), u.stride(0), w.stride(0), out.stride(0), float(limit),
        C // (weight.size(1) if weight is not None else 1),
        CLAMP=limit > 0, HAS_W=weight is not None, BLOCK_M=block_m, BLOCK_C=block_c,
        num_warps=4)
    return out
