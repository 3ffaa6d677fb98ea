"""Every constant of SPEC §1a (the official release) and §7 (the training recipe), pinned to where the code
takes it from: the `v41-flash` preset / ModelConfig fields, the modules built from them, the quantization
formats (bytes of real packed rows), the accounting, the optimizer defaults and `build_optimizer`'s groups,
the TrainConfig defaults and the report schedule. One row per fact; each row's id names the SPEC line.

The expected values are written out from SPEC.md by hand — never read back from the code.
"""

from __future__ import annotations

import functools
import inspect
import math

import pytest
import torch

from dsv41 import load_config
from dsv41.accounting import compute
from dsv41.model.attention import Attention
from dsv41.model.engram import Engram
from dsv41.model.transformer import Block, Transformer
from dsv41.optim import LRSchedule, build_optimizer
from dsv41.optim.muon import POLISH, QUINTIC, Muon, muon_scale, newton_schulz
from dsv41.optim.sinkhorn import SinkhornBalanced, sinkhorn_balance
from dsv41.plan import FULL, REINDEX, WINDOW, layer_plan
from dsv41.quant import fake_quant_index_fp4, fake_quant_kv_fp4, fake_quant_window_fp8, quantize_fp4, quantize_fp8
from dsv41.quant.fp4 import dequantize_fp4
from dsv41.quant.fp8 import dequantize_fp8
from dsv41.train.trainer import TrainConfig


# ---------------------------------------------------------------------- sources (built once)
@functools.cache
def flash():
    return load_config("v41-flash")


@functools.cache
def flash_attention(layer_id: int) -> Attention:
    with torch.device("meta"):
        return Attention(flash(), layer_plan(flash())[layer_id])


@functools.cache
def flash_block() -> Block:
    """Block 14 of v41-flash (Full, Engram) with 6 experts instead of 384 (routing shapes only differ)."""
    c = flash().replace(n_routed_experts=6)
    with torch.device("meta"):
        return Block(c, layer_plan(c)[14])


@functools.cache
def flash_engram() -> Engram:
    with torch.device("meta"):
        return Engram(flash(), 14)


@functools.cache
def tiny_optimizer():
    model = Transformer(load_config("tiny"))
    return model, build_optimizer(model, lr=1.0)


def group_of(kind: str, name: str) -> dict:
    """The param group of optimizer `kind` holding the parameter named `name` in the tiny model."""
    model, opt = tiny_optimizer()
    p = dict(model.named_parameters())[name]
    (group,) = [g for g in opt[kind].param_groups if any(q is p for q in g["params"])]
    return group


def settings(kind: str, name: str, *keys: str) -> tuple:
    group = group_of(kind, name)
    return tuple(group[k] for k in keys)


def assigned(kind: str) -> list[str]:
    return sorted(n for n, (_, a) in tiny_optimizer()[1].summary.assignments.items() if a.optimizer == kind)


def defaults(fn) -> dict:
    return {k: v.default for k, v in inspect.signature(fn).parameters.items() if v.default is not inspect._empty}


def modes(kind: str) -> list[int]:
    return [p.layer_id for p in layer_plan(flash()) if p.mode == kind]


def row_bytes(*parts: torch.Tensor) -> int:
    """Bytes of one stored row: the per-row sizes of a quantizer's outputs."""
    return sum(p[0].numel() * p.element_size() for p in parts)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a, b)


# rows whose 16-channel blocks differ in magnitude by up to 10^6: a different block size or scale kind
# changes the quantized values (for E4M3 a power-of-two scale otherwise cancels out)
_g = torch.Generator().manual_seed(0)
X512 = torch.randn(4, 512, generator=_g) * 10 ** torch.empty(4, 32, 1).uniform_(-4, 2, generator=_g).repeat(
    1, 1, 16).flatten(1)  # (4, 512)
X128 = X512[:, :128]

# (SPEC line, value from its source, the value SPEC states)
ROWS = [
    # §1 / §1a configuration table
    ("§1a dim / hidden size d", lambda: flash().dim, 5120),
    ("§1a moe_inter_dim", lambda: flash().moe_inter_dim, 2304),
    ("§1a n_layers", lambda: flash().n_layers, 40),
    ("§1 encoder = layers 0-19", lambda: flash().encoder_layers, 20),
    ("§1a n_heads", lambda: flash().n_heads, 64),
    ("§1a head_dim", lambda: flash().head_dim, 512),
    ("§1a rope_head_dim", lambda: flash().rope_head_dim, 64),
    ("§1a q_lora_rank", lambda: flash().q_lora_rank, 1280),
    ("§1a o_lora_rank", lambda: flash().o_lora_rank, 1024),
    ("§1a o_groups", lambda: flash().o_groups, 8),
    ("§1a n_routed experts", lambda: flash().n_routed_experts, 384),
    ("§1a n_shared experts", lambda: flash().n_shared_experts, 1),
    ("§1a n_activated experts", lambda: flash().n_activated_experts, 6),
    ("§1a score_func", lambda: flash().score_func, "sqrtsoftplus"),
    ("§1a route_scale", lambda: flash().route_scale, 1.5),
    ("§1a norm_topk_prob", lambda: flash().norm_topk_prob, True),
    ("§1a swiglu_limit", lambda: flash().swiglu_limit, 10.0),
    ("§1a norm_eps", lambda: flash().norm_eps, 1e-20),
    ("§1a hc_eps", lambda: flash().hc_eps, 1e-6),
    ("§1a hc_mult", lambda: flash().hc_mult, 4),
    ("§1a hc_sinkhorn_iters", lambda: flash().hc_sinkhorn_iters, 20),
    ("§1a window_size", lambda: flash().window_size, 128),
    ("§1a compress_ratios (backbone)", lambda: flash().compress_ratios[:40], [0, 0] + [2] * 18 + [1] * 20),
    ("§1a compress_ratios (3 DSpark stages window-only)", lambda: flash().compress_ratios[40:], [0, 0, 0]),
    ("§1a kv_source_layers", lambda: flash().kv_source_layers, [2, 8, 14, 20]),
    ("§1a index_source_layers", lambda: flash().index_source_layers, [2, 8, 14, 20, 24, 28, 32, 36]),
    ("§1 Full layers 2, 8, 14, 20", lambda: modes(FULL), [2, 8, 14, 20]),
    ("§1 Reindex layers 24, 28, 32, 36", lambda: modes(REINDEX), [24, 28, 32, 36]),
    ("§1 layers 0, 1 window only", lambda: modes(WINDOW), [0, 1]),
    ("§1a candidate_source_layer", lambda: flash().candidate_source_layer, 20),
    ("§1a candidate_topk_blocks", lambda: flash().candidate_topk_blocks, 2048),
    ("§1a candidate_block_size", lambda: flash().candidate_block_size, 8),
    ("§1a index_n_heads", lambda: flash().index_n_heads, 32),
    ("§1a index_head_dim", lambda: flash().index_head_dim, 128),
    ("§1a index_topk", lambda: flash().index_topk, 512),
    ("§1a rope_theta (window-only layers)", lambda: flash().rope_theta, 10000.0),
    ("§1a compress_rope_theta", lambda: flash().compress_rope_theta, 160000.0),
    ("§1a YaRN factor", lambda: flash().rope_factor, 16.0),
    ("§1a YaRN original_seq_len", lambda: flash().original_seq_len, 65536),
    ("§1a YaRN beta_fast", lambda: flash().beta_fast, 32),
    ("§1a YaRN beta_slow", lambda: flash().beta_slow, 1),
    ("§1a max context", lambda: flash().max_seq_len, 1_048_576),
    ("§1a engram layers 1 and 14", lambda: flash().engram_layer_ids, [1, 14]),
    ("§1a engram max n-gram 4", lambda: flash().engram_max_ngram_size, 4),
    ("§1a engram 8 heads", lambda: flash().engram_n_heads, 8),
    ("§1a engram 256 dims per head", lambda: flash().engram_head_dim, 256),
    ("§1a engram bucket search from 16,000,000", lambda: flash().engram_vocab_size, 16_000_000),
    ("§1a engram compressed vocab 99,092", lambda: flash().engram_compressed_vocab_size, 99_092),
    ("§1a engram pad id 2", lambda: flash().engram_pad_id, 2),
    ("§1a dspark block size 5", lambda: flash().dspark_block_size, 5),
    ("§1a dspark 3 draft stages", lambda: flash().n_mtp_layers, 3),
    ("§1a dspark target layers", lambda: flash().dspark_target_layer_ids, [37, 38, 39]),
    ("§1a dspark 128 experts", lambda: flash().dspark_n_routed_experts, 128),
    ("§1a dspark top-3", lambda: flash().dspark_n_activated_experts, 3),
    ("§1a dspark Markov rank 256", lambda: flash().dspark_markov_rank, 256),
    ("§1a weights: non-expert linears FP8", lambda: flash().dtype, "fp8"),
    ("§1a weights: routed experts MXFP4", lambda: flash().expert_dtype, "fp4"),
    ("§1 vocabulary decision 129,280", lambda: flash().vocab_size, 129_280),
    # §1a mechanics, read off the modules the config builds
    ("§1a attention scale 512^-1/2", lambda: flash_attention(20).scale, 512 ** -0.5),
    ("§1a indexer head weights x 128^-1/2 x 32^-1/2", lambda: flash_attention(20).indexer.weight_scale,
     128 ** -0.5 * 32 ** -0.5),
    ("§1a q: wq_a 5120 -> 1280", lambda: tuple(flash_attention(24).wq_a.weight.shape), (1280, 5120)),
    ("§1a q: wq_b 1280 -> 64x512", lambda: tuple(flash_attention(24).wq_b.weight.shape), (64 * 512, 1280)),
    ("§1a grouped output: wo_a (4096 -> 1024) x 8", lambda: tuple(flash_attention(24).wo_a.weight.shape),
     (8 * 1024, 4096)),
    ("§1a grouped output: wo_b 8192 -> 5120", lambda: tuple(flash_attention(24).wo_b.weight.shape), (5120, 8192)),
    ("§1a indexer keys 512 -> 128", lambda: tuple(flash_attention(20).indexer.wk.weight.shape), (128, 512)),
    ("§1a indexer queries 1280 -> 32x128", lambda: tuple(flash_attention(24).indexer.wq_b.weight.shape),
     (32 * 128, 1280)),
    ("§1a only kv sources own a compressor", lambda: hasattr(flash_attention(21), "compressor"), False),
    ("§1a compressor wgate only for m > 1", lambda: (hasattr(flash_attention(2).compressor, "wgate"),
                                                     hasattr(flash_attention(20).compressor, "wgate")), (True, False)),
    ("§1a mHC 24 = (2+4)x4 mix outputs", lambda: tuple(flash_block().hc_attn_fn.shape), (24, 4 * 5120)),
    ("§1a engram 24 hash ids per position", lambda: flash().n_engram_hash_cols, 24),
    ("§1a engram wkv 24x256 -> 5x5120", lambda: tuple(flash_engram().wkv.weight.shape), (5 * 5120, 24 * 256)),
    ("§1a engram table rows: sum of bucket primes", lambda: flash().engram_num_embeddings, [384006168, 384016682]),
    # §1a / §4 cache formats: bytes of real quantized rows, and which format each cache uses
    ("§1a main entry 512 FP4 + 32 E4M3 = 288 B", lambda: row_bytes(*quantize_fp4(X512, 16, "e4m3")), 288),
    ("§1a index key 128 FP4 + 4 E8M0 = 68 B", lambda: row_bytes(*quantize_fp4(X128, 32, "e8m0")), 68),
    ("§1a window slot 512 E4M3 + 16 E8M0 = 528 B", lambda: row_bytes(*quantize_fp8(X512)), 528),
    ("§1a main KV: E2M1, E4M3 scale per 16",
     lambda: same(fake_quant_kv_fp4(X512), dequantize_fp4(*quantize_fp4(X512, 16, "e4m3"), 16, "e4m3")), True),
    ("§1a index K/Q: E2M1, E8M0 scale per 32",
     lambda: same(fake_quant_index_fp4(X128), dequantize_fp4(*quantize_fp4(X128, 32, "e8m0"), 32, "e8m0")), True),
    ("§1a window KV: E4M3, power-of-two scale per 32",
     lambda: same(fake_quant_window_fp8(X512), dequantize_fp8(*quantize_fp8(X512, 32), 32)), True),
    ("§1 890 B/token from the accounting", lambda: compute(flash())["global_kv_bytes_per_token"], 890),
    # §7 Muon
    ("§7 NS quintic coefficients", lambda: QUINTIC, (3.4445, -4.7750, 2.0315)),
    ("§7 NS polish coefficients", lambda: POLISH, (2.0, -1.5, 0.5)),
    ("§7 NS 8 + 2 steps (function)", lambda: defaults(newton_schulz)["steps"], (8, 2)),
    ("§7 NS 8 + 2 steps (Muon default)", lambda: defaults(Muon.__init__)["ns_steps"], (8, 2)),
    ("§7 Muon update RMS 0.18 (default)", lambda: defaults(Muon.__init__)["rms"], 0.18),
    ("§7 Muon scale 0.18 sqrt(max(rows, cols))", lambda: (muon_scale(64, 256, 0.18), muon_scale(256, 64, 0.18)),
     (0.18 * 16.0, 0.18 * 16.0)),
    ("§7 Muon momentum 0.95 Nesterov (default)", lambda: (defaults(Muon.__init__)["momentum"],
                                                          defaults(Muon.__init__)["nesterov"]), (0.95, True)),
    ("§7 Muon weight decay 0.1 (default)", lambda: defaults(Muon.__init__)["weight_decay"], 0.1),
    ("§7 Muon group: rms, momentum, Nesterov, wd",
     lambda: settings("muon", "layers.2.attn.wq_a.weight", "rms", "momentum", "nesterov", "weight_decay"),
     (0.18, 0.95, True, 0.1)),
    ("§7 head-wise Muon: attention wq_b per query head",
     lambda: settings("muon", "layers.2.attn.wq_b.weight", "heads"), (load_config("tiny").n_heads,)),
    ("§7 head-wise Muon: indexer wq_b per indexer head",
     lambda: settings("muon", "layers.2.attn.indexer.wq_b.weight", "heads"), (load_config("tiny").index_n_heads,)),
    ("§7 head-wise Muon: key projections (one KV head)",
     lambda: settings("muon", "layers.2.attn.wkv.weight", "heads"), (1,)),
    # §7 AdamW
    ("§7 AdamW betas (0.9, 0.95)", lambda: group_of("adamw", "norm.weight")["betas"], (0.9, 0.95)),
    ("§7 AdamW eps 1e-20", lambda: group_of("adamw", "norm.weight")["eps"], 1e-20),
    ("§7 AdamW norm weights decayed 0.1", lambda: group_of("adamw", "layers.0.attn_norm.weight")["weight_decay"], 0.1),
    ("§7 AdamW scaling factors not decayed", lambda: group_of("adamw", "layers.0.hc_attn_scale")["weight_decay"], 0.0),
    # §7 Sinkhorn-balanced update
    ("§7 Sinkhorn K = 11 (default)", lambda: defaults(SinkhornBalanced.__init__)["iters"], 11),
    ("§7 Sinkhorn tau = 1e-3 (default)", lambda: defaults(SinkhornBalanced.__init__)["tau"], 1e-3),
    ("§7 Sinkhorn function defaults K, tau, eps",
     lambda: tuple(defaults(sinkhorn_balance)[k] for k in ("iters", "tau", "eps")), (11, 1e-3, 1e-20)),
    ("§7 Sinkhorn group: K, tau, gamma, momentum, Nesterov, eps",
     lambda: settings("sinkhorn", "embed.weight", "iters", "tau", "gamma", "momentum", "nesterov", "eps"),
     (11, 1e-3, 0.18, 0.95, True, 1e-20)),
    ("§7 Sinkhorn: embedding, head and Engram tables", lambda: assigned("sinkhorn"),
     ["embed.weight", "head.weight", "layers.1.engram.embed.weight"]),
    ("§7 Engram LR x 5",
     lambda: (TrainConfig().engram_lr_mult, *settings("sinkhorn", "layers.1.engram.embed.weight", "lr")), (5.0, 5.0)),
    ("§7 weight decay 0.1 (train default)", lambda: TrainConfig().weight_decay, 0.1),
    # §7 schedule
    ("§7 peak LR 2.6e-4", lambda: (TrainConfig().lr, LRSchedule.report().peak), (2.6e-4, 2.6e-4)),
    ("§7 final LR 2.6e-5", lambda: (TrainConfig().lr_final, LRSchedule.report().final), (2.6e-5, 2.6e-5)),
    ("§7 warm-up 2000 steps", lambda: LRSchedule.report().warmup_steps, 2000),
    ("§7 constant to 28T, cosine to 40T (of 45T)",
     lambda: (LRSchedule.report().constant_until_tokens, LRSchedule.report().decay_until_tokens), (28e12, 40e12)),
    ("§7 the same proportions in a shorter run", lambda: (TrainConfig().constant_until, TrainConfig().decay_until),
     (28 / 45, 40 / 45)),
    # §5 balancing
    ("§5 balance loss weight 1e-4", lambda: flash().balance_loss_weight, 1e-4),
    ("§5 bias update speed 0.001", lambda: flash().bias_update_speed, 1e-3),
]


@pytest.mark.parametrize("spec_line, source, expected", ROWS, ids=[r[0].lstrip("§") for r in ROWS])  # ASCII ids
def test_spec_constant(spec_line, source, expected):
    got = source()
    if isinstance(expected, float):
        assert math.isclose(got, expected, rel_tol=1e-12), f"{spec_line}: code has {got!r}, SPEC says {expected!r}"
    else:
        assert got == expected, f"{spec_line}: code has {got!r}, SPEC says {expected!r}"
