"""Block manager: every cache pool of one engine, allocated once at start-up and never reallocated.

What lives here (SPEC §1a, §4; nano-vllm's `block_manager.py`, vLLM's KV-cache manager):
  * for each kv-source (Full) layer, a pool of **pages**: `page_rows` packed FP4 main-KV rows
    (D/2 + D/16 bytes) and, under the *same page id*, `page_rows` packed FP4 index-key rows
    (Di/2 + Di/32 bytes). A sequence's entries of that source live in its pages, in order;
  * a **page table** per source: one row per slot, the page ids of that slot's sequence, kept on
    the device (what the kernels read, gathered by slot inside a CUDA graph) with a host mirror
    that is copied over in one transfer when it changed;
  * **slots**: a running sequence owns one slot id in every slot-indexed pool — the FP8 window
    rings of every layer (L, S, W, D + D/32) with their positions, and the compressor's partial
    group of every ratio-m source (fp32 projections and gate scores of up to m − 1 tokens);
  * one extra **dummy slot** (id `dummy_slot`) that padded rows of a fixed-size decode batch read
    and write, so a captured batch never touches a real sequence.

Capacity is counted in pages and slots on the host (`pages_needed`, `alloc_pages`, `alloc_slot`,
`free_page_ids`, `free_slot`; the engine's scheduler plans with them): no allocation ever happens on
the device after start-up, so the memory a server holds is known up
front and `bytes_per_token()` is measured from the pools themselves.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from dsv41.config import ModelConfig
from dsv41.kernels.ref.cache_write import CACHE_LAYOUTS
from dsv41.plan import FULL, layer_plan

PAGE_ROWS = 256  # entries per page of the paged global-KV pools


def to_device(data, device: torch.device, dtype: torch.dtype = torch.long) -> Tensor:
    """A host list (or nested lists) as a device tensor without a stream sync: on CUDA a pinned host tensor
    copied non-blocking (the caching host allocator keeps its block until the copy is done), so the host
    never waits for the GPU work queued before it — `torch.tensor(data, device=cuda)` synchronizes the stream.
    The host-driven steps (prefill pieces) use it, so a piece's host work overlaps the decode step queued
    before it on the device."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(data, dtype=dtype, device=device)
    return torch.tensor(data, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


class OutOfPages(RuntimeError):
    """The fixed pools have no free page or slot left (the scheduler preempts or waits)."""


@dataclass(frozen=True)
class SourcePool:
    """The pools of one kv-source layer."""

    layer_id: int
    ratio: int
    kv: Tensor  # (P, page_rows, kv_bytes) uint8
    index: Tensor  # (P, page_rows, index_bytes) uint8
    table: Tensor  # (S + 1, max_pages) int32 on the device: page ids of each slot's sequence
    table_host: Tensor  # the same on the host; the source of every update
    pending_kv: Tensor | None  # (S + 1, m − 1, D) fp32 partial group of each slot (ratio > 1)
    pending_score: Tensor | None

    @property
    def kv_rows(self) -> Tensor:
        """All main-KV rows as one (P·R, bytes) tensor (what the kernels index)."""
        return self.kv.view(-1, self.kv.size(-1))

    @property
    def index_rows(self) -> Tensor:
        return self.index.view(-1, self.index.size(-1))

    @functools.cached_property
    def page_rows(self) -> int:  # a plain int after the first read: the decode step's host side asks per row
        return self.kv.size(1)

    @property
    def n_pages(self) -> int:
        return self.kv.size(0)

    @property
    def bytes_per_entry(self) -> int:
        return self.kv.size(-1) + self.index.size(-1)


def pages_for(n_entries: int, page_rows: int = PAGE_ROWS) -> int:
    return -(-n_entries // page_rows)


class BlockManager:
    """Fixed pools for up to `max_slots` sequences holding `max_tokens` tokens in total.

    `max_tokens` sizes the global-KV pages of every source (entries = tokens / ratio, rounded up
    per sequence); `max_seq_len` bounds one sequence (page-table width). Slot `dummy_slot` is the
    padding slot of captured decode batches."""

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu", *, max_slots: int = 64,
                 max_tokens: int | None = None, max_seq_len: int | None = None, page_rows: int = PAGE_ROWS):
        c = config
        if max_slots < 1:
            raise ValueError(f"BlockManager: max_slots must be >= 1, got {max_slots}")
        self.config = c
        self.device = torch.device(device)
        self.max_slots, self.page_rows = max_slots, page_rows
        self.max_seq_len = int(max_seq_len or c.max_seq_len)
        self.max_tokens = int(max_tokens or self.max_seq_len * max_slots)
        if self.max_seq_len < 1 or self.max_tokens < 1:
            raise ValueError("BlockManager: max_seq_len and max_tokens must be positive")
        self.dummy_slot = max_slots
        S = max_slots + 1
        pin = self.device.type == "cuda"
        kv_bytes = CACHE_LAYOUTS["kv_fp4"].row_bytes(c.head_dim)
        index_bytes = CACHE_LAYOUTS["index_fp4"].row_bytes(c.index_head_dim)
        self.sources: dict[int, SourcePool] = {}
        self._free_pages: dict[int, list[int]] = {}
        for p in layer_plan(c):
            if p.mode != FULL:
                continue
            m = p.ratio
            # every sequence may waste up to one page per source to rounding
            n_pages = pages_for(-(-self.max_tokens // m), page_rows) + max_slots
            width = pages_for(-(-self.max_seq_len // m), page_rows)
            table_host = torch.zeros(S, width, dtype=torch.int32)
            pend_shape = (S, m - 1, c.head_dim)
            self.sources[p.layer_id] = SourcePool(
                p.layer_id, m,
                kv=torch.zeros(n_pages, page_rows, kv_bytes, dtype=torch.uint8, device=self.device),
                index=torch.zeros(n_pages, page_rows, index_bytes, dtype=torch.uint8, device=self.device),
                table=torch.zeros(S, width, dtype=torch.int32, device=self.device),
                table_host=table_host,
                pending_kv=torch.zeros(pend_shape, device=self.device) if m > 1 else None,
                pending_score=torch.zeros(pend_shape, device=self.device) if m > 1 else None)
            self._free_pages[p.layer_id] = list(range(n_pages - 1, -1, -1))  # pop() hands out 0, 1, …
        self._tables_np = {s: p.table_host.numpy() for s, p in self.sources.items()}  # `set_table` writes these
        self.window = c.window_size
        self.ring_bytes = CACHE_LAYOUTS["window_fp8"].row_bytes(c.head_dim)
        # zeros: a padded row that reads the dummy ring sees finite (zero) keys
        self.ring_rows = torch.zeros(c.n_layers, S, self.window, self.ring_bytes, dtype=torch.uint8,
                                     device=self.device)  # (L, S, W, bytes)
        self.ring_positions = torch.full((c.n_layers, S, self.window), -1, dtype=torch.long,
                                         device=self.device)  # (L, S, W), −1 = empty
        self._free_slots = list(range(max_slots - 1, -1, -1))
        self._tables_dirty = False
        # two pinned staging copies of the page tables for asynchronous transfers (CUDA only)
        self._stages = [{s: torch.empty_like(p.table_host, pin_memory=True) for s, p in self.sources.items()}
                        for _ in range(2)] if pin else []
        self._stage_events: list[torch.cuda.Event | None] = [None, None]
        self._stage_next = 0

    # ------------------------------------------------------------------ capacity (host only)
    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    def free_pages(self, layer_id: int) -> int:
        return len(self._free_pages[layer_id])

    def pages_needed(self, n_tokens: int, have: dict[int, int] | None = None) -> dict[int, int]:
        """New pages per source for a sequence to hold n_tokens, given the pages it `have`s."""
        have = have or {}
        return {s: max(0, pages_for(n_tokens // p.ratio, self.page_rows) - have.get(s, 0))
                for s, p in self.sources.items()}

    # ------------------------------------------------------------------ slots and pages
    def alloc_slot(self) -> int:
        if not self._free_slots:
            raise OutOfPages(f"all {self.max_slots} sequence slots are in use")
        return self._free_slots.pop()  # clean: cleared when it was freed (or never used)

    def clear_slot(self, slot: int) -> None:
        """A slot's window rings empty and its compressor's partial groups zero, as a new sequence finds them.
        Run when the slot is freed, not when it is taken: the device ops are queued behind the finished work
        instead of in front of the next prompt's first launch (~0.1 ms of host time on the H100 box)."""
        self.ring_positions[:, slot] = -1
        for p in self.sources.values():
            if p.pending_kv is not None:
                p.pending_kv[slot].zero_()
                p.pending_score[slot].zero_()

    def free_slot(self, slot: int) -> None:
        if slot == self.dummy_slot or not 0 <= slot < self.max_slots or slot in self._free_slots:
            raise ValueError(f"BlockManager.free_slot: slot {slot} is not an allocated slot")
        self.clear_slot(slot)
        self._free_slots.append(slot)

    def alloc_pages(self, layer_id: int, n: int) -> list[int]:
        """n pages of a source's pool, in the order n `pop`s of the free list would give (one slice: a prefill
        piece takes tens of pages at once). All or none: OutOfPages leaves the pool as it was."""
        free = self._free_pages[layer_id]
        if n > len(free):
            raise OutOfPages(f"no free page left in the pool of kv source {layer_id} "
                             f"({self.sources[layer_id].n_pages} pages of {self.page_rows} entries)")
        if n <= 0:
            return []
        pages = free[-n:]
        del free[-n:]
        pages.reverse()
        return pages

    def free_page_ids(self, layer_id: int, page_ids: list[int]) -> None:
        self._free_pages[layer_id].extend(reversed(page_ids))

    def set_table(self, layer_id: int, slot: int, page_ids: list[int]) -> None:
        """Write a slot's page-table row (host mirror; `sync_tables` sends it)."""
        p = self.sources[layer_id]
        if len(page_ids) > p.table_host.size(1):
            raise OutOfPages(f"kv source {layer_id}: a sequence needs {len(page_ids)} pages, the page table "
                             f"holds {p.table_host.size(1)} (max_seq_len={self.max_seq_len})")
        row = self._tables_np[layer_id][slot]  # a numpy view of the host mirror: no torch op per write
        row[:len(page_ids)] = page_ids
        row[len(page_ids):] = 0
        self._tables_dirty = True

    def sync_tables(self) -> None:
        """Copy the page tables to the device if any changed. On CUDA the host mirror is first
        copied into one of two pinned staging buffers, so the asynchronous transfer never reads a
        mirror the host goes on changing (each staging buffer waits for its previous transfer)."""
        if not self._tables_dirty:
            return
        self._tables_dirty = False
        if self.device.type != "cuda":
            for p in self.sources.values():
                p.table.copy_(p.table_host)
            return
        k = self._stage_next
        self._stage_next = 1 - k
        done = self._stage_events[k]
        if done is not None:
            done.synchronize()
        for layer_id, p in self.sources.items():
            stage = self._stages[k][layer_id]
            stage.copy_(p.table_host)
            p.table.copy_(stage, non_blocking=True)
        self._stage_events[k] = torch.cuda.Event()
        self._stage_events[k].record()

    # ------------------------------------------------------------------ accounting
    def bytes_per_token(self) -> float:
        """Global-KV bytes per token measured from the pools' row widths: Σ_sources bytes / ratio."""
        return sum(p.bytes_per_entry / p.ratio for p in self.sources.values())

    def allocated_bytes(self) -> dict[str, int]:
        """Device bytes held by each kind of pool."""
        nbytes = lambda t: 0 if t is None else t.numel() * t.element_size()
        return {
            "global_kv": sum(nbytes(p.kv) + nbytes(p.index) for p in self.sources.values()),
            "page_tables": sum(nbytes(p.table) for p in self.sources.values()),
            "partial_groups": sum(nbytes(p.pending_kv) + nbytes(p.pending_score) for p in self.sources.values()),
            "window_rings": nbytes(self.ring_rows) + nbytes(self.ring_positions),
        }

    @staticmethod
    def tokens_for_budget(config: ModelConfig, budget_bytes: int, max_slots: int, page_rows: int = PAGE_ROWS) -> int:
        """The most cached tokens (`max_tokens`) whose pools fit in budget_bytes: the slot-indexed pools (window
        rings and their positions, the partial groups of ratio-m sources) and, per source, the pages — those the
        tokens fill plus the one page per slot and the one page of rounding that `__init__` adds. (The page tables,
        a few KiB, are not counted.)"""
        c = config
        S = max_slots + 1
        fixed = c.n_layers * S * c.window_size * (CACHE_LAYOUTS["window_fp8"].row_bytes(c.head_dim) + 8)
        entry = CACHE_LAYOUTS["kv_fp4"].row_bytes(c.head_dim) + CACHE_LAYOUTS["index_fp4"].row_bytes(c.index_head_dim)
        per_token = 0.0
        for p in layer_plan(c):
            if p.mode != FULL:
                continue
            fixed += S * page_rows * entry  # a page per slot of rounding, one more for the total's
            if p.ratio > 1:
                fixed += 2 * S * (p.ratio - 1) * c.head_dim * 4  # partial groups: fp32 projections and scores
            per_token += entry / p.ratio
        left = budget_bytes - fixed
        return max(0, math.floor(left / per_token)) if per_token else 0
