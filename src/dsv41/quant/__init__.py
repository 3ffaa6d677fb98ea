"""Exact FP4 (E2M1) and FP8 (E4M3) block formats of the KV caches and checkpoint weights.

Real storage (uint8 codes + uint8 scale bytes) and fake quantization with a straight-through
gradient for QAT; ``dequantize(quantize(x)) == fake_quant(x)`` bit for bit. SPEC §1a, §4.
The release's products live beside them: `fp8_gemm` (activation quantization + FP8 GEMM with
block scales) and `fp4_gemm` (FP8 activations × MXFP4 experts), each with a Triton kernel.
"""

from dsv41.quant.fp4 import (
    dequantize_fp4,
    fake_quant_fp4,
    fake_quant_index_fp4,
    fake_quant_kv_fp4,
    fp4_decode,
    fp4_encode,
    fp4_entry_bytes,
    mxfp4_dequantize_weight,
    mxfp4_quantize_weight,
    pack_nibbles,
    quantize_fp4,
    unpack_nibbles,
)
from dsv41.quant.fp8 import (
    as_e4m3,
    as_e8m0,
    dequantize_fp8,
    e8m0_scale,
    e8m0_to_float,
    fake_quant_fp8,
    fake_quant_window_fp8,
    fp8_block_dequantize_weight,
    fp8_block_quantize_weight,
    fp8_entry_bytes,
    fp8_row_dequantize,
    fp8_row_quantize,
    quantize_fp8,
)

__all__ = [
    "as_e4m3",
    "as_e8m0",
    "dequantize_fp4",
    "dequantize_fp8",
    "e8m0_scale",
    "e8m0_to_float",
    "fake_quant_fp4",
    "fake_quant_fp8",
    "fake_quant_index_fp4",
    "fake_quant_kv_fp4",
    "fake_quant_window_fp8",
    "fp4_decode",
    "fp4_encode",
    "fp4_entry_bytes",
    "fp8_block_dequantize_weight",
    "fp8_block_quantize_weight",
    "fp8_entry_bytes",
    "fp8_row_dequantize",
    "fp8_row_quantize",
    "mxfp4_dequantize_weight",
    "mxfp4_quantize_weight",
    "pack_nibbles",
    "quantize_fp4",
    "quantize_fp8",
    "unpack_nibbles",
]
