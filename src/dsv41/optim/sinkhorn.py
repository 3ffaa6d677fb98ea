"""Sinkhorn-balanced update for the token embedding, prediction head and Engram tables (SPEC §7).

These matrices are tall lookup tables (vocab or hash buckets × dim) whose gradients are dominated by a
few frequent rows; orthogonalizing them (Muon) mixes unrelated tokens. Instead the update G is
rescaled on both sides, Δ = √n · D_r G D_c with diagonal D_r (m) and D_c (n), found by alternately
ℓ2-normalizing rows and columns (Sinkhorn–Knopp on the squared entries). At the fixed point every
live row has norm √n (row RMS 1) and every column norm √m' over the m' live rows (column RMS 1 over
those rows, ≈ 1 over all m rows when few are masked): each token and each feature moves by the same
amount, whatever its gradient scale.

Rows with ‖G_i‖ ≤ τ·mean_i ‖G_i‖ are masked to zero — tokens absent from recent batches, whose tiny
(momentum) update would otherwise be blown up to full size by the row normalization.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor


def sinkhorn_balance(G: Tensor, tau: float = 1e-3, iters: int = 11, eps: float = 1e-20) -> Tensor:
    """Δ = √n · D_r G D_c for G (m, n) with m ≥ n (a wide G is transposed and back).

    D_r, D_c are kept as vectors: the row norms of D_r G D_c are D_r ⊙ √(G² D_c²) and the column
    norms D_c ⊙ √(D_r² G²), so each of the `iters` (odd: the last is a row step) normalizations is
    a matrix–vector product with the fixed G², never a new m × n matrix.
    """
    if G.ndim != 2:
        raise ValueError(f"sinkhorn_balance needs a matrix, got shape {tuple(G.shape)}")
    if iters < 1 or iters % 2 == 0:
        raise ValueError(f"iters must be odd so the last normalization is over rows, got {iters}")
    X = G.double() if G.dtype == torch.float64 else G.float()
    transposed = X.shape[0] < X.shape[1]
    if transposed:
        X = X.T
    m, n = X.shape
    # Δ does not depend on G's scale; dividing by max|G| keeps G² clear of fp32 under/overflow.
    X = X / X.abs().amax().clamp_min(torch.finfo(X.dtype).tiny)
    S = X.square()  # (m, n), the only matrix built besides Δ
    row_norms = S.sum(1).sqrt()  # (m,)
    d_r = (row_norms > tau * row_norms.mean()).to(X.dtype)  # masked rows start (and stay) at 0
    d_c = torch.ones(n, dtype=X.dtype, device=X.device)
    # a row or column whose norm is 0 (all of G zero, or a column with only masked rows) gets scale 0:
    # 1 / eps would square to inf in fp32 and make 0 · inf = NaN in the next product
    for k in range(iters):
        if k % 2 == 0:  # rows of D_r X D_c to unit norm
            norm = d_r * (S @ d_c.square()).sqrt()  # (m,)
            d_r = torch.where(norm > 0, d_r / (norm + eps), torch.zeros_like(d_r))
        else:  # columns to unit norm
            norm = d_c * (d_r.square() @ S).sqrt()  # (n,)
            d_c = torch.where(norm > 0, d_c / (norm + eps), torch.zeros_like(d_c))
    delta = (n**0.5 * d_r)[:, None] * X * d_c[None, :]  # (m, n); rows of norm √n ⇒ row RMS 1
    if transposed:
        delta = delta.T
    return delta.to(G.dtype)


class SinkhornBalanced(torch.optim.Optimizer):
    """Nesterov momentum → Sinkhorn balancing → p ← p − γ·lr·Δ (γ = 0.18, no weight decay).

    γ = 0.18 makes the update RMS match Muon's, so the shared learning rate means the same thing.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 2.6e-4,
        momentum: float = 0.95,
        nesterov: bool = True,
        gamma: float = 0.18,
        tau: float = 1e-3,
        iters: int = 11,
        eps: float = 1e-20,
    ):
        if lr < 0 or not 0 <= momentum < 1:
            raise ValueError(f"bad SinkhornBalanced hyper-parameters lr={lr} momentum={momentum}")
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, gamma=gamma, tau=tau, iters=iters, eps=eps)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"SinkhornBalanced handles matrices only; got shape {tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            mu = group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.mul_(mu).add_(g)
                update = g.add(buf, alpha=mu) if group["nesterov"] else buf
                delta = sinkhorn_balance(update, group["tau"], group["iters"], group["eps"])
                if isinstance(group["lr"], torch.Tensor):  # a device scalar (a CUDA-graphed step: train/graphs.py)
                    p.sub_(delta.mul_(group["gamma"] * group["lr"]))
                else:
                    p.add_(delta, alpha=-group["gamma"] * group["lr"])
        return loss
