"""Benchmark cases of the single-pass mHC kernels (SPEC §5): Mega-mHC pass, projection, Sinkhorn split.

Work is the minimum bytes moved: mhc_post reads h (n·d) + f (d) and writes h_new (n·d) + x (d) —
(2n+2)·d elements per token — plus the per-token coefficients (post n, comb n², pre n fp32) and
mixes ((2+n)·n fp32), and hc_fn once. The Triton op should run near the copy ceiling; the torch
twin is the eager multi-pass composition (fp32 intermediates) the model used before.
"""

from __future__ import annotations

import torch

from dsv41.kernels.ref import mhc as twin
from dsv41.kernels.triton import mhc as fused

N = 4
K = (2 + N) * N


def streams(B: int, T: int, d: int, device: torch.device, seed: int):
    """Random hand-over inputs (h, f bf16; post, comb, pre, hc_fn fp32) of B × T tokens at width d (also the
    training cases', kernel_cases/mhc_train.py)."""
    g = torch.Generator(device=device).manual_seed(seed)
    h = torch.randn(B, T, N, d, generator=g, device=device).bfloat16()
    f = torch.randn(B, T, d, generator=g, device=device).bfloat16()
    post = 2 * torch.rand(B, T, N, generator=g, device=device)
    comb = torch.softmax(torch.randn(B, T, N, N, generator=g, device=device), dim=-1)
    pre = torch.rand(B, T, N, generator=g, device=device)
    fn = 0.01 * torch.randn(K, N * d, generator=g, device=device)
    return h, f, post, comb, pre, fn


def _post_case(name: str, B: int, T: int, d: int, device: torch.device, with_fn: bool, note: str) -> dict:
    h, f, post, comb, pre, fn = streams(B, T, d, device, seed=B * T + d)
    fn = fn if with_fn else None
    M = B * T
    per_token = (2 * N + 2) * d * 2 + (2 * N + N * N) * 4 + (K * 4 if with_fn else 0)  # streams + coefficients
    work = M * per_token + (K * N * d * 4 if with_fn else 0)  # + hc_fn once

    @torch.no_grad()
    def run_triton():
        return fused.mhc_post(h, f, post, comb, pre, fn, 1e-6)

    @torch.no_grad()
    def run_torch():
        return twin.mhc_post(h, f, post, comb, pre, fn, 1e-6)

    return dict(name=name, shape=f"B={B} T={T} n={N} d={d} bf16" + ("" if with_fn else " no hc_fn"), unit="byte",
                work=work, ceiling="copy", triton=run_triton, torch=run_torch, note=note,
                sweep=lambda **knobs: fused.mhc_post(h, f, post, comb, pre, fn, 1e-6, **knobs))


def _post_split_case(name: str, B: int, d: int, device: torch.device, note: str) -> dict:
    """One inference hand-over (`mhc_post_split`): the pass with the Sinkhorn split of the next coefficients as
    the finish kernel's epilogue. Work as `_post_case` plus the (2n + n²) fp32 coefficients written."""
    h, f, post, comb, pre, fn = streams(B, 1, d, device, seed=B + d + 1)
    g = torch.Generator(device=device).manual_seed(9)
    scale, base = 0.5 + torch.rand(3, generator=g, device=device), torch.randn(K, generator=g, device=device)
    args = (h, f, post, comb, pre, fn, 1e-6, scale, base, N, 20, 1e-6)
    per_token = (2 * N + 2) * d * 2 + (2 * N + N * N) * 4 * 2 + K * 4
    return dict(name=name, shape=f"B={B} T=1 n={N} d={d} bf16 iters=20", unit="byte",
                work=B * per_token + K * N * d * 4, ceiling="copy",
                triton=torch.no_grad()(lambda: fused.mhc_post_split(*args)),
                torch=torch.no_grad()(lambda: twin.mhc_post_split(*args)), note=note,
                sweep=lambda **knobs: fused.mhc_post_split(*args, **knobs))


def cases(device: torch.device) -> list[dict]:
    out = [
        _post_case("mhc_post prefill", 1, 16384, 5120, device, True,
                   "bandwidth-bound if the 24-output projection (3 bf16 MMAs per fp32 product, ~10 FLOP/B) "
                   "overlaps the stream; fused design: hc_fn pre-split once into bf16 planes (L2), 128 programs "
                   "of 128 tokens × 32 channels (8 warps, one per SM), h / f tiles by TMA and the planes by "
                   "cp.async, 2 chunks in flight (3 stages); the projection costs ~nothing beside the stream"),
        _post_case("mhc_post prefill, last pass", 1, 16384, 5120, device, False,
                   "pure stream: residual update + collapse, no projection (legacy kernel, plain loads, "
                   "16-token × 128-channel tiles since 2026-11-30: 64 × 64 stopped at 67 %)"),
        _post_case("mhc_post small preset", 4, 16384, 384, device, True,
                   "d = 384: 6 chunks per token tile, coefficient loads and the hc_fn split weigh more"),
        _post_case("mhc_post decode batch", 128, 1, 5120, device, True,
                   "13 MB: L2-resident, launch-bound; 2 token tiles × 80 d spans (160 programs) + finish kernel"),
        _post_case("mhc_post small decode B=64", 64, 1, 384, device, True,
                   "the `small` preset's decode step (27 per step): latency-bound, a few programs"),
        _post_case("mhc_post decode B=1", 1, 1, 5120, device, True,
                   "one token: pure latency (two launches), reported for the decode step budget"),
        _post_split_case("mhc_post_split small decode B=64", 64, 384, device,
                         "the model's decode hand-over: pass + finish with the split as its epilogue (2 launches); "
                         "the separate path is `mhc_post small decode B=64` + `mhc_split decode B=64` (3)"),
        _post_split_case("mhc_post_split small replay M=128", 128, 384, device,
                         "the decoder replay's hand-over (128 tokens of `small`; 13 passes per replay graph: pass "
                         "98 µs + finish 53 µs in all on the H100, 2026-12-06) — sweep `split` (1: no finish kernel) "
                         "and `split_in_pass` (the split in the unsplit pass) to drop the second launch"),
        _post_split_case("mhc_post_split decode batch", 128, 5120, device,
                         "v41-flash decode hand-over, 2 launches; separate: `mhc_post decode batch` + a split"),
    ]

    h, *_, fn = streams(1, 16384, 5120, device, seed=7)
    M, d = h.shape[0] * h.shape[1], h.shape[-1]
    out.append(dict(
        name="mhc_mixes prefill", shape=f"B=1 T=16384 n={N} d={d} bf16", unit="byte",
        work=M * (N * d * 2 + K * 4) + K * N * d * 4, ceiling="copy",
        triton=torch.no_grad()(lambda: fused.mhc_mixes(h, fn, 1e-6)),
        torch=torch.no_grad()(lambda: twin.mhc_mixes(h, fn, 1e-6)),
        note="read-only stream of h (TMA, as mhc_post); the projection is the same MMA work per byte ×2 "
             "as in mhc_post",
        sweep=lambda **knobs: fused.mhc_mixes(h, fn, 1e-6, **knobs)))

    g = torch.Generator(device=device).manual_seed(8)
    mixes = torch.randn(1, 16384, K, generator=g, device=device)
    scale = 0.5 + torch.rand(3, generator=g, device=device)
    base = torch.randn(K, generator=g, device=device)
    out.append(dict(
        name="mhc_split prefill", shape=f"T=16384 n={N} iters=20", unit="byte",
        work=16384 * (K + 2 * N + N * N) * 4, ceiling="copy",
        triton=torch.no_grad()(lambda: fused.mhc_split(mixes, scale, base, N, 20, 1e-6)),
        torch=torch.no_grad()(lambda: twin.mhc_split(mixes, scale, base, N, 20, 1e-6)),
        note="3 MB: launch/latency-bound (20 dependent Sinkhorn rounds in registers); the twin launches ~90 kernels",
        sweep=lambda **knobs: fused.mhc_split(mixes, scale, base, N, 20, 1e-6, **knobs)))
    for M in (64, 1):  # the decode step's split: one per sublayer, 24 per `small` step
        small = mixes[0, :M]
        out.append(dict(
            name=f"mhc_split decode B={M}", shape=f"T={M} n={N} iters=20", unit="byte",
            work=M * (K + 2 * N + N * N) * 4, ceiling="copy",
            triton=torch.no_grad()(lambda small=small: fused.mhc_split(small, scale, base, N, 20, 1e-6)),
            torch=torch.no_grad()(lambda small=small: twin.mhc_split(small, scale, base, N, 20, 1e-6)),
            note="pure latency: the 40 dependent normalizations of a token; `split_launch` picks the tokens per "
                 "program",
            sweep=lambda small=small, **knobs: fused.mhc_split(small, scale, base, N, 20, 1e-6, **knobs)))
    return out
