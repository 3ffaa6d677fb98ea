"""FLOPs per token in decode (by context) and prefill (exact all-layer vs encoder-only), by kind.

Every assumption is in docs/accounting.md ("FLOPs: every assumption"). Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dsv41.accounting.params import LINEAR, block_params, engram_params
from dsv41.config import ModelConfig
from dsv41.plan import FULL, REINDEX, LayerPlan, decoder_kv_source, layer_plan


# ---------------------------------------------------------------------- FLOPs
def _sum_floor(n: int, m: int) -> int:
    """Σ_{u=1..n} ⌊u/m⌋ in closed form."""
    if n <= 0:
        return 0
    q, r = divmod(n, m)
    return m * q * (q - 1) // 2 + q * (r + 1)


def sum_visible(n_tokens: int, m: int, cap: int | None = None) -> int:
    """Σ over query positions t = 0..n_tokens-1 of min(cap, ⌊(t+1)/m⌋): the entries (or, with m = 1,
    window keys) each query sees, summed in closed form."""
    if cap is None:
        return _sum_floor(n_tokens, m)
    if cap <= 0:
        return 0
    uncapped = min(n_tokens, cap * m - 1)  # ⌊u/m⌋ < cap for u < cap·m
    return _sum_floor(uncapped, m) + cap * max(0, n_tokens - uncapped)


def _sum_visible_range(t0: int, t1: int, m: int, cap: int | None = None) -> int:
    """Σ over t = t0..t1-1 of min(cap, ⌊(t+1)/m⌋)."""
    return sum_visible(t1, m, cap) - sum_visible(t0, m, cap)


@dataclass
class _LayerCost:
    """FLOPs of one layer for one token, split by kind (position-independent parts)."""

    matmul: int  # 2 × active linear weights (query, output, window KV, indexer query, gate, experts, mHC)
    compressor: float  # compressor linears (+ pooling) + index-key projection per entry
    mixing: int  # mHC pre/post mixing contractions
    engram: int
    plan: LayerPlan = field(repr=False)


def _layer_costs(c: ModelConfig) -> list[_LayerCost]:
    out = []
    for plan in layer_plan(c):
        params = block_params(c, plan)
        matmul = 2 * sum(p.active for p in params
                         if p.kind == LINEAR and p.group not in ("compressor", "index_keys"))
        comp = 0
        if plan.mode == FULL:
            comp = 2 * sum(p.numel for p in params if p.kind == LINEAR and p.group == "compressor")
            if plan.ratio > 1:
                comp += 2 * c.head_dim  # weighted sum of the m latents (one multiply-add per channel)
            wk = sum(p.numel for p in params if p.kind == LINEAR and p.group == "index_keys")
            comp += 2 * wk / plan.ratio  # one index key per completed entry
        # hc_pre (n MACs/channel) and hc_post (n² + n) for each of the two sublayers
        mixing = 2 * 2 * c.dim * (c.hc_mult + c.hc_mult ** 2 + c.hc_mult)
        engram = 0
        if plan.engram:
            ep = engram_params(c, plan.layer_id)
            engram = 2 * sum(p.numel for p in ep if p.kind == LINEAR) + 2 * c.hc_mult * c.dim
        out.append(_LayerCost(matmul, comp, mixing, engram, plan))
    return out


def _attention_keys(c: ModelConfig, plan: LayerPlan, t0: int, t1: int,
                    replay_start: int | None = None) -> int:
    """Σ over queries t in [t0, t1) of (window keys + selected entries)."""
    if replay_start is None:
        window = _sum_visible_range(t0, t1, 1, c.window_size)
    else:  # bounded replay: query i sees window keys in [max(s, i-W+1), i]
        w = c.window_size
        window = sum_visible(t1 - replay_start, 1, w) - sum_visible(t0 - replay_start, 1, w)
    selected = _sum_visible_range(t0, t1, plan.ratio, c.index_topk) if plan.ratio else 0
    return window + selected


def _indexer_entries(c: ModelConfig, plan: LayerPlan, t0: int, t1: int) -> int:
    """Σ over queries t in [t0, t1) of the entries this layer's indexer scores."""
    if plan.mode == FULL or (plan.mode == REINDEX and not plan.uses_candidates):
        return _sum_visible_range(t0, t1, plan.ratio)
    if plan.mode == REINDEX:
        pool = c.candidate_topk_blocks * c.candidate_block_size
        return _sum_visible_range(t0, t1, plan.ratio, pool)
    return 0  # window-only and Reuse layers run no indexer


def _flops_over(c: ModelConfig, costs: list[_LayerCost], t0: int, t1: int, *, with_compressor: bool = True,
                replay_start: int | None = None) -> dict[str, float]:
    """Total FLOPs of `costs`' layers for queries t0..t1-1 (all tokens of the range run each layer)."""
    n = t1 - t0
    attn_per_key = 4 * c.n_heads * c.head_dim  # q·k and p·v, one multiply-add each per channel per head
    index_per_entry = 2 * c.index_n_heads * (c.index_head_dim + 1)  # q·k per head + weighted head sum
    tot = dict.fromkeys(("matmul", "attention", "indexer", "compressor", "mixing", "engram"), 0.0)
    for lc in costs:
        tot["matmul"] += n * lc.matmul
        tot["mixing"] += n * lc.mixing
        tot["engram"] += n * lc.engram
        if with_compressor:
            tot["compressor"] += n * lc.compressor
        tot["attention"] += attn_per_key * _attention_keys(c, lc.plan, t0, t1, replay_start)
        tot["indexer"] += index_per_entry * _indexer_entries(c, lc.plan, t0, t1)
    return tot


def _head_flops(c: ModelConfig) -> int:
    return 2 * c.vocab_size * c.dim


def decode_contexts(c: ModelConfig) -> list[int]:
    """Context lengths for decode FLOPs: max/256, max/16, max (4K, 64K, 1M for v41-flash)."""
    return sorted({max(1, c.max_seq_len >> 8), max(1, c.max_seq_len >> 4), c.max_seq_len})


def prefill_lengths(c: ModelConfig) -> list[int]:
    """Prompt lengths for prefill FLOPs: max/32, max/8, max (32K, 128K, 1M for v41-flash)."""
    return sorted({max(1, c.max_seq_len >> 5), max(1, c.max_seq_len >> 3), c.max_seq_len})


def decode_flops(c: ModelConfig, context: int) -> dict[str, float]:
    """FLOPs to decode one token at position context-1 through all layers, plus the head."""
    out = _flops_over(c, _layer_costs(c), context - 1, context)
    out["matmul"] += _head_flops(c)
    out["total"] = sum(out.values())
    return out


def prefill_flops(c: ModelConfig, n_tokens: int) -> dict[str, Any]:
    """Per-prompt-token FLOPs of a cold prefill of n_tokens: `exact` (every layer over every token,
    what training and the reference do) vs `encoder_only` (CED, SPEC §2: encoder over every token,
    the decoder's global-KV producer over every token, the decoder over the last n_win tokens with
    bounded replay). The head runs once, for the first logits, in both."""
    costs = _layer_costs(c)
    enc = [lc for lc in costs if lc.plan.half == "encoder"]
    dec = [lc for lc in costs if lc.plan.half == "decoder"]
    exact = _flops_over(c, costs, 0, n_tokens)
    exact["matmul"] += _head_flops(c)

    ours = _flops_over(c, enc, 0, n_tokens)
    src = decoder_kv_source(c)
    producer = sum(lc.compressor for lc in dec if lc.plan.layer_id == src) * n_tokens
    n_win = min(c.window_size, n_tokens)
    start = n_tokens - n_win
    replay = _flops_over(c, dec, start, n_tokens, with_compressor=False, replay_start=start)
    for k, v in replay.items():
        ours[k] += v
    ours["compressor"] += producer
    ours["matmul"] += _head_flops(c)

    exact_total, ours_total = sum(exact.values()), sum(ours.values())
    return {
        "exact_per_token": exact_total / n_tokens,
        "encoder_only_per_token": ours_total / n_tokens,
        "ratio": exact_total / ours_total,
        "exact_breakdown_per_token": {k: v / n_tokens for k, v in exact.items()},
        "encoder_only_breakdown_per_token": {k: v / n_tokens for k, v in ours.items()},
    }

