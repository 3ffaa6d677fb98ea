"""Single-pass mHC kernels (SPEC §5): Triton vs the torch twin, the twin vs the model's mHC functions,
and a Block forward recomposed from the fused ops vs the current one.

CPU: Triton runs in its interpreter (tiny sizes); `gpu` tests repeat the comparisons at v41-flash
sizes (d = 5120, up to 16K tokens). Outputs of the Triton launchers are poisoned with NaN
(`_empty` patched) so every element must be written; inputs are finite.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from tests.conftest import FP32_RTOL, assert_close, randomize_mixing

from dsv41 import load_config
from dsv41.kernels import ops
from dsv41.kernels.ops import use_backend
from dsv41.kernels.ref import mhc as twin
from dsv41.model.mhc import hc_mixes, hc_post, hc_pre, hc_split_sinkhorn, identity_pre_mix
from dsv41.model.state import ForwardContext
from dsv41.model.transformer import Transformer

N = 4  # hc_mult of every preset
K = (2 + N) * N  # 24 mixes
EPS = 1e-6
BF16_MIXES_RTOL = 1e-4  # mixes from bf16 streams: a one-ulp flip of h_new moves them ~1e-5


@pytest.fixture
def poisoned(monkeypatch):
    """Triton outputs and workspaces start as NaN."""
    from dsv41.kernels.triton import mhc as triton_mhc

    def empty(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(triton_mhc, "_empty", empty)


def streams(B: int, T: int, d: int, dtype: torch.dtype, seed: int, device: str = "cpu", with_fn: bool = True):
    """Random (h, f, post, comb, pre, hc_fn) shaped like the model's: positive comb/pre, post in (0, 2)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, N, d, generator=g)
    f = 2 * torch.randn(B, T, d, generator=g)
    post = 2 * torch.rand(B, T, N, generator=g)
    comb = torch.softmax(2 * torch.randn(B, T, N, N, generator=g), dim=-1)
    pre = torch.rand(B, T, N, generator=g) + 1e-6
    fn = 0.05 * torch.randn(K, N * d, generator=g) if with_fn else None
    tensors = [h.to(dtype), f.to(dtype), post, comb, pre, fn]
    return [None if t is None else t.to(device) for t in tensors]


def scaled_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, what: str) -> None:
    """Elementwise rtol, plus an absolute floor of rtol·max|expected| (cancellation makes some
    outputs tiny; their error is set by the magnitude of the terms, not by their own size)."""
    assert not torch.isnan(actual).any(), f"{what}: NaN left in the output (an element was not written)"
    assert_close(actual, expected, rtol=rtol, atol=rtol * float(expected.abs().max()), what=what)


def bf16_ulp_close(actual: torch.Tensor, expected: torch.Tensor, what: str, max_fraction: float = 0.005,
                   terms: torch.Tensor | None = None) -> None:
    """bf16 outputs: equal, except at most one ulp apart on a tiny fraction of the elements. `terms`
    (the magnitude of what each output sums) sets the ulp where a sum cancels: a GPU's fused
    multiply-adds round differently from torch, which shows as an ulp of the terms, not of the result."""
    assert actual.dtype == expected.dtype == torch.bfloat16, what
    a, e = actual.float(), expected.float()
    assert not torch.isnan(a).any(), f"{what}: NaN left in the output (an element was not written)"
    size = torch.maximum(a.abs(), e.abs()) if terms is None else torch.maximum(torch.maximum(a.abs(), e.abs()),
                                                                               terms.float())
    ulp = torch.ldexp(torch.ones_like(e), torch.frexp(size)[1] - 8)  # bf16 spacing
    diff = (a - e).abs()
    assert bool((diff <= ulp).all()), f"{what}: max error {float((diff / ulp).max()):.1f} ulp"
    frac = float((diff > 0).float().mean())
    assert frac <= max_fraction, f"{what}: {frac:.2%} of the elements differ (allowed {max_fraction:.2%})"


def check_bf16_pass(h_new, x, mixes, expected, pre, fn, inputs=None) -> None:
    """bf16 mhc_post outputs: h_new within one ulp of the twin's; x and mixes also checked against the
    twin applied to the kernel's own h_new (a flipped h_new ulp must not be blamed on them). With
    `inputs` = (h, f, post, comb) the ulp is taken at the size of the summed terms (GPU: FMAs)."""
    e_h, _, e_m = expected
    terms = None if inputs is None else hc_post(inputs[1].abs(), inputs[0].abs(), inputs[2], inputs[3])
    bf16_ulp_close(h_new, e_h, "h_new", terms=terms)
    bf16_ulp_close(x, hc_pre(h_new, pre), "x from h_new", terms=None if inputs is None else hc_pre(h_new.abs(), pre))
    # GPU (inputs given): Hopper's MMA accumulates with less than fp32's rounding, ~6e-5 over K = 20480
    # from cuBLAS fp32 (seen on the H200)
    scaled_close(mixes, twin.mhc_mixes(h_new, fn, EPS), FP32_RTOL if inputs is None else 2e-4, "mixes from h_new")
    scaled_close(mixes, e_m, BF16_MIXES_RTOL if inputs is None else 1e-3, "mixes")


def reference64(h, f, post, comb, pre, fn):
    """Independent fp64 formulas of mhc_post (rounding h_new / x to the output dtype like the contract)."""
    h_new = post.double().unsqueeze(-1) * f.double().unsqueeze(-2) + torch.einsum(
        "btij,btid->btjd", comb.double(), h.double())
    h_new = h_new.to(f.dtype)
    x = (pre.double().unsqueeze(-1) * h_new.double()).sum(-2).to(f.dtype)
    flat = h_new.double().flatten(-2)  # (B, T, n·d)
    mixes = flat @ fn.double().T / torch.sqrt(flat.square().mean(-1, keepdim=True) + EPS)
    return h_new, x, mixes


# --------------------------------------------------------------------------------------------- Triton vs twin
POST_CASES = [  # (B, T, d, knobs)
    (1, 1, 64, dict(block_t=16, block_d=32)),  # one token (decode); the split path by default
    (2, 37, 64, dict(block_t=16, block_d=32, split=1)),  # ragged token tiles
    (1, 21, 48, dict(block_t=16, block_d=32, split=2)),  # ragged d, d split in two spans
    (3, 5, 80, dict(block_t=16, block_d=16, split=3, precision="tf32x3")),  # last span shorter
    (1, 18, 48, dict(block_t=32, block_d=64, precision="ieee")),  # one chunk wider than d
]


@pytest.mark.parametrize("B,T,d,knobs", POST_CASES)
def test_mhc_post_fp32_matches_twin(poisoned, monkeypatch, B, T, d, knobs):
    h, f, post, comb, pre, fn = streams(B, T, d, torch.float32, seed=11 + T + d)
    _force_knobs(monkeypatch, knobs)
    with use_backend("triton"):
        h_new, x, mixes = ops.mhc_post(h, f, post, comb, pre, fn, EPS)
    e_h, e_x, e_m = twin.mhc_post(h, f, post, comb, pre, fn, EPS)
    assert h_new.dtype == x.dtype == torch.float32 and mixes.dtype == torch.float32
    scaled_close(h_new, e_h, FP32_RTOL, "h_new")
    scaled_close(x, e_x, FP32_RTOL, "x")
    scaled_close(mixes, e_m, FP32_RTOL, "mixes")


@pytest.mark.parametrize("B,T,d,knobs", [
    (2, 19, 64, dict(block_t=16, block_d=32)),
    (1, 23, 48, dict(block_t=16, block_d=32, split=2)),
])
def test_mhc_post_bf16_matches_twin(poisoned, monkeypatch, B, T, d, knobs):
    h, f, post, comb, pre, fn = streams(B, T, d, torch.bfloat16, seed=21 + T)
    _force_knobs(monkeypatch, knobs)
    with use_backend("triton"):
        h_new, x, mixes = ops.mhc_post(h, f, post, comb, pre, fn, EPS)
    check_bf16_pass(h_new, x, mixes, twin.mhc_post(h, f, post, comb, pre, fn, EPS), pre, fn)


def test_mhc_post_mixed_dtypes_and_no_projection(poisoned, monkeypatch):
    """hc_fn None → mixes None; fp32 streams with a bf16 sublayer output round h_new to bf16."""
    h, f, post, comb, pre, _ = streams(2, 9, 48, torch.float32, seed=31, with_fn=False)
    f = f.bfloat16()
    _force_knobs(monkeypatch, dict(block_t=16, block_d=32))
    with use_backend("triton"):
        h_new, x, mixes = ops.mhc_post(h, f, post, comb, pre, None, EPS)
    e_h, e_x, e_m = twin.mhc_post(h, f, post, comb, pre, None, EPS)
    assert mixes is None and e_m is None
    bf16_ulp_close(h_new, e_h, "h_new")
    bf16_ulp_close(x, e_x, "x")
    bf16_ulp_close(x, hc_pre(h_new, pre), "x from h_new")


def test_mhc_post_stream_defaults_without_projection(poisoned):
    """The last pass (no hc_fn) at its own defaults, `DEFAULTS["stream"]` (16 tokens × 128 channels):
    ragged token tiles and a ragged last chunk (d = 300), bf16 streams."""
    from dsv41.kernels.triton import mhc as triton_mhc

    h, f, post, comb, pre, _ = streams(1, 37, 300, torch.bfloat16, seed=33, with_fn=False)
    h_new, x, mixes = triton_mhc.mhc_post(h, f, post, comb, pre, None, EPS)
    e_h, _, _ = twin.mhc_post(h, f, post, comb, pre, None, EPS)
    assert mixes is None
    bf16_ulp_close(h_new, e_h, "h_new")
    bf16_ulp_close(x, hc_pre(h_new, pre), "x from h_new")


def test_mhc_post_bf16_rounds_ties_to_even(poisoned, monkeypatch):
    """h_new = f·(1 + k·2⁻⁸), k odd: every value lies halfway between two bf16 numbers."""
    g = torch.Generator().manual_seed(35)
    B, T, d = 1, 5, 32
    f = (torch.randint(0, 2, (B, T, d), generator=g) * 2 - 1) * torch.exp2(torch.randint(-3, 4, (B, T, d), generator=g))
    k = 2 * torch.randint(0, 60, (B, T, N, d), generator=g) + 1
    h = f.unsqueeze(2) * k * 2.0 ** -8  # exact in bf16 (≤ 7 significant bits)
    f, h = f.bfloat16(), h.bfloat16()
    post, comb = torch.ones(B, T, N), torch.eye(N).expand(B, T, N, N)
    pre = torch.zeros(B, T, N)
    pre[..., 2] = 1.0  # x = h_new_2
    _force_knobs(monkeypatch, dict(block_t=16, block_d=16))
    with use_backend("triton"):
        h_new, x, _ = ops.mhc_post(h, f, post, comb, pre, None, EPS)
    e_h, e_x, _ = twin.mhc_post(h, f, post, comb, pre, None, EPS)
    assert torch.equal(h_new, e_h) and torch.equal(x, e_x)
    assert torch.equal(e_h, (f.float().unsqueeze(2) + h.float()).bfloat16()), "the inputs are not ties"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_projection_is_fp32_accurate(poisoned, monkeypatch, dtype):
    """Positive streams and weights with full fp32 mantissas: the sum is coherent, so dropping the
    third bf16 piece of hc_fn (a bf16x2 projection, 2⁻¹⁷) would show as ~7e-6; fp32 stays < 1e-6."""
    g = torch.Generator().manual_seed(37)
    h = (torch.rand(2, 9, N, 64, generator=g) + 0.5).to(dtype)
    fn = torch.rand(K, N * 64, generator=g) + 1
    _force_knobs(monkeypatch, dict(block_t=16, block_d=32))
    with use_backend("triton"):
        mixes = ops.mhc_mixes(h, fn, EPS)
    flat = h.double().flatten(-2)
    exact = flat @ fn.double().T / torch.sqrt(flat.square().mean(-1, keepdim=True) + EPS)
    err = float((mixes.double() - exact).abs().max() / exact.abs().max())
    assert err < 2e-6, f"projection error {err:.2e} relative to fp64"


@pytest.mark.parametrize("dtype,knobs", [
    (torch.float32, dict(block_t=16, block_d=32, split=1)),
    (torch.float32, dict(block_t=16, block_d=16)),  # default split: several spans + the finish kernel
    (torch.bfloat16, dict(block_t=32, block_d=32, split=2)),
    (torch.bfloat16, dict(block_t=16, block_d=16, cat=1)),  # interleaved operand (mhc_post's default)
    (torch.float32, dict(block_t=16, block_d=16, cat=2, split=1)),
])
def test_mhc_mixes_matches_twin(poisoned, monkeypatch, dtype, knobs):
    h, *_, fn = streams(2, 13, 48, dtype, seed=41)
    _force_knobs(monkeypatch, knobs)
    with use_backend("triton"):
        mixes = ops.mhc_mixes(h, fn, EPS)
    scaled_close(mixes, twin.mhc_mixes(h, fn, EPS), FP32_RTOL, "mixes")


FUSED_CASES = [  # (dtype, B, T, d, knobs) for the pre-split-planes kernel (design="fused")
    (torch.bfloat16, 1, 19, 48, dict(block_t=16, block_d=16, tma=False, prefetch=True)),  # ragged, register prefetch
    (torch.bfloat16, 1, 19, 48, dict(block_t=16, block_d=16, cat=2)),  # streams side by side (register A)
    (torch.float32, 2, 7, 48, dict(block_t=16, block_d=16, cat=2, split=2)),  # the same with a split fp32 A
    (torch.bfloat16, 1, 23, 48, dict(block_t=16, block_d=32, split=2, fn_cols=32)),  # ragged d (TMA zero fill)
    (torch.bfloat16, 1, 9, 40, dict(block_t=16, block_d=16, cat=0, tma=False)),  # one dot group per stream
    (torch.float32, 3, 5, 48, dict(block_t=16, block_d=16, split=3)),  # fp32 A: 6 MMAs, d spans + finish
    (torch.float32, 2, 9, 48, dict(block_t=16, block_d=16, tma=True)),  # fp32 tiles through TMA (not the default)
    (torch.bfloat16, 2, 150, 80, dict(tma=True)),  # TMA defaults (128-token tiles, 8 warps), ragged rows and d
    (torch.bfloat16, 1, 40, 44, dict(block_t=16)),  # 88-byte rows: no TMA (not 16-byte aligned), plain loads
]


@pytest.mark.parametrize("dtype,B,T,d,knobs", FUSED_CASES)
def test_mhc_post_fused_matches_twin(poisoned, monkeypatch, dtype, B, T, d, knobs):
    h, f, post, comb, pre, fn = streams(B, T, d, dtype, seed=71 + T + d)
    _force_knobs(monkeypatch, dict(design="fused", **knobs))
    with use_backend("triton"):
        h_new, x, mixes = ops.mhc_post(h, f, post, comb, pre, fn, EPS)
    expected = twin.mhc_post(h, f, post, comb, pre, fn, EPS)
    if dtype == torch.bfloat16:
        check_bf16_pass(h_new, x, mixes, expected, pre, fn)
    else:
        for got, exp, what in zip((h_new, x, mixes), expected, ("h_new", "x", "mixes")):
            scaled_close(got, exp, FP32_RTOL, what)


def test_mhc_fused_last_pass_and_mixes(poisoned, monkeypatch):
    """The fused kernel without the projection (last pass) and without the update (`mhc_mixes`)."""
    h, f, post, comb, pre, fn = streams(1, 21, 48, torch.bfloat16, seed=81)
    _force_knobs(monkeypatch, dict(design="fused", block_t=16, block_d=32))
    with use_backend("triton"):
        h_new, x, none = ops.mhc_post(h, f, post, comb, pre, None, EPS)
        mixes = ops.mhc_mixes(h, fn, EPS)
    e_h, e_x, _ = twin.mhc_post(h, f, post, comb, pre, None, EPS)
    assert none is None
    bf16_ulp_close(h_new, e_h, "h_new")
    bf16_ulp_close(x, hc_pre(h_new, pre), "x from h_new")
    scaled_close(mixes, twin.mhc_mixes(h, fn, EPS), FP32_RTOL, "mixes")


@pytest.mark.parametrize("d,d_pad,cols", [(40, 64, 24), (48, 48, 32)])
def test_fn_split_planes_are_exact(poisoned, d, d_pad, cols):
    """hi + mid + lo = hc_fn exactly, each plane bf16, rows 4·c + i = column i·d + c, zero padding."""
    from dsv41.kernels.triton import mhc as triton_mhc

    g = torch.Generator().manual_seed(d * 7 + cols)
    # magnitudes over 2^±66: every piece stays a normal bf16 (the lo piece of a value near 2^-100 would
    # be subnormal, below what the split is exact for; hc_fn is an O(1e-2) weight)
    fn = torch.randn(K, N * d, generator=g) * torch.logspace(-20, 20, N * d)
    w = triton_mhc._split_fn(fn, d, d_pad, cols)
    assert w.shape == (3, N * d_pad, cols) and w.dtype == torch.bfloat16
    expected = torch.zeros(N * d_pad, cols)
    expected[: N * d, :K] = fn.reshape(K, N, d).permute(2, 1, 0).reshape(N * d, K)
    total = w[0].float() + w[1].float() + w[2].float()  # exact: the pieces do not overlap
    assert not torch.isnan(total).any(), "an element of the planes was not written"
    assert torch.equal(total, expected)


def test_design_knobs_are_checked():
    h, f, post, comb, pre, fn = streams(1, 3, 32, torch.float32, seed=91)
    from dsv41.kernels.triton import mhc as triton_mhc

    with pytest.raises(ValueError, match="design"):
        triton_mhc.mhc_post(h, f, post, comb, pre, fn, EPS, design="mega")
    with pytest.raises(ValueError, match="needs precision"):
        triton_mhc.mhc_post(h, f, post, comb, pre, fn, EPS, design="fused", precision="ieee")
    with pytest.raises(ValueError, match="fn_cols"):
        triton_mhc.mhc_mixes(h, fn, EPS, design="fused", fn_cols=16)
    with pytest.raises(ValueError, match="cat must be"):
        triton_mhc.mhc_post(h, f, post, comb, pre, fn, EPS, design="fused", cat=3)
    with pytest.raises(ValueError, match="tma=True needs design"):
        triton_mhc.mhc_post(h, f, post, comb, pre, fn, EPS, design="legacy", tma=True)
    tall = streams(1, 300, 32, torch.bfloat16, seed=93)  # 512-token tiles: more than a TMA box holds
    with pytest.raises(ValueError, match="≤ 256"):
        triton_mhc.mhc_post(*tall[:5], tall[5], EPS, design="fused", tma=True, block_t=512)
    h, f, post, comb, pre, fn = streams(1, 3, 44, torch.bfloat16, seed=92)  # 88-byte rows
    with pytest.raises(ValueError, match="16-byte aligned"):
        triton_mhc.mhc_post(h, f, post, comb, pre, fn, EPS, design="fused", tma=True)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the ±1e4 logits, in the interpreter
@pytest.mark.parametrize("n,iters,logit_scale", [(4, 20, 1.0), (4, 1, 1.0), (4, 20, 40.0), (3, 5, 1.0)])
def test_mhc_split_matches_twin(poisoned, n, iters, logit_scale):
    g = torch.Generator().manual_seed(51 + iters + n)
    k = (2 + n) * n
    mixes = 3 * torch.randn(2, 33, k, generator=g)
    if logit_scale > 1:  # extreme logits: saturated sigmoids, one-hot softmax rows, ±1e4
        mixes[0, :5] = 1e4 * torch.sign(mixes[0, :5])
    scale = torch.tensor([1.0, 0.5, logit_scale]) * (0.5 + torch.rand(3, generator=g))
    base = torch.randn(k, generator=g)
    with use_backend("triton"):
        pre, post, comb = ops.mhc_split(mixes, scale, base, n, iters, EPS)
    e_pre, e_post, e_comb = twin.mhc_split(mixes, scale, base, n, iters, EPS)
    for got, exp, what in ((pre, e_pre, "pre"), (post, e_post, "post"), (comb, e_comb, "comb")):
        assert not torch.isnan(got).any(), f"{what}: NaN left in the output"
        assert_close(got, exp, rtol=FP32_RTOL, atol=1e-9, what=what)  # entries near eps count


def test_empty_token_range_and_bad_inputs():
    h, f, post, comb, pre, fn = streams(1, 0, 32, torch.float32, seed=61)
    with use_backend("triton"):
        h_new, x, mixes = ops.mhc_post(h, f, post, comb, pre, fn, EPS)
        assert h_new.shape == (1, 0, N, 32) and x.shape == (1, 0, 32) and mixes.shape == (1, 0, K)
        assert ops.mhc_split(torch.zeros(0, K), torch.ones(3), torch.zeros(K), N, 20, EPS)[2].shape == (0, N, N)
        h, f, post, comb, pre, fn = streams(1, 3, 32, torch.float32, seed=62)
        with pytest.raises(ValueError, match="hc_mult"):
            ops.mhc_mixes(h[:, :, :3], fn[:15, :96], EPS)
        with pytest.raises(ValueError, match="f must be"):
            ops.mhc_post(h, f[:, :2], post, comb, pre, fn, EPS)
        with pytest.raises(ValueError, match="float32 or bfloat16"):
            ops.mhc_post(h.half(), f, post, comb, pre, fn, EPS)
        with pytest.raises(ValueError, match="hc_fn must be"):
            ops.mhc_post(h, f, post, comb, pre, fn[:, :64], EPS)
        with pytest.raises(ValueError, match="mixes must be"):
            ops.mhc_split(torch.zeros(3, K + 1), torch.ones(3), torch.zeros(K), N, 20, EPS)


def _force_knobs(monkeypatch, knobs: dict) -> None:
    """Call the Triton launchers through `ops` with explicit tuning knobs."""
    from dsv41.kernels.triton import mhc as triton_mhc

    for name in ("mhc_post", "mhc_mixes"):
        monkeypatch.setattr(triton_mhc, name, partial(getattr(triton_mhc, name), **knobs))


# --------------------------------------------------------------------------------------------- twin vs the model
def test_twins_are_the_model_functions():
    """Bit-identical to the calls Block.forward makes today: hc_post, hc_pre, hc_mixes, hc_split_sinkhorn."""
    h, f, post, comb, pre, fn = streams(2, 11, 40, torch.float32, seed=71)
    scale, base = 0.5 + torch.rand(3), torch.randn(K)
    h_new, x, mixes = twin.mhc_post(h, f, post, comb, pre, fn, EPS)
    expected_h = hc_post(f, h, post, comb)
    assert torch.equal(h_new, expected_h)
    assert torch.equal(x, hc_pre(expected_h, pre))
    assert torch.equal(twin.mhc_mixes(h_new, fn, EPS), mixes)
    for got, exp in zip(twin.mhc_split(mixes, scale, base, N, 20, EPS),
                        hc_mixes(expected_h, fn, scale, base, norm_eps=EPS, hc_mult=N, iters=20, hc_eps=EPS)):
        assert torch.equal(got, exp)
    for got, exp in zip(twin.mhc_split(mixes, scale, base, N, 7, EPS),
                        hc_split_sinkhorn(mixes, scale, base, N, 7, EPS)):
        assert torch.equal(got, exp)
    assert twin.mhc_post(h, f, post, comb, pre, None, EPS)[2] is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_twin_matches_fp64_formulas(dtype):
    h, f, post, comb, pre, fn = streams(3, 7, 56, dtype, seed=81)
    got = twin.mhc_post(h, f, post, comb, pre, fn, EPS)
    exp = reference64(h, f, post, comb, pre, fn)
    if dtype == torch.float32:
        scaled_close(got[0], exp[0], FP32_RTOL, "h_new")
        scaled_close(got[1], exp[1], FP32_RTOL, "x")
    else:
        bf16_ulp_close(got[0], exp[0], "h_new")
        bf16_ulp_close(got[1], exp[1], "x")
    scaled_close(got[2], exp[2].float(), FP32_RTOL, "mixes")


def test_twin_gradients_equal_the_model_path():
    """Training runs the twins with autograd: the same gradients as the separate model calls."""
    scale, base = 0.5 + torch.rand(3), torch.randn(K)
    leaves = [t.requires_grad_() for t in [*streams(1, 6, 32, torch.float32, seed=91), scale, base]]
    h, f, post, comb, pre, fn, scale, base = leaves
    h_new, x, mixes = twin.mhc_post(h, f, post, comb, pre, fn, EPS)
    got = (h_new, x, *twin.mhc_split(mixes, scale, base, N, 20, EPS))
    e_h = hc_post(f, h, post, comb)
    exp = (e_h, hc_pre(e_h, pre), *hc_mixes(e_h, fn, scale, base, norm_eps=EPS, hc_mult=N, iters=20, hc_eps=EPS))
    weights = [torch.randn_like(t) for t in got]
    grads = [torch.autograd.grad(sum((a * w).sum() for a, w in zip(outs, weights)), leaves) for outs in (got, exp)]
    for g_got, g_exp in zip(*grads):
        assert torch.equal(g_got, g_exp)


# --------------------------------------------------------------------------------------------- Block level
def multi_pass_block_forward(block, h, pre_mix, attention):
    """The eager multi-pass Block (before the fused passes), written with the model.mhc functions:
    the independent reference for Block.forward."""
    mix = lambda h, which: hc_mixes(h, getattr(block, f"hc_{which}_fn"), getattr(block, f"hc_{which}_scale"),
                                    getattr(block, f"hc_{which}_base"), **block._hc)
    attn_pre, attn_post, attn_comb = mix(h, "attn")
    x = block.attn_norm(hc_pre(h, pre_mix if block.single_pass else attn_pre))
    h = hc_post(attention(x), h, attn_post, attn_comb)
    ffn_pre, ffn_post, ffn_comb = mix(h, "ffn")
    x = block.ffn_norm(hc_pre(h, attn_pre if block.single_pass else ffn_pre))
    return hc_post(block.ffn(x), h, ffn_post, ffn_comb), ffn_pre


def run_blocks(model, tokens, n_layers: int, fused: bool):
    """Transformer.hidden over the first n_layers blocks: Block.forward (fused passes) or the multi-pass one."""
    ctx = ForwardContext.build(tokens)
    hash_ids = model.hasher(tokens, doc_ids=ctx.doc_ids)
    h = model.embed(tokens).unsqueeze(2).repeat(1, 1, model.config.hc_mult, 1)
    pre_mix = identity_pre_mix(h, model.config.hc_mult)
    carry, states = None, []
    layers = model.layers[:n_layers]
    for i, layer in enumerate(layers):
        if layer.engram is not None:
            h = layer.engram(h, hash_ids[:, :, model.engram_index[layer.layer_id]])
            carry = None  # Engram changed h: x and the mixes are recomputed from it
        attention = partial(layer.attn, ctx=ctx)
        if fused:
            h, pre_mix, carry = layer(h, pre_mix, attention, entry=carry, next_block=model.next_block(i, n_layers - 1))
        else:
            h, pre_mix = multi_pass_block_forward(layer, h, pre_mix, attention)
        states.append((h, pre_mix))
    hidden = carry[0] if fused else hc_pre(h, pre_mix)
    return states, hidden


def block_test_model(seed: int, dtype: torch.dtype = torch.float32, **changes) -> Transformer:
    model = Transformer(load_config("tiny").replace(**changes)).init_weights(seed=seed).eval()
    randomize_mixing(model, seed)
    return model.to(dtype)


@pytest.mark.parametrize("dtype,single_pass,n_layers", [(torch.float32, True, 8), (torch.bfloat16, True, 3),
                                                        (torch.float32, False, 3)])
def test_block_forward_from_twins_equals_current(dtype, single_pass, n_layers):
    """Bit-identical: Block.forward (fused passes, twins) vs the multi-pass block, layer by layer and collapse."""
    model = block_test_model(101, dtype, single_pass_mhc=single_pass)
    tokens = torch.randint(3, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(101))
    with torch.no_grad(), use_backend("torch"):
        current, hidden = run_blocks(model, tokens, n_layers, fused=False)
        fused, fused_hidden = run_blocks(model, tokens, n_layers, fused=True)
        if n_layers == len(model.layers):
            assert torch.equal(hidden, model.hidden(tokens, ForwardContext.build(tokens))), "run_blocks ≠ hidden()"
    assert torch.equal(fused_hidden, hidden), "the final collapse differs"
    for i, ((h, p), (fh, fp)) in enumerate(zip(current, fused)):
        assert torch.equal(fh, h) and torch.equal(fp, p), f"layer {i} differs"


def test_block_forward_with_triton_kernels(poisoned):
    """The first three tiny blocks (entry pass, an Engram layer, a fused hand-over) through the kernels."""
    model = block_test_model(102)
    assert model.layers[1].engram is not None and model.layers[2].engram is None
    tokens = torch.randint(3, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(102))
    with torch.no_grad():
        with use_backend("torch"):
            current, hidden = run_blocks(model, tokens, 3, fused=False)
        with use_backend("triton"):
            fused, fused_hidden = run_blocks(model, tokens, 3, fused=True)
    for i, ((h, p), (fh, fp)) in enumerate(zip(current, fused)):
        scaled_close(fh, h, 1e-4, f"layer {i} streams")
        scaled_close(fp, p, 1e-4, f"layer {i} pre-mix")
    scaled_close(fused_hidden, hidden, 1e-4, "collapse")


# --------------------------------------------------------------------------------------------- GPU, full size
@pytest.mark.gpu
@pytest.mark.parametrize("B,T", [(1, 1), (64, 1), (2, 4096), (1, 16384)])
def test_gpu_mhc_post_v41_flash(B, T):
    h, f, post, comb, pre, fn = streams(B, T, 5120, torch.bfloat16, seed=201 + T, device="cuda")
    with torch.no_grad(), use_backend("triton"):
        h_new, x, mixes = ops.mhc_post(h, f, post, comb, pre, fn, EPS)
    check_bf16_pass(h_new, x, mixes, twin.mhc_post(h, f, post, comb, pre, fn, EPS), pre, fn, (h, f, post, comb))


@pytest.mark.gpu
@pytest.mark.parametrize("design,knobs", [("fused", {}), ("fused", dict(tma=False, cat=0, fn_cols=32)),
                                          ("fused", dict(cat=2)),
                                          ("fused", dict(tma=False, block_t=128, num_warps=8, num_stages=1)),
                                          ("fused", dict(block_t=64, num_warps=4, num_stages=2)), ("legacy", {})])
@pytest.mark.parametrize("with_fn", [True, False])
def test_gpu_mhc_post_designs(design, knobs, with_fn):
    from dsv41.kernels.triton import mhc as triton_mhc

    h, f, post, comb, pre, fn = streams(1, 4096 + 37, 5120, torch.bfloat16, seed=231, device="cuda", with_fn=with_fn)
    h_new, x, mixes = triton_mhc.mhc_post(h, f, post, comb, pre, fn, EPS, design=design, **knobs)
    expected = twin.mhc_post(h, f, post, comb, pre, fn, EPS)
    if with_fn:
        check_bf16_pass(h_new, x, mixes, expected, pre, fn, (h, f, post, comb))
    else:
        assert mixes is None
        terms = hc_post(f.abs(), h.abs(), post, comb)
        bf16_ulp_close(h_new, expected[0], "h_new", terms=terms)
        bf16_ulp_close(x, hc_pre(h_new, pre), "x from h_new", terms=hc_pre(h_new.abs(), pre))


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["split", "tf32x3", "ieee"])
def test_gpu_mhc_post_fp32_precisions(precision):
    from dsv41.kernels.triton import mhc as triton_mhc

    h, f, post, comb, pre, fn = streams(1, 1000, 5120, torch.float32, seed=211, device="cuda")
    got = triton_mhc.mhc_post(h, f, post, comb, pre, fn, EPS, precision=precision)
    exp = twin.mhc_post(h, f, post, comb, pre, fn, EPS)
    for g, e, what in zip(got, exp, ("h_new", "x", "mixes")):
        scaled_close(g, e, FP32_RTOL, what)


@pytest.mark.gpu
@pytest.mark.parametrize("B,T", [(1, 1), (4, 4096)])
def test_gpu_mhc_mixes_and_split_v41_flash(B, T):
    h, *_, fn = streams(B, T, 5120, torch.bfloat16, seed=221 + T, device="cuda")
    scale, base = (0.5 + torch.rand(3)).cuda(), torch.randn(K).cuda()
    with torch.no_grad(), use_backend("triton"):
        mixes = ops.mhc_mixes(h, fn, EPS)
        split = ops.mhc_split(mixes, scale, base, N, 20, EPS)
    e_mixes = twin.mhc_mixes(h, fn, EPS)
    # Hopper's MMA accumulates with less than fp32's rounding: over K = 20480 the split projection
    # lands ~3e-5 from cuBLAS fp32 (seen on the H200), so the GPU bound is 2e-4
    scaled_close(mixes, e_mixes, 2e-4, "mixes")
    for got, exp, what in zip(split, twin.mhc_split(mixes, scale, base, N, 20, EPS), ("pre", "post", "comb")):
        assert_close(got, exp, rtol=FP32_RTOL, atol=FP32_RTOL, what=what)


def test_fn_planes_are_split_once_per_unchanged_weight(monkeypatch):
    """Serving splits each mHC weight once: a second pass over the same unchanged hc_fn reuses its planes (no
    split launch); an in-place update, a weight that needs a gradient, or another tensor splits again — and the
    planes used always equal a fresh split of the weight as it is now."""
    from dsv41.kernels.triton import mhc as triton_mhc

    calls = []
    split = triton_mhc._split_fn
    monkeypatch.setattr(triton_mhc, "_split_fn", lambda *a: calls.append(a) or split(*a))
    fn = torch.randn(K, N * 40, generator=torch.Generator().manual_seed(3)) * 0.01
    with torch.no_grad():
        a = triton_mhc._fn_planes(fn, 40, 64, 32)
        b = triton_mhc._fn_planes(fn, 40, 64, 32)
        assert b is a and len(calls) == 1
        fn.mul_(2.0)  # an in-place update (an optimizer step): the version moves
        c = triton_mhc._fn_planes(fn, 40, 64, 32)
        assert len(calls) == 2 and torch.equal(c, split(fn, 40, 64, 32))
        other = fn.clone()
        assert torch.equal(triton_mhc._fn_planes(other, 40, 64, 32), c) and len(calls) == 3
    trained = fn.clone().requires_grad_()
    triton_mhc._fn_planes(trained, 40, 64, 32)
    triton_mhc._fn_planes(trained, 40, 64, 32)
    assert len(calls) == 5  # with gradients: every call
