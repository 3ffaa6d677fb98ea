"""The release's routed-expert product: FP8 activations × MXFP4 weights, per expert segment.

`inference/model.py` `linear()` for a `float4_e2m1fn_x2` weight: `act_quant(x, 32, "ue8m0")`
(`quant.fp8_gemm.act_quant`), then `fp4_gemm`: each E2M1 weight value is cast to E4M3 (exact: two
significant bits), an FP8 × FP8 dot is taken per 32-wide K step and scaled by the activation's
scale of the row and the weight's E8M0 scale of its *row* and K block (MXFP4: one scale per 32
along K), accumulated in fp32:
    y[m, n] = Σ_kb (Σ_{k ∈ kb} xq[m, k] · e2m1[n, k]) · sx[m, kb] · sw[n, kb].
The routed experts hold the weights stacked (E, out, in/2) packed bytes + (E, out, in/32) scales;
the rows arrive sorted by expert with `counts` rows each (`model.moe`). `fp4_experts_twin` is the
torch twin (any device: each expert's weights dequantized — exact — and multiplied in fp32; reads
the counts on the host); `quant.fp4_gemm_triton` is the Hopper kernel (the E2M1 → E4M3 cast in the
GEMM's prologue, all experts in one launch, no host sync).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dsv41.quant.fp4 import mxfp4_dequantize_weight
from dsv41.quant.fp8_gemm import ACT_BLOCK


def fp4_experts_twin(xq: Tensor, xs: Tensor, packed: Tensor, scales: Tensor, counts: Tensor,
                     out_dtype: torch.dtype) -> Tensor:
    """xq (M, K) E4M3 codes sorted by expert, xs (M, K/32) fp32 scales; packed (E, N, K/2) E2M1 pairs,
    scales (E, N, K/32) E8M0; counts (E,) rows per expert → (M, N) in `out_dtype`."""
    m = xq.shape[0]
    n = packed.shape[1]
    x = xq.view(torch.float8_e4m3fn).float() * xs.float().repeat_interleave(ACT_BLOCK, dim=-1)  # (M, K)
    out = torch.zeros(m, n, dtype=torch.float32, device=xq.device)
    start = 0
    for e, rows in enumerate(counts.tolist()):
        if rows:
            w = mxfp4_dequantize_weight(packed[e].view(torch.uint8), scales[e])  # (N, K), exact
            out[start:start + rows] = x[start:start + rows] @ w.T
            start += rows
    return out.to(out_dtype)
