"""Collectives with gradients: what token dispatch, sequence halos and split entries are built from.

Each op is a `torch.autograd.Function` whose backward is the transposed communication:
  all_to_all(x)       rows to other ranks in uneven splits; backward sends the row gradients back
  gather_shards(t)    every rank's equal-shape shard, stacked (W, ...); backward reduce-scatters (sums)
                      each shard's gradient onto its owner
  from_previous(t)    rank r receives rank r−1's tensor (rank 0: zeros); backward returns the gradient
                      to rank r−1 — the halo exchange of context parallelism
Works on gloo (CPU) and NCCL alike; ranks are group ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def all_reduce(t: Tensor, group: dist.ProcessGroup | None, op: dist.ReduceOp = dist.ReduceOp.SUM) -> Tensor:
    """In-place all-reduce (no gradient); a no-op without a group or on a group of one."""
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup) -> Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(x: Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup) -> Tensor:
    """Rows x[sum(in_splits[:j]) : ...] go to group rank j; returns the rows received, by source rank."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


class _GatherShards(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: Tensor):
        out = grad.new_empty(grad.shape[1:])
        # (W, *shape) → (W·shape[0], ...): rank-major rows, as reduce_scatter_tensor splits them
        dist.reduce_scatter_tensor(out, grad.contiguous().flatten(0, 1), group=ctx.group)  # sum of every use
        return out, None


def gather_shards(t: Tensor, group: dist.ProcessGroup) -> Tensor:
    """(W, *t.shape): every group rank's t, in rank order."""
    return _GatherShards.apply(t, group)


class _FromPrevious(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        out = torch.zeros_like(t)
        _exchange(send=t.contiguous() if rank + 1 < world else None, to=rank + 1,
                  recv=out if rank > 0 else None, frm=rank - 1, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        group = ctx.group
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        back = torch.zeros_like(grad)
        _exchange(send=grad.contiguous() if rank > 0 else None, to=rank - 1,
                  recv=back if rank + 1 < world else None, frm=rank + 1, group=group)
        return back, None


def from_previous(t: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Rank r gets rank r−1's `t` (same shape on every rank; zeros on rank 0)."""
    return _FromPrevious.apply(t, group)


def _exchange(send: Tensor | None, to: int, recv: Tensor | None, frm: int, group: dist.ProcessGroup) -> None:
    ops = []
    if send is not None:
        ops.append(dist.P2POp(dist.isend, send, dist.get_global_rank(group, to), group))
    if recv is not None:
        ops.append(dist.P2POp(dist.irecv, recv, dist.get_global_rank(group, frm), group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
