"""Accounting: parameters, active parameters, KV-cache bytes and FLOPs, derived from a ModelConfig.

This is the report's summary table (SPEC §1, §6) recomputed from the config and the layer plan,
so a changed preset changes every number. Nothing here is a constant standing in for a result;
the only literals are storage-format facts (E2M1 is 4 bits, a scale is one byte, a BF16 value is
two bytes) and V4-Flash's published cache geometry (`V4FlashCache`), which is the baseline the
report compares against. Definitions and every assumption are in docs/accounting.md.

Parameter structure = the official state dict (SPEC §1a): `Param` rows named as the checkpoint
names them; routed experts are one row standing for E tensors. No torch: `dsv41 accounting` and
`dsv41 plan` stay instant.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from dsv41.config import ModelConfig, load_config
from dsv41.plan import FULL, REINDEX, REUSE, WINDOW, LayerPlan, decoder_kv_source, layer_plan

# ---------------------------------------------------------------------- storage formats
SCALE_BYTES = 1  # E4M3 and E8M0 scales are one byte each
BF16_BYTES = 2
KV_SCALE_BLOCK = 16  # main KV entry: one E4M3 scale per 16 channels (SPEC §1a)
INDEX_SCALE_BLOCK = 32  # index key: one E8M0 scale per 32 channels
WINDOW_SCALE_BLOCK = 32  # window slot: FP8 E4M3 values, one power-of-two scale per 32 channels


def fp4_entry_bytes(dim: int, block: int, scale_bytes: int = SCALE_BYTES) -> int:
    """Bytes of an E2M1 row: half a byte per channel + one scale per block. A torch-free twin of
    `dsv41.quant.fp4.fp4_entry_bytes` (tests check they agree), so accounting needs no torch."""
    if dim % 2 or dim % block:
        raise ValueError(f"fp4_entry_bytes: dim={dim} must be even and divisible by block={block}")
    return dim // 2 + dim // block * scale_bytes


def fp8_entry_bytes(dim: int, block: int, scale_bytes: int = SCALE_BYTES) -> int:
    """Bytes of an E4M3 row: one byte per channel + one scale per block (twin of quant.fp8's)."""
    if dim % block:
        raise ValueError(f"fp8_entry_bytes: dim={dim} must be divisible by block={block}")
    return dim + dim // block * scale_bytes


# ---------------------------------------------------------------------- parameter inventory
LINEAR, LOOKUP, VECTOR = "linear", "lookup", "vector"


@dataclass(frozen=True)
class Param:
    name: str  # official state-dict name; routed experts use "{e}" for the expert index
    shape: tuple[int, ...]
    group: str  # breakdown bucket: attention, compressor, indexer, gate, routed_experts, ...
    kind: str = LINEAR  # LINEAR (a matmul weight), LOOKUP (gathered rows), VECTOR (norm, bias, sink, ...)
    copies: int = 1  # routed experts: one row stands for this many tensors
    active_copies: int = 1  # how many of the copies run for one token

    @property
    def numel(self) -> int:
        return math.prod(self.shape) * self.copies

    @property
    def active(self) -> int:
        return math.prod(self.shape) * self.active_copies


def _p(name: str, shape: tuple[int, ...], group: str, kind: str = LINEAR) -> Param:
    return Param(name, shape, group, kind)


def _hc_and_norms(c: ModelConfig, pre: str) -> list[Param]:
    mix = (2 + c.hc_mult) * c.hc_mult
    out = []
    for sub in ("attn", "ffn"):
        out += [
            _p(f"{pre}hc_{sub}_fn", (mix, c.hc_mult * c.dim), "hc"),
            _p(f"{pre}hc_{sub}_base", (mix,), "hc", VECTOR),
            _p(f"{pre}hc_{sub}_scale", (3,), "hc", VECTOR),
            _p(f"{pre}{sub}_norm.weight", (c.dim,), "norms", VECTOR),
        ]
    return out


def _attention(c: ModelConfig, pre: str, plan: LayerPlan | None) -> list[Param]:
    hd = c.n_heads * c.head_dim
    out = [
        _p(f"{pre}attn.attn_sink", (c.n_heads,), "attention", VECTOR),
        _p(f"{pre}attn.wq_a.weight", (c.q_lora_rank, c.dim), "attention"),
        _p(f"{pre}attn.q_norm.weight", (c.q_lora_rank,), "attention", VECTOR),
        _p(f"{pre}attn.wq_b.weight", (hd, c.q_lora_rank), "attention"),
        _p(f"{pre}attn.wkv.weight", (c.head_dim, c.dim), "attention"),
        _p(f"{pre}attn.kv_norm.weight", (c.head_dim,), "attention", VECTOR),
        _p(f"{pre}attn.wo_a.weight", (c.o_groups * c.o_lora_rank, hd // c.o_groups), "attention"),
        _p(f"{pre}attn.wo_b.weight", (c.dim, c.o_groups * c.o_lora_rank), "attention"),
    ]
    if plan is not None and plan.mode == FULL:
        out.append(_p(f"{pre}attn.compressor.wkv.weight", (c.head_dim, c.dim), "compressor"))
        if plan.ratio > 1:
            out.append(_p(f"{pre}attn.compressor.wgate.weight", (c.head_dim, c.dim), "compressor"))
        out.append(_p(f"{pre}attn.compressor.norm.weight", (c.head_dim,), "compressor", VECTOR))
    if plan is not None and plan.mode in (FULL, REINDEX):
        out += [
            _p(f"{pre}attn.indexer.wq_b.weight", (c.index_n_heads * c.index_head_dim, c.q_lora_rank),
               "indexer"),
            _p(f"{pre}attn.indexer.weights_proj.weight", (c.index_n_heads, c.dim), "indexer"),
        ]
    if plan is not None and plan.mode == FULL:
        # index keys are a projection of the entry: they belong to global-KV production
        out += [
            _p(f"{pre}attn.indexer.wk.weight", (c.index_head_dim, c.head_dim), "index_keys"),
            _p(f"{pre}attn.indexer.k_norm.weight", (c.index_head_dim,), "index_keys", VECTOR),
        ]
    return out


def _moe(c: ModelConfig, pre: str, layer_id: int) -> list[Param]:
    n_routed, n_active = c.moe_config(layer_id)
    out = [
        _p(f"{pre}ffn.gate.weight", (n_routed, c.dim), "gate"),
        _p(f"{pre}ffn.gate.bias", (n_routed,), "gate", VECTOR),
    ]
    if c.vision_enabled:
        out.append(_p(f"{pre}ffn.gate.bias_vl", (n_routed,), "gate", VECTOR))
    for w, shape in (("w1", (c.moe_inter_dim, c.dim)), ("w2", (c.dim, c.moe_inter_dim)),
                     ("w3", (c.moe_inter_dim, c.dim))):
        out.append(Param(f"{pre}ffn.experts.{{e}}.{w}.weight", shape, "routed_experts", LINEAR,
                         copies=n_routed, active_copies=n_active))
        out.append(_p(f"{pre}ffn.shared_experts.{w}.weight", shape, "shared_experts"))
    return out


def block_params(c: ModelConfig, plan: LayerPlan) -> list[Param]:
    """One backbone block without its Engram module."""
    pre = f"layers.{plan.layer_id}."
    return _hc_and_norms(c, pre) + _attention(c, pre, plan) + _moe(c, pre, plan.layer_id)


def engram_params(c: ModelConfig, layer_id: int) -> list[Param]:
    """The Engram module applied before block `layer_id`."""
    k = c.engram_layer_ids.index(layer_id)
    pre = f"layers.{layer_id}.engram."
    cols = c.n_engram_hash_cols * c.engram_head_dim
    return [
        _p(f"{pre}embed.weight", (c.engram_num_embeddings[k], c.engram_head_dim), "engram_tables", LOOKUP),
        _p(f"{pre}wkv.weight", ((c.hc_mult + 1) * c.dim, cols), "engram_wkv"),
        _p(f"{pre}q_weight", (c.hc_mult, c.dim), "engram_gate", VECTOR),  # elementwise, per stream
        _p(f"{pre}k_weight", (c.hc_mult, c.dim), "engram_gate", VECTOR),
    ]


def text_params(c: ModelConfig) -> list[Param]:
    return [_p("embed.weight", (c.vocab_size, c.dim), "embed", LOOKUP),
            _p("norm.weight", (c.dim,), "final_norm", VECTOR),
            _p("head.weight", (c.vocab_size, c.dim), "head")]


def dspark_params(c: ModelConfig) -> list[Param]:
    """DSpark draft stages (`mtp.{k}.*`): window-only blocks with their own expert count, stage 0's
    input projection of the target layers, and the last stage's norm, Markov and confidence heads."""
    if not c.dspark_block_size:
        return []
    out: list[Param] = []
    for k in range(c.n_mtp_layers):
        layer_id = c.n_layers + k
        pre = f"mtp.{k}."
        out += _hc_and_norms(c, pre) + _attention(c, pre, None) + _moe(c, pre, layer_id)
        if k == 0:
            n_targets = len(c.dspark_target_layer_ids)
            out += [_p(f"{pre}main_proj.weight", (c.dim, c.dim * n_targets), "dspark_heads"),
                    _p(f"{pre}main_norm.weight", (c.dim,), "dspark_heads", VECTOR)]
        if k == c.n_mtp_layers - 1:
            r = c.dspark_markov_rank
            out += [_p(f"{pre}norm.weight", (c.dim,), "dspark_heads", VECTOR),
                    _p(f"{pre}markov_head.embed.weight", (c.vocab_size, r), "dspark_heads", LOOKUP),
                    _p(f"{pre}markov_head.head.weight", (c.vocab_size, r), "dspark_heads"),
                    _p(f"{pre}confidence_head.proj.weight", (1, c.dim + r), "dspark_heads")]
    return out


def vision_params(c: ModelConfig) -> list[Param]:
    """DeepSeek-ViT, the aligner and the span embeddings, named and shaped as the release's tensors
    (`dsv41.model.vision` lists them and their source): a linear patch embedding 3·p² → D with bias;
    per layer RMSNorm, fused `wqkv` D → 3D and `wo` D → D, both with bias, RMSNorm, bias-free SwiGLU
    (`w1` D → 2I = [gate | up], `w2` I → D); a final RMSNorm; the aligner after the r×r unshuffle
    r²·D → dim → dim with biases; the learned start / end / newline embeddings (dim each)."""
    if not c.vision_enabled:
        return []
    d, inter, pre = c.vision_dim, c.vision_inter_dim, "vision."
    out = [_p(f"{pre}patch_embed.proj.weight", (d, 3 * c.vision_patch_size ** 2), "vit"),
           _p(f"{pre}patch_embed.proj.bias", (d,), "vit", VECTOR)]
    for i in range(c.vision_n_layers):
        lp = f"{pre}blocks.{i}."
        out += [_p(f"{lp}norm1.weight", (d,), "vit", VECTOR),
                _p(f"{lp}attn.wqkv.weight", (3 * d, d), "vit"), _p(f"{lp}attn.wqkv.bias", (3 * d,), "vit", VECTOR),
                _p(f"{lp}attn.wo.weight", (d, d), "vit"), _p(f"{lp}attn.wo.bias", (d,), "vit", VECTOR),
                _p(f"{lp}norm2.weight", (d,), "vit", VECTOR),
                _p(f"{lp}mlp.w1.weight", (2 * inter, d), "vit"), _p(f"{lp}mlp.w2.weight", (d, inter), "vit")]
    out.append(_p(f"{pre}norm.weight", (d,), "vit", VECTOR))
    unshuffled = c.vision_downsample_ratio ** 2 * d
    out += [_p("aligner.w1.weight", (c.dim, unshuffled), "aligner"), _p("aligner.w1.bias", (c.dim,), "aligner", VECTOR),
            _p("aligner.w2.weight", (c.dim, c.dim), "aligner"), _p("aligner.w2.bias", (c.dim,), "aligner", VECTOR)]
    out += [_p(name, (c.dim,), "image_embeds", VECTOR) for name in ("image_start", "image_end", "image_newline")]
    return out


def _total(params: list[Param]) -> int:
    return sum(p.numel for p in params)


def _active(params: list[Param]) -> int:
    return sum(p.active for p in params)


def _by_group(params: list[Param], attr: str = "numel") -> dict[str, int]:
    out: dict[str, int] = {}
    for p in params:
        out[p.group] = out.get(p.group, 0) + getattr(p, attr)
    return out


def _producer(params: list[Param]) -> list[Param]:
    """Global-KV production of a kv-source layer: attn_norm, compressor, index-key projection."""
    return [p for p in params
            if p.group in ("compressor", "index_keys") or p.name.endswith(".attn_norm.weight")]


# ---------------------------------------------------------------------- KV cache
@dataclass(frozen=True)
class V4FlashCache:
    """DeepSeek-V4-Flash's cache geometry, from its public config.json and inference code — the
    baseline the report compares against (SPEC §6). Not derived from our config."""

    n_layers: int = 43
    compress_ratios: tuple[int, ...] = (0, 0) + (4, 128) * 20 + (4,)  # 21 layers at m=4, 20 at m=128
    indexed_ratios: tuple[int, ...] = (4,)  # CSA layers (m=4) own a lightning indexer; HCA (m=128) do not
    nope_dims: int = 448  # FP8 E4M3 channels
    nope_scale_bytes: int = 8  # 7 E8M0 scales (one per 64 channels) padded to 8 bytes
    rope_dims: int = 64  # kept in BF16
    index_head_dim: int = 128  # FP4 index keys, E8M0 scale per 32
    window_size: int = 128  # SWA slots in every layer, same entry format as the main KV

    @property
    def main_entry_bytes(self) -> int:
        return self.nope_dims + self.nope_scale_bytes + self.rope_dims * BF16_BYTES

    @property
    def index_entry_bytes(self) -> int:
        return fp4_entry_bytes(self.index_head_dim, INDEX_SCALE_BLOCK)

    @property
    def global_bytes_per_token(self) -> float:
        total = Fraction(0)
        for m in self.compress_ratios:
            if m:
                idx = self.index_entry_bytes if m in self.indexed_ratios else 0
                total += Fraction(self.main_entry_bytes + idx, m)
        return float(total)

    @property
    def window_snapshot_bytes(self) -> int:
        """One saved SWA state: every layer's window."""
        return self.n_layers * self.window_size * self.main_entry_bytes

    def persistent_bytes_per_token(self, unit_tokens: int) -> float:
        """Global KV + two window snapshots (end of prompt, end of output) per saved unit."""
        return self.global_bytes_per_token + 2 * self.window_snapshot_bytes / unit_tokens


def entry_bytes(c: ModelConfig) -> dict[str, int]:
    return {
        "main": fp4_entry_bytes(c.head_dim, KV_SCALE_BLOCK),
        "index_key": fp4_entry_bytes(c.index_head_dim, INDEX_SCALE_BLOCK),
        "window_slot": fp8_entry_bytes(c.head_dim, WINDOW_SCALE_BLOCK),
    }


def _json_number(x: Fraction) -> int | float:
    return int(x) if x.denominator == 1 else float(x)


def global_kv_by_source(c: ModelConfig) -> dict[int, Fraction]:
    """Bytes per token each kv-source (Full) layer keeps: (main + index-key entry) / m."""
    e = entry_bytes(c)
    entry = e["main"] + e["index_key"]
    return {p.layer_id: Fraction(entry, p.ratio) for p in layer_plan(c) if p.mode == FULL}


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


# ---------------------------------------------------------------------- the table
REPORT = {  # the report's own figures (SPEC §1), printed beside ours for v41-flash only
    "backbone_params": 552e9,
    "engram_params": 196e9,
    "active_params_prefill": 8e9,
    "active_params_decode": 16e9,
    "global_kv_bytes_per_token": 890,
    "v4_global_kv_bytes_per_token": 3514,
    "v4_global_ratio": 4.0,  # "≈ ¼ of V4-Flash"
    "v4_persistent_ratio": 8.0,  # "≈ ⅛ of V4-Flash"
    "decode_flops_growth": 0.25,  # "4K → 1M raises decode FLOPs by only ≈ 25%"
}
PERSISTENT_UNITS = (512, 1024, 2048, 4096, 16384)  # saved-unit lengths for the persistent comparison


def compute(config: ModelConfig) -> dict[str, Any]:
    """Every accounting figure of a config as a JSON-safe dict (keys documented in docs/accounting.md)."""
    c = config
    plans = layer_plan(c)
    text = text_params(c)
    blocks = {p.layer_id: block_params(c, p) for p in plans}
    backbone_list = text + [q for ps in blocks.values() for q in ps]
    backbone = _total(backbone_list)

    engram_list = [q for i in c.engram_layer_ids for q in engram_params(c, i)]
    gathered = c.n_engram_hash_cols * c.engram_head_dim  # one row per hash id
    engram_active = sum(gathered + _total([q for q in engram_params(c, i) if q.kind != LOOKUP])
                        for i in c.engram_layer_ids)

    embed = _total([q for q in text if q.group == "embed"])
    head_norm = _total([q for q in text if q.group != "embed"])
    layers_active = {i: _active(ps) for i, ps in blocks.items()}
    decode_active = embed + sum(layers_active.values()) + head_norm
    encoder_active = sum(layers_active[p.layer_id] for p in plans if p.half == "encoder")
    src = decoder_kv_source(c)
    producer = _total(_producer(blocks[src])) if src is not None else 0
    prefill_active = embed + encoder_active + producer

    kv_sources = global_kv_by_source(c)
    global_kv = sum(kv_sources.values(), Fraction(0))
    e = entry_bytes(c)
    v4 = V4FlashCache()
    persistent = [
        {"unit_tokens": u, "v4_bytes_per_token": v4.persistent_bytes_per_token(u),
         "ours_bytes_per_token": _json_number(global_kv),
         "ratio": v4.persistent_bytes_per_token(u) / float(global_kv) if global_kv else None}
        for u in PERSISTENT_UNITS
    ]
    # unit length up to which V4's persistent bytes are ≥ 8× ours
    gap = 8 * float(global_kv) - v4.global_bytes_per_token
    units_8x = (2 * v4.window_snapshot_bytes / gap if gap > 0 else math.inf) if global_kv else None

    contexts = decode_contexts(c)
    decode = {str(n): decode_flops(c, n) for n in contexts}
    growth = decode[str(contexts[-1])]["total"] / decode[str(contexts[0])]["total"] - 1
    costs = _layer_costs(c)
    indexer_by_half = {
        str(n): {half: _flops_over(c, [lc for lc in costs if lc.plan.half == half], n - 1, n)["indexer"]
                 for half in ("encoder", "decoder")}
        for n in contexts
    }
    prefill = {str(n): prefill_flops(c, n) for n in prefill_lengths(c)}

    dspark = dspark_params(c)
    vision = vision_params(c)
    return {
        "backbone_params": backbone,
        "backbone_breakdown": _by_group(backbone_list),
        "engram_params": _total(engram_list),
        "engram_breakdown": _by_group(engram_list),
        "engram_params_per_layer": {str(i): _total(engram_params(c, i)) for i in c.engram_layer_ids},
        "engram_active_params": engram_active,
        "active_params_decode": decode_active,
        "active_decode_breakdown": {"embed": embed, "layers": sum(layers_active.values()),
                                    "norm_and_head": head_norm},
        "active_params_prefill": prefill_active,
        "active_prefill_breakdown": {"embed": embed, "encoder_layers": encoder_active,
                                     "decoder_global_kv_producer": producer},
        "per_layer": [{"layer": p.layer_id, "half": p.half, "mode": p.mode,
                       "params": _total(blocks[p.layer_id]), "active_params": layers_active[p.layer_id]}
                      for p in plans],
        "dspark_params": _total(dspark),
        "dspark_breakdown": _by_group(dspark),
        "vision_params": _total(vision),
        "vision_breakdown": _by_group(vision),
        "entry_bytes": e,
        "global_kv_bytes_per_token": _json_number(global_kv),
        "global_kv_by_source": {str(i): _json_number(b) for i, b in kv_sources.items()},
        "window_kv_bytes_per_sequence": c.n_layers * c.window_size * e["window_slot"],
        "v4_flash": {
            "main_entry_bytes": v4.main_entry_bytes,
            "index_entry_bytes": v4.index_entry_bytes,
            "global_kv_bytes_per_token": v4.global_bytes_per_token,
            "window_snapshot_bytes": v4.window_snapshot_bytes,
            "global_ratio": v4.global_bytes_per_token / float(global_kv) if global_kv else None,
            "persistent": persistent,
            "unit_tokens_at_8x": units_8x,
        },
        "decode_flops": decode,
        "decode_flops_growth": growth,
        "decode_flops_growth_contexts": [contexts[0], contexts[-1]],
        "decode_indexer_flops_by_half": indexer_by_half,
        "prefill_flops": prefill,
    }


# ---------------------------------------------------------------------- printing
def _is_published(c: ModelConfig) -> bool:
    return c == load_config("v41-flash")


def _fmt_params(n: float) -> str:
    for div, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{suffix}"
    return f"{n:g}"


def _flop_unit(values: list[float]) -> tuple[float, str]:
    top = max(values, default=0.0)
    for div, name in ((1e12, "TFLOP"), (1e9, "GFLOP"), (1e6, "MFLOP"), (1e3, "KFLOP")):
        if top >= div:
            return div, name
    return 1.0, "FLOP"


def _short(n: int) -> str:
    for div, suffix in ((1 << 20, "M"), (1 << 10, "K")):
        if n >= div and n % div == 0:
            return f"{n // div}{suffix}"
    return str(n)


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) if j == 0 else cell.rjust(w)
                       for j, (cell, w) in enumerate(zip(r, widths))).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def format_report(config: ModelConfig, published: bool | None = None) -> str:
    """The accounting as text; beside each figure the report's own when the config is v41-flash."""
    c = config
    r = compute(c)
    pub = _is_published(c) if published is None else published
    v4 = r["v4_flash"]
    ours_ratio_8x = r["v4_flash"]["persistent"]

    head = ("quantity", "ours", "report", "diff") if pub else ("quantity", "ours")
    rows: list[tuple[str, ...]] = [head]

    def row(label: str, ours: float, shown: str, key: str | None = None, fmt=None) -> None:
        if not pub:
            rows.append((label, shown))
            return
        ref = REPORT.get(key) if key else None
        if ref is None:
            rows.append((label, shown, "", ""))
        else:
            rows.append((label, shown, fmt(ref) if fmt else str(ref), f"{(ours - ref) / ref * 100:+.2f}%"))

    for label, key, in_report in (
        ("backbone params", "backbone_params", True),
        ("Engram params", "engram_params", True),
        ("active params / token, prefill", "active_params_prefill", True),
        ("active params / token, decode", "active_params_decode", True),
        ("Engram active params / token", "engram_active_params", False),
        ("DSpark params (not backbone)", "dspark_params", False),
        ("vision params (not backbone)", "vision_params", False),
    ):
        row(label, r[key], _fmt_params(r[key]), key if in_report else None, _fmt_params)
    g = r["global_kv_bytes_per_token"]
    row("global KV bytes / token", g, f"{g:g}", "global_kv_bytes_per_token", lambda x: f"{x:g}")
    row("V4-Flash global KV bytes / token", v4["global_kv_bytes_per_token"],
        f"{v4['global_kv_bytes_per_token']:.2f}", "v4_global_kv_bytes_per_token", lambda x: f"{x:g}")
    if v4["global_ratio"]:
        row("V4-Flash / ours, global KV", v4["global_ratio"], f"{v4['global_ratio']:.2f}x", "v4_global_ratio",
            lambda x: f"{x:g}x")
    for p in ours_ratio_8x:
        if p["ratio"]:
            row(f"V4-Flash / ours, persistent ({_short(p['unit_tokens'])}-token units)", p["ratio"],
                f"{p['ratio']:.2f}x", "v4_persistent_ratio", lambda x: f"{x:g}x")
    n0, n1 = r["decode_flops_growth_contexts"]
    growth = r["decode_flops_growth"]
    row(f"decode FLOPs growth {_short(n0)} -> {_short(n1)}", growth, f"{growth * 100:+.1f}%")
    if pub:  # the growth's "diff" is in percentage points, not relative
        rows[-1] = rows[-1][:2] + (f"{REPORT['decode_flops_growth'] * 100:+.0f}%",
                                   f"{(growth - REPORT['decode_flops_growth']) * 100:+.1f} pp")

    lines = [f"dsv41 accounting ({'v41-flash, with the report' if pub else 'custom config'})", ""]
    lines += _table(rows)
    u8 = v4["unit_tokens_at_8x"]
    if u8 is not None:
        lines.append("")
        lines.append(f"persistent KV: V4-Flash needs >= 8x ours for saved units up to {u8:,.0f} tokens"
                     if math.isfinite(u8) else
                     "persistent KV: V4-Flash needs >= 8x ours at every unit length")

    lines += ["", "entry bytes: " + ", ".join(f"{k} {v}" for k, v in r["entry_bytes"].items()),
              "global KV by kv-source layer (bytes/token): "
              + ", ".join(f"L{k} {v:g}" for k, v in r["global_kv_by_source"].items()),
              f"window KV per sequence: {r['window_kv_bytes_per_sequence']:,} bytes", ""]

    comp = ("matmul", "attention", "indexer", "compressor", "mixing", "engram")
    div, unit = _flop_unit([d["total"] for d in r["decode_flops"].values()])
    rows = [(f"decode {unit}/token @ context", *comp, "total")]
    for n, d in r["decode_flops"].items():
        rows.append((_short(int(n)), *(f"{d[k] / div:.3f}" for k in comp), f"{d['total'] / div:.3f}"))
    lines += _table(rows)
    halves = r["decode_indexer_flops_by_half"]
    lines += ["indexer by half (" + unit + "): " + "; ".join(
        f"{_short(int(n))} encoder {h['encoder'] / div:.3f}, decoder {h['decoder'] / div:.3f}"
        for n, h in halves.items()), ""]
    div, unit = _flop_unit([d["exact_per_token"] for d in r["prefill_flops"].values()])
    rows = [(f"prefill {unit}/token @ prompt", "exact (all layers)", "encoder-only", "ratio")]
    for n, d in r["prefill_flops"].items():
        rows.append((_short(int(n)), f"{d['exact_per_token'] / div:.3f}",
                     f"{d['encoder_only_per_token'] / div:.3f}", f"{d['ratio']:.2f}x"))
    lines += _table(rows) + [""]
    bd = r["backbone_breakdown"]
    lines.append("backbone by part: " + ", ".join(f"{k} {_fmt_params(v)}" for k, v in bd.items()))
    modes = {m: sum(1 for p in r["per_layer"] if p["mode"] == m) for m in (WINDOW, FULL, REINDEX, REUSE)}
    lines.append("layers by mode: " + ", ".join(f"{k} {v}" for k, v in modes.items()))
    return "\n".join(lines)
