"""Lightning indexer in Triton (SPEC §3): FP4 scores over paged keys, block maxima, exact top-k.

Scores. score[b, t, e] = Σ_h w[b, t, h] · relu(q[b, t, h] · key_e); a key is a pool row of Di/2
packed E2M1 bytes (element 2i in the low nibble) + Di/32 E8M0 scale bytes, entry e of sequence b
at row page_table[b, e // page_rows] · page_rows + e % page_rows; e ≥ min(visible_end[b, t],
n_keys[b]) scores −inf. `_scores_kernel` runs on a grid (⌈tiles / TILES⌉, ⌈T / BLOCK_T⌉, B): a
program prepares its BLOCK_T queries × Hi heads once (the N side of `tl.dot`, heads padded to HP)
and walks TILES tiles of BLOCK_N keys. BLOCK_N divides page_rows, so a tile is one page lookup and
BLOCK_N · (Di/2 + Di/32) contiguous bytes.

Tile design ``layout="mma"`` (default; Di = 128, 4-byte aligned 68-byte rows): all of a tile's bytes
are requested at once — per row and scale block one 4-byte load per thread, plus the row's four
scale bytes as one word — and, with ``prefetch`` (default for one query per program), the next
tile's bytes are in flight while this tile is computed (the tile loop is unrolled: a loop-carried
byte tensor would cost a register per byte). The loads are shaped (8, W, 2, R0, 16) (`_rows5`) so
that Triton's coalesced layout for them IS the wgmma A-operand layout, and each block's channels are
taken in the order (0, 2, …, 30, 1, 3, …, 31) — the queries are permuted the same way — so a thread's
4 bytes decode (low nibbles, high nibbles) straight into its own A registers: no interleave, no
shared-memory layout conversion of the keys; the scale word makes one conversion per tile.
``layout="v1"`` (the first design, Di ≠ 128 always): per block, load → decode → shared-memory
layout conversion → dot, one block after the other. Per tile and 32-channel scale block c:
  * ``mma="fp8"`` (default): nibble s.e1e0.m → E4M3 byte s.000e1e0.m00 = code · 2^-6 exactly (E4M3
    subnormals hold the 0.5 code); on the GPU four bytes → eight E4M3 in 5 integer instructions
    (inline PTX, `_E4M3_PTX`). Queries are stored as q / σ in E4M3, σ a power of two per (t, h)
    with max|q| / σ ∈ [128, 256): exact for FP4-fake-quantized q (every block whose E8M0 scale is
    ≥ 2^-13 of the head's largest; smaller blocks round to E4M3). Then
    acc += dot_fp8(keys_c, q_c) · key_scale_c, a K = 32 FP8 MMA whose sum (integers < 2^13 in
    units of the block's grid) is exact, and σ · 2^6 is folded into the head weight.
  * ``mma="bf16"``: nibbles → bf16 through a byte-permute table (`_BF16_PTX`, Triton's own FP4 →
    bf16 sequence, 2 instructions per element) times the E8M0 scale, acc = dot_bf16(keys_c, q_c, acc)
    (every product exact, fp32 accumulation).
Epilogue: Σ_h w_h · relu(acc) over the head columns, −inf mask, store; the block maxima (block_size
a power of two dividing BLOCK_N) in the same pass. `decode="bits"` replaces the inline PTX with
portable integer code (always used under TRITON_INTERPRET=1, where the dots run in fp32).
`_blocks_kernel` is the ``v1`` tile computation over the entries of given blocks (Reindex layers):
one query per program, a page lookup per entry (gathered rows are only 4-byte aligned; a variant
of the ``mma`` words for gathers faulted with misaligned addresses on the H200 and was dropped).

What limits the scores (H200, Hi = 32, Di = 128, decode over 1M keys): 68 B read + 4 B written
per key = 72 MB, 17 µs at 4.25 TB/s. Instruction issue is the other limit: per 128-key tile each
warp (4 per program) issues ~550 SASS instructions with ``mma`` (v1: ~700): 4 × 32 FMAs applying
the key scales, 32 × (relu, FMA) of the head sum, ~7 integer ops per 4 packed bytes of decode, 17
loads, 8 QGMMA — i.e. ~17 warp-instructions per key against ~22 issue slots per key at 22.5 µs
(132 SMs × 4 schedulers × 1.98 GHz). So the kernel needs both the memory in flight (≥ 2 tiles =
17 KB per program with prefetch, 3 programs per SM at 168 registers) and a high issue rate; bf16
decodes at ~2.6 instructions per channel and is issue-bound. The MMA (8.6 GFLOP: 11 µs of bf16
peak, 5.5 µs of FP8) runs on its own pipe. Measured (H200, 2026-11-30): 46 µs = 38 % of copy with
``mma`` + prefetch (tiles 4–8 within 1 %), 47 µs without the prefetch, 63 µs ``v1``; 8 warps ×
256-key tiles 62 µs.

Top-k. Every (score, column) is mapped to one int64 key that orders the way the model's stable
sort does: the order-preserving int32 of the fp32 score (−0 folded into +0) in the high word and
N − 1 − column in the low word, so a larger key = larger score, then lower column; keys are unique.
`_keys_kernel` writes them in one pass; `torch.topk` (a radix select) takes the k largest — exact
because no two keys tie — and the picks are sorted back into column order, −inf picks → −1 at the
end. No host synchronisation. What limits it: the radix select's passes over 8N bytes of keys (a
three-kernel τ-bound / collect / bitonic-merge version written first was 10× slower at 1M: its
single-CTA merge was latency-bound).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from dsv41.kernels.ref.indexer import block_maxima
from dsv41.kernels.triton.common import e8m0_to_f32, fp4_to_f32, interpreting, jit_sizes, runnable

MMAS = ("fp8", "bf16")
DECODES = ("asm", "bits")
LAYOUTS = ("mma", "v1")
DEFAULT_MMA = "fp8"

_KEY_MIN = tl.constexpr(-(2**63))  # below every real key (the padding of the top-k buffers)

# Four packed bytes ($2) → four E4M3 bytes of the low nibbles ($0) and of the high nibbles ($1):
# nibble s.e1e0.m → byte s.000e1e0.m00 (= the E2M1 value · 2^-6).
_E4M3_PTX = tl.constexpr("""{
.reg .b32 t0, t1, t2, t3;
shl.b32 t0, $2, 2;
and.b32 t0, t0, 0x1C1C1C1C;
shl.b32 t1, $2, 4;
and.b32 t1, t1, 0x80808080;
or.b32 $0, t0, t1;
shr.u32 t2, $2, 2;
and.b32 t2, t2, 0x1C1C1C1C;
and.b32 t3, $2, 0x80808080;
or.b32 $1, t2, t3;
}""")

# Four packed bytes ($4) and their four bf16 scales ($5: bytes 0, 1; $6: bytes 2, 3) → bf16 pairs of
# the low nibbles ($0: bytes 0, 1; $1: bytes 2, 3) and of the high nibbles ($2, $3), times the scale.
# prmt looks each magnitude up in 8-byte tables: low byte {00 00 80 C0 00 40 80 C0}, high byte
# {00 3F 3F 3F 40 40 40 40} (0, .5, 1, 1.5, 2, 3, 4, 6), the sign byte 0x80 by the sign bit.
_BF16_PTX = tl.constexpr("""{
.reg .b32 a<17>;
and.b32 a0, $4, 0x88888888;
shr.u32 a1, a0, 3;
and.b32 a2, $4, 0x77777777;
shr.u32 a3, a2, 16;
shr.u32 a4, a0, 19;
prmt.b32 a5, 0xC0800000, 0xC0804000, a2;
prmt.b32 a6, 0xC0800000, 0xC0804000, a3;
prmt.b32 a7, 0x3F3F3F00, 0x40404040, a2;
prmt.b32 a8, 0x3F3F3F00, 0x40404040, a3;
prmt.b32 a9, 0x00008000, 0x00000000, a1;
prmt.b32 a10, 0x00008000, 0x00000000, a4;
or.b32 a11, a7, a9;
or.b32 a12, a8, a10;
prmt.b32 a13, a5, a11, 0x6240;
prmt.b32 a14, a6, a12, 0x6240;
prmt.b32 a15, a5, a11, 0x7351;
prmt.b32 a16, a6, a12, 0x7351;
mul.rn.bf16x2 $0, a13, $5;
mul.rn.bf16x2 $1, a14, $6;
mul.rn.bf16x2 $2, a15, $5;
mul.rn.bf16x2 $3, a16, $6;
}""")


# --------------------------------------------------------------------------------------------- scores
@triton.jit
def _q_block(q_ptr, q_off, row_ok, stride_qd, BLK: tl.constexpr, inv_sigma, FP8: tl.constexpr,
             F32: tl.constexpr, SPLIT: tl.constexpr):
    """Query channels [32·BLK, 32·BLK + 32) as the dot's B operand (32, MQ); SPLIT: in the key
    operand's order of `_key_block_mma` (even channels, then odd ones)."""
    c = BLK * 32 + tl.arange(0, 32)
    x = tl.load(q_ptr + q_off[:, None] + c[None, :] * stride_qd, mask=row_ok[:, None], other=0.0).to(tl.float32)
    if SPLIT:
        MQ: tl.constexpr = x.shape[0]
        x = tl.reshape(tl.permute(tl.reshape(x, (MQ, 16, 2)), (0, 2, 1)), (MQ, 32))
    if FP8:
        x = (x * inv_sigma[:, None]).to(tl.float8e4nv)  # exact: FP4 values over a power of two
        if F32:
            x = x.to(tl.float32)
    else:
        if not F32:
            x = x.to(tl.bfloat16)  # exact: FP4 values
    return tl.trans(x)


@triton.jit
def _queries(q_ptr, w_ptr, b, t0, T, stride_qb, stride_qt, stride_qh, stride_qd, stride_wb, stride_wt, stride_wh,
             HI: tl.constexpr, DI: tl.constexpr, HP: tl.constexpr, BLOCK_T: tl.constexpr, FP8: tl.constexpr,
             F32: tl.constexpr, SPLIT: tl.constexpr):
    """Rows m = t·HP + h of BLOCK_T queries from t0: effective head weights (MQ,) and the B operands
    of the Di/32 scale blocks (unused ones repeat block 0)."""
    NB: tl.constexpr = DI // 32
    MQ: tl.constexpr = BLOCK_T * HP
    m = tl.arange(0, MQ)
    t = t0 + (m // HP).to(tl.int64)
    h = m % HP
    row_ok = (t < T) & (h < HI)
    q_off = b * stride_qb + t * stride_qt + h * stride_qh
    w = tl.load(w_ptr + b * stride_wb + t * stride_wt + h * stride_wh, mask=row_ok, other=0.0).to(tl.float32)
    if FP8:
        d = tl.arange(0, DI)
        x = tl.load(q_ptr + q_off[:, None] + d[None, :] * stride_qd, mask=row_ok[:, None], other=0.0)
        amax = tl.max(tl.abs(x.to(tl.float32)), axis=1)
        # σ = 2^(e − 127) with amax / σ ∈ [128, 256); 1/σ and σ·2^6 built from exponent bits (exact)
        e = tl.maximum((amax.to(tl.int32, bitcast=True) >> 23) - 7, 1)
        inv_sigma = ((254 - e) << 23).to(tl.float32, bitcast=True)
        w = w * ((e + 6) << 23).to(tl.float32, bitcast=True)  # relu(σ·2^6·x) = σ·2^6·relu(x)
    else:
        inv_sigma = tl.full((MQ,), 1.0, tl.float32)
    q0 = _q_block(q_ptr, q_off, row_ok, stride_qd, 0, inv_sigma, FP8, F32, SPLIT)
    q1 = _q_block(q_ptr, q_off, row_ok, stride_qd, 1 % NB, inv_sigma, FP8, F32, SPLIT)
    q2 = _q_block(q_ptr, q_off, row_ok, stride_qd, 2 % NB, inv_sigma, FP8, F32, SPLIT)
    q3 = _q_block(q_ptr, q_off, row_ok, stride_qd, 3 % NB, inv_sigma, FP8, F32, SPLIT)
    return w, q0, q1, q2, q3


@triton.jit
def _e4m3_nibbles(packed, ASM: tl.constexpr):
    """Packed E2M1 bytes → E4M3 bytes (code · 2^-6, exact) of the low nibbles and of the high nibbles:
    inline PTX on the GPU (`_E4M3_PTX`), portable integer code otherwise."""
    if ASM:
        return tl.inline_asm_elementwise(_E4M3_PTX, "=r,=r,r", [packed], dtype=(tl.uint8, tl.uint8),
                                         is_pure=True, pack=4)
    else:
        p = packed.to(tl.int32)
        return (((p << 2) & 0x1C) | ((p << 4) & 0x80)).to(tl.uint8), (((p >> 2) & 0x1C) | (p & 0x80)).to(tl.uint8)


@triton.jit
def _bf16_nibbles(packed, scale, s16, ASM: tl.constexpr, F32: tl.constexpr):
    """Packed E2M1 bytes (BLOCK_N, 16) times their row's E8M0 scale (BLOCK_N,) — fp32 `scale`, and the
    same power of two in bf16 `s16` for the GPU path — → the values of the low nibbles and of the high
    nibbles in bf16 (fp32 when F32), exact: byte-permute tables in inline PTX on the GPU
    (`_BF16_PTX`), portable code otherwise."""
    if ASM:
        s16 = tl.broadcast_to(s16[:, None], packed.shape)
        return tl.inline_asm_elementwise(_BF16_PTX, "=r,=r,=r,=r,r,r,r", [packed, s16],
                                         dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        p = packed.to(tl.int32)
        lo = fp4_to_f32(p) * scale[:, None]
        hi = fp4_to_f32(p >> 4) * scale[:, None]
        if not F32:
            lo = lo.to(tl.bfloat16)
            hi = hi.to(tl.bfloat16)
        return lo, hi


@triton.jit
def _key_block(key_ptr, row_off, ok, BLK: tl.constexpr, DI: tl.constexpr, FP8: tl.constexpr, ASM: tl.constexpr,
               F32: tl.constexpr):
    """Channels [32·BLK, 32·BLK + 32) of the keys at byte offsets row_off (BLOCK_N,) as the dot's A
    operand (BLOCK_N, 32), and their E8M0 scales (BLOCK_N,) fp32. FP8: E4M3 code · 2^-6, unscaled;
    otherwise the scaled values."""
    BLOCK_N: tl.constexpr = row_off.shape[0]
    j = tl.arange(0, 16)
    packed = tl.load(key_ptr + row_off[:, None] + (BLK * 16 + j)[None, :], mask=ok[:, None], other=0)
    sbyte = tl.load(key_ptr + row_off + (DI // 2 + BLK), mask=ok, other=127)
    scale = e8m0_to_f32(sbyte)
    if FP8:
        lo, hi = _e4m3_nibbles(packed, ASM)
        k = tl.reshape(tl.join(lo, hi), (BLOCK_N, 32)).to(tl.float8e4nv, bitcast=True)  # element 2i = low
        if F32:
            k = k.to(tl.float32)
    else:
        s16 = (sbyte.to(tl.int16) << 7).to(tl.bfloat16, bitcast=True)  # 2^(byte − 127) in bf16
        lo, hi = _bf16_nibbles(packed, scale, s16, ASM, F32)
        k = tl.reshape(tl.join(lo, hi), (BLOCK_N, 32))
    return k, scale


@triton.jit
def _tile_acc(key_ptr, row_off, ok, q0, q1, q2, q3, DI: tl.constexpr, FP8: tl.constexpr, ASM: tl.constexpr,
              F32: tl.constexpr):
    """(BLOCK_N, MQ) fp32 key·query dots (FP8: without σ·2^6, which the weights carry)."""
    k, s = _key_block(key_ptr, row_off, ok, 0, DI, FP8, ASM, F32)
    if FP8:
        acc = tl.dot(k, q0) * s[:, None]
    else:
        acc = tl.dot(k, q0)
    if DI >= 64:
        k, s = _key_block(key_ptr, row_off, ok, 1, DI, FP8, ASM, F32)
        if FP8:
            acc += tl.dot(k, q1) * s[:, None]
        else:
            acc = tl.dot(k, q1, acc)
    if DI >= 128:
        k, s = _key_block(key_ptr, row_off, ok, 2, DI, FP8, ASM, F32)
        if FP8:
            acc += tl.dot(k, q2) * s[:, None]
        else:
            acc = tl.dot(k, q2, acc)
        k, s = _key_block(key_ptr, row_off, ok, 3, DI, FP8, ASM, F32)
        if FP8:
            acc += tl.dot(k, q3) * s[:, None]
        else:
            acc = tl.dot(k, q3, acc)
    return acc


@triton.jit
def _rows5(BLOCK_N: tl.constexpr, W: tl.constexpr):
    """Tile rows m = d0 + 16·d1 + 8·d2 + 16·W·d3 as an (8, W, 2, BLOCK_N / 16W, 1) tensor. A load of
    (…, 16) bytes at these rows gets Triton's coalesced layout (4 bytes per thread; then lanes, warps,
    registers over the dims in index order): lanes = (4-byte word, d0), warps = d1, registers =
    (d2, d3) — the wgmma A-operand layout of W warps. `_unfold5` makes it 2-D in row order."""
    R0: tl.constexpr = BLOCK_N // (16 * W)
    d0 = tl.arange(0, 8)[:, None, None, None, None]
    d1 = tl.arange(0, W)[None, :, None, None, None] * 16
    d2 = tl.arange(0, 2)[None, None, :, None, None] * 8
    d3 = tl.arange(0, R0)[None, None, None, :, None] * (16 * W)
    return d0 + d1 + d2 + d3


@triton.jit
def _unfold5(x):
    """(8, W, 2, R0, C) in `_rows5` order → (BLOCK_N, C) in row order (no data movement)."""
    W: tl.constexpr = x.shape[1]
    R0: tl.constexpr = x.shape[3]
    C: tl.constexpr = x.shape[4]
    return tl.reshape(tl.permute(x, (3, 1, 2, 0, 4)), (R0 * W * 16, C))


@triton.jit
def _tile_raw(key_ptr, off5, ok5, off1, ok1):
    """A tile's raw key bytes (Di = 128, 68-byte rows: 4-byte aligned), all loads issued at once:
    the packed bytes of each scale block ((8, W, 2, R0, 16) uint8, `_rows5` rows: one 4-byte load
    per thread and row) and the row's four E8M0 scale bytes as one int32 word (BLOCK_N,)."""
    j = tl.arange(0, 16)[None, None, None, None, :]
    rows = key_ptr + off5
    p0 = tl.load(rows + j, mask=ok5, other=0)
    p1 = tl.load(rows + (16 + j), mask=ok5, other=0)
    p2 = tl.load(rows + (32 + j), mask=ok5, other=0)
    p3 = tl.load(rows + (48 + j), mask=ok5, other=0)
    sw = tl.load((key_ptr + off1 + 64).to(tl.pointer_type(tl.int32)), mask=ok1, other=0x7F7F7F7F)
    return p0, p1, p2, p3, sw


@triton.jit
def _scale_of(sw, BLK: tl.constexpr):
    """fp32 E8M0 scale 2^(byte − 127) (BLOCK_N,) of block BLK from the rows' scale words: the byte
    moved straight into the exponent field; byte 0 (2^-127, subnormal) by an integer max."""
    if BLK == 0:
        bits = sw << 23
    elif BLK == 1:
        bits = sw << 15
    elif BLK == 2:
        bits = sw << 7
    else:
        bits = sw >> 1
    return tl.maximum(bits & 0x7F800000, 0x00400000).to(tl.float32, bitcast=True)


@triton.jit
def _key_block_mma(p5, scale, FP8: tl.constexpr, ASM: tl.constexpr, F32: tl.constexpr):
    """One scale block's keys (packed bytes p5, `_rows5` form) as the dot's A operand (BLOCK_N, 32)
    in channel order (0, 2, …, 30, 1, 3, …, 31) — the low nibbles of bytes 0..15, then the high ones
    — so each thread's 4 loaded bytes decode into its own A registers (no interleave, no layout
    conversion, no shared memory)."""
    x = _unfold5(p5)
    BLOCK_N: tl.constexpr = x.shape[0]
    if FP8:
        lo, hi = _e4m3_nibbles(x, ASM)
        k = tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (BLOCK_N, 32)).to(tl.float8e4nv, bitcast=True)
        if F32:
            k = k.to(tl.float32)
    else:
        lo, hi = _bf16_nibbles(x, scale, scale.to(tl.bfloat16), ASM, F32)  # exact: a power of two
        k = tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (BLOCK_N, 32))
    return k


@triton.jit
def _tile_acc_mma(p0, p1, p2, p3, sw, q0, q1, q2, q3, FP8: tl.constexpr, ASM: tl.constexpr, F32: tl.constexpr):
    """`_tile_acc` (Di = 128) on the raw words of `_tile_raw` (queries in the SPLIT channel order)."""
    packed, queries = (p0, p1, p2, p3), (q0, q1, q2, q3)
    s = _scale_of(sw, 0)
    k = _key_block_mma(p0, s, FP8, ASM, F32)
    acc = tl.dot(k, q0) * s[:, None] if FP8 else tl.dot(k, q0)
    for c in tl.static_range(1, 4):
        s = _scale_of(sw, c)
        k = _key_block_mma(packed[c], s, FP8, ASM, F32)
        if FP8:
            acc += tl.dot(k, queries[c]) * s[:, None]
        else:
            acc = tl.dot(k, queries[c], acc)
    return acc


@triton.jit
def _row_offsets(pt_ptr, b, stride_pb, stride_pp, n0, vis, e1, e5, PAGE_ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                 ROW_BYTES: tl.constexpr):
    """Byte offsets of entries e1 (BLOCK_N,) and e5 (`_rows5` form) of the tile at n0, and their
    masks e < vis (nothing is read when vis ≤ n0)."""
    ROW_ALIGN: tl.constexpr = ROW_BYTES & -ROW_BYTES  # rows are only this aligned (68 B: 4, 34 B: 2)
    ok1 = e1 < vis
    ok5 = e5 < vis
    if PAGE_ROWS % BLOCK_N == 0:  # the tile lies in one page: row = r0 + e
        page = tl.load(pt_ptr + b * stride_pb + (n0 // PAGE_ROWS) * stride_pp, mask=n0 < vis, other=0).to(tl.int64)
        r0 = page * PAGE_ROWS + n0 % PAGE_ROWS - n0
        off1 = (r0 + e1) * ROW_BYTES
        off5 = (r0 + e5) * ROW_BYTES
    else:
        page1 = tl.load(pt_ptr + b * stride_pb + (e1 // PAGE_ROWS) * stride_pp, mask=ok1, other=0).to(tl.int64)
        page5 = tl.load(pt_ptr + b * stride_pb + (e5 // PAGE_ROWS) * stride_pp, mask=ok5, other=0).to(tl.int64)
        off1 = (page1 * PAGE_ROWS + e1 % PAGE_ROWS) * ROW_BYTES
        off5 = (page5 * PAGE_ROWS + e5 % PAGE_ROWS) * ROW_BYTES
    # pin what the alignment analysis may assume (it would assume more: misaligned loads)
    off5 = tl.multiple_of(off5, [ROW_ALIGN, ROW_ALIGN, ROW_ALIGN, ROW_ALIGN, ROW_ALIGN])
    return tl.multiple_of(off1, ROW_ALIGN), off5, ok1, ok5


@triton.jit
def _head_sum(acc, w, BLOCK_T: tl.constexpr, HP: tl.constexpr):
    """Σ_h w·relu(acc) over each query's HP head columns: (BLOCK_N, BLOCK_T·HP) → (BLOCK_T, BLOCK_N)."""
    BLOCK_N: tl.constexpr = acc.shape[0]
    x = tl.maximum(acc, 0.0) * w[None, :]
    return tl.trans(tl.sum(tl.reshape(x, (BLOCK_N, BLOCK_T, HP)), axis=2))


@jit_sizes("T", "n_max", "n_bmax")
def _scores_kernel(q_ptr, w_ptr, key_ptr, pt_ptr, nk_ptr, ve_ptr, out_ptr, bmax_ptr, T, n_max, n_bmax,
                   stride_qb, stride_qt, stride_qh, stride_qd, stride_wb, stride_wt, stride_wh, stride_pb, stride_pp,
                   stride_vb, stride_vt, stride_ob, stride_ot, stride_mb, stride_mt,
                   HI: tl.constexpr, DI: tl.constexpr, HP: tl.constexpr, BLOCK_T: tl.constexpr,
                   BLOCK_N: tl.constexpr, TILES: tl.constexpr, PAGE_ROWS: tl.constexpr, BS: tl.constexpr,
                   FP8: tl.constexpr, ASM: tl.constexpr, F32: tl.constexpr, MMA_LAYOUT: tl.constexpr,
                   PREFETCH: tl.constexpr, ROW_WARPS: tl.constexpr):
    pid_n = tl.program_id(0)
    b = tl.program_id(2).to(tl.int64)
    t0 = tl.program_id(1).to(tl.int64) * BLOCK_T
    w, q0, q1, q2, q3 = _queries(q_ptr, w_ptr, b, t0, T, stride_qb, stride_qt, stride_qh, stride_qd, stride_wb,
                                 stride_wt, stride_wh, HI, DI, HP, BLOCK_T, FP8, F32, MMA_LAYOUT)
    tq = t0 + tl.arange(0, BLOCK_T)
    t_ok = tq < T
    n_keys = tl.load(nk_ptr + b).to(tl.int64)
    lim = tl.load(ve_ptr + b * stride_vb + tq * stride_vt, mask=t_ok, other=0).to(tl.int64)
    lim = tl.where(t_ok, tl.minimum(tl.minimum(lim, n_keys), n_max), 0)  # (BLOCK_T,) entries each query sees
    lim_max = tl.max(lim, axis=0)
    out_rows = out_ptr + b * stride_ob + tq * stride_ot
    if MMA_LAYOUT:
        _scores_tiles(q0, q1, q2, q3, w, key_ptr, pt_ptr, b, stride_pb, stride_pp, pid_n, n_max, n_bmax, lim, lim_max,
                      out_rows, bmax_ptr + b * stride_mb + tq * stride_mt, t_ok, DI, HP, BLOCK_T, BLOCK_N, TILES,
                      PAGE_ROWS, BS, FP8, ASM, F32, PREFETCH, ROW_WARPS)
    else:
        _scores_tiles_v1(q0, q1, q2, q3, w, key_ptr, pt_ptr, b, stride_pb, stride_pp, pid_n, n_max, n_bmax, lim,
                         lim_max, out_rows, bmax_ptr + b * stride_mb + tq * stride_mt, t_ok, DI, HP, BLOCK_T, BLOCK_N,
                         TILES, PAGE_ROWS, BS, FP8, ASM, F32)


@triton.jit
def _store_tile(s, e, n0, out_rows, bmax_rows, t_ok, n_max, n_bmax, BLOCK_N: tl.constexpr, BS: tl.constexpr):
    """Scores (BLOCK_T, BLOCK_N) of entries e (and their block maxima when BS > 0)."""
    BLOCK_T: tl.constexpr = s.shape[0]
    tl.store(out_rows[:, None] + e[None, :], s, mask=t_ok[:, None] & (e < n_max)[None, :])
    if BS > 0:
        blk_max = tl.max(tl.reshape(s, (BLOCK_T, BLOCK_N // BS, BS)), axis=2)  # e ≥ n_max is −inf
        blk = n0 // BS + tl.arange(0, BLOCK_N // BS)
        tl.store(bmax_rows[:, None] + blk[None, :], blk_max, mask=t_ok[:, None] & (blk < n_bmax)[None, :])


@triton.jit
def _scores_tiles(q0, q1, q2, q3, w, key_ptr, pt_ptr, b, stride_pb, stride_pp, pid_n, n_max, n_bmax, lim, lim_max,
                  out_rows, bmax_rows, t_ok, DI: tl.constexpr, HP: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_N: tl.constexpr, TILES: tl.constexpr, PAGE_ROWS: tl.constexpr, BS: tl.constexpr,
                  FP8: tl.constexpr, ASM: tl.constexpr, F32: tl.constexpr, PREFETCH: tl.constexpr,
                  ROW_WARPS: tl.constexpr):
    """The tile loop on MMA-layout loads: all of a tile's bytes are requested at once and, with
    PREFETCH, one tile ahead (the raw bytes of tile i + 1 are in flight while tile i is computed).
    PREFETCH unrolls the loop (`tl.static_range`): loop-carried uint8 tensors would be split into one
    register per byte and re-packed (+100 instructions per tile), straight-line code keeps the
    loaded words as they are."""
    ROW_BYTES: tl.constexpr = DI // 2 + DI // 32
    m1 = tl.arange(0, BLOCK_N)
    m5 = _rows5(BLOCK_N, ROW_WARPS)
    nt0 = pid_n * TILES
    if PREFETCH:
        n0 = nt0.to(tl.int64) * BLOCK_N
        off1, off5, ok1, ok5 = _row_offsets(pt_ptr, b, stride_pb, stride_pp, n0, lim_max, n0 + m1, n0 + m5,
                                            PAGE_ROWS, BLOCK_N, ROW_BYTES)
        p0, p1, p2, p3, sw = _tile_raw(key_ptr, off5, ok5, off1, ok1)
        for i in tl.static_range(TILES):
            n0 = (nt0 + i).to(tl.int64) * BLOCK_N
            if i + 1 < TILES:  # the next tile's bytes (none after the program's last)
                n1 = n0 + BLOCK_N
                off1, off5, ok1, ok5 = _row_offsets(pt_ptr, b, stride_pb, stride_pp, n1, lim_max, n1 + m1, n1 + m5,
                                                    PAGE_ROWS, BLOCK_N, ROW_BYTES)
                r0, r1, r2, r3, rs = _tile_raw(key_ptr, off5, ok5, off1, ok1)
            if n0 < n_max:
                s = tl.full((BLOCK_T, BLOCK_N), float("-inf"), tl.float32)
                if n0 < lim_max:  # a tile nobody sees is only written
                    s = _tile_scores(p0, p1, p2, p3, sw, q0, q1, q2, q3, w, n0 + m1, lim, HP, FP8, ASM, F32)
                _store_tile(s, n0 + m1, n0, out_rows, bmax_rows, t_ok, n_max, n_bmax, BLOCK_N, BS)
            if i + 1 < TILES:
                p0, p1, p2, p3, sw = r0, r1, r2, r3, rs
    else:
        for i in range(TILES):
            n0 = (nt0 + i).to(tl.int64) * BLOCK_N
            if n0 < n_max:
                s = tl.full((BLOCK_T, BLOCK_N), float("-inf"), tl.float32)
                if n0 < lim_max:  # a tile nobody sees is only written
                    off1, off5, ok1, ok5 = _row_offsets(pt_ptr, b, stride_pb, stride_pp, n0, lim_max, n0 + m1,
                                                        n0 + m5, PAGE_ROWS, BLOCK_N, ROW_BYTES)
                    p0, p1, p2, p3, sw = _tile_raw(key_ptr, off5, ok5, off1, ok1)
                    s = _tile_scores(p0, p1, p2, p3, sw, q0, q1, q2, q3, w, n0 + m1, lim, HP, FP8, ASM, F32)
                _store_tile(s, n0 + m1, n0, out_rows, bmax_rows, t_ok, n_max, n_bmax, BLOCK_N, BS)


@triton.jit
def _tile_scores(p0, p1, p2, p3, sw, q0, q1, q2, q3, w, e, lim, HP: tl.constexpr, FP8: tl.constexpr,
                 ASM: tl.constexpr, F32: tl.constexpr):
    """(BLOCK_T, BLOCK_N) scores of a tile's raw bytes; −inf where e ≥ the query's limit."""
    BLOCK_T: tl.constexpr = lim.shape[0]
    acc = _tile_acc_mma(p0, p1, p2, p3, sw, q0, q1, q2, q3, FP8, ASM, F32)
    return tl.where(e[None, :] < lim[:, None], _head_sum(acc, w, BLOCK_T, HP), float("-inf"))


@triton.jit
def _scores_tiles_v1(q0, q1, q2, q3, w, key_ptr, pt_ptr, b, stride_pb, stride_pp, pid_n, n_max, n_bmax, lim,
                     lim_max, out_rows, bmax_rows, t_ok, DI: tl.constexpr, HP: tl.constexpr, BLOCK_T: tl.constexpr,
                     BLOCK_N: tl.constexpr, TILES: tl.constexpr, PAGE_ROWS: tl.constexpr, BS: tl.constexpr,
                     FP8: tl.constexpr, ASM: tl.constexpr, F32: tl.constexpr):
    """The first design (``layout="v1"``): per scale block, load → decode → layout conversion → dot."""
    ROW_BYTES: tl.constexpr = DI // 2 + DI // 32
    ROW_ALIGN: tl.constexpr = ROW_BYTES & -ROW_BYTES  # rows are only this aligned (68 B: 4, 34 B: 2)
    for i in range(TILES):
        n0 = (pid_n * TILES + i).to(tl.int64) * BLOCK_N
        if n0 < n_max:
            e = n0 + tl.arange(0, BLOCK_N)
            s = tl.full((BLOCK_T, BLOCK_N), float("-inf"), tl.float32)
            if n0 < lim_max:  # a tile nobody sees is only written
                ok = e < lim_max
                if PAGE_ROWS % BLOCK_N == 0:  # the tile lies in one page
                    page = tl.load(pt_ptr + b * stride_pb + (n0 // PAGE_ROWS) * stride_pp).to(tl.int64)
                else:
                    page = tl.load(pt_ptr + b * stride_pb + (e // PAGE_ROWS) * stride_pp, mask=ok, other=0)
                    page = page.to(tl.int64)
                # rows are only ROW_ALIGN-aligned: pin what the alignment analysis may assume
                row_off = tl.multiple_of((page * PAGE_ROWS + e % PAGE_ROWS) * ROW_BYTES, ROW_ALIGN)
                acc = _tile_acc(key_ptr, row_off, ok, q0, q1, q2, q3, DI, FP8, ASM, F32)
                s = tl.where(e[None, :] < lim[:, None], _head_sum(acc, w, BLOCK_T, HP), float("-inf"))
            _store_tile(s, e, n0, out_rows, bmax_rows, t_ok, n_max, n_bmax, BLOCK_N, BS)


@jit_sizes("T", "n_cols")
def _blocks_kernel(q_ptr, w_ptr, key_ptr, pt_ptr, nk_ptr, ve_ptr, blk_ptr, out_ptr, T, n_cols,
                   stride_qb, stride_qt, stride_qh, stride_qd, stride_wb, stride_wt, stride_wh, stride_pb, stride_pp,
                   stride_vb, stride_vt, stride_bb, stride_bt, stride_bk, stride_ob, stride_ot,
                   HI: tl.constexpr, DI: tl.constexpr, HP: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr,
                   PAGE_ROWS: tl.constexpr, BS: tl.constexpr, FP8: tl.constexpr, ASM: tl.constexpr,
                   F32: tl.constexpr):
    ROW_BYTES: tl.constexpr = DI // 2 + DI // 32
    ROW_ALIGN: tl.constexpr = ROW_BYTES & -ROW_BYTES  # rows are only this aligned (68 B: 4, 34 B: 2)
    pid_n = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    w, q0, q1, q2, q3 = _queries(q_ptr, w_ptr, b, t, T, stride_qb, stride_qt, stride_qh, stride_qd, stride_wb,
                                 stride_wt, stride_wh, HI, DI, HP, 1, FP8, F32, False)
    lim = tl.minimum(tl.load(ve_ptr + b * stride_vb + t * stride_vt).to(tl.int64), tl.load(nk_ptr + b).to(tl.int64))
    for i in range(TILES):
        j0 = (pid_n * TILES + i).to(tl.int64) * BLOCK_N
        if j0 < n_cols:
            j = j0 + tl.arange(0, BLOCK_N)
            j_ok = j < n_cols
            block = tl.load(blk_ptr + b * stride_bb + t * stride_bt + (j // BS) * stride_bk, mask=j_ok, other=-1)
            e = block.to(tl.int64) * BS + j % BS
            ok = j_ok & (block >= 0) & (e < lim)
            page = tl.load(pt_ptr + b * stride_pb + (e // PAGE_ROWS) * stride_pp, mask=ok, other=0).to(tl.int64)
            # gathered rows are only ROW_ALIGN-aligned (the analysis would assume more: misaligned loads),
            # so the word-layout tiles of `_scores_kernel` (page-aligned runs) do not apply here
            row_off = tl.multiple_of((page * PAGE_ROWS + e % PAGE_ROWS) * ROW_BYTES, ROW_ALIGN)
            acc = _tile_acc(key_ptr, row_off, ok, q0, q1, q2, q3, DI, FP8, ASM, F32)
            s = tl.where(ok[None, :], _head_sum(acc, w, 1, HP), float("-inf"))  # (1, BLOCK_N)
            tl.store(out_ptr + b * stride_ob + t * stride_ot + j[None, :], s, mask=j_ok[None, :])


# --------------------------------------------------------------------------------------------- top-k
@triton.jit
def _order_keys(x, col, N):
    """fp32 scores and int64 columns → int64 keys: larger = larger score, then lower column."""
    u = x.to(tl.int32, bitcast=True)
    u = tl.where((u & 0x7FFFFFFF) == 0, 0, u)  # −0.0 ties with +0.0, as in torch.sort
    o = u ^ ((u >> 31) & 0x7FFFFFFF)  # negative floats: flip the magnitude bits
    return (o.to(tl.int64) << 32) | (N - 1 - col)


@jit_sizes("T", "N")
def _keys_kernel(s_ptr, key_ptr, T, N, stride_sb, stride_st, BLOCK: tl.constexpr):
    """One int64 order key per score (larger = better, ties → lower column); −inf → the minimum."""
    row = tl.program_id(0)
    col = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = col < N
    x = tl.load(s_ptr + (row // T).to(tl.int64) * stride_sb + (row % T).to(tl.int64) * stride_st + col,
                mask=valid, other=float("-inf"))
    key = tl.where(x > float("-inf"), _order_keys(x, col, N), _KEY_MIN)
    tl.store(key_ptr + row.to(tl.int64) * N + col, key, mask=valid)


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Output allocation (a function so tests can poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _check_scoring(name: str, q: Tensor, weights: Tensor, key_pool: Tensor, page_table: Tensor, page_rows: int,
                   n_keys: Tensor, visible_end: Tensor, mma: str, decode: str, block_n: int, tiles: int
                   ) -> tuple[Tensor, int]:
    """Shared argument checks; returns the pool as (n_rows, row_bytes) uint8 and the padded head count."""
    _require(q.dim() == 4 and q.is_floating_point(), f"{name}: q must be (B, T, Hi, Di) float, got "
             f"{tuple(q.shape)} {q.dtype}")
    B, T, Hi, Di = q.shape
    _require(Di in (32, 64, 128), f"{name}: Di must be 32, 64 or 128, got {Di}")
    _require(weights.shape == (B, T, Hi) and weights.is_floating_point(),
             f"{name}: weights must be (B, T, Hi) = {(B, T, Hi)} float, got {tuple(weights.shape)} {weights.dtype}")
    row_bytes = Di // 2 + Di // 32
    _require(key_pool.dim() in (2, 3) and key_pool.size(-1) == row_bytes and key_pool.element_size() == 1
             and key_pool.dtype != torch.bool,
             f"{name}: key_pool must be (n_rows, {row_bytes}) or (n_pages, page_rows, {row_bytes}) uint8, got "
             f"{tuple(key_pool.shape)} {key_pool.dtype}")
    _require(key_pool.is_contiguous(), f"{name}: key_pool must be contiguous")
    _require(page_table.dim() == 2 and page_table.size(0) == B and page_table.dtype in (torch.int32, torch.int64),
             f"{name}: page_table must be (B, pages) int32/int64, got {tuple(page_table.shape)} {page_table.dtype}")
    _require(page_rows > 0, f"{name}: page_rows must be positive, got {page_rows}")
    _require(n_keys.shape == (B,) and not n_keys.is_floating_point(), f"{name}: n_keys must be ({B},) integer")
    _require(visible_end.shape == (B, T) and not visible_end.is_floating_point(),
             f"{name}: visible_end must be (B, T) = {(B, T)} integer")
    _require(mma in MMAS, f"{name}: mma must be one of {MMAS}, got {mma!r}")
    _require(decode in DECODES, f"{name}: decode must be one of {DECODES}, got {decode!r}")
    _require(decode == "asm" or interpreting(), f"{name}: decode='bits' is the interpreter's path (on the GPU it "
             "fails the accuracy test with several queries per program); use 'asm'")
    _require(_pow2(block_n) and block_n >= 16, f"{name}: block_n must be a power of two >= 16, got {block_n}")
    _require(tiles >= 1, f"{name}: tiles must be >= 1, got {tiles}")
    tensors = (q, weights, key_pool, page_table, n_keys, visible_end)
    _require(all(t.device == q.device for t in tensors), f"{name}: all tensors must be on one device")
    _require(runnable(q), f"{name}: tensors must be on CUDA (or TRITON_INTERPRET=1)")
    pool = key_pool.reshape(-1, row_bytes)
    if pool.dtype != torch.uint8:
        pool = pool.view(torch.uint8)
    return pool, Hi


def _flags(mma: str, decode: str) -> dict:
    interp = interpreting()
    return dict(FP8=mma == "fp8", ASM=decode == "asm" and not interp, F32=interp)


def _layout_flags(layout: str, prefetch: int, block_n: int, num_warps: int, Di: int) -> dict:
    """``mma`` (Di = 128 only; other widths run ``v1``): tiles loaded as words straight into the
    MMA operand layout (`_rows5`; ROW_WARPS: the warps that split a tile's rows), with ``prefetch``
    one tile ahead; ``v1``: the first design (per scale block: load, decode, convert, dot)."""
    _require(layout in LAYOUTS, f"layout must be one of {LAYOUTS}, got {layout!r}")
    _require(prefetch in (0, 1), f"prefetch must be 0 or 1, got {prefetch!r}")
    mma_layout = layout == "mma" and Di == 128
    return dict(MMA_LAYOUT=mma_layout, PREFETCH=bool(prefetch) and mma_layout,
                ROW_WARPS=max(1, min(num_warps, block_n // 16)))


def indexer_scores(q: Tensor, weights: Tensor, key_pool: Tensor, page_table: Tensor, page_rows: int,
                   n_keys: Tensor, visible_end: Tensor, n_max: int, block_size: int = 0, *,
                   mma: str = DEFAULT_MMA, decode: str = "asm", block_n: int = 128, block_t: int | None = None,
                   tiles: int = 4, num_warps: int = 4, num_stages: int = 2, layout: str = "mma",
                   prefetch: int | None = None) -> tuple[Tensor, Tensor | None]:
    """See `dsv41.kernels.ops.indexer_scores`. Knobs: the MMA type (``fp8`` / ``bf16``), the nibble
    decode (``asm`` inline PTX / ``bits``), keys per tile (a divisor of page_rows keeps one page per
    tile), queries per program (None: 1 for decode, else up to 64 // heads), tiles per program, warps,
    stages, the tile design (``mma`` / ``v1``, see the module docstring) and the next-tile prefetch
    (None: on for one query per program). A block_size that is not a power of two ≤ block_n gets its
    maxima from a torch reduction."""
    pool, Hi = _check_scoring("indexer_scores", q, weights, key_pool, page_table, page_rows, n_keys, visible_end,
                              mma, decode, block_n, tiles)
    _require(n_max >= 0 and block_size >= 0, f"indexer_scores: n_max and block_size must be >= 0, got "
             f"{n_max}, {block_size}")
    B, T, _, Di = q.shape
    hp = triton.next_power_of_2(Hi)
    if block_t is None:
        block_t = 1 if T == 1 else min(triton.next_power_of_2(T), max(1, 64 // hp))
    _require(_pow2(block_t), f"indexer_scores: block_t must be a power of two, got {block_t}")
    hp = max(hp, 16 // block_t)  # the dot's N = block_t · hp >= 16
    if prefetch is None:  # one query per program: prefetch; more: the registers are taken (it would spill)
        prefetch = int(block_t == 1)
    fused_max = block_size > 0 and _pow2(block_size) and block_size <= block_n
    n_bmax = -(-n_max // block_size) if block_size else 0
    scores = _empty((B, T, n_max), torch.float32, q.device)
    bmax = _empty((B, T, n_bmax), torch.float32, q.device) if fused_max else scores
    n_tiles = -(-n_max // block_n)
    if B and T and n_tiles:
        grid = (-(-n_tiles // tiles), -(-T // block_t), B)
        _scores_kernel[grid](
            q, weights, pool, page_table, n_keys, visible_end, scores, bmax, T, n_max, n_bmax,
            *q.stride(), *weights.stride(), *page_table.stride(), *visible_end.stride(),
            scores.stride(0), scores.stride(1), bmax.stride(0), bmax.stride(1),
            HI=Hi, DI=Di, HP=hp, BLOCK_T=block_t, BLOCK_N=block_n, TILES=tiles, PAGE_ROWS=page_rows,
            BS=block_size if fused_max else 0, **_flags(mma, decode),
            **_layout_flags(layout, prefetch, block_n, num_warps, Di), num_warps=num_warps, num_stages=num_stages)
    if not block_size:
        return scores, None
    return scores, bmax if fused_max else block_maxima(scores, block_size)


def indexer_scores_blocks(q: Tensor, weights: Tensor, key_pool: Tensor, page_table: Tensor, page_rows: int,
                          n_keys: Tensor, visible_end: Tensor, blocks: Tensor, block_size: int, *,
                          mma: str = DEFAULT_MMA, decode: str = "asm", block_n: int = 128, tiles: int = 4,
                          num_warps: int = 4, num_stages: int = 2) -> Tensor:
    """See `dsv41.kernels.ops.indexer_scores_blocks`. Knobs as `indexer_scores` (one query per program;
    the ``v1`` tile design: gathered rows are only 4-byte aligned)."""
    pool, Hi = _check_scoring("indexer_scores_blocks", q, weights, key_pool, page_table, page_rows, n_keys,
                              visible_end, mma, decode, block_n, tiles)
    B, T, _, Di = q.shape
    _require(blocks.dim() == 3 and blocks.shape[:2] == (B, T) and not blocks.is_floating_point(),
             f"indexer_scores_blocks: blocks must be (B, T, nb) integer, got {tuple(blocks.shape)} {blocks.dtype}")
    _require(block_size > 0, f"indexer_scores_blocks: block_size must be positive, got {block_size}")
    _require(blocks.device == q.device, "indexer_scores_blocks: all tensors must be on one device")
    n_cols = blocks.size(2) * block_size
    out = _empty((B, T, n_cols), torch.float32, q.device)
    n_tiles = -(-n_cols // block_n)
    if B and T and n_tiles:
        grid = (-(-n_tiles // tiles), T, B)
        _blocks_kernel[grid](
            q, weights, pool, page_table, n_keys, visible_end, blocks, out, T, n_cols,
            *q.stride(), *weights.stride(), *page_table.stride(), *visible_end.stride(), *blocks.stride(),
            out.stride(0), out.stride(1),
            HI=Hi, DI=Di, HP=max(triton.next_power_of_2(Hi), 16), BLOCK_N=block_n, TILES=tiles,
            PAGE_ROWS=page_rows, BS=block_size, **_flags(mma, decode), num_warps=num_warps, num_stages=num_stages)
    return out


TOPK_METHOD = "auto"  # `topk_indices`' default: `_topk_method` picks by the row length
THRESHOLD_MAX_N = 32768  # rows up to this length take "threshold"; longer ones "keys"


def _topk_method(N: int) -> str:
    """H200, benchmarks/kernels.py (2026-12-04): threshold wins on short rows — 0.037 vs 0.053 ms at
    64 × 4K (k = 128, the `small` decode step), 17.2 vs 27.5 ms at 32K × 32K (a prefill chunk) — and loses on
    long ones: 0.42 vs 0.39 ms at 64 × 128K, 2.0 vs 0.25 ms at 1 × 1M (its fp32 radix select over one long row
    runs few blocks)."""
    return "threshold" if N <= THRESHOLD_MAX_N else "keys"


@triton.jit
def _pick_count(row, thr, start, N, BLOCK: tl.constexpr):
    cols = start + tl.arange(0, BLOCK)
    s = tl.load(row + cols, mask=cols < N, other=float("-inf"))
    return tl.sum(((s > thr) & (s > float("-inf"))).to(tl.int32), axis=0)


@triton.jit
def _pick_tile(row, ids_row, out_row, thr, start, N, K, need_eq, taken, eq_seen, HAS_IDS: tl.constexpr,
               BLOCK: tl.constexpr):
    cols = start + tl.arange(0, BLOCK)
    ok = cols < N
    s = tl.load(row + cols, mask=ok, other=float("-inf"))
    finite = s > float("-inf")
    eq = (s == thr) & finite & ok
    eq_rank = eq_seen + tl.cumsum(eq.to(tl.int32), axis=0) - 1
    picked = ((s > thr) & finite & ok) | (eq & (eq_rank < need_eq))
    pos = taken + tl.cumsum(picked.to(tl.int32), axis=0) - 1
    val = cols.to(tl.int64)
    if HAS_IDS:
        val = tl.load(ids_row + cols, mask=picked, other=0).to(tl.int64)
    tl.store(out_row + pos, val, mask=picked & (pos < K))
    return taken + tl.sum(picked.to(tl.int32), axis=0), eq_seen + tl.sum(eq.to(tl.int32), axis=0)


@jit_sizes("T", "N", "K")
def _pick_kernel(scores_ptr, thr_ptr, ids_ptr, out_ptr, T, N, K, s_sb, s_st, s_ib, s_it, s_ob, s_ot,
                 HAS_IDS: tl.constexpr, BLOCK: tl.constexpr, STATIC_TRIPS: tl.constexpr, N_TILES: tl.constexpr,
                 K_TILES: tl.constexpr):
    """One row (b, t): the columns whose score beats the row's k-th largest value `thr`, then those equal to it
    in column order until k are taken (the stable sort's tie rule), written in ascending column order (or
    ids[column]); −inf never counts; the rest of the k outputs is −1. Two passes over the row. Under the
    interpreter (STATIC_TRIPS) the loops run compile-time trip counts (it cannot take runtime bounds)."""
    bt = tl.program_id(0)
    b, t = bt // T, bt % T
    row = scores_ptr + b.to(tl.int64) * s_sb + t.to(tl.int64) * s_st
    ids_row = ids_ptr + b.to(tl.int64) * s_ib + t.to(tl.int64) * s_it
    out_row = out_ptr + b.to(tl.int64) * s_ob + t.to(tl.int64) * s_ot
    thr = tl.load(thr_ptr + bt)
    n_gt = tl.zeros([1], dtype=tl.int32).sum(axis=0)
    if STATIC_TRIPS:
        for i in range(N_TILES):
            n_gt += _pick_count(row, thr, i * BLOCK, N, BLOCK)
    else:
        for start in range(0, N, BLOCK):
            n_gt += _pick_count(row, thr, start, N, BLOCK)
    need_eq = K - n_gt  # ties at thr to take, lowest columns first
    taken = tl.zeros([1], dtype=tl.int32).sum(axis=0)
    eq_seen = tl.zeros([1], dtype=tl.int32).sum(axis=0)
    if STATIC_TRIPS:
        for i in range(N_TILES):
            taken, eq_seen = _pick_tile(row, ids_row, out_row, thr, i * BLOCK, N, K, need_eq, taken, eq_seen,
                                        HAS_IDS, BLOCK)
        for i in range(K_TILES):  # −1 after the picks (fewer than k finite scores, or k > N)
            j = i * BLOCK + tl.arange(0, BLOCK)
            tl.store(out_row + j, tl.full([BLOCK], -1, tl.int64), mask=(j >= taken) & (j < K))
    else:
        for start in range(0, N, BLOCK):
            taken, eq_seen = _pick_tile(row, ids_row, out_row, thr, start, N, K, need_eq, taken, eq_seen,
                                        HAS_IDS, BLOCK)
        for start in range(0, K, BLOCK):
            j = start + tl.arange(0, BLOCK)
            tl.store(out_row + j, tl.full([BLOCK], -1, tl.int64), mask=(j >= taken) & (j < K))


def topk_indices(scores: Tensor, k: int, ids: Tensor | None = None, *, block: int = 1024,
                 num_warps: int = 4, method: str | None = None) -> Tensor:
    """See `dsv41.kernels.ops.topk_indices`. method (None = TOPK_METHOD; ``auto`` picks by the row length,
    `_topk_method`) ``keys``: one pass turns (score,
    column) into unique int64 keys that order exactly like the model's stable sort; `torch.topk` (a radix
    select) picks the k largest — exact because no two keys tie — and the picks are sorted back into column
    order. ``threshold``: `torch.topk` over the fp32 scores gives the k-th largest value of each row (half the
    radix passes of int64 keys), then `_pick_kernel` takes what beats it and the ties at it in column order —
    the same set, already ascending (timed: `benchmarks/kernels.py` cases "topk …")."""
    method = method or TOPK_METHOD
    _require(method in ("auto", "keys", "threshold"),
             f"topk_indices: method must be 'auto', 'keys' or 'threshold', got {method!r}")
    _require(scores.dim() == 3 and scores.dtype == torch.float32,
             f"topk_indices: scores must be (B, T, N) float32, got {tuple(scores.shape)} {scores.dtype}")
    _require(isinstance(k, int) and k >= 0, f"topk_indices: k must be a non-negative int, got {k!r}")
    _require(_pow2(block), f"topk_indices: block must be a power of two, got {block}")
    B, T, N = scores.shape
    if ids is not None:
        _require(ids.shape == scores.shape and not ids.is_floating_point() and ids.device == scores.device,
                 f"topk_indices: ids must be integer with the shape of scores {tuple(scores.shape)}")
    _require(runnable(scores), "topk_indices: tensors must be on CUDA (or TRITON_INTERPRET=1)")
    _require(N < 2**31, f"topk_indices: at most 2^31 - 1 columns, got {N}")
    dev = scores.device
    if k == 0 or B * T == 0 or N == 0:
        return torch.full((B, T, k), -1, dtype=torch.int64, device=dev)
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    if method == "auto":
        method = _topk_method(N)
    if method == "threshold":
        thr = torch.topk(scores, min(k, N), dim=-1, sorted=False).values.amin(dim=-1).contiguous()  # (B, T)
        out = _empty((B, T, k), torch.int64, dev)
        if ids is not None and ids.stride(-1) != 1:
            ids = ids.contiguous()
        idt = ids if ids is not None else scores
        bl = min(block, triton.next_power_of_2(max(N, k, 16)))
        static = interpreting()
        _pick_kernel[(B * T,)](scores, thr, idt, out, T, N, k, scores.stride(0), scores.stride(1),
                               idt.stride(0), idt.stride(1), out.stride(0), out.stride(1),
                               HAS_IDS=ids is not None, BLOCK=bl, STATIC_TRIPS=static,
                               N_TILES=triton.cdiv(N, bl) if static else 0, K_TILES=triton.cdiv(k, bl) if static else 0,
                               num_warps=num_warps)
        return out
    keys = _empty((B, T, N), torch.int64, dev)
    _keys_kernel[(B * T, triton.cdiv(N, block))](scores, keys, T, N, scores.stride(0), scores.stride(1),
                                                  BLOCK=block, num_warps=num_warps)
    best = torch.topk(keys, min(k, N), dim=-1, sorted=False).values  # (B, T, k')
    col = (N - 1) - (best & 0xFFFFFFFF)  # the low word holds N − 1 − column
    col = torch.where(best > _KEY_MIN.value, col, N).sort(dim=-1).values  # −inf picks sort last
    picked = col < N
    if ids is not None:
        col = ids.gather(-1, col.clamp(max=N - 1))
    out = torch.where(picked, col, -1)
    if k > N:
        out = torch.cat((out, out.new_full((B, T, k - N), -1)), dim=-1)
    return out
