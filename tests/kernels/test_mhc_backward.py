"""The mHC hand-over's training path on Triton (`ops.mhc_post` under a gradient: `kernels.triton.mhc_train`).

Claims checked (CPU, Triton in its interpreter, every dot in fp32): the Function's gradients of h, f, post, comb,
pre and hc_fn equal fp64 autograd of the formulas (written here, evaluated at the Function's own rounded h_new,
as the twin's straight-through `.to(dtype)`), for fp32, bf16 and mixed (fp32 streams, bf16 sublayer output: the
first block under autocast) inputs, with and without hc_fn, and with any one of (h_new, x, mixes) receiving a
gradient (the mixes alone make the −r³ term ~15 % of the streams' gradient: dropping it, or swapping g_comb's
indices, fails these cases and the model test — checked by hand); token counts that are not a multiple of the
tile, d ragged or whole in the chunks; the weight's gradient over several token spans, fp32-accurate; random
shapes and tiles (hypothesis). The bf16 check fails the twin's gradients. A tiny model's losses and every
parameter gradient through the kernels = the twin's. Dispatch: CUDA under a gradient trains through the Function
unless DSV41_TRITON_MHC_BACKWARD=0; CPU `auto` and torch.compile keep the twin. The Function saves nothing beyond
its inputs and outputs, leaves the hc_fn planes' cache alone, and runs no torch arithmetic besides its kernels,
where the twin runs 52 ops per hand-over. `gpu` cases repeat the fp64 comparison at `small` widths (d = 384,
16 × 1024 tokens) in bf16 and fp32 beside the twin's error, the dispatch and the model comparison on CUDA.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.conftest import assert_grads_close, randomize_mixing

from dsv41 import load_config
from dsv41.kernels import ops
from dsv41.kernels.ops import use_backend
from dsv41.kernels.ref import mhc as twin
from dsv41.model.transformer import Transformer
from dsv41.testing.sync import OpCounter

mhc_train = pytest.importorskip("dsv41.kernels.triton.mhc_train")

N = 4
K = (2 + N) * N
EPS = 1e-6
# fp32 gradients (all of them with fp32 inputs; post, comb, pre, hc_fn with bf16 ones) vs fp64 autograd, max error
# over the largest magnitude. Measured ≤ 2.2e-7 (fp32 G, fp32 reductions over d terms).
REL = 2e-6
# bf16 g_h, g_f: the kernel rounds its fp32 sums once, so they are the fp64 values correctly rounded (≤ 0.5 ulp),
# up to fp32 noise of the summed terms (FP32_NOISE·terms, forgiven; without it a cancelling sum measured 0.502).
# A second rounding would show as up to 1 ulp: the twin, which rounds the summed gradients to bf16 on the way, is
# hundreds of ulp off where a sum cancels (and ~3e-3 relative in its fp32 g_post / g_comb; test_the_bf16_check_...).
BF16_ULPS = 0.501
FP32_NOISE = 2.0**-20  # 8 fp32 ulps of the terms: the few roundings of each sum
DTYPES = {"fp32": (torch.float32, torch.float32), "bf16": (torch.bfloat16, torch.bfloat16),
          "fp32-h bf16-f": (torch.float32, torch.bfloat16)}
PRESENT = {"all": (1, 1, 1), "h_new": (1, 0, 0), "x": (0, 1, 0), "mixes": (0, 0, 1)}


@pytest.fixture
def poisoned(monkeypatch):
    """Every output and workspace of the forward and backward kernels starts as NaN."""
    from dsv41.kernels.triton import mhc as triton_mhc

    def empty(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(triton_mhc, "_empty", empty)
    monkeypatch.setattr(mhc_train, "_empty", empty)


def small_tiles(monkeypatch, block_t: int = 16, block_d: int = 16, block_m: int = 16, block_n: int = 32) -> None:
    """Tiles smaller than the test's token count and d, so that both end ragged."""
    monkeypatch.setattr(mhc_train, "BWD_DEFAULTS", (block_t, block_d, 4, 1))
    monkeypatch.setattr(mhc_train, "GRAD_FN_DEFAULTS", (block_m, block_n, 4))


def inputs(B: int, T: int, d: int, h_dtype, f_dtype, seed: int, with_fn: bool = True, device: str = "cpu"):
    """(h, f, post, comb, pre, hc_fn) shaped like the model's: positive comb / pre, post in (0, 2)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, N, d, generator=g).to(h_dtype)
    f = (2 * torch.randn(B, T, d, generator=g)).to(f_dtype)
    post = 2 * torch.rand(B, T, N, generator=g)
    comb = torch.softmax(2 * torch.randn(B, T, N, N, generator=g), dim=-1)
    pre = torch.rand(B, T, N, generator=g) + 1e-6
    fn = 0.05 * torch.randn(K, N * d, generator=g) if with_fn else None
    return [None if t is None else t.to(device) for t in (h, f, post, comb, pre, fn)]


def cotangents(outs, seed: int, present=(1, 1, 1)):
    """Random gradients of (h_new, x, mixes) in their dtypes, None where absent (or the output is None)."""
    g = torch.Generator().manual_seed(seed)
    return [None if o is None or not keep else torch.randn(o.shape, generator=g).to(o.device, o.dtype)
            for o, keep in zip(outs, present)]


def reference64(ins, h_new, grads):
    """fp64 autograd of the formulas at the Function's own forward point: h_new computed in fp64, then moved onto
    the rounded h_new the Function returned (straight through); x and the projection read it."""
    leaves = [None if t is None else t.detach().double().requires_grad_(True) for t in ins]
    h, f, post, comb, pre, fn = leaves
    exact = post.unsqueeze(-1) * f.unsqueeze(-2) + torch.einsum("btij,btid->btjd", comb, h)
    hn = exact + (h_new.detach().double() - exact).detach()
    x = (pre.unsqueeze(-1) * hn).sum(-2)
    outs = [hn, x]
    if fn is not None:
        flat = hn.flatten(-2)
        outs.append(flat @ fn.T * torch.rsqrt(flat.square().mean(-1, keepdim=True) + EPS))
    pairs = [(o, g.double()) for o, g in zip(outs, grads) if g is not None]
    used = [t for t in leaves if t is not None]
    got = torch.autograd.grad([o for o, _ in pairs], used, [g for _, g in pairs], allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for g, t in zip(got, used)]


def function_grads(ins, grads_seed: int, present=(1, 1, 1)):
    """The Function's forward outputs and its gradients of every input that is not None."""
    leaves = [None if t is None else t.detach().clone().requires_grad_(True) for t in ins]
    outs = mhc_train.mhc_post_train(*leaves, EPS)
    grads = cotangents(outs, grads_seed, present)
    pairs = [(o, g) for o, g in zip(outs, grads) if g is not None]
    used = [t for t in leaves if t is not None]
    got = torch.autograd.grad([o for o, _ in pairs], used, [g for _, g in pairs], allow_unused=True)
    return outs, grads, [torch.zeros_like(t) if g is None else g for g, t in zip(got, used)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def bf16_ulps(a: torch.Tensor, b: torch.Tensor, terms: torch.Tensor | None = None) -> float:
    """Largest |a − b| in bf16 ulps of b (b fp64), after forgiving FP32_NOISE·terms: the fp32 rounding of sums whose
    terms have magnitude `terms` (a cancelling sum's fp32 error is relative to its terms, not to its result)."""
    ulp = torch.ldexp(torch.ones_like(b), torch.frexp(b.abs())[1] - 8)
    diff = (a.double() - b).abs()
    if terms is not None:
        diff = (diff - FP32_NOISE * terms).clamp(min=0)
    return (diff / ulp).max().item()


def gradient_terms(ins, h_new, grads) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 magnitudes of the terms g_h and g_f sum: |G_j| bounded by |g_h_new_j| + pre_j·|g_x| + |g_lin| @ |W|
    + |s·h_new_j|, then Σ_j comb_ij·(that) for g_h_i and Σ_j post_j·(that) for g_f."""
    h, f, post, comb, pre, fn = [None if t is None else t.detach().double() for t in ins]
    hn = h_new.detach().double()
    g_hn, g_x, g_m = [None if g is None else g.detach().double() for g in grads]
    big = torch.zeros_like(hn) if g_hn is None else g_hn.abs()
    if g_x is not None:
        big = big + pre.unsqueeze(-1) * g_x.abs().unsqueeze(-2)
    if g_m is not None:
        flat = hn.flatten(-2)
        r = torch.rsqrt(flat.square().mean(-1, keepdim=True) + EPS)
        mixes = flat @ fn.T * r
        s = (g_m * mixes).sum(-1, keepdim=True) * r * r / flat.size(-1)
        big = big + ((g_m * r).abs() @ fn.abs()).view(hn.shape) + (s.unsqueeze(-1) * hn).abs()
    return torch.einsum("btij,btjd->btid", comb, big), (post.unsqueeze(-1) * big).sum(-2)


NAMES = ("h", "f", "post", "comb", "pre", "hc_fn")


def check(got, want, ins, terms=None) -> dict[str, float]:
    """Each gradient in its input's dtype; fp32 ones within REL, bf16 ones (g_h, g_f: `terms` from
    `gradient_terms`) within BF16_ULPS. Returns the errors."""
    errs = {}
    for name, a, b, t in zip(NAMES, got, want, [t for t in ins if t is not None]):
        assert a.dtype == t.dtype and a.shape == t.shape, f"{name}: {a.dtype} {tuple(a.shape)}"
        assert not torch.isnan(a).any(), f"{name}: NaN left (an element was not written)"
        if a.dtype == torch.bfloat16:
            errs[name] = bf16_ulps(a, b, None if terms is None else terms[NAMES.index(name)])
            assert errs[name] <= BF16_ULPS, f"{name}: {errs[name]:.3f} bf16 ulp from fp64"
        else:
            errs[name] = rel(a, b)
            assert errs[name] <= REL, f"{name}: rel err {errs[name]:.1e}"
    return errs


# --------------------------------------------------------------------------------------------- kernels vs fp64
@pytest.mark.parametrize("dtypes", sorted(DTYPES))
@pytest.mark.parametrize("with_fn,present,d", [(True, "all", 40), (True, "h_new", 40), (True, "x", 40),
                                               (True, "mixes", 40), (False, "all", 40), (True, "all", 48)])
def test_backward_equals_fp64_autograd(poisoned, monkeypatch, dtypes, with_fn, present, d):
    """B·T = 18 tokens (16-token tiles: the second ragged), d = 40 (16-channel chunks: the last ragged) or 48
    (whole chunks: hc_fn's rows load unmasked, EVEN_D); the weight's gradient over two token spans (the second
    2 tokens long)."""
    small_tiles(monkeypatch)
    ins = inputs(2, 9, d, *DTYPES[dtypes], seed=3 + len(present), with_fn=with_fn)
    outs, grads, got = function_grads(ins, 5, PRESENT[present])
    errs = check(got, reference64(ins, outs[0], grads), ins, gradient_terms(ins, outs[0], grads))
    print(f"{dtypes} {present}: " + " ".join(f"{k} {v:.1e}" for k, v in errs.items()))


def test_the_projection_term_is_not_negligible_here():
    """With only the mixes' gradient, the −s·h_new term (the RMS's derivative) is a large part of G (measured 16 %
    of the projection term's largest value): dropping it moves the gradients far past REL and BF16_ULPS (the claim
    the `mixes` cases above rely on)."""
    ins = inputs(2, 9, 40, torch.float32, torch.float32, seed=3 + len("mixes"))
    fn = ins[5]
    outs, grads, _ = function_grads(ins, 5, PRESENT["mixes"])
    flat = outs[0].double().flatten(-2)
    r = torch.rsqrt(flat.square().mean(-1, keepdim=True) + EPS)
    g_lin = grads[2].double() * r
    lin_term = (g_lin @ fn.double()).abs().max()
    s = (grads[2].double() * outs[2].double()).sum(-1, keepdim=True) * r * r / flat.size(-1)
    rms_term = (s * flat).abs().max()
    print(f"|r·(g @ W)| {lin_term:.2e}, |s·h_new| {rms_term:.2e}")
    assert rms_term > 0.05 * lin_term


def test_the_bf16_check_can_fail():
    """The twin's bf16 gradients, rounded on the way (module docstring), fail BF16_ULPS and REL on the inputs the
    Function passes with: measured 242 / 576 ulp beyond fp32 noise (g_h / g_f), 3.0e-3 relative (g_post)."""
    ins = inputs(2, 9, 40, torch.bfloat16, torch.bfloat16, seed=3 + len("all"))
    outs, grads, _ = function_grads(ins, 5)
    want, terms = reference64(ins, outs[0], grads), gradient_terms(ins, outs[0], grads)
    leaves = [t.detach().clone().requires_grad_(True) for t in ins]
    tw = torch.autograd.grad(twin.mhc_post(*leaves, EPS), leaves, grads)
    assert bf16_ulps(tw[0], want[0], terms[0]) > 10 * BF16_ULPS and bf16_ulps(tw[1], want[1], terms[1]) > 10 * BF16_ULPS
    assert rel(tw[2], want[2]) > 100 * REL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split", [1, 2, 3, None])
def test_weight_gradient_spans_and_fp32_accuracy(poisoned, dtype, split):
    """g_W = g_linᵀ @ flatten(h_new) over `split` token spans of 45 tokens in 16-token tiles (None: 3 spans, as
    3; 2 spans of 32 + 13 tokens; the last tile of each ragged), fp32-accurate: positive full-mantissa g_lin
    against positive streams (a coherent sum), so a bf16x2 split of g_lin (2⁻¹⁷) would show as ~7e-6."""
    g = torch.Generator().manual_seed(17)
    h_new = (torch.rand(5, 9, N, 24, generator=g) + 0.5).to(dtype)
    g_lin = torch.rand(5, 9, K, generator=g) + 1
    got = mhc_train.hc_fn_grad(h_new, g_lin, block_m=16, block_n=32, split=split)
    want = g_lin.double().reshape(-1, K).T @ h_new.double().reshape(-1, N * 24)
    err = rel(got, want)
    print(f"{dtype} split {split}: rel err {err:.1e}")
    assert got.dtype == torch.float32 and err < 1e-6, f"rel err {err:.1e}"


@settings(max_examples=6, deadline=None)
@given(B=st.integers(1, 2), T=st.integers(1, 20), d=st.sampled_from([11, 16, 27, 32, 43, 64]),
       tiles=st.sampled_from([(16, 16), (32, 16), (16, 64)]), dtypes=st.sampled_from(sorted(DTYPES)),
       seed=st.integers(0, 1000))
def test_property_random_shapes_and_tiles(B, T, d, tiles, dtypes, seed):
    """Any token count (one token included), d ragged or whole in the chunks, any tile."""
    keep = (mhc_train.BWD_DEFAULTS, mhc_train.GRAD_FN_DEFAULTS)
    mhc_train.BWD_DEFAULTS, mhc_train.GRAD_FN_DEFAULTS = (*tiles, 4, 1), (16, 32, 4)
    try:
        ins = inputs(B, T, d, *DTYPES[dtypes], seed=seed)
        outs, grads, got = function_grads(ins, seed + 1)
        check(got, reference64(ins, outs[0], grads), ins, gradient_terms(ins, outs[0], grads))
    finally:
        mhc_train.BWD_DEFAULTS, mhc_train.GRAD_FN_DEFAULTS = keep


def test_forward_is_the_inference_pass():
    ins = inputs(1, 6, 32, torch.bfloat16, torch.bfloat16, seed=9)
    from dsv41.kernels.triton import mhc as triton_mhc

    with torch.no_grad():
        want = triton_mhc.mhc_post(*ins, EPS)
    leaves = [t.clone().requires_grad_(True) for t in ins]
    got = mhc_train.mhc_post_train(*leaves, EPS)
    assert all(torch.equal(a.detach(), b) for a, b in zip(got, want))
    assert type(got[0].grad_fn).__name__ == "MhcPostTrainBackward"


def test_a_trained_weight_is_split_per_call_not_cached():
    """The fused forward (≥ FUSED_MIN_TOKENS tokens) splits hc_fn into bf16 planes; for a weight that needs a
    gradient the launcher's policy is a split per call, never its per-version cache — which the Function's forward
    (grad mode off inside) would otherwise fill with every step's stale planes."""
    from dsv41.kernels.triton import mhc as triton_mhc

    ins = inputs(1, triton_mhc.FUSED_MIN_TOKENS, 16, torch.bfloat16, torch.bfloat16, seed=4)
    before = dict(triton_mhc._PLANES)
    leaves = [t.clone().requires_grad_(True) for t in ins]
    mhc_train.mhc_post_train(*leaves, EPS)
    assert triton_mhc._PLANES == before


def test_bad_inputs_are_refused():
    ins = inputs(1, 4, 16, torch.float32, torch.float32, seed=1)
    h, f, post, comb, pre, fn = ins
    h_new, x, mixes = twin.mhc_post(*ins, EPS)
    with pytest.raises(ValueError, match="g_mixes needs hc_fn"):
        mhc_train.mhc_post_backward(h, f, post, comb, pre, None, h_new, None, None, None, mixes, EPS)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        mhc_train.mhc_post_backward(h.half(), f, post, comb, pre, fn, h_new, mixes, h_new, x, mixes, EPS)
    with pytest.raises(ValueError, match="precision"):
        mhc_train.hc_fn_grad(h_new, mixes, precision="tf32")
    with pytest.raises(ValueError, match="block_t"):
        mhc_train.mhc_post_backward(h, f, post, comb, pre, fn, h_new, mixes, h_new, x, mixes, EPS, block_t=24)


# --------------------------------------------------------------------------------------------- what it saves
def test_saves_only_its_inputs_and_outputs():
    """Beyond its inputs the Function keeps h_new and mixes (its outputs: the next hand-over's h and the
    Sinkhorn split's input, alive anyway); the twin's Functions keep h_new too, plus lin and r."""
    from dsv41.testing.saved import saved_bytes

    ins = inputs(2, 8, 32, torch.bfloat16, torch.bfloat16, seed=13)
    outputs = 2 * 8 * (N * 32 * 2 + K * 4)  # h_new bf16 + mixes fp32
    with use_backend("triton"):
        lean = saved_bytes(lambda *a: ops.mhc_post(*a, EPS), ins)
    with use_backend("torch"):
        plain = saved_bytes(lambda *a: ops.mhc_post(*a, EPS), ins)
    print(f"saved beyond the inputs: {lean} B (Function) vs {plain} B (twin)")
    assert lean == outputs and plain > lean


ARITHMETIC = {"add", "sub", "mul", "div", "sum", "mean", "pow", "rsqrt", "bmm", "mm", "_to_copy", "einsum"}


def test_a_hand_over_runs_its_kernels_and_almost_no_torch_ops():
    """Forward + backward of one hand-over (bf16 streams under autocast, as the training step): the twin's torch
    ops that launch kernels (casts, products, reductions, matmuls) against the Function's (the interpreter's own
    argument copies are not counted). On a GPU the Function is 5 launches: the hc_fn split and the pass forward,
    the backward kernel, the weight's kernel and its sum over token spans."""
    ins = inputs(1, 16, 32, torch.bfloat16, torch.bfloat16, seed=15)
    counts = {}
    for backend in ("triton", "torch"):
        leaves = [t.clone().requires_grad_(True) for t in ins]
        with use_backend(backend):
            with OpCounter() as forward, torch.autocast("cpu", dtype=torch.bfloat16):
                outs = ops.mhc_post(*leaves, EPS)
            grads = cotangents(outs, 3)
            with OpCounter() as backward:
                torch.autograd.backward(outs, grads)
        counts[backend] = sum(v for seen in (forward, backward) for k, v in seen.counts.items()
                              if k.split(".")[-1] in ARITHMETIC)
    print(f"arithmetic torch ops per hand-over: Function {counts['triton']}, twin {counts['torch']}")
    assert counts["triton"] <= 1 and counts["torch"] >= 40  # measured 0 (one span: no sum) and 52


# --------------------------------------------------------------------------------------------- dispatch
class _Fake:
    """Enough of a tensor for `_mhc_post_trains_on_triton`."""

    def __init__(self, cuda: bool, dtype=torch.bfloat16, n: int = N):
        self.is_cuda, self.dtype, self._shape = cuda, dtype, (2, 3, n, 8)

    def dim(self) -> int:
        return len(self._shape)

    def size(self, i: int) -> int:
        return self._shape[i]


def test_cuda_trains_through_the_function_unless_opted_out(monkeypatch):
    cuda, cpu = _Fake(True), _Fake(False)
    monkeypatch.setattr(ops, "HAVE_TRITON", True)
    monkeypatch.delenv("DSV41_TRITON_MHC_BACKWARD", raising=False)
    assert ops._mhc_post_trains_on_triton(cuda, cuda, cuda) and ops._mhc_post_trains_on_triton(cuda, cuda, None)
    assert not ops._mhc_post_trains_on_triton(cuda, cpu, cuda)
    assert not ops._mhc_post_trains_on_triton(_Fake(True, torch.float16), cuda, cuda)  # fp16: the twin
    assert not ops._mhc_post_trains_on_triton(_Fake(True, n=3), cuda, cuda)  # the kernels take n = 4
    monkeypatch.setenv("DSV41_TRITON_MHC_BACKWARD", "0")
    assert not ops._mhc_post_trains_on_triton(cuda, cuda, cuda)
    with use_backend("triton"):
        assert ops._mhc_post_trains_on_triton(cpu, cpu, cpu)  # forced: the interpreter on the CPU
    monkeypatch.setenv("DSV41_TRITON_MHC_BACKWARD", "1")
    monkeypatch.setattr(ops, "HAVE_TRITON", False)
    assert not ops._mhc_post_trains_on_triton(cuda, cuda, cuda)


def test_cpu_auto_torch_and_compile_keep_the_twin(monkeypatch):
    ins = [t.requires_grad_(True) for t in inputs(1, 4, 16, torch.float32, torch.float32, seed=2)]
    assert type(ops.mhc_post(*ins, EPS)[2].grad_fn).__name__ == "_HcProjectBackward"  # auto on the CPU
    with use_backend("torch"):
        assert type(ops.mhc_post(*ins, EPS)[2].grad_fn).__name__ == "_HcProjectBackward"
    with use_backend("triton"):
        assert type(ops.mhc_post(*ins, EPS)[2].grad_fn).__name__ == "MhcPostTrainBackward"
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        assert type(ops.mhc_post(*ins, EPS)[2].grad_fn).__name__ == "_HcProjectBackward"


# --------------------------------------------------------------------------------------------- model level
def test_model_losses_and_gradients_through_the_kernels_equal_the_twin(monkeypatch):
    """`tiny` cut to 3 layers (an Engram layer: its preceding pass has no hc_fn; the last pass has none either),
    fp32, 2 × 12 tokens: the LM and indexer losses and all 89 parameter gradients with every hand-over on the
    Function = with the twin's Functions. Measured: losses equal, worst gradient 2.5e-5 (the Engram's wkv) —
    the fp32 noise of this graph: the twin itself is 1.2e-4 from the float64 model there, the kernels 1.4e-4."""
    config = load_config("tiny").replace(n_layers=3, compress_ratios=[0, 2, 1], kv_source_layers=[1, 2],
                                         index_source_layers=[1, 2], candidate_source_layer=2)
    model = Transformer(config).init_weights(seed=7).train()
    randomize_mixing(model, 7)
    tokens = torch.randint(3, config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(8))

    def run(kernel: bool):
        calls = []
        monkeypatch.setattr(ops, "_mhc_post_trains_on_triton", lambda *a: calls.append(1) or kernel)
        model.zero_grad(set_to_none=True)
        losses = model.losses(tokens[:, :-1], tokens[:, 1:])
        losses.total.backward()
        assert len(calls) == 2 * config.n_layers
        return losses, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    lt, gt = run(False)
    lk, gk = run(True)
    for name in ("lm", "indexer", "total"):
        want, got = getattr(lt, name).item(), getattr(lk, name).item()
        assert abs(got - want) <= 1e-6 * abs(want), f"{name}: kernels {got:.8f} vs twin {want:.8f}"
    assert_grads_close(gk, gt, 1e-4)


# --------------------------------------------------------------------------------------------- GPU, `small` widths
@pytest.mark.gpu
@pytest.mark.parametrize("dtypes", ["bf16", "fp32", "fp32-h bf16-f"])
def test_gpu_small_widths_against_fp64_beside_the_twin(dtypes):
    """16 × 1024 tokens × d = 384 (the `small` training step), compiled for the GPU: every gradient against fp64
    autograd, beside the twin's (no autocast: the twin's projection would be a bf16 matmul). fp32 gradients
    within REL·10 or twice the twin's error (the weight's tf32x3 / bf16x3 dots accumulate over 16K tokens in MMA
    order); bf16 g_h, g_f correctly rounded up to fp32 noise, as on the CPU (the GPU's FMAs round differently)."""
    ins = inputs(16, 1024, 384, *DTYPES[dtypes], seed=41, device="cuda")
    outs, grads, got = function_grads(ins, 43)
    want = reference64(ins, outs[0], grads)
    terms = gradient_terms(ins, outs[0], grads)
    tw = [t.detach().clone().requires_grad_(True) for t in ins]
    twin_grads = torch.autograd.grad(twin.mhc_post(*tw, EPS), tw, grads)
    for name, a, b, t, w in zip(NAMES, got, want, ins, twin_grads):
        assert a.dtype == t.dtype and not torch.isnan(a).any(), name
        if a.dtype == torch.bfloat16:
            err = bf16_ulps(a, b, terms[NAMES.index(name)])
            print(f"{name}: {err:.3f} ulp beyond fp32 noise, {bf16_ulps(a, b):.1f} plain (twin {bf16_ulps(w, b):.1f})")
            assert err <= BF16_ULPS, f"{name}: {err:.3f} bf16 ulp from fp64"
        else:
            err, twin_err = rel(a, b), rel(w, b)
            print(f"{name}: rel {err:.1e} (twin {twin_err:.1e})")
            assert err <= max(10 * REL, 2 * twin_err), f"{name}: rel err {err:.1e} (twin {twin_err:.1e})"


@pytest.mark.gpu
def test_gpu_ops_trains_through_the_function_and_the_variable_opts_out(monkeypatch):
    ins = [t.requires_grad_(True) for t in inputs(2, 64, 384, torch.bfloat16, torch.bfloat16, seed=5, device="cuda")]
    monkeypatch.delenv("DSV41_TRITON_MHC_BACKWARD", raising=False)
    assert type(ops.mhc_post(*ins, EPS)[0].grad_fn).__name__ == "MhcPostTrainBackward"
    monkeypatch.setenv("DSV41_TRITON_MHC_BACKWARD", "0")
    assert type(ops.mhc_post(*ins, EPS)[0].grad_fn).__name__ != "MhcPostTrainBackward"


@pytest.mark.gpu
def test_gpu_tiny_model_gradients_equal_the_twin(monkeypatch):
    """The model-level comparison of the CPU test on CUDA (fp32, the full 8-layer `tiny`, 2 × 64 tokens)."""
    config = load_config("tiny")
    model = Transformer(config).init_weights(seed=7).train()
    randomize_mixing(model, 7)  # a CPU generator: before the move
    model.cuda()
    tokens = torch.randint(3, config.vocab_size, (2, 65), generator=torch.Generator().manual_seed(8)).cuda()

    def run(opt_out: str):
        monkeypatch.setenv("DSV41_TRITON_MHC_BACKWARD", opt_out)
        model.zero_grad(set_to_none=True)
        losses = model.losses(tokens[:, :-1], tokens[:, 1:])
        losses.total.backward()
        return losses.total.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    lt, gt = run("0")
    lk, gk = run("1")
    assert abs(lk - lt) <= 1e-5 * abs(lt)
    assert_grads_close(gk, gt, 1e-3)
