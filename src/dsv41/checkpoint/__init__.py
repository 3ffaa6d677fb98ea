"""Model checkpoints: a directory of `config.json` + safetensors, in our float layout or the release's.

The package by concept:
  * `release_format` — the release's per-tensor storage table (FP8 tiles / FP8 rows / MXFP4 /
    BF16 / FP32), with the reference line each rule comes from; torch-free (accounting reads it);
  * `files` — atomic writes, validated safetensors headers, the tensor store over shards;
  * `codec` — one logical tensor ↔ its stored tensors;
  * `save` — `save_checkpoint` in the `float`, `official-fp8` (exactly the release table) or
    `compact` format;
  * `load` — `load_checkpoint` (meta skeleton, streamed tensor by tensor, `weights="float"` or
    `"as-released"`), `read_state_dict`, `checkpoint_info`.
Only safetensors is read or written, never pickle. Every bad input — missing directory or file,
corrupt or truncated safetensors, missing / unexpected / mis-shaped tensors — raises
`CheckpointError` with one line naming the file or tensor. Design and formats: docs/checkpoint.md.

Names resolve lazily, so `import dsv41.checkpoint.release_format` does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> submodule that defines it
_EXPORTS = {
    "CheckpointError": "files",
    "CONFIG_NAME": "files",
    "INDEX_FILE": "files",
    "SINGLE_FILE": "files",
    "DEFAULT_SHARD_BYTES": "files",
    "read_header": "files",
    "load_state_dict_file": "files",
    "save_state_dict_file": "files",
    "CheckpointFormat": "save",
    "keeps_fp32": "save",
    "save_checkpoint": "save",
    "scale_name": "release_format",
    "storage_of": "release_format",
    "load_checkpoint": "load",
    "load_drafter": "load",
    "read_state_dict": "load",
    "read_config": "load",
    "checkpoint_info": "load",
    "release_layout_problems": "load",
}
__all__ = [
    "CONFIG_NAME",
    "CheckpointError",
    "CheckpointFormat",
    "DEFAULT_SHARD_BYTES",
    "INDEX_FILE",
    "SINGLE_FILE",
    "checkpoint_info",
    "keeps_fp32",
    "load_checkpoint",
    "load_drafter",
    "load_state_dict_file",
    "read_config",
    "read_header",
    "read_state_dict",
    "release_layout_problems",
    "save_checkpoint",
    "save_state_dict_file",
    "scale_name",
    "storage_of",
]

if TYPE_CHECKING:
    from dsv41.checkpoint.files import (
        CONFIG_NAME,
        DEFAULT_SHARD_BYTES,
        INDEX_FILE,
        SINGLE_FILE,
        CheckpointError,
        load_state_dict_file,
        read_header,
        save_state_dict_file,
    )
    from dsv41.checkpoint.load import (
        checkpoint_info,
        load_checkpoint,
        load_drafter,
        read_config,
        read_state_dict,
        release_layout_problems,
    )
    from dsv41.checkpoint.release_format import scale_name, storage_of
    from dsv41.checkpoint.save import CheckpointFormat, keeps_fp32, save_checkpoint


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dsv41.checkpoint' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"dsv41.checkpoint.{_EXPORTS[name]}"), name)
    globals()[name] = value  # resolve once
    return value
