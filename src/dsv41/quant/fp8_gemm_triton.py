"""Hopper kernel of the release's FP8 linear: E4M3 codes with 1×32 / 32×32 block scales on the tensor cores.

`torch._scaled_mm` does not take these scales on sm90: its block-wise modes there are 1×128 and
128×128 (fp32 scales), and the MX 1×32 E8M0 mode needs sm100. So this kernel does what the
release's own `fp8_gemm` kernel does (`inference/kernel.py`): walk K in steps of 32 — one scale
block —, take a dot of the step's codes (fp32 result), multiply it by the activation scale of the
row and the weight scale of the column's 32-row tile, and add it to an fp32 accumulator. Output in
the activation dtype.

The step's dot runs on the fp16 tensor cores, the E4M3 codes widened to fp16 first (exact: E4M3's
range and 3 mantissa bits fit fp16; bf16 would too, but Triton's CPU interpreter mis-multiplies
bf16). Hopper's FP8 MMA (wgmma) sums its products with a short accumulator (about 14 bits, as the
DeepSeek-V3 report measured on H800), which on the H200 put the FP8 dot 1e-4–7e-4 of the output's
scale away from the exact sum at v41 widths; the fp16 dot keeps full fp32 accumulation, so the
kernel equals the fp64 emulation to fp32 summation order (~1e-7).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from dsv41.quant.fp8 import WEIGHT_BLOCK
from dsv41.quant.fp8_gemm import ACT_BLOCK, weight_scale_values


@triton.jit
def _fp8_block_gemm_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, M, N, stride_am, stride_bn, stride_cm,
                           N_KB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           W_TILE: tl.constexpr, GROUP_M: tl.constexpr):
    # grouped program order: GROUP_M row tiles share each column tile while it is in L2
    pid = tl.program_id(0)
    n_m, n_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * n_n)
    first_m = group * GROUP_M
    size_m = tl.minimum(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * n_n)) % size_m
    pid_n = (pid % (GROUP_M * n_n)) // size_m

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < M, rn < N
    a_ptrs = a_ptr + rm[:, None] * stride_am + rk[None, :]  # (BM, 32) codes
    b_ptrs = b_ptr + rn[None, :] * stride_bn + rk[:, None]  # (32, BN) codes, the weight read transposed
    sa_ptrs = sa_ptr + rm * N_KB  # activation scales (M, N_KB)
    sb_ptrs = sb_ptr + (rn // W_TILE) * N_KB  # weight tile scales (ceil(N/32), N_KB), one per column
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(N_KB):  # K is a compile-time constant: one compile per weight width
        a = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
        b = tl.load(b_ptrs, mask=n_ok[None, :], other=0.0)
        sa = tl.load(sa_ptrs + kb, mask=m_ok, other=0.0)
        sb = tl.load(sb_ptrs + kb, mask=n_ok, other=0.0)
        # promote every scale block: the 32-wide step's dot (codes widened to fp16, exact) in fp32, then scaled
        acc += tl.dot(a.to(tl.float16), b.to(tl.float16)) * (sa[:, None] * sb[None, :])
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    c_ptrs = c_ptr + rm[:, None] * stride_cm + rn[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def default_blocks(m: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) by the number of rows (decode → prefill)."""
    if m <= 16:
        return 16, 64, 4, 4
    if m <= 64:
        return 64, 64, 4, 4
    return 128, 128, 8, 3


def fp8_gemm_triton(xq: Tensor, xs: Tensor, wq: Tensor, ws: Tensor, out_dtype: torch.dtype,
                    blocks: tuple[int, int, int, int] | None = None) -> Tensor:
    """Same contract as `fp8_gemm_twin`: (M, K) E4M3 codes, (M, K/32) fp32 scales, (N, K) E4M3 weight,
    (ceil(N/32), K/32) tile scales (E8M0 bytes or fp32) → (M, N) in `out_dtype`."""
    m, k = xq.shape
    n = wq.shape[0]
    if k % ACT_BLOCK or wq.shape[1] != k or xs.shape != (m, k // ACT_BLOCK):
        raise ValueError(f"fp8_gemm_triton: shapes x {tuple(xq.shape)}, x scales {tuple(xs.shape)}, "
                         f"w {tuple(wq.shape)} do not fit K blocks of {ACT_BLOCK}")
    a = (xq if xq.dtype == torch.float8_e4m3fn else xq.view(torch.float8_e4m3fn)).contiguous()
    b = (wq if wq.dtype == torch.float8_e4m3fn else wq.view(torch.float8_e4m3fn)).contiguous()
    sa = xs.float().contiguous()
    sb = weight_scale_values(ws).float().contiguous()
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    block_m, block_n, warps, stages = blocks or default_blocks(m)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _fp8_block_gemm_kernel[grid](a, sa, b, sb, out, m, n, a.stride(0), b.stride(0), out.stride(0),
                                 N_KB=k // ACT_BLOCK, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=ACT_BLOCK,
                                 W_TILE=WEIGHT_BLOCK, GROUP_M=8, num_warps=warps, num_stages=stages)
    return out
