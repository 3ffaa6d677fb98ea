"""Torch twin of `ops.moe_route`: the router's scoring, biased top-k choice and weights (SPEC §1a, the
DeepSeekMoE gate). This is the model's formula; the Triton kernel (`kernels.triton.router`) must equal it."""

from __future__ import annotations

from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor


def moe_route(logits: Tensor, bias: Tensor, gate_temp: float, score_func: str, k: int, norm: bool,
              route_scale: float, dense: bool = False, hook: Callable[[Tensor], Tensor] | None = None,
              dense_ones: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """logits (N, E) fp32 (x · Wᵀ), bias (E,) or (N, E) fp32 → weights (N, k) fp32, indices (N, k) int64,
    scores (N, E) fp32, and with `dense` the (N, E) routing matrix (each chosen expert's weight, else 0) followed
    by `dense_ones` columns of 1 (the dense MoE's shared expert block: `MoE.fuse_dense`).
    hook(indices) → the indices to use (recorded / replayed routing); the weights follow them."""
    scores = logits / gate_temp
    if score_func == "softmax":
        scores = scores.softmax(dim=-1)
    elif score_func == "sigmoid":
        scores = scores.sigmoid()
    else:
        scores = F.softplus(scores).sqrt()
    indices = (scores + bias).topk(k, dim=-1).indices  # the bias steers the choice, not the weight
    if hook is not None:
        indices = hook(indices)
    weights = scores.gather(1, indices)
    if norm and k > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * route_scale
    route = None
    if dense:
        if dense_ones < 0:
            raise ValueError(f"moe_route: dense_ones must be >= 0, got {dense_ones}")
        route = F.pad(scores.new_zeros(scores.shape).scatter_(1, indices, weights), (0, dense_ones), value=1.0)
    return weights, indices, scores, route
