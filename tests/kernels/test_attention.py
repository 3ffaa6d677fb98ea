"""Sparse attention (`ops.sparse_attention`): the Triton kernel equals the torch twin, and the twin
equals the dense training function `model.attention.attend` fed independently dequantized keys.

CPU tests run the kernel in Triton's interpreter at tiny sizes (fp32 dots); `gpu` tests run the
v41-flash and `small` sizes with bf16 queries. Every Triton call writes into NaN-poisoned output
and split-K scratch, so an element the kernel never wrote fails the comparison.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from tests.conftest import BF16_RTOL, FP32_RTOL, assert_close

from dsv41.kernels import ops
from dsv41.kernels.ops import use_backend
from dsv41.kernels.ref import attention as ref
from dsv41.model.attention import attend, topk_mask
from dsv41.quant.fp4 import KV_BLOCK, quantize_fp4
from dsv41.quant.fp8 import quantize_fp8

triton_attention = pytest.importorskip("dsv41.kernels.triton.attention")


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    """Kernel outputs and split-K scratch start as NaN."""
    monkeypatch.setattr(triton_attention, "_empty_out", lambda q: torch.full_like(q, float("nan")))
    monkeypatch.setattr(triton_attention, "_scratch",
                        lambda shape, device: torch.full(shape, float("nan"), device=device))


# ---- inputs ------------------------------------------------------------------------------------


def _values(*shape: int, g: torch.Generator) -> torch.Tensor:
    """Normal values with a per-row log-normal scale (block scales differ between rows)."""
    return torch.randn(*shape, generator=g) * torch.exp(torch.randn(*shape[:-1], 1, generator=g))


def _window_rows(*shape: int, D: int, g: torch.Generator) -> torch.Tensor:
    values, scales = quantize_fp8(_values(*shape, D, g=g))
    return torch.cat((values, scales), dim=-1)  # (..., D + D/32)


def _entry_rows(*shape: int, D: int, g: torch.Generator) -> torch.Tensor:
    packed, scales = quantize_fp4(_values(*shape, D, g=g), KV_BLOCK, "e4m3")
    return torch.cat((packed, scales), dim=-1)  # (..., D/2 + D/16)


def make_case(B: int, T: int, H: int, D: int, *, W: int = 32, K: int = 16, window: int = 32, S: int | None = None,
              ring: bool = True, chunk: bool = False, entries: bool = True, replay: bool = False,
              decode_in_ring: bool = True, page_rows: int = 4, pages_per_seq: int = 6, holes: float = 0.25,
              pool_3d: bool = False, empty_slots: float = 0.0, distinct: bool = False,
              dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0) -> dict:
    """Random arguments of `ops.sparse_attention` (q_pos consecutive per sequence, as the engine's)."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, 3 * W, (B,), generator=g)  # first query position of each sequence
    start[0] = W + 5  # at least one sequence whose window is full of ring keys
    q_pos = start[:, None] + torch.arange(T)  # (B, T)
    args = dict(q=(torch.randn(B, T, H, D, generator=g)).to(dtype), q_pos=q_pos,
                sink=torch.randn(H, generator=g), scale=D ** -0.5, window=window)
    if ring:
        S = S or B + 2
        ring_ids = torch.randperm(S, generator=g)[:B]
        ring_kv = _window_rows(S, W, D=D, g=g)
        ring_pos = torch.full((S, W), -1, dtype=torch.long)
        for b in range(B):  # the ring holds the newest W positions before (decode: up to) the query
            last = int(start[b]) - (0 if decode_in_ring and not chunk else 1)
            p = torch.arange(max(0, last - W + 1), last + 1)
            ring_pos[ring_ids[b], p % W] = p
        empty = torch.rand(S, W, generator=g) < empty_slots
        ring_pos[empty] = -1
        ring_kv[ring_pos < 0] = 0xFF  # garbage (E4M3 NaN, E8M0 NaN) in empty slots
        args.update(ring_kv=ring_kv, ring_pos=ring_pos, ring_ids=ring_ids)
    if chunk:
        args.update(chunk_kv=_window_rows(B, T, D=D, g=g))
    if replay:  # bounded replay: one sequence starts inside its ring range, another before position 0
        ws = start - torch.randint(1, W, (B,), generator=g)
        ws[-1] = -7
        args.update(window_start=ws)
    if entries:
        n_pages = B * pages_per_seq + 3
        pool = _entry_rows(n_pages * page_rows, D=D, g=g)
        page_table = torch.stack([torch.randperm(n_pages, generator=g)[:pages_per_seq] for _ in range(B)])
        n = pages_per_seq * page_rows
        if distinct:
            topk = torch.stack([torch.randperm(n, generator=g)[:K] for _ in range(B * T)]).view(B, T, K)
        else:
            topk = torch.randint(0, n, (B, T, K), generator=g)
        topk[torch.rand(B, T, K, generator=g) < holes] = -1  # holes anywhere, not only at the end
        args.update(entry_pool=pool.view(n_pages, page_rows, -1) if pool_3d else pool,
                    page_table=page_table.int(), page_rows=page_rows, topk=topk)
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def run(backend: str, case: dict, **knobs) -> torch.Tensor:
    """`ops.sparse_attention` under `backend`; knobs go straight to the Triton launcher."""
    if knobs:
        return triton_attention.sparse_attention(**case, **knobs)
    with use_backend(backend):
        return ops.sparse_attention(**case)


def check_triton(case: dict, **knobs) -> torch.Tensor:
    """Triton (poisoned output) vs the twin: fp32 error ≤ 1e-5 relative to the output's scale (the
    outputs are signed sums, so single elements can be far smaller than their rounding error)."""
    expected = run("torch", case)
    actual = run("triton", case, **knobs)
    assert_close(actual, expected, atol=FP32_RTOL * float(expected.abs().amax()), what=f"triton {knobs}")
    return expected


# ---- Triton vs twin (interpreter) ----------------------------------------------------------------


def test_decode_ring_only():
    case = make_case(3, 1, 4, 32, entries=False, S=6, empty_slots=0.1, seed=1)
    check_triton(case)


@pytest.mark.parametrize("pool_3d", [False, True])
def test_decode_ring_and_entries(pool_3d):
    case = make_case(3, 1, 4, 32, pool_3d=pool_3d, seed=2)
    check_triton(case)


@pytest.mark.parametrize("band", [True, False])
def test_prefill_chunk_bounded_replay(band):
    """Ring + the chunk's own keys + entries + window_start, T > window (the band matters)."""
    case = make_case(2, 11, 4, 32, W=8, window=8, chunk=True, replay=True, seed=3)
    expected = check_triton(case, chunk_band=band)
    assert expected.abs().amax() > 0


@pytest.mark.parametrize("num_splits", [1, 3])
def test_the_decoder_replay_reads_no_ring(num_splits):
    """The static replay's call (`StepRecord.window_in_block`): no ring, the block's own keys from the window start
    on, entries; split over programs or not (a block of >= 64 queries splits by default on CUDA)."""
    case = make_case(1, 12, 6, 32, W=8, window=8, ring=False, chunk=True, entries=True, seed=14)
    case["window_start"] = case["q_pos"][:, 0].contiguous()  # the window starts at the block
    expected = check_triton(case, num_splits=num_splits)
    assert expected.abs().amax() > 0


def test_ragged_topk_with_holes():
    """K not a multiple of the tile, −1 anywhere, one query with no entry at all."""
    case = make_case(2, 3, 4, 32, K=13, holes=0.4, seed=4)
    case["topk"][1, 2] = -1
    check_triton(case, block_n=16)


def test_empty_ring_slots_hold_garbage():
    case = make_case(2, 1, 4, 32, empty_slots=0.5, entries=False, seed=5)
    assert bool((case["ring_pos"] < 0).any())
    check_triton(case)


def test_query_with_no_visible_key_is_zero():
    case = make_case(2, 2, 4, 32, chunk=True, seed=6)
    case["ring_pos"][case["ring_ids"][0]] = -1  # sequence 0: empty ring
    case["topk"][0] = -1  # and no entries
    case["window"] = 0  # and no window key (not even its own)
    expected = check_triton(case)
    assert torch.equal(expected[0], torch.zeros_like(expected[0]))
    assert expected[1].abs().amax() > 0


@pytest.mark.parametrize("H,block_h", [(6, None), (20, 16)])
def test_heads_not_a_multiple_of_16(H, block_h):
    case = make_case(2, 1, H, 32, seed=7)
    check_triton(case, **({"block_h": block_h} if block_h else {}))


@pytest.mark.parametrize("knobs", [
    dict(num_splits=3),
    dict(block_k=32, block_pv=32),
    dict(block_dv=32, block_n=16),
    dict(block_k=32, block_dv=32, num_splits=2),
    dict(fp4_decode="int"),
], ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
def test_knobs_match_the_twin(knobs):
    """QK chunks, PV chunks, value split across programs, key-list splits, FP4 decode paths (D = 64)."""
    case = make_case(2, 2, 4, 64, chunk=True, replay=True, seed=8)
    check_triton(case, **knobs)


def test_bf16_queries():
    case = make_case(2, 1, 4, 32, dtype=torch.bfloat16, seed=9)
    expected = run("torch", case)
    actual = run("triton", case)
    assert actual.dtype == torch.bfloat16
    assert_close(actual, expected, rtol=BF16_RTOL, atol=BF16_RTOL, what="bf16")


def test_bad_inputs_raise():
    case = make_case(1, 1, 4, 32, seed=10)
    with pytest.raises(ValueError, match="entry_pool"):
        triton_attention.sparse_attention(**{**case, "entry_pool": case["entry_pool"][:, :-1]})
    with pytest.raises(ValueError, match="ring_kv"):
        triton_attention.sparse_attention(**{**case, "ring_kv": case["ring_kv"][..., :-1]})
    with pytest.raises(ValueError, match="block_n"):
        triton_attention.sparse_attention(**case, block_n=24)


# ---- twin vs the dense training function ---------------------------------------------------------


def _oracle_window(rows: torch.Tensor, D: int) -> torch.Tensor:
    """FP8 rows → fp32 through ml_dtypes (independent of dsv41.quant)."""
    r = rows.numpy()
    values = r[..., :D].view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    scales = np.exp2(r[..., D:].astype(np.float32) - 127.0)
    return torch.from_numpy(values * np.repeat(scales, 32, axis=-1))


def _oracle_entries(rows: torch.Tensor, D: int) -> torch.Tensor:
    """Packed FP4 rows → fp32 through ml_dtypes (element 2i in the low nibble)."""
    r = rows.numpy()
    packed = r[..., :D // 2]
    codes = np.stack((packed & 0xF, packed >> 4), axis=-1).reshape(*packed.shape[:-1], D)
    values = codes.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    scales = r[..., D // 2:].view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return torch.from_numpy(values * np.repeat(scales, KV_BLOCK, axis=-1))


def test_twin_equals_dense_attend():
    """Dense keys (ring slots + chunk), every entry of each sequence with the top-k as an entry mask."""
    B, T, H, D, W = 2, 5, 4, 32, 8
    case = make_case(B, T, H, D, W=W, window=W, chunk=True, replay=True, distinct=True, holes=0.3, seed=11)
    ring_rows = case["ring_kv"][case["ring_ids"]]  # (B, W, row)
    keys = torch.cat((_oracle_window(ring_rows, D), _oracle_window(case["chunk_kv"], D)), dim=1)
    kpos = torch.cat((case["ring_pos"][case["ring_ids"]], case["q_pos"]), dim=1)  # (B, W + T)
    keys = torch.where((kpos >= 0)[..., None], keys, torch.zeros(()))  # empty slots hold NaN bytes
    low = case["window_start"].clamp(min=0)[:, None, None]
    qp, kp = case["q_pos"][:, :, None], kpos[:, None, :]
    window_mask = (kp >= low) & (kp >= 0) & (kp <= qp) & (kp > qp - W)
    pool = case["entry_pool"].view(-1, case["entry_pool"].size(-1))
    rows = case["page_table"].long()[:, :, None] * case["page_rows"] + torch.arange(case["page_rows"])
    entries = _oracle_entries(pool[rows.flatten(1)], D)  # (B, N, D): entry e of sequence b
    entry_mask = topk_mask(case["topk"], entries.size(1))  # (B, T, N)
    expected = attend(case["q"], keys, window_mask, entries, entry_mask, case["sink"], case["scale"])
    actual = ref.sparse_attention(**case)
    assert_close(actual, expected, what="twin vs attend")
    assert expected.abs().amax() > 0


# ---- GPU: full sizes, bf16 queries ---------------------------------------------------------------


def _norm_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.double(), expected.double()
    assert torch.isfinite(a).all(), "non-finite output"
    return float((a - e).norm() / e.norm())


GPU_CASES = {
    "decode-v41": dict(B=64, T=1, H=64, D=512, W=128, K=512, window=128, page_rows=256, pages_per_seq=4),
    "prefill-v41": dict(B=2, T=256, H=64, D=512, W=128, K=512, window=128, chunk=True, replay=True,
                        page_rows=256, pages_per_seq=16),
    "decode-small": dict(B=8, T=1, H=6, D=128, W=128, K=128, window=128, page_rows=256, pages_per_seq=4),
    "prefill-small": dict(B=2, T=300, H=6, D=128, W=128, K=128, window=128, chunk=True, replay=True,
                          page_rows=256, pages_per_seq=4),
    # the decoder replay's call: 128 queries, no ring (their window starts at the block), split by default
    "replay-small": dict(B=1, T=128, H=6, D=128, W=128, K=128, window=128, ring=False, chunk=True,
                         page_rows=256, pages_per_seq=4),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_matches_twin(name):
    shape = dict(GPU_CASES[name])
    case = make_case(shape.pop("B"), shape.pop("T"), shape.pop("H"), shape.pop("D"), **shape,
                     dtype=torch.bfloat16, device="cuda", seed=12)
    if name == "replay-small":
        case["window_start"] = case["q_pos"][:, 0].contiguous()
    expected = run("torch", case)
    actual = run("triton", case)  # the default knobs
    assert _norm_error(actual, expected) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", [
    dict(fp4_decode="e4m3"), dict(fp4_decode="int"), dict(num_splits=1), dict(num_splits=4),
    dict(block_k=512, block_pv=512, block_n=32), dict(block_dv=256), dict(block_n=32, block_pv=256),
], ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
def test_gpu_knobs_match_twin(knobs):
    case = make_case(16, 1, 64, 512, W=128, K=512, window=128, page_rows=256, pages_per_seq=8,
                     dtype=torch.bfloat16, device="cuda", seed=13)
    expected = run("torch", case)
    assert _norm_error(run("triton", case, **knobs), expected) <= 1e-2
