"""The training Functions of mHC's stream ops (hc_pre, hc_post, hc_project) against the plain formulas:
the same outputs, the gradients of plain autograd (fp32: to summation order; bf16 streams: one rounding),
and the point of them — what they save for the backward holds no fp32 copy of a bf16 stream."""

from __future__ import annotations

import pytest
import torch

from dsv41.model import mhc
from dsv41.testing.saved import saved_bytes

B, T, N, D = 2, 5, 4, 48


def _inputs(dtype, stream_dtype=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    sd = stream_dtype or dtype
    x = torch.randn(B, T, N, D, generator=g, dtype=dtype).to(sd)
    f = torch.randn(B, T, D, generator=g, dtype=dtype).to(sd)
    pre = torch.rand(B, T, N, generator=g, dtype=dtype)
    post = 2 * torch.rand(B, T, N, generator=g, dtype=dtype)
    comb = torch.rand(B, T, N, N, generator=g, dtype=dtype).softmax(-1)
    fn = torch.randn((2 + N) * N, N * D, generator=g, dtype=dtype) * 0.05
    return x, f, pre, post, comb, fn


CASES = {
    "hc_pre": (lambda x, f, pre, post, comb, fn: (x, pre), mhc.hc_pre, mhc._hc_pre_math),
    "hc_post": (lambda x, f, pre, post, comb, fn: (f, x, post, comb), mhc.hc_post, mhc._hc_post_math),
    "hc_project": (lambda x, f, pre, post, comb, fn: (x, fn), lambda a, w: mhc.hc_project(a, w, 1e-6),
                   lambda a, w: mhc._hc_project_math(a, w, 1e-6)),
}


def _grads(fn, args, cotangent_seed=1):
    args = [a.detach().clone().requires_grad_(True) for a in args]
    out = fn(*args)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(cotangent_seed))
    grads = torch.autograd.grad(out, args, g.to(out.dtype))
    return out.detach(), grads


@pytest.mark.parametrize("name", sorted(CASES))
def test_lean_functions_equal_plain_autograd_in_fp32(name):
    """The formulas compute in fp32 (`.float()`), so fp32 is their exact setting; measured differences are
    ~1e-7 (summation order), far below the bound; a wrong term in a backward is O(1)."""
    pick, lean, plain = CASES[name]
    args = pick(*_inputs(torch.float32))
    out_l, grads_l = _grads(lean, args)
    out_p, grads_p = _grads(plain, args)
    torch.testing.assert_close(out_l, out_p, rtol=0, atol=0)
    for a, b in zip(grads_l, grads_p):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(CASES))
def test_lean_functions_with_bf16_streams_match_plain_autograd(name):
    pick, lean, plain = CASES[name]
    args = pick(*_inputs(torch.float32, stream_dtype=torch.bfloat16, seed=3))
    out_l, grads_l = _grads(lean, args)
    out_p, grads_p = _grads(plain, args)
    torch.testing.assert_close(out_l, out_p, rtol=0, atol=0)
    for a, b in zip(grads_l, grads_p):
        assert a.dtype == b.dtype
        tol = 1e-2 if a.dtype == torch.bfloat16 else 1e-5  # bf16 grads: one rounding apart at most
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol * 1e-2)


@pytest.mark.parametrize("name", sorted(CASES))
def test_lean_functions_save_no_fp32_copy_of_a_bf16_stream(name):
    pick, lean, plain = CASES[name]
    args = pick(*_inputs(torch.float32, stream_dtype=torch.bfloat16, seed=5))
    stream = B * T * N * D * 4  # bytes of one fp32 copy of the streams
    assert saved_bytes(plain, args) >= stream  # what autograd of the formula keeps (the check can fail)
    assert saved_bytes(lean, args) < stream // 4  # only small per-token tensors (hc_project: lin, rsqrt)


def test_the_functions_run_only_where_a_gradient_is_taken():
    """Training (a gradient needed) goes through the Functions; inference (no_grad, or no input requiring a
    gradient) keeps the plain formulas — the engine's path is unchanged."""
    x, f, pre, post, comb, fn = _inputs(torch.float32)
    x.requires_grad_(True)
    assert type(mhc.hc_pre(x, pre).grad_fn).__name__ == "_HcPreBackward"
    assert type(mhc.hc_post(f, x, post, comb).grad_fn).__name__ == "_HcPostBackward"
    assert type(mhc.hc_project(x, fn, 1e-6).grad_fn).__name__ == "_HcProjectBackward"
    with torch.no_grad():
        assert torch.equal(mhc.hc_pre(x, pre), mhc._hc_pre_math(x, pre))
    assert mhc.hc_pre(x.detach(), pre).grad_fn is None
