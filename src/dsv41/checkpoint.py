"""Model checkpoints: a directory of `config.json` + safetensors, in our float layout or the release's.

A checkpoint directory holds
  * `config.json` — the flat ModelConfig JSON (`ModelConfig.to_json`); on load the release's
    Hugging Face config (nested `text_config`) is read as well (`config.from_hf_config`);
  * `model.safetensors`, or above `max_shard_bytes` (2 GiB) `model-0000k-of-0000n.safetensors`
    plus `model.safetensors.index.json` (`{"metadata": {"total_size"}, "weight_map"}`);
  * any `extra_files` (a tokenizer, notes).
Only safetensors is read or written, never pickle.

Formats (`save_checkpoint(fmt=...)`, SPEC §1a "weights"):
  * `"float"` — every state-dict tensor under its own name, in its own dtype (or `dtype`).
  * `"compact"` — `"official-fp8"` plus `embed.weight`, `head.weight` and `engram.embed.weight` as
    FP8 E4M3 rows with an E8M0 scale per 32 channels (the loader reads 1×32 blocks); for shipping.
  * `"official-fp8"` — the release's layout. The rule, by parameter name:
      - routed experts `*.ffn.experts.<i>.w{1,2,3}.weight` → MXFP4: `X.weight` = packed E2M1 pairs
        stored as I8 `[out, in/2]` (the release's float4_e2m1fn_x2 bytes viewed as int8; element
        2i in the low nibble) + `X.scale` = F8_E8M0 `[out, in/32]`;
      - every other 2-D `*.weight` → FP8: `X.weight` F8_E4M3 `[out, in]` + `X.scale` F8_E8M0
        `[ceil(out/32), ceil(in/32)]` (one power-of-two scale per 32×32 tile), EXCEPT these,
        which stay float: `embed.weight`, `head.weight`, `attn.wo_a.weight` (BF16 in the
        reference), `attn.compressor.*` (FP32 in the reference), `indexer.weights_proj.weight`,
        `ffn.gate.*` (router), `engram.embed.weight` (the report's FP8 table rows use 1×32 scales,
        not tiles; we keep it float), `engram.q_weight`, `engram.k_weight`;
      - so the FP8 set is: attention `wq_a`, `wq_b`, `wkv`, `wo_b`; indexer `wq_b`, `wk`; the
        shared expert's `w1`, `w2`, `w3`; Engram `wkv` (and the same names inside `mtp.*`).
    Float tensors are stored FP32 when they are mHC parameters (`hc_*`), `attn_sink`, router
    (`ffn.gate.*`: weight and selection biases), compressor weights, or 1-D norm weights
    (`*norm.weight`); every other float tensor is stored in `dtype` (default BF16).
    The written config says `dtype: "fp8"`, `expert_dtype: "fp4"`.
  The FP32 set above is kept FP32 in the `"float"` format too when a `dtype` is given.

Loading accepts float tensors, FP8 (`X.weight` F8_E4M3 + `X.scale` F8_E8M0/U8 per 32×32 tile, or
per 1×32 row block, or FP32 scale values) and MXFP4 (`X.weight` I8/U8 `[out, in/2]` or F4, +
`X.scale` `[out, in/32]`), dequantized at load (the format decides, not the name). `mtp.*` and
vision tensors are skipped with a logged note while the model builds no such modules.

The model is built with its parameters on the meta device (buffers, which are pure functions of
the config, are built for real) and materialized one tensor at a time with
`load_state_dict(assign=True)`, so no weight is allocated twice (factories of >= 4M elements go
straight to meta, so even an Engram table larger than host memory is never allocated, and
initializers are skipped). Loaded tensors are copies, never views of the file's mapping, so
rewriting a file later cannot change a live model. Parameter dtypes follow
`model.to(dtype)` (modules that pin a parameter to FP32, like the router's bias, keep it);
buffers keep the dtype their module gave them.

Safety: every file is written to a temporary name and renamed into place; `config.json` is removed
first and written last, so an interrupted save leaves a directory that does not load (never a half
checkpoint that does). A load only reads. Every bad input — missing directory or file, corrupt or
truncated safetensors, missing/unexpected/mis-shaped tensors — raises `CheckpointError` with one
line naming the file or tensor.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from dsv41.config import ConfigError, ModelConfig, load_config
from dsv41.model.transformer import Transformer
from dsv41.quant.fp4 import MXFP4_BLOCK, mxfp4_dequantize_weight, mxfp4_quantize_weight
from dsv41.quant.fp8 import (
    WEIGHT_BLOCK,
    e8m0_to_float,
    fp8_block_dequantize_weight,
    fp8_block_quantize_weight,
    quantize_fp8,
)

logger = logging.getLogger(__name__)

CheckpointFormat = Literal["float", "official-fp8", "compact"]

CONFIG_NAME = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 2 * 1024**3
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_MAX_HEADER_BYTES = 100 * 1024**2

# ---------------------------------------------------------------------- the naming rule (module docstring)
_ROUTED_EXPERT_RE = re.compile(r"(^|\.)ffn\.experts\.\d+\.w[123]\.weight$")
_KEEP_FLOAT_RE = re.compile(
    r"(^|\.)(embed\.weight|head\.weight|attn\.wo_a\.weight|indexer\.weights_proj\.weight"
    r"|engram\.embed\.weight|engram\.q_weight|engram\.k_weight)$"
    r"|(^|\.)ffn\.gate\.|(^|\.)compressor\."
)
# "compact" (what the repo ships): official-fp8, plus the embedding, head and Engram tables as FP8 rows
# with one E8M0 scale per 32 channels, so a small model fits in a few tens of MB
_COMPACT_ROWS_RE = re.compile(r"(^|\.)(embed|head)\.weight$")
_FP32_RE = re.compile(r"(^|\.)hc_[^.]*$|(^|\.)attn_sink$|(^|\.)ffn\.gate\.|(^|\.)compressor\.|norm\.weight$")
# tensors of modules the text model does not build yet: skipped (with a note) when absent from the model
_OPTIONAL_PREFIXES = ("mtp.", "vision.", "visual.", "vision_model.", "vision_tower.", "vit.", "projector.",
                      "mm_projector.")

_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
_PACKED_FP4_DTYPES = {"I8", "U8", "F4"}
_SCALE_BYTE_DTYPES = {"F8_E8M0", "U8"}


class CheckpointError(ConfigError):
    """A checkpoint that cannot be read; the one-line message names the file or tensor. A ConfigError
    (a ValueError), so the CLI reports it as a user error: one line, exit code 2."""


def quantized_kind(name: str, tensor: Tensor) -> Literal["fp8", "mxfp4"] | None:
    """How `fmt="official-fp8"` stores this state-dict entry (None = float)."""
    if tensor.dim() != 2 or not name.endswith(".weight") or not tensor.is_floating_point():
        return None
    if _ROUTED_EXPERT_RE.search(name):
        return "mxfp4"
    if _KEEP_FLOAT_RE.search(name):
        return None
    return "fp8"


def keeps_fp32(name: str) -> bool:
    """Float tensors stored FP32 whatever `dtype` asks (mHC, sinks, router, compressor, norms)."""
    return bool(_FP32_RE.search(name))


def scale_name(weight_name: str) -> str:
    """`X.weight` → `X.scale` (the companion of a quantized weight)."""
    return weight_name[: -len("weight")] + "scale"


# ---------------------------------------------------------------------- atomic files
def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be opened
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Write through `write(tmp)` to a temporary sibling, fsync, rename over `path`."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(path.parent)


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    _atomic_write(path, lambda tmp: tmp.write_bytes(data))


def save_state_dict_file(tensors: dict[str, Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """One safetensors file, written atomically (CPU, contiguous copies of the tensors)."""
    cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    _atomic_write(Path(path), lambda tmp: save_file(cpu, str(tmp), metadata={"format": "pt", **(metadata or {})}))


# ---------------------------------------------------------------------- save
def _plan_entry(name: str, t: Tensor, fmt: CheckpointFormat, dtype: torch.dtype | None
                ) -> tuple[str, list[tuple[str, int]], torch.dtype | None]:
    """(kind, [(stored name, bytes)], float storage dtype) of one state-dict entry."""
    kind = quantized_kind(name, t) if fmt in ("official-fp8", "compact") else None
    if fmt == "compact" and _COMPACT_ROWS_RE.search(name) and t.dim() == 2 and t.shape[1] % WEIGHT_BLOCK == 0:
        return "fp8row", [(name, t.numel()), (scale_name(name), t.numel() // WEIGHT_BLOCK)], None
    if kind == "fp8":
        out_dim, in_dim = t.shape
        tiles = math.ceil(out_dim / WEIGHT_BLOCK) * math.ceil(in_dim / WEIGHT_BLOCK)
        return kind, [(name, t.numel()), (scale_name(name), tiles)], None
    if kind == "mxfp4":
        if t.shape[1] % MXFP4_BLOCK:
            raise ValueError(f"save_checkpoint: {name} has in_features {t.shape[1]}, not a multiple of "
                             f"{MXFP4_BLOCK}: it cannot be stored as MXFP4")
        return kind, [(name, t.numel() // 2), (scale_name(name), t.numel() // MXFP4_BLOCK)], None
    store = t.dtype
    if t.is_floating_point():
        if keeps_fp32(name):
            store = torch.float32
        elif dtype is not None:
            store = dtype
        elif fmt in ("official-fp8", "compact"):
            store = torch.bfloat16
    return "float", [(name, t.numel() * store.itemsize)], store


def _convert(name: str, t: Tensor, kind: str, store: torch.dtype | None) -> dict[str, Tensor]:
    t = t.detach()
    if kind == "fp8":
        values, scales = fp8_block_quantize_weight(t)
        return {name: values.view(torch.float8_e4m3fn).cpu(), scale_name(name): scales.view(torch.float8_e8m0fnu).cpu()}
    if kind == "fp8row":  # one E8M0 scale per 32 along each row (what the report uses for table rows)
        values, scales = quantize_fp8(t.float())
        return {name: values.view(torch.float8_e4m3fn).cpu(), scale_name(name): scales.view(torch.float8_e8m0fnu).cpu()}
    if kind == "mxfp4":
        packed, scales = mxfp4_quantize_weight(t)
        return {name: packed.view(torch.int8).cpu(), scale_name(name): scales.view(torch.float8_e8m0fnu).cpu()}
    return {name: t.to(device="cpu", dtype=store)}


def _check_extra_name(name: str) -> None:
    if (not name or "/" in name or "\\" in name or name.startswith(".") or name in (CONFIG_NAME, INDEX_FILE)
            or name == SINGLE_FILE or _SHARD_RE.match(name)):
        raise ValueError(f"save_checkpoint: extra file name {name!r} must be a plain file name and not a "
                         f"checkpoint file")


def save_checkpoint(model: Transformer, directory: str | Path, *, dtype: torch.dtype | None = None,
                    fmt: CheckpointFormat = "float", extra_files: dict[str, bytes | str] | None = None,
                    metadata: dict[str, Any] | None = None, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write `model` as a checkpoint directory (see the module docstring); returns the directory."""
    if fmt not in ("float", "official-fp8", "compact"):
        raise ValueError(f"save_checkpoint: fmt must be 'float', 'official-fp8' or 'compact', got {fmt!r}")
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"save_checkpoint: dtype must be a floating dtype, got {dtype}")
    if max_shard_bytes <= 0:
        raise ValueError(f"save_checkpoint: max_shard_bytes must be positive, got {max_shard_bytes}")
    for name in extra_files or {}:
        _check_extra_name(name)
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"save_checkpoint: {directory} exists and is not a directory")

    # plan every entry first: bad shapes fail before anything is written
    state = model.state_dict()
    plan = [(name, *_plan_entry(name, t, fmt, dtype)) for name, t in state.items()]
    shards: list[list[int]] = [[]]
    used = 0
    for i, (_, _, outputs, _) in enumerate(plan):
        size = sum(b for _, b in outputs)
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(i)
        used += size
    n = len(shards)
    files = [SINGLE_FILE] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]

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
            name, kind, outputs, store = plan[i]
            tensors.update(_convert(name, state[name], kind, store))
            total += sum(b for _, b in outputs)
        save_state_dict_file(tensors, directory / file, file_meta)
        weight_map.update(dict.fromkeys(tensors, file))
    if n > 1:
        index = {"metadata": {"total_size": total, **file_meta}, "weight_map": weight_map}
        _atomic_write_bytes(directory / INDEX_FILE, (json.dumps(index, indent=2) + "\n").encode())
    # files of an earlier checkpoint in the same directory would confuse a loader
    keep = set(files) | ({INDEX_FILE} if n > 1 else set())
    for stale in directory.iterdir():
        if stale.name not in keep and (stale.name in (SINGLE_FILE, INDEX_FILE) or _SHARD_RE.match(stale.name)):
            stale.unlink()
    for name, content in (extra_files or {}).items():
        _atomic_write_bytes(directory / name, content.encode() if isinstance(content, str) else bytes(content))
    if fmt in ("official-fp8", "compact"):
        config = model.config.replace(dtype="fp8", expert_dtype="fp4")
    else:
        config = model.config.replace(dtype="bf16", expert_dtype=None)
    _atomic_write_bytes(directory / CONFIG_NAME, (config.to_json() + "\n").encode())
    return directory


# ---------------------------------------------------------------------- reading files
def read_header(path: str | Path) -> dict[str, Any]:
    """The safetensors JSON header of one file (tensor entries + `__metadata__`), validated against
    the file size so a truncated or corrupt file fails here with its name."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: {size} bytes, too short to be a safetensors file")
            n = int.from_bytes(head, "little")
            if n > min(size - 8, _MAX_HEADER_BYTES):
                raise CheckpointError(f"{path}: header length {n} exceeds the file ({size} bytes): truncated or "
                                      f"not a safetensors file")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(f"{path}: header is not valid JSON (corrupt safetensors file)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object (corrupt safetensors file)")
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        ok = isinstance(info, dict) and isinstance(info.get("dtype"), str) and isinstance(info.get("shape"), list)
        offsets = info.get("data_offsets") if ok else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry (corrupt safetensors file)")
        end = max(end, offsets[1])
    if 8 + n + end != size:
        raise CheckpointError(f"{path}: tensor data needs {8 + n + end} bytes but the file has {size}: "
                              f"truncated or corrupt")
    return header


def load_state_dict_file(path: str | Path, device: str | torch.device = "cpu") -> dict[str, Tensor]:
    """All tensors of one safetensors file, as stored (no dequantization)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    names = [k for k in read_header(path) if k != "__metadata__"]
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return {name: f.get_tensor(name).to(device, copy=True) for name in names}  # not views of the file
    except CheckpointError:
        raise
    except Exception as e:  # the safetensors reader's own errors
        raise CheckpointError(f"{path}: cannot read tensors ({str(e).splitlines()[0]})") from None


def _tensor_files(directory: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files of a checkpoint and the index's weight map (None without an index)."""
    index_path = directory / INDEX_FILE
    if index_path.exists():
        try:
            index = json.loads(index_path.read_text())
            weight_map = index["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
            raise CheckpointError(f"{index_path}: not a valid safetensors index (needs a 'weight_map' object)") \
                from None
        files = sorted(set(weight_map.values()))
        for file in files:
            if not isinstance(file, str) or Path(file).name != file:
                raise CheckpointError(f"{index_path}: weight_map names {file!r}, not a file in the directory")
            if not (directory / file).is_file():
                raise CheckpointError(f"{directory / file}: missing (listed in {INDEX_FILE})")
        return [directory / f for f in files], weight_map
    single = directory / SINGLE_FILE
    if single.is_file():
        return [single], None
    raise CheckpointError(f"{directory}: no {SINGLE_FILE} or {INDEX_FILE}")


class _TensorStore:
    """Name → (file, dtype, shape) over all files of a checkpoint; reads one tensor at a time."""

    def __init__(self, directory: Path):
        self.files, weight_map = _tensor_files(directory)
        self.entries: dict[str, tuple[Path, str, tuple[int, ...]]] = {}
        self.metadata: dict[str, str] = {}
        self.nbytes: dict[str, int] = {}
        for path in self.files:
            header = read_header(path)
            self.metadata.update(header.get("__metadata__") or {})
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                if name in self.entries:
                    raise CheckpointError(f"{path}: tensor {name} is also in {self.entries[name][0].name}")
                self.entries[name] = (path, info["dtype"], tuple(info["shape"]))
                self.nbytes[name] = info["data_offsets"][1] - info["data_offsets"][0]
        if weight_map is not None:
            for name, file in weight_map.items():
                if name not in self.entries or self.entries[name][0].name != file:
                    raise CheckpointError(f"{directory / INDEX_FILE}: lists {name} in {file}, which does not hold it")
        self._stack = contextlib.ExitStack()
        self._open: dict[Path, Any] = {}

    def __enter__(self) -> _TensorStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def get(self, name: str) -> Tensor:
        path = self.entries[name][0]
        try:
            if path not in self._open:
                self._open[path] = self._stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
            return self._open[path].get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"{path}: cannot read tensor {name} ({str(e).splitlines()[0]})") from None


# ---------------------------------------------------------------------- dequantization
def _bytes(t: Tensor) -> Tensor:
    """uint8 view of a one-byte (or packed FP4) tensor."""
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def _logical_shape(store: _TensorStore, name: str) -> tuple[tuple[int, ...], str | None, str | None]:
    """(float shape, quantization kind, problem) of a stored weight, from the headers alone."""
    _, dt, shape = store.entries[name]
    sname = scale_name(name) if name.endswith(".weight") else None
    if sname is None or sname not in store.entries:
        if dt == "F8_E4M3" or (dt in ("I8", "U8", "F4") and name.endswith(".weight")):
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
        if sshape not in (tiles, rows):
            return shape, None, f"{sname} has shape {list(sshape)}, expected {list(tiles)} (32x32 tiles) " \
                                f"or {list(rows)} (1x32 blocks) for {name} {list(shape)}"
        return shape, "fp8", None
    if dt in _PACKED_FP4_DTYPES:
        out_dim, in_dim = shape if dt == "F4" else (shape[0], shape[1] * 2)  # F4 headers count elements
        expected = (out_dim, in_dim // MXFP4_BLOCK)
        if sdt not in _SCALE_BYTE_DTYPES:
            return shape, None, f"{sname} has dtype {sdt}, expected F8_E8M0 or U8"
        if in_dim % MXFP4_BLOCK or sshape != expected:
            return shape, None, f"{sname} has shape {list(sshape)}, expected {list(expected)} for MXFP4 {name}"
        return (out_dim, in_dim), "mxfp4", None
    return shape, None, f"{name} has a {sname} but dtype {dt}; expected F8_E4M3 or packed FP4 (I8/U8/F4)"


def _dequantize(store: _TensorStore, name: str, kind: str | None, device: torch.device,
                dtype: torch.dtype | None = None) -> Tensor:
    """The value of one logical tensor on `device`, in `dtype` (None: as stored, fp32 when quantized).

    Always a fresh tensor: safetensors hands out views of the file's private mapping, and a model
    must not change (or fault) if someone later rewrites the file in place."""
    raw = store.get(name)
    if kind is None:
        return raw.to(device=device, dtype=dtype if raw.is_floating_point() else None, copy=True)
    return _dequantize_quantized(store, name, raw, kind, device).to(dtype or torch.float32)


def _dequantize_quantized(store: _TensorStore, name: str, raw: Tensor, kind: str, device: torch.device) -> Tensor:
    """FP8 (32x32 tiles or 1x32 row blocks) or MXFP4 weight + its scale → fp32 on `device`."""
    scale = store.get(scale_name(name))
    if scale.dtype != torch.float32:
        scale = _bytes(scale)
    scale = scale.to(device)
    values = _bytes(raw).to(device)
    if kind == "mxfp4":
        return mxfp4_dequantize_weight(values, scale)
    out_dim, in_dim = values.shape
    if scale.shape[0] == math.ceil(out_dim / WEIGHT_BLOCK):  # 32x32 tiles (a 1-row weight reads the same)
        return fp8_block_dequantize_weight(values, scale)
    factor = scale if scale.dtype == torch.float32 else e8m0_to_float(scale)  # 1x32 blocks along `in`
    factor = factor.repeat_interleave(WEIGHT_BLOCK, dim=1)[:, :in_dim]
    return values.view(torch.float8_e4m3fn).float() * factor


def _logical_names(store: _TensorStore) -> dict[str, tuple[tuple[int, ...], str | None, str | None]]:
    """Stored names minus scale companions → (shape, kind, problem)."""
    out = {}
    companions = set()
    for name in store.entries:
        if name.endswith(".weight") and scale_name(name) in store.entries:
            companions.add(scale_name(name))
    for name in store.entries:
        if name not in companions:
            out[name] = _logical_shape(store, name)
    return out


def _few(names: list[str], k: int = 5) -> str:
    return ", ".join(names[:k]) + (f", ... ({len(names)} in all)" if len(names) > k else "")


# ---------------------------------------------------------------------- model construction
_LARGE_NUMEL = 1 << 22  # factory calls this large (16 MiB in fp32) are only ever parameters here
_FACTORIES = (torch.empty, torch.zeros, torch.ones, torch.full, torch.rand, torch.randn)
# in-place initializers (and all of torch.nn.init): no-ops on a meta tensor (skipping them also skips
# torch's slow first-use import of the meta implementations)
_INITIALIZERS = (Tensor.normal_, Tensor.uniform_, Tensor.zero_, Tensor.fill_, Tensor.random_, Tensor.copy_)


class _SkeletonMode(TorchFunctionMode):
    """Tensor factories without an explicit device that ask for >= _LARGE_NUMEL elements go to meta,
    so a parameter larger than host memory (an Engram table) is never allocated, not even lazily;
    initializers applied to meta tensors do nothing."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _INITIALIZERS or getattr(func, "__module__", None) == "torch.nn.init":
            target = args[0] if args else next((v for v in kwargs.values() if isinstance(v, Tensor)), None)
            if isinstance(target, Tensor) and target.is_meta:
                return target
        if func in _FACTORIES and kwargs.get("device") is None:
            size = kwargs.get("size", args[0] if args else ())
            dims = size if isinstance(size, (tuple, list, torch.Size)) else [a for a in args if isinstance(a, int)]
            if all(isinstance(d, int) for d in dims) and math.prod(dims) >= _LARGE_NUMEL:
                kwargs["device"] = "meta"
        return func(*args, **kwargs)


def _build_skeleton(config: ModelConfig) -> Transformer:
    """The model with every parameter on the meta device (initializers run there, for free) and its
    buffers — pure functions of the config — built for real. Patches `nn.Module.register_parameter`
    while it runs, so it is not thread-safe."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        with _SkeletonMode():
            model = Transformer(config)
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]
    for name, buf in model.named_buffers():
        if buf.device.type == "meta":
            raise RuntimeError(f"load_checkpoint: buffer {name} {list(buf.shape)} is too large to build on the host "
                               f"while the parameters stay on meta")
    return model


def _cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """`model.to(dtype)` for parameters (module `_apply` overrides honoured); buffers keep theirs."""
    buffers = dict(model.named_buffers())
    model.to(dtype)
    for name, buf in buffers.items():
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._buffers[leaf] = buf


def read_config(directory: str | Path) -> ModelConfig:
    """The config of a checkpoint directory (flat preset-style or the release's HF config.json)."""
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    try:
        return load_config(path)
    except (ConfigError, OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: {e}") from None


def _check_directory(directory: str | Path) -> Path:
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: checkpoint directory does not exist")
    return directory


# ---------------------------------------------------------------------- load
def load_checkpoint(directory: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                    config: ModelConfig | None = None, strict: bool = True) -> Transformer:
    """Build a Transformer from a checkpoint directory (float, or the release's FP8/MXFP4, dequantized).

    strict=True: every model tensor must be present and nothing else (besides skipped `mtp.*` /
    vision tensors); the model is materialized from the checkpoint alone. strict=False: the model
    is initialized (`init_weights`) and the tensors present are copied in; the rest is logged."""
    if not dtype.is_floating_point:
        raise ValueError(f"load_checkpoint: dtype must be a floating dtype, got {dtype}")
    directory = _check_directory(directory)
    config = config or read_config(directory)
    device = torch.device(device)
    with _TensorStore(directory) as store:
        if strict:
            model = _build_skeleton(config)
        else:
            model = Transformer(config).init_weights()
        _cast_parameters(model, dtype)
        expected = model.state_dict()
        logical = _logical_names(store)

        built = {p for p in _OPTIONAL_PREFIXES if any(n.startswith(p) for n in expected)}
        skipped = sorted(n for n in logical if n not in expected and n.startswith(_OPTIONAL_PREFIXES)
                         and not n.startswith(tuple(built)))
        if skipped:
            logger.info("%s: skipping %d tensors of modules this model does not build (%s)", directory,
                        len(skipped), _few(skipped, 3))
        unexpected = sorted(n for n in logical if n not in expected and n not in skipped)
        missing = sorted(n for n in expected if n not in logical)
        if unexpected or missing:
            parts = ([f"missing {len(missing)} tensors: {_few(missing)}"] if missing else []) + \
                    ([f"unexpected {len(unexpected)} tensors: {_few(unexpected)}"] if unexpected else [])
            message = f"{directory}: checkpoint does not match the model: " + "; ".join(parts)
            if strict:
                raise CheckpointError(message)
            logger.warning("%s", message)
        names = [n for n in expected if n in logical]
        for name in names:  # all headers are checked before any data is read
            shape, _, problem = logical[name]
            if problem:
                raise CheckpointError(f"{store.entries[name][0]}: {problem}")
            if tuple(shape) != tuple(expected[name].shape):
                raise CheckpointError(f"{store.entries[name][0]}: tensor {name} has shape {list(shape)}, the model "
                                      f"expects {list(expected[name].shape)}")
            stored = store.entries[name][1]
            if expected[name].is_floating_point() and logical[name][1] is None and stored not in _FLOAT_DTYPES:
                raise CheckpointError(f"{store.entries[name][0]}: tensor {name} has dtype {stored}, expected a float")
        state = {name: _dequantize(store, name, logical[name][1], device, expected[name].dtype) for name in names}
    model.load_state_dict(state, strict=strict, assign=strict)
    return model.to(device)


def read_state_dict(directory: str | Path, *, device: str | torch.device = "cpu",
                    dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """All logical tensors of a checkpoint, dequantized (quantized ones in fp32, others as stored,
    or all floats in `dtype`); no model is built and nothing is checked against one."""
    directory = _check_directory(directory)
    device = torch.device(device)
    out = {}
    with _TensorStore(directory) as store:
        for name, (_, kind, problem) in _logical_names(store).items():
            if problem:
                raise CheckpointError(f"{store.entries[name][0]}: {problem}")
            out[name] = _dequantize(store, name, kind, device, dtype)
    return out


# ---------------------------------------------------------------------- info
def checkpoint_info(directory: str | Path) -> dict[str, Any]:
    """What a checkpoint holds, from the headers alone: config summary, files, tensor count, bytes,
    dtype histogram, format, metadata. For a CLI to print."""
    directory = _check_directory(directory)
    config = read_config(directory)
    with _TensorStore(directory) as store:
        dtypes: dict[str, dict[str, int]] = {}
        for name, (_, dt, _) in store.entries.items():
            slot = dtypes.setdefault(dt, {"tensors": 0, "bytes": 0})
            slot["tensors"] += 1
            slot["bytes"] += store.nbytes[name]
        logical = _logical_names(store)
        quantized = {kind for _, kind, _ in logical.values() if kind}
        return {
            "directory": str(directory),
            "config": {
                "n_layers": config.n_layers, "dim": config.dim, "vocab_size": config.vocab_size,
                "n_heads": config.n_heads, "n_routed_experts": config.n_routed_experts,
                "n_activated_experts": config.n_activated_experts, "n_mtp_layers": config.n_mtp_layers,
                "vision_n_layers": config.vision_n_layers, "dtype": config.dtype, "expert_dtype": config.expert_dtype,
            },
            "format": "official-fp8" if quantized else "float",
            "quantized": sorted(quantized),
            "files": [p.name for p in store.files],
            "tensors": len(store.entries),
            "logical_tensors": len(logical),
            "bytes": sum(store.nbytes.values()),
            "dtypes": dict(sorted(dtypes.items())),
            "metadata": dict(store.metadata),
        }
