"""Writing a checkpoint: our float layout, the release's exact layout, or the compact shipping one.

Formats (`save_checkpoint(fmt=...)`):
  * `"float"` — every state-dict tensor under its own name, in its own dtype (or `dtype`); with a
    `dtype`, the precision-critical set stays FP32 (`keeps_fp32`: mHC, sinks, router, compressor,
    norms) — our training layout, not the release's.
  * `"official-fp8"` — exactly the release table (`release_format.RULES`): FP8 32×32 tiles, FP8
    rows for the Engram tables, MXFP4 experts, BF16 / FP32 for the rest. The written config says
    `dtype: "fp8"`, `expert_dtype: "fp4"`.
  * `"compact"` — `"official-fp8"` plus `embed.weight` and `head.weight` as FP8 rows (one E8M0
    scale per 32 channels) so a small model ships in a few tens of MB; the loader reads it too.
A model made `as_released` saves its FP8 codes as they are (no second quantization).

Plan first, write second: every entry's stored tensors and bytes are known (and bad shapes fail)
before a byte is written; entries are sharded at `max_shard_bytes` (2 GiB); each file is written
atomically, `config.json` is removed first and written last, so an interrupted save leaves a
directory that does not load.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn

from dsv41.checkpoint.codec import encode, encode_codes
from dsv41.checkpoint.files import (
    CONFIG_NAME,
    DEFAULT_SHARD_BYTES,
    INDEX_FILE,
    SHARD_RE,
    SINGLE_FILE,
    atomic_write_bytes,
    save_state_dict_file,
    shard_names,
)
from dsv41.checkpoint.release_format import FP8_ROWS, MXFP4, QUANTIZED, scale_name, storage_of, stored_bytes
from dsv41.model.released import coded_tensors
from dsv41.model.transformer import Transformer
from dsv41.quant.fp4 import mxfp4_dequantize_weight
from dsv41.quant.fp8 import fp8_block_dequantize_weight, fp8_row_dequantize

CheckpointFormat = Literal["float", "official-fp8", "compact"]
FORMATS = ("float", "official-fp8", "compact")

# "float" with a dtype: these stay FP32 (precision matters more than bytes in training checkpoints)
_FP32_RE = re.compile(r"(^|\.)hc_[^.]*$|(^|\.)attn_sink$|(^|\.)ffn\.gate\.|(^|\.)compressor\.|norm\.weight$")
# "compact": the embedding and head as FP8 rows on top of the release layout
_COMPACT_ROWS_RE = re.compile(r"^(embed|head)\.weight$")


def keeps_fp32(name: str) -> bool:
    """Float tensors the `"float"` format stores FP32 whatever `dtype` asks."""
    return bool(_FP32_RE.search(name))


# (E4M3 codes, E8M0 scales, storage form) of a module that already holds the release's codes
Codes = tuple[Tensor, Tensor, str]


def logical_state(model: nn.Module) -> dict[str, Tensor | Codes]:
    """The model's tensors by official name: float tensors, or the codes of `as_released` modules
    (each `X.weight` + `X.scale` pair becomes one logical `X.weight`)."""
    state: dict[str, Any] = dict(model.state_dict())
    for name, (form, codes, scale) in coded_tensors(model).items():
        state.pop(scale_name(name))
        state[name] = (codes, scale, form)
    return state


def _dequantize_codes(value: Codes) -> Tensor:
    codes, scale, form = value
    if form == MXFP4:
        return mxfp4_dequantize_weight(codes.view(torch.uint8), scale)
    return fp8_row_dequantize(codes, scale) if form == FP8_ROWS else fp8_block_dequantize_weight(codes, scale)


def _storage(name: str, value: Tensor | Codes, fmt: str) -> str:
    """The form one entry is written in: "float" or a release form."""
    if fmt == "float":
        return "float"
    shape = value[0].shape if isinstance(value, tuple) else value.shape
    if fmt == "compact" and _COMPACT_ROWS_RE.search(name) and len(shape) == 2:
        return FP8_ROWS
    return storage_of(name)


def _plan_entry(name: str, value: Tensor | Codes, fmt: str, dtype: torch.dtype | None
                ) -> tuple[str, int, torch.dtype | None]:
    """(storage form, stored bytes, float storage dtype for the "float" form) of one entry."""
    form = _storage(name, value, fmt)
    shape = tuple((value[0] if isinstance(value, tuple) else value).shape)
    if form in QUANTIZED:  # stored_bytes raises for a shape the form cannot hold, before anything is written
        return form, stored_bytes(name, shape) if form == storage_of(name) else _compact_bytes(shape), None
    if form != "float":  # the release's BF16 / FP32
        return form, stored_bytes(name, shape), None
    floating = isinstance(value, tuple) or value.is_floating_point()
    store = torch.float32 if isinstance(value, tuple) else value.dtype
    if floating and keeps_fp32(name):
        store = torch.float32
    elif floating and dtype is not None:
        store = dtype
    return form, int(torch.Size(shape).numel()) * store.itemsize, store


def _compact_bytes(shape: tuple[int, ...]) -> int:
    rows, dim = shape
    return rows * dim + rows * -(-dim // 32)


def _stored(name: str, value: Tensor | Codes, form: str, store: torch.dtype | None) -> dict[str, Tensor]:
    """The CPU tensors of one planned entry."""
    if isinstance(value, tuple):
        if form == value[2]:  # codes already in the form the file wants
            return encode_codes(name, value[0], value[1], form)
        value = _dequantize_codes(value)
    if form == "float":
        return {name: value.detach().to(device="cpu", dtype=store)}
    return encode(name, value, form)


def _check_extra_name(name: str) -> None:
    if (not name or "/" in name or "\\" in name or name.startswith(".") or name in (CONFIG_NAME, INDEX_FILE)
            or name == SINGLE_FILE or SHARD_RE.match(name)):
        raise ValueError(f"save_checkpoint: extra file name {name!r} must be a plain file name and not a "
                         f"checkpoint file")


def save_checkpoint(model: Transformer, directory: str | Path, *, dtype: torch.dtype | None = None,
                    fmt: CheckpointFormat = "float", extra_files: dict[str, bytes | str] | None = None,
                    metadata: dict[str, Any] | None = None, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write `model` as a checkpoint directory (see the module docstring); returns the directory."""
    if fmt not in FORMATS:
        raise ValueError(f"save_checkpoint: fmt must be 'float', 'official-fp8' or 'compact', got {fmt!r}")
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"save_checkpoint: dtype must be a floating dtype, got {dtype}")
    if dtype is not None and fmt != "float":
        raise ValueError(f"save_checkpoint: dtype applies to fmt='float' only; {fmt!r} stores what the release "
                         f"table says")
    if max_shard_bytes <= 0:
        raise ValueError(f"save_checkpoint: max_shard_bytes must be positive, got {max_shard_bytes}")
    for name in extra_files or {}:
        _check_extra_name(name)
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"save_checkpoint: {directory} exists and is not a directory")

    # plan every entry first: bad shapes fail before anything is written
    state = logical_state(model)
    plan = [(name, *_plan_entry(name, value, fmt, dtype)) for name, value in state.items()]
    shards: list[list[int]] = [[]]
    used = 0
    for i, (_, _, size, _) in enumerate(plan):
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(i)
        used += size
    files = shard_names(len(shards))

    file_meta = {"dsv41.format": fmt}
    for key, value in (metadata or {}).items():
        file_meta[str(key)] = value if isinstance(value, str) else json.dumps(value)

    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_NAME).unlink(missing_ok=True)  # the directory is not a checkpoint until the end
    weight_map: dict[str, str] = {}
    total = 0
    for file, members in zip(files, shards):
        tensors: dict[str, Tensor] = {}
        for i in members:
            name, form, size, store = plan[i]
            tensors.update(_stored(name, state[name], form, store))
            total += size
        save_state_dict_file(tensors, directory / file, file_meta)
        weight_map.update(dict.fromkeys(tensors, file))
    if len(files) > 1:
        index = {"metadata": {"total_size": total, **file_meta}, "weight_map": weight_map}
        atomic_write_bytes(directory / INDEX_FILE, (json.dumps(index, indent=2) + "\n").encode())
    # files of an earlier checkpoint in the same directory would confuse a loader
    keep = set(files) | ({INDEX_FILE} if len(files) > 1 else set())
    for stale in directory.iterdir():
        if stale.name not in keep and (stale.name in (SINGLE_FILE, INDEX_FILE) or SHARD_RE.match(stale.name)):
            stale.unlink()
    for name, content in (extra_files or {}).items():
        atomic_write_bytes(directory / name, content.encode() if isinstance(content, str) else bytes(content))
    if fmt in ("official-fp8", "compact"):
        config = model.config.replace(dtype="fp8", expert_dtype="fp4")
    else:
        config = model.config.replace(dtype="bf16", expert_dtype=None)
    atomic_write_bytes(directory / CONFIG_NAME, (config.to_json() + "\n").encode())
    return directory


__all__ = ["FORMATS", "CheckpointFormat", "keeps_fp32", "logical_state", "save_checkpoint", "scale_name"]
