"""`BlockManager`: the fixed pools' budget, slots and page tables (docs/engine.md)."""

from __future__ import annotations

import pytest
import torch

from dsv41 import load_config
from dsv41.engine.block_manager import PAGE_ROWS, BlockManager, OutOfPages


@pytest.mark.parametrize("preset, slots, mib", [("tiny", 3, 4), ("small", 8, 64), ("small", 64, 512)])
def test_the_pools_sized_for_a_budget_fit_in_it_and_waste_less_than_two_pages_a_source(preset, slots, mib):
    """`tokens_for_budget` → `BlockManager(max_tokens=...)`: every pool it allocates (measured from the tensors:
    pages, rings and their positions, partial groups) fits the budget, and what is left is less than two pages
    per source and one token's bytes (the page tables, a few KiB, are not counted)."""
    c = load_config(preset)
    budget = mib * 2**20
    tokens = BlockManager.tokens_for_budget(c, budget, slots)
    assert tokens > 0
    pools = BlockManager(c, "cpu", max_slots=slots, max_tokens=tokens, max_seq_len=tokens)
    held = pools.allocated_bytes()
    used = held["global_kv"] + held["window_rings"] + held["partial_groups"]
    assert used <= budget
    page = sum(PAGE_ROWS * p.bytes_per_entry for p in pools.sources.values())
    assert budget - used < 2 * page + pools.bytes_per_token() + 1
    assert BlockManager.tokens_for_budget(c, 1, slots) == 0  # nothing fits: no tokens, not a negative count


def test_slots_are_freed_once_and_a_reused_slot_starts_empty():
    c = load_config("tiny")
    pools = BlockManager(c, "cpu", max_slots=2, max_tokens=512, max_seq_len=256)
    slot = pools.alloc_slot()
    pools.ring_positions[:, slot] = 7
    grouped = [p for p in pools.sources.values() if p.pending_kv is not None]
    assert grouped, "tiny has a compressed source with partial groups"
    for p in grouped:
        p.pending_kv[slot] = 1.5
        p.pending_score[slot] = -2.0
    pools.free_slot(slot)
    with pytest.raises(ValueError, match="not an allocated slot"):
        pools.free_slot(slot)  # a double free would hand the slot to two sequences
    with pytest.raises(ValueError, match="not an allocated slot"):
        pools.free_slot(pools.dummy_slot)
    assert pools.alloc_slot() == slot and bool((pools.ring_positions[:, slot] == -1).all())  # rings cleared
    assert all(not p.pending_kv[slot].any() and not p.pending_score[slot].any() for p in grouped)
    pools.alloc_slot()
    with pytest.raises(OutOfPages, match="slots"):
        pools.alloc_slot()


def test_a_page_table_row_holds_exactly_the_pages_given():
    """A row written shorter than before keeps none of the old ids; a row longer than the table is OutOfPages
    (the scheduler's signal), not an indexing error."""
    c = load_config("tiny")
    pools = BlockManager(c, "cpu", max_slots=2, max_tokens=4096, max_seq_len=2048, page_rows=16)
    s, p = next(iter(pools.sources.items()))
    width = p.table_host.size(1)
    pools.set_table(s, 1, [5, 9, 3])
    pools.set_table(s, 1, [4])
    assert p.table_host[1].tolist() == [4] + [0] * (width - 1)
    pools.sync_tables()
    assert torch.equal(p.table[1], p.table_host[1])
    pools.set_table(s, 0, list(range(width)))  # a full row is fine
    with pytest.raises(OutOfPages, match="page table"):
        pools.set_table(s, 0, list(range(width + 1)))


def test_pages_come_in_bulk_in_the_free_lists_order_and_all_or_none():
    """`alloc_pages(n)` hands out the free list's next n pages (0, 1, … on a new pool; pages freed since come first,
    in the order they were freed); more than are free is OutOfPages with the pool unchanged."""
    c = load_config("tiny")
    pools = BlockManager(c, "cpu", max_slots=2, max_tokens=4096, max_seq_len=2048, page_rows=16)
    s = next(iter(pools.sources))
    assert pools.alloc_pages(s, 5) == [0, 1, 2, 3, 4] and pools.alloc_pages(s, 0) == []
    pools.free_page_ids(s, [3, 1])
    assert pools.alloc_pages(s, 3) == [3, 1, 5]
    left = pools.free_pages(s)
    with pytest.raises(OutOfPages, match="no free page"):
        pools.alloc_pages(s, left + 1)
    assert pools.free_pages(s) == left and pools.alloc_pages(s, left) == list(range(6, 6 + left))
