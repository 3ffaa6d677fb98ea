"""Benchmark cases of the DSpark drafter's greedy Markov loop (`ops.markov_greedy`) at the shipped drafter's sizes
(V 16,384, Markov rank r 256, model width 384, K = 5 draft positions).

Work is the minimum bytes read: the base logits (B·K·V fp32) and the Markov head (V·r fp32) once; the loop is
K dependent steps (each position's bias needs the argmax before it), so small batches are launch- and
latency-bound, not bandwidth-bound. The Triton op is K + 1 launches: one row per program below 16 rows, tiles
of 16 rows through `tl.dot` from 16 up; the twin is the model's per-position loop (an embedding gather, a
GEMV, an add and an argmax per position). `ops.MARKOV_TRITON_ROWS` picks between them under `auto` from these
cases (2026-12-07, H100: 61 µs against the twin's 131 at B = 1, 513 against 201 at B = 64).
"""

from __future__ import annotations

import torch

from dsv41.kernels.ref import markov as twin
from dsv41.kernels.triton import markov as fused

V, R, DIM, K = 16384, 256, 384, 5


def _case(B: int, device: torch.device, note: str) -> dict:
    g = torch.Generator(device=device).manual_seed(B)
    base = torch.randn(B, K, V, device=device, generator=g)
    hidden = torch.randn(B, K, DIM, device=device, generator=g)
    anchors = torch.randint(0, V, (B,), device=device, generator=g)
    embed = torch.randn(V, R, device=device, generator=g) * 0.05
    head = torch.randn(V, R, device=device, generator=g) * 0.05
    w = torch.randn(DIM + R, device=device, generator=g)
    args = (base, hidden, anchors, embed, head, w)
    return dict(name=f"greedy loop B={B}", shape=f"B={B} K={K} V={V} r={R} dim={DIM} fp32", unit="byte",
                work=4 * (B * K * V + V * R), ceiling="copy", triton=lambda: fused.markov_greedy(*args),
                torch=lambda: twin.markov_greedy(*args), note=note)


def cases(device: torch.device) -> list[dict]:
    return [_case(1, device, "one row per program: K + 1 launches of 256 programs"),
            _case(8, device, "the largest batch `auto` runs the kernels at (ops.MARKOV_TRITON_ROWS)"),
            _case(64, device, "tiles of 16 rows (tl.dot): slower than the twin here, so `auto` runs the twin")]
