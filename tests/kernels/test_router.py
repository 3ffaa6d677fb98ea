"""`ops.moe_route`: the Triton router kernel against its twin (the model's formula), and the twin against
the gate written out here in fp64 (score function, biased top-k choice, normalized and scaled weights, the
dense routing matrix); the MoE layer gives the same output on either; bad arguments are refused."""

from __future__ import annotations

import math

import pytest
import torch

from dsv41.kernels import ops
from dsv41.kernels.ops import use_backend

FUNCS = ("softmax", "sigmoid", "sqrtsoftplus")


def formula(logits, bias, temp, func, k, norm, scale):
    """fp64, one row at a time: the experts of the k largest score + bias, and their weights."""
    z = logits.double() / temp
    if func == "softmax":
        s = torch.softmax(z, dim=-1)
    elif func == "sigmoid":
        s = 1 / (1 + torch.exp(-z))
    else:
        s = torch.where(z > 20, z, torch.log1p(torch.exp(z))).sqrt()
    b = bias.double().expand_as(s)
    chosen, weights = [], []
    for r in range(s.size(0)):
        order = sorted(range(s.size(1)), key=lambda e: -(s[r, e] + b[r, e]).item())[:k]
        w = [s[r, e].item() for e in order]
        if norm and k > 1:
            w = [v / (sum(w) + 1e-20) for v in w]
        chosen.append(order)
        weights.append([v * scale for v in w])
    return s, torch.tensor(chosen), torch.tensor(weights, dtype=torch.float64)


def _inputs(N, E, per_row, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, E, generator=g) * 3
    logits[0, 0] = 45.0  # past softplus' threshold
    bias = torch.randn(N, E, generator=g) * 0.1 if per_row else torch.randn(E, generator=g) * 0.1
    return logits, bias


@pytest.mark.parametrize("func", FUNCS)
@pytest.mark.parametrize("E,k", [(8, 2), (12, 1), (64, 6)])
@pytest.mark.parametrize("norm", [True, False])
def test_kernel_equals_twin_equals_formula(func, E, k, norm):
    logits, bias = _inputs(21, E, per_row=E == 12, seed=E * 10 + k)
    temp, scale = 1.3, 2.5
    with use_backend("torch"):
        tw, ti, ts, tr = ops.moe_route(logits, bias, temp, func, k, norm, scale, dense=True)
    with use_backend("triton"):
        kw, ki, ks, kr = ops.moe_route(logits, bias, temp, func, k, norm, scale, dense=True)
        kw2, ki2, ks2, none = ops.moe_route(logits, bias, temp, func, k, norm, scale)
    fs, fi, fw = formula(logits, bias, temp, func, k, norm, scale)
    assert torch.equal(ki, ti) and torch.equal(ti, fi) and ki.dtype == torch.int64
    torch.testing.assert_close(ks.double(), fs, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ts.double(), fs, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(kw.double(), fw, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(tw.double(), fw, rtol=1e-6, atol=1e-7)
    dense = torch.zeros(21, E, dtype=torch.float64).scatter_(1, fi, fw)
    torch.testing.assert_close(kr.double(), dense, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(tr.double(), dense, rtol=1e-6, atol=1e-7)
    assert none is None and torch.equal(ki2, ki) and torch.equal(kw2, kw) and torch.equal(ks2, ks)
    if norm and k > 1:
        assert torch.allclose(kw.sum(-1).double(), torch.full((21,), scale, dtype=torch.float64), rtol=1e-6)


@pytest.mark.parametrize("ones", [1, 3])
def test_dense_ones_append_columns_of_one_to_the_routing_matrix(ones):
    """`dense_ones` (the fused shared expert's block, `MoE.fuse_dense`): the routing matrix of the formula, then
    `ones` columns of exactly 1; the rest of the outputs as without them."""
    E, k = 8, 2
    logits, bias = _inputs(19, E, per_row=False, seed=7)
    fs, fi, fw = formula(logits, bias, 1.0, "sqrtsoftplus", k, True, 1.5)
    want = torch.cat((torch.zeros(19, E, dtype=torch.float64).scatter_(1, fi, fw),
                      torch.ones(19, ones, dtype=torch.float64)), dim=1)
    for backend in ("torch", "triton"):
        with use_backend(backend):
            plain = ops.moe_route(logits, bias, 1.0, "sqrtsoftplus", k, True, 1.5, dense=True)
            w, i, s, r = ops.moe_route(logits, bias, 1.0, "sqrtsoftplus", k, True, 1.5, dense=True, dense_ones=ones)
        assert r.shape == (19, E + ones), backend
        torch.testing.assert_close(r.double(), want, rtol=1e-6, atol=1e-7)
        assert torch.equal(r[:, E:], torch.ones(19, ones)) and torch.equal(r[:, :E], plain[3]), backend
        assert all(torch.equal(a, b) for a, b in zip((w, i, s), plain[:3])), backend
        with pytest.raises(ValueError, match="dense_ones"):
            ops.moe_route(logits, bias, 1.0, "sqrtsoftplus", k, True, 1.5, dense=True, dense_ones=-1)


def test_the_bias_steers_the_choice_not_the_weight():
    """A bias that flips the order changes the experts, and their weights stay their unbiased scores."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 5.0, 0.0])
    with use_backend("triton"):
        w, i, s, _ = ops.moe_route(logits, bias, 1.0, "sigmoid", 2, False, 1.0)
    assert i.tolist() == [[2, 0]]
    torch.testing.assert_close(w, torch.sigmoid(torch.tensor([[0.0, 2.0]])))


def test_the_moe_layer_is_the_same_on_either_backend():
    from dsv41 import load_config
    from dsv41.model.moe import MoE

    c = load_config("tiny")
    torch.manual_seed(0)
    moe = MoE(c.n_layers - 1, c).eval()
    with torch.no_grad():
        moe.gate.bias.normal_(0, 0.05)
        x = torch.randn(2, 9, c.dim)
        for impl in ("dense", "loop"):
            moe.moe_impl = impl
            with use_backend("torch"):
                want = moe(x)
            with use_backend("triton"):
                got = moe(x)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_route_hook_runs_on_the_twin():
    logits, bias = _inputs(5, 8, False, 3)
    seen = []

    def hook(indices):
        seen.append(indices.clone())
        return indices.flip(-1)

    with use_backend("triton"):
        w, i, s, r = ops.moe_route(logits, bias, 1.0, "sqrtsoftplus", 2, True, 1.0, dense=True, hook=hook)
    assert len(seen) == 1 and torch.equal(i, seen[0].flip(-1))
    torch.testing.assert_close(r.gather(1, i), w)


@pytest.mark.parametrize("kwargs,match", [
    (dict(score_func="tanh"), "score_func"),
    (dict(k=9), "k must be"),
    (dict(bias=torch.zeros(7)), "bias must be"),
])
def test_bad_arguments_are_refused(kwargs, match):
    args = dict(logits=torch.zeros(3, 8), bias=torch.zeros(8), gate_temp=1.0, score_func="sigmoid", k=2,
                norm=True, route_scale=1.0)
    args.update(kwargs)
    with use_backend("triton"), pytest.raises(ValueError, match=match):
        ops.moe_route(**args)


def test_softplus_threshold_is_torchs():
    z = torch.tensor([[19.9, 20.0, 20.1, 60.0, -30.0, 0.0, 3.0, -3.0]])
    with use_backend("triton"):
        _, _, s, _ = ops.moe_route(z, torch.zeros(8), 1.0, "sqrtsoftplus", 1, False, 1.0)
    want = torch.nn.functional.softplus(z).sqrt()
    torch.testing.assert_close(s, want, rtol=1e-6, atol=1e-30)
    assert math.isfinite(s.sum().item())


@pytest.mark.gpu
@pytest.mark.parametrize("N,E,k", [(64, 8, 2), (4096, 384, 6), (1, 384, 6)])
def test_gpu_kernel_equals_twin(N, E, k):
    g = torch.Generator(device="cuda").manual_seed(N + E)
    logits = torch.randn(N, E, generator=g, device="cuda") * 3
    bias = torch.randn(E, generator=g, device="cuda") * 0.1
    with use_backend("torch"):
        want = ops.moe_route(logits, bias, 1.0, "sqrtsoftplus", k, True, 1.5, dense=True)
    got = ops.moe_route(logits, bias, 1.0, "sqrtsoftplus", k, True, 1.5, dense=True)  # auto: the kernel on CUDA
    assert torch.equal(got[1], want[1])
    for a, b in zip(got[:1] + got[2:], want[:1] + want[2:]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    ones = ops.moe_route(logits, bias, 1.0, "sqrtsoftplus", k, True, 1.5, dense=True, dense_ones=1)[3]
    assert torch.equal(ones[:, :E], got[3]) and torch.equal(ones[:, E], torch.ones(N, device="cuda"))
