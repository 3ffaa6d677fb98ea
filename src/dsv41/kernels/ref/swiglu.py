"""Torch twin of `ops.swiglu`: the reference's clamped SwiGLU in fp32, weighted, cast once (SPEC §1a)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def swiglu(gate: Tensor, up: Tensor, limit: float, weight: Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> Tensor:
    """silu(min(gate, limit)) · clamp(up, ±limit) in fp32 (no clamp when limit <= 0), times `weight`,
    in out_dtype (default gate's). gate, up (M, C); weight (M, G) fp32 with C % G == 0 — column j of
    the hidden is scaled by weight[:, j // (C / G)] (G = 1: a per-row routing weight; G = E: the dense
    MoE's per-expert blocks) — or None."""
    g, u = gate.float(), up.float()
    if limit > 0:
        u = u.clamp(min=-limit, max=limit)
        g = g.clamp(max=limit)
    h = F.silu(g) * u
    if weight is not None:
        M, C = h.shape[0], h.shape[-1]
        G = weight.shape[-1]
        h = (weight.reshape(M, G, 1) * h.reshape(M, G, C // G)).reshape(h.shape)
    return h.to(out_dtype or gate.dtype)
