"""The training SwiGLU on Triton (`kernels/triton/swiglu.swiglu_train`: the inference kernel forward, one backward
kernel) against float64 autograd of the formula written out here and against the twin's `_SwiGLU`: the output and
the gradients of gate, up and the routing weight (per row, G = 1, or per block of columns, G = 4), with values
beyond the clamp on both sides and exactly on its bounds, fp32 and bf16 inputs and outputs, only the gradients
asked for, column slices of one (M, 2C) tensor as inputs and non-contiguous cotangents. CPU tests run the kernels in
Triton's interpreter; the `gpu` test repeats the twin comparison at the model's sizes."""

from __future__ import annotations

import pytest
import torch

from dsv41.kernels.ref import swiglu as twin

kernel = pytest.importorskip("dsv41.kernels.triton.swiglu")

M, C = 13, 96  # 2 row blocks (the last partial) and, with G = 1, 3 column blocks in the interpreter

# Measured (every limit, weight and dtype below; three seeds), error over the tensor's largest magnitude, fp32
# results vs float64: y 1.4e-7, grad_gate 6.1e-7 (1 + g(1 − σ) cancels near g ≈ −1.28), grad_up 1.3e-7,
# grad_w 2.4e-7. bf16 results are the float64 values rounded once: each within 2^-8.02 of its own magnitude (half a
# unit in the last place) beyond 2e-7 of the largest (fp32 noise) — except the forward's bf16 y, whose interpreter
# cast truncates: one unit, 2^-7.02.
FP32_REL = 2e-6
BF16_REL = 2**-8  # the backward rounds to nearest, on the GPU and (bit arithmetic) in the interpreter
Y_BF16_REL = 2**-7  # the forward kernel's cast in the interpreter (unchanged inference path)
# kernel vs twin, measured (three seeds): fp32 results ≤ 2.1e-7 of the largest magnitude; bf16 gradients equal
# beyond 1e-7 of it, bf16 y one unit apart (the interpreter's truncating cast)
TWIN_REL = 2e-6


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    """Every output and workspace of the backward starts as NaN: an element the kernel never writes fails."""
    monkeypatch.setattr(kernel, "_empty",
                        lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device))


def formula(g, u, limit, weight):
    """silu(min(g, limit)) · clamp(u, ±limit), column j times weight[:, j // (C / G)] (float64 in, float64 out)."""
    if limit > 0:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    h = g * torch.sigmoid(g) * u
    if weight is not None:
        h = h * weight.repeat_interleave(h.size(1) // weight.size(1), dim=1)
    return h


def make_inputs(dtype, limit, weight_cols, seed, rows=M, cols=C):
    g0 = torch.Generator().manual_seed(seed)
    gate = torch.randn(rows, cols, generator=g0) * 6  # beyond the clamp on both sides
    up = torch.randn(rows, cols, generator=g0) * 6
    if limit > 0:  # exactly on the bounds: torch.clamp passes the gradient there (inclusive)
        gate[0, :4] = limit
        gate[1, 5], gate[2, 7] = -limit, limit
        up[1, :3], up[2, 3:6] = limit, -limit
        up[0, 9] = limit
    weight = None if weight_cols is None else torch.rand(rows, weight_cols, generator=g0) + 0.5
    cot = torch.randn(rows, cols, generator=g0)
    return gate.to(dtype), up.to(dtype), weight, cot


def _check(actual, expected, what, bf16_rel=BF16_REL):
    """fp32: FP32_REL of the largest magnitude; bf16: one rounding of each element (+ fp32 noise)."""
    a, e = actual.detach().double(), expected.detach().double()
    assert a.shape == e.shape and bool(torch.isfinite(a).all()), f"{what}: shape or an unwritten element"
    err = (a - e).abs()
    scale = e.abs().max().clamp_min(1e-30)
    bound = (bf16_rel * e.abs() + FP32_REL * scale) if actual.dtype == torch.bfloat16 else FP32_REL * scale
    assert bool((err <= bound).all()), (f"{what} ({actual.dtype}): max err {err.max().item():.3e}, "
                                        f"rel to max {(err.max() / scale).item():.3e}")


def _check_twin(actual, expected, what):
    """Kernel vs twin, both fp32 math then one rounding: TWIN_REL of the largest magnitude (sigmoid's exp, sum
    order), and in bf16 one unit in the last place of each element (two roundings of values that differ)."""
    a, e = actual.detach().double(), expected.detach().double()
    assert actual.dtype == expected.dtype and a.shape == e.shape and bool(torch.isfinite(a).all()), what
    err = (a - e).abs()
    scale = e.abs().max().clamp_min(1e-30)
    bound = TWIN_REL * scale + (2**-7 * e.abs() if actual.dtype == torch.bfloat16 else 0)
    assert bool((err <= bound).all()), (f"{what} ({actual.dtype}): max err {err.max().item():.3e}, "
                                        f"rel to max {(err.max() / scale).item():.3e}")


def _leaves(*tensors):
    return [None if t is None else t.detach().clone().requires_grad_(True) for t in tensors]


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_cols", [None, 1, 4])
@pytest.mark.parametrize("limit", [10.0, 0.5, 0.0])
def test_equals_float64_autograd_of_the_formula(limit, weight_cols, dtype, out_dtype):
    gate, up, weight, cot = make_inputs(dtype, limit, weight_cols, seed=int(10 * limit) + 7 * (weight_cols or 0))
    cot = cot.to(out_dtype).double()  # what reaches the backward is in out_dtype: both sides get the same values
    g, u, w = _leaves(gate, up, weight)
    y = kernel.swiglu_train(g, u, limit, w, out_dtype)
    (y.double() * cot).sum().backward()
    g64, u64, w64 = _leaves(gate.double(), up.double(), None if weight is None else weight.double())
    y64 = formula(g64, u64, limit, w64)
    (y64 * cot).sum().backward()
    assert y.dtype == out_dtype and g.grad.dtype == u.grad.dtype == dtype
    _check(y, y64, "y", Y_BF16_REL)
    _check(g.grad, g64.grad, "grad_gate")
    _check(u.grad, u64.grad, "grad_up")
    if weight is not None:
        assert w.grad.dtype == weight.dtype
        _check(w.grad, w64.grad, "grad_w")
    if limit > 0:  # both clamps bite, on both sides, and the bounds' gradients are nonzero
        gf, uf = gate.float(), up.float()
        assert (gf > limit).any() and (uf > limit).any() and (uf < -limit).any()
        assert (g64.grad[gf == limit] != 0).all() and (u64.grad[uf.abs() == limit] != 0).all()
        assert (g.grad[gf > limit] == 0).all() and (u.grad[uf.abs() > limit] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_cols", [None, 1, 4])
def test_equals_the_twin_function(dtype, weight_cols):
    """Same forward and gradients as `kernels.ref.swiglu` under grad (its `_SwiGLU`), up to fp32 rounding of the
    sigmoid and the sums (bf16: one unit in the last place)."""
    limit = 0.5
    gate, up, weight, cot = make_inputs(dtype, limit, weight_cols, seed=11)
    got_in, want_in = _leaves(gate, up, weight), _leaves(gate, up, weight)
    got = kernel.swiglu_train(*got_in[:2], limit, got_in[2], dtype)
    want = twin.swiglu(*want_in[:2], limit, want_in[2], dtype)
    assert want.grad_fn is not None and type(want.grad_fn).__name__.startswith("_SwiGLU")
    cot = cot.to(dtype)
    got.backward(cot)
    want.backward(cot)
    _check_twin(got, want, "y")
    for name, a, b in zip(("gate", "up", "weight"), got_in, want_in):
        if a is not None:
            _check_twin(a.grad, b.grad, f"grad_{name}")


@pytest.mark.parametrize("needed", ["gate+up", "up+weight", "weight", "gate"])
def test_only_the_gradients_asked_for(needed):
    """ctx.needs_input_grad: leaves not requiring grad get none; the others are the float64 formula's."""
    limit = 0.5
    gate, up, weight, cot = make_inputs(torch.float32, limit, 4, seed=5)
    wants = needed.split("+")
    g, u, w = (t.detach().clone().requires_grad_(name in wants)
               for name, t in zip(("gate", "up", "weight"), (gate, up, weight)))
    y = kernel.swiglu_train(g, u, limit, w, torch.float32)
    (y.double() * cot).sum().backward()
    g64, u64, w64 = _leaves(gate.double(), up.double(), weight.double())
    (formula(g64, u64, limit, w64) * cot).sum().backward()
    for name, leaf, ref in (("gate", g, g64), ("up", u, u64), ("weight", w, w64)):
        if name in wants:
            _check(leaf.grad, ref.grad, f"grad_{name}")
        else:
            assert leaf.grad is None, name


def test_nothing_asked_for_is_nothing_returned():
    gate, up, weight, cot = make_inputs(torch.float32, 0.5, 1, seed=6)
    assert kernel.swiglu_backward(gate, up, weight, cot, 0.5, False, False, False) == (None, None, None)
    assert kernel.swiglu_backward(gate, up, None, cot, 0.5, False, False, True) == (None, None, None)


@pytest.mark.parametrize("weight_cols", [None, 4])
def test_column_slices_and_non_contiguous_cotangents(weight_cols, monkeypatch):
    """gate, up = gu[:, :C], gu[:, C:] (as the experts pass them) and cotangents with odd strides — a column slice,
    a transposed layout, a broadcast (y.sum()'s stride-0 gradient) — reaching the kernel as they are."""
    limit = 0.5
    gate, up, weight, _ = make_inputs(torch.bfloat16, limit, weight_cols, seed=9)
    g0 = torch.Generator().manual_seed(10)
    cotangents = {"slice": torch.randn(M, 3 * C, generator=g0)[:, C:2 * C],
                  "transposed": torch.randn(C, M, generator=g0).t(),
                  "broadcast": torch.randn(1, 1, generator=g0).expand(M, C)}
    seen = []
    backward = kernel.swiglu_backward

    def spy(gate, up, weight, grad, *rest):
        seen.append((gate.stride(), grad.stride()))
        return backward(gate, up, weight, grad, *rest)

    monkeypatch.setattr(kernel, "swiglu_backward", spy)
    for name, cot in cotangents.items():
        gu = torch.cat([gate, up], dim=1).requires_grad_(True)
        w = None if weight is None else weight.clone().requires_grad_(True)
        y = kernel.swiglu_train(gu[:, :C], gu[:, C:], limit, w, torch.float32)
        grads = torch.autograd.grad(y, [gu] + ([] if w is None else [w]), cot)
        assert seen[-1] == ((2 * C, 1), cot.stride()), (name, seen[-1])
        gu64, w64 = _leaves(torch.cat([gate, up], dim=1).double(), None if weight is None else weight.double())
        y64 = formula(gu64[:, :C], gu64[:, C:], limit, w64)
        want = torch.autograd.grad(y64, [gu64] + ([] if w64 is None else [w64]), cot.double())
        for what, a, b in zip(("grad_gu", "grad_w"), grads, want):
            _check(a, b, f"{name} {what}")


@pytest.mark.gpu
def test_gpu_equals_twin_at_model_sizes():
    """M = 32768 routed rows, C = 256, a per-row weight, bf16 on CUDA: forward and every gradient vs the twin."""
    limit = 10.0
    gate, up, weight, cot = make_inputs(torch.bfloat16, limit, 1, seed=12, rows=32768, cols=256)
    gate, up, weight, cot = (t.cuda() for t in (gate, up, weight, cot))
    got_in, want_in = _leaves(gate, up, weight), _leaves(gate, up, weight)
    got = kernel.swiglu_train(*got_in[:2], limit, got_in[2], torch.bfloat16)
    want = twin.swiglu(*want_in[:2], limit, want_in[2], torch.bfloat16)
    cot = cot.to(torch.bfloat16)
    got.backward(cot)
    want.backward(cot)
    _check_twin(got, want, "y")
    for name, a, b in zip(("gate", "up", "weight"), got_in, want_in):
        _check_twin(a.grad, b.grad, f"grad_{name}")


def test_supported_shapes():
    a, b = torch.randn(4, 32), torch.randn(4, 32).to(torch.bfloat16)
    assert kernel.supported(a, b) and kernel.supported(a, b, torch.rand(4, 1))
    assert kernel.supported(a, b, torch.rand(4, 8).half())
    assert not kernel.supported(a, b, torch.rand(4, 3))  # 32 % 3
    assert not kernel.supported(a, torch.randn(4, 16)) and not kernel.supported(a[None], b[None])
    assert not kernel.supported(a.double(), b) and not kernel.supported(a, b, torch.rand(5, 1))
    with pytest.raises(ValueError, match="swiglu_train"):
        kernel.swiglu_train(a, b, 1.0, torch.rand(4, 3))
