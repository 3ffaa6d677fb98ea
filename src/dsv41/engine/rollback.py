"""The speculative rollback's device half: snapshot the per-slot state a verification block overwrites,
then restore it for the positions that were not accepted (SPEC §5 DSpark; docs/speculative.md).

A verification block of T positions per row writes, besides append-only entries (undone on the host by
`SequenceCache.truncate`), three kinds of small per-slot state: the T window-ring rows of every layer
(FP8 bytes and their positions) and the partial group (fp32 projections) of every ratio-m source.
`RollbackState` holds persistent buffers for up to `max_rows` rows of T positions:

    snapshot(slots, starts)                   before the block: the ring rows it will overwrite and the
                                              partial groups, into the buffers (rows [0, B))
    restore(slots, starts, keep, projections) after acceptance: row b keeps its first keep[b] positions —
                                              dropped ring rows get their snapshot back, the partial group
                                              is rebuilt for start + keep tokens (older members from the
                                              snapshot, kept members from the block's projections)

Key idea: both are device ops on tensors of fixed shape with no host read and no data-dependent branch
(`torch.where` over all B·T rows instead of a boolean gather), so the snapshot runs inside the captured
verification step and the restore is itself replayed from a CUDA graph per batch bucket
(`graphs.DecodeGraphs.restore`). Padding rows (the dummy slot, keep = T) restore nothing of a sequence.
The host-driven verification (`speculative.VerifyRollback`) uses the same two functions eagerly.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dsv41.engine.block_manager import BlockManager


class RollbackState:
    def __init__(self, pools: BlockManager, max_rows: int, T: int):
        W = pools.window
        if T > W:
            raise ValueError(f"a verification block of {T} positions is longer than the window ({W})")
        self.pools, self.max_rows, self.T = pools, max_rows, T
        device = pools.device
        L = pools.ring_rows.size(0)
        self.ring = torch.zeros(L, max_rows * T, pools.ring_bytes, dtype=pools.ring_rows.dtype, device=device)
        self.ring_pos = torch.zeros(L, max_rows * T, dtype=pools.ring_positions.dtype, device=device)
        self.pending = {s: (torch.zeros(max_rows, *p.pending_kv.shape[1:], device=device),
                            torch.zeros(max_rows, *p.pending_score.shape[1:], device=device))
                        for s, p in pools.sources.items() if p.pending_kv is not None}  # (rows, m − 1, D)
        self._t = torch.arange(T, device=device)
        self._members = {s: torch.arange(p.ratio - 1, device=device) for s, p in pools.sources.items()
                         if p.pending_kv is not None}  # a group's open member indices (device: capture-safe)

    def _flat(self, slots: Tensor, starts: Tensor) -> Tensor:
        """(B·T,) the flat ring rows slot·W + position % W a block at `starts` writes."""
        W = self.pools.window
        return (slots.unsqueeze(1) * W + (starts.unsqueeze(1) + self._t) % W).view(-1)  # (B·T,)

    def _rings(self) -> tuple[Tensor, Tensor]:
        pools = self.pools
        L = pools.ring_rows.size(0)
        return pools.ring_rows.view(L, -1, pools.ring_bytes), pools.ring_positions.view(L, -1)

    def snapshot(self, slots: Tensor, starts: Tensor) -> None:
        """Rows slots (B,) about to run T positions from starts (B,): their overwritten state → rows [0, B)."""
        B = slots.numel()
        if B > self.max_rows:
            raise ValueError(f"rollback snapshot of {B} rows; the buffers hold {self.max_rows}")
        flat = self._flat(slots, starts)
        rows, positions = self._rings()
        self.ring[:, :B * self.T] = rows[:, flat]  # (L, B·T, bytes)
        self.ring_pos[:, :B * self.T] = positions[:, flat]  # (L, B·T)
        for s, (kv, score) in self.pending.items():
            p = self.pools.sources[s]
            kv[:B] = p.pending_kv[slots]  # (B, m − 1, D)
            score[:B] = p.pending_score[slots]

    def restore(self, slots: Tensor, starts: Tensor, keep: Tensor, projections: dict[int, tuple[Tensor, Tensor]]
                ) -> None:
        """Row b (slot slots[b], block from starts[b]) keeps its first keep[b] ∈ [0, T] positions.
        projections: source → (kv, score) (≥ B, T, D) of the block, for every source with partial groups."""
        B, T = slots.numel(), self.T
        flat = self._flat(slots, starts)
        dropped = (self._t.unsqueeze(0) >= keep.unsqueeze(1)).view(-1)  # (B·T,)
        rows, positions = self._rings()
        rows[:, flat] = torch.where(dropped.view(1, -1, 1), self.ring[:, :B * T], rows[:, flat])
        positions[:, flat] = torch.where(dropped.view(1, -1), self.ring_pos[:, :B * T], positions[:, flat])
        end = starts + keep  # (B,) token count after the rollback
        for s, (snap_kv, snap_score) in self.pending.items():
            p = self.pools.sources[s]
            m = p.ratio
            proj_kv, proj_score = projections[s]
            member = (end - end % m).unsqueeze(1) + self._members[s]  # (B, m − 1) positions
            old = (member < starts.unsqueeze(1)).unsqueeze(-1)  # (B, m − 1, 1) ran before the block
            j = (member - starts.unsqueeze(1)).clamp(0, T - 1)  # its block position otherwise
            idx = j.unsqueeze(-1).expand(-1, -1, snap_kv.size(-1))  # (B, m − 1, D)
            p.pending_kv[slots] = torch.where(old, snap_kv[:B], proj_kv[:B].gather(1, idx))
            p.pending_score[slots] = torch.where(old, snap_score[:B], proj_score[:B].gather(1, idx))
