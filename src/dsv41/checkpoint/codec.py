"""Tensor codecs: a logical tensor ↔ what a file stores for it (float, FP8 tiles, FP8 rows, MXFP4).

Writing follows the release table (`release_format`): `encode(name, value, storage)` gives the
stored tensors of one logical tensor. Reading accepts every spelling the release and older
checkpoints use — the *stored form decides*, not the name: float tensors; FP8 (`X.weight`
F8_E4M3 + `X.scale` F8_E8M0/U8 per 32×32 tile or per 1×32 row block, or FP32 scale values);
MXFP4 (`X.weight` I8/U8 [out, in/2] or F4 [out, in] + `X.scale` [out, in/32]). `decode` returns
the float value; `release_codes` returns the release's own codes and scales for a module that
keeps them (`weights="as-released"`), re-encoding only when the file holds another form.
Every decoded tensor is a fresh copy on the target device, never a view of the file's mapping.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from dsv41.checkpoint.files import TensorStore
from dsv41.checkpoint.release_format import BF16, F32, FP8_ROWS, FP8_TILES, MXFP4, scale_name
from dsv41.quant.fp4 import MXFP4_BLOCK, mxfp4_dequantize_weight, mxfp4_quantize_weight
from dsv41.quant.fp8 import (
    WEIGHT_BLOCK,
    fp8_block_dequantize_weight,
    fp8_block_quantize_weight,
    fp8_row_dequantize,
    fp8_row_quantize,
)

FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
_PACKED_FP4_DTYPES = {"I8", "U8", "F4"}
_SCALE_BYTE_DTYPES = {"F8_E8M0", "U8"}

# stored kinds read back from headers (None = a plain tensor)
KIND_TILES, KIND_ROWS, KIND_MXFP4 = FP8_TILES, FP8_ROWS, MXFP4


# ---------------------------------------------------------------------- write
def encode(name: str, value: Tensor, storage: str, device: torch.device | str = "cpu") -> dict[str, Tensor]:
    """The tensors stored for one logical tensor in the release's `storage` form, on `device`."""
    value = value.detach()
    if storage == FP8_TILES:
        codes, scale = fp8_block_quantize_weight(value)
    elif storage == FP8_ROWS:
        codes, scale = fp8_row_quantize(value)
    elif storage == MXFP4:
        packed, scale = mxfp4_quantize_weight(value)
        return {name: packed.view(torch.int8).to(device), scale_name(name): scale.view(torch.float8_e8m0fnu).to(device)}
    elif storage in (BF16, F32):
        return {name: value.to(device=device, dtype=torch.bfloat16 if storage == BF16 else torch.float32)}
    else:
        raise ValueError(f"encode: unknown storage {storage!r} for {name}")
    return {name: codes.view(torch.float8_e4m3fn).to(device),
            scale_name(name): scale.view(torch.float8_e8m0fnu).to(device)}


def encode_codes(name: str, codes: Tensor, scale: Tensor, storage: str) -> dict[str, Tensor]:
    """Already-quantized codes and E8M0 scales (an as-released module), stored as they are."""
    values = codes.view(torch.int8 if storage == MXFP4 else torch.float8_e4m3fn)
    return {name: values.cpu().contiguous(), scale_name(name): scale.view(torch.float8_e8m0fnu).cpu().contiguous()}


# ---------------------------------------------------------------------- read: what a header holds
def _bytes(t: Tensor) -> Tensor:
    """uint8 view of a one-byte (or packed FP4) tensor."""
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def logical_shape(store: TensorStore, name: str) -> tuple[tuple[int, ...], str | None, str | None]:
    """(float shape, stored kind, problem) of a stored tensor, from the headers alone."""
    _, dt, shape = store.entries[name]
    sname = scale_name(name) if name.endswith(".weight") else None
    if sname is None or sname not in store.entries:
        if dt == "F8_E4M3" or (dt in _PACKED_FP4_DTYPES and name.endswith(".weight")):
            return shape, None, f"tensor {name} is quantized ({dt}) but {sname} is missing"
        return shape, None, None
    _, sdt, sshape = store.entries[sname]
    if len(shape) != 2 or len(sshape) != 2:
        return shape, None, f"quantized tensor {name} and {sname} must be 2-D, got {list(shape)}, {list(sshape)}"
    if dt == "F8_E4M3":
        out_dim, in_dim = shape
        tiles = (math.ceil(out_dim / WEIGHT_BLOCK), math.ceil(in_dim / WEIGHT_BLOCK))
        rows = (out_dim, math.ceil(in_dim / WEIGHT_BLOCK))
        if sdt not in _SCALE_BYTE_DTYPES | {"F32"}:
            return shape, None, f"{sname} has dtype {sdt}, expected F8_E8M0, U8 or F32"
        if sshape == tiles:  # a one-row weight reads the same either way
            return shape, KIND_TILES, None
        if sshape == rows:
            return shape, KIND_ROWS, None
        return shape, None, f"{sname} has shape {list(sshape)}, expected {list(tiles)} (32x32 tiles) " \
                            f"or {list(rows)} (1x32 blocks) for {name} {list(shape)}"
    if dt in _PACKED_FP4_DTYPES:
        out_dim, in_dim = shape if dt == "F4" else (shape[0], shape[1] * 2)  # F4 headers count elements
        expected = (out_dim, in_dim // MXFP4_BLOCK)
        if sdt not in _SCALE_BYTE_DTYPES:
            return shape, None, f"{sname} has dtype {sdt}, expected F8_E8M0 or U8"
        if in_dim % MXFP4_BLOCK or sshape != expected:
            return shape, None, f"{sname} has shape {list(sshape)}, expected {list(expected)} for MXFP4 {name}"
        return (out_dim, in_dim), KIND_MXFP4, None
    return shape, None, f"{name} has a {sname} but dtype {dt}; expected F8_E4M3 or packed FP4 (I8/U8/F4)"


def logical_names(store: TensorStore) -> dict[str, tuple[tuple[int, ...], str | None, str | None]]:
    """Stored names minus scale companions → (shape, kind, problem)."""
    companions = {scale_name(n) for n in store.entries if n.endswith(".weight") and scale_name(n) in store.entries}
    return {name: logical_shape(store, name) for name in store.entries if name not in companions}


# ---------------------------------------------------------------------- read: values
def decode(store: TensorStore, name: str, kind: str | None, device: torch.device,
           dtype: torch.dtype | None = None) -> Tensor:
    """The value of one logical tensor on `device`, in `dtype` (None: as stored, fp32 when quantized)."""
    raw = store.get(name)
    if kind is None:
        return raw.to(device=device, dtype=dtype if raw.is_floating_point() else None, copy=True)
    scale = store.get(scale_name(name))
    scale = (scale if scale.dtype == torch.float32 else _bytes(scale)).to(device)
    values = _bytes(raw).to(device)
    if kind == KIND_MXFP4:
        out = mxfp4_dequantize_weight(values, scale)
    elif kind == KIND_TILES:
        out = fp8_block_dequantize_weight(values, scale)
    elif scale.dtype == torch.float32:  # 1x32 row blocks with scale values
        factor = scale.repeat_interleave(WEIGHT_BLOCK, dim=1)[:, :values.shape[1]]
        out = values.view(torch.float8_e4m3fn).float() * factor
    else:
        out = fp8_row_dequantize(values, scale)
    return out.to(dtype or torch.float32)


def release_codes(store: TensorStore, name: str, kind: str | None, storage: str,
                  device: torch.device) -> tuple[Tensor, Tensor]:
    """(codes, E8M0 scales) of a weight or table in the release's `storage` form on `device` — E4M3
    codes for FP8, packed E2M1 pairs as int8 for MXFP4: the file's bytes when it holds that form,
    else its value re-encoded by the release rule."""
    scale_dtype = store.entries[scale_name(name)][1] if scale_name(name) in store.entries else None
    if kind == storage and scale_dtype in _SCALE_BYTE_DTYPES:
        codes = _bytes(store.get(name)).to(device, copy=True)
        scale = _bytes(store.get(scale_name(name))).to(device, copy=True)
        return codes.view(torch.int8 if storage == MXFP4 else torch.float8_e4m3fn), scale.view(torch.float8_e8m0fnu)
    stored = encode(name, decode(store, name, kind, device), storage, device)
    return stored[name], stored[scale_name(name)]
