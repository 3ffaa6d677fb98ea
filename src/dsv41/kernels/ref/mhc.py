"""Torch twins of the single-pass mHC kernels (SPEC §5): the executable spec of `ops.mhc_post`,
`ops.mhc_mixes` and `ops.mhc_split`.

Each twin is a composition of the model's own functions in `model.mhc`, so swapping the separate
calls in `Block.forward` for these ops changes nothing numerically (bit-identical on one device):
  * mhc_post  = hc_post (residual update) → hc_pre (next input mix) → the projection of hc_mixes;
  * mhc_mixes = the projection + RMS part of hc_mixes (before the Sinkhorn split);
  * mhc_split = hc_split_sinkhorn on fp32 parameters (as hc_mixes calls it).
Plain torch ops only: training runs these with autograd.
"""

from __future__ import annotations

from torch import Tensor

from dsv41.model.mhc import hc_post, hc_pre, hc_project, hc_split_sinkhorn


def mhc_mixes(h: Tensor, hc_fn: Tensor, norm_eps: float) -> Tensor:
    """(flatten(h) @ hc_fnᵀ)·rsqrt(mean(flatten(h)²) + eps): (B, T, (2+n)·n) fp32 — hc_mixes' first half."""
    return hc_project(h, hc_fn, norm_eps)


def mhc_post(h: Tensor, f: Tensor, post: Tensor, comb: Tensor, pre: Tensor, hc_fn: Tensor | None,
             norm_eps: float) -> tuple[Tensor, Tensor, Tensor | None]:
    """h_new = hc_post(f, h, post, comb) (f's dtype); x = hc_pre(h_new, pre); mixes of h_new (or None)."""
    h_new = hc_post(f, h, post, comb)  # (B, T, n, d), rounded once to f's dtype
    x = hc_pre(h_new, pre)  # (B, T, d), fp32 sum over the rounded streams
    mixes = None if hc_fn is None else mhc_mixes(h_new, hc_fn, norm_eps)
    return h_new, x, mixes


def mhc_split(mixes: Tensor, hc_scale: Tensor, hc_base: Tensor, hc_mult: int, iters: int, eps: float
              ) -> tuple[Tensor, Tensor, Tensor]:
    """pre (..., n), post (..., n), comb (..., n, n) fp32 — hc_mixes' second half."""
    return hc_split_sinkhorn(mixes.float(), hc_scale.float(), hc_base.float(), hc_mult, iters, eps)
