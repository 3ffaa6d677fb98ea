"""`ops.engram_hash` and `ops.engram_gate`: the Triton kernels against their twins (`kernels.ref.engram`, the
model's formulas), the gate twin against the formula written out here in fp64, and the model's dispatch
(inference → the ops, training / document ids → the twin)."""

from __future__ import annotations

import math

import pytest
import torch
from tests.conftest import FP32_RTOL, assert_close

import dsv41
from dsv41.kernels import ops
from dsv41.kernels.ops import use_backend
from dsv41.model.engram import Engram, NgramHasher
from dsv41.plan import engram_table_rows

# fp32 gate against the bound 1e-6 + 1e-5·|out| (|out| up to ~12 here): kernel vs twin measured max abs error 9.5e-7,
# worst ratio 0.22 (reduction order, rsqrt); twin vs the fp64 formula 4.8e-7, worst ratio 0.06
GATE_ATOL = 1e-6
# on the GPU, v41-flash's dim 5120: measured 3.8e-6 (H100, 2026-12-06) — 5120-term fp32 sums in another order and
# the GPU's sqrt / exp; about 2.6x that
GPU_GATE_ATOL = 1e-5


def _config(preset: str = "tiny", layers: list[int] | None = None) -> dsv41.ModelConfig:
    c = dsv41.load_config(preset)
    if layers is not None:
        c = c.replace(engram_layer_ids=layers, engram_num_embeddings=[1] * len(layers))
        c = c.replace(engram_num_embeddings=engram_table_rows(c))
    return c


# ---------------------------------------------------------------------- the gate
def _gate_inputs(B, T, hc, D, dtype, seed, mask: bool):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, hc, D, generator=g) * 3
    x[0, 0, min(1, hc - 1)] = 0  # a zero stream: dot = 0, sign 0, gate σ(0) = ½
    kv = torch.randn(B, T, (hc + 1) * D, generator=g)
    q_weight = torch.rand(hc, D, generator=g) + 0.5
    k_weight = torch.rand(hc, D, generator=g) + 0.5
    token_mask = torch.rand(B, T, generator=g) < 0.7 if mask else None
    return x.to(dtype), kv.to(dtype), q_weight.to(dtype), k_weight.to(dtype), token_mask


def gate_formula(x, kv, q_weight, k_weight, eps, token_mask):
    """fp64, one (token, stream) at a time, the RMS written as a vector length."""
    B, T, hc, D = x.shape
    out = torch.empty(B, T, hc, D, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            row = kv[b, t].double()
            value = row[hc * D:]
            for j in range(hc):
                h, key = x[b, t, j].double(), row[j * D:(j + 1) * D]
                w = (q_weight[j] * k_weight[j]).double()
                rms_h = math.sqrt(h.norm().item() ** 2 / D + eps)
                rms_k = math.sqrt(key.norm().item() ** 2 / D + eps)
                dot = (h * w * key).sum().item() / (rms_h * rms_k) / math.sqrt(D)
                z = math.copysign(math.sqrt(max(abs(dot), 1e-6)), dot) if dot != 0 else 0.0
                gate = 1 / (1 + math.exp(-z))
                if token_mask is not None and not token_mask[b, t]:
                    gate = 0.0
                out[b, t, j] = h + gate * value
    return out


@pytest.mark.parametrize("eps", [1e-20, 0.3])
@pytest.mark.parametrize("mask", [False, True])
def test_gate_twin_is_the_formula(mask, eps):
    x, kv, qw, kw, token_mask = _gate_inputs(2, 3, 4, 40, torch.float32, seed=11 + mask, mask=mask)
    with use_backend("torch"):
        got = ops.engram_gate(x, kv, qw, kw, eps, token_mask)
    want = gate_formula(x, kv, qw, kw, eps, token_mask)
    assert_close(got, want, rtol=FP32_RTOL, atol=GATE_ATOL, what="twin vs fp64")
    if token_mask is None or token_mask[0, 0]:  # the zero stream: gate σ(0) = ½ exactly
        assert torch.equal(got[0, 0, 1], 0.5 * kv[0, 0, 4 * 40:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask", [False, True])
@pytest.mark.parametrize("hc,D", [(4, 48), (3, 64), (4, 600)])
def test_gate_kernel_equals_twin(dtype, mask, hc, D):
    """Non-power-of-two dim (masked columns), a non-power-of-two stream count, and a dim past one BLOCK_D chunk."""
    x, kv, qw, kw, token_mask = _gate_inputs(2, 3, hc, D, dtype, seed=hc * D + mask, mask=mask)
    with use_backend("torch"):
        twin = ops.engram_gate(x, kv, qw, kw, 1e-6, token_mask)
    with use_backend("triton"):
        got = ops.engram_gate(x, kv, qw, kw, 1e-6, token_mask)
    assert got.dtype == twin.dtype == dtype and got.shape == twin.shape
    if dtype == torch.float32:
        assert_close(got, twin, rtol=FP32_RTOL, atol=GATE_ATOL, what="kernel vs twin")
    else:
        # the same fp32 value up to its reduction order, rounded once: at most one bf16 unit apart (measured:
        # identical on these cases — the kernel rounds to nearest even like torch)
        diff = (got.float() - twin.float()).abs()
        assert (diff <= twin.float().abs() * 2**-7 + GATE_ATOL).all(), diff.max()
    if mask:  # masked tokens pass through unchanged, bit for bit
        assert torch.equal(got[~token_mask], x[~token_mask])


def test_gate_strides_and_weights_dtype():
    """A strided x (a slice of wider streams), bf16 weights with fp32 streams: the weights' product rounds in bf16."""
    g = torch.Generator().manual_seed(5)
    wide = torch.randn(2, 3, 4, 80, generator=g)
    x = wide[..., :48]
    kv = torch.randn(2, 3, 5 * 48, generator=g)
    qw = (torch.rand(4, 48, generator=g) + 0.5).bfloat16()
    kw = (torch.rand(4, 48, generator=g) + 0.5).bfloat16()
    with use_backend("torch"):
        twin = ops.engram_gate(x, kv, qw, kw, 1e-6)
    with use_backend("triton"):
        got = ops.engram_gate(x, kv, qw, kw, 1e-6)
    assert_close(got, twin, rtol=FP32_RTOL, atol=GATE_ATOL, what="strided / bf16 weights")


def test_gate_bad_shapes_are_clear_errors():
    x, kv, qw, kw, _ = _gate_inputs(1, 2, 4, 16, torch.float32, seed=0, mask=False)
    with use_backend("triton"), pytest.raises(ValueError, match="kv"):
        ops.engram_gate(x, kv[..., :-1], qw, kw, 1e-6)
    with use_backend("triton"), pytest.raises(ValueError, match="token_mask"):
        ops.engram_gate(x, kv, qw, kw, 1e-6, torch.ones(2, 1, dtype=torch.bool))


# ---------------------------------------------------------------------- the hash
def _hash_case(c, B, T, history: str, dead: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    H = c.engram_max_ngram_size - 1
    tokens = torch.randint(0, c.vocab_size, (B, T), generator=g)
    top = torch.rand(B, T, generator=g) < 0.3
    tokens[top] = c.vocab_size - 1 - torch.randint(0, 3, (int(top.sum()),), generator=g)  # the top of the vocab
    tokens[torch.rand(B, T, generator=g) < 0.1] = -1  # dead by a negative id
    dead_mask = torch.rand(B, T, generator=g) < 0.2 if dead else None
    width = {"none": 0, "short": 1, "full": H, "wide": H + 2}[history]
    hist = None
    if width:
        hist = torch.randint(0, c.vocab_size, (B, width), generator=g)
        hist[torch.rand(B, width, generator=g) < 0.3] = -1  # sequence start / dead entries
        hist[0, -1] = c.vocab_size - 1
    return tokens, hist, dead_mask


def _hash_both(hasher, tokens, **kw):
    with use_backend("torch"):
        twin = hasher(tokens, **kw)
    with use_backend("triton"):
        got = hasher(tokens, **kw)
    return got, twin


@pytest.mark.parametrize("history", ["none", "short", "full", "wide"])
@pytest.mark.parametrize("dead", [False, True])
@pytest.mark.parametrize("B,T", [(1, 1), (5, 1), (3, 11)])
def test_hash_kernel_equals_twin(B, T, history, dead):
    c = _config("tiny", [1, 5])
    hasher = NgramHasher(c)
    tokens, hist, dead_mask = _hash_case(c, B, T, history, dead, seed=B * 100 + T + 7 * dead + len(history))
    got, twin = _hash_both(hasher, tokens, history=hist, dead_mask=dead_mask)
    assert got.dtype == torch.int64 and got.shape == (B, T, 2, c.n_engram_hash_cols)
    mismatch = (got != twin).sum().item()
    assert mismatch == 0, f"{mismatch} of {twin.numel()} ids differ"


def test_hash_token_map_strided_inputs_and_int32():
    """A compressed token map, the decode buffers' transposed (B, T) views, int32 ids: still bit-identical."""
    c = _config("tiny", [1, 5])
    g = torch.Generator().manual_seed(3)
    hasher = NgramHasher(c)
    hasher.set_token_map(torch.randint(0, 3001, (c.vocab_size,), generator=g), 3001)
    tokens, hist, dead_mask = _hash_case(c, 4, 6, "full", True, seed=4)
    kw = dict(history=hist.t().contiguous().t(), dead_mask=dead_mask.t().contiguous().t())
    got, twin = _hash_both(hasher, tokens.t().contiguous().t().int(), **kw)
    assert torch.equal(got, twin)


def test_hash_wrapping_products_and_floored_modulo():
    """Multipliers past the bound: products wrap in int64 and rolling hashes go negative; the kernel wraps like
    torch and takes torch's floored `%` (non-negative ids) — the safety margin of the real bound is not needed."""
    c = _config("tiny", [1, 5])
    hasher = NgramHasher(c)
    g = torch.Generator().manual_seed(9)
    hasher.multipliers = torch.randint(2**60, 2**62, hasher.multipliers.shape, generator=g) * 2 + 1
    tokens, hist, dead_mask = _hash_case(c, 3, 9, "full", True, seed=10)
    assert (hasher.token_map[c.vocab_size - 1] * hasher.multipliers < 0).any()  # they do wrap
    got, twin = _hash_both(hasher, tokens, history=hist, dead_mask=dead_mask)
    assert torch.equal(got, twin)
    assert (twin >= hasher.offsets).all()


def test_hash_release_layout():
    """The v41-flash hasher (8 heads, 48 columns, the compressed vocabulary's multipliers)."""
    c = dsv41.load_config("v41-flash")
    hasher = NgramHasher(c)
    tokens, hist, dead_mask = _hash_case(c, 2, 5, "full", True, seed=1)
    got, twin = _hash_both(hasher, tokens, history=hist, dead_mask=dead_mask)
    assert got.shape == (2, 5, 2, 24) and torch.equal(got, twin)


# ---------------------------------------------------------------------- the model's dispatch
def test_engram_module_runs_the_fused_ops_and_trains_on_the_twin():
    """Inference: the module output is the same on either backend. Training (a gradient), with Triton forced:
    the twin runs, so autograd works and the numbers are the torch path's bit for bit. Document ids: the twin."""
    c = _config("tiny")
    torch.manual_seed(2)
    m = Engram(c, c.engram_layer_ids[0])
    with torch.no_grad():
        m.q_weight.uniform_(0.5, 1.5)
    hasher = NgramHasher(c)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, c.vocab_size, (2, 6), generator=g)
    x = torch.randn(2, 6, c.hc_mult, c.dim, generator=g)
    mask = torch.rand(2, 6, generator=g) < 0.7
    ids, ids_twin = _hash_both(hasher, tokens)
    assert torch.equal(ids, ids_twin)
    with torch.no_grad(), use_backend("torch"):
        twin = m(x, ids, mask)
    with torch.no_grad(), use_backend("triton"):
        got = m(x, ids, mask)
    assert_close(got, twin, rtol=FP32_RTOL, atol=GATE_ATOL, what="module")
    with use_backend("triton"):
        trained = m(x, ids, mask)
        trained.square().sum().backward()
        doc_ids = torch.tensor([[0, 0, 0, 1, 1, 1]] * 2)
        packed = hasher(tokens, doc_ids=doc_ids)
    assert trained.requires_grad and m.q_weight.grad is not None
    assert torch.equal(trained.detach(), twin)
    with use_backend("torch"):
        assert torch.equal(packed, hasher(tokens, doc_ids=doc_ids))


# ---------------------------------------------------------------------- on the GPU
@pytest.mark.gpu
@pytest.mark.parametrize("N", [1, 64, 777])
def test_gpu_gate_equals_twin(N):
    """The v41-flash streams (hc 4, dim 5120) in bf16 and fp32, auto dispatch on CUDA."""
    for dtype in (torch.bfloat16, torch.float32):
        x, kv, qw, kw, mask = _gate_inputs(1, N, 4, 5120, dtype, seed=N, mask=True)
        x, kv, qw, kw, mask = (t.cuda() for t in (x, kv, qw, kw, mask))
        with use_backend("torch"):
            twin = ops.engram_gate(x, kv, qw, kw, 1e-20, mask)
        got = ops.engram_gate(x, kv, qw, kw, 1e-20, mask)
        if dtype == torch.float32:
            assert_close(got, twin, rtol=FP32_RTOL, atol=GPU_GATE_ATOL, what=f"N={N}")
        else:
            diff = (got.float() - twin.float()).abs()
            assert (diff <= twin.float().abs() * 2**-7 + GPU_GATE_ATOL).all(), diff.max()


@pytest.mark.gpu
@pytest.mark.parametrize("B,T", [(64, 1), (3, 300)])
def test_gpu_hash_equals_twin_and_captures(B, T):
    """The v41-flash hasher on CUDA, then both ops captured in a CUDA graph and replayed on new tokens."""
    c = dsv41.load_config("v41-flash")
    hasher = NgramHasher(c).cuda()
    tokens, hist, dead = (t.cuda() for t in _hash_case(c, B, T, "full", True, seed=B + T))
    with use_backend("torch"):
        twin = hasher(tokens, history=hist, dead_mask=dead)
    assert torch.equal(hasher(tokens, history=hist, dead_mask=dead), twin)
    x, kv, qw, kw, mask = (t.cuda() for t in _gate_inputs(B, T, 4, 5120, torch.bfloat16, seed=1, mask=True))
    ops.engram_gate(x, kv, qw, kw, 1e-20, mask)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids = hasher(tokens, history=hist, dead_mask=dead)
        out = ops.engram_gate(x, kv, qw, kw, 1e-20, mask)
    new_tokens, new_hist, new_dead = (t.cuda() for t in _hash_case(c, B, T, "full", True, seed=B + T + 1))
    tokens.copy_(new_tokens)
    hist.copy_(new_hist)
    dead.copy_(new_dead)
    x.mul_(-1)
    graph.replay()
    with use_backend("torch"):
        assert torch.equal(ids, hasher(tokens, history=hist, dead_mask=dead))
        want = ops.engram_gate(x, kv, qw, kw, 1e-20, mask)
    diff = (out.float() - want.float()).abs()
    assert (diff <= want.float().abs() * 2**-7 + GATE_ATOL).all(), diff.max()
