"""Torch twins of the lightning-indexer kernels (SPEC §3): scores over paged FP4 keys, top-k.

score[b, t, e] = Σ_h w[b, t, h] · relu(q[b, t, h] · key_e): the keys are pool rows of Di/2 packed
E2M1 bytes + Di/32 E8M0 scale bytes, found through the page table, dequantized with
`quant.fp4.dequantize_fp4` and scored with the model's own `Indexer.scores` (fp32, head by head).
Top-k is `model.attention.select_topk` (stable: ties go to the lower column), so the engine's choice
equals the model's. Vectorized over batch and queries (the block-restricted scores gather each
query's own keys, so queries go in chunks only to bound that memory). This is the engine's CPU path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from dsv41.kernels.ref.cache_write import dequantize_rows
from dsv41.model.attention import Indexer, select_topk

_GATHER_ELEMENTS = 1 << 24  # dequantized key values held at once by `indexer_scores_blocks` (64 MB fp32)


def key_rows(key_pool: Tensor, page_table: Tensor, page_rows: int, entries: Tensor, stored: Tensor) -> Tensor:
    """Pool rows of entries (B, ...) of each sequence; rows where `stored` is False are row 0 (any bytes)."""
    pool = key_pool.reshape(-1, key_pool.size(-1))  # (n_rows, row_bytes): pages are contiguous
    B = entries.size(0)
    e = torch.where(stored, entries.long(), torch.zeros_like(entries, dtype=torch.long))
    column = (e // page_rows).clamp(max=max(page_table.size(1) - 1, 0)).reshape(B, -1)
    page = page_table.long().gather(1, column).view_as(e) if page_table.size(1) else torch.zeros_like(e)
    row = torch.where(stored, page.clamp(min=0) * page_rows + e % page_rows, torch.zeros_like(e))
    return pool[row]  # (B, ..., row_bytes)


def _limit(n_keys: Tensor, visible_end: Tensor) -> Tensor:
    """(B, T) number of leading entries each query may see."""
    return torch.minimum(visible_end.long(), n_keys.long().view(-1, 1))


def block_maxima(scores: Tensor, block_size: int) -> Tensor:
    """(B, T, N) → (B, T, ceil(N / block_size)) max of each run of block_size columns (−inf padded)."""
    pad = (-scores.size(-1)) % block_size
    padded = F.pad(scores, (0, pad), value=float("-inf"))
    return padded.unflatten(-1, (-1, block_size)).amax(-1)


def indexer_scores(q: Tensor, weights: Tensor, key_pool: Tensor, page_table: Tensor, page_rows: int,
                   n_keys: Tensor, visible_end: Tensor, n_max: int, block_size: int = 0
                   ) -> tuple[Tensor, Tensor | None]:
    """See `dsv41.kernels.ops.indexer_scores`."""
    B, T, _, Di = q.shape
    e = torch.arange(n_max, device=q.device)
    stored = e < n_keys.long().view(-1, 1)  # (B, n_max)
    if key_pool.numel() == 0:
        stored = torch.zeros_like(stored)
    rows = key_rows(key_pool, page_table, page_rows, e.expand(B, n_max), stored)  # (B, n_max, row_bytes)
    keys = dequantize_rows(rows, "index_fp4", Di)  # (B, n_max, Di)
    scores = Indexer.scores(q, weights, keys)  # (B, T, n_max) fp32
    visible = e < _limit(n_keys, visible_end).unsqueeze(-1)  # (B, T, n_max)
    scores = scores.masked_fill(~visible, float("-inf"))
    return scores, block_maxima(scores, block_size) if block_size else None


def indexer_scores_blocks(q: Tensor, weights: Tensor, key_pool: Tensor, page_table: Tensor, page_rows: int,
                          n_keys: Tensor, visible_end: Tensor, blocks: Tensor, block_size: int) -> Tensor:
    """See `dsv41.kernels.ops.indexer_scores_blocks`."""
    B, T, Hi, Di = q.shape
    M = blocks.size(-1) * block_size
    j = torch.arange(M, device=q.device)
    block = blocks.long()[..., j // block_size]  # (B, T, M)
    e = block * block_size + j % block_size
    visible = (block >= 0) & (e < _limit(n_keys, visible_end).unsqueeze(-1))
    stored = (block >= 0) & (e < n_keys.long().view(-1, 1, 1))
    if key_pool.numel() == 0:
        stored = torch.zeros_like(stored)
    out = []
    step = max(1, _GATHER_ELEMENTS // max(1, B * M * Di))  # queries per chunk
    for t0 in range(0, T, step):
        sl = slice(t0, t0 + step)
        rows = key_rows(key_pool, page_table, page_rows, e[:, sl], stored[:, sl])
        keys = dequantize_rows(rows, "index_fp4", Di)  # (B, t, M, Di)
        n = keys.size(1)
        # every query has its own keys: score each (b, t) as a batch of one query
        s = Indexer.scores(q[:, sl].reshape(B * n, 1, Hi, Di), weights[:, sl].reshape(B * n, 1, Hi),
                           keys.reshape(B * n, M, Di))  # (B·t, 1, M)
        out.append(s.view(B, n, M))
    scores = torch.cat(out, dim=1) if out else q.new_zeros(B, 0, M, dtype=torch.float32)
    return scores.masked_fill(~visible, float("-inf"))


def topk_indices(scores: Tensor, k: int, ids: Tensor | None = None) -> Tensor:
    """See `dsv41.kernels.ops.topk_indices`."""
    picked = select_topk(scores, k)  # (B, T, min(k, N)) ascending columns, −1 (−inf picks) last
    if ids is not None:
        picked = torch.where(picked >= 0, ids.long().gather(-1, picked.clamp(min=0)), torch.full_like(picked, -1))
    if picked.size(-1) < k:
        picked = F.pad(picked, (0, k - picked.size(-1)), value=-1)
    return picked
