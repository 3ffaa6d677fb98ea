"""Hopper kernel of the release's routed-expert product: FP8 activations × MXFP4 weights, all experts.

One launch for every expert of a layer, no host sync: the rows come sorted by expert; each program
takes one BLOCK_M tile of one expert's rows (the tile → expert map is built on the device from the
counts, for an upper bound of ceil(M / BLOCK_M) + E tiles; programs past the real tiles return) and
one BLOCK_N column tile. Per 32-wide K step it loads 16 packed bytes per weight row, turns the two
E2M1 codes of each byte into their values (exact) — the GEMM's prologue dequantization — takes a
dot of the step and scales it by the row's activation scale and the weight row's E8M0 scale of that
K block, accumulating in fp32 (what the release's `fp4_gemm` computes). The dot runs on the fp16
tensor cores with both operands widened exactly (E4M3 and E2M1 fit fp16): Hopper's FP8 MMA sums
with a short accumulator and put the product 2e-5 of the output's scale off the exact sum on the
H200, the fp16 one matches the emulation to fp32 order (see `fp8_gemm_triton`). Torch twin:
`dsv41.quant.fp4_gemm.fp4_experts_twin`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from dsv41.quant.fp8_gemm import ACT_BLOCK


@triton.jit
def _e2m1_values(codes):
    """4-bit E2M1 codes (int32) → fp32 values: |v| = 0.5·m for exponent 0, else 2^(e-1)·(1 + m/2)."""
    e = (codes >> 1) & 3
    m = (codes & 1).to(tl.float32)
    mag = tl.where(e == 0, 0.5 * m, tl.exp2((e - 1).to(tl.float32)) * (1.0 + 0.5 * m))
    return tl.where((codes & 8) != 0, -mag, mag)


@triton.jit
def _fp4_experts_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, tile_e_ptr, tile_r0_ptr, tile_r1_ptr, N, E,
                        stride_am, stride_be, stride_bn, stride_se, stride_sn, stride_cm,
                        N_KB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(tile_e_ptr + pid_t)
    if e >= E:  # past the real tiles
        return
    r0 = tl.load(tile_r0_ptr + pid_t)
    r1 = tl.load(tile_r1_ptr + pid_t)
    rm = r0 + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm < r1, rn < N
    ra = tl.arange(0, BLOCK_K)
    rh = tl.arange(0, BLOCK_K // 2)  # packed bytes of one K step
    a_ptrs = a_ptr + rm[:, None].to(tl.int64) * stride_am + ra[None, :]  # (BM, 32) E4M3 codes
    b_base = b_ptr + e.to(tl.int64) * stride_be + rn[None, :].to(tl.int64) * stride_bn  # (1, BN)
    s_base = sb_ptr + e.to(tl.int64) * stride_se + rn.to(tl.int64) * stride_sn  # (BN,)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(N_KB):
        a = tl.load(a_ptrs + kb * BLOCK_K, mask=m_ok[:, None], other=0.0)
        packed = tl.load(b_base + kb * (BLOCK_K // 2) + rh[:, None], mask=n_ok[None, :], other=0).to(tl.int32)
        lo = _e2m1_values(packed & 15)  # (16, BN): element 2i of the step
        hi = _e2m1_values(packed >> 4)  # element 2i + 1
        b = tl.reshape(tl.trans(tl.join(lo, hi), 0, 2, 1), (BLOCK_K, BLOCK_N))  # (32, BN), K interleaved
        sa = tl.load(sa_ptr + rm * N_KB + kb, mask=m_ok, other=0.0)
        # E8M0 byte b -> 2^(b - 127): the byte is the fp32 exponent field (bytes 1..254; the quantizers
        # never write 0 or 255), decoded here rather than as an (E, N, K/32) fp32 copy per call
        s_byte = tl.load(s_base + kb, mask=n_ok, other=0).to(tl.int32)
        sb = (s_byte << 23).to(tl.float32, bitcast=True)
        acc += tl.dot(a.to(tl.float16), b.to(tl.float16)) * (sa[:, None] * sb[None, :])
    c_ptrs = c_ptr + rm[:, None].to(tl.int64) * stride_cm + rn[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def expert_tiles(counts: Tensor, block_m: int, m: int) -> tuple[Tensor, Tensor, Tensor]:
    """(expert, first row, end row) of every BLOCK_M tile of the expert-sorted rows, on the device, for
    ceil(m / block_m) + E tiles (the unused ones get expert E). No host sync."""
    n_e = counts.numel()
    counts = counts.to(torch.int64)
    seg_end = counts.cumsum(0)
    tiles = (counts + block_m - 1) // block_m
    tile_end = tiles.cumsum(0)
    t = torch.arange(-(-m // block_m) + n_e, device=counts.device)
    e = torch.searchsorted(tile_end, t, right=True)  # (T,) expert of tile t (E when past the end)
    ec = e.clamp(max=n_e - 1)
    first_tile = tile_end[ec] - tiles[ec]
    r0 = seg_end[ec] - counts[ec] + (t - first_tile) * block_m
    return e.to(torch.int32), r0.to(torch.int32), seg_end[ec].to(torch.int32)


def fp4_experts_triton(xq: Tensor, xs: Tensor, packed: Tensor, scales: Tensor, counts: Tensor,
                       out_dtype: torch.dtype, block_m: int = 64, block_n: int = 128) -> Tensor:
    """Same contract as `fp4_experts_twin`."""
    m, k = xq.shape
    n_e, n = packed.shape[0], packed.shape[1]
    if k % ACT_BLOCK or packed.shape[2] * 2 != k or scales.shape != (n_e, n, k // ACT_BLOCK):
        raise ValueError(f"fp4_experts_triton: x {tuple(xq.shape)}, packed {tuple(packed.shape)}, "
                         f"scales {tuple(scales.shape)} do not fit")
    a = xq.view(torch.float8_e4m3fn).contiguous()
    b = packed.view(torch.uint8).contiguous()
    sb = scales.view(torch.uint8).contiguous()  # (E, N, K/32) E8M0 bytes, decoded in the kernel
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    tile_e, tile_r0, tile_r1 = expert_tiles(counts, block_m, m)
    grid = (tile_e.numel(), triton.cdiv(n, block_n))
    _fp4_experts_kernel[grid](a, xs.float().contiguous(), b, sb, out, tile_e, tile_r0, tile_r1, n, n_e,
                              a.stride(0), b.stride(0), b.stride(1), sb.stride(0), sb.stride(1), out.stride(0),
                              N_KB=k // ACT_BLOCK, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=ACT_BLOCK,
                              num_warps=4 if block_m <= 64 else 8, num_stages=3)
    return out
