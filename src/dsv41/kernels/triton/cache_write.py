"""Cache write in one pass: RoPE + FP8 / FP4 quantize + pack, straight into the cache rows.

Computes `ops.rope_quantize` bit for bit like the twin (`kernels.ref.cache_write`): x (B, T, D)
pre-RoPE → rotate the last R channels as adjacent pairs in fp32, round to x's dtype → per block of
32 / 16 / 32 channels take amax and the scale (E8M0 or E4M3) → E4M3 values or packed E2M1 codes →
row ``[payload | scales]`` at out_rows[row_index[b, t]] (negative index: skipped).

Layout: the B·T tokens are flattened; one program owns BLOCK_T tokens × all D channels, held as a
(BLOCK_T, D/blk, blk) tile (one quantization block per middle index) loaded with contiguous 16-byte
loads and split into (even, odd) channel pairs — the RoPE pairs and the two nibbles of an FP4 byte.
Rows are written with contiguous stores of the payload and one byte per block for the scales.
Grid: (cdiv(B·T, BLOCK_T),).

Exactness (the rows are compared with the model's fake-quant, so every bit matters):
  * the RoPE products are rounded separately as in torch: launched with ``enable_fp_fusion=False``
    (checked in the sm_90 PTX / SASS: ``mul.rn.f32`` + ``sub.rn.f32``, no FFMA; with fusion on
    they become FFMAs);
  * divisions by non-powers of two (amax / 448, amax / 6, x / E4M3 scale) use ``tl.math.div_rn``
    (``div.rn.f32``; ``/`` on fp32 is an approximate division on the GPU); E8M0 scales divide by
    multiplying with the exact power-of-two reciprocal, which rounds identically (no ``.ftz`` anywhere);
  * bf16 rounding of the rotated values, E8M0 exponents and (in the interpreter, whose float8 / bf16
    casts are not round-to-nearest-even) E4M3 encoding are integer bit manipulations, exact
    everywhere; on the GPU E4M3 uses ``cvt.rn.satfinite.e4m3x2.f32`` (knob ``hw_e4m3``), which
    equals clamp-to-±448-then-round;
  * FP4 codes count the midpoints below |v| with the tie rules of `quant.fp4.fp4_encode`.

Performance: memory-bound in principle (bf16 x → window row: 2 B read + ~1.03 B written per
channel, plus cos/sin on the rotated tail). At decode sizes (B = 128, T = 1: ~0.2 MB) it is one
launch's latency. At a prefill chunk (8192 tokens, ~15 MB) the ALU work is of the same order as the
stream: each thread holds 8 channels (one 16-byte load), and RoPE runs on every channel (selected
per block), so expect 60–80 % of the copy ceiling; kv_fp4 adds a ``div.rn`` per channel.

`ring_write` copies a prefill chunk's last window rows (already quantized) into the window ring: one program per
(row, BLOCK_J keys), each key's row copied as 4-byte words when the row layouts allow it, masked past R.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from dsv41.kernels.ref.cache_write import CACHE_LAYOUTS, check_args, check_ring_args
from dsv41.kernels.triton.common import e4m3_to_f32, fp4_to_f32, interpreting, jit_sizes, runnable

_X_FP32, _X_BF16, _X_FP16 = 0, 1, 2
_X_KIND = {torch.float32: _X_FP32, torch.bfloat16: _X_BF16, torch.float16: _X_FP16}
_FP32_MIN_NORMAL = tl.constexpr(2.0**-126)
_E8M0_FP4_AMAX_FLOOR = tl.constexpr(6.0 * 2.0**-126)  # quant.fp4: scale floor 2^-126
_E4M3_FP4_AMAX_FLOOR = tl.constexpr(6.0 * 2.0**-9)  # quant.fp4: scale floor 2^-9
_WINDOW_AMAX_FLOOR = tl.constexpr(1e-4)  # quant.fp8.WINDOW_AMAX_FLOOR (rounded to fp32 like torch's clamp)


@triton.jit
def _round_to_x(v, X_KIND: tl.constexpr):
    """Round fp32 v to x's dtype (nearest even) and return it as fp32."""
    if X_KIND == 1:  # bf16 by integer rounding: exact on the GPU and in the interpreter (whose cast truncates)
        bits = v.to(tl.int32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits & -65536).to(tl.float32, bitcast=True)
    elif X_KIND == 2:
        return v.to(tl.float16).to(tl.float32)
    else:
        return v


@triton.jit
def _e4m3_code(v, HW: tl.constexpr):
    """fp32 → E4M3 byte as int32: clamp to ±448 then round to nearest even (as quant.fp8), sign kept (−0 → 0x80)."""
    if HW:  # cvt.rn.satfinite: rounds, then saturates at ±448 — the same as clamping first
        return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
    else:
        v = tl.minimum(tl.maximum(v, -448.0), 448.0)
        bits = v.to(tl.int32, bitcast=True)
        sign = (bits >> 24) & 0x80
        a = bits & 0x7FFFFFFF
        exp = a >> 23
        # normal (|v| >= 2^-6): rebias the exponent 127 → 7, round the mantissa 23 → 3 bits (carry may
        # bump the exponent, as it should)
        t = a - (120 << 23)
        normal = (t + 0x7FFFF + ((t >> 20) & 1)) >> 20
        # subnormal (|v| < 2^-6): |v|·2^9 rounded to an integer 0..8 (8 is the smallest normal's code)
        sig = (a & 0x7FFFFF) | 0x800000
        shift = tl.minimum(141 - exp, 25)  # >= 21 here; 25 already rounds every fp32 below 2^-10 to 0
        q = sig >> shift
        rem = sig - (q << shift)
        half = 1 << (shift - 1)
        up = (rem > half) | ((rem == half) & ((q & 1) != 0))
        return tl.where(exp >= 121, normal, q + up.to(tl.int32)) | sign


@triton.jit
def _e8m0_byte(ratio):
    """Exponent byte of 2^ceil(log2(ratio)) from the fp32 bits (ratio > 0), floored at 2^-126, capped at 254."""
    bits = tl.maximum(ratio, _FP32_MIN_NORMAL).to(tl.int32, bitcast=True)
    exp = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return tl.minimum(exp, 254)


@triton.jit
def _e8m0_reciprocal(byte):
    """2^(127 - byte) exactly, for bytes 1..253 (x · it rounds like x / 2^(byte - 127))."""
    return ((254 - byte) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _fp4_code(s):
    """Scaled values (|s| <= 6) → E2M1 codes (int32): midpoints below |s|, ties to the even code; sign kept."""
    a = tl.abs(s)
    mag = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) \
        + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32)
    return mag | ((s.to(tl.int32, bitcast=True) >> 28) & 8)


@jit_sizes("n_tokens", "T", "n_rows", "si_b")
def _rope_quantize_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr, idx_ptr,
    n_tokens, T, n_rows,
    sx_b, sx_t, sx_d, sc_b, sc_t, sc_j, ss_b, ss_t, ss_j, so_m, so_c, si_b, si_t,
    ROT_START: tl.constexpr,  # first rotated channel, D − R
    BLOCK: tl.constexpr,  # channels per scale
    N_BLOCKS: tl.constexpr,  # D // BLOCK
    NB_P: tl.constexpr,  # N_BLOCKS rounded up to a power of two
    PAYLOAD: tl.constexpr,  # payload bytes per row (scales follow)
    FP4: tl.constexpr, E8M0: tl.constexpr, X_KIND: tl.constexpr, HW_E4M3: tl.constexpr,
    BLOCK_T: tl.constexpr,
    MODE: tl.constexpr = 0,  # 0: packed rows at out[idx]; 1: dequantized values; 2: rotated values (no quant)
    HEADS: tl.constexpr = 1,  # values modes: x rows t·HEADS + h share the angles of position t
    INVERSE: tl.constexpr = False,  # rotate by −angle (the output's inverse RoPE)
):
    HALF: tl.constexpr = BLOCK // 2
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = tok < n_tokens
    b = (tok // T).to(tl.int64)
    t = (tok % T).to(tl.int64)
    if MODE == 0:
        row = tl.load(idx_ptr + b * si_b + t * si_t, mask=tok_ok, other=-1).to(tl.int64)
        write = tok_ok & (row >= 0) & (row < n_rows)  # (BT,)
    else:  # values: one output row per token, in token order
        row = tok.to(tl.int64)
        write = tok_ok
    ta = t // HEADS if HEADS > 1 else t  # the position whose angles rotate this token

    nb = tl.arange(0, NB_P)
    blk_ok = nb < N_BLOCKS
    k = tl.arange(0, BLOCK)
    ch = nb[None, :, None] * BLOCK + k[None, None, :]  # (1, NB, BLOCK) channel
    load_ok = tok_ok[:, None, None] & blk_ok[None, :, None]
    x_off = b[:, None, None] * sx_b + t[:, None, None] * sx_t + ch * sx_d
    if X_KIND == 1:  # bf16 passed as int16: its bits are the top half of the fp32
        x = (tl.load(x_ptr + x_off, mask=load_ok, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        x = tl.load(x_ptr + x_off, mask=load_ok, other=0.0).to(tl.float32)
    xe, xo = tl.split(tl.reshape(x, (BLOCK_T, NB_P, HALF, 2)))  # (BT, NB, HALF) even / odd channels

    # RoPE on the pairs at channels >= ROT_START: separately rounded products, as torch does
    if ROT_START % BLOCK == 0:  # rotated tail of whole blocks (the real sizes): a per-block mask keeps loads wide
        rot = nb[None, :, None] * BLOCK >= ROT_START  # (1, NB, 1)
    else:
        rot = nb[None, :, None] * BLOCK + 2 * tl.arange(0, HALF)[None, None, :] >= ROT_START  # (1, NB, HALF)
    j = nb[None, :, None] * HALF + tl.arange(0, HALF)[None, None, :] - ROT_START // 2  # pair index, < 0: none
    rot_ok = tok_ok[:, None, None] & rot
    cos = tl.load(cos_ptr + b[:, None, None] * sc_b + ta[:, None, None] * sc_t + j * sc_j, mask=rot_ok, other=0.0)
    sin = tl.load(sin_ptr + b[:, None, None] * ss_b + ta[:, None, None] * ss_t + j * ss_j, mask=rot_ok, other=0.0)
    if INVERSE:
        sin = -sin
    re = _round_to_x(xe * cos - xo * sin, X_KIND)
    im = _round_to_x(xe * sin + xo * cos, X_KIND)
    ye = tl.where(rot, re, xe)
    yo = tl.where(rot, im, xo)

    row_base = out_ptr + row[:, None] * so_m
    store_ok = write[:, None] & blk_ok[None, :]
    if MODE == 2:  # rotated values, already rounded to x's dtype
        values = tl.reshape(tl.join(ye, yo), (BLOCK_T, NB_P, BLOCK))
        tl.store(row_base[:, :, None] + ch * so_c, values.to(out_ptr.dtype.element_ty), mask=store_ok[:, :, None])
        return
    amax = tl.maximum(tl.max(tl.abs(ye), axis=2), tl.max(tl.abs(yo), axis=2))  # (BT, NB)
    if FP4:
        if E8M0:  # scale 2^ceil(log2(max(amax, 6·2^-126) / 6))
            scale_byte = _e8m0_byte(tl.math.div_rn(tl.maximum(amax, _E8M0_FP4_AMAX_FLOOR), 6.0))
            recip = _e8m0_reciprocal(scale_byte)[:, :, None]
            se = ye * recip
            so = yo * recip
        else:  # scale e4m3(min(max(amax, 6·2^-9) / 6, 448)) (_e4m3_code saturates); it may land below amax / 6
            scale_byte = _e4m3_code(tl.math.div_rn(tl.maximum(amax, _E4M3_FP4_AMAX_FLOOR), 6.0), HW_E4M3)
            scale = e4m3_to_f32(scale_byte.to(tl.uint8))[:, :, None]
            se = tl.math.div_rn(ye, scale)
            so = tl.math.div_rn(yo, scale)
        ce = _fp4_code(tl.minimum(tl.maximum(se, -6.0), 6.0))
        co = _fp4_code(tl.minimum(tl.maximum(so, -6.0), 6.0))
        if MODE == 1:  # dequantized: code value × scale, exact in fp32 and in x's dtype
            if E8M0:
                sv = _e8m0_reciprocal(254 - scale_byte)[:, :, None]  # 2^(byte − 127)
            else:
                sv = e4m3_to_f32(scale_byte.to(tl.uint8))[:, :, None]
            values = tl.reshape(tl.join(fp4_to_f32(ce) * sv, fp4_to_f32(co) * sv), (BLOCK_T, NB_P, BLOCK))
            tl.store(row_base[:, :, None] + ch * so_c, values.to(out_ptr.dtype.element_ty),
                     mask=store_ok[:, :, None])
            return
        packed = (ce | (co << 4)).to(tl.uint8)  # element 2i in the low nibble
        byte_off = nb[None, :, None] * HALF + tl.arange(0, HALF)[None, None, :]
        tl.store(row_base[:, :, None] + byte_off * so_c, packed, mask=store_ok[:, :, None])
    else:  # window FP8: scale 2^ceil(log2(max(amax, 1e-4) / 448)), values e4m3(clamp(x / scale, ±448))
        scale_byte = _e8m0_byte(tl.math.div_rn(tl.maximum(amax, _WINDOW_AMAX_FLOOR), 448.0))
        recip = _e8m0_reciprocal(scale_byte)[:, :, None]
        ve = _e4m3_code(ye * recip, HW_E4M3)
        vo = _e4m3_code(yo * recip, HW_E4M3)
        values = tl.reshape(tl.join(ve, vo), (BLOCK_T, NB_P, BLOCK)).to(tl.uint8)
        tl.store(row_base[:, :, None] + ch * so_c, values, mask=store_ok[:, :, None])
    tl.store(row_base + (PAYLOAD + nb[None, :]) * so_c, scale_byte.to(tl.uint8), mask=store_ok)


def _default_block_t(n_tokens: int, padded_dim: int) -> int:
    """Up to ~2048 channels per program (8 per thread at 8 warps: one 16-byte load of bf16, no layout
    shuffles), but at least ~2 programs per H200 SM when there are tokens for it. The interpreter pays
    per program, not per element: there one program takes up to 64 tokens."""
    if interpreting():
        return min(triton.next_power_of_2(n_tokens), 64)
    block_t = max(1, 2048 // padded_dim)
    while block_t > 1 and triton.cdiv(n_tokens, block_t) < 264:
        block_t //= 2
    return block_t


def rope_quantize(x: Tensor, cos: Tensor, sin: Tensor, fmt: str, out_rows: Tensor, row_index: Tensor, *,
                  block_t: int | None = None, num_warps: int | None = None, hw_e4m3: bool | None = None) -> None:
    """Triton `ops.rope_quantize` (same arguments and result as the twin); knobs: tokens per program
    (power of two), warps, and the E4M3 encoder (hardware cvt on the GPU, integer rounding otherwise).

    Indices >= M are skipped here (the twin raises); indices must be distinct.
    """
    layout, cos, sin = check_args(x, cos, sin, fmt, out_rows, row_index)
    if not runnable(x):
        raise ValueError(f"rope_quantize: Triton needs CUDA tensors or TRITON_INTERPRET=1, got {x.device}")
    if hw_e4m3 is None:
        hw_e4m3 = not interpreting()
    elif hw_e4m3 and interpreting():
        raise ValueError("rope_quantize: hw_e4m3=True is wrong under TRITON_INTERPRET (its float8 cast is not RNE)")
    B, T, D = x.shape
    n_tokens = B * T
    if n_tokens == 0:
        return
    cos, sin = cos.float(), sin.float()  # no-ops for the model's fp32 angles
    n_blocks = D // layout.block
    nb_p = triton.next_power_of_2(n_blocks)
    block_t = block_t or _default_block_t(n_tokens, nb_p * layout.block)
    if block_t & (block_t - 1):
        raise ValueError(f"rope_quantize: block_t must be a power of two, got {block_t}")
    num_warps = num_warps or max(1, min(8, block_t * nb_p * layout.block // 256))
    xk = x.view(torch.int16) if x.dtype == torch.bfloat16 else x
    tensors = (x, cos, sin, row_index)
    if all(B == 1 or t.stride(0) == T * t.stride(1) for t in tensors):
        T = 1  # token-major: address by the flat token index (no integer division in the kernel)
        strides = [s for t in tensors for s in (t.stride(1), 0) + t.stride()[2:]]
    else:
        strides = [s for t in tensors for s in t.stride()]
    sx_b, sx_t, sx_d, sc_b, sc_t, sc_j, ss_b, ss_t, ss_j, si_b, si_t = strides
    _rope_quantize_kernel[(triton.cdiv(n_tokens, block_t),)](
        xk, cos, sin, out_rows, row_index,
        n_tokens, T, out_rows.size(0),
        sx_b, sx_t, sx_d, sc_b, sc_t, sc_j, ss_b, ss_t, ss_j, *out_rows.stride(), si_b, si_t,
        ROT_START=D - 2 * cos.size(-1), BLOCK=layout.block, N_BLOCKS=n_blocks, NB_P=nb_p,
        PAYLOAD=layout.payload_bytes(D), FP4=layout.fp4, E8M0=layout.e8m0, X_KIND=_X_KIND[x.dtype],
        HW_E4M3=hw_e4m3, BLOCK_T=block_t, num_warps=num_warps, enable_fp_fusion=False,
    )


CACHE_BLOCKS = {fmt: layout.block for fmt, layout in CACHE_LAYOUTS.items()}
_VALUE_FORMATS = {"kv_fp4": "kv_fp4", "index_fp4": "index_fp4", None: None}


def _rope_values(x: Tensor, cos: Tensor, sin: Tensor, fmt: str | None, inverse: bool) -> Tensor:
    """RoPE (+ FP4 fake-quant when fmt is given) of x (B, T, [H,] D) as values in x's dtype."""
    if fmt not in _VALUE_FORMATS:
        raise ValueError(f"rope values: fmt must be one of {tuple(_VALUE_FORMATS)}, got {fmt!r}")
    if x.dim() not in (3, 4) or x.dtype not in _X_KIND:
        raise ValueError(f"rope: x must be (B, T, [H,] D) bf16 / fp16 / fp32, got {tuple(x.shape)} {x.dtype}")
    if not runnable(x):
        raise ValueError(f"rope: Triton needs CUDA tensors or TRITON_INTERPRET=1, got {x.device}")
    B, T = x.shape[:2]
    H = x.size(2) if x.dim() == 4 else 1
    D = x.size(-1)
    half = cos.size(-1)
    if cos.shape != sin.shape or not 1 <= half <= D // 2:
        raise ValueError(f"rope: cos / sin must share a shape with 1 <= R/2 <= D/2, got {tuple(cos.shape)}")
    cos, sin = cos.float().expand(B, T, half), sin.float().expand(B, T, half)
    block = 32 if fmt is None else CACHE_BLOCKS[fmt]
    if D % block:
        raise ValueError(f"rope: D = {D} must be a multiple of {block}")
    x3 = x.reshape(B, T * H, D)  # (B, T·H, D): a view for the model's contiguous heads
    out = torch.empty(B * T * H, D, dtype=x.dtype, device=x.device)
    n_tokens = B * T * H
    if n_tokens == 0:
        return out.view(x.shape)
    n_blocks = D // block
    nb_p = triton.next_power_of_2(n_blocks)
    block_t = _default_block_t(n_tokens, nb_p * block)
    num_warps = max(1, min(8, block_t * nb_p * block // 256))
    xk = x3.view(torch.int16) if x.dtype == torch.bfloat16 else x3
    layout = None if fmt is None else CACHE_LAYOUTS[fmt]
    _rope_quantize_kernel[(triton.cdiv(n_tokens, block_t),)](
        xk, cos, sin, out, out,
        n_tokens, T * H, 0,
        *x3.stride(), *cos.stride(), *sin.stride(), *out.stride(), 0, 0,
        ROT_START=D - 2 * half, BLOCK=block, N_BLOCKS=n_blocks, NB_P=nb_p, PAYLOAD=0,
        FP4=layout is not None, E8M0=layout is not None and layout.e8m0, X_KIND=_X_KIND[x.dtype],
        HW_E4M3=not interpreting(), BLOCK_T=block_t, MODE=2 if fmt is None else 1, HEADS=H, INVERSE=inverse,
        num_warps=num_warps, enable_fp_fusion=False,
    )
    return out.view(x.shape)


def rope(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool = False) -> Tensor:
    """Triton `ops.rope`: `model.rope.apply_rope` in one pass, bit for bit."""
    return _rope_values(x, cos, sin, None, inverse)


def rope_fake_quant(x: Tensor, cos: Tensor, sin: Tensor, fmt: str) -> Tensor:
    """Triton `ops.rope_fake_quant`: RoPE then the FP4 format's fake-quant, in one pass, bit for bit."""
    if fmt is None:
        raise ValueError("rope_fake_quant needs a format")
    return _rope_values(x, cos, sin, fmt, False)


# ---------------------------------------------------------------------------------------------
# The window ring's write after a prefill chunk (`ops.ring_write`): one launch for the 4 (full rows) to 9 (ragged
# rows) small torch ops the twin runs per layer.


@jit_sizes("T", "M", "n_keys", "sc_b", "sp_b", "sr_b")
def _ring_write_kernel(
    chunk_ptr, pos_ptr, row_ptr, valid_ptr, out_ptr, out_pos_ptr,
    T, M, n_keys,  # block positions per row, ring rows, keys written per row (min(window, T))
    sc_b, sc_t, sc_r, sp_b, sp_t, sr_b, sr_t, sv, so_m, so_r, sq_m,
    R: tl.constexpr,  # words per row: bytes, or 4-byte words when both row layouts allow them
    BLOCK_R: tl.constexpr, BLOCK_J: tl.constexpr,
    RAGGED: tl.constexpr,  # valid_ptr holds each row's real keys; else every row has T
):
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)  # (BJ,) places in the row's last n_keys
    if RAGGED:
        v = tl.load(valid_ptr + b * sv).to(tl.int64)
    else:
        v = T
    ok = j < n_keys
    t = tl.maximum(v - n_keys + j, 0)  # block position of place j: a short row's first key fills the places before it
    row = tl.load(row_ptr + b * sr_b + t * sr_t, mask=ok, other=-1)
    write = ok & (row >= 0) & (row < M)
    tl.store(out_pos_ptr + row * sq_m, tl.load(pos_ptr + b * sp_b + t * sp_t, mask=write), mask=write)
    r = tl.arange(0, BLOCK_R)
    copy = write[:, None] & (r < R)[None, :]  # (BJ, BR)
    words = tl.load(chunk_ptr + b * sc_b + t[:, None] * sc_t + r[None, :] * sc_r, mask=copy)
    tl.store(out_ptr + row[:, None] * so_m + r[None, :] * so_r, words, mask=copy)


def _words(*rows: Tensor) -> list[Tensor]:
    """Byte tensors as int32 words when every one allows the view (rows of 4k bytes, 4-byte strides), else bytes."""
    try:
        return [t.view(torch.int32) for t in rows]
    except RuntimeError:
        return list(rows)


def ring_write(chunk: Tensor, positions: Tensor, ring_row: Tensor, valid: Tensor | None, ring_rows: Tensor,
               ring_pos: Tensor, window: int, *, block_j: int | None = None) -> None:
    """Triton `ops.ring_write` (same arguments and result as the twin) in one launch, without a host sync;
    knob: keys per program (power of two). Ring rows outside [0, M) are skipped here (the twin indexes them)."""
    check_ring_args(chunk, positions, ring_row, valid, ring_rows, ring_pos)
    if not runnable(chunk):
        raise ValueError(f"ring_write: Triton needs CUDA tensors or TRITON_INTERPRET=1, got {chunk.device}")
    B, T, _ = chunk.shape
    n_keys = min(window, T)
    if B == 0 or n_keys <= 0:
        return
    src, dst = _words(chunk, ring_rows)
    R = src.size(-1)
    block_r = triton.next_power_of_2(R)
    if block_j is None:  # the interpreter pays per program; the GPU holds ~4K words a program
        block_j = min(triton.next_power_of_2(n_keys), 64 if interpreting() else max(1, 4096 // block_r))
    if block_j & (block_j - 1):
        raise ValueError(f"ring_write: block_j must be a power of two, got {block_j}")
    _ring_write_kernel[(B, triton.cdiv(n_keys, block_j))](
        src, positions, ring_row, positions if valid is None else valid, dst, ring_pos,
        T, ring_rows.size(0), n_keys,
        *src.stride(), *positions.stride(), *ring_row.stride(), 0 if valid is None else valid.stride(0),
        *dst.stride(), ring_pos.stride(0),
        R=R, BLOCK_R=block_r, BLOCK_J=block_j, RAGGED=valid is not None, num_warps=4,
    )
