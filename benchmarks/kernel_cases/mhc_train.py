"""Benchmark cases of the mHC hand-over's training kernels (issue 18, `kernels/triton/mhc_train.py`).

A case times one hand-over's forward and backward, `MhcPostTrain` against autograd through the twin
(`ref.mhc.mhc_post`: the three `model.mhc` Functions); `sweep` (benchmarks/sweep.py, sass.py) runs the two
backward kernels alone with their knobs (`fn_*` for `hc_fn_grad`). Work is the minimum bytes moved per token:
the forward reads h (n·d), f (d) and writes h_new (n·d), x (d); the backward reads h, h_new, g_h_new (n·d each),
f, g_x (d each) and writes g_h (n·d), g_f (d) — 29·d elements at n = 4 — plus the fp32 per-token coefficients
(post, comb, pre in; their gradients out), mixes, g_mixes, g_lin, and hc_fn read and its gradient written once.
The backward's first loop (r) and the weight's gradient read h_new again (L2 / 8·d bytes): overhead, not work.
"""

from __future__ import annotations

import torch
from kernel_cases.mhc import streams

from dsv41.kernels.ref import mhc as twin
from dsv41.kernels.triton import mhc_train

N = 4
K = (2 + N) * N
EPS = 1e-20  # the `small` preset's norm_eps


def _backward_case(name: str, B: int, T: int, d: int, device: torch.device, note: str) -> dict:
    h, f, post, comb, pre, fn = streams(B, T, d, device, seed=B * T + d)
    with torch.no_grad():  # the twin: building a case launches no kernel (benchmarks/sass.py only compiles)
        h_new, x, mixes = twin.mhc_post(h, f, post, comb, pre, fn, EPS)
    g_h_new, g_x = torch.randn_like(h_new), torch.randn_like(x)
    g_mixes = torch.randn_like(mixes)
    M = B * T
    work = M * (29 * d * 2 + 2 * (N + N * N + N) * 4 + 4 * K * 4) + 3 * K * N * d * 4

    def sweep(**knobs):
        fn_knobs = {k[3:]: v for k, v in knobs.items() if k.startswith("fn_")}
        bwd = {k: v for k, v in knobs.items() if not k.startswith("fn_")}
        grads = mhc_train.mhc_post_backward(h, f, post, comb, pre, fn, h_new, mixes, g_h_new, g_x, g_mixes, EPS,
                                            **bwd)
        return grads, mhc_train.hc_fn_grad(h_new, grads[-1], **fn_knobs)

    leaves = [t.detach().clone().requires_grad_(True) for t in (h, f, post, comb, pre, fn)]

    def train(step):
        def run():
            outs = step(*leaves, EPS)
            return torch.autograd.grad(outs, leaves, (g_h_new, g_x, g_mixes))
        return run

    return dict(name=name, shape=f"B={B} T={T} n={N} d={d} bf16", unit="byte", work=work, ceiling="copy",
                triton=train(mhc_train.mhc_post_train), torch=train(twin.mhc_post), note=note, sweep=sweep)


def cases(device: torch.device) -> list[dict]:
    return [
        _backward_case("mhc_post backward small", 16, 1024, 384, device,
                       "the 16 × 1024 `small` training step's hand-over: forward pass (hc_fn split + pass), backward "
                       "kernel (14.6 KB per token; 2 loops over d: Σ h_new² for r, then G), the weight's gradient "
                       "(3.2 KB per token; split-K over token spans, bf16x3 dots) and one sum: 5 launches; the twin "
                       "~52 ops"),
        _backward_case("mhc_post backward v41-flash", 1, 4096, 5120, device,
                       "d = 5120: 80 chunks of 64 channels per token tile"),
    ]
