"""One sequence's view of the engine's fixed pools, in the report's storage formats.

What one sequence keeps (SPEC §1a, §4), all inside the `BlockManager`'s pools:
  * for each kv-source (Full) layer, its compressed entries — main KV as FP4 E2M1 with an E4M3
    scale per 16 channels (256 + 32 = 288 B for 512 dims) and index keys as FP4 with an E8M0
    scale per 32 (64 + 4 = 68 B for 128 dims) — in pages it takes from the source's pool as it
    grows (one page id holds `page_rows` main-KV rows and the same number of index-key rows);
  * one slot: its FP8 window ring in every layer (E4M3 with a power-of-two scale per 32 channels,
    512 + 16 = 528 B per slot) and the compressor's partial group of every ratio-m source;
  * the token ids the caches cover (Engram's n-gram history, prefix keys).

`SequenceCache` is a view: page ids, row counts and the slot id are host bookkeeping; the bytes
are in the pools. Bytes per token are measured from the pools' rows: Σ over kv sources of row
bytes / ratio — 890 for the v41-flash shapes. Reads dequantize exactly to the model's fake-quant.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping

import numpy as np
import torch
from torch import Tensor

from dsv41.config import ModelConfig
from dsv41.engine.block_manager import PAGE_ROWS, BlockManager, OutOfPages, SourcePool, pages_for, to_device
from dsv41.kernels.ref.cache_write import dequantize_rows, quantize_rows

__all__ = ["PAGE_ROWS", "BlockManager", "OutOfPages", "SequenceCache", "private_pools"]

PRIVATE_MAX_TOKENS = 8192  # a lone SequenceCache (tests, tools) gets pools for this many tokens
FEW_ROWS = 64  # up to this many rows reserved at once, a Python list beats numpy's call overhead (a decode step's)


def private_pools(config: ModelConfig, device: torch.device | str = "cpu", max_tokens: int | None = None,
                  max_slots: int = 1) -> BlockManager:
    """Small pools for sequences used outside an engine."""
    n = max_tokens or min(config.max_seq_len, PRIVATE_MAX_TOKENS)
    return BlockManager(config, device, max_slots=max_slots, max_tokens=n * max_slots, max_seq_len=n)


class PagedRows:
    """One sequence's append-only rows of one pool kind ("kv" or "index") of one kv source. The
    page list is shared with the other kind of the same source (one page id holds both)."""

    def __init__(self, cache: SequenceCache, layer_id: int, kind: str):
        self.cache, self.layer_id, self.kind = cache, layer_id, kind
        self.n_rows = 0

    @property
    def source(self) -> SourcePool:
        return self.cache.pools.sources[self.layer_id]

    @property
    def rows(self) -> Tensor:
        """The whole pool as (P·R, bytes) rows."""
        return self.source.kv_rows if self.kind == "kv" else self.source.index_rows

    @property
    def row_bytes(self) -> int:
        return self.rows.size(1)

    @property
    def page_rows(self) -> int:
        return self.source.page_rows

    @property
    def page_ids(self) -> list[int]:
        return self.cache.pages[self.layer_id]

    def reserve(self, n: int) -> list[int]:
        """Claim the next n rows (taking pages as needed) and return their pool row ids."""
        first = self.n_rows
        self.cache.ensure_pages(self.layer_id, first + n)
        self.n_rows += n
        R, pages = self.page_rows, self.page_ids
        if n <= FEW_ROWS:
            return [pages[i // R] * R + i % R for i in range(first, first + n)]
        return self._ids(first, n).tolist()

    def reserve_array(self, n: int) -> np.ndarray:
        """`reserve` as an int64 array (a prefill piece's thousands of rows: no Python list between)."""
        first = self.n_rows
        self.cache.ensure_pages(self.layer_id, first + n)
        self.n_rows += n
        return self._ids(first, n)

    def _ids(self, first: int, n: int) -> np.ndarray:
        """Pool row ids of logical rows [first, first + n): the rows of the pages they fall in, in order — one
        broadcast over the pages touched (a gather per row took ~2× as long at 8K rows)."""
        if n <= 0:
            return np.zeros(0, dtype=np.int64)
        R = self.page_rows
        lo, hi = first // R, (first + n - 1) // R + 1
        pages = np.asarray(self.page_ids[lo:hi], dtype=np.int64)
        rows = (pages[:, None] * R + np.arange(R, dtype=np.int64)).ravel()  # every row of those pages
        start = first - lo * R
        return rows[start:start + n]

    def reserve_ids(self, n: int) -> Tensor:
        """`reserve` for many rows at once: the pool row ids as a device tensor (n,) int64."""
        first = self.n_rows
        self.cache.ensure_pages(self.layer_id, first + n)
        self.n_rows += n
        return self.row_ids(torch.arange(first, first + n, device=self.rows.device))

    def row_ids(self, index: Tensor) -> Tensor:
        """Pool row ids of logical rows `index` (any shape, all valid)."""
        table = to_device(self.page_ids, index.device)
        return table[index // self.page_rows] * self.page_rows + index % self.page_rows

    def append(self, rows: Tensor) -> None:
        """rows: (n, row_bytes) uint8."""
        if rows.size(0):
            ids = torch.tensor(self.reserve(rows.size(0)), device=self.rows.device)
            self.rows[ids] = rows.to(self.rows.device)

    def read(self, start: int = 0, end: int | None = None) -> Tensor:
        """Rows [start, end) as one (n, row_bytes) tensor."""
        end = self.n_rows if end is None else end
        if end <= start:
            return torch.empty(0, self.row_bytes, dtype=torch.uint8, device=self.rows.device)
        return self.gather(torch.arange(start, end, device=self.rows.device))

    def gather(self, index: Tensor) -> Tensor:
        """Rows at arbitrary indices (any shape, all valid) → index.shape + (row_bytes,)."""
        return self.rows[self.row_ids(index.reshape(-1))].view(*index.shape, self.row_bytes)


class EntryStore:
    """The packed compressed entries and index keys of one kv-source layer of one sequence."""

    def __init__(self, cache: SequenceCache, layer_id: int):
        c = cache.config
        self.layer_id = layer_id
        self.ratio = cache.pools.sources[layer_id].ratio
        self.head_dim, self.index_head_dim = c.head_dim, c.index_head_dim
        self.kv = PagedRows(cache, layer_id, "kv")
        self.index_k = PagedRows(cache, layer_id, "index")

    @property
    def n_entries(self) -> int:
        return self.kv.n_rows

    def reserve(self, n: int) -> list[int]:
        """Rows for n new entries in both pools (the same ids: one page id holds both kinds)."""
        if self.kv.n_rows != self.index_k.n_rows:
            raise RuntimeError(f"kv source {self.layer_id}: {self.kv.n_rows} entries but "
                               f"{self.index_k.n_rows} index keys")
        self.index_k.reserve(n)
        return self.kv.reserve(n)

    def reserve_array(self, n: int) -> np.ndarray:
        """`reserve` as an int64 array; the index keys' rows are the same ids (computed once)."""
        if self.kv.n_rows != self.index_k.n_rows:
            raise RuntimeError(f"kv source {self.layer_id}: {self.kv.n_rows} entries but "
                               f"{self.index_k.n_rows} index keys")
        ids = self.kv.reserve_array(n)
        self.index_k.n_rows += n  # the pages are shared: kv's reserve took them for both kinds
        return ids

    def reserve_ids(self, n: int) -> Tensor:
        """`reserve` as a device tensor (n,) int64 (prefill chunks: no Python list of row ids)."""
        if self.kv.n_rows != self.index_k.n_rows:
            raise RuntimeError(f"kv source {self.layer_id}: {self.kv.n_rows} entries but "
                               f"{self.index_k.n_rows} index keys")
        self.index_k.n_rows += n
        try:
            return self.kv.reserve_ids(n)
        except OutOfPages:
            self.index_k.n_rows -= n
            raise

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


class WindowRing:
    """One layer's ring of one sequence: `window` slots of FP8 window KV; slot = position % window."""

    def __init__(self, cache: SequenceCache, layer: int):
        self.cache, self.layer = cache, layer
        self.window, self.head_dim = cache.config.window_size, cache.config.head_dim

    @property
    def _rows(self) -> Tensor:
        return self.cache.pools.ring_rows[self.layer, self.cache.slot]  # (W, bytes)

    @property
    def values(self) -> Tensor:
        return self._rows[:, :self.head_dim]

    @property
    def scales(self) -> Tensor:
        return self._rows[:, self.head_dim:]

    @property
    def positions(self) -> Tensor:
        return self.cache.pools.ring_positions[self.layer, self.cache.slot]

    def write(self, kv: Tensor, positions: Tensor) -> None:
        """kv (n, head_dim) float at absolute positions (n,); only the last `window` matter."""
        kv, positions = kv[-self.window:], positions[-self.window:]
        slots = positions % self.window
        self._rows[slots] = quantize_rows(kv, "window_fp8")
        self.positions[slots] = positions

    def read(self) -> tuple[Tensor, Tensor]:
        """(window, head_dim) float KV and (window,) positions (-1 = empty)."""
        return dequantize_rows(self._rows, "window_fp8", self.head_dim), self.positions

    def clear(self) -> None:
        self.positions.fill_(-1)

    @property
    def slot_bytes(self) -> int:
        return self.cache.pools.ring_bytes

    def state(self) -> dict[str, Tensor]:
        """Copies of values, scales and positions (a snapshot that later writes do not change)."""
        return {"values": self.values.clone(), "scales": self.scales.clone(), "positions": self.positions.clone()}

    def load_state(self, state: dict[str, Tensor]) -> None:
        self.values.copy_(state["values"])
        self.scales.copy_(state["scales"])
        self.positions.copy_(state["positions"])


class PendingGroups(MutableMapping):
    """layer_id → (kv, score) fp32 (r, D) of the tokens of a ratio-m source's unfinished group,
    oldest first, r = n_tokens % m. Stored in the slot's rows of the source's partial-group pool
    (the runner writes them there on the device; this view reads and restores them)."""

    def __init__(self, cache: SequenceCache):
        self.cache = cache

    def _pool(self, layer_id: int) -> SourcePool:
        p = self.cache.pools.sources.get(layer_id)
        if p is None or p.pending_kv is None:
            raise KeyError(layer_id)
        return p

    def __getitem__(self, layer_id: int) -> tuple[Tensor, Tensor]:
        p = self._pool(layer_id)
        r = self.cache.n_tokens % p.ratio
        if not r:
            raise KeyError(layer_id)
        s = self.cache.slot
        return p.pending_kv[s, :r], p.pending_score[s, :r]

    def __setitem__(self, layer_id: int, value: tuple[Tensor, Tensor]) -> None:
        """Restore a partial group (the sequence's token count must end up ≡ r mod m)."""
        kv, score = value
        p, s = self._pool(layer_id), self.cache.slot
        r = kv.size(0)
        if r >= p.ratio or score.shape != kv.shape:
            raise ValueError(f"partial group of source {layer_id}: {r} rows for ratio {p.ratio}")
        p.pending_kv[s, :r] = kv.to(p.pending_kv.device)
        p.pending_score[s, :r] = score.to(p.pending_score.device)

    def __delitem__(self, layer_id: int) -> None:
        raise TypeError("a partial group ends when its group completes; it cannot be deleted")

    def _live(self) -> list[int]:
        return [s for s, p in self.cache.pools.sources.items()
                if p.pending_kv is not None and self.cache.n_tokens % p.ratio]

    def __iter__(self) -> Iterator[int]:
        return iter(self._live())

    def __len__(self) -> int:
        return len(self._live())


class SequenceCache:
    """Everything one sequence needs to continue decoding, as a view of shared pools. Sequences
    that run in one batch must share `pools` (an engine passes its own; a lone sequence gets
    small private ones)."""

    def __init__(self, config: ModelConfig, device: torch.device | str | None = None,
                 pools: BlockManager | None = None):
        self.config = config
        if pools is None:
            pools = private_pools(config, device or "cpu")
        self.pools = pools
        self.device = pools.device
        self.slot = pools.alloc_slot()
        self.pages: dict[int, list[int]] = {s: [] for s in pools.sources}
        self.entry_stores: dict[int, EntryStore] = {s: EntryStore(self, s) for s in pools.sources}
        self.windows = [WindowRing(self, i) for i in range(config.n_layers)]
        self.pending = PendingGroups(self)
        self.tokens: list[int] = []  # every token id the caches cover (prompt + generated)
        self.persisted: tuple[int, bytes | None] = (0, None)  # prefix units stored: (end, key of the last)
        self.released = False

    # ------------------------------------------------------------------ pages
    def ensure_pages(self, layer_id: int, n_rows: int) -> None:
        """Take pages from the pool until rows [0, n_rows) of `layer_id` have a home."""
        pages = self.pages[layer_id]
        need = pages_for(n_rows, self.pools.page_rows)
        if need <= len(pages):
            return
        added = self.pools.alloc_pages(layer_id, need - len(pages))
        try:
            self.pools.set_table(layer_id, self.slot, pages + added)
        except OutOfPages:
            self.pools.free_page_ids(layer_id, added)
            raise
        pages.extend(added)

    def pages_held(self) -> dict[int, int]:
        return {s: len(p) for s, p in self.pages.items()}

    def page_limit(self) -> int:
        """The smallest token count the pages held cannot cover: a source of ratio m holding P pages of
        R rows covers P·R entries, i.e. fewer than (P·R + 1)·m tokens."""
        R, sources = self.pools.page_rows, self.pools.sources
        return min(((len(p) * R + 1) * sources[s].ratio for s, p in self.pages.items()), default=1 << 62)

    # ------------------------------------------------------------------ sizes
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

    def truncate(self, n_tokens: int) -> None:
        """Forget every token from `n_tokens` on (a speculative rollback, `engine/speculative.py`): the
        token ids, the entries and index keys of the groups they completed (write-then-truncate: entries
        are append-only, so dropping the row counts is the whole undo) and the pages no longer needed.
        Windows and partial groups are the caller's (`VerifyRollback` restores them from its snapshot)."""
        if not 0 <= n_tokens <= self.n_tokens:
            raise ValueError(f"truncate to {n_tokens} tokens: the cache holds {self.n_tokens}")
        del self.tokens[n_tokens:]
        R = self.pools.page_rows
        for s, store in self.entry_stores.items():
            n_entries = n_tokens // store.ratio
            store.kv.n_rows = store.index_k.n_rows = min(store.kv.n_rows, n_entries)
            pages = self.pages[s]
            need = pages_for(store.kv.n_rows, R)
            if len(pages) > need:
                self.pools.free_page_ids(s, pages[need:])
                del pages[need:]
                self.pools.set_table(s, self.slot, pages)

    # ------------------------------------------------------------------ preemption (swap)
    def swap_out(self) -> dict[str, Tensor]:
        """Copy everything the pools hold for this sequence to the host and release the pools
        (bit-exact: `swap_in` restores the same bytes)."""
        # copies, also on the CPU (where .cpu() would return views of the slot's rows: the slot's next
        # owner would overwrite the swapped-out state)
        state: dict[str, Tensor] = {
            "ring_rows": self.pools.ring_rows[:, self.slot].to("cpu", copy=True),
            "ring_positions": self.pools.ring_positions[:, self.slot].to("cpu", copy=True),
        }
        for s, store in self.entry_stores.items():
            state[f"{s}.kv"] = store.kv.read().cpu()
            state[f"{s}.index_k"] = store.index_k.read().cpu()
            p = self.pools.sources[s]
            if p.pending_kv is not None:
                state[f"{s}.pending_kv"] = p.pending_kv[self.slot].to("cpu", copy=True)
                state[f"{s}.pending_score"] = p.pending_score[self.slot].to("cpu", copy=True)
        self.release()
        return state

    def swap_in(self, state: dict[str, Tensor]) -> None:
        """Take a slot and pages again and restore a `swap_out` state."""
        if not self.released:
            raise RuntimeError("swap_in: the cache still holds its pools")
        self.slot = self.pools.alloc_slot()
        self.released = False
        self.pages = {s: [] for s in self.pools.sources}
        try:
            for s, store in self.entry_stores.items():
                store.kv.n_rows = store.index_k.n_rows = 0
                store.kv.append(state[f"{s}.kv"])
                store.index_k.append(state[f"{s}.index_k"])
                p = self.pools.sources[s]
                if p.pending_kv is not None:
                    p.pending_kv[self.slot] = state[f"{s}.pending_kv"].to(self.device)
                    p.pending_score[self.slot] = state[f"{s}.pending_score"].to(self.device)
        except OutOfPages:
            self.release()
            raise
        self.pools.ring_rows[:, self.slot] = state["ring_rows"].to(self.device)
        self.pools.ring_positions[:, self.slot] = state["ring_positions"].to(self.device)

    def release(self) -> None:
        """Return pages and the slot to the pools; the cache is unusable until `swap_in`."""
        if not self.released:
            for s, pages in self.pages.items():
                self.pools.free_page_ids(s, pages)
                self.pools.set_table(s, self.slot, [])
            self.pages = {s: [] for s in self.pools.sources}
            self.pools.free_slot(self.slot)
            self.released = True
