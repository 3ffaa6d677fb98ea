"""`ops.rope`, `ops.rope_fake_quant` and `ops.rms_norm`: the Triton kernels against their twins — the
model's own `apply_rope`, `fake_quant_fp4` and the RMSNorm formula — and the twins against
from-formula references (complex rotation, fp64 RMS). Interpreter tests at small sizes on the CPU;
`gpu` tests at the model's sizes."""

from __future__ import annotations

import pytest
import torch

from dsv41.kernels import ops
from dsv41.kernels.ops import use_backend
from dsv41.model.rope import apply_rope, rope_angles, rope_frequencies
from dsv41.quant.fp4 import fake_quant_fp4


def _x(shape, dtype, g, device="cpu") -> torch.Tensor:
    spread = torch.exp(torch.randn(*shape, generator=g) * 2.0)  # block amaxes spread over orders of magnitude
    return (torch.randn(*shape, generator=g) * spread).to(dtype).to(device)


def _angles(B, T, R, g, device="cpu"):
    positions = torch.randint(0, 1 << 17, (B, T), generator=g)
    positions[0, 0] = 0
    cos, sin = rope_angles(rope_frequencies(R, 160000.0, 65536, 16.0), positions)
    return cos.to(device), sin.to(device)


def _both(fn, *args):
    with use_backend("torch"):
        want = fn(*args)
    with use_backend("triton"):
        got = fn(*args)
    return got, want


CASES = [((3, 5, 4, 64), 32), ((2, 7, 128), 64), ((1, 3, 6, 32), 16)]  # x shape, rotary dims R


@pytest.mark.parametrize("shape,R", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_kernel_equals_apply_rope_bit_for_bit(shape, R, dtype, inverse):
    g = torch.Generator().manual_seed(hash((shape, R, str(dtype), inverse)) % 2**31)
    x = _x(shape, dtype, g)
    cos, sin = _angles(shape[0], shape[1], R, g)
    got, want = _both(lambda *a: ops.rope(*a, inverse=inverse), x, cos, sin)
    assert got.dtype == x.dtype and got.shape == x.shape
    assert torch.equal(got, want), f"max diff {(got.float() - want.float()).abs().max():.3e}"
    assert torch.equal(got[..., :-R], x[..., :-R])  # the channels before the rotary tail are copied


def test_apply_rope_is_a_complex_rotation_and_inverse_undoes_it():
    """The twin against the formula: pairs (2i, 2i+1) of the tail as complex numbers times e^{±iθ}."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 3, 32, generator=g, dtype=torch.float64)
    cos, sin = _angles(2, 5, 16, g)
    z = torch.view_as_complex(x[..., -16:].reshape(2, 5, 3, 8, 2).contiguous())
    rot = torch.polar(torch.ones_like(cos.double()), torch.atan2(sin.double(), cos.double())).unsqueeze(2)
    want = torch.cat((x[..., :-16], torch.view_as_real(z * rot).flatten(-2)), -1)
    torch.testing.assert_close(apply_rope(x, cos, sin), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(apply_rope(apply_rope(x, cos, sin), cos, sin, inverse=True), x, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fmt,block,kind", [("index_fp4", 32, "e8m0"), ("kv_fp4", 16, "e4m3")])
@pytest.mark.parametrize("shape,R", CASES[:2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_fake_quant_kernel_equals_the_model_path_bit_for_bit(fmt, block, kind, shape, R, dtype):
    g = torch.Generator().manual_seed(hash((fmt, shape, str(dtype))) % 2**31)
    x = _x(shape, dtype, g)
    cos, sin = _angles(shape[0], shape[1], R, g)
    got, want = _both(lambda *a: ops.rope_fake_quant(*a, fmt), x, cos, sin)
    assert torch.equal(want, fake_quant_fp4(apply_rope(x, cos, sin), block, kind))
    assert got.dtype == x.dtype
    assert torch.equal(got, want), f"{(got != want).sum()} of {got.numel()} values differ"
    # a quantizer that does anything: values moved onto the FP4 grid (few distinct magnitudes per block)
    assert not torch.equal(got, apply_rope(x, cos, sin))


@pytest.mark.parametrize("shape", [(4, 3, 384), (1, 1, 64), (37, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_kernel_equals_twin_and_fp64_formula(shape, dtype):
    g = torch.Generator().manual_seed(sum(shape))
    x = _x(shape, dtype, g)
    w = torch.randn(shape[-1], generator=g)
    got, want = _both(ops.rms_norm, x, w, 1e-6)
    ref = (w.double() * x.double() / torch.sqrt(x.double().square().mean(-1, keepdim=True) + 1e-6)).to(dtype)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-5)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(want, ref, **tol)
    assert got.dtype == dtype and got.shape == x.shape


def test_bad_arguments_are_clear_errors():
    x = torch.randn(2, 3, 64)
    cos, sin = torch.ones(2, 3, 16), torch.zeros(2, 3, 16)
    with use_backend("triton"):
        with pytest.raises(ValueError, match="fmt"):
            ops.rope_fake_quant(x, cos, sin, "window_fp8")
        with pytest.raises(ValueError, match="multiple of"):
            ops.rope_fake_quant(torch.randn(2, 3, 48), cos, sin, "index_fp4")
        with pytest.raises(ValueError, match="weight"):
            ops.rms_norm(x, torch.ones(63), 1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,R", [((64, 1, 64, 512), 64), ((1, 4096, 32, 128), 64), ((128, 1, 6, 128), 64)])
def test_gpu_rope_kernels_equal_twins(shape, R):
    g = torch.Generator().manual_seed(5)
    x = _x(shape, torch.bfloat16, g, "cuda")
    cos, sin = _angles(shape[0], shape[1], R, g, "cuda")
    for inverse in (False, True):
        got, want = _both(lambda *a, inv=inverse: ops.rope(*a, inverse=inv), x, cos, sin)
        assert torch.equal(got, want)
    got, want = _both(lambda *a: ops.rope_fake_quant(*a, "index_fp4"), x, cos, sin)
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(64, 1, 384), (8192, 5120), (3, 7, 1280)])
def test_gpu_rms_norm_equals_twin(shape):
    g = torch.Generator().manual_seed(6)
    x = _x(shape, torch.bfloat16, g, "cuda")
    w = torch.randn(shape[-1], generator=g).cuda()
    got, want = _both(ops.rms_norm, x, w, 1e-20)
    torch.testing.assert_close(got, want, rtol=8e-3, atol=1e-5)
