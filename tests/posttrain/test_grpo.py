"""GRPO pieces against hand computations and formulas: sub-group advantages, k(b), r_len, the clipped loss."""

from __future__ import annotations

import math

import pytest
import torch

from dsv41.posttrain.grpo import ClipConfig, EffortReward, grpo_loss, subgroup_advantages


def test_subgroup_advantages_never_mix_effort_levels():
    # prompt p with efforts 25 and 100, prompt q with 25: three sub-groups, centred separately (by hand)
    rewards = [1.0, 0.0, 0.6, 0.2, 0.9, 0.3, 0.5]
    prompts = ["p", "p", "p", "p", "q", "q", "q"]
    efforts = [25, 25, 100, 100, 25, 25, 25]
    got = subgroup_advantages(rewards, prompts, efforts)
    want = [0.5, -0.5, 0.2, -0.2, 0.9 - 1.7 / 3, 0.3 - 1.7 / 3, 0.5 - 1.7 / 3]
    assert torch.allclose(got, torch.tensor(want), atol=1e-6), got
    # a sample's advantage only moves with rewards of its own (prompt, effort): change p's b=100 rewards
    moved = subgroup_advantages([1.0, 0.0, 5.0, -3.0, 0.9, 0.3, 0.5], prompts, efforts)
    assert torch.equal(moved[:2], got[:2]) and torch.equal(moved[4:], got[4:])
    # pooling over effort levels would have given other numbers for p
    pooled = torch.tensor(rewards[:4]) - sum(rewards[:4]) / 4
    assert not torch.allclose(got[:4], pooled)
    scaled = subgroup_advantages(rewards, prompts, efforts, scale=True)
    assert torch.allclose(scaled[:2], torch.tensor([1.0, -1.0]), atol=1e-5)  # (±0.5) / std 0.5
    assert subgroup_advantages([0.7], ["x"], [50]).tolist() == [0.0]


def test_k_and_length_reward_follow_the_formula():
    r = EffortReward(levels=(10, 40, 70, 100), k0=0.8, lam=0.5, c_max=0.3, l_norm=50.0)
    tau = 0.5 * 30.0  # λ · mean gap (30)
    assert r.tau == pytest.approx(tau)
    for b in (10, 40, 55, 100):
        k = 0.8 * math.exp(-(b - 10) / tau)
        assert r.k(b) == pytest.approx(k, rel=1e-12)
        for ell in (0, 7, 40, 500):
            assert r.length_term(b, ell) == pytest.approx(-min(0.3, k * ell / 50.0), rel=1e-12)
            assert r(True, b, ell) == pytest.approx(1 - min(0.3, k * ell / 50.0), rel=1e-12)
    assert r.length_term(10, 10_000) == -0.3  # capped at C_max
    assert r.k(100) < r.k(40) < r.k(10) == 0.8  # higher effort pays less per token
    uneven = EffortReward(levels=(25, 50, 100), lam=2.0)
    assert uneven.tau == pytest.approx(2.0 * 37.5)
    with pytest.raises(ValueError):
        EffortReward(levels=(50,))


def test_clipped_loss_matches_a_per_token_formula():
    g = torch.Generator().manual_seed(1)
    B, T = 3, 6
    old = -torch.rand(B, T, generator=g) * 3
    new = old + 0.5 * torch.randn(B, T, generator=g)
    ref = old + 0.3 * torch.randn(B, T, generator=g)
    adv = torch.tensor([1.5, -0.7, 0.4])
    mask = torch.rand(B, T, generator=g) > 0.3
    clip = ClipConfig(eps_low=0.2, eps_high=0.28, kl_coef=0.05)
    loss, _ = grpo_loss(new, old, adv, mask, clip, logp_ref=ref)
    terms = []
    for b in range(B):
        for t in range(T):
            if mask[b, t]:
                r = math.exp(new[b, t] - old[b, t])
                a = float(adv[b])
                surr = min(r * a, min(max(r, 0.8), 1.28) * a)
                d = float(ref[b, t] - new[b, t])
                terms.append(-surr + 0.05 * (math.exp(d) - d - 1))
    assert float(loss) == pytest.approx(sum(terms) / len(terms), rel=1e-5)
