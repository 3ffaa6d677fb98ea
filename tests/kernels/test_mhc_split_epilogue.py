"""The Sinkhorn split as the epilogue of the mHC kernel that writes the mixes (`ops.mhc_post_split`,
`ops.mhc_mixes_split`; `kernels/triton/mhc.py`, "Sinkhorn epilogue").

Claims: the fused launchers return what the separate kernels return — pass (+ finish) then
`_mhc_split_kernel` — bit for bit (the interpreter here; the GPU tests on the device), and the twin
composition to fp32 rounding; they launch no split kernel where d is split (one launch less per
hand-over); the model's forward on them equals its forward on the separate kernels; a gradient keeps the
two ops. Outputs are poisoned with NaN so every element must be written.
"""

from __future__ import annotations

from collections import Counter
from functools import partial

import pytest
import torch
from tests.conftest import FP32_RTOL, assert_close, randomize_mixing
from tests.kernels.test_mhc import EPS, K, N, block_test_model, streams

from dsv41 import load_config
from dsv41.kernels import ops
from dsv41.kernels.ops import use_backend
from dsv41.kernels.ref import mhc as twin
from dsv41.model.state import ForwardContext
from dsv41.model.transformer import Transformer

ITERS = 20  # the presets' hc_sinkhorn_iters
# pre / post / comb of the fused launchers against the twin composition (projection and split in torch): at most
# 3.0e-6 relative, 1.1e-6 absolute over CASES (interpreter, 2026-12-06) — the projection's fp32 rounding
# carried through the split; the bound is ~3× that
TWIN_RTOL, TWIN_ATOL = FP32_RTOL, 1e-8
KERNELS = ("_mhc_pass_kernel", "_mhc_fused_kernel", "_mhc_finish_kernel", "_mhc_split_kernel")


@pytest.fixture
def poisoned(monkeypatch):
    """Triton outputs and workspaces start as NaN."""
    from dsv41.kernels.triton import mhc as triton_mhc

    monkeypatch.setattr(triton_mhc, "_empty", lambda shape, dtype, device: torch.full(shape, float("nan"),
                                                                                      dtype=dtype, device=device))


class _Counted:
    """A Triton kernel whose `kernel[grid](...)` launches are counted."""

    def __init__(self, kernel, name: str, counts: Counter):
        self.kernel, self.name, self.counts = kernel, name, counts

    def __getitem__(self, grid):
        self.counts[self.name] += 1
        return self.kernel[grid]


@pytest.fixture
def launches(monkeypatch) -> Counter:
    """Launches of the mHC pass, finish and split kernels, by name."""
    from dsv41.kernels.triton import mhc as triton_mhc

    counts = Counter()
    for name in KERNELS:
        monkeypatch.setattr(triton_mhc, name, _Counted(getattr(triton_mhc, name), name, counts))
    return counts


def split_params(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return 0.5 + torch.rand(3, generator=g), torch.randn(K, generator=g)


def separate(h, f, post, comb, pre, fn, scale, base, knobs: dict):
    """The separate kernels: pass (+ finish), then `_mhc_split_kernel` — the same knobs, no epilogue."""
    from dsv41.kernels.triton import mhc as triton_mhc

    knobs = {k: v for k, v in knobs.items() if k != "split_in_pass"}
    h_new, x, mixes = triton_mhc.mhc_post(h, f, post, comb, pre, fn, EPS, **knobs)
    coefs = triton_mhc.mhc_split(mixes, scale, base, N, ITERS, EPS)
    mixes_only = triton_mhc.mhc_split(triton_mhc.mhc_mixes(h, fn, EPS, **knobs), scale, base, N, ITERS, EPS)
    return h_new, x, coefs, mixes_only


CASES = [  # (dtype, B, T, d, knobs): M = B·T never a multiple of the tile
    (torch.float32, 2, 37, 48, dict(block_t=16, block_d=16, split=3)),  # legacy pass, d split: finish epilogue
    (torch.bfloat16, 1, 23, 48, dict(block_t=16, block_d=32, split=2)),
    (torch.bfloat16, 1, 19, 48, dict(design="fused", block_t=16, block_d=16, split=2)),  # fused pass + finish
    (torch.float32, 3, 5, 48, dict(design="fused", block_t=16, block_d=16, split=3)),
    (torch.bfloat16, 1, 150, 80, dict(design="fused", tma=True, split=2)),  # 128-token TMA tiles; 8-token finish
    (torch.float32, 2, 37, 48, dict(block_t=16, block_d=16, split=1)),  # unsplit: the split kernel after the pass
    (torch.float32, 1, 21, 48, dict(block_t=16, block_d=32, split=1, split_in_pass=True)),  # legacy pass epilogue
    (torch.bfloat16, 1, 150, 80, dict(design="fused", tma=True, split=1, split_in_pass=True)),  # 128-token tile
]


@pytest.mark.parametrize("dtype,B,T,d,knobs", CASES)
def test_split_epilogue_equals_the_separate_kernels_and_the_twin(poisoned, monkeypatch, dtype, B, T, d, knobs):
    from dsv41.kernels.triton import mhc as triton_mhc

    h, f, post, comb, pre, fn = streams(B, T, d, dtype, seed=301 + T + d)
    scale, base = split_params(301 + T)
    for name in ("mhc_post_split", "mhc_mixes_split"):
        monkeypatch.setattr(triton_mhc, name, partial(getattr(triton_mhc, name), **knobs))
    with torch.no_grad(), use_backend("triton"):
        h_new, x, coefs = ops.mhc_post_split(h, f, post, comb, pre, fn, EPS, scale, base, N, ITERS, EPS)
        entry = ops.mhc_mixes_split(h, fn, EPS, scale, base, N, ITERS, EPS)
        e_h, e_x, e_coefs, e_entry = separate(h, f, post, comb, pre, fn, scale, base, knobs)
    assert torch.equal(h_new, e_h) and torch.equal(x, e_x), "the streams changed"
    for got, exp, what in ((coefs, e_coefs, "mhc_post_split"), (entry, e_entry, "mhc_mixes_split")):
        for g, e, part in zip(got, exp, ("pre", "post", "comb")):
            assert not torch.isnan(g).any(), f"{what} {part}: NaN left (an element was not written)"
            assert g.shape == e.shape and g.dtype == torch.float32, f"{what} {part}: {g.shape} {g.dtype}"
            assert torch.equal(g, e), f"{what} {part}: max diff {float((g - e).abs().max()):.3e} from the " \
                                      "separate kernels"
    t_h, t_x, t_coefs = twin.mhc_post_split(h, f, post, comb, pre, fn, EPS, scale, base, N, ITERS, EPS)
    t_entry = twin.mhc_mixes_split(h, fn, EPS, scale, base, N, ITERS, EPS)
    for got, exp, what in ((coefs, t_coefs, "mhc_post_split"), (entry, t_entry, "mhc_mixes_split")):
        for g, e, part in zip(got, exp, ("pre", "post", "comb")):
            assert_close(g, e, rtol=TWIN_RTOL, atol=TWIN_ATOL, what=f"{what} {part} vs the twin")


@pytest.mark.parametrize("knobs,expected", [
    (dict(block_t=16, block_d=16, split=3), {"_mhc_pass_kernel": 1, "_mhc_finish_kernel": 1}),
    (dict(block_t=16, block_d=16, split=1), {"_mhc_pass_kernel": 1, "_mhc_split_kernel": 1}),
    (dict(block_t=16, block_d=16, split=1, split_in_pass=True), {"_mhc_pass_kernel": 1}),
    (dict(design="fused", block_t=16, block_d=16, split=2), {"_mhc_fused_kernel": 1, "_mhc_finish_kernel": 1}),
])
def test_split_epilogue_launches(launches, knobs, expected):
    """One hand-over, counted: with d split the finish kernel splits (no split kernel: 2 launches for the
    separate path's 3); unsplit, the split kernel follows the pass unless `split_in_pass`."""
    from dsv41.kernels.triton import mhc as triton_mhc

    h, f, post, comb, pre, fn = streams(1, 21, 48, torch.float32, seed=311)
    scale, base = split_params(311)
    triton_mhc.mhc_post_split(h, f, post, comb, pre, fn, EPS, scale, base, N, ITERS, EPS, **knobs)
    assert dict(launches) == expected
    launches.clear()
    triton_mhc.mhc_mixes_split(h, fn, EPS, scale, base, N, ITERS, EPS, **knobs)
    assert dict(launches) == expected


def test_model_forward_on_the_split_epilogue_equals_the_separate_kernels(monkeypatch, launches):
    """The tiny model's logits, every op on Triton, with d split (16-channel chunks: d = 64 is one default chunk,
    which would never split): Block.forward's hand-overs on the fused launchers equal those on the separate
    kernels bit for bit, and launch 2 split kernels per layer fewer (the attention and the FFN coefficients) —
    Engram layers and the first block included (`mhc_mixes_split`), the last pass without a projection."""
    from dsv41.kernels.triton import mhc as triton_mhc

    model = block_test_model(321, hc_sinkhorn_iters=3)  # the rounds cost interpreter time only; their own tests run 20
    n_layers = len(model.layers)
    for name in ("mhc_post", "mhc_mixes", "mhc_post_split", "mhc_mixes_split"):
        monkeypatch.setattr(triton_mhc, name, partial(getattr(triton_mhc, name), block_t=16, block_d=16))
    tokens = torch.randint(3, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(321))
    runs = {}
    for fused in (True, False):
        with monkeypatch.context() as m, torch.no_grad(), use_backend("triton"):
            if not fused:
                m.setattr(ops, "_split_fuses", lambda *a, **k: False)
            launches.clear()
            runs[fused] = (model(tokens, ctx=ForwardContext.build(tokens)), dict(launches))
    (logits, fused_launches), (expected, separate_launches) = runs[True], runs[False]
    assert torch.equal(logits, expected), f"logits differ by {float((logits - expected).abs().max()):.3e}"
    assert fused_launches.get("_mhc_split_kernel", 0) == 0, fused_launches
    assert separate_launches["_mhc_split_kernel"] == 2 * n_layers, separate_launches
    assert sum(separate_launches.values()) - sum(fused_launches.values()) == 2 * n_layers
    assert fused_launches["_mhc_finish_kernel"] == separate_launches["_mhc_finish_kernel"]


def test_a_gradient_keeps_the_two_ops(monkeypatch):
    """Training is unchanged: with a gradient the op is `mhc_post` then `mhc_split` (whose Triton training
    Function gives hc_scale its gradient), never the fused launcher; without one it is the fused launcher;
    the torch backend is the twin composition bit for bit; an empty token range returns empty coefficients."""
    from dsv41.kernels.triton import mhc as triton_mhc

    h, f, post, comb, pre, fn = streams(1, 6, 32, torch.float32, seed=331)
    scale, base = (t.requires_grad_() for t in split_params(331))
    fused = []
    real = triton_mhc.mhc_post_split
    monkeypatch.setattr(triton_mhc, "mhc_post_split", lambda *a, **k: fused.append(1) or real(*a, **k))
    with use_backend("triton"):
        _, _, (p, q, c) = ops.mhc_post_split(h, f, post, comb, pre, fn, EPS, scale, base, N, ITERS, EPS)
        assert not fused and c.requires_grad
        (g,) = torch.autograd.grad(c.sum() + p.sum() + q.sum(), scale)
        assert torch.isfinite(g).all() and bool(g.abs().sum() > 0)
        with torch.no_grad():
            ops.mhc_post_split(h, f, post, comb, pre, fn, EPS, scale, base, N, ITERS, EPS)
        assert fused == [1]
        with torch.no_grad():
            empty = streams(1, 0, 32, torch.float32, seed=332)
            _, _, coefs = ops.mhc_post_split(*empty, EPS, scale, base, N, ITERS, EPS)
            assert [tuple(t.shape) for t in coefs] == [(1, 0, N), (1, 0, N), (1, 0, N, N)]
            with pytest.raises(ValueError, match="hc_base must be"):
                ops.mhc_mixes_split(h, fn, EPS, scale, base[:-1], N, ITERS, EPS)
    with torch.no_grad(), use_backend("torch"):
        got = ops.mhc_post_split(h, f, post, comb, pre, fn, EPS, scale, base, N, ITERS, EPS)
        exp = twin.mhc_post_split(h, f, post, comb, pre, fn, EPS, scale, base, N, ITERS, EPS)
    assert all(torch.equal(a, b) for a, b in zip((*got[:2], *got[2]), (*exp[:2], *exp[2])))


# --------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("B,T", [(1, 1), (64, 1), (1, 128), (2, 4096 + 37), (1, 16384)])
def test_gpu_split_epilogue_equals_the_separate_kernels(B, T):
    """v41-flash width, bf16, on the default plan: decode (legacy pass, d split), the 128-token replay, a prefill
    chunk (fused TMA pass, d split) — the finish epilogue at `split_launch`'s tile — and 16K tokens (unsplit: the
    split kernel after the pass): bit-identical. The opt-in pass epilogue at 16K sums in another layout: within
    fp32 rounding of the separate kernels."""
    h, f, post, comb, pre, fn = streams(B, T, 5120, torch.bfloat16, seed=341 + T, device="cuda")
    scale, base = (t.cuda() for t in split_params(341))
    with torch.no_grad(), use_backend("triton"):
        h_new, x, coefs = ops.mhc_post_split(h, f, post, comb, pre, fn, EPS, scale, base, N, ITERS, EPS)
        entry = ops.mhc_mixes_split(h, fn, EPS, scale, base, N, ITERS, EPS)
        e_h, e_x, e_coefs, e_entry = separate(h, f, post, comb, pre, fn, scale, base, {})
    assert torch.equal(h_new, e_h) and torch.equal(x, e_x)
    for got, exp in ((coefs, e_coefs), (entry, e_entry)):
        for g, e, part in zip(got, exp, ("pre", "post", "comb")):
            assert torch.equal(g, e), f"{part}: max diff {float((g - e).abs().max()):.3e}"
    if T == 16384:
        from dsv41.kernels.triton import mhc as triton_mhc

        with torch.no_grad():
            _, _, in_pass = triton_mhc.mhc_post_split(h, f, post, comb, pre, fn, EPS, scale, base, N, ITERS, EPS,
                                                      split_in_pass=True)
        for g, e, part in zip(in_pass, e_coefs, ("pre", "post", "comb")):
            assert_close(g, e, rtol=FP32_RTOL, atol=1e-9, what=f"split_in_pass {part}")


@pytest.mark.gpu
@pytest.mark.parametrize("B,T", [(64, 1), (2, 300)])
def test_gpu_model_forward_on_the_split_epilogue_equals_the_separate_kernels(monkeypatch, B, T):
    """The `small` model in bf16 on CUDA (`auto`: Triton without gradients): logits with the fused hand-overs
    equal those on the separate kernels bit for bit, a decode-shaped batch and a prefill chunk."""
    model = Transformer(load_config("small")).init_weights(seed=351)
    randomize_mixing(model, 351)
    model = model.to("cuda", torch.bfloat16).eval()
    tokens = torch.randint(3, model.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(351))
    tokens = tokens.cuda()
    with torch.no_grad():
        fused = model(tokens)
        monkeypatch.setattr(ops, "_split_fuses", lambda *a, **k: False)
        expected = model(tokens)
    assert torch.equal(fused, expected), f"logits differ by {float((fused - expected).abs().max()):.3e}"
