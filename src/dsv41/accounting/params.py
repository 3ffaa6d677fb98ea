"""Parameter inventory: every tensor of the official state dict as a `Param` row (name, shape, group).

Rows are named as the checkpoint names them (SPEC §1a); routed experts are one row standing for E
tensors (`copies`, `active_copies`). Torch-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dsv41.config import ModelConfig
from dsv41.plan import FULL, REINDEX, LayerPlan

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
    (`dsv41.model.vision` lists them and their source; SPEC §5 "Vision"): a linear patch embedding
    3·p² → D with bias; per layer RMSNorm, fused `wqkv` D → 3D and `wo` D → D, both with bias, RMSNorm,
    bias-free SwiGLU (`w1` D → 2I = [gate | up], `w2` I → D); a final RMSNorm; the aligner after the
    r×r unshuffle r²·D → dim → dim with biases; the learned start / end / newline embeddings (dim
    each). With these the release-format bytes equal the release's index total exactly
    (docs/checkpoint.md)."""
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

