"""Single-pass mHC in Triton (SPEC §5): the Mega-mHC pass, the coefficient projection, the Sinkhorn split.

`mhc_post` reads the n = 4 streams h (M, 4, d) and the sublayer output f (M, d) once and writes
  h_new_j = post_j·f + Σ_i comb_ij·h_i   (fp32 math, rounded once to f's dtype),
  x       = Σ_j pre_j·h_new_j            (fp32 over the *rounded* h_new, then rounded),
  mixes   = (flatten(h_new) @ hc_fnᵀ)·rsqrt(mean(flatten(h_new)²) + eps)   ((2+n)·n = 24, fp32);
`mhc_mixes` is the same pass with h as the streams (no update), `mhc_split` the Sinkhorn split;
`mhc_post_split` / `mhc_mixes_split` return the split of the mixes instead (the Sinkhorn epilogue below).

Layout and grid. M = B·T tokens; h rows (token stride, stream stride, contiguous d), outputs
contiguous. A program owns BLOCK_T tokens (the M dimension of `tl.dot`) and one span of d, walked in
BLOCK_D chunks; per chunk it loads 4 h tiles + 1 f tile, forms h_new and x in registers, stores them,
and accumulates Σ h_new² and the projection tile acc (BLOCK_T, 32) (24 outputs padded to 32). Grid
(⌈M / BLOCK_T⌉, SPLIT): when the token tiles alone cannot fill the GPU (decode, short chunks) the d
axis is split, each program writes its partial projection + Σ h² to a workspace and
`_mhc_finish_kernel` sums the SPLIT partials in a fixed order (deterministic) and applies the RMS.
Two pass kernels (launcher knob `design`):
  * ``fused`` (`_mhc_fused_kernel`, the default from FUSED_MIN_TOKENS tokens when hc_fn is given):
    `_mhc_fn_split_kernel` first splits hc_fn once per call into bf16 planes W (3, 4·d, 32) — hi,
    mid, lo, row 4·c + i = column i·d + c — so the chunk loop does no splitting math: the 4 rounded
    bf16 h_new tiles are joined into one (BLOCK_T, 4·BLOCK_D) A operand (`_cat4`; `CATS`) against the
    chunk's contiguous (4·BLOCK_D, 32) plane tiles (columns 24–31 zero; `fn_cols`): 3 dots (B by
    cp.async when num_stages ≥ 2, the last wgmma left in flight into the next chunk). `tma` (default
    where `_tma_ready`: sm_90+ or the interpreter, 16-byte aligned rows) loads the 5 h/f tiles
    through tensor descriptors, so Triton's pipeliner keeps them in flight in shared memory (the
    copy engine, no address math in the loop; rows ≥ M and columns ≥ D arrive as zeros); without it
    they are plain register loads, and `prefetch` can load the next chunk's tiles into registers
    before this chunk's math. Defaults (the fastest of the H200 sweeps, 2026-11-30): with TMA
    BLOCK_T 128, BLOCK_D 32, 8 warps, 3 stages, unsplit at 16K tokens — 0.561 ms at d = 5120 (71 %
    of copy; 0.595 split in 3 with 24-column planes), against 0.70 with 2 stages, 0.65 at 64 tokens ×
    4 warps × 2 stages, 0.88 at BLOCK_D 64 and 0.80 with TMA stores of h_new / x as well (not kept);
    without TMA BLOCK_T 64, BLOCK_D 32, 4 warps, 3 stages — 0.74 ms (53 %), 0.95 with the register
    prefetch; ``legacy`` 1.98 ms.
  * ``legacy`` (`_mhc_pass_kernel`, decode, the pass without hc_fn and the ``tf32x3`` / ``ieee``
    precisions): hc_fn fp32 tiles read from L2 per stream and split in registers, 4 × 3 small dots
    per chunk, serialized with the loads (20 % of copy with the projection at 16K tokens; it spills
    at 255 registers). Without hc_fn it is a pure stream with its own defaults (`DEFAULTS["stream"]`):
    16 tokens × 128 channels, 4 warps — 0.492 ms at 16K tokens × d = 5120 (80 % of copy; H200 sweep,
    2026-11-30), against 0.51 at 16 × 64, 0.59 at 64 × 64 × 8 warps (the previous default), 0.63 at
    16 × 256 or 32 × 128, 0.85–0.90 fused: small token tiles, many resident programs per SM.

Precision of the projection. flatten(h_new) has n·d = 20480 terms and the contract is fp32 (it
feeds sigmoids and a 20-round Sinkhorn). `precision`:
  * ``split`` (default): hc_fn is split into three bf16 pieces (hi + mid + lo carries 24 mantissa
    bits, exactly); when the A operand is exactly bf16 (bf16 h_new — the model's case) it takes
    3 bf16 MMAs, otherwise A is split as well (6 MMAs, the products ≥ 2^-24). bf16 products are exact
    and accumulate in fp32, so the result is fp32-accurate;
  * ``tf32x3`` / ``ieee``: one `tl.dot` on fp32 operands with that input precision (plain ``tf32``,
    10 mantissa bits, is not accurate enough and is not offered); legacy kernel only.

What limits it (H200, d = 5120, bf16). Traffic is (2n+2)·d·2 = 102 KB per token (+ 96 B of
coefficients and mixes): 16K tokens move 1.68 GB, 0.39 ms at 4.3 TB/s. The projection is
2·24·4·d = 0.98 MFLOP per token, ~24 FLOP per byte of h_new (~10 per byte moved), too much for fp32
CUDA-core FMAs (``ieee``, ~0.3 ms on the cores that also do the update). On tensor cores ``split``
costs 3 × 2·32·4·d = 3.9 MFLOP per token (64 GFLOP, ~0.1 ms of m64n32k16 wgmma) that overlaps the
stream. The fused loop issues ~1,060 instructions per thread per 64 × 32 chunk (half of them the
update's FMAs; ~66 per token·channel, ~40 % of the issue slots at the copy rate). The plane tiles are
re-read from L2 by every token tile (128 × 2.9 MB = 0.37 GB of L2 traffic beside the 1.68 GB
stream at 128-token tiles). Measured with TMA loads it reaches 71 % of copy (0.557 ms, unsplit) — the
main loop issues ~1,100 instructions per thread per 128 × 32 chunk (8 warps: ~2,200 issue cycles
per SM for 80 KB moved; Nsight Compute: 34 % of issue slots busy) with one 40 KB h / f chunk in
flight while it computes the other (two TMA buffers; the plane tiles are three deep). Its stalls
(benchmarks/ncu.py): waiting on the TMA chunk 22 %, the shared-memory round trip of the A operand
17 % (8-way bank-conflicted stores; 37 % of shared wavefronts are excess), a block barrier before
each of the 5 TMA issues per chunk 10 %. The tile shape matters too: the pass without the projection
stops at 67 % with 64-token tiles and reaches 73–80 % with 16-token tiles of 64–128 channels
(`DEFAULTS["stream"]`; two 4-warp programs per SM, plain loads). The projection
wants the opposite — tall token tiles, so that each hc_fn plane tile read from L2 serves many tokens
(16- or 32-token fused tiles: 1.9–2.3 ms), and wider chunks at 128 tokens need more shared memory
than an SM has (BLOCK_D 64: 377 KB, most of it the staged planes). Next: keep the planes out of the
per-chunk pipeline (e.g. a persistent program per SM holding a tall tile's projection accumulator
while it walks short token slices), or project in a separate pass over h_new (+0.67 GB read) behind
a stream at 80 %.

Sinkhorn epilogue (`mhc_post_split`, `mhc_mixes_split`; the model's inference hand-overs). The split of
the mixes runs in the kernel that writes them, one launch less per hand-over. With d split (M ≤ 8,320
tokens at the defaults on 132 SMs: decode, the bounded replay, prefill chunks — `_plan`)
`_mhc_finish_kernel` stores its tokens' mixes, passes a barrier and reloads them for `_sinkhorn_rows` at the
split kernel's own tile and warps (`split_launch`), hence the same layout and the same sums in the same
order: bit-identical to pass + finish + split (sm_90a TTGIR compiled on the CPU, 2026-12-06: the same
(BLOCK, 4, 4) encoding and the same ops as `_mhc_split_kernel` at M = 64 and 4096). An unsplit pass keeps
the separate split kernel unless `split_in_pass`: there the rounds would run on the pass's own tile, whose
layout differs (TTGIR at 128 tokens × 8 warps: sizePerThread [1, 1, 4], threadsPerWarp [32, 1, 1],
warpsPerCTA [4, 2, 1], against [1, 1, 4] / [8, 4, 1] / [1, 1, 1] for the split kernel at BLOCK 8), so the
column sums add in another order — ulps apart, not bits — and 8 cells per thread lengthen the 40 dependent
normalizations (the split kernel at 64 tokens × 4 warps took ~15 µs against 4.0 µs at BLOCK 2, H200
2026-12-04, `split_launch`) at the end of a pass of ≥ 0.3 ms, for one launch saved. (The split kernel's own
row sums already depend on BLOCK: across lanes, (a + b) + (c + d), at BLOCK 2; in a thread, ((a + b) + c) + d,
at BLOCK 8.)

Interpreter note: TRITON_INTERPRET's fp32 → bf16 cast truncates, so there (EXACT_CAST) the rounding
of h_new and x to bf16 is done with integer bit arithmetic (round to nearest even, exact); the GPU
uses the hardware conversion, which rounds the same way.
"""

from __future__ import annotations

import functools
import weakref
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from dsv41.kernels.triton.common import capability, dot_dtype, interpreting, jit_sizes, runnable

HC_MULT = 4  # the pass kernel is written for n = 4 streams (every preset)
PRECISIONS = ("split", "tf32x3", "ieee")
FLOATS = (torch.float32, torch.bfloat16)


# --------------------------------------------------------------------------------------------- device code
@triton.jit
def _round_bf16(x, EXACT_CAST: tl.constexpr):
    """fp32 → the nearest bf16 value (ties to even), returned in fp32."""
    if EXACT_CAST:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(tl.bfloat16).to(tl.float32)


@triton.jit
def _to_out(x, OUT_BF16: tl.constexpr, EXACT_CAST: tl.constexpr):
    """Round an fp32 tile to the output dtype's grid (the value is then stored exactly)."""
    if OUT_BF16:
        return _round_bf16(x, EXACT_CAST)
    else:
        return x


@triton.jit
def _split_dots(acc, a, b_hi, b_mid, b_lo, A_BF16: tl.constexpr, DOT: tl.constexpr):
    """acc += a @ (b_hi + b_mid + b_lo) with bf16 MMAs, fp32-accurate (the module docstring's ``split``):
    3 MMAs when a is exactly bf16, else a is split too and 6 keep every product down to 2^-24 relative."""
    a_hi = a.to(tl.bfloat16)
    if A_BF16:  # smallest terms first
        acc = tl.dot(a_hi.to(DOT), b_lo.to(DOT), acc)
        acc = tl.dot(a_hi.to(DOT), b_mid.to(DOT), acc)
        acc = tl.dot(a_hi.to(DOT), b_hi.to(DOT), acc)
    else:
        ra = a - a_hi.to(tl.float32)
        a_mid = ra.to(tl.bfloat16)
        a_lo = (ra - a_mid.to(tl.float32)).to(tl.bfloat16)
        acc = tl.dot(a_lo.to(DOT), b_hi.to(DOT), acc)
        acc = tl.dot(a_mid.to(DOT), b_mid.to(DOT), acc)
        acc = tl.dot(a_hi.to(DOT), b_lo.to(DOT), acc)
        acc = tl.dot(a_mid.to(DOT), b_hi.to(DOT), acc)
        acc = tl.dot(a_hi.to(DOT), b_mid.to(DOT), acc)
        acc = tl.dot(a_hi.to(DOT), b_hi.to(DOT), acc)
    return acc


@triton.jit
def _project(acc, a, b, PRECISION: tl.constexpr, A_BF16: tl.constexpr, DOT: tl.constexpr):
    """acc += a (BLOCK_T, BLOCK_D) @ b (BLOCK_D, KP) to fp32 accuracy (see the module docstring)."""
    if PRECISION == "split":  # b split in registers into three bf16 pieces, exactly
        b_hi = b.to(tl.bfloat16)
        rb = b - b_hi.to(tl.float32)
        b_mid = rb.to(tl.bfloat16)
        b_lo = (rb - b_mid.to(tl.float32)).to(tl.bfloat16)
        acc = _split_dots(acc, a, b_hi, b_mid, b_lo, A_BF16, DOT)
    else:
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _coef(ptr, rows64, row_ok, STRIDE: tl.constexpr, idx: tl.constexpr):
    """Per-token coefficient ptr[token, idx] as a (BLOCK_T, 1) fp32 column."""
    return tl.load(ptr + rows64 * STRIDE + idx, mask=row_ok, other=0.0).to(tl.float32)[:, None]


@triton.jit
def _coefs(post_ptr, comb_ptr, pre_ptr, rows64, row_ok):
    """The 24 per-token coefficients as (BLOCK_T, 1) columns, loaded once: cf[j] = post_j,
    cf[4 + 4·i + j] = comb_ij, cf[20 + j] = pre_j (post (M, 4), comb (M, 4, 4) [i, j], pre (M, 4))."""
    cf = ()
    for j in tl.static_range(4):
        cf = cf + (_coef(post_ptr, rows64, row_ok, 4, j),)
    for ij in tl.static_range(16):
        cf = cf + (_coef(comb_ptr, rows64, row_ok, 16, ij),)
    for j in tl.static_range(4):
        cf = cf + (_coef(pre_ptr, rows64, row_ok, 4, j),)
    return cf


@triton.jit
def _residual(cf, f, h0, h1, h2, h3, j: tl.constexpr):
    """Stream j of the residual update in fp32 (hc_post): post_j·f + Σ_i comb_ij·h_i."""
    return cf[j] * f + (cf[4 + j] * h0 + cf[8 + j] * h1 + cf[12 + j] * h2 + cf[16 + j] * h3)


@triton.jit
def _collapse(cf, n0, n1, n2, n3):
    """The next sublayer's input in fp32 (hc_pre) from the rounded streams: Σ_j pre_j·h_new_j."""
    return cf[20] * n0 + cf[21] * n1 + cf[22] * n2 + cf[23] * n3


@triton.jit
def _token_tile(post_ptr, comb_ptr, pre_ptr, M, POST: tl.constexpr, BLOCK_T: tl.constexpr, KP: tl.constexpr):
    """A pass program's BLOCK_T tokens: (rows64, row_ok), their 24 coefficients (`_coefs`, POST only)
    and the zeroed projection accumulators (acc (BLOCK_T, KP), Σ h_new² (BLOCK_T,))."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < M
    rows64 = rows.to(tl.int64)
    cf = ()
    if POST:
        cf = _coefs(post_ptr, comb_ptr, pre_ptr, rows64, row_ok)
    return rows64, row_ok, cf, tl.zeros((BLOCK_T, KP), dtype=tl.float32), tl.zeros((BLOCK_T,), dtype=tl.float32)


@triton.jit
def _store_update(hnew_ptr, x_ptr, out_row, x_row, col, ok, D, n0, n1, n2, n3, x):
    """A chunk's outputs: the 4 h_new stream tiles (rows out_row, stride D) and the x tile, cast to
    their dtype (a no-op for tiles already in it)."""
    o_ty = hnew_ptr.dtype.element_ty
    hn = hnew_ptr + out_row + col[None, :]
    tl.store(hn, n0.to(o_ty), mask=ok)
    tl.store(hn + D, n1.to(o_ty), mask=ok)
    tl.store(hn + 2 * D, n2.to(o_ty), mask=ok)
    tl.store(hn + 3 * D, n3.to(o_ty), mask=ok)
    tl.store(x_ptr + x_row + col[None, :], x.to(x_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _store_mixes(acc, sq, mix_ptr, part_ptr, sq_ptr, rows64, row_ok, kk, pid_s, M, D, norm_eps,
                 FINAL: tl.constexpr, K_OUT: tl.constexpr, KP: tl.constexpr):
    """The projection's epilogue: mixes = acc · rsqrt(mean(h_new²) + eps), or (d split) this span's
    partial acc and Σ h_new² for `_mhc_finish_kernel`."""
    if FINAL:
        r = tl.math.rsqrt(sq / (4 * D) + norm_eps)
        mask = row_ok[:, None] & (kk[None, :] < K_OUT)
        tl.store(mix_ptr + rows64[:, None] * K_OUT + kk[None, :], acc * r[:, None], mask=mask)
    else:
        slot = pid_s * M + rows64
        tl.store(part_ptr + slot[:, None] * KP + kk[None, :], acc, mask=row_ok[:, None])
        tl.store(sq_ptr + slot, sq, mask=row_ok)


@triton.jit
def _fn_tile(fn_ptr, s_fnk, col, col_ok, kk, K_OUT: tl.constexpr):
    """hc_fn[k, col] as a (BLOCK_D, KP) fp32 tile (rows k ≥ K_OUT and ragged columns are 0)."""
    mask = col_ok[:, None] & (kk[None, :] < K_OUT)
    return tl.load(fn_ptr + kk[None, :] * s_fnk + col[:, None], mask=mask, other=0.0).to(tl.float32)


@jit_sizes("M")
def _mhc_pass_kernel(h_ptr, f_ptr, post_ptr, comb_ptr, pre_ptr, fn_ptr, hnew_ptr, x_ptr, mix_ptr, part_ptr, sq_ptr,
                     scale_ptr, base_ptr, npre_ptr, npost_ptr, ncomb_ptr,
                     M, D, norm_eps, hc_eps, s_mix, s_ht, s_hn, s_ft, s_fnk, N_IT: tl.constexpr,
                     SINKHORN: tl.constexpr, ITERS: tl.constexpr,
                     POST: tl.constexpr, HAS_FN: tl.constexpr, FINAL: tl.constexpr, OUT_BF16: tl.constexpr,
                     A_BF16: tl.constexpr, EXACT_CAST: tl.constexpr, PRECISION: tl.constexpr, DOT: tl.constexpr,
                     K_OUT: tl.constexpr, KP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_s = tl.program_id(1)
    rows64, row_ok, cf, acc, sq = _token_tile(post_ptr, comb_ptr, pre_ptr, M, POST, BLOCK_T, KP)
    kk = tl.arange(0, KP)
    h_row = h_ptr + rows64[:, None] * s_ht
    out_row = rows64[:, None] * (4 * D)
    for it in range(N_IT):  # this program's span of d: N_IT chunks (the last span may end early)
        col = (pid_s * N_IT + it) * BLOCK_D + tl.arange(0, BLOCK_D)
        col_ok = col < D
        ok = row_ok[:, None] & col_ok[None, :]
        h0 = tl.load(h_row + col[None, :], mask=ok, other=0.0).to(tl.float32)
        h1 = tl.load(h_row + s_hn + col[None, :], mask=ok, other=0.0).to(tl.float32)
        h2 = tl.load(h_row + 2 * s_hn + col[None, :], mask=ok, other=0.0).to(tl.float32)
        h3 = tl.load(h_row + 3 * s_hn + col[None, :], mask=ok, other=0.0).to(tl.float32)
        if POST:
            f = tl.load(f_ptr + rows64[:, None] * s_ft + col[None, :], mask=ok, other=0.0).to(tl.float32)
            # residual update in fp32, one rounding to the output dtype (hc_post)
            n0 = _to_out(_residual(cf, f, h0, h1, h2, h3, 0), OUT_BF16, EXACT_CAST)
            n1 = _to_out(_residual(cf, f, h0, h1, h2, h3, 1), OUT_BF16, EXACT_CAST)
            n2 = _to_out(_residual(cf, f, h0, h1, h2, h3, 2), OUT_BF16, EXACT_CAST)
            n3 = _to_out(_residual(cf, f, h0, h1, h2, h3, 3), OUT_BF16, EXACT_CAST)
            # the next sublayer's input from the rounded streams (hc_pre)
            x = _to_out(_collapse(cf, n0, n1, n2, n3), OUT_BF16, EXACT_CAST)
            _store_update(hnew_ptr, x_ptr, out_row, rows64[:, None] * D, col, ok, D, n0, n1, n2, n3, x)
        else:
            n0, n1, n2, n3 = h0, h1, h2, h3
        if HAS_FN:
            sq += tl.sum(n0 * n0 + n1 * n1 + n2 * n2 + n3 * n3, axis=1)
            acc = _project(acc, n0, _fn_tile(fn_ptr, s_fnk, col, col_ok, kk, K_OUT), PRECISION, A_BF16, DOT)
            acc = _project(acc, n1, _fn_tile(fn_ptr, s_fnk, D + col, col_ok, kk, K_OUT), PRECISION, A_BF16, DOT)
            acc = _project(acc, n2, _fn_tile(fn_ptr, s_fnk, 2 * D + col, col_ok, kk, K_OUT), PRECISION, A_BF16, DOT)
            acc = _project(acc, n3, _fn_tile(fn_ptr, s_fnk, 3 * D + col, col_ok, kk, K_OUT), PRECISION, A_BF16, DOT)

    if HAS_FN:
        _store_mixes(acc, sq, mix_ptr, part_ptr, sq_ptr, rows64, row_ok, kk, pid_s, M, D, norm_eps, FINAL, K_OUT, KP)
        if FINAL:  # this program wrote its tokens' mixes: with SINKHORN (`split_in_pass`) it splits them too
            _split_epilogue(mix_ptr, scale_ptr, base_ptr, npre_ptr, npost_ptr, ncomb_ptr, M, hc_eps, s_mix,
                            SINKHORN, ITERS, BLOCK_T)


@triton.jit
def _mhc_fn_split_kernel(fn_ptr, w_ptr, D, ROWS, s_fnk, K_OUT: tl.constexpr, KP: tl.constexpr, KW: tl.constexpr,
                         BLOCK_C: tl.constexpr):
    """hc_fn (K_OUT, 4·D) fp32 → W (3, ROWS, KW) bf16 planes hi / mid / lo with hi + mid + lo = hc_fn exactly.

    Row r = 4·c + i of a plane holds hc_fn[:, i·D + c] (zero for c ≥ D and in the KW - K_OUT padding
    columns), so a chunk's (4·BLOCK_D, KW) B tile is one contiguous block matching `_cat4`'s A columns.
    A program reads BLOCK_C channels of each stream (coalesced along c) and writes their 4·BLOCK_C rows."""
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    kk = tl.arange(0, KP)
    src_ok = (c < D)[:, None] & (kk[None, :] < K_OUT)
    out = (4 * c < ROWS)[:, None] & (kk[None, :] < KW)
    for i in tl.static_range(4):
        b = tl.load(fn_ptr + kk[None, :] * s_fnk + (i * D + c)[:, None], mask=src_ok, other=0.0).to(tl.float32)
        hi = b.to(tl.bfloat16)
        rb = b - hi.to(tl.float32)  # exact
        mid = rb.to(tl.bfloat16)
        lo = (rb - mid.to(tl.float32)).to(tl.bfloat16)  # exact: ≤ 8 significant bits are left
        dst = w_ptr + (4 * c + i).to(tl.int64)[:, None] * KW + kk[None, :]
        tl.store(dst, hi, mask=out)
        tl.store(dst + ROWS * KW, mid, mask=out)
        tl.store(dst + 2 * ROWS * KW, lo, mask=out)


@triton.jit
def _rounded(v, o_ty: tl.constexpr, OUT_BF16: tl.constexpr, EXACT_CAST: tl.constexpr):
    """fp32 v → (v in the output dtype, that value in fp32): one packed conversion on the GPU."""
    if OUT_BF16 and not EXACT_CAST:
        o = v.to(o_ty)
        return o, o.to(tl.float32)
    else:
        n = _to_out(v, OUT_BF16, EXACT_CAST)
        return n.to(o_ty), n


@triton.jit
def _cat4(a0, a1, a2, a3, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCKED: tl.constexpr):
    """Four (BLOCK_T, BLOCK_D) tiles → one (BLOCK_T, 4·BLOCK_D) operand: column 4·c + i = a_i[:, c]
    (interleaved), or with BLOCKED column i·BLOCK_D + c (the streams side by side)."""
    x = tl.join(tl.join(a0, a2), tl.join(a1, a3))  # [t, c, j, k] = a_{2j+k}[t, c]
    if BLOCKED:
        x = tl.permute(x, (0, 2, 3, 1))
    return tl.reshape(x, (BLOCK_T, 4 * BLOCK_D))


@triton.jit
def _dot3(acc, a, w_ptr, w_off, w_ok, s_wp, A_BF16: tl.constexpr, DOT: tl.constexpr):
    """acc += a @ (hi + mid + lo)[w_off] from the pre-split planes (`_split_dots`); w_ok masks the planes'
    missing padding columns (KW = 24 < KP)."""
    b_lo = tl.load(w_ptr + 2 * s_wp + w_off, mask=w_ok, other=0.0)
    b_mid = tl.load(w_ptr + s_wp + w_off, mask=w_ok, other=0.0)
    b_hi = tl.load(w_ptr + w_off, mask=w_ok, other=0.0)
    return _split_dots(acc, a, b_hi, b_mid, b_lo, A_BF16, DOT)


@triton.jit
def _load5(h_row, f_row, s_hn, col, ok, POST: tl.constexpr):
    """The chunk's 4 h tiles and f tile, in their storage dtype (f is h0 again when there is no update)."""
    h0 = tl.load(h_row + col[None, :], mask=ok, other=0.0)
    h1 = tl.load(h_row + s_hn + col[None, :], mask=ok, other=0.0)
    h2 = tl.load(h_row + 2 * s_hn + col[None, :], mask=ok, other=0.0)
    h3 = tl.load(h_row + 3 * s_hn + col[None, :], mask=ok, other=0.0)
    if POST:
        f = tl.load(f_row + col[None, :], mask=ok, other=0.0)
    else:
        f = h0
    return h0, h1, h2, h3, f


@triton.jit
def _load5_tma(h_desc, f_desc, t0, c0, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, POST: tl.constexpr):
    """`_load5` through tensor descriptors (TMA): h (M, 4, D) in (BLOCK_T, 1, BLOCK_D) boxes, f (M, D) in
    (BLOCK_T, BLOCK_D) boxes; rows ≥ M and columns ≥ D arrive as zeros."""
    h0 = tl.reshape(h_desc.load([t0, 0, c0]), (BLOCK_T, BLOCK_D))
    h1 = tl.reshape(h_desc.load([t0, 1, c0]), (BLOCK_T, BLOCK_D))
    h2 = tl.reshape(h_desc.load([t0, 2, c0]), (BLOCK_T, BLOCK_D))
    h3 = tl.reshape(h_desc.load([t0, 3, c0]), (BLOCK_T, BLOCK_D))
    if POST:
        f = f_desc.load([t0, c0])
    else:
        f = h0
    return h0, h1, h2, h3, f


@jit_sizes("M")
def _mhc_fused_kernel(h_ptr, f_ptr, post_ptr, comb_ptr, pre_ptr, w_ptr, hnew_ptr, x_ptr, mix_ptr, part_ptr, sq_ptr,
                      scale_ptr, base_ptr, npre_ptr, npost_ptr, ncomb_ptr, h_desc, f_desc,
                      M, D, norm_eps, hc_eps, s_mix, s_ht, s_hn, s_ft, s_wp, N_IT: tl.constexpr,
                      SINKHORN: tl.constexpr, ITERS: tl.constexpr,
                      POST: tl.constexpr, HAS_FN: tl.constexpr, FINAL: tl.constexpr, OUT_BF16: tl.constexpr,
                      A_BF16: tl.constexpr, EXACT_CAST: tl.constexpr, DOT: tl.constexpr, PREFETCH: tl.constexpr,
                      CAT: tl.constexpr, TMA: tl.constexpr, K_OUT: tl.constexpr, KP: tl.constexpr,
                      KW: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """The pass with pre-split hc_fn planes (`_mhc_fn_split_kernel`): per chunk the 4 rounded h_new
    tiles are one (BLOCK_T, 4·BLOCK_D) A operand (CAT) against the chunk's (4·BLOCK_D, KW → KP) bf16 planes —
    3 dots, no splitting math. The chunk's 5 h / f tiles come through tensor descriptors (TMA: pipelined
    by Triton in shared memory), or as register loads, the next chunk's issued before this chunk's
    math (PREFETCH), or plain."""
    pid_s = tl.program_id(1)
    rows64, row_ok, cf, acc, sq = _token_tile(post_ptr, comb_ptr, pre_ptr, M, POST, BLOCK_T, KP)
    kk = tl.arange(0, KP)
    cc = tl.arange(0, BLOCK_D)
    h_row = h_ptr + rows64[:, None] * s_ht
    f_row = f_ptr + rows64[:, None] * s_ft
    out_row = rows64[:, None] * (4 * D)
    x_row = rows64[:, None] * D
    col0 = pid_s * (N_IT * BLOCK_D)
    if PREFETCH:
        col = col0 + cc
        h0, h1, h2, h3, f = _load5(h_row, f_row, s_hn, col, row_ok[:, None] & (col < D)[None, :], POST)
    for it in range(N_IT):  # this program's span of d: N_IT chunks (the last span may end early)
        col = col0 + it * BLOCK_D + cc
        ok = row_ok[:, None] & (col < D)[None, :]
        if PREFETCH:  # the next chunk's tiles are in flight during this chunk's math and MMAs
            ncol = col + BLOCK_D
            nok = row_ok[:, None] & ((ncol < D) & (it + 1 < N_IT))[None, :]
            u0, u1, u2, u3, uf = _load5(h_row, f_row, s_hn, ncol, nok, POST)
        elif TMA:
            h0, h1, h2, h3, f = _load5_tma(h_desc, f_desc, tl.program_id(0) * BLOCK_T, col0 + it * BLOCK_D, BLOCK_T,
                                           BLOCK_D, POST)
        else:
            h0, h1, h2, h3, f = _load5(h_row, f_row, s_hn, col, ok, POST)
        g0 = h0.to(tl.float32)
        g1 = h1.to(tl.float32)
        g2 = h2.to(tl.float32)
        g3 = h3.to(tl.float32)
        if POST:
            ff = f.to(tl.float32)
            o_ty = hnew_ptr.dtype.element_ty
            o0, n0 = _rounded(_residual(cf, ff, g0, g1, g2, g3, 0), o_ty, OUT_BF16, EXACT_CAST)
            o1, n1 = _rounded(_residual(cf, ff, g0, g1, g2, g3, 1), o_ty, OUT_BF16, EXACT_CAST)
            o2, n2 = _rounded(_residual(cf, ff, g0, g1, g2, g3, 2), o_ty, OUT_BF16, EXACT_CAST)
            o3, n3 = _rounded(_residual(cf, ff, g0, g1, g2, g3, 3), o_ty, OUT_BF16, EXACT_CAST)
            x = _to_out(_collapse(cf, n0, n1, n2, n3), OUT_BF16, EXACT_CAST)
            _store_update(hnew_ptr, x_ptr, out_row, x_row, col, ok, D, o0, o1, o2, o3, x)
        else:
            n0, n1, n2, n3 = g0, g1, g2, g3
            o0, o1, o2, o3 = h0, h1, h2, h3
        if HAS_FN:
            sq += tl.sum(n0 * n0 + n1 * n1 + n2 * n2 + n3 * n3, axis=1)
            if A_BF16:  # the A operand straight from the stored bf16 tiles
                n0, n1, n2, n3 = o0, o1, o2, o3
            wr = (col0 + it * BLOCK_D) * 4  # first W row of the chunk (W is zero-padded past 4·D)
            w_ok = (kk < KW)[None, :]
            if CAT:
                a = _cat4(n0, n1, n2, n3, BLOCK_T, BLOCK_D, CAT == 2)
                r = tl.arange(0, 4 * BLOCK_D)
                if CAT == 2:  # row i·BLOCK_D + c of the operand is plane row 4·c + i
                    r = 4 * (r % BLOCK_D) + r // BLOCK_D
                w_off = (wr + r)[:, None] * KW + kk[None, :]
                acc = _dot3(acc, a, w_ptr, w_off, w_ok, s_wp, A_BF16, DOT)
            else:  # one K = BLOCK_D operand per stream (rows 4·c + i of the planes)
                w_off = (wr + 4 * cc)[:, None] * KW + kk[None, :]
                acc = _dot3(acc, n0, w_ptr, w_off, w_ok, s_wp, A_BF16, DOT)
                acc = _dot3(acc, n1, w_ptr, w_off + KW, w_ok, s_wp, A_BF16, DOT)
                acc = _dot3(acc, n2, w_ptr, w_off + 2 * KW, w_ok, s_wp, A_BF16, DOT)
                acc = _dot3(acc, n3, w_ptr, w_off + 3 * KW, w_ok, s_wp, A_BF16, DOT)
        if PREFETCH:
            h0, h1, h2, h3, f = u0, u1, u2, u3, uf

    if HAS_FN:
        _store_mixes(acc, sq, mix_ptr, part_ptr, sq_ptr, rows64, row_ok, kk, pid_s, M, D, norm_eps, FINAL, K_OUT, KP)
        if FINAL:  # this program wrote its tokens' mixes: with SINKHORN (`split_in_pass`) it splits them too
            _split_epilogue(mix_ptr, scale_ptr, base_ptr, npre_ptr, npost_ptr, ncomb_ptr, M, hc_eps, s_mix,
                            SINKHORN, ITERS, BLOCK_T)


@jit_sizes("M")
def _mhc_finish_kernel(part_ptr, sq_ptr, mix_ptr, scale_ptr, base_ptr, npre_ptr, npost_ptr, ncomb_ptr, M, D, norm_eps,
                       hc_eps, s_mix, SPLIT: tl.constexpr, K_OUT: tl.constexpr, KP: tl.constexpr,
                       BLOCK_T: tl.constexpr, SINKHORN: tl.constexpr, ITERS: tl.constexpr):
    """mixes of BLOCK_T tokens from the SPLIT partial projections (fixed order: deterministic), then with
    SINKHORN their split (`_sinkhorn_rows`)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < M
    rows64 = rows.to(tl.int64)
    kk = tl.arange(0, KP)
    acc = tl.zeros((BLOCK_T, KP), dtype=tl.float32)
    sq = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for s in range(SPLIT):  # fixed order: deterministic
        slot = s * M + rows64
        acc += tl.load(part_ptr + slot[:, None] * KP + kk[None, :], mask=row_ok[:, None], other=0.0)
        sq += tl.load(sq_ptr + slot, mask=row_ok, other=0.0)
    r = tl.math.rsqrt(sq / (4 * D) + norm_eps)
    mask = row_ok[:, None] & (kk[None, :] < K_OUT)
    tl.store(mix_ptr + rows64[:, None] * K_OUT + kk[None, :], acc * r[:, None], mask=mask)
    _split_epilogue(mix_ptr, scale_ptr, base_ptr, npre_ptr, npost_ptr, ncomb_ptr, M, hc_eps, s_mix, SINKHORN, ITERS,
                    BLOCK_T)


@triton.jit
def _split_epilogue(mix_ptr, scale_ptr, base_ptr, npre_ptr, npost_ptr, ncomb_ptr, M, hc_eps, s_mix,
                    SINKHORN: tl.constexpr, ITERS: tl.constexpr, BLOCK_T: tl.constexpr):
    """With SINKHORN, the split of the mixes rows this program has just stored (its BLOCK_T tokens): the
    barrier (bar.sync, CTA-scope memory ordering) makes every thread's global stores visible to the program's
    other threads, which then reload the rows in the split's (BLOCK_T, 4, 4) layout — one launch instead of
    two (`_sinkhorn_rows`)."""
    if SINKHORN:
        tl.debug_barrier()
        _sinkhorn_rows(mix_ptr, scale_ptr, base_ptr, npre_ptr, npost_ptr, ncomb_ptr, M, hc_eps, s_mix, ITERS, 4, 4,
                       BLOCK_T)  # n = NP = 4 streams, as the pass


@triton.jit
def _split_setup(mix_ptr, scale_ptr, M, s_mt, N: tl.constexpr, NP: tl.constexpr, BLOCK: tl.constexpr):
    """The Sinkhorn split kernels' common start: this program's token rows, the stream index, the scales."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    rows64 = rows.to(tl.int64)
    j = tl.arange(0, NP)
    s0 = tl.load(scale_ptr).to(tl.float32)
    s1 = tl.load(scale_ptr + 1).to(tl.float32)
    s2 = tl.load(scale_ptr + 2).to(tl.float32)
    return rows < M, rows64, j, j < N, s0, s1, s2, mix_ptr + rows64 * s_mt


@triton.jit
def _sinkhorn_rows(mix_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, M, eps, s_mt,
                   ITERS: tl.constexpr, N: tl.constexpr, NP: tl.constexpr, BLOCK: tl.constexpr):
    """The Sinkhorn split of this program's BLOCK tokens (`tl.program_id(0)`): mixes rows (stride s_mt) →
    pre (M, N), post (M, N), comb (M, N, N) fp32, each token's n×n matrix in registers as a (BLOCK, NP, NP)
    slice. The body of `_mhc_split_kernel`, and the epilogue of the kernels that write the mixes
    (`_mhc_finish_kernel`; a FINAL pass with `split_in_pass`), which reload their own rows after a barrier.
    The `tl.sum`s of the normalizations add their n terms in an order set by the layout Triton gives the
    slice, which depends on BLOCK and num_warps (module docstring): a caller that must agree with
    `_mhc_split_kernel` bit for bit runs it at `split_launch`'s BLOCK and warps with the same runtime s_mt."""
    row_ok, rows64, j, j_ok, s0, s1, s2, mix_row = _split_setup(mix_ptr, scale_ptr, M, s_mt, N, NP, BLOCK)

    ok2 = row_ok[:, None] & j_ok[None, :]
    m_pre = tl.load(mix_row[:, None] + j[None, :], mask=ok2, other=0.0).to(tl.float32)
    b_pre = tl.load(base_ptr + j, mask=j_ok, other=0.0).to(tl.float32)
    pre = tl.sigmoid(m_pre * s0 + b_pre[None, :]) + eps
    tl.store(pre_ptr + rows64[:, None] * N + j[None, :], pre, mask=ok2)
    m_post = tl.load(mix_row[:, None] + N + j[None, :], mask=ok2, other=0.0).to(tl.float32)
    b_post = tl.load(base_ptr + N + j, mask=j_ok, other=0.0).to(tl.float32)
    post = 2 * tl.sigmoid(m_post * s1 + b_post[None, :])
    tl.store(post_ptr + rows64[:, None] * N + j[None, :], post, mask=ok2)

    i3 = j[None, :, None]  # (1, NP, 1) row index of comb
    j3 = j[None, None, :]  # (1, 1, NP) column index
    cell_ok = (i3 < N) & (j3 < N)
    ok3 = row_ok[:, None, None] & cell_ok
    cell = 2 * N + i3 * N + j3
    logits = tl.load(mix_row[:, None, None] + cell, mask=ok3, other=0.0).to(tl.float32) * s2
    logits += tl.load(base_ptr + cell, mask=cell_ok, other=0.0).to(tl.float32)
    logits = tl.where(j3 < N, logits, float("-inf"))  # padding columns leave the row softmax alone
    e = tl.exp(logits - tl.max(logits, axis=2)[:, :, None])
    comb = tl.math.div_rn(e, tl.sum(e, axis=2)[:, :, None]) + eps
    comb = tl.where(cell_ok, comb, 0.0)
    comb = tl.math.div_rn(comb, tl.sum(comb, axis=1)[:, None, :] + eps)  # columns
    for _ in range(ITERS - 1):
        comb = tl.math.div_rn(comb, tl.sum(comb, axis=2)[:, :, None] + eps)  # rows
        comb = tl.math.div_rn(comb, tl.sum(comb, axis=1)[:, None, :] + eps)  # columns
    tl.store(comb_ptr + rows64[:, None, None] * (N * N) + i3 * N + j3, comb, mask=ok3)


@jit_sizes("M")
def _mhc_split_kernel(mix_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, M, eps, s_mt,
                      ITERS: tl.constexpr, N: tl.constexpr, NP: tl.constexpr, BLOCK: tl.constexpr):
    """BLOCK tokens per program (`_sinkhorn_rows`)."""
    _sinkhorn_rows(mix_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, M, eps, s_mt, ITERS, N, NP, BLOCK)


@triton.jit
def _norm_step(x, cell_ok, eps, COLUMNS: tl.constexpr):
    """One Sinkhorn normalization of (BLOCK, NP, NP): columns (sums over axis 1) or rows (axis 2)."""
    if COLUMNS:
        return tl.math.div_rn(x, tl.sum(x, axis=1)[:, None, :] + eps)
    return tl.math.div_rn(x, tl.sum(x, axis=2)[:, :, None] + eps)


@triton.jit
def _mhc_split_bwd_kernel(mix_ptr, scale_ptr, base_ptr, gpre_ptr, gpost_ptr, gcomb_ptr, gz_ptr, xs_ptr, M, eps,
                          s_mt, ITERS: tl.constexpr, N: tl.constexpr, NP: tl.constexpr, BLOCK: tl.constexpr):
    """dL/dz of the split's pre-activations z = mixes·scale + base, (M, (2+n)·n) fp32, from the gradients of
    pre, post, comb. The Sinkhorn rounds run forward once from the softmax, each normalization's input stored in
    the scratch xs (M, K·NP·NP) fp32 for K = 2·ITERS − 1, then are differentiated in reverse from those inputs:
    2K normalizations' work and K·NP²·8 bytes of traffic per token. (Until 2026-12-07 each input was recomputed from
    the softmax in registers, K² / 2 normalizations: 0.53 ms per call at 16K tokens and ITERS = 20 on the H100.)"""
    row_ok, rows64, j, j_ok, s0, s1, s2, mix_row = _split_setup(mix_ptr, scale_ptr, M, s_mt, N, NP, BLOCK)
    K: tl.constexpr = (2 + N) * N
    gz_row = gz_ptr + rows64 * K

    ok2 = row_ok[:, None] & j_ok[None, :]
    sig = tl.sigmoid(tl.load(mix_row[:, None] + j[None, :], mask=ok2, other=0.0).to(tl.float32) * s0
                     + tl.load(base_ptr + j, mask=j_ok, other=0.0).to(tl.float32)[None, :])
    g = tl.load(gpre_ptr + rows64[:, None] * N + j[None, :], mask=ok2, other=0.0)
    tl.store(gz_row[:, None] + j[None, :], g * sig * (1 - sig), mask=ok2)
    sig = tl.sigmoid(tl.load(mix_row[:, None] + N + j[None, :], mask=ok2, other=0.0).to(tl.float32) * s1
                     + tl.load(base_ptr + N + j, mask=j_ok, other=0.0).to(tl.float32)[None, :])
    g = tl.load(gpost_ptr + rows64[:, None] * N + j[None, :], mask=ok2, other=0.0)
    tl.store(gz_row[:, None] + N + j[None, :], 2 * g * sig * (1 - sig), mask=ok2)

    i3 = j[None, :, None]
    j3 = j[None, None, :]
    cell_ok = (i3 < N) & (j3 < N)
    ok3 = row_ok[:, None, None] & cell_ok
    cell = 2 * N + i3 * N + j3
    logits = tl.load(mix_row[:, None, None] + cell, mask=ok3, other=0.0).to(tl.float32) * s2
    logits += tl.load(base_ptr + cell, mask=cell_ok, other=0.0).to(tl.float32)
    logits = tl.where(j3 < N, logits, float("-inf"))
    e = tl.exp(logits - tl.max(logits, axis=2)[:, :, None])
    p = tl.math.div_rn(e, tl.sum(e, axis=2)[:, :, None])  # the softmax (0 in padding columns)
    x0 = tl.where(cell_ok, p + eps, 0.0)
    g = tl.load(gcomb_ptr + rows64[:, None, None] * (N * N) + i3 * N + j3, mask=ok3, other=0.0)
    # normalizations 1..K (K = 2·ITERS − 1): odd = columns, even = rows. Forward: store each one's input
    KS: tl.constexpr = 2 * ITERS - 1
    xs_cell = xs_ptr + rows64[:, None, None] * (KS * NP * NP) + i3 * NP + j3  # (BLOCK, NP, NP): step 1's slot
    row3 = row_ok[:, None, None] & (i3 < NP)
    x = x0
    for t in range(1, KS + 1):
        tl.store(xs_cell + (t - 1) * (NP * NP), x, mask=row3)
        if t < KS:
            if t % 2 == 1:
                x = _norm_step(x, cell_ok, eps, True)
            else:
                x = _norm_step(x, cell_ok, eps, False)
    # back from the last (a loop of positive steps)
    for back in range(0, KS):
        step = KS - back
        x = tl.load(xs_cell + (step - 1) * (NP * NP), mask=row3, other=0.0)  # the input of `step`
        # (the two branches' sums have different shapes: Triton wants each name one type in both branches)
        if step % 2 == 1:  # y = x / (Σ_i x + eps) along columns: g_x = (g − Σ_i g·y) / (Σ_i x + eps)
            col_sum = tl.sum(x, axis=1)[:, None, :] + eps
            y = tl.math.div_rn(x, col_sum)
            g = tl.math.div_rn(g - tl.sum(g * y, axis=1)[:, None, :], col_sum)
        else:
            row_sum = tl.sum(x, axis=2)[:, :, None] + eps
            y = tl.math.div_rn(x, row_sum)
            g = tl.math.div_rn(g - tl.sum(g * y, axis=2)[:, :, None], row_sum)
        g = tl.where(cell_ok, g, 0.0)
    g_logits = p * (g - tl.sum(g * p, axis=2)[:, :, None])  # the row softmax's backward
    tl.store(gz_row[:, None, None] + cell, g_logits, mask=ok3)


# --------------------------------------------------------------------------------------------- launchers
@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _programs_wanted(device: torch.device, per_sm: int = 2) -> int:
    """per_sm programs per SM (a small number in the interpreter, so tests reach the split path)."""
    return per_sm * _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 8


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Every output and workspace comes from here (tests poison it to prove each element is written)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _check_streams(name: str, h: Tensor, hc_fn: Tensor | None) -> tuple[int, int, int, int]:
    _require(h.dim() == 4, f"{name}: h must be (B, T, n, d), got shape {tuple(h.shape)}")
    B, T, n, d = h.shape
    _require(n == HC_MULT, f"{name}: the Triton kernel is written for hc_mult = {HC_MULT}, got n = {n}")
    _require(d > 0, f"{name}: d must be positive")
    _require(h.dtype in FLOATS, f"{name}: h must be float32 or bfloat16, got {h.dtype}")
    _require(runnable(h), f"{name}: h is on {h.device}; Triton needs CUDA (or TRITON_INTERPRET=1)")
    if hc_fn is not None:
        k = (2 + n) * n
        _require(tuple(hc_fn.shape) == (k, n * d), f"{name}: hc_fn must be ({k}, {n * d}), got {tuple(hc_fn.shape)}")
        _require(hc_fn.is_floating_point() and hc_fn.device == h.device, f"{name}: hc_fn must be a float tensor "
                 f"on {h.device}, got {hc_fn.dtype} on {hc_fn.device}")
    return B, T, n, d


def _plan(M: int, d: int, device: torch.device, block_t: int, block_d: int, split: int | None, per_sm: int = 2
          ) -> tuple[int, int, int, int]:
    """Block sizes shrunk to the problem, and the d split: (BLOCK_T, BLOCK_D, SPLIT, chunks per span);
    split=None splits d only when the token tiles give fewer than half of per_sm programs per SM."""
    for knob, value in (("block_t", block_t), ("block_d", block_d)):
        _require(value >= 16 and value & (value - 1) == 0, f"{knob} must be a power of two ≥ 16, got {value}")
    bt = max(16, min(block_t, triton.next_power_of_2(M)))
    bd = max(16, min(block_d, triton.next_power_of_2(d)))
    tiles, chunks = triton.cdiv(M, bt), triton.cdiv(d, bd)
    if split is None:
        want = _programs_wanted(device, per_sm)
        split = 1 if 2 * tiles >= want else min(chunks, triton.cdiv(want, tiles))
    _require(split >= 1, f"split must be ≥ 1, got {split}")
    per = triton.cdiv(chunks, min(split, chunks))  # chunks per span; no span is empty
    return bt, bd, triton.cdiv(chunks, per), per


DESIGNS = ("fused", "legacy")
# BLOCK_T, BLOCK_D, num_warps, num_stages when the caller leaves them None: per design, and for the fused
# design with TMA loads (the fastest of the H200 sweeps, 2026-11-30 — see the module docstring)
DEFAULTS = {"fused_tma": (128, 32, 8, 3), "fused": (64, 32, 4, 3), "legacy": (64, 64, 8, 1),
            "stream": (16, 128, 4, 1)}  # "stream": the legacy kernel without hc_fn (pure stream)
# how the fused pass feeds the 4 rounded streams to the projection: 0 one K = BLOCK_D operand per stream
# (12 dots), 1 one operand with interleaved columns 4·c + i (shared-memory A), 2 the streams side by side,
# columns i·BLOCK_D + c (register A; with the update's registers live it spills). H200 sweep 2026-11-30,
# 16K tokens × d = 5120: mhc_post 0.578 ms with 1 vs 0.964 with 2; mhc_mixes 0.285 with 2 vs 0.324 with 1.
CATS = (0, 1, 2)
CAT_DEFAULT = {True: 1, False: 2}  # by "is there a residual update" (mhc_post / mhc_mixes)
FUSED_MIN_TOKENS = 256  # below this (decode) `design=None` keeps the legacy kernel: no extra split launch


def _split_fn(hc_fn: Tensor, d: int, d_pad: int, cols: int) -> Tensor:
    """The (3, 4·d_pad, cols) bf16 hi / mid / lo planes of hc_fn (`_mhc_fn_split_kernel`), one launch."""
    rows = 4 * d_pad
    w = _empty((3, rows, cols), torch.bfloat16, hc_fn.device)
    block = 32
    _mhc_fn_split_kernel[(triton.cdiv(d_pad, block),)](hc_fn, w, d, rows, hc_fn.stride(0), K_OUT=hc_fn.size(0),
                                                        KP=32, KW=cols, BLOCK_C=block, num_warps=4)
    return w


_PLANES: dict[tuple, tuple[weakref.ref, int, Tensor]] = {}  # (id, address, d, d_pad, cols) → (weight, version, planes)
_PLANES_MAX = 512  # entries before the cache starts afresh (weights made per call would otherwise pile up)


def _fn_planes(hc_fn: Tensor, d: int, d_pad: int, cols: int) -> Tensor:
    """`_split_fn`, once per weight: the planes of an hc_fn that has not changed since its last split are reused
    (serving splits each mHC weight on its first pass instead of every pass: one launch less per pass). A weight
    that needs a gradient is split on every call; an in-place update (its version moves) or another tensor at the
    same address (the weak reference differs) splits again."""
    if hc_fn.requires_grad and torch.is_grad_enabled():
        return _split_fn(hc_fn, d, d_pad, cols)
    key = (id(hc_fn), hc_fn.data_ptr(), d, d_pad, cols)
    hit = _PLANES.get(key)
    if hit is not None and hit[0]() is hc_fn and hit[1] == hc_fn._version:
        return hit[2]
    if len(_PLANES) >= _PLANES_MAX:
        _PLANES.clear()
    planes = _split_fn(hc_fn, d, d_pad, cols)
    _PLANES[key] = (weakref.ref(hc_fn), hc_fn._version, planes)
    return planes


TMA_DEFAULT = True  # `tma=None`: the fused pass loads bf16 h / f through tensor descriptors where `_tma_ready`


def _tma_ready(*ts: Tensor) -> bool:
    """Can these row-major tiles go through TMA: Hopper or newer (or the interpreter), 16-byte aligned bases
    and row strides (the last dim contiguous)?"""
    cap = capability(ts[0])
    if not interpreting() and (cap is None or cap[0] < 9):
        return False
    for t in ts:
        e = t.element_size()
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any((st * e) % 16 for st in t.stride()[:-1]):
            return False
    return True


class Sinkhorn(NamedTuple):
    """The split a pass applies to the mixes it writes (`mhc_post_split`, `mhc_mixes_split`): `mhc_split`'s
    arguments for n = 4 streams."""

    hc_scale: Tensor  # (3,)
    hc_base: Tensor  # ((2+n)·n,)
    iters: int
    eps: float


def _sinkhorn_args(name: str, h: Tensor, hc_scale: Tensor, hc_base: Tensor, hc_mult: int, iters: int,
                   eps: float) -> Sinkhorn:
    n = h.size(2)
    k = (2 + n) * n
    _require(hc_mult == n, f"{name}: hc_mult = {hc_mult} but h has {n} streams")
    _require(tuple(hc_scale.shape) == (3,), f"{name}: hc_scale must be (3,), got {tuple(hc_scale.shape)}")
    _require(tuple(hc_base.shape) == (k,), f"{name}: hc_base must be ({k},), got {tuple(hc_base.shape)}")
    _require(iters >= 0, f"{name}: iters must be ≥ 0, got {iters}")
    for what, t in (("hc_scale", hc_scale), ("hc_base", hc_base)):
        _require(t.is_floating_point() and t.device == h.device,
                 f"{name}: {what} must be a float tensor on {h.device}, got {t.dtype} on {t.device}")
    return Sinkhorn(hc_scale, hc_base, int(iters), float(eps))


def _launch_pass(h: Tensor, f: Tensor | None, post: Tensor | None, comb: Tensor | None, pre: Tensor | None,
                 hc_fn: Tensor | None, norm_eps: float, block_t: int | None = None, block_d: int | None = None,
                 split: int | None = None, precision: str | None = None, num_warps: int | None = None,
                 num_stages: int | None = None, design: str | None = None, prefetch: bool = False,
                 cat: int | None = None, fn_cols: int = 32, tma: bool | None = None, sinkhorn: Sinkhorn | None = None,
                 split_in_pass: bool = False
                 ) -> tuple[Tensor | None, Tensor | None, Tensor | None, tuple[Tensor, Tensor, Tensor] | None]:
    """(h_new, x, mixes, with `sinkhorn` the split of the mixes (pre, post, comb)) — see `mhc_post`. With d split,
    the split is `_mhc_finish_kernel`'s epilogue; an unsplit pass is followed by `_mhc_split_kernel`, or with
    `split_in_pass` splits in its own epilogue (the module docstring's "Sinkhorn epilogue")."""
    B, T, n, d = h.shape
    M, K = B * T, (2 + n) * n
    dev = h.device
    post_pass = f is not None
    out_dtype = f.dtype if post_pass else h.dtype
    h_new = _empty((B, T, n, d), out_dtype, dev) if post_pass else None
    x = _empty((B, T, d), out_dtype, dev) if post_pass else None
    mixes = _empty((B, T, K), torch.float32, dev) if hc_fn is not None else None
    coefs = None
    if sinkhorn is not None:  # pre (B, T, n), post (B, T, n), comb (B, T, n, n) fp32, as `mhc_split`'s
        coefs = tuple(_empty((B, T, *shape), torch.float32, dev) for shape in ((n,), (n,), (n, n)))
    if M == 0:
        return h_new, x, mixes, coefs
    precision = precision or "split"
    _require(precision in PRECISIONS, f"precision must be one of {PRECISIONS}, got {precision!r}")
    _require(design is None or design in DESIGNS, f"design must be one of {DESIGNS}, got {design!r}")

    h2 = h.reshape(M, n, d)
    if h2.stride(2) != 1:
        h2 = h2.contiguous()
    if post_pass:
        f2 = f.reshape(M, d)
        if f2.stride(1) != 1:
            f2 = f2.contiguous()
        post2, comb2, pre2 = (t.reshape(M, -1).contiguous() for t in (post, comb, pre))
    else:
        f2, post2, comb2, pre2 = h2, h2, h2, h2  # unused
    fn = hc_fn if hc_fn is not None else h2
    if hc_fn is not None and fn.stride(1) != 1:
        fn = fn.contiguous()

    # fused (pre-split planes) unless the caller asks otherwise, the projection is not `split`, or it is a
    # decode step (a few tokens: the extra split launch would cost more than it saves)
    if design is None:  # measured on the H200: without hc_fn the legacy pass is faster (0.49 vs 0.80 ms)
        design = "fused" if precision == "split" and M >= FUSED_MIN_TOKENS and hc_fn is not None else "legacy"
    _require(design == "legacy" or precision == "split", f"design 'fused' needs precision 'split', got {precision!r}")
    if design == "fused":  # h / f through TMA where the layout allows it (and the caller does not refuse)
        tma_ok = _tma_ready(h2, f2)
        _require(not tma or tma_ok, "mhc: tma=True needs a Hopper GPU (or the interpreter) and 16-byte aligned "
                 "h / f base addresses and row strides")
        # default only for bf16 streams (the model's): fp32 tiles at the TMA block sizes need more shared
        # memory than an SM has (336 KB at 128 × 32 with the split A operand)
        default = TMA_DEFAULT and h2.element_size() == 2 and f2.element_size() == 2
        explicit_tma = bool(tma)
        tma = tma_ok and (default if tma is None else bool(tma))
    else:
        _require(not tma, "mhc: tma=True needs design 'fused'")
        tma = explicit_tma = False
    dbt, dbd, dnw, dns = DEFAULTS["fused_tma" if tma else "stream" if design == "legacy" and hc_fn is None else design]
    if design == "legacy" and hc_fn is not None and M < FUSED_MIN_TOKENS:
        # a decode batch: 16-token tiles give 4× the programs (H200 sweep 2026-12-04, `small` at 64 tokens:
        # 10.9 µs with 16 × 64 tiles, 13.9 µs with 64 × 64, pass + finish)
        dbt = 16
    block_t, block_d = block_t or dbt, block_d or dbd
    num_warps, num_stages = num_warps or dnw, num_stages or dns
    # the TMA pass holds ~188 KB of shared memory: one resident program per SM, so a tile per SM is enough
    # (16K tokens × d = 5120: 0.578 ms unsplit vs 0.598 split in 3, H200 sweep 2026-11-30)
    bt, bd, split, n_it = _plan(M, d, dev, block_t, block_d, split, per_sm=1 if tma else 2)
    if tma and max(bt, bd) > 256:  # a TMA box is at most 256 elements per dimension
        _require(not explicit_tma, f"mhc: tma=True needs block_t and block_d ≤ 256, got {bt}, {bd}")
        tma = False
    final = split == 1 or hc_fn is None
    in_pass = sinkhorn is not None and final and bool(split_in_pass)
    if final:
        part = sq = h2  # unused
    else:
        part = _empty((split, M, 32), torch.float32, dev)
        sq = _empty((split, M), torch.float32, dev)
    if bt < 64:  # a 16/32-token tile (decode) has too little work for 8 warps
        num_warps = min(num_warps, 4)
    grid = (triton.cdiv(M, bt), split)
    # the split's inputs and outputs (dummies without it); s_mix = K stays a runtime argument (`_sinkhorn_rows`)
    if sinkhorn is not None:
        split_args = (sinkhorn.hc_scale.contiguous(), sinkhorn.hc_base.contiguous(), *coefs)
        split_eps, iters = float(sinkhorn.eps), int(sinkhorn.iters)
    else:
        split_args, split_eps, iters = (h2,) * 5, 0.0, 0
    common = dict(POST=post_pass, HAS_FN=hc_fn is not None, FINAL=final, OUT_BF16=out_dtype == torch.bfloat16,
                  A_BF16=out_dtype == torch.bfloat16, EXACT_CAST=interpreting(), DOT=dot_dtype(),
                  SINKHORN=in_pass, ITERS=iters if in_pass else 0,  # 0 without the epilogue: one compiled variant
                  K_OUT=K, KP=32, BLOCK_T=bt, BLOCK_D=bd, num_warps=num_warps, num_stages=num_stages)
    outs = (h_new if post_pass else h2, x if post_pass else h2, mixes if mixes is not None else h2, part, sq,
            *split_args)
    if design == "fused":
        _require(fn_cols in (24, 32), f"fn_cols must be 24 or 32, got {fn_cols}")
        cat = CAT_DEFAULT[post_pass] if cat is None else cat
        _require(cat in CATS, f"cat must be one of {CATS}, got {cat!r}")
        h_desc = f_desc = h2  # unused unless TMA
        if tma:
            h_desc = TensorDescriptor.from_tensor(h2, [bt, 1, bd])
            f_desc = TensorDescriptor.from_tensor(f2, [bt, bd]) if post_pass else h_desc
        w = _fn_planes(fn, d, split * n_it * bd, fn_cols) if hc_fn is not None else h2
        _mhc_fused_kernel[grid](
            h2, f2, post2, comb2, pre2, w, *outs, h_desc, f_desc, M, d, float(norm_eps), split_eps, K, h2.stride(0),
            h2.stride(1), f2.stride(0), w.stride(0), N_IT=n_it, PREFETCH=bool(prefetch) and not tma, CAT=int(cat),
            TMA=tma, KW=fn_cols, **common)
    else:
        _mhc_pass_kernel[grid](
            h2, f2, post2, comb2, pre2, fn, *outs, M, d, float(norm_eps), split_eps, K, h2.stride(0), h2.stride(1),
            f2.stride(0), fn.stride(0), N_IT=n_it, PRECISION=precision, **common)
    if not final:
        # with the split, the finish program takes the split kernel's tile and warps (`split_launch`): the same
        # layout of the Sinkhorn rounds, so the same sums in the same order (module docstring)
        fb, fw = split_launch(M, dev) if sinkhorn is not None else (64, 4)
        _mhc_finish_kernel[(triton.cdiv(M, fb),)](part, sq, mixes, *split_args, M, d, float(norm_eps), split_eps, K,
                                                  SPLIT=split, K_OUT=K, KP=32, BLOCK_T=fb,
                                                  SINKHORN=sinkhorn is not None, ITERS=iters, num_warps=fw)
    elif sinkhorn is not None and not in_pass:
        _launch_split(mixes.view(M, K), *split_args, M, n, iters, split_eps, *split_launch(M, dev))
    return h_new, x, mixes, coefs


def mhc_post(h: Tensor, f: Tensor, post: Tensor, comb: Tensor, pre: Tensor, hc_fn: Tensor | None, norm_eps: float,
             *, block_t: int | None = None, block_d: int | None = None, split: int | None = None,
             precision: str | None = None, num_warps: int | None = None, num_stages: int | None = None,
             design: str | None = None, prefetch: bool = False, cat: int | None = None, fn_cols: int = 32,
             tma: bool | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """The Mega-mHC pass (see `ops.mhc_post`). Knobs: `design` (``fused`` | ``legacy``; None: fused from
    FUSED_MIN_TOKENS tokens with the ``split`` precision), BLOCK_T tokens × BLOCK_D channels per step,
    `split` d spans per token tile (None: `_plan`'s choice), `precision` of the projection (``split`` |
    ``tf32x3`` | ``ieee``); fused only: `prefetch` the next chunk's tiles into registers, `cat` (`CATS`;
    None: CAT_DEFAULT) how the 4 streams meet the planes, `fn_cols` (24 | 32) columns of the planes
    (32: 64-byte rows, the padding zero — 0.561 vs 0.579 ms for mhc_post, 0.256 vs 0.292 for mhc_mixes at
    16K tokens × d = 5120, H200 sweep 2026-11-30),
    `tma` (h / f through tensor descriptors; None: bf16 streams wherever `_tma_ready` and the blocks are
    ≤ 256; True raises where it cannot). None block sizes / warps / stages take
    `DEFAULTS["fused_tma"]` with TMA, `DEFAULTS["stream"]` for legacy without hc_fn, else
    `DEFAULTS[design]`."""
    _check_post("mhc_post", h, f, post, comb, pre, hc_fn)
    h_new, x, mixes, _ = _launch_pass(h, f, post, comb, pre, hc_fn, norm_eps, block_t, block_d, split, precision,
                                      num_warps, num_stages, design, prefetch, cat, fn_cols, tma)
    return h_new, x, mixes


def _check_post(name: str, h: Tensor, f: Tensor, post: Tensor, comb: Tensor, pre: Tensor, hc_fn: Tensor | None
                ) -> None:
    B, T, n, d = _check_streams(name, h, hc_fn)
    _require(tuple(f.shape) == (B, T, d), f"{name}: f must be {(B, T, d)}, got {tuple(f.shape)}")
    _require(f.dtype in FLOATS, f"{name}: f must be float32 or bfloat16, got {f.dtype}")
    for what, t, shape in (("post", post, (B, T, n)), ("comb", comb, (B, T, n, n)), ("pre", pre, (B, T, n))):
        _require(tuple(t.shape) == shape, f"{name}: {what} must be {shape}, got {tuple(t.shape)}")
        _require(t.is_floating_point(), f"{name}: {what} must be floating point, got {t.dtype}")
    for what, t in (("f", f), ("post", post), ("comb", comb), ("pre", pre)):
        _require(t.device == h.device, f"{name}: {what} is on {t.device}, h on {h.device}")


def mhc_post_split(h: Tensor, f: Tensor, post: Tensor, comb: Tensor, pre: Tensor, hc_fn: Tensor, norm_eps: float,
                   hc_scale: Tensor, hc_base: Tensor, hc_mult: int, iters: int, hc_eps: float, **knobs
                   ) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor, Tensor]]:
    """`mhc_post`, then `mhc_split` of its mixes in the kernel that writes them (see `ops.mhc_post_split`):
    (h_new, x, (pre, post, comb)). `knobs`: `mhc_post`'s, and `split_in_pass` (an unsplit pass splits in its
    own epilogue instead of a split kernel after it: one launch less, ulps from it on a GPU; module docstring)."""
    _require(hc_fn is not None, "mhc_post_split: hc_fn is required")
    _check_post("mhc_post_split", h, f, post, comb, pre, hc_fn)
    sinkhorn = _sinkhorn_args("mhc_post_split", h, hc_scale, hc_base, hc_mult, iters, hc_eps)
    h_new, x, _, coefs = _launch_pass(h, f, post, comb, pre, hc_fn, norm_eps, sinkhorn=sinkhorn, **knobs)
    return h_new, x, coefs


def mhc_mixes(h: Tensor, hc_fn: Tensor, norm_eps: float, *, block_t: int | None = None, block_d: int | None = None,
              split: int | None = None, precision: str | None = None, num_warps: int | None = None,
              num_stages: int | None = None, design: str | None = None, prefetch: bool = False,
              cat: int | None = None, fn_cols: int = 32, tma: bool | None = None) -> Tensor:
    """The coefficient projection of h alone (see `ops.mhc_mixes`): reads h once."""
    _require(hc_fn is not None, "mhc_mixes: hc_fn is required")
    _check_streams("mhc_mixes", h, hc_fn)
    return _launch_pass(h, None, None, None, None, hc_fn, norm_eps, block_t, block_d, split, precision,
                        num_warps, num_stages, design, prefetch, cat, fn_cols, tma)[2]


def mhc_mixes_split(h: Tensor, hc_fn: Tensor, norm_eps: float, hc_scale: Tensor, hc_base: Tensor, hc_mult: int,
                    iters: int, hc_eps: float, **knobs) -> tuple[Tensor, Tensor, Tensor]:
    """`mhc_mixes`, then `mhc_split` in the kernel that writes the mixes (see `ops.mhc_mixes_split`):
    (pre, post, comb). `knobs`: `mhc_mixes`'s and `split_in_pass` (as `mhc_post_split`)."""
    _require(hc_fn is not None, "mhc_mixes_split: hc_fn is required")
    _check_streams("mhc_mixes_split", h, hc_fn)
    sinkhorn = _sinkhorn_args("mhc_mixes_split", h, hc_scale, hc_base, hc_mult, iters, hc_eps)
    return _launch_pass(h, None, None, None, None, hc_fn, norm_eps, sinkhorn=sinkhorn, **knobs)[3]


def mhc_split_backward(mixes: Tensor, hc_scale: Tensor, hc_base: Tensor, g_pre: Tensor | None,
                       g_post: Tensor | None, g_comb: Tensor | None, hc_mult: int, iters: int, eps: float,
                       *, block: int = 32, num_warps: int = 4) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (mixes' (..., K) fp32, hc_scale's (3,), hc_base's (K,)) of the split (see `ops.mhc_split`)
    from those of pre, post and comb (None = zero): one kernel for dL/dz of z = mixes·scale + base, then the
    three small reductions in torch."""
    n = hc_mult
    K = (2 + n) * n
    _require(iters >= 1, f"mhc_split_backward: iters must be ≥ 1, got {iters}")
    _require(mixes.size(-1) == K, f"mhc_split_backward: mixes must be (..., {K}), got {tuple(mixes.shape)}")
    _require(runnable(mixes),
             f"mhc_split_backward: mixes is on {mixes.device}; Triton needs CUDA (or TRITON_INTERPRET=1)")
    lead = mixes.shape[:-1]
    M = mixes[..., 0].numel()
    dev = mixes.device
    m2 = mixes.reshape(M, K)
    if m2.stride(1) != 1:
        m2 = m2.contiguous()

    def grad(t: Tensor | None, shape: tuple[int, ...]) -> Tensor:
        return torch.zeros(shape, dtype=torch.float32, device=dev) if t is None else \
            t.reshape(shape).float().contiguous()

    gz = _empty((M, K), torch.float32, dev)
    if M:
        NP = triton.next_power_of_2(n)
        xs = _empty((M, (2 * int(iters) - 1) * NP * NP), torch.float32, dev)  # each normalization's input
        _mhc_split_bwd_kernel[(triton.cdiv(M, block),)](
            m2, hc_scale.contiguous(), hc_base.contiguous(), grad(g_pre, (M, n)), grad(g_post, (M, n)),
            grad(g_comb, (M, n, n)), gz, xs, M, float(eps), m2.stride(0), ITERS=int(iters), N=n,
            NP=NP, BLOCK=block, num_warps=num_warps)
    segments = (slice(0, n), slice(n, 2 * n), slice(2 * n, K))
    scale = hc_scale.float()
    g_mixes = torch.cat([gz[:, seg] * scale[k] for k, seg in enumerate(segments)], dim=1)
    weighted = gz * m2.float()
    g_scale = torch.stack([weighted[:, seg].sum() for seg in segments])
    return g_mixes.reshape(*lead, K), g_scale.to(hc_scale.dtype), gz.sum(0).to(hc_base.dtype)


def split_launch(M: int, device: torch.device) -> tuple[int, int]:
    """(BLOCK, num_warps) of the Sinkhorn split for M tokens. Each program runs the 2·iters dependent
    normalizations of its tokens, so its time is latency: few tokens per program, one warp. H200 sweep
    (2026-12-04, `benchmarks/sweep.py mhc "mhc_split …"`): M = 64 and M = 1 take 4.0 µs at BLOCK 1–4
    (the former default BLOCK = 64, 4 warps: one program of ~15 µs at M = 64); M = 16,384 is fastest at
    BLOCK 8, 1 warp (9.3 µs; 4: 9.7, 16: 11.4, 64 with 4 warps > 12.6)."""
    return (8 if triton.cdiv(M, 8) >= _programs_wanted(device, 1) else 2), 1


def mhc_split(mixes: Tensor, hc_scale: Tensor, hc_base: Tensor, hc_mult: int, iters: int, eps: float,
              *, block: int | None = None, num_warps: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Sinkhorn split (see `ops.mhc_split`), BLOCK tokens per program (None: `split_launch`)."""
    n = hc_mult
    K = (2 + n) * n
    _require(n >= 1, f"mhc_split: hc_mult must be ≥ 1, got {n}")
    _require(mixes.dim() >= 1 and mixes.size(-1) == K, f"mhc_split: mixes must be (..., {K}), got {tuple(mixes.shape)}")
    _require(mixes.is_floating_point(), f"mhc_split: mixes must be floating point, got {mixes.dtype}")
    _require(tuple(hc_scale.shape) == (3,), f"mhc_split: hc_scale must be (3,), got {tuple(hc_scale.shape)}")
    _require(tuple(hc_base.shape) == (K,), f"mhc_split: hc_base must be ({K},), got {tuple(hc_base.shape)}")
    _require(iters >= 0, f"mhc_split: iters must be ≥ 0, got {iters}")
    for name, t in (("hc_scale", hc_scale), ("hc_base", hc_base)):
        _require(t.device == mixes.device, f"mhc_split: {name} is on {t.device}, mixes on {mixes.device}")
    _require(runnable(mixes), f"mhc_split: mixes is on {mixes.device}; Triton needs CUDA (or TRITON_INTERPRET=1)")
    lead = mixes.shape[:-1]
    M = mixes[..., 0].numel()
    dev = mixes.device
    auto_block, auto_warps = split_launch(M, dev)
    block, num_warps = block or auto_block, num_warps or auto_warps
    _require(block >= 1 and block & (block - 1) == 0, f"mhc_split: block must be a power of two, got {block}")
    pre = _empty((*lead, n), torch.float32, dev)
    post = _empty((*lead, n), torch.float32, dev)
    comb = _empty((*lead, n, n), torch.float32, dev)
    if M == 0:
        return pre, post, comb
    m2 = mixes.reshape(M, K)
    if m2.stride(1) != 1:
        m2 = m2.contiguous()
    _launch_split(m2, hc_scale.contiguous(), hc_base.contiguous(), pre, post, comb, M, n, iters, eps, block, num_warps)
    return pre, post, comb


def _launch_split(m2: Tensor, hc_scale: Tensor, hc_base: Tensor, pre: Tensor, post: Tensor, comb: Tensor, M: int,
                  n: int, iters: int, eps: float, block: int, num_warps: int) -> None:
    """`_mhc_split_kernel` over mixes rows m2 (M, (2+n)·n) (unit column stride) into pre, post, comb."""
    _mhc_split_kernel[(triton.cdiv(M, block),)](
        m2, hc_scale, hc_base, pre, post, comb, M, float(eps), m2.stride(0), ITERS=int(iters), N=n,
        NP=triton.next_power_of_2(n), BLOCK=block, num_warps=num_warps)
