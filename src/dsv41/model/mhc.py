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

from dsv41.kernels.ops import needs_grad


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


def _hc_project_parts(x: Tensor, hc_fn: Tensor, norm_eps: float) -> tuple[Tensor, Tensor]:
    """(flatten(x) @ hc_fnᵀ (B, T, (2+n)·n), 1 / RMS of flatten(x) (B, T, 1)), in fp32."""
    flat = x.flatten(-2).float()  # (B, T, n·d)
    rsqrt = torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    return F.linear(flat, hc_fn.float()), rsqrt


def _hc_project_math(x: Tensor, hc_fn: Tensor, norm_eps: float) -> Tensor:
    lin, rsqrt = _hc_project_parts(x, hc_fn, norm_eps)
    return lin * rsqrt  # (B, T, (2+n)·n)


def hc_project(x: Tensor, hc_fn: Tensor, norm_eps: float) -> Tensor:
    """Projection of flatten(x) (B, T, n, d), divided by its RMS: (B, T, (2+n)·n) fp32."""
    if needs_grad(x, hc_fn):
        return _HcProject.apply(x, hc_fn, norm_eps)
    return _hc_project_math(x, hc_fn, norm_eps)


def hc_mixes(x: Tensor, hc_fn: Tensor, hc_scale: Tensor, hc_base: Tensor, *, norm_eps: float, hc_mult: int,
             iters: int, hc_eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """Coefficients from the stream x (B, T, n, d): Sinkhorn split of `hc_project`."""
    mixes = hc_project(x, hc_fn, norm_eps)
    return hc_split_sinkhorn(mixes, hc_scale.float(), hc_base.float(), hc_mult, iters, hc_eps)


def _hc_pre_math(x: Tensor, pre: Tensor) -> Tensor:
    return (pre.unsqueeze(-1) * x.float()).sum(dim=-2).to(x.dtype)


def hc_pre(x: Tensor, pre: Tensor) -> Tensor:
    """Collapse streams: (B, T, n, d) × (B, T, n) → (B, T, d), summed in fp32."""
    if needs_grad(x, pre):
        return _HcPre.apply(x, pre)
    return _hc_pre_math(x, pre)


def _hc_post_math(f: Tensor, residual: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    mixed = torch.einsum("btij,btid->btjd", comb, residual.float())
    return (post.unsqueeze(-1) * f.float().unsqueeze(-2) + mixed).to(f.dtype)


def hc_post(f: Tensor, residual: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    """Expand a sublayer output back: y_j = post_j·f + Σ_i comb_ij·x_i → (B, T, n, d)."""
    if needs_grad(f, residual, post, comb):
        return _HcPost.apply(f, residual, post, comb)
    return _hc_post_math(f, residual, post, comb)


# ---------------------------------------------------------------------- training: lean saved activations
# Autograd of the three formulas above saves the fp32 upcasts of the (B, T, n, d) streams (x.float(),
# residual.float(), the flattened stream): with bf16 streams that is twice the stream's bytes per use, and
# the streams are the model's widest activations (n = 4 copies of d). These Functions compute the same
# forward and save the inputs as they came (bf16 tensors that other ops keep alive anyway), upcasting again
# in the backward; the upcast is exact, so the gradients are the plain autograd's up to fp32 summation order.
# Only when a gradient will be taken (`ops.needs_grad`): inference keeps the plain formulas.
class _HcPre(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, pre: Tensor) -> Tensor:
        ctx.save_for_backward(x, pre)
        return _hc_pre_math(x, pre)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, pre = ctx.saved_tensors
        g = grad.float().unsqueeze(-2)  # (B, T, 1, d)
        grad_x = (pre.unsqueeze(-1) * g).to(x.dtype) if ctx.needs_input_grad[0] else None
        grad_pre = (x.float() * g).sum(-1).to(pre.dtype) if ctx.needs_input_grad[1] else None
        return grad_x, grad_pre


class _HcPost(torch.autograd.Function):
    @staticmethod
    def forward(ctx, f: Tensor, residual: Tensor, post: Tensor, comb: Tensor) -> Tensor:
        ctx.save_for_backward(f, residual, post, comb)
        return _hc_post_math(f, residual, post, comb)

    @staticmethod
    def backward(ctx, grad: Tensor):
        f, residual, post, comb = ctx.saved_tensors
        g = grad.float()  # (B, T, n, d)
        need = ctx.needs_input_grad
        grad_f = (post.unsqueeze(-1) * g).sum(-2).to(f.dtype) if need[0] else None
        grad_res = torch.einsum("btij,btjd->btid", comb, g).to(residual.dtype) if need[1] else None
        grad_post = (g * f.float().unsqueeze(-2)).sum(-1).to(post.dtype) if need[2] else None
        grad_comb = torch.einsum("btjd,btid->btij", g, residual.float()).to(comb.dtype) if need[3] else None
        return grad_f, grad_res, grad_post, grad_comb


class _HcProject(torch.autograd.Function):
    """out = (flat @ Wᵀ)·r, r = (mean(flat²) + eps)^(-1/2): saves x, W, r and lin = flat @ Wᵀ ((2+n)·n per token)."""

    @staticmethod
    def forward(ctx, x: Tensor, hc_fn: Tensor, norm_eps: float) -> Tensor:
        lin, rsqrt = _hc_project_parts(x, hc_fn, norm_eps)
        ctx.save_for_backward(x, hc_fn, rsqrt, lin)
        return lin * rsqrt

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, hc_fn, rsqrt, lin = ctx.saved_tensors
        grad = grad.float()
        flat = x.flatten(-2).float()
        w = hc_fn.float()
        grad_lin = grad * rsqrt  # (B, T, M)
        grad_x = grad_fn = None
        if ctx.needs_input_grad[0]:
            grad_r = (grad * lin).sum(-1, keepdim=True)  # (B, T, 1)
            # d r / d flat = −r³·flat / N
            grad_flat = grad_lin @ w - grad_r * rsqrt.pow(3) * flat / flat.size(-1)
            grad_x = grad_flat.to(x.dtype).view(x.shape)
        if ctx.needs_input_grad[1]:
            grad_fn = (grad_lin.reshape(-1, grad_lin.size(-1)).mT @ flat.reshape(-1, flat.size(-1))).to(hc_fn.dtype)
        return grad_x, grad_fn, None


def identity_pre_mix(x: Tensor, hc_mult: int) -> Tensor:
    """The first pre-mix: one-hot on stream 0, (B, T, n) fp32."""
    pre = x.new_zeros(*x.shape[:2], hc_mult, dtype=torch.float32)
    pre[..., 0] = 1.0
    return pre
