"""Checkpoint files: atomic writes, validated safetensors headers, and a tensor store over shards.

A checkpoint directory holds `config.json`, then either `model.safetensors` or shards
`model-0000k-of-0000n.safetensors` plus `model.safetensors.index.json` (`{"metadata":
{"total_size"}, "weight_map"}`), and any extra files. Every file is written to a temporary name,
fsynced and renamed into place. Every read validates the header against the file size first, so a
truncated or corrupt file fails with its name (`CheckpointError`, one line). Only safetensors is
read or written, never pickle.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from dsv41.config import ConfigError

CONFIG_NAME = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 2 * 1024**3
SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_MAX_HEADER_BYTES = 100 * 1024**2


class CheckpointError(ConfigError):
    """A checkpoint that cannot be read; the one-line message names the file or tensor. A ConfigError
    (a ValueError), so the CLI reports it as a user error: one line, exit code 2."""


def shard_names(n: int) -> list[str]:
    """File names of an n-file checkpoint (the single file when n == 1)."""
    return [SINGLE_FILE] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]


# ---------------------------------------------------------------------- atomic files
def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be opened
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
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


def atomic_write_bytes(path: Path, data: bytes) -> None:
    atomic_write(path, lambda tmp: tmp.write_bytes(data))


def save_state_dict_file(tensors: dict[str, Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """One safetensors file, written atomically (CPU, contiguous copies of the tensors)."""
    cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    atomic_write(Path(path), lambda tmp: save_file(cpu, str(tmp), metadata={"format": "pt", **(metadata or {})}))


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


def tensor_files(directory: Path) -> tuple[list[Path], dict[str, str] | None]:
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


class TensorStore:
    """Name → (file, dtype, shape) over all files of a checkpoint; reads one tensor at a time."""

    def __init__(self, directory: Path):
        self.files, weight_map = tensor_files(directory)
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

    def __enter__(self) -> TensorStore:
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


