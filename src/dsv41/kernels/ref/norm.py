"""Torch twin of `ops.rms_norm`: RMSNorm computed in fp32 and cast back (the executable spec)."""

from __future__ import annotations

import torch
from torch import Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """weight · x / sqrt(mean(x²) + eps) over the last dim, in fp32, returned in x's dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps)
    return (weight.float() * h).to(x.dtype)
