"""Per-sequence KV cache in the report's storage formats: packed FP4 global KV, FP8 window rings.

What one sequence keeps (SPEC §1a, §4):
  * for each kv-source (Full) layer, its compressed entries — main KV as FP4 E2M1 with an E4M3
    scale per 16 channels (256 + 32 = 288 B for 512 dims) and index keys as FP4 with an E8M0
    scale per 32 (64 + 4 = 68 B for 128 dims) — in pages that grow with the sequence (nothing is
    preallocated for a maximum length);
  * the compressor's partial group (fp32 projections and gate scores of tokens whose group of m
    has not completed yet);
  * for every layer, a ring of `window_size` slots of window KV in FP8 E4M3 with a power-of-two
    scale per 32 channels (512 + 16 = 528 B per slot);
  * the last few token ids (Engram's n-gram history).

Bytes per token are measured from the stored rows: Σ over kv sources of row bytes / ratio — 890
for the v41-flash shapes. Reads dequantize exactly to the model's fake-quant values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from dsv41.config import ModelConfig
from dsv41.kernels.ref.cache_write import CACHE_LAYOUTS, dequantize_rows, quantize_rows
from dsv41.plan import FULL, layer_plan

PAGE_ROWS = 256  # entries per page of the paged global-KV store


class RowPool:
    """Pages of uint8 rows shared by the sequences of one engine, so one kernel launch can read
    every sequence's rows through a page table. Grows by doubling; page ids stay valid."""

    def __init__(self, row_bytes: int, device: torch.device, page_rows: int = PAGE_ROWS):
        self.row_bytes, self.page_rows, self.device = row_bytes, page_rows, torch.device(device)
        self.data = torch.empty(0, page_rows, row_bytes, dtype=torch.uint8, device=self.device)  # (P, R, bytes)
        self._free: list[int] = []
        self._used = 0  # pages ever handed out (the rest of `data` is spare capacity)

    def alloc(self) -> int:
        if self._free:
            return self._free.pop()
        if self._used == self.data.size(0):
            grown = self.data.new_empty(max(4, 2 * self._used), self.page_rows, self.row_bytes)
            grown[:self._used] = self.data
            self.data = grown
        self._used += 1
        return self._used - 1

    def release(self, page_ids: list[int]) -> None:
        self._free.extend(page_ids)

    @property
    def rows(self) -> Tensor:
        """All rows as one (P·R, row_bytes) tensor (what the kernels index)."""
        return self.data.view(-1, self.row_bytes)


class PagedRows:
    """One sequence's append-only rows, stored in pages of a (possibly shared) `RowPool`."""

    def __init__(self, row_bytes: int, device: torch.device, page_rows: int = PAGE_ROWS, pool: RowPool | None = None):
        self.pool = pool if pool is not None else RowPool(row_bytes, device, page_rows)
        if self.pool.row_bytes != row_bytes:
            raise ValueError(f"PagedRows: pool rows are {self.pool.row_bytes} B, expected {row_bytes}")
        self.row_bytes, self.page_rows, self.device = row_bytes, self.pool.page_rows, self.pool.device
        self.page_ids: list[int] = []
        self.n_rows = 0
        self._table: Tensor | None = None

    def reserve(self, n: int) -> list[int]:
        """Claim the next n rows (allocating pages) and return their pool row ids (host ints: the
        engine gathers a whole batch's ids into one tensor)."""
        need = -(-(self.n_rows + n) // self.page_rows)
        while len(self.page_ids) < need:
            self.page_ids.append(self.pool.alloc())
            self._table = None
        first, R = self.n_rows, self.page_rows
        self.n_rows += n
        return [self.page_ids[i // R] * R + i % R for i in range(first, first + n)]

    def row_ids(self, index: Tensor) -> Tensor:
        """Pool row ids of logical rows `index` (any shape, all valid)."""
        return self.page_table().long()[index // self.page_rows] * self.page_rows + index % self.page_rows

    def append(self, rows: Tensor) -> None:
        """rows: (n, row_bytes) uint8."""
        if rows.size(0):
            ids = torch.tensor(self.reserve(rows.size(0)), device=self.device)  # may grow the pool
            self.pool.rows[ids] = rows.to(self.device)

    def read(self, start: int = 0, end: int | None = None) -> Tensor:
        """Rows [start, end) as one (n, row_bytes) tensor."""
        end = self.n_rows if end is None else end
        if end <= start:
            return torch.empty(0, self.row_bytes, dtype=torch.uint8, device=self.device)
        return self.gather(torch.arange(start, end, device=self.device))

    def gather(self, index: Tensor) -> Tensor:
        """Rows at arbitrary indices (any shape, all valid) → index.shape + (row_bytes,)."""
        return self.pool.rows[self.row_ids(index.reshape(-1))].view(*index.shape, self.row_bytes)

    def page_table(self) -> Tensor:
        """(n_pages,) int32 pool page ids, cached on the device until a page is added."""
        if self._table is None:
            self._table = torch.tensor(self.page_ids, dtype=torch.int32, device=self.device)
        return self._table

    def release(self) -> None:
        """Give the pages back to the pool (the rows are gone)."""
        self.pool.release(self.page_ids)
        self.page_ids, self.n_rows, self._table = [], 0, None


@dataclass
class EntryStore:
    """The packed compressed entries and index keys of one kv-source layer."""

    ratio: int
    head_dim: int
    index_head_dim: int
    device: torch.device
    kv_pool: RowPool | None = None  # shared pools (engine); private ones when None
    index_pool: RowPool | None = None
    kv: PagedRows = field(init=False)
    index_k: PagedRows = field(init=False)

    def __post_init__(self) -> None:
        self.kv_bytes = CACHE_LAYOUTS["kv_fp4"].row_bytes(self.head_dim)
        self.index_bytes = CACHE_LAYOUTS["index_fp4"].row_bytes(self.index_head_dim)
        self.kv = PagedRows(self.kv_bytes, self.device, pool=self.kv_pool)
        self.index_k = PagedRows(self.index_bytes, self.device, pool=self.index_pool)

    @property
    def n_entries(self) -> int:
        return self.kv.n_rows

    def append(self, entries: Tensor, index_keys: Tensor) -> None:
        """entries (n, head_dim), index_keys (n, index_head_dim) in float → packed rows."""
        self.kv.append(quantize_rows(entries, "kv_fp4"))
        self.index_k.append(quantize_rows(index_keys, "index_fp4"))

    def entries(self, index: Tensor | None = None) -> Tensor:
        rows = self.kv.read() if index is None else self.kv.gather(index)
        return dequantize_rows(rows, "kv_fp4", self.head_dim)

    def index_keys(self) -> Tensor:
        return dequantize_rows(self.index_k.read(), "index_fp4", self.index_head_dim)

    @property
    def bytes_per_entry(self) -> int:
        return self.kv.row_bytes + self.index_k.row_bytes

    def release(self) -> None:
        self.kv.release()
        self.index_k.release()


class RingPool:
    """Window rings of every layer for many sequences: rows (L, S, W, D + D/32) uint8 (E4M3 values,
    then E8M0 scales) and positions (L, S, W) (−1 = empty). A sequence owns one slot s in all
    layers, so one tensor of slot ids serves every layer's kernel call."""

    def __init__(self, n_layers: int, window: int, head_dim: int, device: torch.device):
        self.n_layers, self.window, self.head_dim = n_layers, window, head_dim
        self.row_bytes = CACHE_LAYOUTS["window_fp8"].row_bytes(head_dim)
        self.device = torch.device(device)
        self.rows = torch.empty(n_layers, 0, window, self.row_bytes, dtype=torch.uint8, device=self.device)
        self.positions = torch.empty(n_layers, 0, window, dtype=torch.long, device=self.device)
        self._free: list[int] = []
        self._used = 0

    def alloc(self) -> int:
        if self._free:
            slot = self._free.pop()
        else:
            if self._used == self.rows.size(1):
                n = max(2, 2 * self._used)
                rows = self.rows.new_zeros(self.n_layers, n, self.window, self.row_bytes)
                rows[:, :self._used] = self.rows
                positions = self.positions.new_full((self.n_layers, n, self.window), -1)
                positions[:, :self._used] = self.positions
                self.rows, self.positions = rows, positions
            slot, self._used = self._used, self._used + 1
        self.positions[:, slot] = -1
        return slot

    def release(self, slot: int) -> None:
        self._free.append(slot)


class WindowRing:
    """One layer's ring of one sequence: `window` slots of FP8 window KV; slot = position % window.
    A view into a `RingPool` (rows are re-read from the pool, which may grow)."""

    def __init__(self, window: int, head_dim: int, device: torch.device, pool: RingPool | None = None,
                 layer: int = 0, slot: int | None = None):
        self.window, self.head_dim = window, head_dim
        self.pool = pool if pool is not None else RingPool(1, window, head_dim, device)
        self.layer = layer
        self.slot = self.pool.alloc() if slot is None else slot

    @property
    def values(self) -> Tensor:
        return self.pool.rows[self.layer, self.slot, :, :self.head_dim]

    @property
    def scales(self) -> Tensor:
        return self.pool.rows[self.layer, self.slot, :, self.head_dim:]

    @property
    def positions(self) -> Tensor:
        return self.pool.positions[self.layer, self.slot]

    def write(self, kv: Tensor, positions: Tensor) -> None:
        """kv (n, head_dim) float at absolute positions (n,); only the last `window` matter."""
        kv, positions = kv[-self.window:], positions[-self.window:]
        slots = positions % self.window
        self.pool.rows[self.layer, self.slot, slots] = quantize_rows(kv, "window_fp8")
        self.positions[slots] = positions

    def read(self) -> tuple[Tensor, Tensor]:
        """(window, head_dim) float KV and (window,) positions (-1 = empty)."""
        return dequantize_rows(self.pool.rows[self.layer, self.slot], "window_fp8", self.head_dim), self.positions

    def clear(self) -> None:
        self.positions.fill_(-1)

    @property
    def slot_bytes(self) -> int:
        return self.pool.row_bytes

    def state(self) -> dict[str, Tensor]:
        """Copies of values, scales and positions (a snapshot that later writes do not change)."""
        return {"values": self.values.clone(), "scales": self.scales.clone(), "positions": self.positions.clone()}

    def load_state(self, state: dict[str, Tensor]) -> None:
        self.values.copy_(state["values"])
        self.scales.copy_(state["scales"])
        self.positions.copy_(state["positions"])


class CachePools:
    """The storage every sequence of one engine draws from (entry pages per kv source, ring slots)."""

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu"):
        c = config
        self.device = torch.device(device)
        self.plans = layer_plan(c)
        kv_bytes = CACHE_LAYOUTS["kv_fp4"].row_bytes(c.head_dim)
        index_bytes = CACHE_LAYOUTS["index_fp4"].row_bytes(c.index_head_dim)
        self.kv = {p.layer_id: RowPool(kv_bytes, self.device) for p in self.plans if p.mode == FULL}
        self.index = {p.layer_id: RowPool(index_bytes, self.device) for p in self.plans if p.mode == FULL}
        self.rings = RingPool(c.n_layers, c.window_size, c.head_dim, self.device)


class SequenceCache:
    """Everything one sequence needs to continue decoding. Sequences that run in one batch must
    share `pools` (an engine passes its own; a lone sequence gets private ones)."""

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu", pools: CachePools | None = None):
        self.config = c = config
        self.device = torch.device(device)
        self.pools = pools if pools is not None else CachePools(c, self.device)
        self.plans = layer_plan(c)
        self.entry_stores: dict[int, EntryStore] = {
            p.layer_id: EntryStore(p.ratio, c.head_dim, c.index_head_dim, self.device,
                                   self.pools.kv[p.layer_id], self.pools.index[p.layer_id])
            for p in self.plans if p.mode == FULL
        }
        self.ring_slot = self.pools.rings.alloc()
        self.windows = [WindowRing(c.window_size, c.head_dim, self.device, self.pools.rings, i, self.ring_slot)
                        for i in range(c.n_layers)]
        # compressor partial groups of m > 1 sources: fp32 projections / gate scores, oldest first
        self.pending: dict[int, tuple[Tensor, Tensor]] = {}
        self.tokens: list[int] = []  # every token id the caches cover (prompt + generated)
        self.persisted: tuple[int, bytes | None] = (0, None)  # prefix units stored: (end, key of the last)
        self.released = False

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    def bytes_per_token(self) -> float:
        """Global KV bytes per token measured from the stored row sizes: Σ row bytes / ratio."""
        return sum(s.bytes_per_entry / s.ratio for s in self.entry_stores.values())

    def global_kv_bytes(self) -> int:
        """Bytes of global KV actually held (used rows)."""
        return sum(s.n_entries * s.bytes_per_entry for s in self.entry_stores.values())

    def window_bytes(self) -> int:
        return sum(w.window * w.slot_bytes for w in self.windows)

    def clear_windows(self, layers: range | None = None) -> None:
        for i in layers if layers is not None else range(len(self.windows)):
            self.windows[i].clear()

    def release(self) -> None:
        """Return pages and the ring slot to the pools; the cache is unusable afterwards."""
        if not self.released:
            for store in self.entry_stores.values():
                store.release()
            self.pools.rings.release(self.ring_slot)
            self.released = True
