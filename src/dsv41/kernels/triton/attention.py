"""Sparse attention (SPEC §3): one softmax over window keys ∪ selected compressed entries + sink.

MQA over the 512-dim latent: all H heads of a query share every key, and keys = values. One
program takes a block of BLOCK_H heads of one query (b, t) as the M dimension of `tl.dot`, streams
key tiles of BLOCK_N rows decoded to the dot dtype in registers (never written back to memory), and
runs an online softmax in the exp2 domain with fp32 accumulation:
  * window tiles: the pooled FP8 ring (slot ring_ids[b], positions ring_pos), then the chunk's own
    keys (prefill); rows of D E4M3 bytes + D/32 E8M0 bytes, masked by position;
  * entry tiles: top-k ids → page table → packed FP4 rows of the shared pool (D/2 bytes, element
    2i in the low nibble, + D/16 E4M3 scales), −1 = none.
The sink starts the running max (so nothing is ever −inf − −inf) and adds exp(sink − m) to the
denominator at the end; a query with no visible key returns zeros.

Grid (B·T, head blocks · D/BLOCK_DV, splits). Knobs:
  * BLOCK_K < D computes QK as a runtime loop over D-chunks that streams q's chunk in again (L2
    hits). Why: a single (64 × 512) · (512 × BLOCK_N) wgmma keeps ~2·D/16 64-bit smem descriptors
    live across the tile loop (LLVM hoists them), and with the (64 × 512) fp32 accumulator that
    spills at D = 512 (ptxas for sm_90: BLOCK_K = D spills ~0.7–0.9 KB/thread; the default
    BLOCK_K = 128, BLOCK_N = 64, BLOCK_PV = 128 at 8 warps spills 32–88 B with preload_pv, none
    without).
  * BLOCK_PV splits PV into value chunks (the accumulator is a tuple of (BLOCK_H, BLOCK_PV)
    tiles), each fed by its own decoded chunk; only BLOCK_K = BLOCK_PV = D reuses the QK tile.
    preload_pv issues the value chunks' loads before QK so that their latency hides behind it.
  * BLOCK_DV < D splits the value columns across programs (QK is recomputed per split).
  * num_splits > 1 splits the tile list (flash-decoding); each split writes fp32 (acc, max, sum)
    and `_combine_kernel` merges them, so that small decode batches fill the 132 SMs.
  * chunk_band (default) scans only chunk rows (t − window, t] for query t: that holds every
    visible chunk key when q_pos strictly increases along T (the engine's consecutive positions);
    and it skips the ring for queries t >= window − 1, which see no ring key when the ring holds
    positions before the chunk's first (the engine writes the chunk's keys into the ring after the
    call). chunk_band=False scans the whole chunk and the ring for arbitrary positions.
  * fp4_decode: "lut" (GPU default) turns 8 codes into bf16 with byte-permute table lookups in
    inline PTX (~3 ALU ops per value); "e4m3" moves the E2M1 bits into an E4M3 byte (value·2^-6,
    exact, subnormals included) for the hardware FP8 conversion; "int" uses `common.fp4_to_f32`.

What limits it: at H = 64 the work is ~390 FLOP per byte read, so it should be tensor-core bound,
but every key element needs decoding (~3–8 ALU ops vs 256 dot FLOPs per element), q's chunks are
re-read from L2 for every tile (64 KB per BLOCK_N keys), chunked PV decodes each key twice, and the
page-table gathers of 288-byte rows are latency-bound for small batches. Under TRITON_INTERPRET
loops run a compile-time trip count with dead iterations masked (the interpreter cannot take
runtime loop bounds with numpy >= 2.4) and the dot dtype is fp32.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from dsv41.kernels.triton.common import (
    dot_dtype,
    e4m3_to_f32,
    e8m0_to_f32,
    fp4_to_f32,
    interpreting,
    jit_sizes,
    runnable,
)

LOG2E = 1.4426950408889634
_LOG2E = tl.constexpr(LOG2E)  # what the kernels may read


# E2M1 → bf16 four bytes (eight codes) at a time with byte-permute table lookups (GPU only).
# prmt with the 3-bit magnitude as selector picks the high / low byte of the bf16 value from an
# 8-entry table (0, .5, 1, 1.5, 2, 3, 4, 6 = 0x0000, 3F00, 3F80, 3FC0, 4000, 4040, 4080, 40C0);
# the sign bit is replicated into place by prmt's sign mode; then × the block scale (exact: ≤ 6
# significant bits). In: $4 = 4 packed bytes, $5 / $6 = bf16x2 scales of bytes (0, 1) / (2, 3).
# Out: $0 / $1 = low-nibble values of bytes (0, 1) / (2, 3), $2 / $3 = high-nibble values.
_FP4_LUT_ASM = tl.constexpr("""
{
.reg .b32 m, m2, th_a, th_b, tl_a, tl_b, h0, l0, h1, l1, se, sg;
mov.b32 th_a, 0x3F3F3F00;
mov.b32 th_b, 0x40404040;
mov.b32 tl_a, 0xC0800000;
mov.b32 tl_b, 0xC0804000;
and.b32 m, $4, 0x77777777;
shr.b32 m2, m, 16;
prmt.b32 h0, th_a, th_b, m;
prmt.b32 l0, tl_a, tl_b, m;
prmt.b32 h1, th_a, th_b, m2;
prmt.b32 l1, tl_a, tl_b, m2;
shl.b32 se, $4, 4;
prmt.b32 $0, l0, h0, 0x6240;
prmt.b32 sg, se, se, 0x9080;
and.b32 sg, sg, 0x80008000;
or.b32 $0, $0, sg;
mul.rn.bf16x2 $0, $0, $5;
prmt.b32 $1, l1, h1, 0x6240;
prmt.b32 sg, se, se, 0xB0A0;
and.b32 sg, sg, 0x80008000;
or.b32 $1, $1, sg;
mul.rn.bf16x2 $1, $1, $6;
prmt.b32 $2, l0, h0, 0x7351;
prmt.b32 sg, $4, $4, 0x9080;
and.b32 sg, sg, 0x80008000;
or.b32 $2, $2, sg;
mul.rn.bf16x2 $2, $2, $5;
prmt.b32 $3, l1, h1, 0x7351;
prmt.b32 sg, $4, $4, 0xB0A0;
and.b32 sg, sg, 0x80008000;
or.b32 $3, $3, sg;
mul.rn.bf16x2 $3, $3, $6;
}
""")

FP4_DECODES = ("int", "e4m3", "lut")  # common.fp4_to_f32 | E4M3 bit move + hardware convert | prmt tables (GPU)


@triton.jit
def _load_raw(rows, ok, col0, NCOL: tl.constexpr, D: tl.constexpr, FP4: tl.constexpr):
    """Bytes of channels [col0, col0 + NCOL) of key rows (rows: (BLOCK_N,) uint8 pointers, ok: row mask):
    (payload (BLOCK_N, NCOL) E4M3 or (BLOCK_N, NCOL/2) packed E2M1, scales (BLOCK_N, NCOL/32 or /16))."""
    if FP4:
        payload = tl.load(rows[:, None] + col0 // 2 + tl.arange(0, NCOL // 2)[None, :], mask=ok[:, None], other=0)
        scales = tl.load(rows[:, None] + D // 2 + col0 // 16 + tl.arange(0, NCOL // 16)[None, :],
                         mask=ok[:, None], other=0)
    else:
        payload = tl.load(rows[:, None] + col0 + tl.arange(0, NCOL)[None, :], mask=ok[:, None], other=0)
        scales = tl.load(rows[:, None] + D + col0 // 32 + tl.arange(0, NCOL // 32)[None, :],
                         mask=ok[:, None], other=127)
    return payload, scales


@triton.jit
def _decode(payload, scales, NCOL: tl.constexpr, BLOCK_N: tl.constexpr, FP4: tl.constexpr,
            FP4_DECODE: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Raw bytes from `_load_raw` → (BLOCK_N, NCOL) values in the dot dtype (exact: ≤ 6 significant bits)."""
    if FP4:
        G: tl.constexpr = NCOL // 16
        packed = tl.reshape(payload, (BLOCK_N, G, 8))
        scale = e4m3_to_f32(scales)[:, :, None]  # (BLOCK_N, G, 1)
        if FP4_DECODE == 2:
            x_lo, x_hi = tl.inline_asm_elementwise(_FP4_LUT_ASM, "=r,=r,=r,=r,r,r,r",
                                                   [packed, scale.to(tl.bfloat16)],
                                                   dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        elif FP4_DECODE == 1:
            # E2M1 bits s.e1e0.m → E4M3 bits s.000e1e0.m00 encode value · 2^-6 exactly (E4M3 subnormals
            # cover the 0.5 code), so one hardware FP8 conversion replaces the integer decode
            lo = (((packed & 7) << 2) | ((packed & 8) << 4)).to(tl.uint8)
            hi = (((packed >> 2) & 0x1C) | (packed & 0x80)).to(tl.uint8)
            scale = scale * 64.0
            x_lo, x_hi = e4m3_to_f32(lo) * scale, e4m3_to_f32(hi) * scale
        else:
            x_lo, x_hi = fp4_to_f32(packed) * scale, fp4_to_f32(packed >> 4) * scale
        x = tl.reshape(tl.join(x_lo, x_hi), (BLOCK_N, NCOL))  # (BLOCK_N, G, 8, 2): element 2i = low nibble
    else:
        G: tl.constexpr = NCOL // 32
        x = e4m3_to_f32(tl.reshape(payload, (BLOCK_N, G, 32))) * e8m0_to_f32(scales)[:, :, None]
        x = tl.reshape(x, (BLOCK_N, NCOL))
    return x.to(DOT_DTYPE)


@triton.jit
def _keys(rows, ok, col0, NCOL: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, FP4: tl.constexpr,
          FP4_DECODE: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Channels [col0, col0 + NCOL) of a key tile in the dot dtype: window rows (FP8) or entry rows (FP4)."""
    payload, scales = _load_raw(rows, ok, col0, NCOL, D, FP4)
    return _decode(payload, scales, NCOL, BLOCK_N, FP4, FP4_DECODE, DOT_DTYPE)


@triton.jit
def _dot(a, b, acc, DOT_DTYPE: tl.constexpr):
    if DOT_DTYPE == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _attend_tile(acc, m_i, l_i, q, q_rows, h_ok, rows, visible, dv0, qk_scale,
                 D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_DV: tl.constexpr, BLOCK_PV: tl.constexpr, PRELOAD_PV: tl.constexpr, FP4: tl.constexpr,
                 FP4_DECODE: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """One online-softmax step (log2 domain) over the key tile at `rows` ((BLOCK_N,) row pointers).

    QK: BLOCK_K == D is one dot against q held in shared memory; BLOCK_K < D accumulates over
    D-chunks in a runtime loop that streams q's chunk in again (an L2 hit), so that only one chunk's
    wgmma descriptors are live — a full-D dot keeps ~2·D/16 64-bit descriptors live across the tile
    loop, which spills at D = 512. PV: acc is a tuple of BLOCK_DV/BLOCK_PV (BLOCK_H, BLOCK_PV)
    chunks, each fed by its own decoded value chunk; when nothing is chunked the QK tile is reused."""
    s = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
    REUSE: tl.constexpr = (BLOCK_K == D) and (BLOCK_PV == D)
    raw = ()
    if PRELOAD_PV and not REUSE:  # issue the value bytes' loads now: their latency hides behind QK
        for c in tl.static_range(BLOCK_DV // BLOCK_PV):
            raw = raw + (_load_raw(rows, visible, dv0 + c * BLOCK_PV, BLOCK_PV, D, FP4),)
    if BLOCK_K == D:
        k = _keys(rows, visible, 0, D, D, BLOCK_N, FP4, FP4_DECODE, DOT_DTYPE)
        s = _dot(q, tl.trans(k), s, DOT_DTYPE)
    else:
        for c in range(0, D, BLOCK_K):
            cols = c + tl.arange(0, BLOCK_K)
            qc = tl.load(q_rows[:, None] + cols[None, :], mask=h_ok[:, None], other=0.0).to(DOT_DTYPE)
            kc = _keys(rows, visible, c, BLOCK_K, D, BLOCK_N, FP4, FP4_DECODE, DOT_DTYPE)
            s = _dot(qc, tl.trans(kc), s, DOT_DTYPE)
    s = tl.where(visible[None, :], s * qk_scale, float("-inf"))  # (BLOCK_H, BLOCK_N)
    m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: m starts at the sink
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(DOT_DTYPE)
    new = ()
    for c in tl.static_range(BLOCK_DV // BLOCK_PV):
        if REUSE:
            v = k
        elif PRELOAD_PV:
            v = _decode(raw[c][0], raw[c][1], BLOCK_PV, BLOCK_N, FP4, FP4_DECODE, DOT_DTYPE)
        else:
            v = _keys(rows, visible, dv0 + c * BLOCK_PV, BLOCK_PV, D, BLOCK_N, FP4, FP4_DECODE, DOT_DTYPE)
        new = new + (_dot(p, v, acc[c] * alpha[:, None], DOT_DTYPE),)
    return new, m_new, l_i


@triton.jit
def _window_step(acc, m_i, l_i, q, q_rows, h_ok, k0, live, n, low, t_pos, qk_scale, pos_base, row_base, row_stride,
                 dv0, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_DV: tl.constexpr, BLOCK_PV: tl.constexpr, PRELOAD_PV: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Window keys k0 + [0, BLOCK_N) of a table of n FP8 rows (row_base + k · row_stride) whose positions
    are pos_base[k]: the ring slot of this query's sequence, or the call's own chunk keys. live = False:
    a padding iteration that changes nothing."""
    k = k0 + tl.arange(0, BLOCK_N)
    ok = (k < n) & live
    p = tl.load(pos_base + k, mask=ok, other=-1)
    visible = ok & (p >= low) & (p <= t_pos)
    rows = row_base + k.to(tl.int64) * row_stride
    return _attend_tile(acc, m_i, l_i, q, q_rows, h_ok, rows, visible, dv0, qk_scale,
                        D, BLOCK_H, BLOCK_N, BLOCK_K, BLOCK_DV, BLOCK_PV, PRELOAD_PV, False, 0, DOT_DTYPE)


@triton.jit
def _entry_step(acc, m_i, l_i, q, q_rows, h_ok, i, live, qk_scale, ids, K, page_table_base, page_rows, pool_ptr,
                stride_pool, dv0, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_PV: tl.constexpr, PRELOAD_PV: tl.constexpr,
                FP4_DECODE: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Entry tile i: top-k ids → page table → pool rows (−1 = none)."""
    j = i * BLOCK_N + tl.arange(0, BLOCK_N)
    e = tl.load(ids + j, mask=(j < K) & live, other=-1).to(tl.int64)
    visible = e >= 0
    e = tl.where(visible, e, 0)
    page = tl.load(page_table_base + e // page_rows, mask=visible, other=0).to(tl.int64)
    rows = pool_ptr + (page * page_rows + e % page_rows) * stride_pool
    return _attend_tile(acc, m_i, l_i, q, q_rows, h_ok, rows, visible, dv0, qk_scale,
                        D, BLOCK_H, BLOCK_N, BLOCK_K, BLOCK_DV, BLOCK_PV, PRELOAD_PV, True, FP4_DECODE, DOT_DTYPE)


@jit_sizes("T", "K", "n_ring_tiles", "n_chunk_tiles", "n_tiles", "tiles_per_split", "n_splits", "stride_chunk_b",
           "stride_tk_b", "stride_tk_t", "stride_pos_b")
def _sparse_attention_kernel(
        q_ptr, q_pos_ptr, sink_ptr, window_start_ptr,
        ring_ptr, ring_pos_ptr, ring_ids_ptr, chunk_ptr,
        pool_ptr, page_table_ptr, topk_ptr,
        out_ptr, part_o_ptr, part_ml_ptr,
        T, H, W, K, window, page_rows, qk_scale,
        stride_qb, stride_qt, stride_qh, stride_ob, stride_ot, stride_oh,
        stride_ring_s, stride_ring_w, stride_rpos_s, stride_chunk_b, stride_chunk_t, stride_pool,
        stride_pt_b, stride_tk_b, stride_tk_t, stride_pos_b,
        n_ring_tiles, n_chunk_tiles, n_tiles, tiles_per_split, n_splits,
        D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        BLOCK_DV: tl.constexpr, BLOCK_PV: tl.constexpr, PRELOAD_PV: tl.constexpr,
        HAS_RING: tl.constexpr, HAS_CHUNK: tl.constexpr, HAS_ENTRIES: tl.constexpr, HAS_WS: tl.constexpr,
        CHUNK_BAND: tl.constexpr, SPLIT: tl.constexpr, FP4_DECODE: tl.constexpr, DOT_DTYPE: tl.constexpr,
        STATIC_TRIPS: tl.constexpr, MAX_RING: tl.constexpr, MAX_CHUNK: tl.constexpr, MAX_ENTRY: tl.constexpr):
    bt = tl.program_id(0)
    N_DV: tl.constexpr = D // BLOCK_DV
    N_PV: tl.constexpr = BLOCK_DV // BLOCK_PV
    hb, dv0 = tl.program_id(1) // N_DV, (tl.program_id(1) % N_DV) * BLOCK_DV
    split = tl.program_id(2)
    b, t = bt // T, bt % T

    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < H
    q_rows = q_ptr + b.to(tl.int64) * stride_qb + t * stride_qt + heads * stride_qh  # (BLOCK_H,)
    q = q_rows  # unused when QK streams q per chunk
    if BLOCK_K == D:
        dcols = tl.arange(0, D)
        q = tl.load(q_rows[:, None] + dcols[None, :], mask=h_ok[:, None], other=0.0).to(DOT_DTYPE)  # (BLOCK_H, D)
    sink = tl.load(sink_ptr + heads, mask=h_ok, other=0.0).to(tl.float32) * _LOG2E
    m_i = sink
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = ()
    for _c in tl.static_range(N_PV):
        acc = acc + (tl.zeros([BLOCK_H, BLOCK_PV], dtype=tl.float32),)

    # window keys at p are visible iff low <= p <= t_pos
    pos_base = q_pos_ptr + b * stride_pos_b
    t_pos = tl.load(pos_base + t).to(tl.int64)
    low = t_pos - window + 1
    if HAS_WS:
        low = tl.maximum(low, tl.load(window_start_ptr + b).to(tl.int64))
    low = tl.maximum(low, 0)

    # this split's tiles [first, last) of the list ring tiles | chunk tiles | entry tiles. Under the
    # interpreter (STATIC_TRIPS) loops run a compile-time count with dead iterations masked off
    # (it cannot take runtime loop bounds); on the GPU they run exactly their tiles.
    first = split * tiles_per_split
    last = tl.minimum(first + tiles_per_split, n_tiles)
    if HAS_RING:
        rid = tl.load(ring_ids_ptr + b).to(tl.int64)
        ring_base = ring_ptr + rid * stride_ring_s
        rpos_base = ring_pos_ptr + rid * stride_rpos_s
        end = tl.minimum(last, n_ring_tiles)
        if CHUNK_BAND and HAS_CHUNK:
            # the ring holds positions before the chunk's first, q_pos[b, 0]: with positions strictly
            # increasing, query t's window starts at t_pos − window + 1 >= q_pos[b, 0] + t − window + 1, past
            # every ring key once t >= window − 1
            end = tl.where(t + 1 >= window, first, end)
        if STATIC_TRIPS:
            for j in range(MAX_RING):
                acc, m_i, l_i = _window_step(
                    acc, m_i, l_i, q, q_rows, h_ok, (first + j) * BLOCK_N, first + j < end, W, low, t_pos, qk_scale,
                    rpos_base, ring_base, stride_ring_w, dv0,
                    D, BLOCK_H, BLOCK_N, BLOCK_K, BLOCK_DV, BLOCK_PV, PRELOAD_PV, DOT_DTYPE)
        else:
            for i in range(first, end):
                acc, m_i, l_i = _window_step(
                    acc, m_i, l_i, q, q_rows, h_ok, i * BLOCK_N, True, W, low, t_pos, qk_scale,
                    rpos_base, ring_base, stride_ring_w, dv0,
                    D, BLOCK_H, BLOCK_N, BLOCK_K, BLOCK_DV, BLOCK_PV, PRELOAD_PV, DOT_DTYPE)
    if HAS_CHUNK:
        s0 = 0
        if CHUNK_BAND:
            s0 = tl.maximum(t - window + 1, 0)
        chunk_base = chunk_ptr + b.to(tl.int64) * stride_chunk_b
        start = tl.maximum(first, n_ring_tiles)
        end = tl.minimum(last, n_ring_tiles + n_chunk_tiles)
        if STATIC_TRIPS:
            for j in range(MAX_CHUNK):
                acc, m_i, l_i = _window_step(
                    acc, m_i, l_i, q, q_rows, h_ok, s0 + (start + j - n_ring_tiles) * BLOCK_N, start + j < end, T,
                    low, t_pos, qk_scale, pos_base, chunk_base, stride_chunk_t, dv0,
                    D, BLOCK_H, BLOCK_N, BLOCK_K, BLOCK_DV, BLOCK_PV, PRELOAD_PV, DOT_DTYPE)
        else:
            for i in range(start, end):
                acc, m_i, l_i = _window_step(
                    acc, m_i, l_i, q, q_rows, h_ok, s0 + (i - n_ring_tiles) * BLOCK_N, True, T,
                    low, t_pos, qk_scale, pos_base, chunk_base, stride_chunk_t, dv0,
                    D, BLOCK_H, BLOCK_N, BLOCK_K, BLOCK_DV, BLOCK_PV, PRELOAD_PV, DOT_DTYPE)
    if HAS_ENTRIES:
        n_win = n_ring_tiles + n_chunk_tiles
        ids = topk_ptr + b.to(tl.int64) * stride_tk_b + t.to(tl.int64) * stride_tk_t
        pt_base = page_table_ptr + b * stride_pt_b
        start = tl.maximum(first, n_win)
        if STATIC_TRIPS:
            for j in range(MAX_ENTRY):
                acc, m_i, l_i = _entry_step(acc, m_i, l_i, q, q_rows, h_ok, start + j - n_win, start + j < last,
                                            qk_scale, ids, K, pt_base, page_rows, pool_ptr, stride_pool, dv0,
                                            D, BLOCK_H, BLOCK_N, BLOCK_K, BLOCK_DV, BLOCK_PV, PRELOAD_PV,
                                            FP4_DECODE, DOT_DTYPE)
        else:
            for i in range(start, last):
                acc, m_i, l_i = _entry_step(acc, m_i, l_i, q, q_rows, h_ok, i - n_win, True,
                                            qk_scale, ids, K, pt_base, page_rows, pool_ptr, stride_pool, dv0,
                                            D, BLOCK_H, BLOCK_N, BLOCK_K, BLOCK_DV, BLOCK_PV, PRELOAD_PV,
                                            FP4_DECODE, DOT_DTYPE)

    if SPLIT:
        # unnormalized partials (acc, m, l) relative to this split's running max
        row = (bt.to(tl.int64) * n_splits + split) * H + heads  # (BLOCK_H,)
        for c in tl.static_range(N_PV):
            vcols = dv0 + c * BLOCK_PV + tl.arange(0, BLOCK_PV)
            tl.store(part_o_ptr + row[:, None] * D + vcols[None, :], acc[c], mask=h_ok[:, None])
        tl.store(part_ml_ptr + row * 2, m_i, mask=h_ok & (dv0 == 0))
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=h_ok & (dv0 == 0))
    else:
        denom = l_i + tl.exp2(sink - m_i)
        o_rows = out_ptr + b.to(tl.int64) * stride_ob + t * stride_ot + heads * stride_oh
        for c in tl.static_range(N_PV):
            vcols = dv0 + c * BLOCK_PV + tl.arange(0, BLOCK_PV)
            o = acc[c] / denom[:, None]
            tl.store(o_rows[:, None] + vcols[None, :], o.to(out_ptr.dtype.element_ty), mask=h_ok[:, None])


@jit_sizes("T")
def _combine_kernel(part_o_ptr, part_ml_ptr, sink_ptr, out_ptr, T, H, stride_ob, stride_ot, stride_oh,
                    N_SPLITS: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Merge the splits of one (query, head block, value block): Σ_s w_s·acc_s / (Σ_s w_s·l_s + e^sink)."""
    bt = tl.program_id(0)
    N_DV: tl.constexpr = D // BLOCK_DV
    hb, dv0 = tl.program_id(1) // N_DV, (tl.program_id(1) % N_DV) * BLOCK_DV
    b, t = bt // T, bt % T
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < H
    vcols = dv0 + tl.arange(0, BLOCK_DV)
    sink = tl.load(sink_ptr + heads, mask=h_ok, other=0.0).to(tl.float32) * _LOG2E
    m = sink
    for s in range(N_SPLITS):
        row = (bt.to(tl.int64) * N_SPLITS + s) * H + heads
        m = tl.maximum(m, tl.load(part_ml_ptr + row * 2, mask=h_ok, other=0.0))
    l = tl.exp2(sink - m)
    o = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    for s in range(N_SPLITS):
        row = (bt.to(tl.int64) * N_SPLITS + s) * H + heads
        w = tl.exp2(tl.load(part_ml_ptr + row * 2, mask=h_ok, other=0.0) - m)
        l += w * tl.load(part_ml_ptr + row * 2 + 1, mask=h_ok, other=0.0)
        o += w[:, None] * tl.load(part_o_ptr + row[:, None] * D + vcols[None, :], mask=h_ok[:, None], other=0.0)
    o = o / l[:, None]
    o_rows = out_ptr + b.to(tl.int64) * stride_ob + t * stride_ot + heads * stride_oh
    tl.store(o_rows[:, None] + vcols[None, :], o.to(out_ptr.dtype.element_ty), mask=h_ok[:, None])


# ---------------------------------------------------------------------------------------------
# launcher


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _scratch(shape: tuple[int, ...], device: torch.device) -> Tensor:
    """fp32 split-K scratch (allocators are functions so that tests can poison them)."""
    return torch.empty(shape, dtype=torch.float32, device=device)


def _empty_out(q: Tensor) -> Tensor:
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(f"sparse_attention: {msg}")


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def sparse_attention(q: Tensor, q_pos: Tensor, sink: Tensor, scale: float, window: int, *,
                     ring_kv: Tensor | None = None, ring_pos: Tensor | None = None, ring_ids: Tensor | None = None,
                     chunk_kv: Tensor | None = None, window_start: Tensor | None = None,
                     entry_pool: Tensor | None = None, page_table: Tensor | None = None, page_rows: int = 0,
                     topk: Tensor | None = None, out: Tensor | None = None,
                     block_h: int | None = None, block_n: int | None = None, block_k: int | None = None,
                     block_dv: int | None = None, block_pv: int | None = None, num_splits: int | None = None,
                     num_warps: int | None = None, num_stages: int | None = None, chunk_band: bool = True,
                     fp4_decode: str | None = None, preload_pv: bool = True) -> Tensor:
    """See `dsv41.kernels.ops.sparse_attention`. Knobs (None = a default for the shape): heads per
    program (block_h), keys per tile (block_n), QK chunk (block_k; D = one dot), value columns per
    program (block_dv < D splits D across programs) and per PV dot (block_pv), key-list splits
    (num_splits; None = enough programs for one wave on the SMs), warps, stages, the chunk band
    (needs q_pos strictly increasing along T), the FP4 decode (`FP4_DECODES`); `out` optional."""
    _check(q.dim() == 4 and q.is_floating_point(), f"q must be (B, T, H, D) float, got {tuple(q.shape)} {q.dtype}")
    B, T, H, D = q.shape
    dev = q.device
    _check(runnable(q), "tensors must be on CUDA (or TRITON_INTERPRET=1)")
    _check(_pow2(D) and D >= 32, f"D must be a power of two >= 32, got {D}")
    _check(q.stride(-1) == 1, "q's last dim must be contiguous")
    _check(q_pos.shape == (B, T) and not q_pos.is_floating_point() and q_pos.stride(-1) == 1,
           f"q_pos must be (B, T) = {(B, T)} integer, contiguous along T")
    _check(sink.shape == (H,) and sink.is_contiguous(), f"sink must be ({H},) contiguous, got {tuple(sink.shape)}")
    tensors = [q_pos, sink]
    win_bytes, ent_bytes = D + D // 32, D // 2 + D // 16

    has_ring = ring_kv is not None
    W = 0
    if has_ring:
        _check(ring_pos is not None, "ring_kv needs ring_pos")
        _check(ring_kv.dim() == 3 and ring_kv.dtype == torch.uint8 and ring_kv.size(2) == win_bytes
               and ring_kv.stride(2) == 1, f"ring_kv must be (S, W, {win_bytes}) uint8, got {tuple(ring_kv.shape)}")
        S, W = ring_kv.shape[:2]
        _check(ring_pos.shape == (S, W) and ring_pos.stride(1) == 1 and not ring_pos.is_floating_point(),
               f"ring_pos must be ({S}, {W}) integer")
        if ring_ids is None:
            _check(S == B, "ring_ids is required when the ring has more slots than the batch")
            ring_ids = torch.arange(B, device=dev)
        _check(ring_ids.shape == (B,) and ring_ids.is_contiguous(), f"ring_ids must be ({B},)")
        tensors += [ring_kv, ring_pos, ring_ids]
    has_chunk = chunk_kv is not None
    if has_chunk:
        _check(chunk_kv.dim() == 3 and chunk_kv.shape[:2] == (B, T) and chunk_kv.size(2) == win_bytes
               and chunk_kv.dtype == torch.uint8 and chunk_kv.stride(2) == 1,
               f"chunk_kv must be ({B}, {T}, {win_bytes}) uint8, got {tuple(chunk_kv.shape)}")
        tensors.append(chunk_kv)
    has_ws = window_start is not None
    if has_ws:
        _check(window_start.shape == (B,) and window_start.is_contiguous(), f"window_start must be ({B},)")
        tensors.append(window_start)
    has_entries = entry_pool is not None and topk is not None and topk.size(-1) > 0
    K = 0
    if has_entries:
        if entry_pool.dim() == 3 and page_rows <= 0:
            page_rows = entry_pool.size(1)
        _check(page_table is not None and page_rows > 0, "entries need page_table and page_rows > 0")
        _check(entry_pool.dtype == torch.uint8 and entry_pool.size(-1) == ent_bytes and entry_pool.dim() in (2, 3),
               f"entry_pool must be (rows, {ent_bytes}) or (pages, page_rows, {ent_bytes}) uint8, "
               f"got {tuple(entry_pool.shape)} {entry_pool.dtype}")
        _check(entry_pool.dim() == 2 or entry_pool.size(1) == page_rows,
               f"entry_pool pages hold {entry_pool.size(1)} rows, page_rows={page_rows}")
        if entry_pool.dim() == 3:
            try:
                entry_pool = entry_pool.view(-1, ent_bytes)  # (pages · page_rows, row bytes)
            except RuntimeError as err:
                raise ValueError("sparse_attention: entry_pool pages must be contiguous rows") from err
        _check(entry_pool.stride(1) == 1, "entry_pool rows must be contiguous")
        _check(topk.dim() == 3 and topk.shape[:2] == (B, T) and not topk.is_floating_point()
               and topk.stride(-1) == 1, f"topk must be ({B}, {T}, K) integer, got {tuple(topk.shape)}")
        _check(page_table.dim() == 2 and page_table.size(0) == B and page_table.stride(1) == 1
               and not page_table.is_floating_point(), f"page_table must be ({B}, pages) integer")
        K = topk.size(-1)
        tensors += [entry_pool, page_table, topk]
    _check(all(t.device == dev for t in tensors), "all tensors must be on q's device")

    _check(sink.is_floating_point(), f"sink must be float, got {sink.dtype}")
    # defaults: 64 heads on the wgmma M dimension with D = 512 stream QK in 128-wide chunks and PV
    # in 128-wide value chunks (no register spills on sm_90); small head counts use mma.sync tiles, and
    # for a prefill chunk 64-key tiles on 2 warps, one stage (H200 sweep, `small` at T = 16K: 1.73 ms vs
    # 2.71 ms with the decode defaults)
    block_h = block_h or min(64, max(16, triton.next_power_of_2(H)))
    big = block_h >= 64 and D >= 256
    small_prefill = not big and T >= 64  # (verification steps of a few tokens keep the decode tiles)
    block_n = block_n or (64 if big or small_prefill else 32)
    block_dv = block_dv or D
    block_k = block_k or (128 if big else D)
    num_warps = num_warps or (8 if big else 2 if small_prefill else 4)
    num_stages = num_stages or (1 if small_prefill else 2)
    if fp4_decode is None:
        fp4_decode = "e4m3" if interpreting() else "lut"
    _check(fp4_decode in FP4_DECODES, f"fp4_decode must be one of {FP4_DECODES}, got {fp4_decode!r}")
    _check(fp4_decode != "lut" or not interpreting(), "fp4_decode='lut' (inline PTX) cannot run in the interpreter")
    _check(_pow2(block_h) and block_h >= 16, f"block_h must be a power of two >= 16, got {block_h}")
    _check(_pow2(block_n) and block_n >= 16, f"block_n must be a power of two >= 16, got {block_n}")
    _check(_pow2(block_dv) and 32 <= block_dv <= D, f"block_dv must be a power of two in [32, {D}], got {block_dv}")
    _check(_pow2(block_k) and 32 <= block_k <= D, f"block_k must be a power of two in [32, {D}], got {block_k}")
    block_pv = block_pv or (block_dv if block_k == D else min(block_k, block_dv))
    _check(_pow2(block_pv) and 32 <= block_pv <= block_dv,
           f"block_pv must be a power of two in [32, block_dv={block_dv}], got {block_pv}")

    if out is None:
        out = _empty_out(q)
    _check(out.shape == q.shape and out.stride(-1) == 1 and out.device == dev, "out must be like q")
    if B * T == 0:
        return out

    n_ring = triton.cdiv(W, block_n) if has_ring else 0
    n_chunk = triton.cdiv(max(0, min(T, window) if chunk_band else T), block_n) if has_chunk else 0  # band ⊂ (t−W, t]
    n_entry = triton.cdiv(K, block_n) if has_entries else 0
    n_tiles = n_ring + n_chunk + n_entry
    n_hb, n_dv = triton.cdiv(H, block_h), D // block_dv
    programs = B * T * n_hb * n_dv
    if num_splits is None:
        # decode: one wave of programs; a short prefill block (the decoder replay: 128 queries of a few tiles each)
        # up to four programs per SM, so that the tiles' dependent loads (top-k id → page → entry) overlap
        waves = 4 if small_prefill else 1
        num_splits = 1 if interpreting() or not q.is_cuda else waves * _sm_count(dev.index or 0) // programs
    num_splits = max(1, min(num_splits, n_tiles))
    per_split = triton.cdiv(max(n_tiles, 1), num_splits)
    num_splits = triton.cdiv(max(n_tiles, 1), per_split)  # no empty split
    split = num_splits > 1
    part_o = part_ml = out
    if split:
        part_o = _scratch((B * T, num_splits, H, D), dev)
        part_ml = _scratch((B * T, num_splits, H, 2), dev)

    static = interpreting()  # the interpreter cannot run loops with runtime bounds (numpy >= 2.4)
    dummy = q_pos  # any tensor for absent pointers (never dereferenced)
    pool = entry_pool if has_entries else dummy
    _sparse_attention_kernel[(B * T, n_hb * n_dv, num_splits)](
        q, q_pos, sink, window_start if has_ws else dummy,
        ring_kv if has_ring else dummy, ring_pos if has_ring else dummy, ring_ids if has_ring else dummy,
        chunk_kv if has_chunk else dummy,
        pool, page_table if has_entries else dummy, topk if has_entries else dummy,
        out, part_o, part_ml,
        T, H, W, K, int(min(window, 1 << 30)), int(page_rows), float(scale) * LOG2E,
        q.stride(0), q.stride(1), q.stride(2), out.stride(0), out.stride(1), out.stride(2),
        ring_kv.stride(0) if has_ring else 0, ring_kv.stride(1) if has_ring else 0,
        ring_pos.stride(0) if has_ring else 0,
        chunk_kv.stride(0) if has_chunk else 0, chunk_kv.stride(1) if has_chunk else 0,
        pool.stride(0) if has_entries else 0,
        page_table.stride(0) if has_entries else 0,
        topk.stride(0) if has_entries else 0, topk.stride(1) if has_entries else 0, q_pos.stride(0),
        n_ring, n_chunk, n_tiles, per_split, num_splits,
        D=D, BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_DV=block_dv, BLOCK_PV=block_pv,
        PRELOAD_PV=preload_pv,
        HAS_RING=has_ring, HAS_CHUNK=has_chunk, HAS_ENTRIES=has_entries, HAS_WS=has_ws,
        CHUNK_BAND=chunk_band, SPLIT=split, FP4_DECODE=FP4_DECODES.index(fp4_decode), DOT_DTYPE=dot_dtype(),
        STATIC_TRIPS=static, MAX_RING=min(per_split, n_ring) if static else 0,
        MAX_CHUNK=min(per_split, n_chunk) if static else 0, MAX_ENTRY=min(per_split, n_entry) if static else 0,
        num_warps=num_warps, num_stages=num_stages,
    )
    if split:
        block_c = min(D, 4096 // block_h)  # value columns per combine program (4096 fp32 partials)
        _combine_kernel[(B * T, n_hb * (D // block_c))](
            part_o, part_ml, sink, out, T, H, out.stride(0), out.stride(1), out.stride(2),
            N_SPLITS=num_splits, D=D, BLOCK_H=block_h, BLOCK_DV=block_c, num_warps=4,
        )
    return out
