"""Torch twins of `ops.engram_hash` and `ops.engram_gate`: Engram's n-gram hashing and its gated memory read
(SPEC §1a, §5). These are the model's formulas — `model.engram` calls them for training (document ids, autograd)
and the Triton kernels (`kernels.triton.engram`) must equal them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def engram_hash(tokens: Tensor, token_map: Tensor, multipliers: Tensor, primes: Tensor, offsets: Tensor,
                pad_id: int, *, history: Tensor | None = None, dead_mask: Tensor | None = None,
                doc_ids: Tensor | None = None) -> Tensor:
    """tokens (B, T) raw ids (negative = dead) → int64 ids (B, T, L, orders · heads), order-major columns.

    token_map (V,) raw → compressed id; multipliers (L, S) int64 with S = max n-gram; primes (L, S − 1, heads);
    offsets (L, (S − 1) · heads) each column's first table row. history (B, <= S − 1) raw ids right before
    tokens[:, 0], newest last, −1 = sequence start or dead; dead_mask (B, T) True = image / masked; doc_ids
    (B, T) stop the look-back at document boundaries (history counts as tokens[:, 0]'s document)."""
    B, T = tokens.shape
    H = multipliers.size(1) - 1
    device = tokens.device
    tokens = tokens.long()
    if history is None:
        history = torch.full((B, H), -1, dtype=torch.int64, device=device)
    else:
        history = history.to(device=device, dtype=torch.int64)[:, -H:] if H else history[:, :0]
        if history.shape[1] < H:  # fewer than H known: the rest is the sequence start
            history = F.pad(history, (H - history.shape[1], 0), value=-1)
    ext = torch.cat([history, tokens], dim=1)  # (B, H + T): ext[:, H + t] = tokens[:, t]
    usable = ext >= 0
    if dead_mask is not None:
        usable[:, H:] &= ~dead_mask.to(device=device, dtype=torch.bool)
    compressed = token_map[ext.clamp(min=0)]  # (B, H + T)
    pad = token_map[pad_id]
    if doc_ids is not None:
        doc_ids = doc_ids.to(device)
        ext_doc = torch.cat([doc_ids[:, :1].expand(B, H), doc_ids], dim=1)  # (B, H + T)

    blocked = torch.zeros(B, T, dtype=torch.bool, device=device)
    rolling = None
    hashes = []
    for s in range(H + 1):
        window = slice(H - s, H - s + T)  # position t - s for every t
        blocked = blocked | ~usable[:, window]
        if doc_ids is not None:
            blocked = blocked | (ext_doc[:, window] != doc_ids)
        tok = torch.where(blocked, pad, compressed[:, window])  # (B, T)
        product = tok[:, :, None] * multipliers[:, s]  # (B, T, L); int64 wraps, the bound prevents it
        rolling = product if rolling is None else rolling ^ product
        if s >= 1:  # n-gram order s + 1: one bucket per head
            hashes.append(rolling[..., None] % primes[:, s - 1])  # (B, T, L, heads)
    ids = torch.stack(hashes, dim=3).flatten(3)  # (B, T, L, orders * heads), order-major
    return ids + offsets


def engram_gate(x: Tensor, kv: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float,
                token_mask: Tensor | None = None) -> Tensor:
    """x (B, T, hc, dim) streams, kv (B, T, (hc + 1) · dim) the projected rows (hc keys, then one value) →
    x + gate · value (B, T, hc, dim) in x's dtype, fp32 math. gate = σ(sign(d) · √max(|d|, 1e-6)) with
    d = Σ(h · q_weight · k_weight · key) · rstd(h) · rstd(key) · dim^−½ per (token, stream); 0 where
    token_mask (B, T) is False."""
    B, T, hc, dim = x.shape
    key, value = kv.split([hc * dim, dim], dim=-1)
    key = key.reshape(B, T, hc, dim).float()  # (B, T, hc, dim)
    w = (q_weight * k_weight).float()  # (hc, dim)
    h = x.float()
    # each (token, stream) is RMS-normalized over dim on both sides of the dot
    rstd = torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    dot = (h * w * key).sum(-1) * rstd * dim**-0.5  # (B, T, hc)
    gate = torch.sigmoid(dot.sign() * dot.abs().clamp(min=1e-6).sqrt())
    if token_mask is not None:
        gate = torch.where(token_mask[..., None].to(torch.bool), gate, 0.0)
    out = h + gate[..., None] * value[:, :, None, :].float()  # (B, T, hc, dim)
    return out.to(x.dtype)
