"""The indexer's selected-entry scores in Triton (`kernels/triton/selected_scores.py`, issue 18) against a float64
formula written here and against the torch twin (`model.sparse_attention._SelectedScores`, and its plain-autograd
form): scores and the gradients of the index queries, the head weights and the index keys, with −1 picks, picks
shared by many queries (the atomics), Hi not a power of two and K not a multiple of the tile. CPU tests run the
kernels in Triton's interpreter; the `gpu` test repeats the comparison at `small` widths in fp32 and bf16 and checks
that the training path picks the kernels on CUDA."""

from __future__ import annotations

import pytest
import torch

from dsv41.kernels import ops
from dsv41.model import sparse_attention
from dsv41.model.sparse_attention import _SelectedScores, selected_index_scores_reference

kernel = pytest.importorskip("dsv41.kernels.triton.selected_scores")

# fp32 kernel vs the float64 formula, max error over the largest magnitude. Measured: ≤ 3e-7 (scores and
# every gradient; the twin is as far); the tolerance is a few times that.
REL = 2e-6
NAMES = ("iq", "weights", "index_k")


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    """Every output starts as NaN: an element the kernels never write fails."""
    monkeypatch.setattr(kernel, "_empty",
                        lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device))


def make_case(B, T, H, D, N, K, *, seed, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    iq = torch.randn(B, T, H, D, generator=g)
    weights = torch.randn(B, T, H, generator=g)
    index_k = torch.randn(B, N, D, generator=g)
    topk = torch.argsort(torch.rand(B, T, N, generator=g), dim=-1)[..., :K]  # distinct per query
    topk = torch.where(torch.rand(B, T, K, generator=g) < 0.2, -1, topk)  # −1: reads row 0
    leaves = [x.to(device=device, dtype=dtype).requires_grad_(True) for x in (iq, weights, index_k)]
    return leaves, topk.to(device)


def formula64(iq, weights, index_k, topk):
    """float64: s[b, t, k] = Σ_h w[b, t, h] · max(0, Σ_d iq[b, t, h, d] · index_k[b, max(topk, 0), d])."""
    B, T, K = topk.shape
    rows = index_k.double()[torch.arange(B).view(B, 1, 1), topk.clamp(min=0)]  # (B, T, K, Di)
    dots = (iq.double().unsqueeze(3) * rows.unsqueeze(2)).sum(-1)  # (B, T, Hi, K)
    return (dots.clamp(min=0) * weights.double().unsqueeze(-1)).sum(2)


def _rel(actual, expected):
    a, e = actual.detach().double(), expected.detach().double()
    assert a.shape == e.shape and bool(torch.isfinite(a).all()), "shape or an unwritten element"
    return ((a - e).abs().max() / e.abs().max().clamp_min(1e-30)).item()


CASES = {
    "small-heads": dict(B=2, T=9, H=3, D=16, N=7, K=5),  # K < one tile, N small: rows shared by most queries
    "two-tiles": dict(B=2, T=6, H=4, D=32, N=40, K=21),  # K spans two tiles (16 in the interpreter)
    "one-row": dict(B=1, T=5, H=6, D=16, N=3, K=3),  # every query picks (nearly) every row: heavy atomics
}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_equals_float64_formula_and_twin(name):
    (iq, w, k), topk = make_case(**CASES[name], seed=len(name))
    got = kernel.selected_index_scores(iq, w, k, topk)
    want = formula64(iq, w, k, topk)
    twin = _SelectedScores.apply(iq, w, k, topk)
    assert _rel(got, want) <= REL and _rel(got, twin) <= REL
    g = torch.randn(got.shape, generator=torch.Generator().manual_seed(3))
    g[..., 0] = 0.0  # some zero upstream gradients
    grads = torch.autograd.grad((got * g).sum(), (iq, w, k))
    exact = torch.autograd.grad((want * g.double()).sum(), (iq, w, k))
    twin_g = torch.autograd.grad((selected_index_scores_reference(iq, w, k, topk) * g).sum(), (iq, w, k))
    for n, a, e, t in zip(NAMES, grads, exact, twin_g):
        err, err_twin = _rel(a, e), _rel(a, t)
        print(f"{name} d{n}: {err:.1e} vs float64, {err_twin:.1e} vs twin")
        assert err <= REL and err_twin <= REL, n


def test_only_the_asked_gradients_and_a_clear_error():
    (iq, w, k), topk = make_case(1, 4, 2, 16, 6, 3, seed=1)
    w.requires_grad_(False)
    out = kernel.selected_index_scores(iq, w, k, topk)
    d_iq, d_k = torch.autograd.grad(out.sum(), (iq, k))
    assert d_iq.shape == iq.shape and d_k.shape == k.shape
    with pytest.raises(ValueError, match="unsupported"):
        kernel.selected_index_scores(iq[..., :12], w, k[..., :12], topk)
    with pytest.raises(ValueError, match="weights"):
        kernel.selected_index_scores(iq, w[:, :2], k, topk)


def test_the_training_path_dispatches_to_the_kernel_when_asked(monkeypatch):
    """`model.sparse_attention.selected_index_scores` runs the kernel under backend 'triton' and the twin under
    'torch' (the CPU default): the kernel's function is called exactly in the first case."""
    (iq, w, k), topk = make_case(1, 4, 2, 16, 6, 3, seed=2)
    calls = []
    real = kernel.selected_index_scores
    monkeypatch.setattr(kernel, "selected_index_scores", lambda *a: calls.append(1) or real(*a))
    with ops.use_backend("triton"):
        a = sparse_attention.selected_index_scores(iq, w, k, topk)
    assert calls == [1]
    with ops.use_backend("torch"):
        b = sparse_attention.selected_index_scores(iq, w, k, topk)
    assert calls == [1] and _rel(a, b) <= REL


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_kernel_equals_twin_at_small_widths(dtype):
    """`small`'s indexer (Hi 4, Di 64, top-128) at 4 × 1024 queries over 512 keys: the kernel = the twin to fp32
    rounding (both compute in fp32 from the same inputs), and the CUDA default picks the kernel."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    (iq, w, k), topk = make_case(4, 1024, 4, 64, 512, 128, seed=5, dtype=dtype, device="cuda")
    assert ops.selected_scores_kernel(iq, k)
    got = kernel.selected_index_scores(iq, w, k, topk)
    twin = _SelectedScores.apply(iq, w, k, topk)
    assert _rel(got, twin) <= 1e-5
    g = torch.randn(got.shape, device="cuda")
    grads = torch.autograd.grad((got * g).sum(), (iq, w, k))
    twin_g = torch.autograd.grad((twin * g).sum(), (iq, w, k))
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16 gradients: one rounding of fp32 sums taken in two orders
    for n, a, t in zip(NAMES, grads, twin_g):
        assert _rel(a, t) <= tol, n
