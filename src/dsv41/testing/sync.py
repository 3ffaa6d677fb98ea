"""Host-sync detection and op counting for code that must run inside a CUDA graph or `torch.compile`.

Key idea: a step that is captured in a CUDA graph (or compiled with `fullgraph=True`) may not make the
host wait for the device, and every output shape must follow from input shapes. Both properties can be
checked on the CPU, where no GPU is needed: ops that would sync on a GPU are recognisable by *what they
are*, not by how long they take. `NoSyncMode` raises `HostSyncError` at the first such op:

- reads of a tensor's values on the host: `aten._local_scalar_dense` / `aten.item` (`.item()`, `int(t)`,
  `bool(t)`, `if t:`), `Tensor.tolist()`, `Tensor.numpy()` (these two never reach the dispatcher on the
  CPU, so a torch-function mode catches them), `aten.equal`, `aten.allclose` and every other op tagged
  `data_dependent_output`;
- ops whose output shape depends on the data: `aten.nonzero`, `aten.masked_select`, `aten.bincount`,
  `aten.unique*`, `argwhere` and every other op tagged `dynamic_output_shape`, with two refinements:
  indexing (`aten.index.Tensor`, `index_put`) only with a boolean/uint8 mask (integer indices keep a
  static shape), `aten.repeat_interleave.Tensor` only without `output_size`;
- device → host copies (`.cpu()`, `.to("cpu")`, `copy_` into a CPU tensor from a device tensor).

`OpCounter` counts the aten ops of a region and how many of them are kernels (ops that are not views:
on a GPU each launches at least one kernel) — the number a CUDA graph saves in launches.

Used by the MoE tests (issue 15: dispatch without `.tolist()` / `bincount`) and reusable by the engine's
decode-step tests. No module state: each mode instance keeps its own counts.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Tensor methods that read values on the host without necessarily passing through the dispatcher.
_HOST_READ_METHODS = {
    torch.Tensor.tolist: "Tensor.tolist",
    torch.Tensor.numpy: "Tensor.numpy",
    torch.Tensor.item: "Tensor.item",
    torch.Tensor.__bool__: "Tensor.__bool__",
    torch.Tensor.__int__: "Tensor.__int__",
    torch.Tensor.__float__: "Tensor.__float__",
    torch.Tensor.__index__: "Tensor.__index__",
}
_MASK_DTYPES = (torch.bool, torch.uint8)
_INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
# no kernel runs: allocations (the caching allocator hands out memory without a launch) and metadata-only
# ops that are not declared views
_NO_KERNEL = {aten.empty.memory_format, aten.empty_like.default, aten.empty_strided.default,
              aten.new_empty.default, aten.new_empty_strided.default, aten._unsafe_view.default}


class HostSyncError(Exception):
    """An op that would make the host wait for the device, or give a data-dependent shape.

    Not a RuntimeError on purpose: code that probes a kernel and treats a RuntimeError as "not supported"
    (the MoE's grouped_mm probe) must not swallow it and cache a wrong answer.
    """


def _device_of(t: object) -> torch.device | None:
    return t.device if isinstance(t, torch.Tensor) else None


def sync_reason(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> str | None:
    """Why `func(*args, **kwargs)` is not allowed in a captured step, or None when it is."""
    tags = set(func.tags)
    if func in _INDEXING:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        masks = [i for i in indices if isinstance(i, torch.Tensor) and i.dtype in _MASK_DTYPES]
        return "boolean-mask indexing (its shape depends on the mask)" if masks else None
    if func is aten.repeat_interleave.Tensor:
        if kwargs.get("output_size") is None and (len(args) < 3 or args[2] is None):
            return "repeat_interleave without output_size (its shape depends on the repeats)"
        return None
    if torch.Tag.data_dependent_output in tags:
        return "reads tensor values on the host"
    if torch.Tag.dynamic_output_shape in tags:
        return "output shape depends on the data"
    if func is aten._to_copy.default:
        src, dst = _device_of(args[0]), kwargs.get("device")
        if src is not None and src.type != "cpu" and dst is not None and torch.device(dst).type == "cpu":
            return "device → host copy"
    if func is aten.copy_.default:
        dst, src = _device_of(args[0]), _device_of(args[1])
        if dst is not None and src is not None and dst.type == "cpu" and src.type != "cpu":
            return "device → host copy"
    return None


class _HostReads(TorchFunctionMode):
    """The torch-function half of NoSyncMode: `tolist`, `numpy`, `item`, `bool(t)`, `int(t)`, ..."""

    def __init__(self, allow: frozenset[str]) -> None:
        super().__init__()
        self.allow = allow

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = _HOST_READ_METHODS.get(func)
        if name is not None and name not in self.allow:
            raise HostSyncError(f"{name}: reads tensor values on the host")
        return func(*args, **(kwargs or {}))


class NoSyncMode(TorchDispatchMode):
    """`with NoSyncMode(): step()` raises HostSyncError at the first host sync or data-dependent shape.

    `allow` names ops to let through (`"aten.nonzero.default"`, `"Tensor.tolist"`, ...). `ops_seen` counts
    the aten ops that ran inside, so a test can check the region did real work.
    """

    def __init__(self, allow: Iterable[str] = ()) -> None:
        super().__init__()
        self.allow = frozenset(allow)
        self.ops_seen = 0
        self._host_reads: _HostReads | None = None

    def __enter__(self) -> NoSyncMode:
        self._host_reads = _HostReads(self.allow)
        self._host_reads.__enter__()
        try:
            return super().__enter__()
        except BaseException:
            self._host_reads.__exit__(None, None, None)
            raise

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            super().__exit__(exc_type, exc, tb)
        finally:
            if self._host_reads is not None:
                self._host_reads.__exit__(exc_type, exc, tb)
                self._host_reads = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops_seen += 1
        if str(func) not in self.allow:
            reason = sync_reason(func, args, kwargs)
            if reason is not None:
                raise HostSyncError(f"{func}: {reason}")
        return func(*args, **kwargs)


def launches_kernel(func) -> bool:
    """An aten op that is neither a view nor a bare allocation: on a GPU it launches at least one kernel."""
    return not getattr(func, "is_view", False) and func not in _NO_KERNEL


class OpCounter(TorchDispatchMode):
    """Counts aten ops by name; `kernels` = ops that are neither views nor bare allocations (on a GPU each
    of them launches at least one kernel; fused or compiled code launches fewer)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.kernels = 0

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        if launches_kernel(func):
            self.kernels += 1
        return func(*args, **(kwargs or {}))
