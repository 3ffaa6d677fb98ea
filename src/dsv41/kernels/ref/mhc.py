"""Torch twins of the single-pass mHC kernels (SPEC §5): the executable spec of `ops.mhc_post`,
`ops.mhc_mixes` and `ops.mhc_split`.

Each twin is a composition of the model's own functions in `model.mhc`, so swapping the separate
calls in `Block.forward` for these ops changes nothing numerically (bit-identical on one device):
  * mhc_post  = hc_post (residual update) → hc_pre (next input mix) → the projection of hc_mixes;
  * mhc_mixes = the projection + RMS part of hc_mixes (before the Sinkhorn split);
  * mhc_split = hc_split_sinkhorn on fp32 parameters (as hc_mixes calls it);
  * mhc_post_split / mhc_mixes_split = mhc_post / mhc_mixes then mhc_split (the Triton kernels run the split
    as the epilogue of the kernel that writes the mixes; here it is the composition);
  * mhc_split_backward = autograd through mhc_split (the reference of the Triton backward that
    `ops.mhc_split` trains with on CUDA).
Plain torch ops only: training runs these with autograd.
"""

from __future__ import annotations

import torch
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


def mhc_post_split(h: Tensor, f: Tensor, post: Tensor, comb: Tensor, pre: Tensor, hc_fn: Tensor, norm_eps: float,
                   hc_scale: Tensor, hc_base: Tensor, hc_mult: int, iters: int, hc_eps: float
                   ) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor, Tensor]]:
    """(h_new, x, mhc_split(mixes of h_new)): the next sublayer's coefficients instead of its mixes."""
    h_new, x, mixes = mhc_post(h, f, post, comb, pre, hc_fn, norm_eps)
    return h_new, x, mhc_split(mixes, hc_scale, hc_base, hc_mult, iters, hc_eps)


def mhc_mixes_split(h: Tensor, hc_fn: Tensor, norm_eps: float, hc_scale: Tensor, hc_base: Tensor, hc_mult: int,
                    iters: int, hc_eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """(pre, post, comb) of the streams h: mhc_split of mhc_mixes = hc_mixes."""
    return mhc_split(mhc_mixes(h, hc_fn, norm_eps), hc_scale, hc_base, hc_mult, iters, hc_eps)


def mhc_split_backward(mixes: Tensor, hc_scale: Tensor, hc_base: Tensor, g_pre: Tensor | None,
                       g_post: Tensor | None, g_comb: Tensor | None, hc_mult: int, iters: int, eps: float
                       ) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of (mixes (fp32), hc_scale, hc_base) through `mhc_split` from those of pre, post, comb
    (None = zero): autograd of the forward, recomputed on detached inputs."""
    leaves = [t.detach().requires_grad_(True) for t in (mixes, hc_scale, hc_base)]
    with torch.enable_grad():
        outs = mhc_split(*leaves, hc_mult, iters, eps)
        pairs = [(o, g) for o, g in zip(outs, (g_pre, g_post, g_comb)) if g is not None]
        if not pairs:
            return tuple(torch.zeros_like(t, dtype=torch.float32 if i == 0 else t.dtype)
                         for i, t in enumerate((mixes, hc_scale, hc_base)))
        grads = torch.autograd.grad([o for o, _ in pairs], leaves, [g for _, g in pairs], allow_unused=True)
    return tuple(torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves))
