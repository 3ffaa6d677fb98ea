"""Bytes autograd saves for the backward of one call (tests of the lean training Functions)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor


def saved_bytes(fn: Callable[..., Tensor], args: Sequence[Tensor]) -> int:
    """Run fn(*args) on fresh leaf copies that require grad; the bytes of the storages saved for the backward,
    each counted once, beyond the arguments' own storages."""
    seen: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    leaves = [a.detach().clone().requires_grad_(True) for a in args]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*leaves)
    inputs = {a.untyped_storage().data_ptr() for a in leaves}
    return sum(n for ptr, n in seen.items() if ptr not in inputs)
