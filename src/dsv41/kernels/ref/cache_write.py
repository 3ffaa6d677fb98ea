"""Torch twin of the cache write: RoPE, then FP8 / FP4 quantize, then pack into cache rows.

The executable spec of `ops.rope_quantize` (SPEC §1a, §4) and the engine's CPU path: the model's own
`apply_rope` followed by the storage quantizers of `quant.fp8` / `quant.fp4`, the payload and scale
bytes concatenated into one uint8 row per token and scattered into the rows `row_index` names.

Row layouts, D channels per token (`CACHE_LAYOUTS`):
  * ``window_fp8``: D E4M3 bytes | D/32 E8M0 bytes (528 B for D = 512);
  * ``kv_fp4``:     D/2 packed E2M1 bytes | D/16 E4M3 bytes (288 B);
  * ``index_fp4``:  D/2 packed E2M1 bytes | D/32 E8M0 bytes (68 B for D = 128).

`ring_write` is the spec of `ops.ring_write`: a prefill chunk's last window rows, already quantized, copied into
the window ring after the attention has read it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from dsv41.model.rope import apply_rope
from dsv41.quant.fp4 import INDEX_BLOCK, KV_BLOCK, dequantize_fp4, fake_quant_fp4, quantize_fp4
from dsv41.quant.fp8 import WINDOW_BLOCK, dequantize_fp8, quantize_fp8


class CacheLayout(NamedTuple):
    block: int  # channels per scale
    fp4: bool  # payload: packed E2M1 (D/2 bytes) or E4M3 (D bytes)
    e8m0: bool  # scale bytes: E8M0 exponents or E4M3 values

    def payload_bytes(self, dim: int) -> int:
        return dim // 2 if self.fp4 else dim

    def row_bytes(self, dim: int) -> int:
        return self.payload_bytes(dim) + dim // self.block


CACHE_LAYOUTS = {
    "window_fp8": CacheLayout(WINDOW_BLOCK, fp4=False, e8m0=True),
    "kv_fp4": CacheLayout(KV_BLOCK, fp4=True, e8m0=False),
    "index_fp4": CacheLayout(INDEX_BLOCK, fp4=True, e8m0=True),
}


def quantize_rows(y: Tensor, fmt: str) -> Tensor:
    """Values y (..., D) → cache rows (..., row_bytes) uint8: [payload | scales]."""
    layout = CACHE_LAYOUTS[fmt]
    if layout.fp4:
        payload, scales = quantize_fp4(y, layout.block, "e8m0" if layout.e8m0 else "e4m3")
    else:
        payload, scales = quantize_fp8(y, layout.block)
    return torch.cat((payload, scales), dim=-1)


def dequantize_rows(rows: Tensor, fmt: str, dim: int) -> Tensor:
    """Cache rows (..., row_bytes) of `dim` channels → fp32 values (..., dim), exactly the fake-quant."""
    layout = CACHE_LAYOUTS[fmt]
    payload, scales = rows[..., :layout.payload_bytes(dim)], rows[..., layout.payload_bytes(dim):]
    if layout.fp4:
        return dequantize_fp4(payload, scales, layout.block, "e8m0" if layout.e8m0 else "e4m3")
    return dequantize_fp8(payload, scales, layout.block)


def check_args(x: Tensor, cos: Tensor, sin: Tensor, fmt: str, out_rows: Tensor, row_index: Tensor
               ) -> tuple[CacheLayout, Tensor, Tensor]:
    """Validate the arguments of `rope_quantize`; returns (layout, cos, sin) expanded to (B, T, R/2)."""
    if fmt not in CACHE_LAYOUTS:
        raise ValueError(f"rope_quantize: fmt must be one of {tuple(CACHE_LAYOUTS)}, got {fmt!r}")
    layout = CACHE_LAYOUTS[fmt]
    if x.dim() != 3 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"rope_quantize: x must be (B, T, D) bf16 / fp16 / fp32, got {tuple(x.shape)} {x.dtype}")
    B, T, D = x.shape
    if D % layout.block != 0:
        raise ValueError(f"rope_quantize: {fmt} needs D divisible by {layout.block}, got D={D}")
    if cos.shape != sin.shape or cos.dim() == 0 or not (cos.is_floating_point() and sin.is_floating_point()):
        raise ValueError(f"rope_quantize: cos / sin must be float tensors of one shape, got "
                         f"{tuple(cos.shape)} {cos.dtype} and {tuple(sin.shape)} {sin.dtype}")
    half = cos.size(-1)
    if half < 1 or 2 * half > D:
        raise ValueError(f"rope_quantize: need 1 <= R/2 = cos.size(-1) <= D/2, got {half} for D={D}")
    try:
        cos, sin = cos.expand(B, T, half), sin.expand(B, T, half)
    except RuntimeError as err:
        raise ValueError(f"rope_quantize: cos {tuple(cos.shape)} does not broadcast to {(B, T, half)}") from err
    if out_rows.dim() != 2 or out_rows.dtype != torch.uint8 or out_rows.size(1) != layout.row_bytes(D):
        raise ValueError(f"rope_quantize: out_rows must be (M, {layout.row_bytes(D)}) uint8 for {fmt} with "
                         f"D={D}, got {tuple(out_rows.shape)} {out_rows.dtype}")
    if row_index.shape != (B, T) or row_index.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"rope_quantize: row_index must be ({B}, {T}) int64 / int32, got "
                         f"{tuple(row_index.shape)} {row_index.dtype}")
    devices = {t.device for t in (x, cos, sin, out_rows, row_index)}
    if len(devices) != 1:
        raise ValueError(f"rope_quantize: all tensors must be on one device, got {sorted(map(str, devices))}")
    return layout, cos, sin


def rope_quantize(x: Tensor, cos: Tensor, sin: Tensor, fmt: str, out_rows: Tensor, row_index: Tensor) -> None:
    """out_rows[row_index[b, t]] = [payload | scales] of apply_rope(x, cos, sin)[b, t]; −1 skips.

    Row indices must be distinct (else which token lands is unspecified) and < M; any negative
    index skips its token. Rows not indexed are left untouched.
    """
    _, cos, sin = check_args(x, cos, sin, fmt, out_rows, row_index)
    rows = quantize_rows(apply_rope(x, cos, sin), fmt)  # (B, T, row_bytes)
    keep = row_index >= 0
    out_rows[row_index[keep]] = rows[keep]


def rope(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool = False) -> Tensor:
    """Twin of `ops.rope`: the model's `apply_rope`."""
    return apply_rope(x, cos, sin, inverse=inverse)


def rope_fake_quant(x: Tensor, cos: Tensor, sin: Tensor, fmt: str) -> Tensor:
    """Twin of `ops.rope_fake_quant`: `apply_rope`, then the FP4 format's fake-quant (straight-through)."""
    layout = CACHE_LAYOUTS.get(fmt)
    if layout is None or not layout.fp4:
        raise ValueError(f"rope_fake_quant: fmt must be 'kv_fp4' or 'index_fp4', got {fmt!r}")
    return fake_quant_fp4(apply_rope(x, cos, sin), layout.block, "e8m0" if layout.e8m0 else "e4m3")


def check_ring_args(chunk: Tensor, positions: Tensor, ring_row: Tensor, valid: Tensor | None, ring_rows: Tensor,
                    ring_pos: Tensor) -> None:
    """Validate the arguments of `ring_write`."""
    if chunk.dim() != 3 or chunk.dtype != torch.uint8:
        raise ValueError(f"ring_write: chunk must be (B, T, R) uint8, got {tuple(chunk.shape)} {chunk.dtype}")
    B, T, R = chunk.shape
    for name, t in (("positions", positions), ("ring_row", ring_row)):
        if t.shape != (B, T) or t.dtype != torch.int64:
            raise ValueError(f"ring_write: {name} must be ({B}, {T}) int64, got {tuple(t.shape)} {t.dtype}")
    if valid is not None and (valid.shape != (B,) or valid.is_floating_point()):
        raise ValueError(f"ring_write: valid must be ({B},) integers or None, got {tuple(valid.shape)} {valid.dtype}")
    if ring_rows.dim() != 2 or ring_rows.dtype != torch.uint8 or ring_rows.size(1) != R:
        raise ValueError(f"ring_write: ring_rows must be (M, {R}) uint8, got "
                         f"{tuple(ring_rows.shape)} {ring_rows.dtype}")
    if ring_pos.shape != ring_rows.shape[:1] or ring_pos.dtype != torch.int64:
        raise ValueError(f"ring_write: ring_pos must be ({ring_rows.size(0)},) int64, got "
                         f"{tuple(ring_pos.shape)} {ring_pos.dtype}")


def ring_write(chunk: Tensor, positions: Tensor, ring_row: Tensor, valid: Tensor | None, ring_rows: Tensor,
               ring_pos: Tensor, window: int) -> None:
    """Each row's last w = min(window, T) real keys of a chunk → their ring rows: for j < w,
    t = max(valid[b] − w + j, 0) (valid None: T), ring_rows[ring_row[b, t]] = chunk[b, t] and
    ring_pos[ring_row[b, t]] = positions[b, t]. A row of fewer real keys than w writes its first key
    again (the same bytes to the same row)."""
    check_ring_args(chunk, positions, ring_row, valid, ring_rows, ring_pos)
    B, T, R = chunk.shape
    w = min(window, T)
    if valid is None:  # every row's last w block positions
        last_w = slice(T - w, T)
        keep = ring_row[:, last_w].reshape(-1)  # (B·w,)
        ring_rows[keep] = chunk[:, last_w].reshape(-1, R)
        ring_pos[keep] = positions[:, last_w].reshape(-1)
        return
    t = (valid.view(B, 1) - w + torch.arange(w, device=chunk.device)).clamp(min=0)  # (B, w)
    keep = ring_row.gather(1, t).view(-1)  # (B·w,)
    ring_rows[keep] = chunk.gather(1, t.unsqueeze(-1).expand(-1, -1, R)).view(-1, R)
    ring_pos[keep] = positions.gather(1, t).view(-1)
