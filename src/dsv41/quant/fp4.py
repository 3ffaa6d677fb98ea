"""FP4 (E2M1) with block scales: main KV entries, indexer keys/queries and MXFP4 expert weights.

E2M1 magnitudes are ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}``; the 4-bit code is the magnitude index | sign<<3
(so ``-0`` is code 8). Encoding rounds to nearest with ties to the even code index (0.25→0, 0.75→1,
1.25→1, 1.75→2, 2.5→2, 3.5→4, 5→4) and saturates at ±6. Two codes share a byte: element 2i in the
low nibble, 2i+1 in the high nibble.

Two scale kinds (SPEC §1a, §4):

* ``"e4m3"`` — main KV (block 16): ``scale = e4m3(max(amax, 6·2^-9) / 6)``, stored as its E4M3
  byte. E4M3 rounding may land *below* amax/6, so ``x / scale`` is clamped to ±6 before encoding.
  512 channels → 256 + 32 = 288 bytes. A ratio above 448 saturates the scale at 448 (|x| > 2688).
* ``"e8m0"`` — indexer keys/queries (block 32) and MXFP4 weights: ``scale = 2^ceil(log2(max(amax,
  6·2^-126) / 6))``, stored as an E8M0 exponent byte; never clamps. 128 channels → 64 + 4 = 68 bytes.

``fake_quant_fp4`` returns exactly ``dequantize_fp4(*quantize_fp4(x))`` (fp32 math, cast to x's
dtype) with a straight-through gradient: identity where ``|x / scale| <= 6``, zero where clamped.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
from torch import Tensor

from dsv41.quant.fp8 import E4M3_MAX, _as_bytes, _check_block, e8m0_scale, e8m0_to_float

ScaleKind = Literal["e4m3", "e8m0"]

FP4_MAX = 6.0
KV_BLOCK = 16  # main KV: channels per E4M3 scale
INDEX_BLOCK = 32  # indexer keys / queries: channels per E8M0 scale
MXFP4_BLOCK = 32  # expert weights: E8M0 scale per 32 along K
_E4M3_AMAX_FLOOR = 6.0 * 2.0**-9  # scale floor 2^-9 = smallest E4M3 subnormal
_E8M0_AMAX_FLOOR = 6.0 * 2.0**-126  # scale floor 2^-126 = smallest normal fp32

# code → value, codes 0..7 positive, 8..15 negative (code 8 is -0.0)
_FP4_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_FP4_VALUES = _FP4_GRID + tuple(-v for v in _FP4_GRID)
# Midpoints between neighbouring grid values. At a midpoint the even code wins: for midpoints
# after an even code (0.25, 1.25, 2.5, 5) that is the lower code, so only values strictly above
# count; for those after an odd code (0.75, 1.75, 3.5) the upper code, so values equal count too.
_MID_TIE_DOWN = (0.25, 1.25, 2.5, 5.0)
_MID_TIE_UP = (0.75, 1.75, 3.5)


def _const(values: tuple[float, ...], like: Tensor) -> Tensor:
    return _device_const(values, like.device)


@functools.lru_cache(maxsize=32)
def _device_const(values: tuple[float, ...], device: torch.device) -> Tensor:
    """A constant table on `device`, made once: a CUDA graph may replay code that reads it (a fresh
    `torch.tensor` would be a host → device copy, which capture refuses)."""
    return torch.tensor(values, dtype=torch.float32, device=device)


def fp4_encode(x: Tensor) -> Tensor:
    """Round x (any float dtype, any shape) to E2M1 codes (uint8, same shape); saturates at ±6.

    NaN inputs are not supported (they encode as an arbitrary code).
    """
    a = x.float().abs().contiguous()
    # number of midpoints below |x| (ties resolved to the even code) = magnitude index 0..7
    magnitude = torch.bucketize(a, _const(_MID_TIE_DOWN, a), right=False)
    magnitude = magnitude + torch.bucketize(a, _const(_MID_TIE_UP, a), right=True)
    sign = torch.signbit(x).to(torch.uint8) << 3  # keeps the sign of -0.0
    return magnitude.to(torch.uint8) | sign


def fp4_decode(codes: Tensor) -> Tensor:
    """E2M1 codes (uint8, low 4 bits used) → fp32 values, same shape."""
    table = _const(_FP4_VALUES, codes)
    return table[(codes & 0xF).long()]


def pack_nibbles(codes: Tensor) -> Tensor:
    """Codes (..., D) uint8 → (..., D/2): element 2i in the low nibble, 2i+1 in the high."""
    if codes.dim() == 0 or codes.shape[-1] % 2 != 0:
        raise ValueError(f"pack_nibbles: last dim must be even, got shape {tuple(codes.shape)}")
    return (codes[..., 0::2] & 0xF) | ((codes[..., 1::2] & 0xF) << 4)


def unpack_nibbles(packed: Tensor) -> Tensor:
    """(..., D/2) uint8 → codes (..., D), inverse of :func:`pack_nibbles`."""
    packed = _as_bytes(packed, "packed")
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)  # (..., D/2, 2) → (..., D)


def _check_kind(scale_kind: str) -> None:
    if scale_kind not in ("e4m3", "e8m0"):
        raise ValueError(f"scale_kind must be 'e4m3' or 'e8m0', got {scale_kind!r}")


def _scales(amax: Tensor, scale_kind: ScaleKind) -> tuple[Tensor, Tensor]:
    """Block amax (fp32) → (scale bytes uint8, scale values fp32), same shape."""
    if scale_kind == "e4m3":
        ratio = amax.clamp(min=_E4M3_AMAX_FLOOR) / torch.full((), FP4_MAX, dtype=amax.dtype, device=amax.device)
        # RNE; clamp first: torch 2.11 casts values >= 480 to NaN (2.13 on CPU saturates)
        scale = ratio.clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
        return scale.view(torch.uint8), scale.float()
    scale_bytes = e8m0_scale(amax.clamp(min=_E8M0_AMAX_FLOOR), FP4_MAX)
    return scale_bytes, e8m0_to_float(scale_bytes)


def _fp4_core(x: Tensor, block: int, scale_kind: ScaleKind) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Shared by quantize / fake-quant: (codes, scale bytes, fp32 scales, in-range mask)."""
    xb = x.float().unflatten(-1, (-1, block))  # (..., D/block, block)
    amax = xb.abs().amax(dim=-1, keepdim=True)  # (..., D/block, 1)
    scale_bytes, scale = _scales(amax, scale_kind)
    scaled = xb / scale
    in_range = scaled.abs() <= FP4_MAX
    codes = fp4_encode(scaled.clamp(-FP4_MAX, FP4_MAX))
    return codes, scale_bytes.squeeze(-1), scale, in_range


def quantize_fp4(x: Tensor, block: int, scale_kind: ScaleKind) -> tuple[Tensor, Tensor]:
    """x (..., D) → (packed codes uint8 (..., D/2), scale bytes uint8 (..., D/block))."""
    _check_kind(scale_kind)
    _check_block(x, block, "quantize_fp4")
    if block % 2 != 0:
        raise ValueError(f"quantize_fp4: block must be even to pack nibbles, got {block}")
    codes, scale_bytes, _, _ = _fp4_core(x, block, scale_kind)
    return pack_nibbles(codes.flatten(-2)), scale_bytes


def _scale_values(scales: Tensor, scale_kind: ScaleKind) -> Tensor:
    if scale_kind == "e4m3":
        return scales.view(torch.float8_e4m3fn).float()
    return e8m0_to_float(scales)


def dequantize_fp4(packed: Tensor, scales: Tensor, block: int, scale_kind: ScaleKind,
                   dtype: torch.dtype = torch.float32) -> Tensor:
    """(packed (..., D/2), scale bytes (..., D/block)) → (..., D) in ``dtype`` (computed in fp32)."""
    _check_kind(scale_kind)
    packed = _as_bytes(packed, "packed")
    scales = _as_bytes(scales, "scales")
    if block <= 0 or block % 2 != 0:
        raise ValueError(f"dequantize_fp4: block must be positive and even, got {block}")
    if packed.dim() == 0 or scales.shape != packed.shape[:-1] + (packed.shape[-1] * 2 // block,) \
            or (packed.shape[-1] * 2) % block != 0:
        raise ValueError(
            f"dequantize_fp4: packed {tuple(packed.shape)} and scales {tuple(scales.shape)} do not "
            f"match with block={block} (expect scales (..., 2*packed.shape[-1]/block))"
        )
    values = fp4_decode(unpack_nibbles(packed)).unflatten(-1, (-1, block))  # (..., D/block, block)
    out = values * _scale_values(scales, scale_kind).unsqueeze(-1)
    return out.flatten(-2).to(dtype)


class _FakeQuantFP4(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, block: int, scale_kind: ScaleKind) -> Tensor:
        codes, _, scale, in_range = _fp4_core(x, block, scale_kind)
        ctx.save_for_backward(in_range)
        return (fp4_decode(codes) * scale).flatten(-2).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        (in_range,) = ctx.saved_tensors
        return grad * in_range.flatten(-2).to(grad.dtype), None, None


def fake_quant_fp4(x: Tensor, block: int, scale_kind: ScaleKind) -> Tensor:
    """``dequantize_fp4(*quantize_fp4(x))`` in x's dtype; straight-through gradient (0 where clamped)."""
    _check_kind(scale_kind)
    _check_block(x, block, "fake_quant_fp4")
    return _FakeQuantFP4.apply(x, block, scale_kind)


def fake_quant_kv_fp4(x: Tensor) -> Tensor:
    """Main-KV fake quant: E2M1, E4M3 scale per 16 channels."""
    return fake_quant_fp4(x, KV_BLOCK, "e4m3")


def fake_quant_index_fp4(x: Tensor) -> Tensor:
    """Indexer key/query fake quant: E2M1, E8M0 scale per 32 channels."""
    return fake_quant_fp4(x, INDEX_BLOCK, "e8m0")


def fp4_entry_bytes(dim: int, block: int, scale_bytes: int = 1) -> int:
    """Bytes of one FP4 entry: half a byte per channel + one scale per block (288 for 512 / 16)."""
    if dim % block != 0 or dim % 2 != 0:
        raise ValueError(f"fp4_entry_bytes: dim={dim} must be even and divisible by block={block}")
    return dim // 2 + (dim // block) * scale_bytes


# ---------------------------------------------------------------------------------------------
# MXFP4 expert weights: packed (out, in/2) uint8, E8M0 scales (out, in/32).


def mxfp4_dequantize_weight(packed: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """(packed (..., out, in/2), E8M0 (..., out, in/32)) → (..., out, in) in ``dtype``."""
    return dequantize_fp4(packed, scales, MXFP4_BLOCK, "e8m0", dtype)


def mxfp4_quantize_weight(w: Tensor) -> tuple[Tensor, Tensor]:
    """(..., out, in) float → (packed uint8 (..., out, in/2), E8M0 bytes (..., out, in/32)).

    Scale per 32 along K = ``2^ceil(log2(amax / 6))`` (an all-zero block gets 2^-126).
    """
    return quantize_fp4(w, MXFP4_BLOCK, "e8m0")
