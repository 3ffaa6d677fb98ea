"""Device-side helpers shared by the Triton kernels: FP4 / FP8 / E8M0 decoding and the dot dtype.

Everything here is exact: FP4 E2M1 values and E8M0 scales are powers of two times at most two
significant bits, so decoded values are exact in fp32 (and in bf16). `e4m3_to_f32` uses the
hardware conversion; under TRITON_INTERPRET=1 it is exact for every byte except the two NaN codes
(0x7F, 0xFF decode to ±480 there), which the quantizers never produce (they clamp to ±448).

Interpreter caveat (triton 3.6 and 3.9 on the CPU): `tl.dot` on bf16 operands returns garbage while
loads are exact, so kernels take the dot's operand dtype as a compile-time parameter and callers
pass `dot_dtype()`: fp32 under the interpreter, bf16 on the GPU.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def jit_sizes(*sizes: str):
    """`triton.jit` without specialization on the integer arguments `sizes` (token, row and entry counts, and the
    strides that follow them). Triton compiles a kernel again for each new combination of its integer arguments
    being 1, a multiple of 16 or neither; on a serving path whose counts change with every batch that was a
    compile in the middle of live traffic — decode_load (2026-12-06, H100): steps of 6.2 s and 4.9 s, every stream
    waiting, when the first pieces of 511 tokens ran (the sparse-attention kernel alone compiles in 4-5 s). Sizes
    whose divisibility is fixed by the model's shapes (head and row strides) stay specialized: their alignment
    vectorizes loads and never starts another compile."""
    return triton.jit(do_not_specialize=list(sizes))


def dot_dtype() -> tl.dtype:
    """Operand dtype for `tl.dot` on decoded values: fp32 in the interpreter, bf16 on the GPU."""
    return tl.float32 if interpreting() else tl.bfloat16


CAPABILITY_OVERRIDE: tuple[int, int] | None = None  # set by benchmarks/sass.py, which compiles for sm_90a on the CPU


def capability(t: torch.Tensor) -> tuple[int, int] | None:
    """Compute capability the kernels are built for on t's device: the override, the CUDA device's, or None."""
    if CAPABILITY_OVERRIDE is not None:
        return CAPABILITY_OVERRIDE
    return torch.cuda.get_device_capability(t.device) if t.is_cuda else None


def runnable(t: torch.Tensor) -> bool:
    """Can a Triton kernel run on this tensor's device (CUDA, or any device in the interpreter)?"""
    return t.is_cuda or interpreting()


@triton.jit
def fp4_to_f32(codes):
    """E2M1 codes (low 4 bits of an integer tensor) → fp32: {0, .5, 1, 1.5, 2, 3, 4, 6}, bit 3 = sign."""
    c = codes.to(tl.int32) & 0xF
    mag = c & 7
    e = mag >> 1
    m = mag & 1
    # normal (e > 0): 2^(e-1)·(1 + m/2) → exponent bits e + 126, mantissa bit 22; subnormal 0.5 = 2^-1
    bits = tl.where(e == 0, tl.where(m == 1, 126 << 23, 0), ((e + 126) << 23) | (m << 22))
    value = bits.to(tl.float32, bitcast=True)
    return tl.where((c & 8) != 0, -value, value)


@triton.jit
def e8m0_to_f32(scale_bytes):
    """E8M0 exponent bytes → fp32 2^(byte - 127) (byte 0 → 2^-127; byte 255, NaN, never stored)."""
    b = scale_bytes.to(tl.int32) & 0xFF
    value = (b << 23).to(tl.float32, bitcast=True)
    return tl.where(b == 0, 5.877471754111438e-39, value)  # 2^-127


@triton.jit
def e4m3_to_f32(value_bytes):
    """E4M3 bit patterns (uint8) → fp32 through the hardware conversion."""
    return value_bytes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
