"""Synthetic long contexts: caches filled with random rows in the real formats, without a prefill.

Benchmarks of decode at 32K–128K tokens × 64 sequences would spend most of their time (and device
budget) prefilling. `fill_synthetic` makes a sequence's cache look as if `n` tokens had been
prefilled: every kv source's packed FP4 entries and index keys, the windows' FP8 rows with their
positions and the compressors' partial groups are random values written by the engine's own
quantizing op (`ops.rope_quantize`), so the decode step reads and attends over valid rows of the
right sizes. The outputs mean nothing; the work per step is the real work at that context.
"""

from __future__ import annotations

import torch

from dsv41.engine.cache import SequenceCache
from dsv41.engine.engine import Engine
from dsv41.engine.sampling import SamplingParams
from dsv41.engine.sequence import Sequence, SequenceStatus
from dsv41.kernels import ops


def fill_synthetic(cache: SequenceCache, n: int, generator: torch.Generator) -> None:
    """Make `cache` hold a context of n tokens: random entries / index keys / windows written in
    the cache formats by the engine's quantizing op (no prefill)."""
    c, pools, device = cache.config, cache.pools, cache.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def rows_of(store_rows, n_rows: int) -> torch.Tensor:
        first = store_rows.n_rows
        cache.ensure_pages(store_rows.layer_id, first + n_rows)
        store_rows.n_rows += n_rows
        i = torch.arange(first, first + n_rows, device=device)
        pages = torch.tensor(cache.pages[store_rows.layer_id], device=device)
        return pages[i // pools.page_rows] * pools.page_rows + i % pools.page_rows

    for s, store in cache.entry_stores.items():
        m = store.ratio
        n_e = n // m
        for rows, fmt, dim in ((store.kv, "kv_fp4", c.head_dim), (store.index_k, "index_fp4", c.index_head_dim)):
            ids = rows_of(rows, n_e)
            for lo in range(0, n_e, 1 << 16):
                part = ids[lo:lo + (1 << 16)]
                x = torch.randn(1, part.numel(), dim, device=device, generator=generator).to(dtype)
                one = torch.ones(1, part.numel(), c.rope_head_dim // 2, device=device)
                ops.rope_quantize(x, one, one * 0, fmt, rows.rows, part[None])
        p = pools.sources[s]
        if p.pending_kv is not None:
            p.pending_kv[cache.slot].normal_(generator=generator)
            p.pending_score[cache.slot].normal_(generator=generator)
    W = c.window_size
    pos = torch.arange(max(0, n - W), n, device=device)
    ring_rows = pools.ring_rows.view(c.n_layers, -1, pools.ring_bytes)
    for layer in range(c.n_layers):
        x = torch.randn(1, pos.numel(), c.head_dim, device=device, generator=generator).to(dtype)
        one = torch.ones(1, pos.numel(), c.rope_head_dim // 2, device=device)
        ops.rope_quantize(x, one, one * 0, "window_fp8", ring_rows[layer], (cache.slot * W + pos % W)[None])
        pools.ring_positions[layer, cache.slot, pos % W] = pos
    cache.tokens = torch.randint(3, c.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()


def synthetic_running(engine: Engine, batch: int, context: int, seed: int = 0) -> list[Sequence]:
    """`batch` sequences of `context` synthetic tokens, running (decoding) in `engine`."""
    g = torch.Generator(device=engine.device).manual_seed(seed)
    seqs = []
    for b in range(batch):
        seq = Sequence(-1 - b, [1], SamplingParams(max_tokens=10**9))
        seq.cache = SequenceCache(engine.config, pools=engine.pools)
        fill_synthetic(seq.cache, context, g)
        seq.next_token = 5 + b
        seq.status = SequenceStatus.RUNNING
        engine.scheduler.running.append(seq)
        seqs.append(seq)
    engine.pools.sync_tables()
    return seqs
