"""The sparse training attention kernel (`kernels/triton/sparse_train.py`, issue 18) against the torch
twin (`model.sparse_attention.attend_sparse`: band + gathered rows, autograd) and against a float64
dense formula written here (every key of the row, masks, one softmax with the sink).

CPU tests run the kernels in Triton's interpreter (fp32 dots) on small shapes with packed documents,
a bounded-replay start, invalid entries, H not a power of two and T not a multiple of the window:
the output, the log-sum-exp, the entry logits (the indexer KL's target) and every input gradient
(q, window keys, entry pool, sink). `gpu` tests repeat the twin comparison at `small` widths in fp32
and bf16.
"""

from __future__ import annotations

import pytest
import torch

from dsv41.model.attention import topk_mask
from dsv41.model.sparse_attention import attend_sparse, gather_rows, window_band
from dsv41.model.state import ForwardContext

sparse_train = pytest.importorskip("dsv41.kernels.triton.sparse_train")

# fp32 kernel (interpreter: fp32 dots) vs the float64 formula, max error over the largest magnitude.
# Measured: ≤ 4.2e-7 (output, LSE, logits), ≤ 2.7e-7 (gradients); the fp32 twin is as far (≤ 4.5e-7).
REL = 2e-6
GRADS = ("q", "kv", "pool", "sink")


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    """Every output and scratch buffer starts as NaN: an element the kernels never write fails."""
    monkeypatch.setattr(sparse_train, "_empty",
                        lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device))


def make_case(B: int, T: int, H: int, D: int, N: int, K: int, W: int, *, seed: int, replay: bool = True,
              dtype: torch.dtype = torch.float32, device: str = "cpu", empty_rows: bool = True) -> dict:
    """Random inputs: row 0 one document, row 1 three packed documents; replay starts in both rows;
    top-k lists of distinct slots with −1 padding and picks the validity mask turns off."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=g)
    kv = torch.randn(B, T, D, generator=g)
    pool = torch.randn(B, N, D, generator=g)
    sink = torch.randn(H, generator=g)
    doc = torch.zeros(B, T, dtype=torch.long)
    if B > 1:
        doc[1, T // 3:] = 1
        doc[1, (2 * T) // 3 + 1:] = 2
    t = torch.arange(T)
    ws = None
    if replay:
        ws = torch.stack([torch.where(t >= T // 2, T // 2, 0)] + [torch.where(t >= T // 4 + 3, T // 4 + 3, 0)]
                         * (B - 1))  # (B, T)
    topk = torch.argsort(torch.rand(B, T, N, generator=g), dim=-1)[..., :K]  # distinct per query
    topk = torch.where(torch.rand(B, T, K, generator=g) < 0.2, -1, topk)
    valid = (topk >= 0) & (torch.rand(B, T, K, generator=g) < 0.8)
    if empty_rows:
        valid[:, :3] = False  # queries with no entry at all
    args = dict(q=q, kv=kv, pool=pool, sink=sink)
    args = {k: v.to(device=device, dtype=dtype) for k, v in args.items()}
    return dict(**args, doc=doc.to(device), ws=None if ws is None else ws.to(device), topk=topk.to(device),
                valid=valid.to(device), W=W, scale=D ** -0.5)


def run_kernel(c: dict, entry_logits: bool = False, **knobs):
    index = torch.where(c["valid"], c["topk"], -1)
    return sparse_train.sparse_train_attention(c["q"], c["kv"], c["doc"], c["ws"], c["W"], c["pool"], index,
                                               c["sink"], c["scale"], entry_logits=entry_logits, **knobs)


def run_twin(c: dict):
    band = window_band(c["doc"], c["ws"], c["W"])
    return attend_sparse(c["q"], c["kv"], band, c["W"], gather_rows(c["pool"], c["topk"]), c["valid"], c["sink"],
                         c["scale"])


def dense64(c: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 from the formula: logits of all T keys and all N entries, masked; one softmax with the sink."""
    q, kv, pool, sink = (c[k].double() for k in ("q", "kv", "pool", "sink"))
    B, T, H, D = q.shape
    wmask = ForwardContext.build(c["doc"], c["doc"], window_start=c["ws"]).window_mask(c["W"])  # (B, T, T)
    emask = topk_mask(torch.where(c["valid"], c["topk"], -1), pool.size(1))  # (B, T, N)
    logits = torch.cat((torch.einsum("bthd,bsd->bths", q, kv), torch.einsum("bthd,bnd->bthn", q, pool)), -1)
    logits = (logits * c["scale"]).masked_fill(~torch.cat((wmask, emask), -1).unsqueeze(2), float("-inf"))
    logits = torch.cat((logits, sink.view(1, 1, H, 1).expand(B, T, H, 1)), -1)  # (B, T, H, T + N + 1)
    lse = torch.logsumexp(logits, -1)
    probs = torch.exp(logits - lse.unsqueeze(-1))[..., :-1]
    return torch.einsum("bths,bsd->bthd", probs, torch.cat((kv, pool), 1)), lse


def _rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.detach().double(), expected.detach().double()
    assert a.shape == e.shape, (tuple(a.shape), tuple(e.shape))
    assert bool(torch.isfinite(a).all()), "non-finite values (an unwritten element?)"
    return ((a - e).abs().max() / e.abs().max().clamp_min(1e-30)).item()


def _check(what: str, actual: torch.Tensor, expected: torch.Tensor, tol: float = REL) -> float:
    err = _rel(actual, expected)
    print(f"{what}: max rel err {err:.2e}")
    assert err <= tol, f"{what}: max err {err:.2e} of the largest magnitude (tolerance {tol:.0e})"
    return err


CASES = {
    # T = 45 not a multiple of W = 8; three packed documents in row 1; replay starts; K < one entry tile;
    # 16-row / 16-key window tiles (several key tiles per query tile, several query tiles per key tile)
    "packed-replay": dict(B=2, T=45, H=3, D=16, N=24, K=5, W=8, knobs=dict(block_m=16, block_n=16)),
    # K = 20 spans two entry tiles (16 in the interpreter); H = 6 heads padded to 16 MMA rows
    "two-entry-tiles": dict(B=2, T=37, H=6, D=32, N=40, K=20, W=16),
    # a window longer than the sequence, no replay start, one row
    "window-past-T": dict(B=1, T=30, H=2, D=16, N=10, K=4, W=64, replay=False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_equals_dense_float64_and_twin(name):
    """Output, LSE, entry logits and the gradients of q, window keys, entry pool and sink."""
    shape = dict(CASES[name])
    knobs = shape.pop("knobs", {})
    c = make_case(shape.pop("B"), shape.pop("T"), shape.pop("H"), shape.pop("D"), shape.pop("N"), shape.pop("K"),
                  shape.pop("W"), seed=11 + len(name), **shape)
    leaves = [c[k].requires_grad_(True) for k in GRADS]
    o, lse, logits = run_kernel(c, entry_logits=True, **knobs)
    o64, lse64 = dense64(c)
    twin = run_twin(c)
    _check(f"{name} output vs float64", o, o64)
    _check(f"{name} output vs twin", o, twin)
    _check(f"{name} LSE vs float64", lse, lse64)
    picked = gather_rows(c["pool"], c["topk"]).double()  # (B, T, K, D)
    want = torch.einsum("bthd,btkd->bthk", c["q"].double(), picked) * c["scale"]
    on = c["valid"].unsqueeze(2).expand_as(want)  # only the valid picks' logits are defined
    _check(f"{name} entry logits", logits[on], want[on])
    w = torch.randn(o.shape, generator=torch.Generator().manual_seed(5))
    got = torch.autograd.grad((o * w).sum(), leaves)
    exact = torch.autograd.grad((o64 * w.double()).sum(), leaves)
    twin_g = torch.autograd.grad((twin * w).sum(), leaves)
    for n, a, e, tw in zip(GRADS, got, exact, twin_g):
        _check(f"{name} d{n} vs float64", a, e)
        _check(f"{name} d{n} vs twin", a, tw)


def test_window_only_and_no_valid_entry():
    """No entry pool (a window-only layer) and a pool whose picks are all invalid: both equal the
    window-only float64 formula, the pool's gradient is zero."""
    c = make_case(2, 33, 4, 16, 12, 3, 8, seed=21)
    c["valid"][:] = False
    for k in GRADS:
        c[k].requires_grad_(True)
    o64, lse64 = dense64(c)
    w = torch.randn(o64.shape, generator=torch.Generator().manual_seed(6))
    exact = torch.autograd.grad((o64 * w.double()).sum(), [c["q"], c["kv"], c["sink"]])
    o, lse, _ = sparse_train.sparse_train_attention(c["q"], c["kv"], c["doc"], c["ws"], c["W"], None, None, c["sink"],
                                                    c["scale"])
    _check("window-only output", o, o64)
    _check("window-only LSE", lse, lse64)
    for n, a, e in zip(("q", "kv", "sink"), torch.autograd.grad((o * w).sum(), [c["q"], c["kv"], c["sink"]]), exact):
        _check(f"window-only d{n}", a, e)
    o, lse, logits = run_kernel(c, entry_logits=True)
    _check("all-invalid output", o, o64)
    dpool = torch.autograd.grad((o * w).sum(), c["pool"])[0]
    assert bool((dpool == 0).all()), "an invalid pick received a gradient"


def test_bad_input_is_a_clear_error():
    c = make_case(1, 8, 2, 16, 4, 2, 4, seed=3, replay=False)
    with pytest.raises(ValueError, match="unsupported"):
        sparse_train.sparse_train_attention(c["q"][..., :12], c["kv"][..., :12], c["doc"], None, 4, None, None,
                                            c["sink"], 0.3)
    with pytest.raises(ValueError, match="window_kv"):
        sparse_train.sparse_train_attention(c["q"], c["kv"][:, :5], c["doc"], None, 4, None, None, c["sink"], 0.3)
    with pytest.raises(ValueError, match="one dtype"):
        run_kernel({**c, "pool": c["pool"].bfloat16()})
    with pytest.raises(ValueError, match="unsupported"):
        run_kernel({**c, "pool": c["pool"].double()})


@pytest.mark.slow
# ---- GPU: `small` widths, fp32 and bf16 ------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_small_widths_match_twin(dtype):
    """H = 6, D = 128, W = 128, K = 128, N = 512 (a ratio-2 layer of `small` at T = 1024). fp32: the
    kernel's IEEE dots vs the twin in fp32; bf16: the kernel and the bf16 twin against the float64
    formula — the kernel no further than twice the twin's error."""
    c = make_case(2, 1024, 6, 128, 512, 128, 128, seed=31, dtype=dtype, device="cuda")
    leaves = [c[k].requires_grad_(True) for k in GRADS]
    o, lse, _ = run_kernel(c)
    twin = run_twin(c)
    w = torch.randn(o.shape, generator=torch.Generator().manual_seed(9)).to(device="cuda", dtype=dtype)
    got = (o,) + torch.autograd.grad((o * w).sum(), leaves)
    ref = (twin,) + torch.autograd.grad((twin * w).sum(), leaves)
    if dtype == torch.float32:
        for n, a, e in zip(("o",) + GRADS, got, ref):
            _check(f"gpu fp32 {n}", a, e, 1e-5)
        return
    c64 = {**c, **{k: c[k].detach().double() for k in GRADS}}
    for k in GRADS:
        c64[k].requires_grad_(True)
    o64, _ = dense64(c64)
    exact = (o64,) + torch.autograd.grad((o64 * w.double()).sum(), [c64[k] for k in GRADS])
    for n, a, tw, e in zip(("o",) + GRADS, got, ref, exact):
        ek, et = _rel(a, e), _rel(tw, e)
        print(f"gpu bf16 {n}: kernel {ek:.2e} twin {et:.2e} vs float64")
        assert ek <= 2 * et + 1e-3, f"{n}: kernel err {ek:.2e} vs the bf16 twin's {et:.2e}"
