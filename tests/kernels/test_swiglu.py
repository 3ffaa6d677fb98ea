"""`ops.swiglu`: the Triton kernel against its twin, and the twin against the formula written out here
(clamp, silu, routing weight per row or per expert block, one rounding)."""

from __future__ import annotations

import pytest
import torch

from dsv41.kernels import ops
from dsv41.kernels.ops import use_backend


def formula(g, u, limit, weight, dtype):
    g, u = g.double(), u.double()
    if limit > 0:
        u, g = u.clamp(-limit, limit), g.clamp(max=limit)
    h = g * torch.sigmoid(g) * u
    if weight is not None:
        G = weight.size(1)
        h = h * weight.double().repeat_interleave(h.size(1) // G, dim=1)
    return h.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_cols", [None, 1, 4])
@pytest.mark.parametrize("limit", [10.0, 0.5, 0.0])
def test_kernel_equals_twin_equals_formula(dtype, weight_cols, limit):
    g0 = torch.Generator().manual_seed(hash((str(dtype), weight_cols, limit)) % 2**31)
    M, C = 13, 96
    gate = (torch.randn(M, C, generator=g0) * 6).to(dtype)  # beyond the clamp on both sides
    up = (torch.randn(M, C, generator=g0) * 6).to(dtype)
    weight = None if weight_cols is None else torch.rand(M, weight_cols, generator=g0)
    with use_backend("torch"):
        twin = ops.swiglu(gate, up, limit, weight, torch.bfloat16)
    with use_backend("triton"):
        got = ops.swiglu(gate, up, limit, weight, torch.bfloat16)
        got32 = ops.swiglu(gate, up, limit, weight, torch.float32)
    want = formula(gate, up, limit, weight, torch.float64)
    assert twin.dtype == got.dtype == torch.bfloat16
    torch.testing.assert_close(got32.double(), want, rtol=2e-6, atol=1e-6)
    # bf16 outputs: the same value up to one unit in the last place
    diff = (got.float() - twin.float()).abs()
    assert (diff <= twin.float().abs() * 2**-7 + 1e-30).all(), diff.max()
    torch.testing.assert_close(twin.double(), want.to(torch.bfloat16).double(), rtol=2**-7, atol=1e-30)
    if limit > 0:  # the clamp is exercised: values beyond the limit exist
        assert (up.float().abs() > limit).any() and (gate.float() > limit).any()


def test_the_moe_hidden_is_the_fused_op():
    """The experts call ops.swiglu; on the twin its numbers are the formula's, bit for bit."""
    from dsv41.model.moe import _swiglu

    g0 = torch.Generator().manual_seed(7)
    gate, up, w = torch.randn(5, 32, generator=g0), torch.randn(5, 32, generator=g0), torch.rand(5, 1, generator=g0)
    with use_backend("torch"):
        assert torch.equal(ops.swiglu(gate, up, 10.0, w, torch.float32), _swiglu(gate, up, 10.0, w))


def test_bad_shapes_are_clear_errors():
    with use_backend("triton"), pytest.raises(ValueError, match="weight"):
        ops.swiglu(torch.randn(4, 30), torch.randn(4, 30), 10.0, torch.rand(4, 4))


@pytest.mark.gpu
@pytest.mark.parametrize("shape,weight_cols", [((64, 2048), 8), ((8192, 256), 1), ((128, 2304), None)])
def test_gpu_kernel_equals_twin(shape, weight_cols):
    g0 = torch.Generator().manual_seed(8)
    gate = (torch.randn(*shape, generator=g0) * 6).to(torch.bfloat16).cuda()
    up = (torch.randn(*shape, generator=g0) * 6).to(torch.bfloat16).cuda()
    weight = None if weight_cols is None else torch.rand(shape[0], weight_cols, generator=g0).cuda()
    with use_backend("torch"):
        twin = ops.swiglu(gate, up, 10.0, weight, torch.bfloat16)
    with use_backend("triton"):
        got = ops.swiglu(gate, up, 10.0, weight, torch.bfloat16)
    diff = (got.float() - twin.float()).abs()
    assert (diff <= twin.float().abs() * 2**-7 + 1e-30).all(), diff.max()
