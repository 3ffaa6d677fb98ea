"""LR schedule shape: warm-up endpoints, continuity, cosine midpoint, report proportions, lr_mult."""

from __future__ import annotations

import math

import pytest
import torch

from dsv41.optim import LRSchedule, build_optimizer

T = 1e12


def test_report_schedule_shape():
    s = LRSchedule.report()
    assert s.lr_at(0, step=1) == pytest.approx(2.6e-4 / 2000)
    assert s.lr_at(1e9, step=1000) == pytest.approx(1.3e-4)
    assert s.lr_at(1e9, step=2000) == 2.6e-4
    assert s.lr_at(28 * T, step=10**6) == 2.6e-4
    assert s.lr_at(34 * T, step=10**6) == pytest.approx((2.6e-4 + 2.6e-5) / 2)  # cosine midpoint
    assert s.lr_at(40 * T, step=10**6) == pytest.approx(2.6e-5)
    assert s.lr_at(45 * T, step=10**6) == 2.6e-5
    with pytest.raises(ValueError):
        s.lr_at(1e9)  # step-based warm-up needs the step


def test_token_warmup_endpoints_and_continuity():
    s = LRSchedule(peak=1e-3, final=1e-4, warmup_tokens=1e6, constant_until_tokens=5e6, decay_until_tokens=9e6)
    assert s.lr_at(0) == 0.0
    assert s.lr_at(0.25e6) == pytest.approx(0.25e-3)
    assert s.lr_at(1e6) == 1e-3
    assert s.lr_at(7e6) == pytest.approx(0.55e-3)  # midpoint of the cosine
    assert s.lr_at(1e9) == 1e-4
    for boundary in (1e6, 5e6, 9e6):
        left, right = s.lr_at(boundary - 1.0), s.lr_at(boundary + 1.0)
        assert abs(left - right) < 1e-9, f"jump at {boundary:g}: {left} → {right}"
    after_warmup = [s.lr_at(t) for t in torch.linspace(1e6, 1.2e7, 500).tolist()]
    assert all(a >= b for a, b in zip(after_warmup, after_warmup[1:])), "not monotone after warm-up"
    # the cosine has zero slope at both ends (smooth, not just continuous)
    slope = (s.lr_at(5e6 + 1e3) - s.lr_at(5e6)) / 1e3
    assert abs(slope) < 1e-12 and s.lr_at(8e6) == pytest.approx(1e-4 + 0.9e-3 * (1 + math.cos(0.75 * math.pi)) / 2)


def test_scaled_keeps_report_proportions():
    s = LRSchedule.scaled(45e9)
    assert (s.constant_until_tokens, s.decay_until_tokens) == pytest.approx((28e9, 40e9))
    assert s.warmup_tokens == pytest.approx(0.45e9)
    assert s.lr_at(34e9) == pytest.approx((s.peak + s.final) / 2)


def test_invalid_schedule_rejected():
    with pytest.raises(ValueError):
        LRSchedule(peak=1e-3, final=1e-4, warmup_tokens=10, constant_until_tokens=5, decay_until_tokens=20)


def test_apply_respects_engram_multiplier(fake_model):
    opt = build_optimizer(fake_model, lr=1.0, engram_lr_mult=5.0)
    s = LRSchedule(peak=2e-3, final=2e-4, warmup_tokens=100, constant_until_tokens=200, decay_until_tokens=300)
    assert s.apply(opt, 50) == pytest.approx(1e-3)
    by_mult = {g["lr_mult"]: g["lr"] for g in opt.param_groups}
    assert by_mult == pytest.approx({1.0: 1e-3, 5.0: 5e-3})
    assert all(g["lr"] == pytest.approx(1e-3 * g["lr_mult"]) for g in opt.param_groups)
