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


def _complex_rope64(x: torch.Tensor, cos, sin, inverse: bool) -> torch.Tensor:
    """The rotation written as complex products in fp64 (independent of `apply_rope`), differentiable."""
    R = 2 * cos.size(-1)
    angle = torch.atan2(sin.double(), cos.double()) * (-1.0 if inverse else 1.0)
    if x.dim() == cos.dim() + 1:
        angle = angle.unsqueeze(-2)
    z = torch.view_as_complex(x[..., -R:].unflatten(-1, (-1, 2)).contiguous())
    return torch.cat((x[..., :-R], torch.view_as_real(z * torch.polar(torch.ones_like(angle), angle)).flatten(-2)), -1)


@pytest.mark.parametrize("shape,R", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_training_kernels_equal_autograd_bit_for_bit(shape, R, dtype, inverse):
    """Under a gradient the kernel path (`ops._RoPE`: forward kernel, backward = the kernel with the angles
    negated) gives the output and x's gradient of autograd through `apply_rope` bit for bit, and both equal fp64
    autograd through a complex rotation to x's rounding; the cotangent arrives non-contiguous."""
    g = torch.Generator().manual_seed(hash(("train", shape, R, str(dtype), inverse)) % 2**31)
    x = _x(shape, dtype, g)
    cos, sin = _angles(shape[0], shape[1], R, g)
    cot = torch.randn(*reversed(shape), generator=g).to(dtype).permute(*reversed(range(len(shape))))
    results = {}
    for name in ("torch", "triton"):
        leaf = x.clone().requires_grad_(True)
        with use_backend(name):
            y = ops.rope(leaf, cos, sin, inverse=inverse)
        assert ("_RoPE" in type(y.grad_fn).__name__) == (name == "triton")  # the kernel Function ran, or autograd
        y.backward(cot)
        results[name] = (y.detach(), leaf.grad)
    (y_k, gx_k), (y_t, gx_t) = results["triton"], results["torch"]
    assert torch.equal(y_k, y_t) and torch.equal(gx_k, gx_t), f"max grad diff {(gx_k - gx_t).abs().max():.3e}"
    x64 = x.double().requires_grad_(True)
    _complex_rope64(x64, cos, sin, inverse).backward(cot.double())
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-5)
    torch.testing.assert_close(gx_k.double(), x64.grad, **tol)
    assert gx_k.dtype == dtype


def test_rope_training_takes_the_twin_where_the_kernel_does_not_fit():
    """`auto` on the CPU, angles that need a gradient, or D not a multiple of 32: autograd through the twin."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(2, 3, 64, generator=g, requires_grad=True)
    cos, sin = _angles(2, 3, 16, g)
    assert "_RoPE" not in type(ops.rope(x, cos, sin).grad_fn).__name__  # auto, CPU tensors
    with use_backend("triton"):
        assert "_RoPE" in type(ops.rope(x, cos, sin).grad_fn).__name__
        assert "_RoPE" not in type(ops.rope(x, cos.requires_grad_(), sin).grad_fn).__name__


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
@pytest.mark.parametrize("shape,R", [((16, 1024, 6, 128), 64), ((16, 1024, 128), 64), ((16, 1024, 4, 64), 64)])
def test_gpu_rope_training_equals_autograd(shape, R):
    """`small`'s training shapes (queries, window keys, indexer queries): the kernel Function against autograd
    through the twin, output and gradient bit for bit."""
    g = torch.Generator().manual_seed(9)
    x = _x(shape, torch.bfloat16, g, "cuda")
    cos, sin = _angles(shape[0], shape[1], R, g, "cuda")
    cot = torch.randn(*shape, generator=g).to(torch.bfloat16).cuda()
    out = {}
    for name in ("torch", "auto"):
        leaf = x.clone().requires_grad_(True)
        with use_backend(name):
            y = ops.rope(leaf, cos, sin, inverse=True)
        assert ("_RoPE" in type(y.grad_fn).__name__) == (name == "auto")
        y.backward(cot)
        out[name] = (y.detach(), leaf.grad)
    assert torch.equal(out["auto"][0], out["torch"][0]) and torch.equal(out["auto"][1], out["torch"][1])


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(64, 1, 384), (8192, 5120), (3, 7, 1280)])
def test_gpu_rms_norm_equals_twin(shape):
    g = torch.Generator().manual_seed(6)
    x = _x(shape, torch.bfloat16, g, "cuda")
    w = torch.randn(shape[-1], generator=g).cuda()
    got, want = _both(ops.rms_norm, x, w, 1e-20)
    torch.testing.assert_close(got, want, rtol=8e-3, atol=1e-5)
