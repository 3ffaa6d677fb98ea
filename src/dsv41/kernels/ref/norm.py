"""Torch twin of `ops.rms_norm`: RMSNorm computed in fp32 and cast back (the executable spec).

In training (a gradient needed) the same forward runs inside an autograd Function that saves x as it came
(bf16 under autocast), the weight and the (…, 1) reciprocal RMS, not autograd's fp32 copies of x and of the
normalized x; the backward is the closed form  ∂x = r·(g − n·mean(g·n)),  g = w·∂y,  n = x·r."""

from __future__ import annotations

import torch
from torch import Tensor

from dsv41.kernels.ops import needs_grad


def _rms_norm_math(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    h = x.float()
    rsqrt = torch.rsqrt(h.square().mean(-1, keepdim=True) + eps)
    return (weight.float() * (h * rsqrt)).to(x.dtype), rsqrt


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """weight · x / sqrt(mean(x²) + eps) over the last dim, in fp32, returned in x's dtype."""
    if needs_grad(x, weight):
        return _RMSNorm.apply(x, weight, eps)
    return _rms_norm_math(x, weight, eps)[0]


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        y, rsqrt = _rms_norm_math(x, weight, eps)
        ctx.save_for_backward(x, weight, rsqrt)
        return y

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight, rsqrt = ctx.saved_tensors
        n = x.float() * rsqrt  # the normalized x, recomputed
        gy = grad.float()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            g = gy * weight.float()
            grad_x = (rsqrt * (g - n * (g * n).mean(-1, keepdim=True))).to(x.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = (gy * n).reshape(-1, n.size(-1)).sum(0).to(weight.dtype)
        return grad_x, grad_w, None
