"""Sparse training attention: each query's window band ∪ its gathered top-k entries (issue 18, SPEC §3).

The same math as the dense masked `attention.attend` (the executable spec and this path's test
oracle) — one softmax over the window keys and the selected entries plus the per-head sink, K = V =
the latent — with memory O(T·(W + K)·D) instead of O(T·(T + N)):
  * window: queries in blocks of W against their own and the previous key block (2W keys), masked
    by `window_band` (same document, t − W < u ≤ t, bounded-replay start) — never a (T, T) mask;
  * entries: the K selected entries gathered per query, (B, T, K, D), validity from the slots;
  * index scores: computed per chunk of `ForwardContext.score_chunk` queries without autograd,
    only the top-k (and the candidate blocks) kept, so scoring needs O(chunk·N), not O(T·N);
  * indexer KL over the top-k set (`indexer_kl_set = "topk"`): the target is the main attention
    logits of the gathered entries (detached), the prediction the index scores recomputed with
    autograd for the selected entries only.
The selection (top-k, candidate blocks) is the dense path's own functions applied per chunk, so
both paths pick the same entries. The attention itself (`attend_topk`) runs the fused Triton kernel
of `kernels/triton/sparse_train.py` on CUDA — window keys read from (B, T, D), entries by index from
(B, N, D), O and the log-sum-exp saved, P recomputed in its backward, the KL's entry logits written
by its forward — and `attend_sparse` here (plain autograd over the band and the gathered rows) as
its twin: on the CPU, under `torch.compile`, and with `ops.use_backend("torch")`.

`attention_forward(attn, x, ctx)` replaces `attn(x, ctx)` when `ctx.attention == "sparse"`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from dsv41.kernels import ops
from dsv41.model.attention import (
    Attention,
    Indexer,
    candidate_block_ids,
    candidate_layout,
    newest_block,
    select_topk,
    topk_mask,
)
from dsv41.model.state import EntrySlots, ForwardContext
from dsv41.plan import FULL, REINDEX, REUSE


def window_band(doc_ids: Tensor, window_start: Tensor | None, window: int) -> Tensor:
    """(B, T, 2W) bool: key u = (t // W − 1)·W + j (j < 2W) is in query t's window (same document,
    t − W < u ≤ t, u ≥ the replay start). The band form of `ForwardContext.window_mask`."""
    B, T = doc_ids.shape
    W = window
    nb = -(-T // W)
    t = torch.arange(T, device=doc_ids.device).unsqueeze(-1)  # (T, 1)
    u = (t // W - 1) * W + torch.arange(2 * W, device=doc_ids.device)  # (T, 2W) key index
    ok = (u >= 0) & (u <= t) & (u > t - W)  # u ≤ t < T: in range whenever ok
    key_doc = F.pad(doc_ids, (W, nb * W - T), value=-1)[:, u + W]  # (B, T, 2W)
    mask = ok & (key_doc == doc_ids.unsqueeze(-1))
    if window_start is not None:
        mask &= u >= window_start.unsqueeze(-1)
    return mask


def window_blocks(kv: Tensor, window: int) -> Tensor:
    """(B, T, D) keys → (B, nb, 2W, D): block b holds keys (b − 1)·W .. (b + 1)·W − 1 (zero padded)."""
    B, T, D = kv.shape
    W = window
    nb = -(-T // W)
    padded = F.pad(kv, (0, 0, W, nb * W - T))  # (B, (nb + 1)·W, D)
    return padded.unfold(1, 2 * W, W).transpose(-1, -2)  # (B, nb, 2W, D)


def _blocked(x: Tensor, window: int) -> Tensor:
    """(B, T, ...) → (B, nb, W, ...), zero padded to whole blocks."""
    T, W = x.size(1), window
    nb = -(-T // W)
    pad = [0, 0] * (x.dim() - 2) + [0, nb * W - T]
    return F.pad(x, pad).unflatten(1, (nb, W))  # (B, nb, W, ...)


def attend_sparse(q: Tensor, window_kv: Tensor, band: Tensor, window: int, entries: Tensor | None,
                  entry_valid: Tensor | None, sink: Tensor, scale: float) -> Tensor:
    """`attend` over a window band and gathered entries: one softmax with the sink.

    q (B, T, H, D); window_kv (B, T, D); band (B, T, 2W) from `window_band`; entries (B, T, K, D)
    gathered per query, entry_valid (B, T, K). Returns (B, T, H, D) in q's dtype."""
    B, T, H, D = q.shape
    dt = torch.promote_types(q.dtype, window_kv.dtype)
    keys = window_blocks(window_kv.to(dt), window)  # (B, nb, 2W, D)
    qb = _blocked(q.to(dt), window)  # (B, nb, W, H, D)
    logits = [torch.einsum("bnihd,bnjd->bnihj", qb, keys).flatten(1, 2)[:, :T].float() * scale]  # (B, T, H, 2W)
    masks = [band]
    if entries is not None and entries.size(2):
        logits.append(torch.einsum("bthd,btkd->bthk", q.to(dt), entries.to(dt)).float() * scale)  # (B, T, H, K)
        masks.append(entry_valid)
    scores = torch.cat(logits, dim=-1).masked_fill(~torch.cat(masks, dim=-1).unsqueeze(2), float("-inf"))
    sink_col = sink.float().view(1, 1, H, 1).expand(B, T, H, 1)
    probs = torch.softmax(torch.cat((scores, sink_col), dim=-1), dim=-1)  # (B, T, H, 2W + K + 1)
    pw = _blocked(probs[..., :2 * window].to(dt), window)  # (B, nb, W, H, 2W)
    o = torch.einsum("bnihj,bnjd->bnihd", pw, keys).flatten(1, 2)[:, :T]  # (B, T, H, D)
    if len(logits) > 1:
        o = o + torch.einsum("bthk,btkd->bthd", probs[..., 2 * window:-1].to(dt), entries.to(dt))
    return o.to(q.dtype)


def gather_rows(x: Tensor, index: Tensor) -> Tensor:
    """x (B, N, D), index (B, T, K) with −1 = none → (B, T, K, D) (row 0 where none).

    An `index_select` over the flattened rows: its backward is an `index_add_` (atomic adds on CUDA),
    where advanced indexing's backward (`index_put_` with accumulate) sorts the indices first — 158 ms
    of a 490 ms `small` training step on the H200 (benchmarks/train_profile.py)."""
    B, N, D = x.shape
    offset = torch.arange(B, device=x.device).view(-1, 1, 1) * N  # (B, 1, 1)
    flat = (index.clamp(min=0) + offset).reshape(-1)  # (B·T·K,)
    return x.reshape(B * N, D).index_select(0, flat).view(*index.shape, D)  # (B, T, K, D)


def entry_validity(slots: EntrySlots, topk: Tensor, doc_ids: Tensor) -> Tensor:
    """(B, T, K) bool: pick k is an entry query t may see (same document, group ended, valid slot)."""
    B, T, K = topk.shape
    idx = topk.clamp(min=0).flatten(1)  # (B, T·K)
    doc = slots.doc.gather(1, idx).view(B, T, K)
    end = slots.token.gather(1, idx).view(B, T, K)
    ok = slots.valid.gather(1, idx).view(B, T, K)
    t = torch.arange(T, device=topk.device).view(1, T, 1)
    return (topk >= 0) & ok & (doc == doc_ids.unsqueeze(-1)) & (end <= t)


@torch.no_grad()
def chunked_selection(scores_fn, slots: EntrySlots, doc_ids: Tensor, k: int, chunk: int,
                      candidates: Tensor | None = None, block_size: int = 1, pick_blocks: int = 0
                      ) -> tuple[Tensor, Tensor | None]:
    """Top-k slots per query from index scores made `chunk` queries at a time (never (B, T, N)).

    scores_fn(t0, t1) → (B, t1 − t0, N) index scores of those queries. `candidates` (B, T, Kb): kept
    block ids (blocks of `block_size` slots) that restrict the choice (Reindex layers); `pick_blocks`
    > 0: also pick that many candidate blocks per query (the candidate source). Returns
    (top-k (B, T, K), candidate block ids (B, T, pick_blocks) or None)."""
    B, T = doc_ids.shape
    token = torch.arange(T, device=doc_ids.device).expand(B, T)
    layout = None
    if candidates is not None or pick_blocks:
        layout = candidate_layout(slots, block_size)
    candidate_args = (block_size, pick_blocks) if pick_blocks else None
    tops, kept = [], []
    for t0 in range(0, T, chunk):
        t1 = min(t0 + chunk, T)
        visible = slots.visible(doc_ids[:, t0:t1], token[:, t0:t1])  # (B, C, N)
        scores = scores_fn(t0, t1).masked_fill(~visible, float("-inf"))
        if candidate_args is not None:
            block_id, n_blocks = layout
            kept.append(candidate_block_ids(scores, block_id, n_blocks, newest_block(visible, block_id),
                                            candidate_args[1]))
        elif candidates is not None:
            block_id, n_blocks = layout
            pool = topk_mask(candidates[:, t0:t1], n_blocks)  # (B, C, blocks)
            pool = pool.gather(-1, block_id.unsqueeze(1).expand(-1, t1 - t0, -1))  # (B, C, N)
            scores = scores.masked_fill(~pool, float("-inf"))
        tops.append(select_topk(scores, k))
    return torch.cat(tops, dim=1), (torch.cat(kept, dim=1) if kept else None)


def indexer_kl_topk(entry_logits: Tensor, valid: Tensor, index_scores: Tensor) -> Tensor:
    """KL(main attention over the selected entries ‖ softmax of their index scores), mean over
    queries with any entry. entry_logits (B, T, H, K) main-attention logits (taken detached: the
    target is a constant, heads' probabilities summed and renormalized); valid (B, T, K);
    index_scores (B, T, K) with autograd. The top-k form of `attention.indexer_kl`."""
    has_any = valid.any(-1)  # (B, T)
    with torch.no_grad():
        logits = entry_logits.detach().double().masked_fill(~valid.unsqueeze(2), float("-inf"))
        target = torch.softmax(logits, dim=-1).nan_to_num(0.0).sum(2)  # (B, T, K)
        target = target / target.sum(-1, keepdim=True).clamp_min(1e-30)
    log_pred = torch.log_softmax(index_scores.double().masked_fill(~valid, float("-inf")), dim=-1)
    kl = torch.where(target > 0, target * (target.clamp_min(1e-30).log() - log_pred), torch.zeros_like(target))
    # the mean over queries with any entry, without a host sync or a data-dependent shape (torch.compile):
    # a query without one has target 0 everywhere, so its row of kl is 0; none at all gives 0
    n = has_any.sum().clamp_min(1)
    return (kl.sum(-1).sum() / n).to(index_scores.dtype)


class _SelectedScores(torch.autograd.Function):
    """Σ_h w_h·relu(q_h·k_s) over gathered keys, saving the (B, T, Hi, K) dot products instead of the
    (B, T, K, Di) gathered keys (autograd of the plain form keeps those: 0.5 GB per indexer layer of
    `small` at 16 × 1024); the backward gathers the keys again and scatters their gradient back."""

    @staticmethod
    def forward(ctx, iq: Tensor, weights: Tensor, index_k: Tensor, topk: Tensor) -> Tensor:
        keys = gather_rows(index_k, topk).float()  # (B, T, K, Di), not kept
        dots = torch.einsum("bthd,btkd->bthk", iq.float(), keys)  # (B, T, Hi, K)
        ctx.save_for_backward(iq, weights, index_k, topk, dots)
        return (dots.relu() * weights.float().unsqueeze(-1)).sum(2)  # (B, T, K)

    @staticmethod
    def backward(ctx, grad: Tensor):
        # fp32 as in the forward: a CPU backward runs inside the caller's autocast, whose bf16 einsums would
        # round the gradients (and index_add_ refuses a bf16 source into the fp32 sum)
        with torch.autocast(grad.device.type, enabled=False):
            return _SelectedScores._backward(ctx, grad)

    @staticmethod
    def _backward(ctx, grad: Tensor):
        iq, weights, index_k, topk, dots = ctx.saved_tensors
        g = grad.float().unsqueeze(2)  # (B, T, 1, K)
        d_weights = (g * dots.relu()).sum(-1).to(weights.dtype) if ctx.needs_input_grad[1] else None  # (B, T, Hi)
        d_dots = g * weights.float().unsqueeze(-1) * (dots > 0)  # (B, T, Hi, K)
        d_iq = d_index_k = None
        if ctx.needs_input_grad[0]:
            keys = gather_rows(index_k, topk).float()  # (B, T, K, Di) again
            d_iq = torch.einsum("bthk,btkd->bthd", d_dots, keys).to(iq.dtype)
        if ctx.needs_input_grad[2]:
            B, N, Di = index_k.shape
            d_keys = torch.einsum("bthk,bthd->btkd", d_dots, iq.float())  # (B, T, K, Di)
            offset = torch.arange(B, device=index_k.device).view(-1, 1, 1) * N  # (B, 1, 1)
            flat = (topk.clamp(min=0) + offset).reshape(-1)  # the rows gather_rows read
            d_index_k = torch.zeros(B * N, Di, dtype=torch.float32, device=index_k.device).index_add_(
                0, flat, d_keys.reshape(-1, Di)).view(B, N, Di).to(index_k.dtype)
        return d_iq, d_weights, d_index_k, None


def selected_index_scores(iq: Tensor, weights: Tensor, index_k: Tensor, topk: Tensor) -> Tensor:
    """Index scores Σ_h w_h·relu(q_h·k_s) of the selected entries only: (B, T, K) fp32, with autograd
    (a custom backward that re-gathers the keys instead of saving them; `selected_index_scores_reference`
    is the plain autograd form it is tested against). The Triton kernels when `ops.selected_scores_kernel` says so
    (CUDA: the keys read by index, no (B, T, K, Di) tensor in either pass)."""
    if ops.selected_scores_kernel(iq, index_k):
        return ops.selected_index_scores(iq, weights, index_k, topk)
    return _SelectedScores.apply(iq, weights, index_k, topk)


def selected_index_scores_reference(iq: Tensor, weights: Tensor, index_k: Tensor, topk: Tensor) -> Tensor:
    """The plain autograd form of `selected_index_scores` (keeps the gathered keys for its backward)."""
    keys = gather_rows(index_k, topk)  # (B, T, K, Di)
    per_head = torch.einsum("bthd,btkd->bthk", iq.float(), keys.float()).relu()  # (B, T, Hi, K)
    return (per_head * weights.unsqueeze(-1)).sum(2)


def attend_topk(q: Tensor, window_kv: Tensor, ctx: ForwardContext, window: int, pool: Tensor | None,
                topk: Tensor | None, valid: Tensor | None, sink: Tensor, scale: float, *, entry_logits: bool = False
                ) -> tuple[Tensor, Tensor | None]:
    """The layer's attention: window band ∪ entries `pool` (B, N, D) picked by topk (B, T, K) where
    `valid`. The fused Triton kernel when `ops.sparse_train_kernel` says so (CUDA; backend switch
    `ops.use_backend("torch")` forces this twin), else `attend_sparse` on the band and the gathered rows.
    Returns (o (B, T, H, D), the entries' detached logits (B, T, H, K) fp32 when `entry_logits`)."""
    if pool is not None and topk is not None and ops.sparse_train_kernel(q, window_kv, pool):
        dt = torch.promote_types(torch.promote_types(q.dtype, window_kv.dtype), pool.dtype)
        index = torch.where(valid, topk, -1)  # (B, T, K) −1 = not attended
        o, _, logits = ops.sparse_train_attention(q.to(dt), window_kv.to(dt), ctx.doc_ids, ctx.window_start,
                                                  window, pool.to(dt), index, sink, scale, entry_logits=entry_logits)
        return o.to(q.dtype), logits
    if pool is None and ops.sparse_train_kernel(q, window_kv, None):
        dt = torch.promote_types(q.dtype, window_kv.dtype)
        o, _, _ = ops.sparse_train_attention(q.to(dt), window_kv.to(dt), ctx.doc_ids, ctx.window_start, window,
                                             None, None, sink, scale)
        return o.to(q.dtype), None
    key = ("band", window)
    if key not in ctx._cache:
        ctx._cache[key] = window_band(ctx.doc_ids, ctx.window_start, window)
    entries = gather_rows(pool, topk) if pool is not None else None  # (B, T, K, D)
    o = attend_sparse(q, window_kv, ctx._cache[key], window, entries, valid, sink, scale)
    logits = None
    if entry_logits and entries is not None:
        logits = torch.einsum("bthd,btkd->bthk", q.detach().float(), entries.detach().float()) * scale
    return o, logits


def attention_forward(attn: Attention, x: Tensor, ctx: ForwardContext) -> Tensor:
    """`Attention.forward` on the sparse path: same parameters, sharing and outputs."""
    cos, sin = attn.angles(ctx.positions)
    qr, q = attn.query(x, cos, sin)
    window_kv = attn.window_kv(x, cos, sin)
    pool = topk = valid = kl = None
    if attn.ratio:
        pool, topk, valid, kl = _compressed(attn, x, qr, ctx)
    o, logits = attend_topk(q, window_kv, ctx, attn.window, pool, topk, valid, attn.attn_sink, attn.scale,
                            entry_logits=kl is not None)
    if kl is not None:
        ctx.indexer_losses.append(kl(logits))
    return attn.output(o, cos, sin)


def _compressed(attn: Attention, x: Tensor, qr: Tensor, ctx: ForwardContext
                ) -> tuple[Tensor, Tensor, Tensor, Callable[[Tensor], Tensor] | None]:
    """The CSA2 sharing of `Attention._compressed` with chunked selection; returns the entry pool
    (B, N, D), the top-k (B, T, K), its validity (B, T, K) and — when this layer trains its indexer —
    the KL as a function of the selected entries' main-attention logits (made by the attention)."""
    shared, mode, plan = ctx.shared, attn.plan.mode, attn.plan
    if mode == FULL:
        slots = ctx.slots(attn.ratio)
        latent = attn.compressor(x, slots.token)
        shared.kv, shared.index_k = attn.entries(latent, slots.first_position)
        shared.slots, shared.kv_source = slots, attn.layer_id
    slots = shared.slots
    iq = weights = None
    if mode in (FULL, REINDEX):
        cos, sin = attn.angles(ctx.positions)
        iq = attn.indexer.queries(qr.detach(), cos, sin, attn.qat)
        weights = attn.indexer.head_weights(x.detach())
        index_k = shared.index_k

        def scores_fn(t0: int, t1: int) -> Tensor:
            return Indexer.scores(iq[:, t0:t1], weights[:, t0:t1], index_k)

        pick = attn.candidate_topk_blocks if plan.candidate_source else 0
        pool = shared.candidate_blocks if plan.uses_candidates and not plan.candidate_source else None
        shared.topk, kept = chunked_selection(scores_fn, slots, ctx.doc_ids, attn.index_topk, ctx.score_chunk,
                                              candidates=pool, block_size=attn.candidate_block_size,
                                              pick_blocks=pick)
        if kept is not None:
            shared.candidate_blocks, shared.candidate_source = kept, attn.layer_id
        shared.topk_source = attn.layer_id
    valid = entry_validity(slots, shared.topk, ctx.doc_ids)
    kl = None
    if mode in (FULL, REINDEX) and ctx.training_losses:
        if attn.kl_set != "topk":
            raise ValueError("the sparse attention path computes the indexer KL over the top-k set only "
                             "(indexer_kl_set='topk'); use attention='dense' for 'allowed'")
        selected = selected_index_scores(iq, weights, shared.index_k, shared.topk)
        # padding queries get no KL (the attention itself still reads `valid` unmasked)
        kl_valid = valid if ctx.query_mask is None else valid & ctx.query_mask.unsqueeze(-1)

        def kl(entry_logits: Tensor) -> Tensor:
            return indexer_kl_topk(entry_logits, kl_valid, selected)

    if ctx.trace is not None:
        ctx.trace.append(dict(layer=attn.layer_id, mode=mode, kv_source=shared.kv_source, kv=shared.kv,
                              topk_source=shared.topk_source, topk=shared.topk, allowed=None,
                              candidates=shared.candidate_blocks if mode == REINDEX else None,
                              reused=mode == REUSE))
    return shared.kv, shared.topk, valid, kl
