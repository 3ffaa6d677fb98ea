"""FP8 E4M3 with power-of-two (E8M0) block scales: window KV cache and checkpoint weights.

Two users share one format family (SPEC §1a, §4):

* **Window (SWA) KV**: 512 channels, one E8M0 scale per 32 channels,
  ``scale = 2^ceil(log2(max(amax, 1e-4) / 448))``, values ``e4m3(clamp(x / scale, ±448))``
  → 512 + 16 = 528 bytes per ring slot.
* **Checkpoint weights** (non-expert linears): E4M3 ``[out, in]`` with one E8M0 scale per 32×32
  block, scale shape ``[ceil(out/32), ceil(in/32)]``.

Storage is plain ``torch.uint8`` (the E4M3 / E8M0 bit patterns); :func:`as_e4m3` / :func:`as_e8m0`
reinterpret them as torch's float8 dtypes without copying.

E8M0 rounds the ratio ``amax / max_value`` *up* to a power of two (exponent field, plus one when the
fp32 mantissa is non-zero), so ``|x / scale| <= max_value`` always holds and nothing clamps. Note that
torch's and ml_dtypes' own casts to ``float8_e8m0fnu`` round to *nearest* — not what the format
needs — so the exponent is computed from the fp32 bits here.

``fake_quant_fp8`` returns exactly ``dequantize_fp8(*quantize_fp8(x))`` with a straight-through
gradient (identity where ``|x / scale| <= 448``, zero where clamped); QAT uses it.
"""

from __future__ import annotations

import torch
from torch import Tensor

E4M3_MAX = 448.0  # largest finite float8_e4m3fn
WINDOW_BLOCK = 32  # window KV: channels per E8M0 scale
WINDOW_AMAX_FLOOR = 1e-4  # window KV: amax floor before the scale is taken
WEIGHT_BLOCK = 32  # checkpoint FP8 weights: 32×32 blocks

_E8M0_NAN = 255  # the one non-finite E8M0 code
_FP32_MIN_NORMAL = 2.0**-126


def as_e4m3(values: Tensor) -> Tensor:
    """View uint8 E4M3 bit patterns as ``torch.float8_e4m3fn`` (no copy)."""
    return values.view(torch.float8_e4m3fn)


def as_e8m0(scales: Tensor) -> Tensor:
    """View uint8 E8M0 exponent bytes as ``torch.float8_e8m0fnu`` (no copy)."""
    return scales.view(torch.float8_e8m0fnu)


def _as_bytes(t: Tensor, name: str) -> Tensor:
    """Accept uint8 or a one-byte float8 dtype; return the uint8 view."""
    if t.dtype == torch.uint8:
        return t
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu):
        return t.view(torch.uint8)
    raise TypeError(f"{name} must be uint8 (or a float8 view of it), got {t.dtype}")


def _check_block(x: Tensor, block: int, what: str) -> None:
    if block <= 0:
        raise ValueError(f"{what}: block must be positive, got {block}")
    if x.dim() == 0 or x.shape[-1] % block != 0:
        raise ValueError(
            f"{what}: last dim must be divisible by block={block}, got shape {tuple(x.shape)}"
        )


def e8m0_scale(amax: Tensor, max_value: float) -> Tensor:
    """Exponent byte of ``2^ceil(log2(amax / max_value))`` (ratio taken in fp32), as uint8.

    The ratio is floored at 2^-126 (smallest normal fp32, byte 1), so ``amax = 0`` gives byte 1, and
    capped at byte 254 (2^127). Callers apply their own amax floors first.
    """
    # True fp32 division by a same-device tensor (CUDA turns a CPU-scalar divisor into a
    # reciprocal multiply, which can differ in the last bit from CPU). `torch.full` fills it on the
    # device (no host → device copy, so a CUDA graph can capture it; `new_tensor` copies).
    ratio = amax.float() / torch.full((), max_value, dtype=torch.float32, device=amax.device)
    ratio = ratio.clamp(min=_FP32_MIN_NORMAL)
    bits = ratio.view(torch.int32)
    exponent = bits >> 23  # biased exponent, sign is 0 (ratio > 0)
    exponent = exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32)  # round up unless a power of two
    return exponent.clamp(max=254).to(torch.uint8)


def e8m0_to_float(scales: Tensor) -> Tensor:
    """E8M0 exponent bytes → fp32 ``2^(byte - 127)``; byte 255 is NaN."""
    b = _as_bytes(scales, "scales").to(torch.int32)
    value = (b << 23).view(torch.float32)  # exact for bytes 1..254
    value = torch.where(b == 0, torch.full_like(value, 2.0**-127), value)
    return torch.where(b == _E8M0_NAN, torch.full_like(value, float("nan")), value)


def _fp8_core(x: Tensor, block: int, amax_floor: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Shared by quantize / fake-quant: (e4m3 values, scale bytes, fp32 scales, in-range mask)."""
    xb = x.float().unflatten(-1, (-1, block))  # (..., D/block, block)
    amax = xb.abs().amax(dim=-1, keepdim=True).clamp(min=amax_floor)  # (..., D/block, 1)
    scale_bytes = e8m0_scale(amax, E4M3_MAX)
    scale = e8m0_to_float(scale_bytes)
    scaled = xb / scale
    in_range = scaled.abs() <= E4M3_MAX
    values = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)  # RNE
    return values, scale_bytes.squeeze(-1), scale, in_range


def quantize_fp8(x: Tensor, block: int = WINDOW_BLOCK, amax_floor: float = WINDOW_AMAX_FLOOR
                 ) -> tuple[Tensor, Tensor]:
    """x (..., D) → (E4M3 bits uint8 (..., D), E8M0 scale bytes uint8 (..., D/block))."""
    _check_block(x, block, "quantize_fp8")
    values, scale_bytes, _, _ = _fp8_core(x, block, amax_floor)
    return values.view(torch.uint8).flatten(-2), scale_bytes


def dequantize_fp8(values: Tensor, scales: Tensor, block: int = WINDOW_BLOCK,
                   dtype: torch.dtype = torch.float32) -> Tensor:
    """(E4M3 bits (..., D), E8M0 bytes (..., D/block)) → (..., D) in ``dtype`` (computed in fp32)."""
    values = _as_bytes(values, "values")
    scales = _as_bytes(scales, "scales")
    _check_block(values, block, "dequantize_fp8")
    if scales.shape != values.shape[:-1] + (values.shape[-1] // block,):
        raise ValueError(
            f"dequantize_fp8: scales shape {tuple(scales.shape)} does not match values "
            f"{tuple(values.shape)} with block={block}"
        )
    v = values.view(torch.float8_e4m3fn).float().unflatten(-1, (-1, block))  # (..., D/block, block)
    out = v * e8m0_to_float(scales).unsqueeze(-1)
    return out.flatten(-2).to(dtype)


class _FakeQuantFP8(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, block: int, amax_floor: float) -> Tensor:
        values, _, scale, in_range = _fp8_core(x, block, amax_floor)
        ctx.save_for_backward(in_range)
        return (values.float() * scale).flatten(-2).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        (in_range,) = ctx.saved_tensors
        return grad * in_range.flatten(-2).to(grad.dtype), None, None


def fake_quant_fp8(x: Tensor, block: int = WINDOW_BLOCK, amax_floor: float = WINDOW_AMAX_FLOOR) -> Tensor:
    """``dequantize_fp8(*quantize_fp8(x))`` in x's dtype; straight-through gradient (0 where clamped)."""
    _check_block(x, block, "fake_quant_fp8")
    return _FakeQuantFP8.apply(x, block, amax_floor)


def fake_quant_window_fp8(x: Tensor) -> Tensor:
    """Window-KV fake quant: E4M3, E8M0 scale per 32 channels, amax floor 1e-4."""
    return fake_quant_fp8(x, WINDOW_BLOCK, WINDOW_AMAX_FLOOR)


def fp8_entry_bytes(dim: int, block: int, scale_bytes: int = 1) -> int:
    """Bytes of one FP8 entry: one byte per channel + one scale per block (528 for 512 / 32)."""
    if dim % block != 0:
        raise ValueError(f"fp8_entry_bytes: dim={dim} must be divisible by block={block}")
    return dim + (dim // block) * scale_bytes


# ---------------------------------------------------------------------------------------------
# Checkpoint weights: E4M3 [out, in], E8M0 per block×block tile, scales [ceil(out/b), ceil(in/b)].


def fp8_block_dequantize_weight(w_e4m3: Tensor, scale_e8m0: Tensor, block: int = WEIGHT_BLOCK,
                                dtype: torch.dtype = torch.float32) -> Tensor:
    """(E4M3 (out, in), E8M0 (ceil(out/b), ceil(in/b))) → (out, in) in ``dtype``.

    ``scale_e8m0`` may also be an fp32 tensor of scale values (older checkpoints store those).
    """
    w = _as_bytes(w_e4m3, "w_e4m3")
    if w.dim() != 2:
        raise ValueError(f"fp8_block_dequantize_weight: weight must be 2-D, got shape {tuple(w.shape)}")
    out_dim, in_dim = w.shape
    expected = (-(-out_dim // block), -(-in_dim // block))
    if tuple(scale_e8m0.shape) != expected:
        raise ValueError(
            f"fp8_block_dequantize_weight: scale shape {tuple(scale_e8m0.shape)} != {expected} "
            f"for weight {tuple(w.shape)} and block={block}"
        )
    if scale_e8m0.dtype == torch.float32:
        scale = scale_e8m0
    else:
        scale = e8m0_to_float(scale_e8m0)
    # expand each tile's scale over its block×block tile, cropping the ragged edge
    scale = scale.repeat_interleave(block, dim=0)[:out_dim].repeat_interleave(block, dim=1)[:, :in_dim]
    return (w.view(torch.float8_e4m3fn).float() * scale).to(dtype)


def fp8_block_quantize_weight(w: Tensor, block: int = WEIGHT_BLOCK) -> tuple[Tensor, Tensor]:
    """(out, in) float → (E4M3 bits uint8 (out, in), E8M0 bytes uint8 (ceil(out/b), ceil(in/b))).

    Scale per tile = ``2^ceil(log2(amax / 448))`` (an all-zero tile gets 2^-126).
    """
    if w.dim() != 2:
        raise ValueError(f"fp8_block_quantize_weight: weight must be 2-D, got shape {tuple(w.shape)}")
    out_dim, in_dim = w.shape
    rows, cols = -(-out_dim // block), -(-in_dim // block)
    padded = w.float().new_zeros(rows * block, cols * block)
    padded[:out_dim, :in_dim] = w.float()  # zero padding never raises a tile's amax
    tiles = padded.view(rows, block, cols, block)  # (R, b, C, b)
    amax = tiles.abs().amax(dim=(1, 3))  # (R, C)
    scale_bytes = e8m0_scale(amax, E4M3_MAX)
    scale = e8m0_to_float(scale_bytes)[:, None, :, None]  # (R, 1, C, 1)
    values = (tiles / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    values = values.view(rows * block, cols * block)[:out_dim, :in_dim].contiguous()
    return values.view(torch.uint8), scale_bytes


# ---------------------------------------------------------------------------------------------
# Table rows (the release's Engram tables): E4M3 [rows, dim], one E8M0 scale per 32 channels of a
# row, scales [rows, ceil(dim/32)]; a ragged last block is padded with zeros (never raises its amax).


def fp8_row_quantize(w: Tensor, block: int = WEIGHT_BLOCK) -> tuple[Tensor, Tensor]:
    """(rows, dim) float → (E4M3 bits uint8 (rows, dim), E8M0 bytes uint8 (rows, ceil(dim/b))).

    Scale per block = ``2^ceil(log2(amax / 448))``, as for the weight tiles (a zero block gets 2^-126).
    """
    if w.dim() != 2:
        raise ValueError(f"fp8_row_quantize: table must be 2-D, got shape {tuple(w.shape)}")
    rows, dim = w.shape
    cols = -(-dim // block)
    padded = w.float().new_zeros(rows, cols * block)
    padded[:, :dim] = w.float()
    blocks = padded.view(rows, cols, block)  # (R, C, b)
    scale_bytes = e8m0_scale(blocks.abs().amax(dim=-1), E4M3_MAX)  # (R, C)
    values = (blocks / e8m0_to_float(scale_bytes)[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    values = values.view(rows, cols * block)[:, :dim]  # (R, dim): the padding cropped
    return values.contiguous().view(torch.uint8), scale_bytes


def fp8_row_dequantize(values: Tensor, scales: Tensor, block: int = WEIGHT_BLOCK,
                       dtype: torch.dtype = torch.float32) -> Tensor:
    """(E4M3 (..., dim), E8M0 (..., ceil(dim/b))) → (..., dim) in ``dtype`` (rows gathered or whole)."""
    v = _as_bytes(values, "values")
    s = _as_bytes(scales, "scales")
    dim = v.shape[-1]
    if s.shape != v.shape[:-1] + (-(-dim // block),):
        raise ValueError(f"fp8_row_dequantize: scales shape {tuple(s.shape)} does not match values "
                         f"{tuple(v.shape)} with block={block}")
    factor = e8m0_to_float(s).repeat_interleave(block, dim=-1)[..., :dim]
    return (v.view(torch.float8_e4m3fn).float() * factor).to(dtype)
