"""Speculative decoding, the policy and the acceptance rule without a model: the verification-length
scheduler against brute force on synthetic step-time curves, the step-time curve's interpolation, the
rejection rule's output distribution = p exactly (formula) and empirically (χ²), sampling_probs = the
distribution `sample` draws from."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from tests.engine.test_sampling import CHI2_999, _nucleus

from dsv41.engine.sampling import SamplingParams, sampling_probs
from dsv41.engine.speculative import (
    StepTimeCurve,
    choose_lengths,
    expected_accepted,
    rejection_residual,
    verify,
)


def linear(a: float, b: float):
    return lambda n: a + b * n


# ---------------------------------------------------------------------------------------------- scheduler
def test_expected_accepted_is_the_sum_of_prefix_products():
    c = [0.9, 0.5, 0.8, 0.1]
    for L in range(5):
        expected = sum(np.prod(c[:i]) for i in range(1, L + 1))
        assert expected_accepted(c, L) == pytest.approx(expected, rel=1e-12), L


@pytest.mark.parametrize("B,a,b", [(1, 1.0, 0.0), (1, 1.0, 0.02), (8, 1.0, 0.02), (64, 1.0, 0.02), (64, 1.0, 1.0),
                                   (16, 0.1, 0.05)])
def test_padded_lengths_maximise_tokens_per_second_from_the_formula(B, a, b):
    g = torch.Generator().manual_seed(B)
    conf = (0.5 + 0.5 * torch.rand(B, 4, generator=g)).tolist()
    caps = torch.randint(0, 5, (B,), generator=g).tolist()
    caps[0] = 4
    curve = linear(a, b)

    def rate(T: int) -> float:  # Σ_b (1 + Σ_{l ≤ min(T, cap)} Π c) / t(B·(T + 1))
        gained = sum(1 + sum(np.prod(cb[:i]) for i in range(1, min(T, cap) + 1)) for cb, cap in zip(conf, caps))
        return gained / curve(B * (T + 1))

    best_T = max(range(5), key=lambda T: (rate(T), -T))
    assert choose_lengths(conf, caps, curve) == [min(best_T, cap) for cap in caps], [rate(T) for T in range(5)]


def test_a_steep_curve_shortens_verification_and_a_flat_one_verifies_everything():
    conf = [[0.8] * 4]
    flat, steep = linear(1.0, 0.0), linear(0.0, 1.0)  # memory-bound vs compute-bound
    assert choose_lengths(conf * 4, [4] * 4, flat) == [4] * 4
    assert choose_lengths(conf * 4, [4] * 4, steep) == [0] * 4  # 1.8 / 2 < 1 / 1 already at T = 1
    # the same curve, growing batch: the chosen length never grows, and it shrinks once compute dominates
    curve = linear(1.0, 0.01)
    chosen = [choose_lengths(conf * B, [4] * B, curve)[0] for B in (1, 8, 32, 64, 256)]
    assert chosen == sorted(chosen, reverse=True) and chosen[0] == 4 and chosen[-1] < 4, chosen


def test_equal_rates_choose_less_verification():
    """Drafts that are never accepted gain nothing; on a flat curve every length has the same rate: the shortest
    (no verification) wins the tie, padded or ragged."""
    flat = linear(1.0, 0.0)
    assert choose_lengths([[0.0] * 4] * 3, [4] * 3, flat) == [0] * 3
    assert choose_lengths([[0.0] * 4] * 3, [4] * 3, flat, padded=False) == [0] * 3


def test_a_rejection_when_p_never_exceeds_q_falls_back_to_p():
    """norm(max(0, p − q)) is empty when q = p (a rejection has probability 0 then): the residual is p, never a
    zero row that a draw could not invert."""
    p = torch.tensor([0.5, 0.25, 0.25, 0.0], dtype=torch.float64)
    assert torch.equal(rejection_residual(p, p.clone(), 1), p)


def test_a_final_draw_at_the_top_of_the_range_stays_on_a_token_p_can_emit(monkeypatch):
    """The bonus / replacement draw inverts a CDF whose total may round below u · total: it must stay on a token
    with mass (the last ones of p here have none)."""
    import dsv41.engine.speculative as speculative

    monkeypatch.setattr(speculative, "host_uniforms", lambda generator, n, dtype=torch.float32: [1.0] * n)
    logits = torch.tensor([[[2.0, 1.0, 0.5, -1e9, -1e9]] * 2])  # (1, 2, 5): two tokens p never emits
    params = SamplingParams(temperature=1.0, seed=1)
    for drafts in ([[0]], [[3]]):  # accepted then the bonus draw, or rejected then the replacement draw
        (verdict,) = speculative.verify(logits, drafts, [1], [params], [None])
        assert verdict.tokens[-1] in (0, 1, 2), verdict


def test_ragged_lengths_match_brute_force_over_every_combination():
    g = torch.Generator().manual_seed(3)
    for trial in range(6):
        B, k = 3, 3
        conf = torch.rand(B, k, generator=g).tolist()
        caps = torch.randint(0, k + 1, (B,), generator=g).tolist()
        curve = linear(1.0, [0.0, 0.05, 0.3, 1.0, 0.15, 0.6][trial])

        def rate(lengths, conf=conf, curve=curve) -> float:
            gained = sum(1 + sum(np.prod(conf[b][:i]) for i in range(1, L + 1)) for b, L in enumerate(lengths))
            return gained / curve(sum(L + 1 for L in lengths))

        best = max(rate(ls) for ls in itertools.product(*(range(c + 1) for c in caps)))
        got = choose_lengths(conf, caps, curve, padded=False)
        assert all(0 <= L <= c for L, c in zip(got, caps))
        assert rate(got) == pytest.approx(best, rel=1e-9), (trial, got, rate(got), best)


def test_step_time_curve_interpolates_its_points():
    curve = StepTimeCurve([(8, 2.0), (1, 1.0), (4, 1.5), (4, 1.7)])  # unsorted; duplicates averaged
    assert curve.points == [(1, 1.0), (4, 1.6), (8, 2.0)]
    assert curve(1) == 1.0 and curve(0) == 1.0  # flat below the first point
    assert curve(2) == pytest.approx(1.0 + 0.6 / 3)
    assert curve(6) == pytest.approx(1.6 + 0.4 / 2)
    assert curve(16) == pytest.approx(2.0 + 0.4 / 4 * 8)  # extrapolated from the last two
    assert StepTimeCurve([(5, 3.0)])(500) == 3.0
    with pytest.raises(ValueError):
        StepTimeCurve([(0, 1.0)])


# ---------------------------------------------------------------------------------------------- acceptance rule
@pytest.mark.parametrize("seed", range(4))
def test_rejection_rule_output_distribution_is_p_exactly(seed):
    """P(out = y) = q(y)·min(1, p(y)/q(y)) + P(reject)·residual(y), in fp64 from the code's residual."""
    g = torch.Generator().manual_seed(seed)
    V = 7
    p = torch.rand(V, generator=g, dtype=torch.float64) ** 3
    p[seed % V] = 0.0  # a token p never emits
    p /= p.sum()
    q = torch.rand(V, generator=g, dtype=torch.float64)
    q /= q.sum()
    accept = torch.minimum(torch.ones_like(p), p / q)
    out = q * accept + (q * (1 - accept)).sum() * rejection_residual(p, q, 0)
    assert torch.allclose(out, p, rtol=0, atol=1e-14), (out - p).abs().max()
    # a deterministic draft x (q = δ_x): accepted with p(x), else drawn from p without x
    for x in range(V):
        out = torch.zeros_like(p)
        out[x] = p[x]
        out += (1 - p[x]) * rejection_residual(p, None, x)
        assert torch.allclose(out, p, rtol=0, atol=1e-14), (x, (out - p).abs().max())


def test_sampling_probs_is_the_distribution_sample_draws_from():
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(5, 11, generator=g) * 3
    params = [SamplingParams(temperature=0.9, top_p=0.75), SamplingParams(temperature=1.4, top_k=5, top_p=0.85),
              SamplingParams(temperature=0.7, top_k=4), SamplingParams(temperature=1.0), SamplingParams()]
    probs = sampling_probs(logits, params)
    for i, prm in enumerate(params[:4]):
        expected = _nucleus(logits[i].double().numpy(), prm.temperature, prm.top_k, prm.top_p)
        assert np.abs(probs[i].double().numpy() - expected).max() < 1e-6, i
    assert torch.equal(probs[4], torch.nn.functional.one_hot(logits[4].argmax(), 11).float())  # greedy: one-hot


def test_verify_emits_p_at_the_first_position_and_p_given_the_draft_after_it():
    """Empirical: 6000 rows of one verification of L = 2 drafts drawn from q ≠ p; the first emitted token
    is distributed as p_0 (filtered by temperature / top-k), the second — emitted only when the first
    draft was accepted — as p_1, the distribution after that draft (χ², p = 0.001)."""
    V, N = 6, 6000
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(1, 3, V, generator=g) * 2
    params = SamplingParams(temperature=0.8, top_k=5, seed=1)
    p = sampling_probs(logits[0], [params] * 3).double()  # (3, V)
    q = torch.softmax(torch.randn(2, V, generator=g), -1)  # (2, V): the drafter's proposal distributions
    drafts = torch.multinomial(q, N, replacement=True, generator=g).t()  # (N, 2)
    gen = torch.Generator().manual_seed(12)
    verdicts = verify(logits.expand(N, 3, V), drafts.tolist(), [2] * N, [params] * N, [gen] * N,
                      q.expand(N, 2, V))
    first = np.bincount([v.tokens[0] for v in verdicts], minlength=V)
    second = np.bincount([v.tokens[1] for v in verdicts if v.accepted >= 1], minlength=V)
    for counts, expected in ((first, p[0].numpy()), (second, p[1].numpy())):
        n = counts.sum()
        kept = expected > 0
        assert counts[~kept].sum() == 0, f"emitted outside the kept set: {counts}"
        chi2 = float((((counts - n * expected) ** 2)[kept] / (n * expected[kept])).sum())
        assert chi2 < CHI2_999[int(kept.sum()) - 1], f"chi2 {chi2:.1f}; counts {counts}, expected {n * expected}"
    rate = np.mean([v.accepted for v in verdicts])
    assert 0.2 < rate < 1.8, rate  # drafts were tested, some accepted and some rejected
    # both drafts accepted: the bonus token is drawn from p_2, the distribution after the second draft
    bonus = np.bincount([v.tokens[2] for v in verdicts if v.accepted == 2], minlength=V)
    n, kept = bonus.sum(), p[2].numpy() > 0
    assert n > 200 and bonus[~kept].sum() == 0, bonus
    chi2 = float((((bonus - n * p[2].numpy()) ** 2)[kept] / (n * p[2].numpy()[kept])).sum())
    assert chi2 < CHI2_999[int(kept.sum()) - 1], f"chi2 {chi2:.1f}; counts {bonus}"


def test_a_rejected_draft_is_replaced_by_a_fresh_draw_from_the_residual():
    """p = (.4, .3, .2, .1), drafts from q = (.1, .1, .4, .4): drafts 2 and 3 are rejected with probability
    1 − p/q, and what replaces them must be distributed as norm(max(0, p − q)) = (.6, .4, 0, 0) — drawn with a
    uniform of its own (reusing the one that rejected, always ≥ p/q, would favour the CDF's upper end)."""
    V, N = 4, 8000
    p = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    q = torch.tensor([0.1, 0.1, 0.4, 0.4], dtype=torch.float64)
    logits = p.log().float().view(1, 1, V).expand(N, 2, V)  # T = 2: one draft and the position after it
    g = torch.Generator().manual_seed(21)
    drafts = torch.multinomial(q.float(), N, replacement=True, generator=g).view(N, 1)
    params = SamplingParams(temperature=1.0, seed=3)
    verdicts = verify(logits, drafts.tolist(), [1] * N, [params] * N, [torch.Generator().manual_seed(4)] * N,
                      q.float().view(1, 1, V).expand(N, 1, V))
    replaced = np.bincount([v.tokens[0] for v in verdicts if v.accepted == 0], minlength=V)
    expected = np.array([0.6, 0.4, 0.0, 0.0])
    n = replaced.sum()
    assert n > 1000 and replaced[2:].sum() == 0, replaced
    chi2 = float(((replaced[:2] - n * expected[:2]) ** 2 / (n * expected[:2])).sum())
    assert chi2 < CHI2_999[1], f"chi2 {chi2:.1f}; counts {replaced}, expected {n * expected}"


def test_greedy_verification_is_exact_match_and_draws_nothing():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 4, 50, generator=g)
    argmax = logits.argmax(-1).tolist()
    drafts = [argmax[0][:3], argmax[1][:1] + [(argmax[1][1] + 1) % 50, argmax[1][2]], [(argmax[2][0] + 7) % 50] * 3]
    gen = torch.Generator().manual_seed(0)
    state = gen.get_state()
    out = verify(logits, drafts, [3, 3, 2], [SamplingParams()] * 3, [gen] * 3)
    assert [v.accepted for v in out] == [3, 1, 0]
    assert out[0].tokens == argmax[0][:4] and out[1].tokens == argmax[1][:2] and out[2].tokens == [argmax[2][0]]
    assert torch.equal(gen.get_state(), state)
