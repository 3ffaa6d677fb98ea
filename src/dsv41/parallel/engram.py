"""Engram tables row-sharded over an engram-parallel group, read by all-to-all (SPEC §5, report §Engram).

A table (rows × 256 at release size: 384M rows per layer) is never all-gathered as FSDP would: rank r
of the group holds rows [r·c, (r+1)·c), c = ⌈rows/W⌉ (torch.chunk's split), with its Sinkhorn momentum.

* Prefetch at the start of a step — addresses depend only on tokens: every rank hashes all its
  micro-batches, sends the distinct row ids to their owners (all-to-all of ids), receives the rows
  (all-to-all of rows) and keeps them as one leaf tensor. The Engram forward then reads rows from
  it by id (`searchsorted`), for any micro-batch, in any pipeline order.
* Gradients held locally — backward accumulates into that leaf's `.grad` only; after the backbone's
  backward has finished, `push_grads` sends each row's gradient to its owner (the reverse
  all-to-all), which adds it into its shard's gradient (divided by the data ranks, as FSDP averages).
* The optimizer is `ShardedSinkhorn` with the group's all-reduced column statistics.

Cost per step: ids (8 B) and rows (256·4 B) of the distinct addresses of the local batch, each way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard

from dsv41.model.engram import Engram


def _exchange(send: Tensor, counts_out: list[int], counts_in: list[int], group: dist.ProcessGroup) -> Tensor:
    """Plain (gradient-free) all-to-all of rows."""
    out = send.new_empty((sum(counts_in), *send.shape[1:]))
    dist.all_to_all_single(out, send.contiguous(), counts_in, counts_out, group=group)
    return out


class ShardedEngramTable(nn.Module):
    """Drop-in for `Engram.embed` (`weight` keeps the name): this rank's rows, lookups from the prefetch."""

    def __init__(self, table: nn.Embedding, group: dist.ProcessGroup):
        super().__init__()
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.num_embeddings, self.embedding_dim = table.weight.shape
        self.rows_per_rank = -(-self.num_embeddings // self.size)
        self.lo = min(self.rank * self.rows_per_rank, self.num_embeddings)
        hi = min(self.lo + self.rows_per_rank, self.num_embeddings)
        self.weight = nn.Parameter(table.weight.detach()[self.lo:hi].clone())
        self._ids: Tensor | None = None  # (U,) sorted distinct ids of the prefetch
        self._rows: Tensor | None = None  # (U, D) leaf holding their rows; gradients accumulate here
        self._plan: tuple[Tensor, list[int], list[int]] | None = None

    @torch.no_grad()
    def prefetch(self, ids: Tensor) -> None:
        """Collective over the group: fetch the rows of every id in `ids` (any shape)."""
        uniq = torch.unique(ids.flatten())  # sorted
        owner = uniq // self.rows_per_rank
        send_counts = torch.bincount(owner, minlength=self.size)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        out_c, in_c = send_counts.tolist(), recv_counts.tolist()
        asked = _exchange(uniq, out_c, in_c, self.group)  # ids other ranks want from my rows
        rows = _exchange(self.weight.detach().index_select(0, asked - self.lo), in_c, out_c, self.group)
        self._ids, self._plan = uniq, (asked, out_c, in_c)
        self._rows = rows.requires_grad_(self.weight.requires_grad)

    def forward(self, hash_ids: Tensor) -> Tensor:
        if self._rows is None:
            raise RuntimeError("ShardedEngramTable: call prefetch(ids) at the start of the step")
        pos = torch.searchsorted(self._ids, hash_ids)  # every id was prefetched
        return self._rows[pos]  # (..., D)

    @torch.no_grad()
    def push_grads(self, divide: float) -> None:
        """Collective, after the whole backward: row gradients to their owners, added into weight.grad."""
        if self._plan is None:
            return
        asked, out_c, in_c = self._plan
        g = self._rows.grad if self._rows.grad is not None else torch.zeros_like(self._rows)
        back = _exchange(g, out_c, in_c, self.group)  # (len(asked), D) gradients of my rows
        grad = torch.zeros_like(self.weight).index_add_(0, asked - self.lo, back).div_(divide)
        self.weight.grad = grad if self.weight.grad is None else self.weight.grad.add_(grad)
        self._ids = self._rows = self._plan = None

    def global_weight(self, mesh) -> DTensor:
        """The table as a DTensor row-sharded over `mesh` (the group's mesh), for distributed checkpoints."""
        return DTensor.from_local(self.weight, mesh, [Shard(0)], run_check=False,
                                  shape=torch.Size((self.num_embeddings, self.embedding_dim)),
                                  stride=(self.embedding_dim, 1))


def shard_engram_tables(model: nn.Module, group: dist.ProcessGroup) -> list[ShardedEngramTable]:
    """Replace every Engram table of `model` by its row shard; returns the sharded tables."""
    tables = []
    for module in model.modules():
        if isinstance(module, Engram) and not isinstance(module.embed, ShardedEngramTable):
            module.embed = ShardedEngramTable(module.embed, group)
            tables.append(module.embed)
    return tables
