"""Context parallelism: each sequence split into `cp` contiguous chunks, one per rank (SPEC §3).

A `ContextParallelContext` is the ForwardContext of one rank's chunk; the attention code is unchanged
and reaches the rest of the sequence only through the context's sequence-split hooks:

* window halo — a query's window reaches back `window − 1` tokens, into the previous rank's chunk:
  each layer receives the last `window − 1` rows of the previous rank's window KV (`from_previous`,
  whose backward returns their gradient), and the mask covers halo ∪ local keys.
* compressor groups aligned to the split — a compressed entry belongs to the rank holding its group's
  last token; a group that starts on the previous rank reads `m − 1` halo rows of the attention input,
  so every group is compressed exactly once, whatever document boundaries do to the group phase.
* split shared state — each rank keeps only the entries it compressed (`own_slots`, at most ⌈T_r/m⌉ per
  row) in the per-forward SharedAttention record and in the pipeline payload; a consumer layer
  gathers the other ranks' entries for its own computation only (`gather_entries`, whose backward
  reduce-scatters the gradients back to the owners). Top-k indices and candidate masks are per query,
  so they are split like the queries.
* whole-sequence statistics — the indexer KL averages over the queries of all ranks (`count_queries`),
  the MoE balance loss counts whole sequences (`MoE.sequence_reduce`), the LM loss divides by the
  target count of the whole sequence. Each rank's loss is then its part of the sequence's loss; the
  parts sum to the single-device loss.

Needs T divisible by cp and chunks of at least `window − 1` and `m − 1` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from dsv41.model.state import EntrySlots, ForwardContext, build_slots
from dsv41.parallel.comm import all_reduce, from_previous, gather_shards


@dataclass
class ContextParallelContext(ForwardContext):
    """ForwardContext of the chunk [offset, offset + T_r) of every row; `full_*` describe whole rows."""

    full_doc_ids: Tensor | None = None  # (B, T) long
    full_positions: Tensor | None = None  # (B, T) long
    full_window_start: Tensor | None = None  # (B, T) long or None
    offset: int = 0  # first token of this rank's chunk
    group: dist.ProcessGroup | None = None
    cp_rank: int = 0
    cp_size: int = 1
    _own: dict[int, tuple[EntrySlots, Tensor]] = field(default_factory=dict)

    @classmethod
    def for_chunk(cls, doc_ids: Tensor, group: dist.ProcessGroup, window_start: Tensor | None = None,
                  training_losses: bool = False) -> ContextParallelContext:
        """The context of this rank's chunk of rows with document ids `doc_ids` (B, T) (whole rows)."""
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        B, T = doc_ids.shape
        if T % size:
            raise ValueError(f"context parallelism: sequence length {T} is not divisible by cp={size}")
        whole = ForwardContext.build(doc_ids, doc_ids)
        n = T // size
        lo = rank * n
        chunk = slice(lo, lo + n)
        return cls(doc_ids=whole.doc_ids[:, chunk], positions=whole.positions[:, chunk],
                   window_start=None if window_start is None else window_start[:, chunk],
                   training_losses=training_losses, full_doc_ids=whole.doc_ids, full_positions=whole.positions,
                   full_window_start=window_start, offset=lo, group=group, cp_rank=rank, cp_size=size)

    @property
    def chunk(self) -> int:
        return self.doc_ids.size(1)

    @property
    def token_index(self) -> Tensor:
        B, T = self.doc_ids.shape
        return (self.offset + torch.arange(T, device=self.doc_ids.device)).expand(B, T)

    def slots(self, ratio: int) -> EntrySlots:
        """Slots of the whole rows (every rank agrees on the numbering)."""
        if ratio not in self._slots:
            self._slots[ratio] = build_slots(self.full_doc_ids, self.full_positions, ratio)
        return self._slots[ratio]

    # ---------------------------------------------------------------- window halo
    def window_keys(self, kv: Tensor, window: int) -> tuple[Tensor, Tensor]:
        H = window - 1
        if H > self.chunk:
            raise ValueError(f"context parallelism: chunk of {self.chunk} tokens is shorter than the window halo {H}")
        halo = from_previous(kv[:, self.chunk - H:], self.group)  # (B, H, D): previous rank's last rows
        return torch.cat([halo, kv], dim=1), self._halo_mask(window)  # (B, H + T_r, D)

    def _halo_mask(self, window: int) -> Tensor:
        key = ("halo_window", window)
        if key not in self._cache:
            H, dev = window - 1, self.doc_ids.device
            q = self.token_index  # (B, T_r) global query index
            k = self.offset - H + torch.arange(H + self.chunk, device=dev)  # (S,) global key index
            kdoc = self.full_doc_ids.gather(1, k.clamp(min=0).expand(q.size(0), -1))  # (B, S)
            qt, kt = q.unsqueeze(-1), k.view(1, 1, -1)
            mask = (kt >= 0) & (kt <= qt) & (kt > qt - window) & (kdoc.unsqueeze(1) == self.doc_ids.unsqueeze(-1))
            if self.window_start is not None:
                mask &= kt >= self.window_start.unsqueeze(-1)
            self._cache[key] = mask  # (B, T_r, H + T_r)
        return self._cache[key]

    # ---------------------------------------------------------------- split entries
    def own_slots(self, ratio: int) -> EntrySlots:
        return self._own_slots(ratio)[0]

    def _own_slots(self, ratio: int) -> tuple[EntrySlots, Tensor]:
        """(this rank's slots, capacity ⌈T_r/m⌉ per row, with tokens indexing halo ∪ chunk rows;
        index (B, N) of every global slot in the rank-major stack of all ranks' own slots)."""
        if ratio not in self._own:
            s = self.slots(ratio)
            cap = -(-self.chunk // ratio)
            # slots are in token order: a rank's slots are a contiguous run per row
            bounds = torch.arange(self.cp_size + 1, device=s.token.device) * self.chunk  # (cp + 1,)
            before = (s.token.unsqueeze(1) < bounds.view(1, -1, 1)) & s.valid.unsqueeze(1)  # (B, cp + 1, N)
            first = before.sum(-1)  # (B, cp + 1): slots ending before each chunk boundary
            lo = first[:, self.cp_rank:self.cp_rank + 1]  # (B, 1)
            idx = lo + torch.arange(cap, device=lo.device)  # (B, cap)
            mine = idx < first[:, self.cp_rank + 1:self.cp_rank + 2]
            safe = idx.clamp(max=max(s.token.size(1) - 1, 0))
            halo = ratio - 1
            pick = (lambda t: t.gather(1, safe)) if s.token.size(1) else (lambda t: torch.zeros_like(idx))
            own = EntrySlots(ratio=ratio,
                             token=torch.where(mine, pick(s.token) - self.offset + halo, torch.full_like(idx, halo)),
                             doc=torch.where(mine, pick(s.doc), torch.full_like(idx, -1)),
                             group=torch.where(mine, pick(s.group), torch.zeros_like(idx)),
                             valid=mine)
            # where global slot j lives: rank r = its chunk, position j − first[r] in that rank's own slots
            r = (s.token // self.chunk).clamp(max=self.cp_size - 1)  # (B, N); invalid slots are never visible
            j = torch.arange(s.token.size(1), device=r.device).expand_as(r)
            where = r * cap + (j - first.gather(1, r)).clamp(0, cap - 1)
            self._own[ratio] = (own, where)
        return self._own[ratio]

    def compressor_input(self, x: Tensor, ratio: int) -> Tensor:
        if ratio == 1:
            return x
        halo = from_previous(x[:, self.chunk - (ratio - 1):], self.group)  # (B, m − 1, dim)
        return torch.cat([halo, x], dim=1)

    def gather_entries(self, t: Tensor, ratio: int) -> Tensor:
        """Own-slot rows (B, cap, ...) of every rank → (B, N, ...) in global slot order."""
        where = self._own_slots(ratio)[1]  # (B, N)
        parts = gather_shards(t, self.group)  # (cp, B, cap, ...)
        stacked = parts.transpose(0, 1).flatten(1, 2)  # (B, cp·cap, ...)
        index = where.view(*where.shape, *([1] * (t.dim() - 2))).expand(*where.shape, *t.shape[2:])
        return stacked.gather(1, index)

    # ---------------------------------------------------------------- whole-sequence statistics
    def count_queries(self, has_any: Tensor) -> Tensor:
        return all_reduce(has_any.sum().float(), self.group)

    def sequence_sum(self, t: Tensor) -> Tensor:
        """A per-sequence statistic summed over the chunks (no gradient)."""
        return all_reduce(t.detach().clone(), self.group)
