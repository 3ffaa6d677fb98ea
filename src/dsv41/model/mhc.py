"""Manifold-constrained hyper-connections (mHC) with the report's single-pass schedule (SPEC §5).

The residual stream is `hc_mult` parallel copies X (n × d). Each sublayer F gets the coefficients
(pre A ∈ R^n, post C ∈ R^n, comb B ∈ R^{n×n}) from one projection of the RMS-normalized flattened
stream; B is made doubly stochastic by Sinkhorn–Knopp. The update is X ← B·X + C·F(A·X).
Single-pass mHC feeds a sublayer with the pre-mix made by the *previous* sublayer
(X_{l+1} = B_l X_l + C_l F_l(A_{l−1} X_l)), so residual update, input mixing and coefficient
prediction read X once — the fusion the Mega-mHC kernel exploits. The first pre-mix is one-hot on
stream 0. `classic` mode uses the sublayer's own A (same parameters) for ablations.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def hc_split_sinkhorn(mixes: Tensor, hc_scale: Tensor, hc_base: Tensor, hc_mult: int, iters: int,
                      eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """Split (..., (2+n)·n) projections into pre (..., n), post (..., n) and comb (..., n, n).

    pre = σ(s0·m + b) + eps, post = 2σ(s1·m + b), comb = row-softmax(s2·m + b) + eps followed by a
    column normalization and `iters − 1` more row+column rounds (the official order)."""
    n = hc_mult
    pre = torch.sigmoid(mixes[..., :n] * hc_scale[0] + hc_base[:n]) + eps
    post = 2 * torch.sigmoid(mixes[..., n:2 * n] * hc_scale[1] + hc_base[n:2 * n])
    logits = (mixes[..., 2 * n:] * hc_scale[2] + hc_base[2 * n:]).unflatten(-1, (n, n))  # (..., n, n)
    comb = torch.softmax(logits, dim=-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre, post, comb


def hc_project(x: Tensor, hc_fn: Tensor, norm_eps: float) -> Tensor:
    """Projection of flatten(x) (B, T, n, d), divided by its RMS: (B, T, (2+n)·n) fp32."""
    flat = x.flatten(-2).float()  # (B, T, n·d)
    rsqrt = torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    return F.linear(flat, hc_fn.float()) * rsqrt  # (B, T, (2+n)·n)


def hc_mixes(x: Tensor, hc_fn: Tensor, hc_scale: Tensor, hc_base: Tensor, *, norm_eps: float, hc_mult: int,
             iters: int, hc_eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """Coefficients from the stream x (B, T, n, d): Sinkhorn split of `hc_project`."""
    mixes = hc_project(x, hc_fn, norm_eps)
    return hc_split_sinkhorn(mixes, hc_scale.float(), hc_base.float(), hc_mult, iters, hc_eps)


def hc_pre(x: Tensor, pre: Tensor) -> Tensor:
    """Collapse streams: (B, T, n, d) × (B, T, n) → (B, T, d), summed in fp32."""
    return (pre.unsqueeze(-1) * x.float()).sum(dim=-2).to(x.dtype)


def hc_post(f: Tensor, residual: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    """Expand a sublayer output back: y_j = post_j·f + Σ_i comb_ij·x_i → (B, T, n, d)."""
    mixed = torch.einsum("btij,btid->btjd", comb, residual.float())
    return (post.unsqueeze(-1) * f.float().unsqueeze(-2) + mixed).to(f.dtype)


def identity_pre_mix(x: Tensor, hc_mult: int) -> Tensor:
    """The first pre-mix: one-hot on stream 0, (B, T, n) fp32."""
    pre = x.new_zeros(*x.shape[:2], hc_mult, dtype=torch.float32)
    pre[..., 0] = 1.0
    return pre
