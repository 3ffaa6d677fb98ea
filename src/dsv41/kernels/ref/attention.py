"""Torch twin of the sparse attention kernel (SPEC §3): window keys ∪ selected entries + sink.

Dequantize the window rows (FP8) and the selected entry rows (packed FP4) with the repo's own
`quant` functions, build the window mask from positions, and run `model.attention.attend_gathered`
(fp32 softmax). Vectorized over batch and queries; queries are processed in chunks only to bound
the memory of the gathered entries (T · K · D floats), which is what makes long prefill chunks fit.
This is also the engine's CPU path.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dsv41.kernels.ref.cache_write import dequantize_rows
from dsv41.model.attention import attend_gathered

_GATHER_ELEMENTS = 1 << 24  # dequantized entry values held at once (64 MB of fp32)


def entry_rows(entry_pool: Tensor, page_table: Tensor, page_rows: int, topk: Tensor) -> tuple[Tensor, Tensor]:
    """Pool rows of the selected entries: (rows (B, T, K, row_bytes) uint8, valid (B, T, K) bool)."""
    if entry_pool.dim() == 3:  # (pages, page_rows, row_bytes)
        page_rows = page_rows if page_rows > 0 else entry_pool.size(1)
    pool = entry_pool.reshape(-1, entry_pool.size(-1))  # (n_rows, row_bytes)
    valid = topk >= 0
    e = topk.long().clamp(min=0)  # (B, T, K)
    page = page_table.long().gather(1, (e // page_rows).flatten(1)).view_as(e)  # (B, T, K)
    row = torch.where(valid, page * page_rows + e % page_rows, torch.zeros_like(e))
    return pool[row], valid


def window_keys(q_pos: Tensor, window: int, ring_kv: Tensor | None, ring_pos: Tensor | None,
                ring_ids: Tensor | None, chunk_kv: Tensor | None, window_start: Tensor | None, dim: int
                ) -> tuple[Tensor, Tensor]:
    """Window keys (B, Tw, D) fp32 (ring slots, then the chunk's own keys) and the mask (B, T, Tw)."""
    B = q_pos.size(0)
    keys, positions = [], []
    if ring_kv is not None:
        ids = ring_ids.long() if ring_ids is not None else torch.arange(B, device=ring_kv.device)
        keys.append(dequantize_rows(ring_kv[ids], "window_fp8", dim))  # (B, W, D)
        positions.append(ring_pos[ids].long())  # (B, W), −1 = empty
    if chunk_kv is not None:
        keys.append(dequantize_rows(chunk_kv, "window_fp8", dim))  # (B, T, D)
        positions.append(q_pos.long())
    if not keys:
        return q_pos.new_zeros(B, 0, dim, dtype=torch.float32), q_pos.new_zeros(B, q_pos.size(1), 0, dtype=torch.bool)
    kv, kpos = torch.cat(keys, dim=1), torch.cat(positions, dim=1)  # (B, Tw, D), (B, Tw)
    kv = kv.masked_fill((kpos < 0).unsqueeze(-1), 0.0)  # empty slots may hold anything
    low = torch.zeros(B, dtype=torch.long, device=kpos.device)
    if window_start is not None:
        low = window_start.long().clamp(min=0)
    qp, kp = q_pos.long().unsqueeze(-1), kpos.unsqueeze(1)  # (B, T, 1), (B, 1, Tw)
    mask = (kp >= low.view(B, 1, 1)) & (kp >= 0) & (kp <= qp) & (kp > qp - window)  # (B, T, Tw)
    return kv, mask


def sparse_attention(q: Tensor, q_pos: Tensor, sink: Tensor, scale: float, window: int, *,
                     ring_kv: Tensor | None = None, ring_pos: Tensor | None = None, ring_ids: Tensor | None = None,
                     chunk_kv: Tensor | None = None, window_start: Tensor | None = None,
                     entry_pool: Tensor | None = None, page_table: Tensor | None = None, page_rows: int = 0,
                     topk: Tensor | None = None) -> Tensor:
    """See `dsv41.kernels.ops.sparse_attention`."""
    B, T, H, D = q.shape
    kv, mask = window_keys(q_pos, window, ring_kv, ring_pos, ring_ids, chunk_kv, window_start, D)
    use_entries = entry_pool is not None and topk is not None and topk.size(-1) > 0
    if not use_entries:
        return attend_gathered(q, kv, mask, None, None, sink, scale)
    K = topk.size(-1)
    step = max(1, _GATHER_ELEMENTS // (B * K * D))  # queries per chunk
    out = []
    for t0 in range(0, T, step):
        rows, valid = entry_rows(entry_pool, page_table, page_rows, topk[:, t0:t0 + step])
        entries = dequantize_rows(rows, "kv_fp4", D).masked_fill(~valid.unsqueeze(-1), 0.0)  # (B, t, K, D)
        out.append(attend_gathered(q[:, t0:t0 + step], kv, mask[:, t0:t0 + step], entries, valid, sink, scale))
    return out[0] if len(out) == 1 else torch.cat(out, dim=1)
