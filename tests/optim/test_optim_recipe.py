"""The optimizer recipe of SPEC §7, each against a from-formula float64 implementation written here:
Muon's hybrid Newton–Schulz (8 × (3.4445, −4.7750, 2.0315) then 2 × (2, −1.5, 0.5)), the 0.18·√max
scale, Nesterov momentum and decoupled weight decay with the unscaled lr; and the Sinkhorn-balanced
update (τ = 1e-3 row mask, K = 11 alternating normalizations, Δ = √n·D_r G D_c, γ = 0.18)."""

from __future__ import annotations

import math

import pytest
import torch

from dsv41.optim.muon import Muon, newton_schulz
from dsv41.optim.sinkhorn import SinkhornBalanced

SPEC_QUINTIC, SPEC_POLISH = (3.4445, -4.7750, 2.0315), (2.0, -1.5, 0.5)
NS64_RTOL = 1e-14  # float64 Newton–Schulz vs the float64 formula: measured ≤ 3.5e-15 relative
STEP_RTOL = 6e-14  # float64 optimizer step vs formula, relative to the update size: measured ≤ 1.9e-14
FP32_ATOL = 2e-6  # float32 Newton–Schulz vs float64 formula, entries of size ~1/√max: measured ≤ 4.7e-7


def ns_formula(G: torch.Tensor, quintic=SPEC_QUINTIC, polish=SPEC_POLISH, steps=(8, 2)) -> torch.Tensor:
    """X ← aX + b(XXᵀ)X + c(XXᵀ)²X on the wide orientation of G/(‖G‖_F + 1e-7)."""
    X = G.double()
    tall = X.shape[-2] > X.shape[-1]
    if tall:
        X = X.mT
    X = X / (torch.linalg.matrix_norm(X, keepdim=True) + 1e-7)
    for (a, b, c), n in zip((quintic, polish), steps):
        for _ in range(n):
            A = X @ X.mT
            X = a * X + b * (A @ X) + c * (A @ (A @ X))
    return X.mT if tall else X


@pytest.mark.parametrize("shape", [(24, 56), (56, 24), (3, 16, 40)])
def test_newton_schulz_is_the_recipe_iteration(shape):
    g = torch.Generator().manual_seed(61)
    G = torch.randn(shape, generator=g, dtype=torch.float64)
    want = ns_formula(G)
    got = newton_schulz(G, dtype=torch.float64)
    rel = ((got - want).abs().max() / want.abs().max()).item()
    assert rel <= NS64_RTOL, f"float64 NS: max rel err {rel:.2e}"
    # the float32 default agrees to float32 precision
    err = (newton_schulz(G.float()).double() - want).abs().max().item()
    assert err <= FP32_ATOL, f"float32 NS: max err {err:.2e}"
    # a coefficient a little off (or a phase one step short) changes the result far beyond the tolerance
    for other in (ns_formula(G, quintic=(3.4445, -4.7750, 2.0)), ns_formula(G, polish=(1.875, -1.25, 0.375)),
                  ns_formula(G, steps=(7, 2))):
        assert (other - want).abs().max().item() > 1e3 * NS64_RTOL * want.abs().max().item()


@pytest.mark.parametrize("heads", [None, 4])
def test_muon_steps_follow_the_recipe(heads):
    """p ← p·(1 − lr·wd) − lr·0.18·√max(r, c)·NS(g + μ·buf), buf ← μ·buf + g (μ = 0.95), per head if set."""
    g = torch.Generator().manual_seed(62)
    rows, cols, lr, wd, mu = 48, 20, 0.03, 0.1, 0.95
    p = torch.nn.Parameter(torch.randn(rows, cols, generator=g, dtype=torch.float64))
    want = p.detach().clone()
    opt = Muon([p], lr=lr, weight_decay=wd, heads=heads, ns_dtype=torch.float64)  # the defaults otherwise
    buf = torch.zeros_like(want)
    h = heads or 1
    for _ in range(3):
        grad = torch.randn(rows, cols, generator=g, dtype=torch.float64)
        p.grad = grad.clone()
        opt.step()
        buf = mu * buf + grad
        u = (grad + mu * buf).view(h, rows // h, cols)  # (heads, rows/heads, cols)
        d = rows // h
        ortho = ns_formula(u) * 0.18 * math.sqrt(max(d, cols))
        want = want * (1 - lr * wd) - lr * ortho.reshape(rows, cols)
        rel = ((p.detach() - want).abs().max() / (lr * ortho.abs().max())).item()
        assert rel <= STEP_RTOL, f"Muon step differs from the recipe by {rel:.2e} of the update"


def _balanced_formula(G: torch.Tensor, tau: float = 1e-3, K: int = 11) -> torch.Tensor:
    """SPEC §7 on a tall G (m ≥ n), materialized: mask rows with ‖G_i‖ ≤ τ·mean‖G_i‖, then K alternating
    ℓ2 normalizations starting (and, K odd, ending) with the rows, then × √n."""
    X = G.clone()
    norms = X.norm(dim=1)
    X[norms <= tau * norms.mean()] = 0
    for k in range(K):
        dim = 1 if k % 2 == 0 else 0
        X = X / (X.norm(dim=dim, keepdim=True) + 1e-20)
    return X * G.shape[1] ** 0.5


def _skewed(g: torch.Generator, m: int, n: int) -> tuple[torch.Tensor, int, int]:
    """A tall update with lognormal row/column scales; one row at 0.9·τ·mean and one at 1.1·τ·mean."""
    G = torch.randn(m, n, generator=g, dtype=torch.float64)
    G = G * torch.randn(m, 1, generator=g, dtype=torch.float64).mul(1.5).exp()
    G = G * torch.randn(1, n, generator=g, dtype=torch.float64).exp()
    below, above = 3, 7
    others = [i for i in range(m) if i not in (below, above)]
    total = G[others].norm(dim=1).sum()
    mean = total / (m - 0.9e-3 - 1.1e-3)  # the mean of all m norms once the two rows are set
    G[below] *= 0.9e-3 * mean / G[below].norm()
    G[above] *= 1.1e-3 * mean / G[above].norm()
    return G, below, above


def test_sinkhorn_balanced_steps_follow_the_recipe():
    g = torch.Generator().manual_seed(63)
    m, n, lr, mu = 200, 24, 0.02, 0.95
    p = torch.nn.Parameter(torch.randn(m, n, generator=g, dtype=torch.float64))
    want = p.detach().clone()
    opt = SinkhornBalanced([p], lr=lr)  # the defaults: τ, K, γ, momentum, Nesterov
    buf = torch.zeros_like(want)
    for step in range(2):
        G, below, above = _skewed(g, m, n)
        p.grad = G.clone() if step == 0 else G.clone() * 0.5
        before = p.detach().clone()
        opt.step()
        grad = p.grad
        buf = mu * buf + grad
        u = grad + mu * buf
        delta = _balanced_formula(u)
        want = want - 0.18 * lr * delta
        rel = ((p.detach() - want).abs().max() / (0.18 * lr * delta.abs().max())).item()
        assert rel <= STEP_RTOL, f"step {step}: differs from the recipe by {rel:.2e} of the update"
        if step == 0:  # no momentum yet: the two rows sit on either side of the τ mask
            moved = (p.detach() - before).abs().sum(1)
            assert moved[below] == 0 and moved[above] > 0, "τ = 1e-3·mean row norm decides which rows move"
            # K = 11 is not K = 9 or 13 at this tolerance, and τ is not 1e-4 or 1e-2
            for other in (_balanced_formula(u, K=9), _balanced_formula(u, K=13), _balanced_formula(u, tau=1e-4),
                          _balanced_formula(u, tau=1e-2)):
                assert (other - delta).abs().max().item() > 1e3 * STEP_RTOL * delta.abs().max().item()
    # no weight decay: a zero gradient with no momentum moves nothing
    q = torch.nn.Parameter(torch.randn(m, n, generator=g, dtype=torch.float64))
    q0 = q.detach().clone()
    q.grad = torch.zeros_like(q)
    SinkhornBalanced([q], lr=lr).step()
    assert torch.equal(q.detach(), q0)
