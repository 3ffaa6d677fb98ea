"""Training path of the single-pass mHC hand-over in Triton (SPEC §5, issue 18): `ops.mhc_post` under a gradient.

The eager twin trains through three autograd Functions (`model.mhc._HcPost` → `_HcPre` → `_HcProject`),
dozens of torch ops per hand-over, most of them fp32 copies of the (B, T, 4, d) streams and batched 4 × 4
products (the profile of the 16 × 1024 `small` step: `aten::copy_` 45.9 ms, `aten::mul` 38 ms, `aten::bmm`
24 ms of 260 ms). `MhcPostTrain` is the whole hand-over as one Function:
  * forward = the inference pass (`kernels.triton.mhc.mhc_post`: h_new, x, mixes from one read of h and f);
  * backward = `_mhc_post_bwd_kernel` (one read of h, f, h_new and the incoming gradients, one write of g_h,
    g_f and of the per-token reductions) and `_hc_fn_grad_kernel` + one sum for the weight's gradient.

Formulas, per token (N = n·d, flat = flatten(h_new) of the *rounded* h_new, which x and the projection read):
  h_new_j = post_j·f + Σ_i comb_ij·h_i ;  x = Σ_j pre_j·h_new_j ;  lin = flat @ Wᵀ ;
  r = (mean(flat²) + eps)^(-1/2) ;  mixes = lin·r ;
  G_j, the total gradient of h_new_j = g_h_new_j + pre_j·g_x + (g_lin @ W)_j − s·h_new_j  with
      g_lin = g_mixes·r  and  s = Σ_k g_mixes_k·lin_k·r³ / N = Σ_k g_mixes_k·mixes_k·r² / N ;
  g_h_i = Σ_j comb_ij·G_j ;  g_f = Σ_j post_j·G_j ;  g_post_j = Σ_c G_j·f ;  g_comb_ij = Σ_c G_j·h_i ;
  g_pre_j = Σ_c g_x·h_new_j ;  g_W = Σ_tokens g_linᵀ ⊗ flat.
The roundings of h_new and x pass the gradient straight through, as autograd of the twin's `.to(dtype)` does.
Unlike the twin, G stays fp32 until g_h and g_f are stored: the twin rounds pre_j·g_x and the projection's
gradient to the stream dtype and sums them there (autograd accumulates a bf16 tensor's gradients in bf16).

Saved for the backward: the inputs and the outputs h_new and mixes — tensors alive anyway (h_new is the next
hand-over's h, mixes the Sinkhorn split's saved input). r is recomputed by the backward kernel in a first loop
over d (Σ h_new²: the tile's 4·d values, read again by the second loop, mostly from L2 — a program's tile is
BLOCK_T·4·d·2 = 48 KB at 16 tokens × d = 384, the resident programs' ~19 MB well inside the H100's 50 MB L2).
Saving r instead would need the forward kernel to emit it (it is the inference kernel, unchanged here) or a
separate torch reduction over h_new: another read of it from DRAM (8·d bytes per token) and one more launch.

Traffic per token, bf16 streams (d = 384: `small`): the backward kernel reads h, g_h_new, h_new (4·d each), f,
g_x (d each) and writes g_h (4·d), g_f (d): 19·d·2 = 14.6 KB, + 0.5 KB of coefficients, mixes and reductions
(fp32); the weight's gradient reads h_new again (8·d = 3.1 KB) and g_lin (96 B). 16K tokens: 247 + 52 MB,
~0.10 ms at 3 TB/s (the H100's copy rate; an estimate, not measured).

Registers decide the design (benchmarks/sass.py mhc_train, compiled for sm_90a on the CPU; not yet timed on a
GPU). (g_lin @ W)_j is K = 24 fp32 FMAs per element in a runtime loop over k, g_lin's column and W's row re-read
from L1 at each step: 168 registers at 16 tokens × 64 channels × 4 warps (3 programs per SM), no spills. As a
`tl.dot` (tf32x3) the operand fragments and the MMA layout the compiler spread over the chunk took all 255
registers (spilling at most tile shapes), and unrolled over k (static_range) the hoisted loads did the same. The
24 coefficients are re-read per chunk rather than held, and a chunk runs in phases — the 4 G_j; f's terms; stream
by stream h_i's terms — so that few (BLOCK_T, BLOCK_D) fp32 tiles are live at once; h and f are loaded first, in
their storage dtype, so their latency hides behind the first phase (after the chunk's first store they could not
move up). Issue cost from the SASS: the k loop is 59 instructions per step per thread (32 FFMA, 9 loads; 78 with
masked hc_fn loads, hence EVEN_D), a chunk ~2,390 and the r loop ~140: ~315 per token·channel, ~67 µs of issue at
16K tokens × d = 384 on an H100 (132 SMs × 4 schedulers × 1.755 GHz) beside the ~82 µs of the kernel's traffic
at 3 TB/s — close to each other; an estimate, to be measured.

Precision: the backward kernel is fp32 throughout (FMAs, no dots). g_W multiplies g_lin split into three bf16
pieces (hi + mid + lo = g_lin exactly) with the bf16 h_new — exact products, fp32 accumulation — or a ``tf32x3``
dot for fp32 h_new (`precision`). Partial sums of g_W per token span are added by torch in a fixed order
(deterministic; no atomics). In the interpreter every dot is fp32.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from dsv41.kernels.triton.common import dot_dtype, interpreting, jit_sizes, runnable

HC_MULT = 4  # the kernels are written for n = 4 streams (every preset), as the forward pass is
FLOATS = (torch.float32, torch.bfloat16)
PRECISIONS = ("tf32x3", "ieee")  # of the weight gradient's dot for fp32 h_new (bf16: exact bf16x3)
# BLOCK_T tokens × BLOCK_D channels, warps, stages: not swept on a GPU yet. Compiled for sm_90a on the CPU
# (benchmarks/sass.py mhc_train): 168 registers, no spills; 16 × 32 × 4 warps: 128 (4 programs per SM);
# 16 × 64 × 8 warps: 165; 32 × 64 × 8 warps: 180
BWD_DEFAULTS = (16, 64, 4, 1)
# BLOCK_M tokens × BLOCK_N columns of flatten(h_new), warps (sass.py, sm_90a: 96 registers with bf16 h_new, 194
# with fp32; 64 × 128 took 237 / 255 and spilled with fp32)
GRAD_FN_DEFAULTS = (32, 128, 4)


# --------------------------------------------------------------------------------------------- device code
@triton.jit
def _to_out(x, OUT_BF16: tl.constexpr, EXACT_CAST: tl.constexpr):
    """An fp32 tile → the value its output dtype stores (bf16: nearest, ties to even), in fp32. The interpreter's
    fp32 → bf16 cast truncates, so there (EXACT_CAST) the rounding is integer bit arithmetic, as in the forward."""
    if OUT_BF16 and EXACT_CAST:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x


@triton.jit
def _coef(ptr, rows64, row_ok, STRIDE: tl.constexpr, idx: tl.constexpr):
    """The per-token coefficient ptr[token, idx] as a (BLOCK_T, 1) fp32 column (post (M, 4), comb (M, 4, 4)
    [i, j] at 4·i + j, pre (M, 4), contiguous)."""
    return tl.load(ptr + rows64 * STRIDE + idx, mask=row_ok, other=0.0).to(tl.float32)[:, None]


@triton.jit
def _w_row(at, col_ok, EVEN_D: tl.constexpr):
    """A chunk of one row of hc_fn in fp32; unmasked when BLOCK_D divides D (a masked load first zeroes its
    registers: 16 instructions more per k at 16 × 64 × 4 warps, of 78)."""
    if EVEN_D:
        return tl.load(at).to(tl.float32)
    else:
        return tl.load(at, mask=col_ok, other=0.0).to(tl.float32)


@triton.jit
def _store(ptr, v, ok, OUT_BF16: tl.constexpr, EXACT_CAST: tl.constexpr):
    tl.store(ptr, _to_out(v, OUT_BF16, EXACT_CAST).to(ptr.dtype.element_ty), mask=ok)


@jit_sizes("M")
def _mhc_post_bwd_kernel(h_ptr, f_ptr, hn_ptr, post_ptr, comb_ptr, pre_ptr, fn_ptr, mix_ptr, ghn_ptr, gx_ptr, gm_ptr,
                         gh_ptr, gf_ptr, gpost_ptr, gcomb_ptr, gpre_ptr, glin_ptr, M, D, norm_eps, s_ht, s_hn, s_ft,
                         s_fnk, HAS_GHN: tl.constexpr, HAS_GX: tl.constexpr, HAS_GM: tl.constexpr,
                         GH_BF16: tl.constexpr, GF_BF16: tl.constexpr, EXACT_CAST: tl.constexpr,
                         K_OUT: tl.constexpr, KP: tl.constexpr, N_CHUNKS: tl.constexpr, EVEN_D: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """BLOCK_T tokens per program, all of d in BLOCK_D chunks (the module docstring's formulas). h (M, 4, D) by
    strides, f (M, D) by row stride; h_new, g_h_new, g_h (M, 4, D) and g_x, g_f (M, D) contiguous; mixes, g_mixes,
    g_lin (M, K_OUT), g_post, g_pre (M, 4), g_comb (M, 4, 4) fp32; hc_fn (K_OUT, 4·D) by row stride.
    Absent gradients (HAS_*) are zero. Loop 1 (with g_mixes): r from Σ h_new², then s and g_lin; loop 2: G, the
    outputs and the reductions. Both walk N_CHUNKS = ⌈D / BLOCK_D⌉ chunks (a compile-time count: the interpreter
    cannot loop to a runtime bound)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < M
    rows64 = rows.to(tl.int64)
    cc = tl.arange(0, BLOCK_D)
    kk = tl.arange(0, KP)
    h_row = h_ptr + rows64[:, None] * s_ht
    f_row = f_ptr + rows64[:, None] * s_ft
    n_row = rows64[:, None] * (4 * D)  # h_new, g_h_new, g_h
    x_row = rows64[:, None] * D  # g_x, g_f

    k_ok = row_ok[:, None] & (kk < K_OUT)[None, :]
    at = rows64[:, None] * K_OUT + kk[None, :]
    r = tl.zeros((BLOCK_T,), dtype=tl.float32)
    s = tl.zeros((BLOCK_T, 1), dtype=tl.float32)
    if HAS_GM:
        sq = tl.zeros((BLOCK_T,), dtype=tl.float32)
        for it in range(N_CHUNKS):
            col = it * BLOCK_D + cc
            ok = row_ok[:, None] & (col < D)[None, :]
            for j in tl.static_range(4):
                v = tl.load(hn_ptr + n_row + j * D + col[None, :], mask=ok, other=0.0).to(tl.float32)
                sq += tl.sum(v * v, axis=1)
        r = tl.math.rsqrt(sq / (4 * D) + norm_eps)
        gm = tl.load(gm_ptr + at, mask=k_ok, other=0.0).to(tl.float32)
        mixes = tl.load(mix_ptr + at, mask=k_ok, other=0.0)
        s = (tl.sum(gm * mixes, axis=1) * (r * r) / (4 * D))[:, None]  # Σ g·lin·r³ / N with lin = mixes / r
        tl.store(glin_ptr + at, gm * r[:, None], mask=k_ok)

    # Per chunk, in three phases that keep few (BLOCK_T, BLOCK_D) tiles live (the module docstring: registers):
    # G_j for the 4 streams; f's terms; then stream by stream h_i's terms. acc holds the per-token reductions, by
    # stream j: acc[6·j] = g_post_j, acc[6·j + 1 + i] = g_comb_ij, acc[6·j + 5] = g_pre_j.
    acc = (tl.zeros((BLOCK_T,), dtype=tl.float32),) * 24
    for it in range(N_CHUNKS):
        col = it * BLOCK_D + cc
        col_ok = col < D
        ok = row_ok[:, None] & col_ok[None, :]
        # the chunk's inputs that phases 2 and 3 read, issued first (in their storage dtype: half the registers
        # for bf16), so that their latency hides behind phase 1; after the chunk's first store they could not move
        h_in = ()
        for i in tl.static_range(4):
            h_in = h_in + (tl.load(h_row + i * s_hn + col[None, :], mask=ok, other=0.0),)
        f_in = tl.load(f_row + col[None, :], mask=ok, other=0.0)
        gx = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
        if HAS_GX:
            gx = tl.load(gx_ptr + x_row + col[None, :], mask=ok, other=0.0).to(tl.float32)
        G = (tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32),) * 4
        if HAS_GM:  # (g_lin @ W)_j: K_OUT fp32 FMAs per element, a runtime loop (module docstring: registers)
            for k in range(K_OUT):
                g_lin = tl.load(gm_ptr + rows64 * K_OUT + k, mask=row_ok, other=0.0)[:, None] * r[:, None]
                w_at = fn_ptr + k * s_fnk + col
                G = (G[0] + g_lin * _w_row(w_at, col_ok, EVEN_D)[None, :],
                     G[1] + g_lin * _w_row(w_at + D, col_ok, EVEN_D)[None, :],
                     G[2] + g_lin * _w_row(w_at + 2 * D, col_ok, EVEN_D)[None, :],
                     G[3] + g_lin * _w_row(w_at + 3 * D, col_ok, EVEN_D)[None, :])
        total = ()
        g_pre = ()
        for j in tl.static_range(4):
            g = G[j]
            if HAS_GHN:
                g += tl.load(ghn_ptr + n_row + j * D + col[None, :], mask=ok, other=0.0).to(tl.float32)
            red = acc[6 * j + 5]
            if HAS_GX or HAS_GM:
                hn = tl.load(hn_ptr + n_row + j * D + col[None, :], mask=ok, other=0.0).to(tl.float32)
                if HAS_GX:
                    g += _coef(pre_ptr, rows64, row_ok, 4, j) * gx
                    red += tl.sum(gx * hn, axis=1)
                if HAS_GM:  # the RMS's term
                    g -= s * hn
            total = total + (g,)
            g_pre = g_pre + (red,)
        G = total
        fv = f_in.to(tl.float32)
        gf = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
        g_post = ()
        for j in tl.static_range(4):
            gf += _coef(post_ptr, rows64, row_ok, 4, j) * G[j]
            g_post = g_post + (acc[6 * j] + tl.sum(G[j] * fv, axis=1),)
        _store(gf_ptr + x_row + col[None, :], gf, ok, GF_BF16, EXACT_CAST)
        g_comb = ()
        for i in tl.static_range(4):
            hi = h_in[i].to(tl.float32)
            gh = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
            for j in tl.static_range(4):
                gh += _coef(comb_ptr, rows64, row_ok, 16, 4 * i + j) * G[j]
                g_comb = g_comb + (acc[6 * j + 1 + i] + tl.sum(G[j] * hi, axis=1),)
            _store(gh_ptr + n_row + i * D + col[None, :], gh, ok, GH_BF16, EXACT_CAST)
        new = ()
        for j in tl.static_range(4):  # back into acc's order (g_comb is by i, then j)
            new = new + (g_post[j], g_comb[j], g_comb[4 + j], g_comb[8 + j], g_comb[12 + j], g_pre[j])
        acc = new

    for j in tl.static_range(4):
        tl.store(gpost_ptr + rows64 * 4 + j, acc[6 * j], mask=row_ok)
        for i in tl.static_range(4):
            tl.store(gcomb_ptr + rows64 * 16 + 4 * i + j, acc[6 * j + 1 + i], mask=row_ok)
        tl.store(gpre_ptr + rows64 * 4 + j, acc[6 * j + 5], mask=row_ok)


@jit_sizes("M")
def _hc_fn_grad_kernel(hn_ptr, glin_ptr, part_ptr, M, N4, HN_BF16: tl.constexpr, PRECISION: tl.constexpr,
                       DOT: tl.constexpr, K_OUT: tl.constexpr, KP: tl.constexpr, STEPS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """part[s, k, c] = Σ_{t in span s} g_lin[t, k]·flat[t, c] for the BLOCK_N columns c of program_id(0) and the
    STEPS·BLOCK_M tokens of span s = program_id(1) (a compile-time count, as in the backward kernel; the last
    span's tiles past M are masked). flat = h_new (M, N4) contiguous, g_lin (M, K_OUT) fp32."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N4
    kk = tl.arange(0, KP)
    k_ok = kk < K_OUT
    tt = tl.arange(0, BLOCK_M)
    start = tl.program_id(1) * (STEPS * BLOCK_M)
    acc = tl.zeros((KP, BLOCK_N), dtype=tl.float32)
    for it in range(STEPS):
        t = start + it * BLOCK_M + tt
        t_ok = t < M
        t64 = t.to(tl.int64)
        g = tl.load(glin_ptr + t64[None, :] * K_OUT + kk[:, None], mask=k_ok[:, None] & t_ok[None, :], other=0.0)
        b = tl.load(hn_ptr + t64[:, None] * N4 + n[None, :], mask=t_ok[:, None] & n_ok[None, :], other=0.0)
        if HN_BF16:  # g_lin in three exact bf16 pieces against the exact bf16 stream: fp32-accurate products
            g_hi = g.to(tl.bfloat16)
            rg = g - g_hi.to(tl.float32)
            g_mid = rg.to(tl.bfloat16)
            g_lo = (rg - g_mid.to(tl.float32)).to(tl.bfloat16)
            b = b.to(DOT)
            acc = tl.dot(g_lo.to(DOT), b, acc)
            acc = tl.dot(g_mid.to(DOT), b, acc)
            acc = tl.dot(g_hi.to(DOT), b, acc)
        else:
            acc = tl.dot(g, b.to(tl.float32), acc, input_precision=PRECISION)
    out = part_ptr + tl.program_id(1).to(tl.int64) * K_OUT * N4 + kk[:, None] * N4 + n[None, :]
    tl.store(out, acc, mask=k_ok[:, None] & n_ok[None, :])


# --------------------------------------------------------------------------------------------- launchers
@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _programs_wanted(device: torch.device) -> int:
    """Two programs per SM (8 in the interpreter, so tests reach several token spans)."""
    if device.type != "cuda":
        return 8
    return 2 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Every output and workspace comes from here (tests poison it to prove each element is written)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _block(value: int, size: int, knob: str) -> int:
    _require(value >= 16 and value & (value - 1) == 0, f"{knob} must be a power of two ≥ 16, got {value}")
    return max(16, min(value, triton.next_power_of_2(size)))


def _rows(t: Tensor, M: int, width: int) -> Tensor:
    """t as contiguous (M, width) rows (a copy only when it is not already laid out so)."""
    return t.reshape(M, width).contiguous()


def mhc_post_backward(h: Tensor, f: Tensor, post: Tensor, comb: Tensor, pre: Tensor, hc_fn: Tensor | None,
                      h_new: Tensor, mixes: Tensor | None, g_h_new: Tensor | None, g_x: Tensor | None,
                      g_mixes: Tensor | None, norm_eps: float, *, block_t: int | None = None,
                      block_d: int | None = None, num_warps: int | None = None, num_stages: int | None = None
                      ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """Gradients of `ops.mhc_post` (the module docstring's formulas) from those of h_new (B, T, 4, d), x (B, T, d)
    and mixes (B, T, 24) (None = zero; g_mixes needs hc_fn and the forward's mixes). Returns g_h (h's dtype),
    g_f (f's dtype), g_post (B, T, 4), g_comb (B, T, 4, 4), g_pre (B, T, 4) fp32 and g_lin = g_mixes·r
    (B, T, 24) fp32 (None without g_mixes), for `hc_fn_grad`. One kernel; knobs as BWD_DEFAULTS."""
    _require(h.dim() == 4 and h.size(2) == HC_MULT, f"mhc_post_backward: h must be (B, T, {HC_MULT}, d), "
             f"got {tuple(h.shape)}")
    B, T, n, d = h.shape
    M, K = B * T, (2 + n) * n
    _require(h.dtype in FLOATS and f.dtype in FLOATS and h_new.dtype in FLOATS,
             f"mhc_post_backward: h, f, h_new must be float32 or bfloat16, got {h.dtype}, {f.dtype}, {h_new.dtype}")
    _require(tuple(f.shape) == (B, T, d) and tuple(h_new.shape) == (B, T, n, d),
             f"mhc_post_backward: f must be {(B, T, d)} and h_new {(B, T, n, d)}, got {tuple(f.shape)}, "
             f"{tuple(h_new.shape)}")
    _require(runnable(h), f"mhc_post_backward: h is on {h.device}; Triton needs CUDA (or TRITON_INTERPRET=1)")
    has_gm = g_mixes is not None
    _require(not has_gm or (hc_fn is not None and mixes is not None),
             "mhc_post_backward: g_mixes needs hc_fn and the forward's mixes")
    dev = h.device
    g_h = _empty((B, T, n, d), h.dtype, dev)
    g_f = _empty((B, T, d), f.dtype, dev)
    g_post = _empty((B, T, n), torch.float32, dev)
    g_comb = _empty((B, T, n, n), torch.float32, dev)
    g_pre = _empty((B, T, n), torch.float32, dev)
    g_lin = _empty((B, T, K), torch.float32, dev) if has_gm else None
    if M == 0:
        return g_h, g_f, g_post, g_comb, g_pre, g_lin
    h2 = h.reshape(M, n, d)
    if h2.stride(2) != 1:
        h2 = h2.contiguous()
    f2 = f.reshape(M, d)
    if f2.stride(1) != 1:
        f2 = f2.contiguous()
    post2, comb2, pre2 = (t.reshape(M, -1).float().contiguous() for t in (post, comb, pre))
    hn2 = _rows(h_new, M, n * d)
    ghn = _rows(g_h_new, M, n * d) if g_h_new is not None else hn2  # unused when absent
    gx = _rows(g_x, M, d) if g_x is not None else f2
    if has_gm:
        fn = hc_fn if hc_fn.stride(1) == 1 else hc_fn.contiguous()
        _require(tuple(fn.shape) == (K, n * d), f"mhc_post_backward: hc_fn must be {(K, n * d)}, got {tuple(fn.shape)}")
        mix2, gm2 = _rows(mixes.float(), M, K), _rows(g_mixes.float(), M, K)
        glin2 = g_lin
    else:
        fn, mix2, gm2, glin2 = post2, post2, post2, post2  # unused
    dbt, dbd, dnw, dns = BWD_DEFAULTS
    bt, bd = _block(block_t or dbt, M, "block_t"), _block(block_d or dbd, d, "block_d")
    _mhc_post_bwd_kernel[(triton.cdiv(M, bt),)](
        h2, f2, hn2, post2, comb2, pre2, fn, mix2, ghn, gx, gm2, g_h, g_f, g_post, g_comb, g_pre, glin2,
        M, d, float(norm_eps), h2.stride(0), h2.stride(1), f2.stride(0), fn.stride(0),
        HAS_GHN=g_h_new is not None, HAS_GX=g_x is not None, HAS_GM=has_gm, GH_BF16=h.dtype == torch.bfloat16,
        GF_BF16=f.dtype == torch.bfloat16, EXACT_CAST=interpreting(), K_OUT=K, KP=32, N_CHUNKS=triton.cdiv(d, bd),
        EVEN_D=d % bd == 0, BLOCK_T=bt, BLOCK_D=bd, num_warps=num_warps or dnw, num_stages=num_stages or dns)
    return g_h, g_f, g_post, g_comb, g_pre, g_lin


def hc_fn_grad(h_new: Tensor, g_lin: Tensor, *, block_m: int | None = None, block_n: int | None = None,
               split: int | None = None, num_warps: int | None = None, precision: str = "tf32x3") -> Tensor:
    """g_W = g_linᵀ @ flatten(h_new): (K, n·d) fp32 from h_new (B, T, n, d) and g_lin (B, T, K) fp32. The tokens
    are cut into `split` spans (None: enough for two programs per SM), each span's partial written once, and the
    partials summed by torch in span order (deterministic). One kernel + one sum."""
    _require(precision in PRECISIONS, f"precision must be one of {PRECISIONS}, got {precision!r}")
    K = g_lin.size(-1)
    N4 = h_new.size(-2) * h_new.size(-1)
    M = g_lin[..., 0].numel()
    dev = h_new.device
    if M == 0:
        return torch.zeros((K, N4), dtype=torch.float32, device=dev)
    _require(K <= 32, f"hc_fn_grad: at most 32 mixes per token, got {K}")
    dbm, dbn, dnw = GRAD_FN_DEFAULTS
    bm, bn = _block(block_m or dbm, M, "block_m"), _block(block_n or dbn, N4, "block_n")
    n_tiles = triton.cdiv(N4, bn)
    if split is None:
        split = max(1, min(triton.cdiv(M, bm), triton.cdiv(_programs_wanted(dev), n_tiles)))
    _require(split >= 1, f"split must be ≥ 1, got {split}")
    rows = triton.cdiv(triton.cdiv(M, split), bm) * bm  # tokens per span, whole BLOCK_M tiles
    split = triton.cdiv(M, rows)
    part = _empty((split, K, N4), torch.float32, dev)
    _hc_fn_grad_kernel[(n_tiles, split)](
        _rows(h_new, M, N4), _rows(g_lin.float(), M, K), part, M, N4, HN_BF16=h_new.dtype == torch.bfloat16,
        PRECISION=precision, DOT=dot_dtype(), K_OUT=K, KP=32, STEPS=rows // bm, BLOCK_M=bm, BLOCK_N=bn,
        num_warps=num_warps or dnw)
    return part[0] if split == 1 else part.sum(0)


# --------------------------------------------------------------------------------------------- autograd
class MhcPostTrain(torch.autograd.Function):
    """`ops.mhc_post` with a gradient: the inference pass forward, `mhc_post_backward` + `hc_fn_grad` backward.
    Saves the inputs and the outputs h_new and mixes (no copies; see the module docstring)."""

    @staticmethod
    def forward(ctx, h: Tensor, f: Tensor, post: Tensor, comb: Tensor, pre: Tensor, hc_fn: Tensor | None,
                norm_eps: float):
        from dsv41.kernels.triton import mhc as triton_mhc

        # grad mode is off inside a Function's forward; the launcher reads it to decide whether hc_fn's bf16 planes
        # may be cached per weight version (`mhc._fn_planes`: not for a weight that needs a gradient — it changes
        # every step, and sharded training re-allocates it, which would fill the cache with stale planes). The
        # launcher's reshapes of the inputs are the only ops it records; they die with the call.
        with torch.enable_grad():
            h_new, x, mixes = triton_mhc.mhc_post(h, f, post, comb, pre, hc_fn, norm_eps)
        ctx.set_materialize_grads(False)  # an unused output (x in classic mode) arrives as None, not zeros
        ctx.save_for_backward(h, f, post, comb, pre, hc_fn, h_new, mixes)
        ctx.norm_eps = norm_eps
        return h_new, x, mixes

    @staticmethod
    def backward(ctx, g_h_new: Tensor | None, g_x: Tensor | None, g_mixes: Tensor | None):
        h, f, post, comb, pre, hc_fn, h_new, mixes = ctx.saved_tensors
        need = ctx.needs_input_grad
        g_h, g_f, g_post, g_comb, g_pre, g_lin = mhc_post_backward(
            h, f, post, comb, pre, hc_fn, h_new, mixes, g_h_new, g_x, g_mixes if hc_fn is not None else None,
            ctx.norm_eps)
        g_fn = hc_fn_grad(h_new, g_lin).to(hc_fn.dtype) if need[5] and g_lin is not None else None
        return (g_h if need[0] else None, g_f if need[1] else None, g_post.to(post.dtype) if need[2] else None,
                g_comb.to(comb.dtype) if need[3] else None, g_pre.to(pre.dtype) if need[4] else None, g_fn, None)


def mhc_post_train(h: Tensor, f: Tensor, post: Tensor, comb: Tensor, pre: Tensor, hc_fn: Tensor | None,
                   norm_eps: float) -> tuple[Tensor, Tensor, Tensor | None]:
    """`ops.mhc_post` (same contract) through `MhcPostTrain`: autograd-capable, Triton forward and backward."""
    return MhcPostTrain.apply(h, f, post, comb, pre, hc_fn, norm_eps)
