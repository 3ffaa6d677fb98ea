"""`kernels.triton.norm.rms_norm_train`: the training RMSNorm (a forward kernel that keeps r, a backward kernel
that writes ∂x and per-program ∂w partial sums) against float64 autograd of the formula written out here and
against the twin's `_RMSNorm`. Interpreter tests at small sizes on the CPU — D not a power of two, rows not a
multiple of the tile, several backward programs, views for x and for the cotangent, gradients not needed; a `gpu`
test at `small`'s width."""

from __future__ import annotations

import pytest
import torch
from tests.conftest import assert_close

from dsv41.kernels.ref import norm as twin
from dsv41.kernels.triton import norm

EPS = 1e-6
# Tolerance by output dtype for `_check`: |err| ≤ tol·(|want| + max|want|), the floor judging an element near zero
# against the tensor's scale. Measured (the smallest tol that passes the cases below), against fp64: fp32 y, ∂x, ∂w
# 1.1e-7; bf16 y and ∂x 2.6e-3, ∂w in bf16 1.2e-3; fp16 1.9e-4 — the interpreter rounds fp32 → bf16 / fp16 toward
# zero (one ulp off, 2^-7 relative for bf16; the GPU rounds to nearest). Against the twin: fp32 1.1e-7, bf16 3.0e-3.
TOL = {torch.float32: 5e-7, torch.bfloat16: 8e-3, torch.float16: 8e-4}  # bf16: one ulp


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    """Every output and buffer starts as NaN: an element the kernels never write fails."""
    monkeypatch.setattr(norm, "_empty",
                        lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device))


def _case(shape, dtype, w_dtype=torch.float32, seed=0, device="cpu"):
    """x with rows of scales spread over orders of magnitude and a nonzero mean, a random weight (not ones), and a
    cotangent representable in x's dtype (the gradient reaching y is rounded to it; the fp64 reference is not)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(*shape[:-1], 1, generator=g) * 1.5)
    x = ((torch.randn(*shape, generator=g) + 0.3) * scale).to(dtype).to(device).requires_grad_()
    w = torch.randn(shape[-1], generator=g).to(w_dtype).to(device).requires_grad_()
    ct = torch.randn(*shape, generator=g).to(dtype).to(device)
    return x, w, ct


def _fp64(x: torch.Tensor, w: torch.Tensor, ct: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """y = w·x / sqrt(mean(x²) + eps) and its gradients for the loss Σ y·ct, all in float64."""
    xd = x.detach().double().requires_grad_()
    wd = w.detach().double().requires_grad_()
    y = wd * xd / torch.sqrt(xd.square().mean(-1, keepdim=True) + EPS)
    return (y.detach(), *torch.autograd.grad((y * ct.double()).sum(), (xd, wd)))


def _run(fn, x, w, ct):
    y = fn(x, w, EPS)
    inputs = tuple(t for t in (x, w) if t.requires_grad)
    grads = iter(torch.autograd.grad((y.double() * ct.double()).sum(), inputs))
    return y.detach(), *(next(grads) if t.requires_grad else None for t in (x, w))


def _check(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    tol = TOL[got.dtype]
    assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item(), what=what)


CASES = [((3, 37, 384), torch.bfloat16, torch.float32),  # 111 rows: 7 tiles of 16 in 4 programs, the last half empty
         ((3, 37, 384), torch.float32, torch.float32),
         ((5, 192), torch.float32, torch.float32),
         ((5, 192), torch.bfloat16, torch.bfloat16),  # ∂w in bf16
         ((300, 100), torch.float32, torch.float32),  # D not a power of two; 19 tiles, 5 per program
         ((41, 100), torch.float16, torch.float32)]


@pytest.mark.parametrize("shape,dtype,w_dtype", CASES)
def test_kernels_equal_fp64_formula(shape, dtype, w_dtype):
    x, w, ct = _case(shape, dtype, w_dtype, seed=sum(shape))
    y, gx, gw = _run(norm.rms_norm_train, x, w, ct)
    assert y.dtype == dtype and gx.dtype == dtype and gw.dtype == w_dtype and y.shape == x.shape
    for what, got, want in zip(("y", "grad_x", "grad_w"), (y, gx, gw), _fp64(x, w, ct)):
        _check(got, want, what)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_equal_twin_function(dtype):
    x, w, ct = _case((3, 37, 384), dtype, seed=7)
    got = _run(norm.rms_norm_train, x, w, ct)
    want = _run(twin.rms_norm, x, w, ct)
    for what, a, b in zip(("y", "grad_x", "grad_w"), got, want):
        _check(a, b.double(), what)


def test_gradients_not_needed_are_none():
    x, w, ct = _case((3, 37, 384), torch.bfloat16, seed=3)
    _, gx_all, gw_all = _fp64(x, w, ct)
    y, gx, gw = _run(norm.rms_norm_train, x, w.detach(), ct)  # weight frozen: no partial sums
    assert gw is None
    _check(gx, gx_all, "grad_x alone")
    y, gx, gw = _run(norm.rms_norm_train, x.detach(), w, ct)  # x a constant: no ∂x written
    assert gx is None
    _check(gw, gw_all, "grad_w alone")
    x.grad = w.grad = None
    (norm.rms_norm_train(x, w.detach(), EPS).float() * ct).sum().backward()
    assert x.grad is not None and w.grad is None


@pytest.mark.parametrize("cotangent", ["transposed", "expanded", "strided"])
def test_views_of_x_and_of_the_cotangent(cotangent):
    g = torch.Generator().manual_seed(11)
    base = torch.randn(37, 3, 192, generator=g, requires_grad=True)
    x = base.transpose(0, 1)  # (3, 37, 192), rows not evenly spaced: reshaped by a copy
    w = torch.randn(192, generator=g, requires_grad=True)
    ct = {"transposed": torch.randn(37, 3, 192, generator=g).transpose(0, 1),
          "expanded": torch.randn(192, generator=g).expand(3, 37, 192),  # a row stride of 0, read in place
          "strided": torch.randn(3, 37, 384, generator=g)[..., ::2]}[cotangent]  # last stride 2
    assert not ct.is_contiguous()
    y = norm.rms_norm_train(x, w, EPS)
    gb, gw = torch.autograd.grad(y, (base, w), ct)
    y64, gx64, gw64 = _fp64(x, w, ct)
    _check(y.detach(), y64, "y")
    _check(gb, gx64.transpose(0, 1), "grad_x")
    _check(gw, gw64, "grad_w")
    # x with a non-unit last stride: the (N, D) rows are made contiguous
    wide = torch.randn(5, 384, generator=g, requires_grad=True)
    xs = wide[:, ::2]
    ys = norm.rms_norm_train(xs, w, EPS)
    ct2 = torch.randn(5, 192, generator=g)
    gs, gw2 = torch.autograd.grad((ys * ct2).sum(), (wide, w))
    y64, gx64, gw64 = _fp64(xs, w, ct2)
    _check(ys.detach(), y64, "y (strided x)")
    _check(gs[:, ::2], gx64, "grad_x (strided x)")
    assert torch.equal(gs[:, 1::2], torch.zeros(5, 192))
    _check(gw2, gw64, "grad_w (strided x)")


def test_no_rows():
    x = torch.randn(0, 3, 64, requires_grad=True)
    w = torch.randn(64, requires_grad=True)
    y = norm.rms_norm_train(x, w, EPS)
    gx, gw = torch.autograd.grad(y.sum(), (x, w))
    assert y.shape == x.shape and gx.shape == x.shape and torch.equal(gw, torch.zeros(64))


def test_supported_and_bad_arguments():
    x = torch.randn(2, 3, 64)
    assert norm.supported(x, torch.ones(64)) and norm.supported(x.half(), torch.ones(64, dtype=torch.bfloat16))
    assert not norm.supported(x, torch.ones(63))
    assert not norm.supported(x, torch.ones(1, 64))
    assert not norm.supported(x.long(), torch.ones(64))
    assert not norm.supported(x, torch.ones(64, dtype=torch.float64))
    assert not norm.supported(torch.randn(2, 8200), torch.ones(8200))
    with pytest.raises(ValueError, match="weight"):
        norm.rms_norm_train(x, torch.ones(63), EPS)
    with pytest.raises(ValueError, match="8192"):
        norm.rms_norm_train(torch.randn(2, 8200), torch.ones(8200), EPS)


@pytest.mark.gpu
def test_gpu_kernels_equal_twin_at_small_width():
    """`small`'s width, 16K tokens of bf16: 4096 forward programs, ~4 backward programs per SM of 8 tiles each."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    x, w, ct = _case((16 * 1024, 384), torch.bfloat16, seed=5, device="cuda")
    got = _run(norm.rms_norm_train, x, w, ct)
    want = _run(twin.rms_norm, x, w, ct)
    # the two round the same fp32 values to nearest; r differs by reduction order, so rare one-ulp flips
    for what, a, b in zip(("y", "grad_x", "grad_w"), got, want):
        _check(a, b.double(), what)
    for what, a, b in zip(("y", "grad_x", "grad_w"), got, _fp64(x, w, ct)):
        _check(a, b, what)
