"""CSA2 attention: window KV, compressor, lightning indexer, candidate blocks, sparse attention.

Each layer attends, in one softmax with a learned per-head sink, to (SPEC §3, §1a)
  * its own sliding window of the last `window_size` tokens (KV = kv_norm(wkv(x)), RoPE, FP8), and
  * for compressed layers, `index_topk` compressed entries chosen by an indexer.
Keys and values are both the single 512-dim latent (MQA over the latent); the output has the
query's rotation removed (inverse RoPE) and goes through a grouped low-rank projection.

Layer sharing (CSA2): a Full layer owns a `Compressor` (m tokens → 1 entry by a per-channel
softmax gate, RMSNorm; m = 1 is just RMSNorm(wkv(x))) and derives index keys from the *pre-RoPE*
entries; entries and keys are rotated at their group's first position and FP4-quantized. Full and
Reindex layers own an `Indexer` query; Reuse layers take the latest top-k. The decoder's Full
layer also picks candidate blocks, and later Reindex layers score only inside them. Sharing goes
through the per-forward `ForwardContext.shared` record — never a module global.

The indexer learns from an auxiliary KL loss (SPEC §3 decision): target = main attention
probability over the layer's top-k entries (config `indexer_kl_set="topk"`, DeepSeek-V3.2's sparse
stage) or over every entry it may select (`"allowed"`, the dense form) — heads summed, renormalized
— prediction = softmax of the index scores over the same entries; the indexer's inputs are detached.

`attend` is the dense masked form; `model/sparse_attention.py` computes the same attention with
memory O(T·(W + K)) for training at length (docs/training.md).

This is the eager, readable path (the executable spec) that training runs; the engine calls the
fused kernels in `kernels.ops`, whose torch twins are built from `attend_gathered`, `Indexer.scores`,
`select_topk` and `select_candidate_blocks` here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dsv41.config import ModelConfig
from dsv41.kernels import ops
from dsv41.model.norm import RMSNorm
from dsv41.model.rope import layer_frequencies, rope_angles
from dsv41.model.state import ForwardContext
from dsv41.plan import FULL, REINDEX, REUSE, LayerPlan
from dsv41.quant.fp4 import fake_quant_index_fp4, fake_quant_kv_fp4
from dsv41.quant.fp8 import fake_quant_window_fp8


def _maybe(fq, x: Tensor, enabled: bool) -> Tensor:
    return fq(x) if enabled else x


class Compressor(nn.Module):
    """m tokens → one 512-dim entry (returned before RoPE; the indexer reads that form)."""

    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        self.ratio = config.compress_ratios[layer_id]
        self.head_dim = config.head_dim
        self.wkv = nn.Linear(config.dim, config.head_dim, bias=False)
        if self.ratio > 1:
            self.wgate = nn.Linear(config.dim, config.head_dim, bias=False)
        self.norm = RMSNorm(config.head_dim, config.norm_eps)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """fp32 projections and gate scores (B, T, D) — fp32 even in a bf16 model, as the reference."""
        xf = x.float()
        return F.linear(xf, self.wkv.weight.float()), F.linear(xf, self.wgate.weight.float())

    def pool(self, kv: Tensor, score: Tensor) -> Tensor:
        """(..., m, D) projections and gate scores of one group → (..., D) fp32 pooled latent."""
        return (kv * score.softmax(dim=-2)).sum(dim=-2)

    def forward(self, x: Tensor, group_end: Tensor) -> Tensor:
        """x: (B, T, dim); group_end: (B, N) token index of each group's last token → (B, N, D)."""
        B, T, _ = x.shape
        if self.ratio == 1:
            kv = self.wkv(x)
            idx = group_end.clamp(max=T - 1).unsqueeze(-1).expand(-1, -1, self.head_dim)
            return self.norm(kv.gather(1, idx))
        kv, score = self.project(x)  # pooling runs in fp32, as the reference does
        offsets = torch.arange(-(self.ratio - 1), 1, device=x.device)  # group members, oldest first
        idx = (group_end.unsqueeze(-1) + offsets).clamp(0, T - 1)  # (B, N, m)
        flat = idx.flatten(1).unsqueeze(-1).expand(-1, -1, self.head_dim)
        kv_g = kv.gather(1, flat).unflatten(1, idx.shape[1:])  # (B, N, m, D)
        score_g = score.gather(1, flat).unflatten(1, idx.shape[1:])
        return self.norm(self.pool(kv_g, score_g).to(x.dtype))


class Indexer(nn.Module):
    """Lightning indexer: score(t, s) = Σ_h w_{t,h} · relu(q_{t,h} · k_s)."""

    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        self.n_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(config.dim, self.n_heads, bias=False)
        self.owns_k = layer_id in config.kv_source_layers
        if self.owns_k:
            self.wk = nn.Linear(config.head_dim, self.head_dim, bias=False)
            self.k_norm = RMSNorm(self.head_dim, config.norm_eps)
        self.weight_scale = self.head_dim ** -0.5 * self.n_heads ** -0.5

    def keys(self, latent: Tensor, cos: Tensor, sin: Tensor, quant: bool) -> Tensor:
        """Index keys from pre-RoPE entries (B, N, D) → (B, N, index_head_dim)."""
        k = ops.rope(self.k_norm(self.wk(latent)), cos, sin)
        return _maybe(fake_quant_index_fp4, k, quant)

    def queries(self, qr: Tensor, cos: Tensor, sin: Tensor, quant: bool) -> Tensor:
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))  # (B, T, Hi, Di)
        return ops.rope_fake_quant(q, cos, sin, "index_fp4") if quant else ops.rope(q, cos, sin)

    def head_weights(self, x: Tensor) -> Tensor:
        return self.weights_proj(x).float() * self.weight_scale  # (B, T, Hi)

    @staticmethod
    def scores(q: Tensor, weights: Tensor, k: Tensor) -> Tensor:
        """(B, T, Hi, Di) × (B, T, Hi) × (B, N, Di) → (B, T, N) fp32, one head at a time."""
        out = None
        for h in range(q.size(2)):
            s = torch.einsum("btd,bnd->btn", q[:, :, h].float(), k.float()).relu() * weights[:, :, h, None]
            out = s if out is None else out + s
        return out


def select_candidate_blocks(scores: Tensor, block_id: Tensor, n_blocks: int, newest_block: Tensor,
                            topk_blocks: int) -> Tensor:
    """Level one of the hierarchical indexer: keep the top blocks per query.

    scores (B, T, N) with unreachable entries at −inf; block_id (B, N) block of each slot;
    newest_block (B, T) block holding the query's newest visible entry (−1 = none), pinned in
    because it is only partly filled. Returns (B, T, N) bool: slot lies in a kept block."""
    B, T, N = scores.shape
    kept = candidate_block_ids(scores, block_id, n_blocks, newest_block, topk_blocks)
    return topk_mask(kept, n_blocks).gather(-1, block_id.unsqueeze(1).expand(B, T, N))


def candidate_block_ids(scores: Tensor, block_id: Tensor, n_blocks: int, newest_block: Tensor,
                        topk_blocks: int) -> Tensor:
    """The blocks `select_candidate_blocks` keeps, as (B, T, topk_blocks) block ids (−1 = none):
    O(T·blocks) to hand down the stack instead of a (B, T, N) mask (the sparse path keeps these)."""
    B, T, N = scores.shape
    index = block_id.unsqueeze(1).expand(B, T, N)
    block_scores = scores.new_full((B, T, n_blocks), float("-inf"))
    block_scores = block_scores.scatter_reduce(-1, index, scores, reduce="amax", include_self=True)
    pin = torch.arange(n_blocks, device=scores.device) == newest_block.unsqueeze(-1)
    block_scores = block_scores.masked_fill(pin, float("inf"))
    values, indices = stable_topk(block_scores, topk_blocks)
    return torch.where(values > float("-inf"), indices, torch.full_like(indices, -1))


def stable_topk(scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Top-k along the last dim with ties broken towards the lower index. ReLU index scores tie
    at 0 often; a deterministic rule keeps a document's choice independent of where it was packed
    (its slots are contiguous and in position order) and makes the engine match the model."""
    k = min(k, scores.size(-1))
    values, idx = torch.sort(scores, dim=-1, descending=True, stable=True)
    return values[..., :k], idx[..., :k]


def select_topk(scores: Tensor, k: int) -> Tensor:
    """Top-k slots per query, in position order; picks with score −inf become −1 (at the end)."""
    values, idx = stable_topk(scores, k)
    big = scores.size(-1)
    idx = torch.where(values > float("-inf"), idx, torch.full_like(idx, big)).sort(dim=-1).values
    return torch.where(idx < big, idx, torch.full_like(idx, -1))


def topk_mask(topk: Tensor, n: int) -> Tensor:
    """(B, T, K) slot indices (−1 = none) → (B, T, n) bool selection mask."""
    mask = torch.zeros(*topk.shape[:-1], n + 1, dtype=torch.bool, device=topk.device)
    mask.scatter_(-1, torch.where(topk >= 0, topk, torch.full_like(topk, n)), True)
    return mask[..., :n]


def attend(q: Tensor, window_kv: Tensor, window_mask: Tensor, entries: Tensor | None, entry_mask: Tensor | None,
           sink: Tensor, scale: float) -> Tensor:
    """One softmax over window keys ∪ selected entries, plus a sink that only adds to the denominator.

    q (B, Tq, H, D); window_kv (B, Tw, D); window_mask (B, Tq, Tw); entries (B, N, D);
    entry_mask (B, Tq, N). K = V = the latent. Returns (B, Tq, H, D) in q's dtype."""
    logits = [torch.einsum("bthd,bsd->bhts", q.float(), window_kv.float()) * scale]
    masks = [window_mask]
    values = [window_kv]
    if entries is not None and entries.size(1):
        logits.append(torch.einsum("bthd,bsd->bhts", q.float(), entries.float()) * scale)
        masks.append(entry_mask)
        values.append(entries)
    scores = torch.cat(logits, dim=-1)  # (B, H, Tq, S)
    scores = scores.masked_fill(~torch.cat(masks, dim=-1).unsqueeze(1), float("-inf"))
    sink_col = sink.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat((scores, sink_col), dim=-1), dim=-1)[..., :-1]
    o = torch.einsum("bhts,bsd->bthd", probs, torch.cat(values, dim=1).float())
    return o.to(q.dtype)


def attend_gathered(q: Tensor, window_kv: Tensor, window_mask: Tensor, entries: Tensor | None,
                    entry_valid: Tensor | None, sink: Tensor, scale: float) -> Tensor:
    """`attend` with per-query entry lists: entries (B, Tq, K, D) gathered from the cache,
    entry_valid (B, Tq, K) (False for index −1). Same math, K instead of all N entries."""
    logits = [torch.einsum("bthd,bsd->bhts", q.float(), window_kv.float()) * scale]
    masks = [window_mask]
    if entries is not None and entries.size(2):
        logits.append(torch.einsum("bthd,btkd->bhtk", q.float(), entries.float()) * scale)
        masks.append(entry_valid)
    scores = torch.cat(logits, dim=-1).masked_fill(~torch.cat(masks, dim=-1).unsqueeze(1), float("-inf"))
    sink_col = sink.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat((scores, sink_col), dim=-1), dim=-1)[..., :-1]
    S = window_kv.size(1)
    o = torch.einsum("bhts,bsd->bthd", probs[..., :S], window_kv.float())
    if len(logits) > 1:
        o = o + torch.einsum("bhtk,btkd->bthd", probs[..., S:], entries.float())
    return o.to(q.dtype)


def indexer_kl(q: Tensor, entries: Tensor, allowed: Tensor, index_scores: Tensor, scale: float,
               n_queries: Tensor | None = None) -> Tensor:
    """KL(main attention over allowed entries ‖ softmax(index scores)), mean over queries with any entry
    (or summed and divided by `n_queries` when the queries are split over devices).

    The target is detached: heads' probabilities summed and renormalized (SPEC §3 decision)."""
    has_any = allowed.any(-1)  # (B, T)
    with torch.no_grad():
        logits = torch.einsum("bthd,bsd->bhts", q.float(), entries.float()).double() * scale
        logits = logits.masked_fill(~allowed.unsqueeze(1), float("-inf"))
        target = torch.softmax(logits, dim=-1).nan_to_num(0.0).sum(1)  # (B, T, N)
        target = target / target.sum(-1, keepdim=True).clamp_min(1e-30)
    log_pred = torch.log_softmax(index_scores.double().masked_fill(~allowed, float("-inf")), dim=-1)
    kl = torch.where(target > 0, target * (target.clamp_min(1e-30).log() - log_pred), torch.zeros_like(target))
    # a query without an allowed entry has target 0, so its row of kl is 0: sums need no boolean indexing
    # (no host sync, no data-dependent shape)
    total = kl.sum()
    loss = total / (has_any.sum() if n_queries is None else n_queries).clamp_min(1)
    return loss.to(index_scores.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, plan: LayerPlan):
        super().__init__()
        c = config
        self.layer_id, self.plan = plan.layer_id, plan
        self.n_heads, self.head_dim, self.rope_dim = c.n_heads, c.head_dim, c.rope_head_dim
        self.window, self.ratio = c.window_size, plan.ratio
        self.n_groups, self.o_lora_rank = c.o_groups, c.o_lora_rank
        self.qat = c.qat
        self.index_topk, self.kl_set = c.index_topk, c.indexer_kl_set
        self.candidate_topk_blocks, self.candidate_block_size = c.candidate_topk_blocks, c.candidate_block_size
        self.scale = c.head_dim ** -0.5

        self.attn_sink = nn.Parameter(torch.zeros(c.n_heads, dtype=torch.float32))
        self.wq_a = nn.Linear(c.dim, c.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(c.q_lora_rank, c.norm_eps)
        self.wq_b = nn.Linear(c.q_lora_rank, c.n_heads * c.head_dim, bias=False)
        self.wkv = nn.Linear(c.dim, c.head_dim, bias=False)
        self.kv_norm = RMSNorm(c.head_dim, c.norm_eps)
        # grouped output: wo_a is block-diagonal over groups, stored as one (G·R, H·D/G) matrix
        self.wo_a = nn.Linear(c.n_heads * c.head_dim // c.o_groups, c.o_groups * c.o_lora_rank, bias=False)
        self.wo_b = nn.Linear(c.o_groups * c.o_lora_rank, c.dim, bias=False)
        if plan.owns_compressor:
            self.compressor = Compressor(c, plan.layer_id)
        if plan.owns_indexer:
            self.indexer = Indexer(c, plan.layer_id)
        self._rope_config = c
        self.register_buffer("freqs", layer_frequencies(c, plan.ratio), persistent=False)
        self._fused_a: tuple[Tensor, tuple[int, int]] | None = None  # `fuse_projections`: [wq_a; wkv], addresses

    def _apply(self, fn, recurse: bool = True):  # type: ignore[override]
        """The RoPE frequencies stay fp32 whatever the module is cast to: `.to(bf16)` would round them to ~3
        digits (phases off by radians at position 10^4) — a cast recomputes them on the new device."""
        super()._apply(fn, recurse)
        freqs = self._buffers["freqs"]
        if freqs.dtype != torch.float32:
            self._buffers["freqs"] = layer_frequencies(self._rope_config, self.ratio).to(freqs.device)
        if self._fused_a is not None and not self._fused_a_ok():  # a conversion gave the weights new tensors
            self._fused_a = None
        return self

    # ------------------------------------------------------------ the engine's fused input projection
    def fuse_projections(self) -> bool:
        """Lay wq_a and wkv out as one (q_lora_rank + head_dim, dim) matrix, the two weights views into it (the
        state dict unchanged, in-place updates seen by both), so that `project` is one GEMM instead of two (the
        engine: one kernel fewer per layer of every step). Plain weights of one dtype and device only; False
        otherwise. A cast or a reassigned weight undoes it (`project` checks). Idempotent: a fused matrix stays
        where it is (an engine's CUDA graphs read it by address; a second engine on the same model calls this
        again — `MoE.fuse_dense`)."""
        if self._fused_a_ok():
            return True
        a, kv = self.wq_a.weight, self.wkv.weight
        if type(a) is not nn.Parameter or type(kv) is not nn.Parameter or (a.dtype, a.device) != (kv.dtype, kv.device):
            return False
        w = torch.cat([a.detach(), kv.detach()])
        self.wq_a.weight.data, self.wkv.weight.data = w[:a.size(0)], w[a.size(0):]
        self._fused_a = (w, self._a_addresses())
        return True

    def _a_addresses(self) -> tuple[int, int]:
        return self.wq_a.weight.data_ptr(), self.wkv.weight.data_ptr()

    def _fused_a_ok(self) -> bool:
        return self._fused_a is not None and self._a_addresses() == self._fused_a[1]

    def project(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(wq_a(x), wkv(x)) before their norms: one GEMM over the fused matrix (`fuse_projections`) — the two
        outputs views into its result — or two."""
        if self._fused_a_ok() and not torch.is_grad_enabled():
            out = F.linear(x, self._fused_a[0])
            r = self.wq_a.out_features
            return out[..., :r], out[..., r:]
        return self.wq_a(x), self.wkv(x)

    # ------------------------------------------------------------ pieces the engine reuses
    def angles(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        return rope_angles(self.freqs, positions)

    def query(self, x: Tensor, cos: Tensor, sin: Tensor, projected: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(qr (B, T, q_lora_rank), q (B, T, H, D) rotated); `projected`: wq_a(x) when the caller has it
        (`project`)."""
        qr = self.q_norm(self.wq_a(x) if projected is None else projected)
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))  # (B, T, H, D)
        return qr, ops.rope(q, cos, sin)

    def window_kv(self, x: Tensor, cos: Tensor, sin: Tensor, quant: bool | None = None) -> Tensor:
        """This layer's own window KV: kv_norm(wkv(x)), RoPE, FP8 (when quantizing)."""
        quant = self.qat if quant is None else quant
        return _maybe(fake_quant_window_fp8, ops.rope(self.kv_norm(self.wkv(x)), cos, sin), quant)

    def entries(self, latent: Tensor, first_positions: Tensor, quant: bool | None = None
                ) -> tuple[Tensor, Tensor | None]:
        """Pre-RoPE latents (B, N, D) → (entries rotated at their first position + FP4, index keys)."""
        quant = self.qat if quant is None else quant
        cos, sin = self.angles(first_positions)
        index_k = None
        if self.plan.owns_indexer and self.indexer.owns_k:
            index_k = self.indexer.keys(latent.detach(), cos, sin, quant)
        return _maybe(fake_quant_kv_fp4, ops.rope(latent, cos, sin), quant), index_k

    def output(self, o: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Inverse RoPE on the output's rotary tail, then the grouped projection."""
        o = ops.rope(o, cos, sin, inverse=True)
        B, T = o.shape[:2]
        o = o.reshape(B, T, self.n_groups, -1)  # (B, T, G, H·D/G)
        wo_a = self.wo_a.weight.view(self.n_groups, self.o_lora_rank, -1)  # (G, R, H·D/G)
        o = torch.einsum("btgd,grd->btgr", o, wo_a.to(o.dtype))
        return self.wo_b(o.flatten(2))

    # ------------------------------------------------------------ training / full-sequence forward
    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        cos, sin = self.angles(ctx.positions)
        qr, q = self.query(x, cos, sin)
        window_kv = self.window_kv(x, cos, sin)
        entries = entry_mask = None
        if self.ratio:
            entries, entry_mask = self._compressed(x, qr, q, ctx)
        keys, window_mask = ctx.window_keys(window_kv, self.window)
        o = attend(q, keys, window_mask, entries, entry_mask, self.attn_sink, self.scale)
        return self.output(o, cos, sin)

    def _compressed(self, x: Tensor, qr: Tensor, q: Tensor, ctx: ForwardContext) -> tuple[Tensor, Tensor]:
        shared, mode = ctx.shared, self.plan.mode
        if mode == FULL:  # this device's own entries (all of them unless the sequence is split)
            own = ctx.own_slots(self.ratio)
            latent = self.compressor(ctx.compressor_input(x, self.ratio), own.token)
            shared.kv, shared.index_k = self.entries(latent, own.first_position)
            shared.latent, shared.slots, shared.kv_source = latent, ctx.slots(self.ratio), self.layer_id
        slots = shared.slots
        kv = ctx.gather_entries(shared.kv, self.ratio)  # (B, N, D) every slot, in slot order
        visible = ctx.visible(self.ratio)  # (B, T, N)
        allowed = visible
        if mode in (FULL, REINDEX):
            cos, sin = self.angles(ctx.positions)
            iq = self.indexer.queries(qr.detach(), cos, sin, self.qat)
            index_k = ctx.gather_entries(shared.index_k, self.ratio)
            scores = Indexer.scores(iq, self.indexer.head_weights(x.detach()), index_k)
            scores = scores.masked_fill(~visible, float("-inf"))
            if self.plan.candidate_source:
                shared.candidates = self._candidates(scores, visible, slots)
                shared.candidate_source = self.layer_id
            elif self.plan.uses_candidates:
                allowed = visible & shared.candidates
                scores = scores.masked_fill(~allowed, float("-inf"))
            shared.topk = select_topk(scores.detach(), self.index_topk)
            shared.topk_source = self.layer_id
            if ctx.training_losses:
                # the KL's entry set (config `indexer_kl_set`): this layer's top-k, or all it may select
                kl_set = allowed if self.kl_set == "allowed" else topk_mask(shared.topk, allowed.size(-1)) & allowed
                if ctx.query_mask is not None:  # padding queries: no KL (their rows of the target are 0)
                    kl_set = kl_set & ctx.query_mask.unsqueeze(-1)
                n_queries = ctx.count_queries(kl_set.any(-1))
                ctx.indexer_losses.append(indexer_kl(q.detach(), kv.detach(), kl_set, scores, self.scale, n_queries))
        selected = topk_mask(shared.topk, slots.token.size(1)) & visible
        if ctx.trace is not None:
            ctx.trace.append(dict(layer=self.layer_id, mode=mode, kv_source=shared.kv_source, kv=kv,
                                  topk_source=shared.topk_source, topk=shared.topk, allowed=allowed,
                                  candidates=shared.candidates if mode == REINDEX else None,
                                  reused=mode == REUSE))
        return kv, selected

    def _candidates(self, scores: Tensor, visible: Tensor, slots) -> Tensor:
        """Candidate blocks of `candidate_block_size` entries, counted inside each document."""
        block_id, n_blocks = candidate_layout(slots, self.candidate_block_size)
        newest = newest_block(visible, block_id)
        keep = select_candidate_blocks(scores, block_id, n_blocks, newest, self.candidate_topk_blocks)
        return keep & visible  # the newest block is partly in the future: the pool stays visible


def candidate_layout(slots, block_size: int) -> tuple[Tensor, int]:
    """(block id of every slot (B, N), number of blocks): blocks of `block_size` entries counted
    inside each document (a document's first slot starts a block). The number of blocks is the static
    bound N (every block holds a slot): no host sync, shapes fixed by the slots' (torch.compile); the
    blocks past a row's last are empty, never kept (their score stays −inf)."""
    starts = slots.valid & (slots.group % block_size == 0)  # first slot of each block
    block_id = torch.where(slots.valid, starts.long().cumsum(1) - 1, torch.zeros_like(slots.group))
    return block_id, max(block_id.size(1), 1)


def newest_block(visible: Tensor, block_id: Tensor) -> Tensor:
    """(B, Tq) block holding each query's newest visible slot (−1 = none); visible (B, Tq, N) is a
    prefix of the query's document slots."""
    n = visible.size(-1)
    last = torch.where(visible, torch.arange(n, device=visible.device), -1).amax(-1)  # (B, Tq)
    return torch.where(last >= 0, block_id.gather(1, last.clamp(min=0)), torch.full_like(last, -1))
