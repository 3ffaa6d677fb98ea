"""Sinkhorn-balanced update: row RMS 1, column RMS ≈ 1, masked rows zero, vector form = naive form."""

from __future__ import annotations

import pytest
import torch

from dsv41.optim.sinkhorn import SinkhornBalanced, sinkhorn_balance

# measured over 400 random draws: row RMS within 3e-7 of 1, column RMS (live rows) within 7.4e-6 of 1,
# vector form vs materialized form 6.4e-7 relative; the bounds sit a few times above
ROW_RMS_TOL = 1e-6
COL_RMS_REL_TOL = 3e-5
FP32_RTOL = 2e-6


def _skewed_update(m: int, n: int, n_absent: int, n_tiny: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A tall update with lognormal row and column scales (a real embedding gradient is far from
    balanced), `n_absent` zero rows and `n_tiny` rows below the τ = 1e-3 mask threshold."""
    G = torch.randn(m, n) * torch.randn(m, 1).exp() * torch.randn(1, n).exp()
    rows = torch.randperm(m)
    G[rows[:n_absent]] = 0
    G[rows[n_absent : n_absent + n_tiny]] *= 1e-7
    masked = torch.zeros(m, dtype=torch.bool)
    masked[rows[: n_absent + n_tiny]] = True
    return G, masked


def _naive_sinkhorn(G: torch.Tensor, tau: float, iters: int, eps: float = 1e-20) -> torch.Tensor:
    """The textbook form: materialize the matrix and normalize it in place, rows then columns."""
    tall = G.shape[0] >= G.shape[1]
    X = G if tall else G.T
    norms = X.norm(dim=1)
    X = X * (norms > tau * norms.mean())[:, None]
    for k in range(iters):
        dim = 1 if k % 2 == 0 else 0
        X = X / (X.norm(dim=dim, keepdim=True) + eps)
    X = X * X.shape[1] ** 0.5
    return X if tall else X.T


@pytest.mark.parametrize("m,n", [(300, 64), (500, 48), (128, 128)])
def test_row_and_column_rms(m, n):
    G, masked = _skewed_update(m, n, n_absent=m // 10, n_tiny=3)
    D = sinkhorn_balance(G)
    assert D.shape == G.shape and D.dtype == G.dtype
    assert torch.equal(D[masked], torch.zeros_like(D[masked])), "masked rows must get exactly zero"
    live = D[~masked]
    row_rms = live.square().mean(1).sqrt()
    assert (row_rms - 1).abs().max() <= ROW_RMS_TOL, f"row RMS in [{row_rms.min():.6f}, {row_rms.max():.6f}]"
    # columns: norm √m' over the m' live rows ⇒ RMS 1 over those rows
    col_rms = live.square().mean(0).sqrt()
    assert (col_rms - 1).abs().max() <= COL_RMS_REL_TOL, f"col RMS in [{col_rms.min():.4f}, {col_rms.max():.4f}]"
    # the input's columns were far from balanced, so this is the iteration's doing
    G_live = G[~masked] * n**0.5 / G[~masked].norm(dim=1, keepdim=True)
    assert (G_live.square().mean(0).sqrt() - 1).abs().max() > 0.5


def test_wide_matrix_is_balanced_along_its_long_side():
    G, masked = _skewed_update(400, 40, n_absent=20, n_tiny=2)
    D_wide = sinkhorn_balance(G.T.contiguous())
    assert torch.allclose(D_wide, sinkhorn_balance(G).T, rtol=FP32_RTOL, atol=0)
    assert torch.equal(D_wide[:, masked], torch.zeros(40, int(masked.sum())))


@pytest.mark.parametrize("m,n,iters", [(300, 64, 11), (64, 300, 11), (200, 50, 3)])
def test_vector_scaling_equals_naive_materializing_version(m, n, iters):
    G, _ = _skewed_update(max(m, n), min(m, n), n_absent=10, n_tiny=2)
    if m < n:
        G = G.T.contiguous()
    got = sinkhorn_balance(G, tau=1e-3, iters=iters)
    want = _naive_sinkhorn(G, tau=1e-3, iters=iters)
    err = (got - want).abs().max() / want.abs().max()
    assert err <= FP32_RTOL, f"max err {err.item():.2e} (relative to max |Δ|)"


def test_invariant_to_update_scale():
    G, _ = _skewed_update(120, 30, n_absent=5, n_tiny=1)
    for scale in (1e-12, 1e8):
        got = sinkhorn_balance(G * scale)
        assert torch.allclose(got, sinkhorn_balance(G), rtol=1e-5, atol=1e-6), f"scale {scale}"


def test_even_iterations_rejected():
    with pytest.raises(ValueError):
        sinkhorn_balance(torch.randn(8, 4), iters=10)


def test_optimizer_step_is_nesterov_then_balance_with_gamma_lr_and_no_decay():
    shape, lr, mu, gamma = (90, 24), 1e-2, 0.95, 0.18
    p = torch.nn.Parameter(torch.randn(shape))
    want = p.detach().clone()
    opt = SinkhornBalanced([p], lr=lr)
    buf = torch.zeros(shape)
    for _ in range(3):
        g = torch.randn(shape)
        g[:7] = 0  # tokens absent this step: still moved by their momentum, unless masked
        p.grad = g
        opt.step()
        buf = mu * buf + g
        want = want - gamma * lr * _naive_sinkhorn(g + mu * buf, tau=1e-3, iters=11)
        err = (p.detach() - want).abs().max()
        # fp32 rounding of p (|p| < 8: one ulp ≤ 4.8e-7); measured ≤ 2.4e-7 over 150 draws
        assert err <= 1e-6, f"max err {err.item():.2e}"
    # update RMS is γ·lr per row, like Muon's 0.18
    p.grad = torch.randn(shape)
    before = p.detach().clone()
    opt.step()
    rms = ((before - p.detach()) / lr).square().mean().sqrt().item()
    assert abs(rms - gamma) < 4e-7, f"update RMS {rms:.8f}"  # measured ≤ 1.1e-7 from 0.18 over 150 draws


def test_zero_rows_and_columns_get_a_zero_update_not_nan():
    """An all-zero gradient (an RL batch whose advantages are all 0) and a column that is zero on every
    live row: 1/eps used to square to inf in fp32 and turn the next product into 0 · inf = NaN."""
    assert torch.equal(sinkhorn_balance(torch.zeros(12, 5)), torch.zeros(12, 5))
    g = torch.Generator().manual_seed(3)
    G = torch.randn(12, 5, generator=g)
    G[:, 2] = 0.0
    G[7] = 1e-9  # below tau · mean row norm: a masked row, the only one that touches column 2
    delta = sinkhorn_balance(G)
    assert torch.isfinite(delta).all()
    assert torch.equal(delta[:, 2], torch.zeros(12)) and torch.equal(delta[7], torch.zeros(5))
    live = torch.tensor([i != 7 for i in range(12)])
    rms = delta[live].square().mean(1).sqrt()  # the live rows still come out at row RMS 1
    assert torch.allclose(rms, torch.ones_like(rms), atol=1e-4), rms
