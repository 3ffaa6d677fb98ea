"""The release's routed-expert product (FP8 activations × MXFP4 weights, per expert) against an fp64 emulation.

The emulation decodes E2M1 nibbles and E8M0 bytes with numpy from their bit fields (element 2i in
the low nibble) and sums every 32-wide block in float64 — exact for E4M3 × E2M1 products.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from tests.quant.test_fp8_gemm import E4M3

from dsv41.quant.fp4 import mxfp4_quantize_weight
from dsv41.quant.fp4_gemm import fp4_experts_twin
from dsv41.quant.fp8_gemm import act_quant

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def emulate_fp4_experts(xq: np.ndarray, xs: np.ndarray, packed: np.ndarray, scales: np.ndarray,
                        counts: np.ndarray) -> np.ndarray:
    """y[m, n] = Σ_kb (Σ_{k in kb} e4m3(xq[m, k]) · e2m1(w_e[n, k])) · xs[m, kb] · 2^(scales_e[n, kb] - 127),
    e = the expert of row m (rows sorted by expert, counts[e] each)."""
    m, k = xq.shape
    n = packed.shape[1]
    xv = E4M3[xq].reshape(m, k // 32, 32)
    out = np.zeros((m, n))
    start = 0
    for e, rows in enumerate(counts):
        if rows:
            b = packed[e].astype(np.int64)
            w = E2M1[np.stack([b & 15, b >> 4], axis=-1).reshape(n, k)].reshape(n, k // 32, 32)  # (N, KB, 32)
            partial = np.einsum("mbk,nbk->mnb", xv[start:start + rows], w)  # exact block dots
            ws = np.ldexp(1.0, scales[e].astype(np.int64) - 127)  # (N, KB)
            out[start:start + rows] = np.einsum("mnb,mb,nb->mn", partial, xs[start:start + rows], ws)
            start += rows
    return out


def _case(seed: int, counts: list[int], n: int, k: int):
    g = torch.Generator().manual_seed(seed)
    counts_t = torch.tensor(counts)
    x = torch.randn(int(counts_t.sum()), k, generator=g) * 3
    w = torch.randn(len(counts), n, k, generator=g) * torch.exp(torch.randn(len(counts), n, 1, generator=g))
    packed, scales = mxfp4_quantize_weight(w)
    xq, xs = act_quant(x)
    want = emulate_fp4_experts(xq.view(torch.uint8).numpy().astype(np.int64), xs.double().numpy(),
                               packed.numpy(), scales.numpy(), counts_t.numpy())
    return x, w, counts_t, packed, scales, xq, xs, want


@pytest.mark.parametrize("counts,n,k", [([5, 0, 17, 3], 48, 64), ([1], 96, 128), ([0, 0, 9], 32, 32)])
def test_fp4_experts_twin_equals_the_fp64_emulation(counts, n, k):
    x, w, counts_t, packed, scales, xq, xs, want = _case(len(counts) + n, counts, n, k)
    got = fp4_experts_twin(xq, xs, packed.view(torch.int8), scales, counts_t, torch.float32).double().numpy()
    rel = np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)
    assert rel < 2e-6, f"max error {rel:.2e} of the output's scale"


def test_fp4_experts_triton_equals_the_emulation_in_the_interpreter():
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET"):
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    from dsv41.quant.fp4_gemm_triton import fp4_experts_triton

    x, w, counts_t, packed, scales, xq, xs, want = _case(3, [5, 0, 17, 3], 48, 64)
    got = fp4_experts_triton(xq, xs, packed.view(torch.int8), scales, counts_t, torch.float32,
                             block_m=16, block_n=32).double().numpy()
    rel = np.abs(got - want).max() / np.abs(want).max()
    assert rel < 2e-6, f"max error {rel:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("counts,n,k", [([3, 0, 1, 2] * 16, 2304, 5120), ([40] * 48 + [0] * 16, 5120, 2304)])
def test_cuda_fp4_experts_equal_the_emulation(counts, n, k):
    """The Hopper kernel at v41 expert widths (w1/w3 and w2 shapes; 64 of the 384 experts, to keep the
    float weights the test quantizes small; decode-like and prefill-like loads) = the fp64 emulation."""
    from dsv41.quant.fp4_gemm_triton import fp4_experts_triton

    g = torch.Generator(device="cuda").manual_seed(0)
    counts_t = torch.tensor(counts, device="cuda")
    x = torch.randn(int(counts_t.sum()), k, generator=g, device="cuda")
    w = torch.randn(len(counts), n, k, generator=g, device="cuda") * k ** -0.5
    packed, scales = mxfp4_quantize_weight(w)
    del w
    xq, xs = act_quant(x)
    got = fp4_experts_triton(xq, xs, packed.view(torch.int8), scales, counts_t, torch.float32).double().cpu().numpy()
    busy = [e for e, c in enumerate(counts) if c][:6]  # emulate a few experts (numpy is slow)
    rows = np.cumsum([0] + counts)
    for e in busy:
        sl = slice(rows[e], rows[e + 1])
        codes = xq[sl].view(torch.uint8).cpu().numpy().astype(np.int64)
        want = emulate_fp4_experts(codes, xs[sl].double().cpu().numpy(), packed[e:e + 1].cpu().numpy(),
                                   scales[e:e + 1].cpu().numpy(), np.array([counts[e]]))
        rel = np.abs(got[sl] - want).max() / np.abs(want).max()
        print(f"expert {e}: max error {rel:.2e}")
        assert rel < 2e-6, f"expert {e}: max error {rel:.2e}"
