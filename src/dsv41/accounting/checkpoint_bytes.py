"""Checkpoint bytes in the release's format, per component: what an `official-fp8` save writes.

Every `Param` row is stored as `dsv41.checkpoint.release_format` says — FP8 tiles, FP8 rows, MXFP4,
BF16 or FP32, scale tensors included — and routed experts count once per copy. For v41-flash the
total is compared with the release's own `model.safetensors.index.json` (`metadata.total_size`).
Torch-free.
"""

from __future__ import annotations

import math
from typing import Any

from dsv41.accounting.params import Param
from dsv41.checkpoint.release_format import DTYPE_BYTES, storage_of, stored_layout

# the release's model.safetensors.index.json metadata.total_size (text, Engram, DSpark and vision)
RELEASE_TOTAL_SIZE = 510_286_023_000


def checkpoint_bytes(params: list[Param]) -> dict[str, Any]:
    """{"total", "scales", "by_group", "by_form"} bytes of `params` in the release's format."""
    by_group: dict[str, int] = {}
    by_form: dict[str, int] = {}
    scales = 0
    for p in params:
        name = p.name.replace("{e}", "0")  # experts: one name stands for every copy
        form = storage_of(name)
        for stored, dtype, shape in stored_layout(name, p.shape):
            n = DTYPE_BYTES[dtype] * math.prod(shape) * p.copies
            by_group[p.group] = by_group.get(p.group, 0) + n
            by_form[form] = by_form.get(form, 0) + n
            scales += n if stored != name else 0
    return {"total": sum(by_group.values()), "scales": scales, "by_group": by_group, "by_form": by_form}
