"""RoPE and YaRN against the from-formula float64 implementation in `csa2_reference.py` (SPEC §1a):
frequencies per layer kind, the complex-pair rotation, its inverse, relative-position invariance of
q·k, and the attention layer's query rotation and output inverse rotation."""

from __future__ import annotations

import math

import pytest
import torch
from tests.model.csa2_reference import d, layer_ref_frequencies, ref_frequencies, ref_rotate

from dsv41 import load_config
from dsv41.model.rope import apply_rope, layer_frequencies, rope_angles, rope_frequencies
from dsv41.model.transformer import Transformer

# float32 frequencies vs float64: measured ≤ 1.7e-7 relative (v41-flash YaRN). Rotations of unit-scale
# values at positions < 1000 in float32 (the angle is rounded to fp32 first): measured ≤ 1.2e-5.
FREQ_RTOL = 5e-7
ROT_ATOL = 5e-5


def _max_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want) / want).abs().max().item()


@pytest.mark.parametrize("preset", ["tiny", "small", "v41-flash"])
def test_frequencies_follow_the_formula_per_layer_kind(preset):
    c = load_config(preset)
    plain = rope_frequencies(c.rope_head_dim, c.rope_theta)
    want_plain = ref_frequencies(c.rope_head_dim, c.rope_theta)
    yarn = layer_frequencies(c, 1)
    want_yarn = ref_frequencies(c.rope_head_dim, c.compress_rope_theta, c.original_seq_len, c.rope_factor,
                                c.beta_fast, c.beta_slow)
    for what, got, want in (("plain", plain, want_plain), ("yarn", yarn, want_yarn)):
        err = _max_rel(got, want)
        assert err <= FREQ_RTOL, f"{preset} {what} frequencies: max rel err {err:.2e}"
    # window-only layers: rope_theta, never YaRN; every compressed ratio: compress_rope_theta + YaRN
    for ratio in sorted(set(c.compress_ratios)):
        got, want = layer_frequencies(c, ratio), layer_ref_frequencies(c, ratio)
        assert _max_rel(got, want) <= FREQ_RTOL, f"{preset} ratio {ratio}"
    assert _max_rel(layer_frequencies(c, 0), want_yarn) > 0.1, "the two kinds must differ for the test to mean anything"
    # YaRN here really ramps: some pairs keep θ, some are divided by the factor, some lie between
    theta = ref_frequencies(c.rope_head_dim, c.compress_rope_theta)
    kept = torch.isclose(want_yarn, theta, rtol=1e-12)
    divided = torch.isclose(want_yarn, theta / c.rope_factor, rtol=1e-12)
    assert kept.any() and divided.any() and (~kept & ~divided).any()


def test_yarn_ramp_direction_by_hand():
    """A hand case: R = 16, base 10000, L = 2048, factor 8, ramp between beta 32 and 1 rotations.
    i(r) = 16·ln(2048/(2πr))/(2·ln 10000): i(32) = 2.016 → low = 2; i(1) = 5.026 → high = 6.
    Pairs 0–2 keep θ_i; pairs ≥ 6 get θ_i / 8; pair 4 is half-way: θ_4·(1/2 + 1/16)."""
    got = rope_frequencies(16, 10000.0, 2048, 8.0, 32, 1).double()
    theta = 10000.0 ** (-torch.arange(8, dtype=torch.float64) / 8)
    blend = torch.tensor([0, 0, 0, 0.25, 0.5, 0.75, 1, 1], dtype=torch.float64)  # (i − 2) / 4, clamped
    want = theta * (1 - blend) + theta / 8 * blend
    assert torch.allclose(got, want, rtol=FREQ_RTOL), (got, want)
    assert math.isclose(got[4].item() / theta[4].item(), 0.5 + 1 / 16, rel_tol=1e-6)


def test_model_layers_use_their_kind():
    model = Transformer(load_config("tiny"))
    c = model.config
    for layer in model.layers:
        attn = layer.attn
        want = layer_ref_frequencies(c, attn.ratio)
        err = _max_rel(attn.freqs, want)
        assert err <= FREQ_RTOL, f"layer {attn.layer_id} (ratio {attn.ratio}) frequencies: max rel err {err:.2e}"


def test_apply_rope_is_complex_rotation_of_the_last_dims():
    g = torch.Generator().manual_seed(5)
    c = load_config("tiny")
    theta = layer_ref_frequencies(c, 2)
    x = torch.randn(2, 9, 3, 32, generator=g)  # (B, T, H, D), rotary tail = last 16
    pos = torch.randint(0, 1000, (2, 9), generator=g)
    cos, sin = rope_angles(theta.float(), pos)
    got = apply_rope(x, cos, sin)
    want = ref_rotate(d(x), pos, theta)
    err = (got.double() - want).abs().max().item()
    assert err <= ROT_ATOL, f"rotation: max abs err {err:.2e}"
    assert torch.equal(got[..., :16], x[..., :16]), "the non-rotary channels must pass through"
    back = apply_rope(got, cos, sin, inverse=True)
    err = (back.double() - d(x)).abs().max().item()
    assert err <= ROT_ATOL, f"inverse ∘ rotation: max abs err {err:.2e}"
    # the inverse is the rotation by −angle, applied on its own
    inv = apply_rope(x, cos, sin, inverse=True)
    err = (inv.double() - ref_rotate(d(x), pos, theta, inverse=True)).abs().max().item()
    assert err <= ROT_ATOL, f"inverse rotation: max abs err {err:.2e}"


def test_q_dot_k_depends_only_on_relative_position():
    g = torch.Generator().manual_seed(6)
    c = load_config("tiny")
    for ratio in (0, 2):
        freqs = layer_frequencies(c, ratio)
        q, k = torch.randn(2, 32, generator=g), torch.randn(2, 32, generator=g)

        def dot(p: int, u: int, freqs=freqs, q=q, k=k) -> float:
            cq, sq = rope_angles(freqs, torch.tensor([p]))
            ck, sk = rope_angles(freqs, torch.tensor([u]))
            return (apply_rope(q[:1], cq, sq) * apply_rope(k[:1], ck, sk)).sum().item()

        base = dot(37, 11)
        for shift in (1, 50, 400):
            assert abs(dot(37 + shift, 11 + shift) - base) <= ROT_ATOL * 32, (ratio, shift)
        assert abs(dot(37, 12) - base) > 1e-3, "q·k must change with the relative position"


def test_attention_rotates_the_query_and_unrotates_the_output():
    """`Attention.query` rotates q = wq_b(q_norm(wq_a x)) at the token position; `Attention.output`
    applies the inverse rotation before the grouped projection."""
    g = torch.Generator().manual_seed(7)
    model = Transformer(load_config("tiny")).init_weights(seed=7)
    c = model.config
    for layer_id in (0, 2):
        attn = model.layers[layer_id].attn
        theta = layer_ref_frequencies(c, attn.ratio)
        x = torch.randn(1, 12, c.dim, generator=g)
        pos = torch.arange(100, 112).unsqueeze(0)
        cos, sin = attn.angles(pos)
        _, q = attn.query(x, cos, sin)
        xq = d(x) @ d(attn.wq_a.weight).T
        xq = xq / xq.square().mean(-1, keepdim=True).sqrt() * d(attn.q_norm.weight)
        want = ref_rotate((xq @ d(attn.wq_b.weight).T).unflatten(-1, (c.n_heads, c.head_dim)), pos, theta)
        err = ((q.double() - want).abs().max() / want.abs().max()).item()
        assert err <= ROT_ATOL, f"layer {layer_id} query: max rel err {err:.2e}"

        o = torch.randn(1, 12, c.n_heads, c.head_dim, generator=g)
        got = attn.output(o, cos, sin)
        plain = ref_rotate(d(o), pos, theta, inverse=True).reshape(1, 12, c.o_groups, -1)  # (B, T, G, H·D/G)
        wo_a = d(attn.wo_a.weight).view(c.o_groups, c.o_lora_rank, -1)
        want = torch.einsum("btgd,grd->btgr", plain, wo_a).flatten(2) @ d(attn.wo_b.weight).T
        err = ((got.double() - want).abs().max() / want.abs().max()).item()
        assert err <= ROT_ATOL, f"layer {layer_id} output: max rel err {err:.2e}"
