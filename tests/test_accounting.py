"""Accounting: the report's totals from the config, exact KV bytes, and internal consistency."""

from __future__ import annotations

import random

import pytest

from dsv41 import accounting
from dsv41.accounting import compute, fp4_entry_bytes, fp8_entry_bytes, sum_visible
from dsv41.config import load_config
from dsv41.plan import FULL, REINDEX, layer_plan

# the report's figures and how far ours may lie from them (SPEC §1; reasons in docs/accounting.md)
REPORT_TOLERANCES = {
    "backbone_params": (552e9, 0.005),
    "engram_params": (196e9, 0.01),
    "active_params_prefill": (8e9, 0.06),
    "active_params_decode": (16e9, 0.03),
}


@pytest.fixture(scope="module")
def flash() -> dict:
    return compute(load_config("v41-flash"))


@pytest.mark.parametrize("key", sorted(REPORT_TOLERANCES))
def test_v41_flash_totals_match_the_report(flash: dict, key: str) -> None:
    ref, tol = REPORT_TOLERANCES[key]
    rel = (flash[key] - ref) / ref
    assert abs(rel) <= tol, f"{key}: ours {flash[key]:,} vs report {ref:,.0f} ({rel:+.3%}, tol {tol:.1%})"


def test_v41_flash_global_kv_is_890_exactly(flash: dict) -> None:
    assert flash["global_kv_bytes_per_token"] == 890
    assert isinstance(flash["global_kv_bytes_per_token"], int)
    # three encoder Full layers at m=2 keep half an entry per token, the decoder source a whole one
    assert flash["global_kv_by_source"] == {"2": 178, "8": 178, "14": 178, "20": 356}


def test_entry_sizes_from_the_bit_layout() -> None:
    # independent hand computation: E2M1 = 1 sign + 2 exponent + 1 mantissa bits; E4M3 = 1 + 4 + 3;
    # every scale (E4M3 or E8M0) is one byte
    e2m1_bits, e4m3_bits, scale = 1 + 2 + 1, 1 + 4 + 3, 1
    main = 512 * e2m1_bits // 8 + (512 // 16) * scale
    index_key = 128 * e2m1_bits // 8 + (128 // 32) * scale
    window = 512 * e4m3_bits // 8 + (512 // 32) * scale
    assert (main, index_key, window) == (288, 68, 528)
    c = load_config("v41-flash")
    assert accounting.entry_bytes(c) == {"main": main, "index_key": index_key, "window_slot": window}
    assert compute(c)["window_kv_bytes_per_sequence"] == c.n_layers * c.window_size * window


def test_entry_formulas_agree_with_the_quant_package() -> None:
    fp4 = pytest.importorskip("dsv41.quant.fp4")
    fp8 = pytest.importorskip("dsv41.quant.fp8")
    rng = random.Random(7)
    for _ in range(20):
        dim = 32 * rng.randint(1, 64)
        for block in (16, 32):
            assert fp4_entry_bytes(dim, block) == fp4.fp4_entry_bytes(dim, block)
            assert fp8_entry_bytes(dim, block) == fp8.fp8_entry_bytes(dim, block)


def test_breakdowns_sum_to_their_totals(flash: dict) -> None:
    r = flash
    assert sum(r["backbone_breakdown"].values()) == r["backbone_params"]
    assert sum(r["engram_breakdown"].values()) == r["engram_params"]
    assert sum(r["engram_params_per_layer"].values()) == r["engram_params"]
    assert sum(r["active_decode_breakdown"].values()) == r["active_params_decode"]
    assert sum(r["active_prefill_breakdown"].values()) == r["active_params_prefill"]
    assert sum(r["global_kv_by_source"].values()) == r["global_kv_bytes_per_token"]
    assert sum(r["dspark_breakdown"].values()) == r["dspark_params"]
    assert sum(r["vision_breakdown"].values()) == r["vision_params"]
    bd = r["backbone_breakdown"]
    layers = sum(p["params"] for p in r["per_layer"])
    assert layers + bd["embed"] + bd["head"] + bd["final_norm"] == r["backbone_params"]
    assert sum(p["active_params"] for p in r["per_layer"]) == r["active_decode_breakdown"]["layers"]
    for d in r["decode_flops"].values():
        assert d["total"] == pytest.approx(sum(v for k, v in d.items() if k != "total"), rel=1e-12)
    # Engram, DSpark and vision stay out of the backbone
    assert r["engram_params"] > 0 and r["dspark_params"] > 0 and r["vision_params"] > 0
    assert "engram_tables" not in bd and "dspark_heads" not in bd


def _random_config(rng: random.Random):
    """A fresh valid config with random widths (layer pattern of the tiny preset)."""
    heads = rng.choice([2, 4, 8])
    return load_config("tiny").replace(
        dim=32 * rng.randint(1, 6), moe_inter_dim=16 * rng.randint(1, 8), n_heads=heads,
        o_groups=rng.choice([g for g in (1, 2, 4) if heads % g == 0]), head_dim=32 * rng.randint(1, 3),
        q_lora_rank=8 * rng.randint(1, 8), o_lora_rank=8 * rng.randint(1, 8),
        vocab_size=rng.randint(100, 999),
        n_routed_experts=rng.randint(2, 12), n_activated_experts=2, index_n_heads=rng.randint(1, 5),
        index_head_dim=32 * rng.randint(1, 2), hc_mult=rng.randint(1, 4), rope_head_dim=16,
    )


@pytest.mark.parametrize("seed", range(5))
def test_backbone_and_active_match_a_hand_formula(seed: int) -> None:
    c = _random_config(random.Random(seed))
    d, hd, hc, e = c.dim, c.head_dim, c.hc_mult, c.n_routed_experts
    mix = (2 + hc) * hc
    expert = 3 * d * c.moe_inter_dim
    common = (2 * mix * hc * d + 2 * mix + 6 + 2 * d  # mHC + the two sublayer norms
              + c.n_heads + d * c.q_lora_rank + c.q_lora_rank + c.n_heads * hd * c.q_lora_rank + hd * d + hd
              + c.o_groups * c.o_lora_rank * (c.n_heads * hd // c.o_groups) + d * c.o_groups * c.o_lora_rank
              + e * d + e)  # gate weight and bias
    index_q = c.index_n_heads * c.index_head_dim * c.q_lora_rank + c.index_n_heads * d
    total = active = 2 * c.vocab_size * d + d
    for p in layer_plan(c):
        own = common
        if p.mode == FULL:
            own += hd * d * (2 if p.ratio > 1 else 1) + hd + c.index_head_dim * hd + c.index_head_dim
        if p.mode in (FULL, REINDEX):
            own += index_q
        total += own + (e + 1) * expert
        active += own + (c.n_activated_experts + 1) * expert
    r = compute(c)
    assert r["backbone_params"] == total
    assert r["active_params_decode"] == active
    assert r["active_params_prefill"] < r["active_params_decode"]


def test_against_the_model_state_dict() -> None:
    """Our inventory must name and shape exactly what the model builds (tiny preset)."""
    pytest.importorskip("torch")
    transformer = pytest.importorskip("dsv41.model.transformer")
    c = load_config("tiny")
    shapes = {k: tuple(v.shape) for k, v in transformer.Transformer(c).state_dict().items()}
    ours = {}
    params = accounting.text_params(c) + [q for p in layer_plan(c) for q in accounting.block_params(c, p)]
    params += [q for i in c.engram_layer_ids for q in accounting.engram_params(c, i)]
    for p in params:
        for k in range(p.copies):
            ours[p.name.format(e=k)] = p.shape
    assert sorted(set(shapes) - set(ours)) == [] and sorted(set(ours) - set(shapes)) == []
    assert {k: v for k, v in ours.items() if shapes[k] != v} == {}


def test_closed_form_visible_sums_match_brute_force() -> None:
    rng = random.Random(11)
    for _ in range(200):
        n, m = rng.randint(0, 300), rng.randint(1, 5)
        cap = rng.choice([None, 0, 1, rng.randint(1, 80)])
        brute = sum((t + 1) // m if cap is None else min(cap, (t + 1) // m) for t in range(n))
        assert sum_visible(n, m, cap) == brute, (n, m, cap)


def test_decode_flops_follow_the_plan() -> None:
    c = load_config("v41-flash")
    short, long = accounting.decode_flops(c, 4096), accounting.decode_flops(c, 1 << 20)
    # past top-k and the window, attention stops growing; only the indexers' scans grow
    assert short["attention"] == long["attention"]
    assert short["matmul"] == long["matmul"]
    per_entry = 2 * c.index_n_heads * (c.index_head_dim + 1)
    full_scans = sum((1 << 20) // p.ratio for p in layer_plan(c) if p.mode == FULL)
    pool = c.candidate_topk_blocks * c.candidate_block_size
    reindex_scans = sum(min(pool, (1 << 20) // p.ratio) for p in layer_plan(c) if p.mode == REINDEX)
    assert long["indexer"] == per_entry * (full_scans + reindex_scans)


def test_prefill_encoder_only_saves_about_half() -> None:
    c = load_config("v41-flash")
    r = accounting.prefill_flops(c, 1 << 15)
    assert 1.5 < r["ratio"] < 2.5
    # a prompt no longer than the window replays every token through the decoder: no saving
    short = accounting.prefill_flops(c, c.window_size)
    assert short["ratio"] == pytest.approx(1.0, rel=1e-9)


def test_v4_comparison(flash: dict) -> None:
    v4 = flash["v4_flash"]
    assert v4["main_entry_bytes"] == 448 + 8 + 64 * 2
    assert v4["global_kv_bytes_per_token"] == pytest.approx(21 * (584 + 68) / 4 + 20 * 584 / 128)
    assert v4["global_ratio"] == pytest.approx(v4["global_kv_bytes_per_token"] / 890)
    ratios = [p["ratio"] for p in v4["persistent"]]
    assert ratios == sorted(ratios, reverse=True)  # longer saved units amortize the window snapshots
    u8 = v4["unit_tokens_at_8x"]
    assert v4["global_kv_bytes_per_token"] + 2 * v4["window_snapshot_bytes"] / u8 == pytest.approx(8 * 890)
    # one saved window state: 43 layers × 128 slots × a 584-byte main entry; V4 saves two per unit (the prompt's
    # end and the output's), amortized over the unit's tokens
    assert v4["window_snapshot_bytes"] == 43 * 128 * 584
    for row in v4["persistent"]:
        n = row["unit_tokens"]
        assert row["v4_bytes_per_token"] == pytest.approx(v4["global_kv_bytes_per_token"] + 2 * 43 * 128 * 584 / n)
        assert row["ratio"] == pytest.approx(row["v4_bytes_per_token"] / 890)


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_small_presets_are_sane(name: str) -> None:
    r = compute(load_config(name))
    assert 0 < r["active_params_prefill"] < r["active_params_decode"] < r["backbone_params"]
    assert 0 < r["engram_active_params"] < r["engram_params"]
    assert r["global_kv_bytes_per_token"] > 0
    assert r["dspark_params"] == 0 and r["vision_params"] == 0
    assert all(v["total"] > 0 for v in r["decode_flops"].values())
    assert "report" not in accounting.format_report(load_config(name)).splitlines()[2]


def test_report_table_shows_the_report_for_v41_flash() -> None:
    text = accounting.format_report(load_config("v41-flash"))
    header = text.splitlines()[2]
    assert "report" in header and "diff" in header
    assert "552.00B" in text and "890" in text
