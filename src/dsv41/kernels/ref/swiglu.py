"""Torch twin of `ops.swiglu`: the reference's clamped SwiGLU in fp32, weighted, cast once (SPEC §1a)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from dsv41.kernels.ops import needs_grad


def _swiglu_math(gate: Tensor, up: Tensor, limit: float, weight: Tensor | None, out_dtype: torch.dtype | None
                 ) -> Tensor:
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


def swiglu(gate: Tensor, up: Tensor, limit: float, weight: Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> Tensor:
    """silu(min(gate, limit)) · clamp(up, ±limit) in fp32 (no clamp when limit <= 0), times `weight`,
    in out_dtype (default gate's). gate, up (M, C); weight (M, G) fp32 with C % G == 0 — column j of
    the hidden is scaled by weight[:, j // (C / G)] (G = 1: a per-row routing weight; G = E: the dense
    MoE's per-expert blocks) — or None. In training (a gradient needed) the same forward runs in an autograd
    Function that saves gate, up and weight as they came instead of autograd's fp32 copies and silu
    intermediates (the experts' widest activations), and recomputes them in the backward."""
    if needs_grad(gate, up, weight):
        return _SwiGLU.apply(gate, up, limit, weight, out_dtype)
    return _swiglu_math(gate, up, limit, weight, out_dtype)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, limit, weight, out_dtype):
        ctx.limit = limit
        ctx.save_for_backward(gate, up, weight)
        return _swiglu_math(gate, up, limit, weight, out_dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        gate, up, weight = ctx.saved_tensors
        limit = ctx.limit
        g, u = gate.float(), up.float()
        g_ok = u_ok = None  # where the clamps pass the gradient (torch.clamp: inclusive bounds)
        if limit > 0:
            g_ok, u_ok = g <= limit, (u >= -limit) & (u <= limit)
            u = u.clamp(min=-limit, max=limit)
            g = g.clamp(max=limit)
        sig = torch.sigmoid(g)
        silu = g * sig
        gh = grad.float()
        grad_w = None
        if weight is not None:
            M, C = gh.shape[0], gh.shape[-1]
            G = weight.shape[-1]
            if ctx.needs_input_grad[3]:
                grad_w = (gh * silu * u).reshape(M, G, C // G).sum(-1).to(weight.dtype)
            gh = (weight.float().reshape(M, G, 1) * gh.reshape(M, G, C // G)).reshape(gh.shape)
        grad_gate = grad_up = None
        if ctx.needs_input_grad[0]:
            grad_gate = gh * u * (sig * (1 + g * (1 - sig)))  # d silu / d g
            if g_ok is not None:
                grad_gate = grad_gate * g_ok
            grad_gate = grad_gate.to(gate.dtype)
        if ctx.needs_input_grad[1]:
            grad_up = gh * silu
            if u_ok is not None:
                grad_up = grad_up * u_ok
            grad_up = grad_up.to(up.dtype)
        return grad_gate, grad_up, None, grad_w, None
