"""The training Functions of the RMSNorm and SwiGLU twins against their plain formulas: same outputs,
plain autograd's gradients (fp32 to summation order, bf16 inputs to one rounding; SwiGLU with values exactly
on its clamp bounds, with and without routing weights), and no fp32 copy of a bf16 input saved."""

from __future__ import annotations

import pytest
import torch

from dsv41.kernels.ref import norm, swiglu
from dsv41.testing.saved import saved_bytes


def _grad_pair(lean, plain, args, seed=1):
    args_l = [a.detach().clone().requires_grad_(True) for a in args]
    args_p = [a.detach().clone().requires_grad_(True) for a in args]
    out_l, out_p = lean(*args_l), plain(*args_p)
    assert torch.equal(out_l, out_p)
    g = torch.randn(out_l.shape, generator=torch.Generator().manual_seed(seed)).to(out_l.dtype)
    return torch.autograd.grad(out_l, args_l, g), torch.autograd.grad(out_p, args_p, g)


def _close(a, b):
    assert a.dtype == b.dtype
    tol = 1e-2 if a.dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol * 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_backward_equals_plain_autograd(dtype):
    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(4, 9, 96, generator=g)).to(dtype)
    w = 1 + 0.2 * torch.randn(96, generator=g)
    lean = lambda x, w: norm.rms_norm(x, w, 1e-6)  # noqa: E731
    plain = lambda x, w: norm._rms_norm_math(x, w, 1e-6)[0]  # noqa: E731
    for a, b in zip(*_grad_pair(lean, plain, [x, w])):
        _close(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("limit", [0.0, 1.5])
@pytest.mark.parametrize("groups", [None, 1, 4])
def test_swiglu_backward_equals_plain_autograd(dtype, limit, groups):
    g = torch.Generator().manual_seed(2)
    M, C = 6, 32
    gate, up = (2 * torch.randn(M, C, generator=g)), (2 * torch.randn(M, C, generator=g))
    if limit:
        gate[0, :3] = limit  # on the bound: the clamp passes the gradient there (inclusive)
        up[1, :3], up[1, 3] = -limit, limit
    args = [gate.to(dtype), up.to(dtype)] + ([] if groups is None else [torch.rand(M, groups, generator=g)])

    def lean(*a):
        return swiglu.swiglu(a[0], a[1], limit, a[2] if len(a) > 2 else None, torch.float32)

    def plain(*a):
        return swiglu._swiglu_math(a[0], a[1], limit, a[2] if len(a) > 2 else None, torch.float32)

    for a, b in zip(*_grad_pair(lean, plain, args)):
        _close(a, b)


def test_the_lean_functions_save_no_fp32_copy_of_a_bf16_input():
    x = torch.randn(8, 16, 128).to(torch.bfloat16)
    w = torch.ones(128)
    fp32_copy = x.numel() * 4
    assert saved_bytes(lambda x, w: norm._rms_norm_math(x, w, 1e-6)[0], [x, w]) >= fp32_copy  # can fail
    assert saved_bytes(lambda x, w: norm.rms_norm(x, w, 1e-6), [x, w]) < fp32_copy // 16  # the (…, 1) rsqrt
    gate, up, rw = torch.randn(64, 256).to(torch.bfloat16), torch.randn(64, 256).to(torch.bfloat16), torch.rand(64, 1)
    fp32_copy = gate.numel() * 4
    assert saved_bytes(lambda *a: swiglu._swiglu_math(*a[:2], 1.5, a[2], None), [gate, up, rw]) >= fp32_copy
    assert saved_bytes(lambda *a: swiglu.swiglu(*a[:2], 1.5, a[2], None), [gate, up, rw]) == 0
