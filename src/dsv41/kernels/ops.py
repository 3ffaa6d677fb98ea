"""The kernel boundary: every fused operation the model and engine use, dispatched per call.

Each op has a torch twin in `dsv41.kernels.ref` (the executable spec, any device, autograd-safe)
and a Triton implementation in `dsv41.kernels.triton` (Hopper). Dispatch:

* ``auto`` (default) — Triton when Triton is importable, every tensor argument is on CUDA and no
  argument needs a gradient; the twin otherwise (CPU, training).
* ``triton`` — always Triton (on CPU tensors this needs ``TRITON_INTERPRET=1``; tests use it).
* ``torch`` — always the twin.

Choose with the ``DSV41_KERNELS`` environment variable or, scoped, ``with use_backend("torch"):``
(a context variable: per thread / task, never a module global the model depends on).

Storage formats read and written here (SPEC §1a, §4), one uint8 row per token or entry:
  * window KV: ``D`` E4M3 bytes then ``D/32`` E8M0 scale bytes (528 B for D = 512);
  * main KV entry: ``D/2`` packed E2M1 bytes (element 2i in the low nibble) then ``D/16`` E4M3
    scale bytes (288 B);
  * index key: ``Di/2`` packed E2M1 bytes then ``Di/32`` E8M0 scale bytes (68 B for Di = 128).
Entries live in a paged pool shared by the sequences of one engine: entry ``e`` of sequence ``b``
is row ``page_table[b, e // page_rows] * page_rows + e % page_rows`` of the pool.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import Tensor

BACKENDS = ("auto", "triton", "torch")

try:  # Triton is optional: CPU-only installs run the twins
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the install
    HAVE_TRITON = False


def _initial_backend() -> str:
    name = os.environ.get("DSV41_KERNELS", "auto")
    if name not in BACKENDS:
        raise ValueError(f"DSV41_KERNELS must be one of {BACKENDS}, got {name!r}")
    return name


_DEFAULT_BACKEND = _initial_backend()
_backend: ContextVar[str] = ContextVar("dsv41_kernels_backend", default=_DEFAULT_BACKEND)


@contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Force ``auto`` / ``triton`` / ``torch`` inside the block (this thread / task only)."""
    if name not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {BACKENDS}, got {name!r}")
    token = _backend.set(name)
    try:
        yield
    finally:
        _backend.reset(token)


def backend() -> str:
    return _backend.get()


def _forced() -> bool | None:
    """True / False when the backend is forced to Triton / torch, None for ``auto``."""
    choice = _backend.get()
    if choice == "torch":
        return False
    if choice == "triton":
        if not HAVE_TRITON:
            raise RuntimeError("kernel backend 'triton' was forced but Triton is not installed")
        return True
    return None


def needs_grad(*tensors: Tensor | None) -> bool:
    """A gradient will be taken through a call on these tensors (grad mode on, one of them requires it):
    `auto` keeps such calls on the twins, and the twins' training Functions switch on it."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _use_triton(*tensors: Tensor | None) -> bool:
    """An inference kernel runs: forced, or `auto` with every tensor on CUDA — and never under a gradient, forced
    or not (these kernels have no backward: their output would cut the graph and leave the inputs' gradients
    silently missing; the ops with training kernels choose those in `_training_kernel`)."""
    forced = _forced()
    present = [t for t in tensors if t is not None]
    if needs_grad(*present):
        return False
    if forced is not None:
        return forced
    if not HAVE_TRITON or not present or not all(t.is_cuda for t in present):
        return False
    return True


def _impl(family: str, name: str, *tensors: Tensor | None, supported: bool = True):
    """The function `name` of kernels.triton.<family> or kernels.ref.<family>; `supported=False`
    (a dtype the kernel does not take) keeps `auto` on the twin. Under `torch.compile` always the twin
    (plain torch ops the compiler can trace and fuse; no context variable, no dynamic import)."""
    if torch.compiler.is_compiling():
        return getattr(_ref_module(family), name)
    use = _use_triton(*tensors) and (supported or _backend.get() == "triton")
    package = "triton" if use else "ref"
    return getattr(importlib.import_module(f"dsv41.kernels.{package}.{family}"), name)


def _ref_module(family: str):
    """The twins' module by static import (what dynamo can trace)."""
    if family == "attention":
        from dsv41.kernels.ref import attention as module
    elif family == "indexer":
        from dsv41.kernels.ref import indexer as module
    elif family == "mhc":
        from dsv41.kernels.ref import mhc as module
    elif family == "cache_write":
        from dsv41.kernels.ref import cache_write as module
    elif family == "norm":
        from dsv41.kernels.ref import norm as module
    elif family == "swiglu":
        from dsv41.kernels.ref import swiglu as module
    elif family == "router":
        from dsv41.kernels.ref import router as module
    elif family == "engram":
        from dsv41.kernels.ref import engram as module
    elif family == "markov":
        from dsv41.kernels.ref import markov as module
    else:
        raise ValueError(f"no kernel family {family!r}")
    return module


# ---------------------------------------------------------------------------------------------
# Sparse attention (SPEC §3): one softmax over window keys ∪ selected compressed entries + sink.


def sparse_attention(q: Tensor, q_pos: Tensor, sink: Tensor, scale: float, window: int, *,
                     ring_kv: Tensor | None = None, ring_pos: Tensor | None = None, ring_ids: Tensor | None = None,
                     chunk_kv: Tensor | None = None, window_start: Tensor | None = None,
                     entry_pool: Tensor | None = None, page_table: Tensor | None = None, page_rows: int = 0,
                     topk: Tensor | None = None) -> Tensor:
    """MQA over the latent: keys = values = window KV (FP8) ∪ the top-k entries (packed FP4).

    q (B, T, H, D) at absolute positions q_pos (B, T). Window keys come from two places:
      * ring_kv (S, W, D + D/32) rows with positions ring_pos (S, W) (−1 = empty); sequence b reads
        ring slot ring_ids[b];
      * chunk_kv (B, T, D + D/32): this call's own new keys, at positions q_pos (prefill chunks).
    A window key at position p is visible to a query at position t iff
    ``max(0, window_start[b]) <= p <= t`` and ``p > t - window``. q_pos must increase by one along
    T (consecutive tokens, as the engine runs them): the kernel scans only each query's band of the
    chunk, and with a chunk the ring must hold positions before q_pos[b, 0] (the engine writes a
    chunk's keys into the ring after the call): queries t >= window − 1 skip the ring.
    Entries: topk (B, T, K) entry indices (−1 = none) into the paged `entry_pool` rows
    (D/2 + D/16 bytes). sink (H,) only adds exp(sink) to the denominator. Softmax in fp32;
    returns (B, T, H, D) in q's dtype (a query with no visible key returns zeros).
    """
    fn = _impl("attention", "sparse_attention", q, ring_kv, chunk_kv, entry_pool, topk)
    return fn(q, q_pos, sink, scale, window, ring_kv=ring_kv, ring_pos=ring_pos, ring_ids=ring_ids,
              chunk_kv=chunk_kv, window_start=window_start, entry_pool=entry_pool, page_table=page_table,
              page_rows=page_rows, topk=topk)


# ---------------------------------------------------------------------------------------------
# Lightning indexer (SPEC §3): FP4 queries × FP4 keys, ReLU, per-head weights; top-k; blocks.


def indexer_scores(q: Tensor, weights: Tensor, key_pool: Tensor, page_table: Tensor, page_rows: int,
                   n_keys: Tensor, visible_end: Tensor, n_max: int, block_size: int = 0
                   ) -> tuple[Tensor, Tensor | None]:
    """score[b, t, e] = Σ_h weights[b, t, h] · relu(q[b, t, h] · key_e) over every key of the pool.

    q (B, T, Hi, Di) holds FP4-fake-quantized values (exact in bf16); weights (B, T, Hi) fp32;
    key_pool rows (Di/2 + Di/32) paged as the entries; key e of sequence b is visible to query t iff
    e < min(visible_end[b, t], n_keys[b]). Returns (scores (B, T, n_max) fp32 with −inf where not
    visible, block_max (B, T, ceil(n_max / block_size)) fp32 max of each block's scores, or None when
    block_size is 0).
    """
    fn = _impl("indexer", "indexer_scores", q, key_pool)
    return fn(q, weights, key_pool, page_table, page_rows, n_keys, visible_end, n_max, block_size)


def indexer_scores_blocks(q: Tensor, weights: Tensor, key_pool: Tensor, page_table: Tensor, page_rows: int,
                          n_keys: Tensor, visible_end: Tensor, blocks: Tensor, block_size: int) -> Tensor:
    """Scores inside selected blocks only (Reindex layers): blocks (B, T, nb) block ids (−1 = none).

    Returns (B, T, nb · block_size) fp32: column j scores entry blocks[.., j // bs]·bs + j % bs,
    −inf where the block is −1 or the entry is not visible (as in `indexer_scores`).
    """
    fn = _impl("indexer", "indexer_scores_blocks", q, key_pool)
    return fn(q, weights, key_pool, page_table, page_rows, n_keys, visible_end, blocks, block_size)


def topk_indices(scores: Tensor, k: int, ids: Tensor | None = None) -> Tensor:
    """The k best columns of scores (B, T, N) per row, ties broken towards the lower column.

    Returns (B, T, k) int64: the picked columns in ascending order (or ids[..., column] of them when
    `ids` (B, T, N) is given — ascending when ids ascend along N, as the engine's do), picks whose
    score is −inf replaced by −1 and moved to the end; k > N pads with −1. Equals
    `model.attention.select_topk`.
    """
    fn = _impl("indexer", "topk_indices", scores)
    return fn(scores, k, ids)


def select_blocks(block_max: Tensor, newest: Tensor, k_blocks: int) -> Tensor:
    """Candidate blocks (level one of the hierarchical indexer): the block holding the query's
    newest visible entry (newest (B, T), −1 = none) is pinned, then the best blocks by block_max
    (B, T, nb) (ties → lower block). Returns (B, T, k_blocks) int64 ascending block ids, −1 padded;
    blocks whose max is −inf are never picked unless pinned."""
    nb = block_max.size(-1)
    pin = torch.arange(nb, device=block_max.device) == newest.unsqueeze(-1)
    return topk_indices(block_max.masked_fill(pin, float("inf")), k_blocks)


# ---------------------------------------------------------------------------------------------
# Single-pass mHC (SPEC §5): one pass over the streams after a sublayer.

_MHC_FLOATS = {torch.float32, torch.bfloat16}  # what the Triton kernels take (fp16 runs the twin)
_FLOATS = _MHC_FLOATS | {torch.float16}  # what the elementwise kernels (RoPE, RMSNorm, SwiGLU, router, ...) take


def mhc_post(h: Tensor, f: Tensor, post: Tensor, comb: Tensor, pre: Tensor, hc_fn: Tensor | None,
             norm_eps: float) -> tuple[Tensor, Tensor, Tensor | None]:
    """Residual update, input mixing and the next coefficient projection, reading h once.

    h (B, T, n, d), f (B, T, d) the sublayer output, post (B, T, n), comb (B, T, n, n), pre (B, T, n)
    fp32 (the pre-mix the *next* sublayer uses), hc_fn ((2+n)·n, n·d) fp32 or None. Returns
      h_new = post_j·f + Σ_i comb_ij·h_i  (B, T, n, d) in f's dtype (fp32 math, one rounding),
      x     = Σ_j pre_j·h_new_j          (B, T, d) in f's dtype,
      mixes = (flatten(h_new) @ hc_fnᵀ)·rsqrt(mean(flatten(h_new)²) + norm_eps)  (B, T, (2+n)·n)
              fp32 from the rounded h_new, or None when hc_fn is None.
    Under a gradient where `_mhc_post_trains_on_triton` (forced, or CUDA unless DSV41_TRITON_MHC_BACKWARD=0) it
    trains through `kernels.triton.mhc_train.MhcPostTrain`: this pass forward, one backward kernel (+ the weight's
    gradient), where the twin runs its three autograd Functions (`model.mhc`).
    """
    if needs_grad(h, f, post, comb, pre, hc_fn) and not torch.compiler.is_compiling() \
            and _mhc_post_trains_on_triton(h, f, hc_fn):
        train = importlib.import_module("dsv41.kernels.triton.mhc_train").mhc_post_train
        return train(h, f, post, comb, pre, hc_fn, norm_eps)
    fn = _impl("mhc", "mhc_post", h, f, post, comb, pre, hc_fn, supported=_MHC_FLOATS.issuperset((h.dtype, f.dtype)))
    return fn(h, f, post, comb, pre, hc_fn, norm_eps)


def mhc_mixes(h: Tensor, hc_fn: Tensor, norm_eps: float) -> Tensor:
    """The coefficient projection alone: (flatten(h) @ hc_fnᵀ)·rsqrt(mean(flatten(h)²) + eps), fp32."""
    return _impl("mhc", "mhc_mixes", h, hc_fn, supported=h.dtype in _MHC_FLOATS)(h, hc_fn, norm_eps)


def mhc_post_split(h: Tensor, f: Tensor, post: Tensor, comb: Tensor, pre: Tensor, hc_fn: Tensor, norm_eps: float,
                   hc_scale: Tensor, hc_base: Tensor, hc_mult: int, iters: int, hc_eps: float
                   ) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor, Tensor]]:
    """`mhc_post`, then `mhc_split` of its mixes with (hc_scale, hc_base): (h_new, x, (pre', post', comb')) — the
    next sublayer's coefficients instead of its mixes (twin: `ref.mhc.mhc_post_split`, the composition).

    On the Triton inference path (`_split_fuses`), whenever the pass splits d (up to 8,320 tokens on 132 SMs:
    decode, the bounded replay, prefill chunks) the split is the epilogue of its finish kernel, which writes
    the mixes: one launch less per hand-over (2 per layer: 24 per decode step of the 12-layer `small`), the
    separate kernels' results bit for bit; a longer, unsplit pass is followed by the split kernel as before
    (`kernels/triton/mhc.py`, "Sinkhorn epilogue"). Elsewhere (a gradient, torch.compile, the twins) it is
    the two ops, training paths included."""
    tensors = (h, f, post, comb, pre, hc_fn, hc_scale, hc_base)
    if _split_fuses(tensors, supported=_MHC_FLOATS.issuperset((h.dtype, f.dtype))):
        fused = importlib.import_module("dsv41.kernels.triton.mhc").mhc_post_split
        return fused(h, f, post, comb, pre, hc_fn, norm_eps, hc_scale, hc_base, hc_mult, iters, hc_eps)
    h_new, x, mixes = mhc_post(h, f, post, comb, pre, hc_fn, norm_eps)
    return h_new, x, mhc_split(mixes, hc_scale, hc_base, hc_mult, iters, hc_eps)


def mhc_mixes_split(h: Tensor, hc_fn: Tensor, norm_eps: float, hc_scale: Tensor, hc_base: Tensor, hc_mult: int,
                    iters: int, hc_eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """`mhc_mixes`, then `mhc_split`: the coefficients (pre, post, comb) of the streams h, with the split in the
    projection's kernel on the Triton inference path (as `mhc_post_split`; twin `ref.mhc.mhc_mixes_split`)."""
    if _split_fuses((h, hc_fn, hc_scale, hc_base), supported=h.dtype in _MHC_FLOATS):
        fused = importlib.import_module("dsv41.kernels.triton.mhc").mhc_mixes_split
        return fused(h, hc_fn, norm_eps, hc_scale, hc_base, hc_mult, iters, hc_eps)
    return mhc_split(mhc_mixes(h, hc_fn, norm_eps), hc_scale, hc_base, hc_mult, iters, hc_eps)


def _split_fuses(tensors: tuple[Tensor, ...], supported: bool) -> bool:
    """Does the Sinkhorn split ride in the kernel that writes the mixes: where `_impl` picks the Triton kernels
    and no gradient is taken? (A gradient keeps the composition: its ops have their own training paths.)"""
    if torch.compiler.is_compiling() or needs_grad(*tensors):
        return False
    return _use_triton(*tensors) and (supported or _backend.get() == "triton")


def mhc_split(mixes: Tensor, hc_scale: Tensor, hc_base: Tensor, hc_mult: int, iters: int, eps: float
              ) -> tuple[Tensor, Tensor, Tensor]:
    """Sinkhorn split of (..., (2+n)·n) mixes into pre (..., n), post (..., n), comb (..., n, n);
    equals `model.mhc.hc_split_sinkhorn`. Under a gradient with the Triton backend forced, or on CUDA (unless
    DSV41_TRITON_SINKHORN_BACKWARD=0: the autograd twin), it trains through
    `_SinkhornSplit`: the forward kernel, and one backward kernel that differentiates the Sinkhorn rounds in
    registers — 2 launches (+ a few reductions) for what autograd runs as ~12 ops per round forward and
    backward (the eager training step's largest launch share: 41 % at 20 rounds)."""
    if needs_grad(mixes, hc_scale, hc_base) and not torch.compiler.is_compiling() and iters >= 1 \
            and _trains_on_triton(mixes, hc_scale, hc_base):
        return _SinkhornSplit.apply(mixes, hc_scale, hc_base, hc_mult, iters, eps)
    return _impl("mhc", "mhc_split", mixes, hc_scale, hc_base)(mixes, hc_scale, hc_base, hc_mult, iters, eps)


def _trains_on_triton(*tensors: Tensor) -> bool:
    """A training Function with Triton kernels runs: forced, or `auto` with every tensor on CUDA unless
    DSV41_TRITON_SINKHORN_BACKWARD=0 (the kernel = fp64 autograd on the H200, `tests/kernels/test_sinkhorn_backward.py`;
    the 16 x 1024 `small` eager step 39.2K -> 59.3K tokens/s with it, 2026-12-04)."""
    forced = _forced()
    if forced is not None:
        return forced
    opted_out = os.environ.get("DSV41_TRITON_SINKHORN_BACKWARD", "1") == "0"
    return not opted_out and HAVE_TRITON and all(t.is_cuda for t in tensors)


def _mhc_post_trains_on_triton(h: Tensor, f: Tensor, hc_fn: Tensor | None) -> bool:
    """`mhc_post` under a gradient runs `MhcPostTrain` (issue 18): forced, or `auto` with h, f (and hc_fn) on CUDA,
    fp32 / bf16 streams and n = 4 (what the kernels take), unless DSV41_TRITON_MHC_BACKWARD=0 (the twin's
    Functions). Tests: `tests/kernels/test_mhc_backward.py` (the kernels against fp64 autograd, on the CPU
    interpreter; its `gpu` cases at `small` widths)."""
    forced = _forced()
    if forced is not None:
        return forced
    if os.environ.get("DSV41_TRITON_MHC_BACKWARD", "1") == "0" or not HAVE_TRITON:
        return False
    shapes_ok = h.dim() == 4 and h.size(-2) == 4 and _MHC_FLOATS.issuperset((h.dtype, f.dtype))
    return shapes_ok and all(t.is_cuda for t in (h, f, hc_fn) if t is not None)


class _SinkhornSplit(torch.autograd.Function):
    """`mhc_split` with the Triton forward and backward (saves only the mixes, scale and base)."""

    @staticmethod
    def forward(ctx, mixes, hc_scale, hc_base, hc_mult, iters, eps):
        from dsv41.kernels.triton import mhc as triton_mhc

        ctx.save_for_backward(mixes, hc_scale, hc_base)
        ctx.args = (hc_mult, iters, eps)
        return triton_mhc.mhc_split(mixes, hc_scale, hc_base, hc_mult, iters, eps)

    @staticmethod
    def backward(ctx, g_pre, g_post, g_comb):
        from dsv41.kernels.triton import mhc as triton_mhc

        mixes, hc_scale, hc_base = ctx.saved_tensors
        g_mixes, g_scale, g_base = triton_mhc.mhc_split_backward(mixes, hc_scale, hc_base, g_pre, g_post, g_comb,
                                                                 *ctx.args)
        return g_mixes.to(mixes.dtype), g_scale, g_base, None, None, None


# ---------------------------------------------------------------------------------------------
# Cache writes (SPEC §1a, §4): RoPE + quantize + pack, straight into cache rows.

CACHE_FORMATS = ("window_fp8", "kv_fp4", "index_fp4")


def rope_quantize(x: Tensor, cos: Tensor, sin: Tensor, fmt: str, out_rows: Tensor, row_index: Tensor) -> None:
    """Rotate, quantize and store: x (B, T, D) pre-RoPE → rows out_rows[row_index[b, t]].

    The last 2·cos.size(-1) channels of x rotate as adjacent pairs by (cos, sin) (B, T, R/2) in fp32
    and are rounded to x's dtype (as `model.rope.apply_rope`), then quantized by `fmt`:
    ``window_fp8`` (`quant.fp8.quantize_fp8`), ``kv_fp4`` (`quantize_fp4`, block 16, E4M3) or
    ``index_fp4`` (block 32, E8M0), and written as [payload | scales] into out_rows (M, row_bytes)
    uint8. row_index (B, T) int64, distinct; a negative index skips the token, rows not indexed are
    untouched. Bit-identical to the twin.
    """
    if fmt not in CACHE_FORMATS:
        raise ValueError(f"rope_quantize: fmt must be one of {CACHE_FORMATS}, got {fmt!r}")
    _impl("cache_write", "rope_quantize", x, out_rows)(x, cos, sin, fmt, out_rows, row_index)


def ring_write(chunk: Tensor, positions: Tensor, ring_row: Tensor, valid: Tensor | None, ring_rows: Tensor,
               ring_pos: Tensor, window: int) -> None:
    """A prefill chunk's last w = min(window, T) real window keys → the window ring, after the attention read it.

    chunk (B, T, R) uint8 quantized window rows, positions (B, T) int64, ring_row (B, T) int64 each token's
    flat ring row, valid (B,) integers each row's real keys (block positions [0, valid), 0 <= valid <= T) or
    None (all T). For j < w, t = max(valid[b] − w + j, 0): ring_rows[ring_row[b, t]] = chunk[b, t] and
    ring_pos[ring_row[b, t]] = positions[b, t], in place into ring_rows (M, R) uint8 and ring_pos (M,) int64;
    a row of fewer real keys than w writes its first key again (the same bytes to the same row). Rows not
    named are untouched. Bit-identical to the twin; one kernel on CUDA, no host sync (capturable).
    """
    _impl("cache_write", "ring_write", chunk, ring_rows)(chunk, positions, ring_row, valid, ring_rows, ring_pos,
                                                         window)


def rope(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool = False) -> Tensor:
    """Rotate the last 2·cos.size(-1) channels of x (B, T, [H,] D) as adjacent pairs by the angles
    (cos, sin) (B, T, R/2) — by their negatives when `inverse` — in fp32, rounded to x's dtype; the
    other channels are copied. Equals `model.rope.apply_rope` bit for bit. One kernel on CUDA.

    In training (x needs a gradient; the angles never do) it is one kernel forward and one backward on CUDA
    (`_RoPE`): a rotation's transpose is the rotation by the negated angles, so the backward is this function
    with `inverse` flipped on the incoming gradient — the same fp32 products, sums and one rounding as autograd
    through `apply_rope` (bit for bit, `tests/kernels/test_rope_norm.py`), where autograd ran ~8 kernels forward
    and ~10 backward per call. `auto` takes it when x is a 3- or 4-D CUDA float tensor with D % 32 == 0."""
    fits = x.dim() in (3, 4) and x.dtype in _FLOATS and x.size(-1) % 32 == 0
    if needs_grad(x) and not needs_grad(cos, sin) and _training_kernel("cache_write", x, fits=fits):
        return _RoPE.apply(x, cos, sin, inverse)
    return _impl("cache_write", "rope", x, cos, sin, supported=fits)(x, cos, sin, inverse)


class _RoPE(torch.autograd.Function):
    """`rope` with the Triton kernel forward and backward (saves only the angles)."""

    @staticmethod
    def forward(ctx, x, cos, sin, inverse):
        from dsv41.kernels.triton import cache_write

        ctx.save_for_backward(cos, sin)
        ctx.inverse = inverse
        return cache_write.rope(x, cos, sin, inverse)

    @staticmethod
    def backward(ctx, grad):
        from dsv41.kernels.triton import cache_write

        cos, sin = ctx.saved_tensors
        return cache_write.rope(grad, cos, sin, not ctx.inverse), None, None, None


def rope_fake_quant(x: Tensor, cos: Tensor, sin: Tensor, fmt: str) -> Tensor:
    """`rope`, then the FP4 fake-quant of cache format `fmt` ("kv_fp4": E4M3 scale per 16; "index_fp4":
    E8M0 per 32) — the values a packed row of `rope_quantize` dequantizes to — in x's dtype. Equals
    `quant.fp4.fake_quant_fp4(apply_rope(x))` bit for bit. One kernel on CUDA."""
    return _impl("cache_write", "rope_fake_quant", x, cos, sin)(x, cos, sin, fmt)


# ---------------------------------------------------------------------------------------------
# RMSNorm


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """weight · x / sqrt(mean(x²) + eps) over the last dim in fp32, in x's dtype (`model.norm.RMSNorm`).
    The Triton kernel agrees with the twin to fp32 rounding (reduction order). One kernel on CUDA.

    In training (a gradient needed) on CUDA: one forward kernel that also keeps each row's 1/RMS and one backward
    kernel for ∂x and the rows' partial ∂w sums (`kernels.triton.norm.rms_norm_train`; the twin's Function ran
    ~7 + ~12 fp32 torch ops; `tests/kernels/test_norm_train.py`)."""
    if needs_grad(x, weight) and _training_kernel("norm", x, weight):
        return importlib.import_module("dsv41.kernels.triton.norm").rms_norm_train(x, weight, eps)
    return _impl("norm", "rms_norm", x, weight, supported=x.dtype in _FLOATS)(x, weight, eps)


# ---------------------------------------------------------------------------------------------
# SwiGLU (the experts' hidden)


def swiglu(gate: Tensor, up: Tensor, limit: float, weight: Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> Tensor:
    """silu(min(gate, limit)) · clamp(up, ±limit) in fp32 (no clamp when limit <= 0), scaled by `weight`
    (M, G): hidden column j by weight[:, j // (C / G)] — a per-row routing weight (G = 1) or the dense
    MoE's per-expert blocks (G = E) — rounded once to out_dtype (default gate's). gate, up (M, C).
    Equals `model.moe._swiglu(...).to(out_dtype)` to fp32 rounding. One kernel on CUDA.

    In training (a gradient needed) on CUDA: that kernel forward and one backward kernel for ∂gate, ∂up and the
    routing weight's per-row partial sums (`kernels.triton.swiglu.swiglu_train`; the twin's Function ran ~7 + ~15
    fp32 torch ops; `tests/kernels/test_swiglu_train.py`)."""
    if needs_grad(gate, up, weight) and _training_kernel("swiglu", gate, up, weight):
        return importlib.import_module("dsv41.kernels.triton.swiglu").swiglu_train(gate, up, limit, weight, out_dtype)
    fn = _impl("swiglu", "swiglu", gate, up, weight, supported=gate.dtype in _FLOATS)
    return fn(gate, up, limit, weight, out_dtype)


def moe_route(logits: Tensor, bias: Tensor, gate_temp: float, score_func: str, k: int, norm: bool,
              route_scale: float, dense: bool = False, hook=None, dense_ones: int = 0
              ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """The router after its matmul: scores = score_func(logits / gate_temp) ("softmax" | "sigmoid" |
    "sqrtsoftplus"), the k experts of largest scores + bias (bias (E,), or (N, E) per row), their scores as
    weights (divided by their sum + 1e-20 when `norm` and k > 1) times route_scale. logits (N, E) fp32 →
    weights (N, k) fp32, indices (N, k) int64 (descending choice), scores (N, E) fp32, and with `dense` the
    (N, E) routing matrix (each chosen expert's weight, 0 elsewhere), followed by `dense_ones` columns of 1 (the
    fused shared expert's block: `MoE.fuse_dense`). hook(indices) → the indices used (a
    recorded or replayed routing; the twin runs it). One kernel on CUDA (no gradient, no hook)."""
    if hook is not None:
        return _ref_module("router").moe_route(logits, bias, gate_temp, score_func, k, norm, route_scale, dense, hook,
                                               dense_ones=dense_ones)
    fn = _impl("router", "moe_route", logits, bias, supported=logits.dtype == torch.float32)
    return fn(logits, bias, gate_temp, score_func, k, norm, route_scale, dense, dense_ones=dense_ones)


# ---------------------------------------------------------------------------------------------
# Engram (SPEC §1a, §5): n-gram hash ids and the gated memory read, inference only


def engram_hash(tokens: Tensor, token_map: Tensor, multipliers: Tensor, primes: Tensor, offsets: Tensor,
                pad_id: int, *, history: Tensor | None = None, dead_mask: Tensor | None = None) -> Tensor:
    """`model.engram.NgramHasher` without document ids: tokens (B, T) raw ids (negative = dead) → int64
    (B, T, L, (S − 1)·heads) table ids. Slot s of position t reads tokens[t − s], or before the chunk
    history (B, <= S − 1) (newest last, −1 = start / dead; None = sequence start); a negative or dead_mask
    (B, T) token blocks its slot and every farther one (they read token_map[pad_id]). Per layer l the rolling
    xor of token_map[id]·multipliers[l, s] (int64, wrapping) after slot o + 1 gives order o's columns:
    hash % primes[l, o, head] + offsets[l, o·heads + head]. Bit-identical to the twin; one kernel on CUDA."""
    fn = _impl("engram", "engram_hash", tokens, token_map, history, dead_mask)
    return fn(tokens, token_map, multipliers, primes, offsets, pad_id, history=history, dead_mask=dead_mask)


def engram_gate(x: Tensor, kv: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float,
                token_mask: Tensor | None = None) -> Tensor:
    """Engram's memory read after its `wkv` GEMM: x (B, T, hc, dim) streams, kv (B, T, (hc + 1)·dim) hc keys
    then one value → x + gate·value (B, T, hc, dim) in x's dtype, fp32 math; per (token, stream)
    d = Σ(h·(q_weight·k_weight)·key)·rstd(h)·rstd(key)·dim^−½ (RMS over dim, + eps), gate =
    σ(sign(d)·√max(|d|, 1e-6)), 0 where token_mask (B, T) is False. Agrees with the twin to fp32 rounding
    (reduction order); one kernel on CUDA (no gradient)."""
    fn = _impl("engram", "engram_gate", x, kv, q_weight, k_weight, token_mask,
               supported=_FLOATS.issuperset((kv.dtype, q_weight.dtype, k_weight.dtype)))
    return fn(x, kv, q_weight, k_weight, eps, token_mask)


# ---------------------------------------------------------------------------------------------
# DSpark drafting: the greedy semi-autoregressive Markov loop, inference only


MARKOV_TRITON_ROWS = 8  # `markov_greedy` under `auto`: the Triton kernels up to this many rows, the twin above


def markov_greedy(base: Tensor, hidden: Tensor, anchors: Tensor, embed: Tensor, head: Tensor, conf_weight: Tensor
                  ) -> tuple[Tensor, Tensor]:
    """`model.dspark.DSpark.sample` at temperature 0 after the base logits: base (B, K, V) fp32, hidden
    (B, K, dim), anchors (B,) ids, the Markov head's embed and head (V, r), the confidence head's weight
    ((1,) dim + r). Per position i from prev = anchors: e = embed[prev], conf[:, i] = w · [hidden[:, i], e],
    tokens[:, i] = argmax(base[:, i] + head · e) (torch.argmax: lowest index on ties, NaN largest) = the next
    prev; fp32 products. → (tokens (B, K) int64, conf (B, K) fp32). The Triton kernels agree with the twin to
    fp32 rounding (tokens equal unless a row's top two logits are that close); K + 1 launches on CUDA, no
    host sync (capturable), instead of ~10 per position. `auto` runs the kernels up to MARKOV_TRITON_ROWS rows
    (their one-row-per-program form) and the twin above: in CUDA graphs on the H100 (2026-12-07, the shipped
    drafter's V 16,384, r 256, K 5) 61 µs against the twin's 131 at B = 1, but 513 µs (the tiles of 16 rows)
    against 201 at B = 64."""
    fn = _impl("markov", "markov_greedy", base, hidden, anchors, embed, head, conf_weight,
               supported=base.dtype == torch.float32 and base.dim() == 3 and base.size(0) <= MARKOV_TRITON_ROWS
               and _FLOATS.issuperset((hidden.dtype, embed.dtype, head.dtype, conf_weight.dtype)))
    return fn(base, hidden, anchors, embed, head, conf_weight)


# ---------------------------------------------------------------------------------------------
# Sparse training attention (issue 18): forward and backward, autograd-capable


def sparse_train_kernel(q: Tensor, window_kv: Tensor, entries: Tensor | None) -> bool:
    """Should the training attention run the Triton kernel on these tensors? Backend ``triton``: yes
    (the interpreter on CPU tensors); ``torch`` or under ``torch.compile``: no (the twin,
    `model.sparse_attention.attend_sparse`); ``auto``: when Triton is installed, q is on CUDA and the
    kernel takes the shapes. Unlike the inference ops, ``auto`` picks it with gradients too: it has
    its own backward."""
    return _training_kernel("sparse_train", q, window_kv, entries)


def _training_kernel(module: str, first: Tensor, *args: Tensor | None, fits: bool | None = None) -> bool:
    """The training kernels' shared choice: never under torch.compile (it traces the twin), the forced backend's
    answer, else Triton installed, `first` on CUDA and the kernels take the shapes: `fits` when the caller
    decided it, else kernels.triton.<module>.supported(first, *args)."""
    if torch.compiler.is_compiling():
        return False
    forced = _forced()
    if forced is not None:
        return forced
    if not HAVE_TRITON or not first.is_cuda:
        return False
    if fits is not None:
        return fits
    return importlib.import_module(f"dsv41.kernels.triton.{module}").supported(first, *args)


def sparse_train_attention(q: Tensor, window_kv: Tensor, doc_ids: Tensor, window_start: Tensor | None, window: int,
                           entries: Tensor | None, index: Tensor | None, sink: Tensor, scale: float, *,
                           entry_logits: bool = False) -> tuple[Tensor, Tensor, Tensor | None]:
    """One softmax per query and head over its window keys ∪ its selected entries ∪ the sink (the
    training path's `attend_sparse` without gathering), with autograd for q, window_kv, entries, sink.

    q (B, T, H, D); window_kv (B, T, D): key u is in query t's window iff t − window < u ≤ t,
    doc_ids[u] = doc_ids[t] and u ≥ window_start[t] (None: no replay start); entries (B, N, D) read
    at index (B, T, K) (−1 = not attended). K = V. Returns (o (B, T, H, D) in q's dtype, the
    log-sum-exp (B, T, H) fp32 with the sink, and with `entry_logits` the entries' scaled logits
    (B, T, H, K) fp32, detached — the indexer KL's target). Triton only; see `sparse_train_kernel`."""
    fn = importlib.import_module("dsv41.kernels.triton.sparse_train").sparse_train_attention
    return fn(q, window_kv, doc_ids, window_start, window, entries, index, sink, scale, entry_logits=entry_logits)


def selected_scores_kernel(iq: Tensor, index_k: Tensor) -> bool:
    """Should the indexer's selected-entry scores (training) run the Triton kernels? As `sparse_train_kernel`:
    backend ``triton`` yes (the interpreter on CPU tensors), ``torch`` or under ``torch.compile`` no (the twin,
    `model.sparse_attention._SelectedScores`), ``auto`` when Triton is installed, iq is on CUDA and the kernels
    take the shapes (they have their own backward)."""
    return _training_kernel("selected_scores", iq, index_k)


def selected_index_scores(iq: Tensor, weights: Tensor, index_k: Tensor, topk: Tensor) -> Tensor:
    """Σ_h w_h·relu(q_h·k_{topk}) per query and selected entry: iq (B, T, Hi, Di), weights (B, T, Hi), index_k
    (B, N, Di), topk (B, T, K) (−1 reads row 0) → (B, T, K) fp32, with autograd for iq, weights, index_k. The keys
    are read by index (no (B, T, K, Di) gather); the backward adds the keys' gradients atomically. Triton only;
    see `selected_scores_kernel`."""
    fn = importlib.import_module("dsv41.kernels.triton.selected_scores").selected_index_scores
    return fn(iq, weights, index_k, topk)
