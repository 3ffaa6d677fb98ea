"""Lightning-indexer kernels: Triton vs the torch twin vs the model's own code.

CPU tests run the Triton kernels in the interpreter at tiny sizes (portable `bits` decode, fp32
dots); the GPU decode (inline PTX) is checked here by emulating its instructions on every byte,
and end to end by the `gpu` tests at v41-flash sizes.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from dsv41.kernels import ops
from dsv41.kernels.ops import use_backend
from dsv41.kernels.ref import indexer as ref
from dsv41.kernels.ref.cache_write import dequantize_rows
from dsv41.model.attention import Indexer, select_candidate_blocks, select_topk
from dsv41.quant.fp4 import INDEX_BLOCK, fake_quant_index_fp4, fp4_decode, quantize_fp4
from dsv41.quant.fp8 import e8m0_to_float

tri = pytest.importorskip("dsv41.kernels.triton.indexer")

NAN_POISON = float("nan")
INT_POISON = -7777


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    """Every output the Triton launchers allocate starts as garbage: NaN / a sentinel integer."""
    def empty(shape, dtype, device):
        fill = NAN_POISON if dtype.is_floating_point else INT_POISON
        return torch.full(shape, fill, dtype=dtype, device=device)
    monkeypatch.setattr(tri, "_empty", empty)


# --------------------------------------------------------------------------------------------- inputs
def _pool(n_pages: int, page_rows: int, Di: int, gen: torch.Generator, device="cpu") -> tuple[Tensor, Tensor]:
    """(pool (n_pages, page_rows, row_bytes) uint8, the fp32 keys it holds (n_pages·page_rows, Di))."""
    x = torch.randn(n_pages * page_rows, Di, generator=gen) * torch.rand(n_pages * page_rows, 1, generator=gen) * 3
    x[:, :Di // 2] *= 0.25  # scale blocks differ inside a key
    packed, scales = quantize_fp4(x.to(device), INDEX_BLOCK, "e8m0")
    pool = torch.cat([packed, scales], dim=-1).view(n_pages, page_rows, -1)
    return pool, dequantize_rows(pool.view(n_pages * page_rows, -1), "index_fp4", Di)


def _case(B, T, Hi, Di, page_rows, n_keys, gen, device="cpu", spare_pages=3):
    """Random queries, weights (both signs), pages in random order, ragged lengths."""
    pages_per_seq = max(1, -(-max(n_keys) // page_rows))
    n_pages = B * pages_per_seq + spare_pages
    pool, key_vals = _pool(n_pages, page_rows, Di, gen, device)
    page_table = torch.randperm(n_pages, generator=gen)[:B * pages_per_seq].view(B, pages_per_seq).to(torch.int32)
    q = fake_quant_index_fp4(torch.randn(B, T, Hi, Di, generator=gen) * 2)
    q[..., -32:] *= 8  # query blocks with different E8M0 scales too
    q = fake_quant_index_fp4(q)
    w = torch.randn(B, T, Hi, generator=gen)
    return dict(q=q.to(device), weights=w.to(device), key_pool=pool, page_table=page_table.to(device),
                page_rows=page_rows, n_keys=torch.tensor(n_keys, device=device)), key_vals.to(device)



def _magnitude(args: dict, **kw) -> Tensor:
    """Σ_h |w|·relu(q·k): the size of the terms each score sums (bounds summation-order error)."""
    a = dict(args, weights=args["weights"].abs())
    out = ref.indexer_scores(**a, **kw)[0] if "n_max" in kw else ref.indexer_scores_blocks(**a, **kw)
    return out.nan_to_num(neginf=0.0)


def _assert_scores(actual: Tensor, expected: Tensor, magnitude: Tensor, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert not actual.isnan().any(), f"{what}: NaN (an element was not written)"
    assert torch.equal(actual == float("-inf"), expected == float("-inf")), f"{what}: −inf positions differ"
    finite = expected.isfinite()
    err = (actual - expected).abs()[finite].double()
    bound = (1e-5 * magnitude[finite] + 1e-6).double()
    assert bool((err <= bound).all()), f"{what}: max err {err.max():.3e}, worst ratio {(err / bound).max():.2f}"


# --------------------------------------------------------------------------------------------- PTX decoders
def _prmt(a: int, b: int, c: int) -> int:
    pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        sel = (c >> (4 * i)) & 0xF
        byte = pool[sel & 7]
        if sel & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def _bf16x2(x: int) -> list[float]:
    halves = torch.tensor([x & 0xFFFF, x >> 16], dtype=torch.int32).to(torch.int16)
    return halves.view(torch.bfloat16).float().tolist()


def _mul_bf16x2(a: int, b: int) -> int:
    prod = torch.tensor(_bf16x2(a)) * torch.tensor(_bf16x2(b))
    bits = prod.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    return int(bits[0]) | (int(bits[1]) << 16)


def _run_ptx(asm: str, args: list[int], n_out: int) -> list[int]:
    """Execute the straight-line PTX subset the decoders use ($i operands, b32 registers)."""
    regs = {f"${i}": v for i, v in enumerate([0] * n_out + args)}
    m32 = 0xFFFFFFFF

    def val(tok: str) -> int:
        tok = tok.strip()
        return regs[tok] if tok in regs else int(tok, 0) & m32

    for line in asm.strip().strip("{}").splitlines():
        line = line.strip().rstrip(";")
        if not line or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        dst, *src = [s.strip() for s in rest.split(",")]
        x = [val(s) for s in src]
        if op == "and.b32":
            r = x[0] & x[1]
        elif op == "or.b32":
            r = x[0] | x[1]
        elif op == "shl.b32":
            r = (x[0] << x[1]) & m32
        elif op == "shr.u32":
            r = x[0] >> x[1]
        elif op == "prmt.b32":
            r = _prmt(*x)
        elif op == "mul.rn.bf16x2":
            r = _mul_bf16x2(*x)
        else:
            raise AssertionError(f"unknown instruction {op}")
        regs[dst] = r
    return [regs[f"${i}"] for i in range(n_out)]


def test_ptx_decoders_match_fp4():
    """The GPU decoders, instruction by instruction, on all 256 bytes in every byte position."""
    gen = torch.Generator().manual_seed(1)
    values = torch.randperm(256, generator=gen).view(64, 4)
    scale_bytes = torch.randint(110, 140, (64, 4), generator=gen)
    for word_bytes, sbytes in zip(values.tolist(), scale_bytes.tolist()):
        word = sum(v << (8 * i) for i, v in enumerate(word_bytes))
        codes = torch.tensor(word_bytes)
        want_lo, want_hi = fp4_decode(codes & 0xF), fp4_decode(codes >> 4)
        # E4M3: lo / hi bytes encode value · 2^-6
        lo, hi = _run_ptx(tri._E4M3_PTX.value, [word], 2)
        for got, want in ((lo, want_lo), (hi, want_hi)):
            e4m3 = torch.tensor([(got >> (8 * i)) & 0xFF for i in range(4)], dtype=torch.uint8)
            assert torch.equal(e4m3.view(torch.float8_e4m3fn).float() * 64, want), (word_bytes, hex(got))
        # bf16 times the E8M0 scale of each byte
        sc = e8m0_to_float(torch.tensor(sbytes, dtype=torch.uint8))
        s_bits = [int(b) << 7 for b in sbytes]
        out = _run_ptx(tri._BF16_PTX.value, [word, s_bits[0] | s_bits[1] << 16, s_bits[2] | s_bits[3] << 16], 4)
        got_lo = torch.tensor(_bf16x2(out[0]) + _bf16x2(out[1]))
        got_hi = torch.tensor(_bf16x2(out[2]) + _bf16x2(out[3]))
        assert torch.equal(got_lo, want_lo * sc) and torch.equal(got_hi, want_hi * sc), word_bytes


# --------------------------------------------------------------------------------------------- scores
SCORE_CASES = [  # B, T, Hi, Di, page_rows, n_keys, n_max, block_size, knobs
    (2, 3, 4, 32, 16, [37, 50], 50, 8, dict(block_n=16, tiles=2)),
    (1, 4, 3, 64, 12, [41], 45, 4, dict(block_n=16, block_t=2)),  # page_rows ∤ block_n: lookup per entry
    (3, 2, 2, 128, 32, [0, 1, 70], 70, 3, dict(block_n=16, tiles=3)),  # block 3: torch block max
]


@pytest.mark.parametrize("case", SCORE_CASES)
def test_scores_match_twin(case):
    """Default knobs through ops (fp8 MMA, block max), then both MMA kinds with small tiles."""
    B, T, Hi, Di, page_rows, n_keys, n_max, bs, knobs = case
    gen = torch.Generator().manual_seed(Di)
    args, _ = _case(B, T, Hi, Di, page_rows, n_keys, gen)
    visible_end = torch.randint(-2, n_max + 5, (B, T), generator=gen)
    visible_end[0, 0] = n_max + 10  # everything stored is visible
    args["visible_end"] = visible_end
    want, want_max = ref.indexer_scores(**args, n_max=n_max, block_size=bs)
    with use_backend("triton"):
        got, got_max = ops.indexer_scores(**args, n_max=n_max, block_size=bs)
    got_bf16, got_bf16_max = tri.indexer_scores(**args, n_max=n_max, block_size=bs, mma="bf16", **knobs)
    got_fp8, none = tri.indexer_scores(**args, n_max=n_max, block_size=0, mma="fp8", **knobs)
    assert none is None
    mag = _magnitude(args, n_max=n_max)
    for g, what in ((got, "default"), (got_bf16, "bf16"), (got_fp8, "fp8")):
        _assert_scores(g, want, mag, f"scores {what} {case[:4]}")
    for g in (got_max, got_bf16_max):
        _assert_scores(g, want_max, ref.block_maxima(mag, bs), "block max")
    assert bool(want.isfinite().any()) and bool((want == float("-inf")).any())  # the case tests both


LAYOUT_CASES = [  # page_rows, n_keys, n_max, block_size, knobs (Di = 128: the `mma` tile design)
    (32, [70, 33], 75, 8, dict(block_n=16, tiles=3, prefetch=1)),  # several tiles per program, ragged
    (32, [70, 33], 75, 8, dict(block_n=16, tiles=2, prefetch=0)),
    (24, [61, 9], 64, 4, dict(block_n=16, tiles=2)),  # page_rows ∤ block_n: page lookup per entry
    (64, [100, 64], 128, 16, dict(block_n=64, tiles=1, num_warps=4)),  # rows over 4 warps (`_rows5`)
    (64, [100, 64], 128, 16, dict(block_n=64, tiles=2, num_warps=8, block_t=2)),  # 2 queries, 4 row-warps
]


@pytest.mark.parametrize("case", LAYOUT_CASES)
def test_scores_tile_designs(case):
    """Di = 128 through both tile designs (`mma`: split channel order, row-form loads, prefetch; `v1`)."""
    page_rows, n_keys, n_max, bs, knobs = case
    B, T, Hi, Di = 2, 3, 4, 128
    gen = torch.Generator().manual_seed(page_rows + n_max)
    args, _ = _case(B, T, Hi, Di, page_rows, n_keys, gen)
    args["visible_end"] = torch.stack([torch.randint(-1, n_max + 3, (T,), generator=gen) for _ in range(B)])
    args["visible_end"][0, 0] = n_max
    want, want_max = ref.indexer_scores(**args, n_max=n_max, block_size=bs)
    mag = _magnitude(args, n_max=n_max)
    for layout in tri.LAYOUTS:
        for mma in tri.MMAS:
            got, got_max = tri.indexer_scores(**args, n_max=n_max, block_size=bs, mma=mma, layout=layout, **knobs)
            _assert_scores(got, want, mag, f"scores {layout} {mma} {knobs}")
            _assert_scores(got_max, want_max, ref.block_maxima(mag, bs), f"block max {layout} {mma}")
    assert bool(want.isfinite().any()) and bool((want == float("-inf")).any())


def test_split_channel_order_matches_keys():
    """The `mma` design's channel order (low nibbles, then high ones, per scale block) is the same
    permutation on keys and queries: a key with one non-zero channel scores only against it."""
    gen = torch.Generator().manual_seed(12)
    B, T, Hi, Di, page_rows = 1, 1, 1, 128, 16
    args, _ = _case(B, T, Hi, Di, page_rows, [16], gen)
    q = torch.zeros(B, T, Hi, Di)
    q[..., :] = torch.arange(Di) % 6 + 1.0  # distinct small integers: which channel met which is visible
    keys = torch.zeros(16, Di)
    keys[torch.arange(16), torch.randperm(Di, generator=gen)[:16]] = 1.0  # one channel per key
    packed, scales = quantize_fp4(keys, INDEX_BLOCK, "e8m0")
    args.update(q=q, weights=torch.ones(B, T, Hi), visible_end=torch.tensor([[16]]),
                key_pool=torch.cat([packed, scales], dim=-1).view(1, 16, -1),
                page_table=torch.zeros(1, 1, dtype=torch.int32))
    got, _ = tri.indexer_scores(**args, n_max=16, block_n=16, layout="mma")
    assert torch.equal(got[0, 0], (keys * q[0, 0, 0]).sum(-1)), got


def test_scores_edges():
    """No visible key anywhere, n_max beyond every sequence, a single key; flat pool layout."""
    gen = torch.Generator().manual_seed(3)
    args, _ = _case(2, 2, 4, 32, 16, [1, 0], gen)
    args["key_pool"] = args["key_pool"].flatten(0, 1)  # (n_rows, row_bytes)
    args["visible_end"] = torch.tensor([[1, 0], [5, 5]])
    with use_backend("triton"):
        got, got_max = ops.indexer_scores(**args, n_max=20, block_size=8)
    want, want_max = ref.indexer_scores(**args, n_max=20, block_size=8)
    _assert_scores(got, want, _magnitude(args, n_max=20), "edge scores")
    _assert_scores(got_max, want_max, torch.ones_like(want_max), "edge block max")
    assert int(want.isfinite().sum()) == 1
    with use_backend("triton"):
        empty, empty_max = ops.indexer_scores(**args, n_max=0, block_size=8)
    assert empty.shape == (2, 2, 0) and empty_max.shape == (2, 2, 0)


def test_twin_matches_model_and_fp64():
    """Twin = Indexer.scores on the fake-quantized keys (bit for bit) ≈ an fp64 sum; top-k = select_topk."""
    gen = torch.Generator().manual_seed(4)
    B, T, Hi, Di, page_rows = 2, 5, 4, 64, 8
    n_keys = [29, 40]
    args, key_vals = _case(B, T, Hi, Di, page_rows, n_keys, gen)
    positions = torch.arange(T).expand(B, T) * 9 + 3
    args["visible_end"] = positions
    got, _ = ref.indexer_scores(**args, n_max=40)
    pt = args["page_table"].long()
    e = torch.arange(40)
    rows = pt[:, (e // page_rows)] * page_rows + e % page_rows  # (B, 40)
    keys = key_vals[rows]  # (B, 40, Di)
    visible = (e < torch.minimum(positions, torch.tensor(n_keys).view(-1, 1)).unsqueeze(-1))
    model = Indexer.scores(args["q"], args["weights"], keys).masked_fill(~visible, float("-inf"))
    assert torch.equal(got, model)
    exact = (torch.einsum("bthd,bnd->bthn", args["q"].double(), keys.double()).relu()
             * args["weights"].double().unsqueeze(-1)).sum(2).masked_fill(~visible, float("-inf"))
    _assert_scores(got, exact.float(), _magnitude(args, n_max=40), "twin vs fp64")
    assert torch.equal(ref.topk_indices(got, 16), select_topk(got, 16))


def test_scores_blocks_match_twin_and_full():
    gen = torch.Generator().manual_seed(5)
    B, T, Hi, Di, page_rows, bs = 2, 3, 4, 32, 16, 8
    n_keys = [60, 45]
    args, _ = _case(B, T, Hi, Di, page_rows, n_keys, gen)
    args["visible_end"] = torch.tensor([[60, 33, 7], [45, 100, 0]])
    nb = 5
    blocks = torch.stack([torch.randperm(8, generator=gen)[:nb].sort().values for _ in range(B * T)]).view(B, T, nb)
    blocks[0, 1, 3:] = -1  # holes
    blocks[1, 0, 0] = -1
    want = ref.indexer_scores_blocks(**args, blocks=blocks, block_size=bs)
    with use_backend("triton"):
        got = ops.indexer_scores_blocks(**args, blocks=blocks, block_size=bs)
    got2 = tri.indexer_scores_blocks(**args, blocks=blocks, block_size=bs, mma="bf16", block_n=16, tiles=2)
    mag = _magnitude(args, blocks=blocks, block_size=bs)
    _assert_scores(got, want, mag, "block scores")
    _assert_scores(got2, want, mag, "block scores bf16")
    # Di = 128 (the v41-flash width)
    args128, _ = _case(B, T, Hi, 128, page_rows, n_keys, gen)
    args128["visible_end"] = args["visible_end"]
    want128 = ref.indexer_scores_blocks(**args128, blocks=blocks, block_size=bs)
    mag128 = _magnitude(args128, blocks=blocks, block_size=bs)
    for knobs in (dict(block_n=16, tiles=2), dict(block_n=32, tiles=1), dict(block_n=32, tiles=2, mma="bf16")):
        got128 = tri.indexer_scores_blocks(**args128, blocks=blocks, block_size=bs, **knobs)
        _assert_scores(got128, want128, mag128, f"block scores Di=128 {knobs}")
    # = the full scores at those entries (−inf for holes)
    full, _ = ref.indexer_scores(**args, n_max=64)
    j = torch.arange(nb * bs)
    entry = blocks[..., j // bs] * bs + j % bs
    masked = full.gather(-1, entry.clamp(min=0)).masked_fill(entry < 0, float("-inf"))
    _assert_scores(want, masked, mag, "blocks twin vs full")
    assert bool(want.isfinite().any()) and bool((want == float("-inf")).any())


# --------------------------------------------------------------------------------------------- top-k
def _scores_kinds(gen: torch.Generator, N: int) -> Tensor:
    """(1, 5, N) rows: integer ties, relu zeros of both signs, random with −inf, all −inf, rising."""
    ints = torch.randint(-3, 4, (N,), generator=gen).float()  # many exact ties
    relu = (torch.randn(N, generator=gen) - 1.5).relu()  # mostly zeros: the top-k holds many
    relu = torch.where(torch.rand(N, generator=gen) < 0.5, relu, -relu * 0.0)  # +0.0 and −0.0 tie
    with_inf = torch.randn(N, generator=gen)
    with_inf[::3] = float("-inf")
    all_inf = torch.full((N,), float("-inf"))
    rising = torch.arange(N).float()  # every pick in the last columns
    return torch.stack([ints, relu, with_inf, all_inf, rising]).unsqueeze(0)


TOPK_CASES = [  # N, k, knobs ({}: the default method through ops)
    (100, 16, {}),
    (100, 16, dict(method="keys")),  # unique int64 keys + torch.topk
    (100, 5, dict(method="keys", block=16)),  # many key blocks
    (12, 16, dict(method="keys")),  # k > N
    (16, 16, dict(method="keys", block=16)),  # k = N
    (100, 16, dict(method="threshold")),  # the k-th value, then ties in column order (`_pick_kernel`)
    (100, 5, dict(method="threshold", block=16)),  # many row tiles: the running counts carry across them
    (12, 16, dict(method="threshold")),
    (16, 16, dict(method="threshold", block=16)),
]


@pytest.mark.parametrize("case", TOPK_CASES)
def test_topk_matches_twin(case):
    N, k, knobs = case
    scores = _scores_kinds(torch.Generator().manual_seed(N + k), N)
    want = ref.topk_indices(scores, k)
    if knobs:
        got = tri.topk_indices(scores, k, **knobs)
    else:
        with use_backend("triton"):
            got = ops.topk_indices(scores, k)
    assert torch.equal(got, want), f"N={N} k={k}\n{got}\n{want}"


def test_topk_ids_and_edges():
    gen = torch.Generator().manual_seed(7)
    scores = torch.randn(1, 3, 40, generator=gen)
    scores[0, 0, 5:] = float("-inf")
    ids = torch.randint(0, 1000, (1, 3, 40), generator=gen).sort(-1).values * 3 + 1
    want = ref.topk_indices(scores, 9, ids)
    with use_backend("triton"):
        got = ops.topk_indices(scores, 9, ids)
        assert ops.topk_indices(scores, 0).shape == (1, 3, 0)
        assert torch.equal(ops.topk_indices(scores[..., :0], 4), torch.full((1, 3, 4), -1))
        one = ops.topk_indices(scores[:1, :1, :1], 5)
        wide = torch.randn(1, 2, 64, generator=gen)
        strided = ops.topk_indices(wide[..., ::2], 8)  # a non-contiguous view
    assert torch.equal(got, want)
    assert (got[0, 0, 5:] == -1).all() and (got[0, 0, :5] >= 0).all()
    assert one.tolist() == [[[0, -1, -1, -1, -1]]]
    assert torch.equal(strided, ref.topk_indices(wide[..., ::2], 8))


def test_select_blocks_matches_model():
    """ops.select_blocks (block max from the scores kernel, pinned newest block) = the model's candidates."""
    gen = torch.Generator().manual_seed(8)
    B, T, Hi, Di, page_rows, bs, k_blocks = 2, 4, 4, 32, 16, 8, 3
    n_keys = [61, 37]
    args, _ = _case(B, T, Hi, Di, page_rows, n_keys, gen)
    visible_end = torch.tensor([[5, 20, 44, 61], [0, 9, 30, 37]])
    args["visible_end"] = visible_end
    n_max = 64
    with use_backend("triton"):
        scores, block_max = ops.indexer_scores(**args, n_max=n_max, block_size=bs)
        limit = torch.minimum(visible_end, torch.tensor(n_keys).view(-1, 1))
        newest = torch.where(limit > 0, (limit - 1) // bs, -1)
        picked = ops.select_blocks(block_max, newest, k_blocks)  # (B, T, k_blocks)
    nb = block_max.size(-1)
    block_id = (torch.arange(n_max) // bs).expand(B, n_max)
    model = select_candidate_blocks(scores, block_id, nb, newest, k_blocks)  # (B, T, n_max) slot mask
    kept = torch.zeros(B, T, nb + 1, dtype=torch.bool).scatter_(-1, picked.masked_fill(picked < 0, nb), True)[..., :nb]
    assert torch.equal(kept.gather(-1, block_id.unsqueeze(1).expand(B, T, n_max)), model)
    assert (picked[1, 0] == -1).all()  # nothing visible: no block, not even a pinned one
    with use_backend("torch"):
        assert torch.equal(ops.select_blocks(block_max, newest, k_blocks), picked)


def test_bad_arguments():
    gen = torch.Generator().manual_seed(9)
    args, _ = _case(1, 1, 4, 32, 16, [10], gen)
    args["visible_end"] = torch.tensor([[10]])
    with pytest.raises(ValueError, match="Di must be"):
        tri.indexer_scores(**dict(args, q=args["q"][..., :16]), n_max=10)
    with pytest.raises(ValueError, match="key_pool"):
        tri.indexer_scores(**dict(args, key_pool=args["key_pool"][..., :-1]), n_max=10)
    with pytest.raises(ValueError, match="mma"):
        tri.indexer_scores(**args, n_max=10, mma="fp16")
    with pytest.raises(ValueError, match="block_n"):
        tri.indexer_scores(**args, n_max=10, block_n=24)
    with pytest.raises(ValueError, match="layout"):
        tri.indexer_scores(**args, n_max=10, layout="wgmma")
    with pytest.raises(ValueError, match="prefetch"):
        tri.indexer_scores(**args, n_max=10, prefetch=2)
    with pytest.raises(ValueError, match="scores must be"):
        tri.topk_indices(torch.zeros(2, 3), 2)


# --------------------------------------------------------------------------------------------- GPU, v41-flash sizes
gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("layout", tri.LAYOUTS)
@pytest.mark.parametrize("mma", tri.MMAS)
@pytest.mark.parametrize("decode", ["asm"])  # "bits" is the interpreter's path
def test_gpu_scores_full_size(mma, decode, layout):
    gen = torch.Generator().manual_seed(10)
    B, T, Hi, Di, page_rows = 2, 2, 32, 128, 256
    n_keys = [300_000, 123_457]
    args, _ = _case(B, T, Hi, Di, page_rows, n_keys, gen, device="cuda")
    args["visible_end"] = torch.tensor([[300_000, 250_001], [123_457, 99_999]], device="cuda")
    n_max = 300_000
    want, want_max = ref.indexer_scores(**args, n_max=n_max, block_size=8)
    mag = _magnitude(args, n_max=n_max)
    for knobs in (dict(), dict(prefetch=0), dict(block_n=256, num_warps=8, tiles=2)):
        got, got_max = tri.indexer_scores(**args, n_max=n_max, block_size=8, mma=mma, decode=decode, layout=layout,
                                          **knobs)
        _assert_scores(got, want, mag, f"gpu scores {mma} {decode} {layout} {knobs}")
        _assert_scores(got_max, want_max, ref.block_maxima(mag, 8), "gpu block max")
    # prefill shape: several queries per program
    args["visible_end"] = torch.randint(0, n_max, (B, T), device="cuda")
    got, _ = tri.indexer_scores(**args, n_max=n_max, mma=mma, decode=decode, block_t=2, layout=layout)
    mag = _magnitude(args, n_max=n_max)  # the bound of the new visibility
    _assert_scores(got, ref.indexer_scores(**args, n_max=n_max)[0], mag, "gpu scores block_t 2")


@gpu
@pytest.mark.parametrize("mma", tri.MMAS)
def test_gpu_scores_blocks_full_size(mma):
    gen = torch.Generator().manual_seed(11)
    B, T, Hi, Di, page_rows, bs, nb = 2, 3, 32, 128, 256, 8, 2048
    n_keys = [200_000, 150_000]
    args, _ = _case(B, T, Hi, Di, page_rows, n_keys, gen, device="cuda")
    args["visible_end"] = torch.tensor([[200_000] * 3, [150_000, 1000, 0]], device="cuda")
    blocks = torch.stack([torch.randperm(25_000, generator=gen)[:nb].sort().values for _ in range(B * T)])
    blocks = blocks.view(B, T, nb).cuda()
    blocks[0, 1, -100:] = -1
    want = ref.indexer_scores_blocks(**args, blocks=blocks, block_size=bs)
    for knobs in (dict(), dict(block_n=64, tiles=2)):
        got = tri.indexer_scores_blocks(**args, blocks=blocks, block_size=bs, mma=mma, **knobs)
        _assert_scores(got, want, _magnitude(args, blocks=blocks, block_size=bs), f"gpu block scores {mma} {knobs}")


@gpu
def test_gpu_topk_full_size():
    gen = torch.Generator().manual_seed(12)
    N = 1 << 20
    scores = torch.randn(2, 2, N, generator=gen)
    scores[0, 1] = torch.arange(N).float()  # rising: the τ bound keeps many candidates
    scores[1, 0] = torch.randint(0, 50, (N,), generator=gen).float()  # massive ties
    scores[1, 1, ::2] = float("-inf")
    scores = scores.cuda()
    for k in (512, 2048):
        for method in ("keys", "threshold"):
            assert torch.equal(tri.topk_indices(scores, k, method=method), ref.topk_indices(scores, k)), (k, method)
    ids = torch.arange(N, device="cuda").expand(2, 2, N) * 8 + 3
    for method in ("keys", "threshold"):
        assert torch.equal(tri.topk_indices(scores, 512, ids, method=method), ref.topk_indices(scores, 512, ids))
    # select_blocks at the real size: 128K blocks, 2048 picked, one pinned
    block_max = ref.block_maxima(scores, 8)
    newest = torch.tensor([[5, 131_071], [-1, 77]], device="cuda")
    with use_backend("triton"):
        got = ops.select_blocks(block_max, newest, 2048)
    with use_backend("torch"):
        assert torch.equal(got, ops.select_blocks(block_max, newest, 2048))


def test_the_default_topk_method_goes_by_the_row_length(monkeypatch):
    """`auto` (the default) takes threshold up to THRESHOLD_MAX_N columns and keys beyond (the faster on the
    H200 for each); both give the twin's picks on either side of the bound."""
    taken = []
    real = tri._pick_kernel
    monkeypatch.setattr(tri, "THRESHOLD_MAX_N", 40)

    class Spy:
        def __getitem__(self, grid):
            taken.append("threshold")
            return real[grid]

    monkeypatch.setattr(tri, "_pick_kernel", Spy())
    gen = torch.Generator().manual_seed(3)
    for N in (40, 41):
        scores = torch.randn(1, 2, N, generator=gen)
        scores[0, 1, ::3] = 0.5  # ties
        with use_backend("triton"):
            assert torch.equal(ops.topk_indices(scores, 7), ref.topk_indices(scores, 7)), N
    assert taken == ["threshold"]  # N = 40 only
    assert tri._topk_method(tri.THRESHOLD_MAX_N) == "threshold" and tri._topk_method(1 << 20) == "keys"


def test_threshold_topk_takes_the_lowest_columns_of_a_tie_at_the_kth_value():
    """Ties that straddle the k-th place: of the columns equal to the k-th value only the lowest are taken,
    as the stable sort takes them; with ids, in the ids' order; −inf columns never."""
    scores = torch.tensor([[[1.0, 3.0, 2.0, 2.0, 5.0, 2.0, 2.0, float("-inf"), 2.0, 0.5]]])
    got = tri.topk_indices(scores, 4, method="threshold")  # 5, 3, then two of the five 2.0s: columns 2 and 3
    assert got.tolist() == [[[1, 2, 3, 4]]] == ref.topk_indices(scores, 4).tolist()
    ids = torch.arange(10).view(1, 1, 10) * 10 + 7
    assert tri.topk_indices(scores, 4, ids, method="threshold").tolist() == [[[17, 27, 37, 47]]]
    assert tri.topk_indices(scores, 12, method="threshold").tolist() == [[[0, 1, 2, 3, 4, 5, 6, 8, 9, -1, -1, -1]]]
    before = torch.tensor([[[2.0, 2.0, 2.0, 5.0]]])  # a tie before a larger score: exactly need_eq ties taken
    got = tri.topk_indices(before, 2, method="threshold")
    assert got.tolist() == [[[0, 3]]] == ref.topk_indices(before, 2).tolist()
    with pytest.raises(ValueError, match="method"):
        tri.topk_indices(scores, 4, method="radix")
