"""The Sinkhorn split's training path on Triton (`ops.mhc_split` under a gradient: `_SinkhornSplit`).

Claims checked (CPU, Triton in its interpreter): the backward kernel's gradients of mixes, hc_scale and hc_base
equal fp64 autograd through the model's `hc_split_sinkhorn` (an independent reference), for several n and
round counts, extreme logits, and any subset of (pre, post, comb) receiving a gradient; the torch twin
(`ref.mhc_split_backward`) equals the same reference; the Function's forward is the inference kernel's; and
a forward + backward runs a handful of torch ops besides its two kernels, where autograd through the rounds
runs hundreds; CUDA trains through it by default (DSV41_TRITON_SINKHORN_BACKWARD=0 opts out).
"""

from __future__ import annotations

import pytest
import torch

from dsv41.kernels import ops
from dsv41.kernels.ops import use_backend
from dsv41.kernels.ref import mhc as twin
from dsv41.model.mhc import hc_split_sinkhorn
from dsv41.testing.sync import OpCounter

EPS = 1e-6
ARITHMETIC = {"add", "sub", "mul", "div", "sum", "exp", "sigmoid", "_softmax", "_softmax_backward_data", "cat",
              "stack", "sigmoid_backward", "neg", "where", "mul_", "add_", "div_"}


def inputs(n: int, seed: int, extreme: bool = False):
    g = torch.Generator().manual_seed(seed)
    k = (2 + n) * n
    mixes = 2 * torch.randn(3, 17, k, generator=g)
    if extreme:  # saturated sigmoids and near one-hot softmax rows
        mixes[0, :4] = 30 * torch.sign(mixes[0, :4])
    scale = torch.tensor([1.0, 0.5, 1.5]) * (0.5 + torch.rand(3, generator=g))
    base = torch.randn(k, generator=g)
    grads = (torch.randn(3, 17, n, generator=g), torch.randn(3, 17, n, generator=g),
             torch.randn(3, 17, n, n, generator=g))
    return mixes, scale, base, grads


def reference(mixes, scale, base, grads, n, iters):
    """fp64 autograd of the model's split: d mixes, d scale, d base."""
    leaves = [t.double().requires_grad_(True) for t in (mixes, scale, base)]
    outs = hc_split_sinkhorn(*leaves, n, iters, EPS)
    pairs = [(o, g.double()) for o, g in zip(outs, grads) if g is not None]
    return torch.autograd.grad([o for o, _ in pairs], leaves, [g for _, g in pairs])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
@pytest.mark.parametrize("n,iters,extreme", [(4, 20, False), (4, 20, True), (4, 1, False), (3, 5, False)])
@pytest.mark.parametrize("present", ["all", "comb", "pre+post"])
def test_backward_kernel_equals_fp64_autograd(n, iters, extreme, present):
    from dsv41.kernels.triton.mhc import mhc_split_backward

    mixes, scale, base, grads = inputs(n, 7 * n + iters, extreme)
    keep = {"all": (1, 1, 1), "comb": (0, 0, 1), "pre+post": (1, 1, 0)}[present]
    grads = tuple(g if k else None for g, k in zip(grads, keep))
    want = reference(mixes, scale, base, grads, n, iters)
    got = mhc_split_backward(mixes, scale, base, *grads, n, iters, EPS)
    errs = [rel(a, b) for a, b in zip(got, want)]
    print(f"n={n} iters={iters} {present}: rel err mixes {errs[0]:.1e} scale {errs[1]:.1e} base {errs[2]:.1e}")
    assert max(errs) <= 2e-5, errs  # measured ≤ 1.6e-6 (fp32 through 39 normalizations)
    tw = twin.mhc_split_backward(mixes, scale, base, *grads, n, iters, EPS)
    assert max(rel(a, b) for a, b in zip(tw, want)) <= 2e-5


def test_training_through_ops_on_triton_equals_the_twin_and_launches_a_handful_of_ops():
    mixes, scale, base, (gp, gq, gc) = inputs(4, 3)
    results = {}
    for backend in ("triton", "torch"):
        leaves = [t.clone().requires_grad_(True) for t in (mixes, scale, base)]
        with use_backend(backend), OpCounter() as ops_seen:
            pre, post, comb = ops.mhc_split(*leaves, 4, 20, EPS)
            torch.autograd.backward([pre, post, comb], [gp, gq, gc])
        # the interpreter copies every kernel argument (set_ / copy_ / empty); count the arithmetic only
        arithmetic = sum(v for k, v in ops_seen.counts.items() if k.split(".")[-1] in ARITHMETIC)
        results[backend] = (pre, post, comb, *[t.grad for t in leaves], arithmetic)
    tri, ref = results["triton"], results["torch"]
    for a, b in zip(tri[:3], ref[:3]):  # the inference kernel's forward
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)
    for a, b in zip(tri[3:6], ref[3:6]):
        assert rel(a, b.double()) <= 2e-5
    print(f"arithmetic torch ops besides the kernels: {tri[6]}; autograd through the rounds: {ref[6]}")
    assert tri[6] <= 12 and ref[6] >= 200  # measured 10 and 424


def test_the_function_saves_only_its_inputs():
    from dsv41.testing.saved import saved_bytes

    mixes, scale, base, _ = inputs(4, 5)

    def split(*leaves):
        return ops.mhc_split(*leaves, 4, 20, EPS)

    with use_backend("triton"):
        lean = saved_bytes(split, (mixes, scale, base))
    with use_backend("torch"):
        plain = saved_bytes(split, (mixes, scale, base))
    print(f"saved beyond the inputs: {lean} B (Function) vs {plain} B (autograd through the rounds)")
    assert lean == 0 and plain > 20 * mixes.numel() * 4  # measured 33x the mixes


@pytest.mark.gpu
def test_gpu_backward_kernel_equals_fp64_autograd_at_training_sizes():
    """16 × 1024 tokens (the train_peer step), compiled for the GPU, against fp64 autograd."""
    from dsv41.kernels.triton.mhc import mhc_split_backward

    g = torch.Generator().manual_seed(11)
    mixes = 2 * torch.randn(16, 1024, 24, generator=g)
    scale, base = 0.5 + torch.rand(3, generator=g), torch.randn(24, generator=g)
    grads = (torch.randn(16, 1024, 4, generator=g), torch.randn(16, 1024, 4, generator=g),
             torch.randn(16, 1024, 4, 4, generator=g))
    want = reference(mixes, scale, base, grads, 4, 20)
    got = mhc_split_backward(mixes.cuda(), scale.cuda(), base.cuda(), *(t.cuda() for t in grads), 4, 20, EPS)
    assert max(rel(a.cpu(), b) for a, b in zip(got, want)) <= 2e-5


def test_cuda_trains_through_the_kernels_by_default_and_the_variable_opts_out(monkeypatch):
    """The default since the kernel ran on the H200 (= fp64 autograd there): CUDA tensors train through
    `_SinkhornSplit` unless DSV41_TRITON_SINKHORN_BACKWARD=0; CPU tensors never do under `auto`."""
    from types import SimpleNamespace

    cuda, cpu = SimpleNamespace(is_cuda=True), SimpleNamespace(is_cuda=False)
    monkeypatch.setattr(ops, "HAVE_TRITON", True)
    monkeypatch.delenv("DSV41_TRITON_SINKHORN_BACKWARD", raising=False)
    assert ops._trains_on_triton(cuda, cuda) and not ops._trains_on_triton(cuda, cpu)
    monkeypatch.setenv("DSV41_TRITON_SINKHORN_BACKWARD", "0")
    assert not ops._trains_on_triton(cuda, cuda)
    monkeypatch.setenv("DSV41_TRITON_SINKHORN_BACKWARD", "1")
    assert ops._trains_on_triton(cuda, cuda)
    monkeypatch.setattr(ops, "HAVE_TRITON", False)
    assert not ops._trains_on_triton(cuda, cuda)
