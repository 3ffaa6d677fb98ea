"""The release's FP8 linear: activations quantized per 1×32 block, FP8 × FP8 with block scales.

What `inference/model.py` `linear()` does for a weight stored FP8 (SPEC §1a "weights"):

* `act_quant(x, 32, "ue8m0")` (kernel.py): per row and per 32 consecutive input channels,
  ``amax = max(max|x|, 1e-4)``, ``s = 2^ceil(log2(amax · fp32(1/448)))`` (the exponent read from the
  fp32 bits: +1 unless the mantissa is zero), codes ``e4m3(clamp(x / s, ±448))`` with round to
  nearest even. The ratio is a product with the fp32 reciprocal, as in the kernel; it can differ
  from the quotient in its last bit but never in the power of two it rounds up to (checked over
  every fp32 amax of a binade), so the scales equal the weight rule's `e8m0_scale` above the floor.
* `fp8_gemm(x, s, w, w.scale)`: ``y[m, n] = Σ_kb (Σ_{k ∈ kb} xq[m, k]·wq[n, k]) · s[m, kb] · ws[n // 32, kb]``
  with fp32 accumulation, cast to the activation dtype. The weight carries one E8M0 scale per
  32×32 tile (`fp8_block_quantize_weight`).

`fp8_gemm_twin` is the torch twin (any device): both operands dequantized — exact, e4m3 times a
power of two — and multiplied in fp32, so it differs from the blockwise sum only by fp32
summation order. `dsv41.quant.fp8_gemm_triton` is the Hopper kernel (FP8 tensor-core dots per
32-wide K step, scales applied to an fp32 accumulator); `dsv41.model.released` picks between them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dsv41.quant.fp8 import E4M3_MAX, WEIGHT_BLOCK, e8m0_to_float

ACT_BLOCK = 32  # fp8_block_size: activation scale per 32 input channels
ACT_AMAX_FLOOR = 1e-4  # act_quant_kernel: amax = max(amax, 1e-4)
_INV_E4M3_MAX = torch.tensor(1.0 / E4M3_MAX, dtype=torch.float32).item()  # the kernel's fp8_max_inv, as fp32


def _pow2_ceil(ratio: Tensor) -> Tensor:
    """2^ceil(log2(ratio)) of positive normal fp32 values, from the bits (fast_log2_ceil + fast_pow2)."""
    bits = ratio.view(torch.int32)
    exponent = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(torch.int32)  # biased, rounded up
    return (exponent << 23).view(torch.float32)


def act_quant(x: Tensor, block: int = ACT_BLOCK) -> tuple[Tensor, Tensor]:
    """x (..., K) → (codes float8_e4m3fn (..., K), scales fp32 (..., K / block)), as the release."""
    if x.dim() == 0 or x.shape[-1] % block:
        raise ValueError(f"act_quant: last dim must be a multiple of {block}, got shape {tuple(x.shape)}")
    xb = x.float().unflatten(-1, (-1, block))  # (..., K/b, b)
    amax = xb.abs().amax(dim=-1, keepdim=True).clamp(min=ACT_AMAX_FLOOR)  # (..., K/b, 1)
    # fp32 product, as the kernel: the constant is an fp32 value, and a Python scalar needs no host →
    # device copy (which a CUDA-graph capture forbids)
    scale = _pow2_ceil(amax * _INV_E4M3_MAX)
    codes = (xb / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)  # exact division: scale is 2^k
    return codes.flatten(-2), scale.squeeze(-1)


def weight_scale_values(scale: Tensor) -> Tensor:
    """E8M0 bytes (or float8_e8m0fnu) of the weight tiles → fp32 scale values, same shape."""
    return e8m0_to_float(scale) if scale.dtype != torch.float32 else scale


def dequantize_tiles(codes: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """FP8 weight (N, K) with 32×32 tile scales (ceil(N/32), ceil(K/32)) → (N, K) in ``dtype``."""
    n, k = codes.shape
    s = weight_scale_values(scale).repeat_interleave(WEIGHT_BLOCK, 0)[:n].repeat_interleave(WEIGHT_BLOCK, 1)[:, :k]
    return (_as_e4m3(codes).float() * s).to(dtype)


def _as_e4m3(codes: Tensor) -> Tensor:
    return codes if codes.dtype == torch.float8_e4m3fn else codes.view(torch.float8_e4m3fn)


def fp8_gemm_twin(xq: Tensor, xs: Tensor, wq: Tensor, ws: Tensor, out_dtype: torch.dtype) -> Tensor:
    """(M, K) codes × (M, K/32) scales · ((N, K) codes, (ceil(N/32), K/32) tile scales)ᵀ → (M, N).

    Dequantizes both sides (exact) and multiplies in fp32."""
    x = _as_e4m3(xq).float() * xs.float().repeat_interleave(ACT_BLOCK, dim=-1)  # (M, K)
    return (x @ dequantize_tiles(wq, ws).T).to(out_dtype)
