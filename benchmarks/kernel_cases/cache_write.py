"""Benchmark cases of the cache write (SPEC §1a, §4): RoPE + FP8 / FP4 quantize + pack into rows.

Work is the minimum bytes moved per token: read x (D bf16), cos + sin (R/2 fp32 each) and the row
index (int64), write one row (528 B window, 288 B main KV, 68 B index key). The Triton op is one
pass and should stream near the copy ceiling at prefill sizes; decode sizes (128 tokens, ~0.2 MB)
are one launch's latency. The torch twin is the model's eager composition (apply_rope, quantizer,
cat, masked index_put): a dozen kernels with fp32 intermediates.
"""

from __future__ import annotations

import torch

from dsv41.kernels.ref import cache_write as twin
from dsv41.kernels.ref.cache_write import CACHE_LAYOUTS
from dsv41.kernels.triton import cache_write as fused
from dsv41.model.rope import rope_angles, rope_frequencies

R = 64  # rope_head_dim of v41-flash


def _case(name: str, fmt: str, B: int, T: int, D: int, device: torch.device, note: str) -> dict:
    g = torch.Generator(device=device).manual_seed(B * T + D)
    n = B * T
    x = (torch.randn(B, T, D, generator=g, device=device)
         * torch.exp(2 * torch.randn(B, T, D, generator=g, device=device))).bfloat16()
    positions = torch.randint(0, 1 << 17, (B, T), generator=g, device=device)
    cos, sin = rope_angles(rope_frequencies(R, 10000.0).to(device), positions)
    row_bytes = CACHE_LAYOUTS[fmt].row_bytes(D)
    M = 4 * n  # a pool larger than the tokens written, rows scattered through it
    out_rows = torch.zeros(M, row_bytes, dtype=torch.uint8, device=device)
    row_index = torch.randperm(M, generator=g, device=device)[:n].view(B, T)
    work = n * (2 * D + 2 * (R // 2) * 4 + 8 + row_bytes)

    @torch.no_grad()
    def run_triton():
        fused.rope_quantize(x, cos, sin, fmt, out_rows, row_index)

    @torch.no_grad()
    def run_torch():
        twin.rope_quantize(x, cos, sin, fmt, out_rows, row_index)

    return dict(name=name, shape=f"B={B} T={T} D={D} R={R} bf16 → {row_bytes} B rows", unit="byte", work=work,
                ceiling="copy", triton=run_triton, torch=run_torch, note=note)


def cases(device: torch.device) -> list[dict]:
    return [
        _case("window_fp8 decode", "window_fp8", 128, 1, 512, device,
              "128 tokens (~0.2 MB): launch latency; 128 programs of one token, 2 warps"),
        _case("window_fp8 prefill chunk", "window_fp8", 1, 8192, 512, device,
              "~15 MB: 2048 programs of 4 tokens × 512 channels (8 per thread); ALU (RoPE on every channel, "
              "E4M3 cvt, index/address math) about as long as the stream"),
        _case("kv_fp4 prefill entries", "kv_fp4", 1, 8192, 512, device,
              "x / E4M3 scale needs a true division per channel (div.rn): the most ALU-heavy format"),
        _case("index_fp4 prefill keys", "index_fp4", 1, 8192, 128, device,
              "68 B rows (not 16-byte aligned: narrow stores); 512 programs of 16 keys"),
        _case("index_fp4 decode", "index_fp4", 128, 1, 128, device, "launch latency"),
    ]
