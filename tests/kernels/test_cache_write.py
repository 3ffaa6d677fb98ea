"""Cache write (`ops.rope_quantize`): the Triton kernel equals the torch twin bit for bit, and the twin
equals the model's own path (apply_rope, then the quant.* storage quantizers / fake-quant). The window
ring's write after a prefill chunk (`ops.ring_write`): kernel = twin = the formula, loop by loop.

CPU tests run the kernel in Triton's interpreter at tiny sizes; `gpu` tests at the v41-flash sizes.
"""

from __future__ import annotations

import pytest
import torch

from dsv41.kernels import ops
from dsv41.kernels.ops import use_backend
from dsv41.kernels.ref.cache_write import CACHE_LAYOUTS
from dsv41.model.rope import apply_rope, rope_angles, rope_frequencies
from dsv41.quant.fp4 import INDEX_BLOCK, KV_BLOCK, dequantize_fp4, fake_quant_fp4, quantize_fp4
from dsv41.quant.fp8 import dequantize_fp8, fake_quant_window_fp8, quantize_fp8

POISON = 0xAB
FORMATS = ("window_fp8", "kv_fp4", "index_fp4")
TINY = {"window_fp8": (32, 16), "kv_fp4": (32, 16), "index_fp4": (32, 16)}  # fmt → (D, R)
SMALL = {"window_fp8": (128, 64), "kv_fp4": (128, 64), "index_fp4": (64, 64)}
FULL = {"window_fp8": (512, 64), "kv_fp4": (512, 64), "index_fp4": (128, 64)}


def _random_x(B: int, T: int, D: int, dtype: torch.dtype, g: torch.Generator, device="cpu") -> torch.Tensor:
    """Normal values with a per-channel log-normal spread (block amaxes differ by orders of magnitude)."""
    spread = torch.exp(torch.randn(B, T, D, generator=g) * 2.5)
    return (torch.randn(B, T, D, generator=g) * spread).to(dtype).to(device)


def _angles(B: int, T: int, R: int, g: torch.Generator, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """The model's angles at random positions (position 0 included: cos 1, sin 0)."""
    positions = torch.randint(0, 1 << 16, (B, T), generator=g)
    positions[0, 0] = 0
    cos, sin = rope_angles(rope_frequencies(R, 10000.0), positions)
    return cos.to(device), sin.to(device)


def _row_index(B: int, T: int, M: int, g: torch.Generator, skip: float = 0.25, device="cpu") -> torch.Tensor:
    """Distinct random rows of a pool of M (M >= B·T), a fraction set to −1."""
    index = torch.randperm(M, generator=g)[:B * T].view(B, T)
    index[torch.rand(B, T, generator=g) < skip] = -1
    return index.to(device)


def _write(backend: str, x, cos, sin, fmt, M, row_index, **knobs) -> torch.Tensor:
    """A poisoned (M, row_bytes) pool after rope_quantize with `backend` (knobs: direct Triton call)."""
    out = torch.full((M, CACHE_LAYOUTS[fmt].row_bytes(x.size(-1))), POISON, dtype=torch.uint8, device=x.device)
    if knobs:
        from dsv41.kernels.triton.cache_write import rope_quantize

        rope_quantize(x, cos, sin, fmt, out, row_index, **knobs)
    else:
        with use_backend(backend):
            ops.rope_quantize(x, cos, sin, fmt, out, row_index)
    return out


def _assert_rows_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    if not torch.equal(actual, expected):
        bad = (actual != expected).any(dim=1).nonzero().flatten()
        r = int(bad[0])
        raise AssertionError(f"{what}: {bad.numel()} rows differ, first row {r}:\n{actual[r].tolist()}\n"
                             f"expected\n{expected[r].tolist()}")


def _quantize(y: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    if fmt == "window_fp8":
        return quantize_fp8(y)
    if fmt == "kv_fp4":
        return quantize_fp4(y, KV_BLOCK, "e4m3")
    return quantize_fp4(y, INDEX_BLOCK, "e8m0")


def _expected_pool(x, cos, sin, fmt, M, row_index) -> torch.Tensor:
    """Independent of the twin's packing: quantize each token, concatenate, store row by row."""
    payload, scales = _quantize(apply_rope(x, cos, sin), fmt)
    out = torch.full((M, payload.size(-1) + scales.size(-1)), POISON, dtype=torch.uint8)
    for b in range(x.size(0)):
        for t in range(x.size(1)):
            r = int(row_index[b, t])
            if r >= 0:
                out[r] = torch.cat((payload[b, t], scales[b, t]))
    return out


# ------------------------------------------------------------------------------------------------
# edge values: each builder returns (N, D) fp32 rows; cos = 1, sin = 0 keeps them unrotated


def _blocks(values: list[float], block: int, pin: float, D: int) -> torch.Tensor:
    """Rows of D channels; every block starts with `pin` (fixes the block's amax, so its scale) and
    holds block − 1 of the values (cycled to fill the last row)."""
    per_row = (D // block) * (block - 1)
    n_rows = -(-len(values) // per_row)
    v = torch.tensor(values, dtype=torch.float32)
    v = v.repeat(-(-n_rows * per_row // v.numel()))[:n_rows * per_row].view(n_rows, D // block, block - 1)
    pins = torch.full((n_rows, D // block, 1), pin)
    return torch.cat((pins, v), dim=-1).flatten(1)


def _with_neighbours(v: torch.Tensor) -> list[float]:
    """v, its fp32 neighbours on both sides, and the negatives of all of them."""
    up, down = torch.nextafter(v, torch.tensor(float("inf"))), torch.nextafter(v, torch.tensor(-float("inf")))
    both = torch.cat((v, up, down))
    return torch.cat((both, -both)).tolist()


def _e4m3_grid() -> torch.Tensor:
    return torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448


def _fp4_grid() -> torch.Tensor:
    return torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _edge_rows(fmt: str, D: int) -> torch.Tensor:
    block = CACHE_LAYOUTS[fmt].block
    rows = []
    if fmt == "window_fp8":  # scale 1 (amax 448): every E4M3 value, midpoint (ties → even) and neighbour
        grid = _e4m3_grid()
        rows.append(_blocks(_with_neighbours(torch.cat((grid, (grid[1:] + grid[:-1]) / 2))), block, 448.0, D))
        rows.append(_blocks([1.0, -3.5, 0.0625], block, 448.0 * 2.0**-20, D))  # amax/448 a power of two
        rows.append(_blocks([1e-5, -3e-5, 0.0], block, 1e-4, D))  # exactly at the amax floor
    else:
        grid = _fp4_grid()
        mid = (grid[1:] + grid[:-1]) / 2  # 0.25 .. 5: ties → even code
        values = _with_neighbours(torch.cat((grid, mid)))
        rows.append(_blocks(values, block, 6.0, D))  # scale exactly 1
        rows.append(_blocks([v * 8 for v in values], block, 48.0, D))  # scale 8
        if fmt == "kv_fp4":
            rows.append(_blocks([v * 1.125 for v in values], block, 6.75, D))  # E4M3 scale 1.125
            rows.append(_blocks(values + [6.3, -6.37], block, 6.0 * 1.0624, D))  # scale rounds down: clamp
            rows.append(_blocks([1e-4, -2e-3, 0.0], block, 6 * 2.0**-9, D))  # at the E4M3 scale floor
            rows.append(_blocks([3e3, -1e4, 2e5, 1.0], block, -1e5, D))  # ratio > 448: scale saturates
        else:
            rows.append(_blocks([1e-38, -3e-38, 0.0], block, 6 * 2.0**-126, D))  # at the E8M0 floor
    special = torch.zeros(8, D)
    special[1] = -0.0  # negative zeros
    special[2, ::3] = -0.0
    special[2, 1] = 1e-30
    special[3] = torch.linspace(-1e30, 1e30, D)  # huge, with small values in the same blocks
    special[3, ::4] = 1e-3
    special[4] = torch.linspace(-1e-6, 1e-6, D)  # below the window floor
    special[5] = torch.linspace(-1e-39, 1e-39, D)  # fp32 subnormals, below every floor
    special[6] = torch.linspace(-3e-3, 3e-3, D)  # below the E4M3-scale floor
    special[7] = torch.linspace(-1e-20, 1e-20, D)
    rows.append(special)
    return torch.cat(rows)


def _edge_inputs(fmt: str, D: int, R: int, dtype: torch.dtype, device="cpu"):
    x = _edge_rows(fmt, D).to(dtype)
    N = x.size(0)
    x = x.view(1, N, D).to(device)
    cos, sin = torch.ones(1, N, R // 2, device=device), torch.zeros(1, N, R // 2, device=device)
    return x, cos, sin


# ------------------------------------------------------------------------------------------------
# CPU (interpreter) tests


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("sizes", ["tiny", "small"])
def test_triton_matches_twin_random(fmt, dtype, sizes):
    D, R = (TINY if sizes == "tiny" else SMALL)[fmt]
    g = torch.Generator().manual_seed(FORMATS.index(fmt) * 4 + 2 * (dtype == torch.bfloat16) + (sizes == "tiny"))
    B, T, M = 3, 7, 40  # 21 tokens, ragged vs every tile
    x, (cos, sin) = _random_x(B, T, D, dtype, g), _angles(B, T, R, g)
    row_index = _row_index(B, T, M, g)
    expected = _write("torch", x, cos, sin, fmt, M, row_index)
    actual = _write("triton", x, cos, sin, fmt, M, row_index)
    _assert_rows_equal(actual, expected, f"{fmt} {dtype} D={D}")
    untouched = torch.ones(M, dtype=torch.bool)
    untouched[row_index[row_index >= 0]] = False
    assert bool((actual[untouched] == POISON).all()), "a row outside row_index was written"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_twin_edge_values(fmt, dtype):
    D, R = TINY[fmt]
    x, cos, sin = _edge_inputs(fmt, D, R, dtype)
    N = x.size(1)
    row_index = torch.arange(N).flip(0).view(1, N)  # reversed rows, no skips
    expected = _write("torch", x, cos, sin, fmt, N + 3, row_index)
    actual = _write("triton", x, cos, sin, fmt, N + 3, row_index)
    _assert_rows_equal(actual, expected, f"{fmt} {dtype} edge values")
    assert bool((actual[N:] == POISON).all())
    # the same values rotated by the model's angles
    g = torch.Generator().manual_seed(7)
    cos, sin = _angles(1, N, R, g)
    _assert_rows_equal(_write("triton", x, cos, sin, fmt, N, row_index),
                       _write("torch", x, cos, sin, fmt, N, row_index), f"{fmt} {dtype} rotated edge values")


def _tie_pairs(pin: float, pairs: list[tuple[float, float]]) -> torch.Tensor:
    """(1, 2, 64) bf16: groups of 8 pairs (16 channels), each led by (pin, 0) to fix the block scale."""
    group = torch.tensor([(pin, 0.0)] + (pairs * 7)[:7])  # (8, 2)
    return group.repeat(4, 1).flatten().view(1, 1, 64).repeat(1, 2, 1).to(torch.bfloat16)


def test_bf16_rounding_ties_after_rope():
    """cos = 1, sin = −1 maps a pair (a, b) to (a + b, b − a): sums that are exact bf16 ties must round
    to even — and land on an E4M3 / E2M1 midpoint, so the wrong rounding shows in the stored codes.
    (The interpreter's own fp32 → bf16 cast truncates; the kernel must not.)"""
    cos, sin = torch.ones(1, 2, 32), -torch.ones(1, 2, 32)  # all 64 channels rotate
    row_index = torch.tensor([[1, 0]])
    # a + b, ties to the upper even: 1.1875 - 2^-8 → 1.1875 (E4M3 tie → 1.25), 2.375 - 2^-7 → 2.375 (→ 2.5);
    # to the lower even: 1.0625 + 2^-8 → 1.0625 (E4M3 tie → 1)
    fp8_pairs = [(1.1875, -(2.0**-8)), (2.375, -(2.0**-7)), (1.0625, 2.0**-8), (-1.1875, 2.0**-8),
                 (-1.0625, -(2.0**-8))]
    # upper: 1.75 - 2^-8 → 1.75 (E2M1 tie → 2), 0.75 - 2^-9 → 0.75 (→ 1), 3.5 - 2^-7 → 3.5 (→ 4);
    # lower: 2.5 + 2^-7 → 2.5 (→ 2), 0.25 + 2^-10 → 0.25 (→ 0)
    fp4_pairs = [(1.75, -(2.0**-8)), (0.75, -(2.0**-9)), (3.5, -(2.0**-7)), (2.5, 2.0**-7), (0.25, 2.0**-10),
                 (-1.75, 2.0**-8), (-2.5, -(2.0**-7))]
    for fmt, x in (("window_fp8", _tie_pairs(448.0, fp8_pairs)), ("kv_fp4", _tie_pairs(6.0, fp4_pairs)),
                   ("index_fp4", _tie_pairs(6.0, fp4_pairs))):
        a, b = x.float()[..., 0::2], x.float()[..., 1::2]
        re, im = a * cos - b * sin, a * sin + b * cos  # fp32, before the rounding to bf16
        assert bool(((re.view(torch.int32) & 0xFFFF) == 0x8000).any()), "fixture: some must be exact bf16 ties"
        expected = _write("torch", x, cos, sin, fmt, 2, row_index)
        for wrong in (0x7FFF, 0x8000, 0):  # ties down, ties away, truncation: the stored codes must differ
            y = torch.stack([((v.view(torch.int32) + wrong) & -65536).view(torch.float32) for v in (re, im)], -1)
            rows = torch.cat(_quantize(y.flatten(-2), fmt), -1)
            assert not torch.equal(rows, expected[row_index]), f"fixture: {fmt} does not see the tie rounding"
        _assert_rows_equal(_write("triton", x, cos, sin, fmt, 2, row_index), expected, f"{fmt} bf16 ties")


def test_knobs_strides_and_ragged_tiles():
    """Small tiles (several programs, ragged last one), non-contiguous x, broadcast cos / sin, int32
    row indices, fp16 input, the E4M3 encoder choice."""
    g = torch.Generator().manual_seed(11)
    fmt, (D, R) = "window_fp8", TINY["window_fp8"]
    B, T, M = 2, 5, 12
    wide = _random_x(B, 2 * T, 2 * D, torch.bfloat16, g)
    x = wide[:, ::2, D:]  # strided tokens and an offset channel start
    cos, sin = _angles(1, T, R, g)  # (1, T, R/2): broadcast over B
    row_index = _row_index(B, T, M, g).to(torch.int32)
    expected = _write("torch", x, cos, sin, fmt, M, row_index)
    for knobs in ({"block_t": 1, "num_warps": 1}, {"block_t": 4}, {"block_t": 8, "hw_e4m3": False}):
        _assert_rows_equal(_write("triton", x, cos, sin, fmt, M, row_index, **knobs), expected, str(knobs))
    for fmt in ("kv_fp4", "index_fp4"):
        x16 = _random_x(B, T, D, torch.float16, g)
        _assert_rows_equal(_write("triton", x16, cos, sin, fmt, M, row_index, block_t=4),
                           _write("torch", x16, cos, sin, fmt, M, row_index), f"{fmt} fp16")


def test_skips_and_untouched_rows():
    g = torch.Generator().manual_seed(3)
    fmt, (D, R) = "kv_fp4", TINY["kv_fp4"]
    x, (cos, sin) = _random_x(2, 3, D, torch.bfloat16, g), _angles(2, 3, R, g)
    none = torch.full((2, 3), -1)
    for backend in ("torch", "triton"):
        assert bool((_write(backend, x, cos, sin, fmt, 5, none) == POISON).all()), backend
    # the kernel also skips indices past the pool (the twin raises): no out-of-bounds write
    past = torch.tensor([[0, 5, -1], [7, 1, 2]])
    out = _write("triton", x, cos, sin, fmt, 5, past)
    inside = torch.where(past < 5, past, -1)
    _assert_rows_equal(out, _write("torch", x, cos, sin, fmt, 5, inside), "indices >= M")
    assert bool((out[3:] == POISON).all())


@pytest.mark.parametrize("fmt", FORMATS)
def test_twin_matches_quantizers(fmt):
    """Twin == apply_rope + quant.fp8 / quant.fp4 called directly, rows assembled by hand."""
    D, R = SMALL[fmt]
    g = torch.Generator().manual_seed(5)
    B, T, M = 2, 6, 15
    x, (cos, sin) = _random_x(B, T, D, torch.bfloat16, g), _angles(B, T, R, g)
    row_index = _row_index(B, T, M, g)
    _assert_rows_equal(_write("torch", x, cos, sin, fmt, M, row_index),
                       _expected_pool(x, cos, sin, fmt, M, row_index), f"twin {fmt}")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_rows_dequantize_to_fake_quant(fmt, backend):
    """Reading a row back gives exactly the model's fake-quant of the rotated input."""
    D, R = TINY[fmt]
    g = torch.Generator().manual_seed(9)
    B, T = 2, 4
    x, (cos, sin) = _random_x(B, T, D, torch.bfloat16, g), _angles(B, T, R, g)
    row_index = torch.randperm(B * T, generator=g).view(B, T)
    rows = _write(backend, x, cos, sin, fmt, B * T, row_index)[row_index]  # (B, T, row_bytes)
    y = apply_rope(x, cos, sin)
    if fmt == "window_fp8":
        read = dequantize_fp8(rows[..., :D], rows[..., D:])
        fake = fake_quant_window_fp8(y)
    else:
        block, kind = (KV_BLOCK, "e4m3") if fmt == "kv_fp4" else (INDEX_BLOCK, "e8m0")
        read = dequantize_fp4(rows[..., :D // 2], rows[..., D // 2:], block, kind)
        fake = fake_quant_fp4(y, block, kind)
    assert torch.equal(read.to(x.dtype), fake), f"{fmt}: max diff {(read - fake.float()).abs().max():.3e}"
    assert torch.isfinite(read).all() and (read != 0).any()


def test_bad_arguments():
    from dsv41.kernels.triton.cache_write import rope_quantize as triton_rope_quantize

    x, cos, sin = torch.randn(2, 3, 32), torch.ones(2, 3, 8), torch.zeros(2, 3, 8)
    out, index = torch.zeros(6, 33, dtype=torch.uint8), torch.arange(6).view(2, 3)
    with pytest.raises(ValueError, match="fmt"):
        ops.rope_quantize(x, cos, sin, "fp8", out, index)
    for backend in ("torch", "triton"):
        with use_backend(backend):
            with pytest.raises(ValueError, match="out_rows"):
                ops.rope_quantize(x, cos, sin, "kv_fp4", out, index)  # 33 B rows are window rows
            with pytest.raises(ValueError, match="row_index"):
                ops.rope_quantize(x, cos, sin, "window_fp8", out, index.view(6))
            with pytest.raises(ValueError, match="x must be"):
                ops.rope_quantize(x.long(), cos, sin, "window_fp8", out, index)
            with pytest.raises(ValueError, match="divisible"):
                ops.rope_quantize(torch.randn(2, 3, 48), cos, sin, "window_fp8", out, index)
            with pytest.raises(ValueError, match="broadcast"):
                ops.rope_quantize(x, cos[:, :2], sin[:, :2], "window_fp8", out, index)
            with pytest.raises(ValueError, match="R/2"):
                ops.rope_quantize(x, torch.ones(2, 3, 17), torch.ones(2, 3, 17), "window_fp8", out, index)
    with pytest.raises(ValueError, match="hw_e4m3"):
        triton_rope_quantize(x, cos, sin, "window_fp8", out, index, hw_e4m3=True)


# ------------------------------------------------------------------------------------------------
# GPU tests at the v41-flash sizes (decode batch, one prefill chunk), bit-exact vs the twin on CUDA


def _gpu_case(fmt: str, B: int, T: int, dtype: torch.dtype, **knobs) -> None:
    D, R = FULL[fmt]
    g = torch.Generator().manual_seed(B * 131 + T)
    x, (cos, sin) = _random_x(B, T, D, dtype, g, "cuda"), _angles(B, T, R, g, "cuda")
    M = 2 * B * T + 5
    row_index = _row_index(B, T, M, g, device="cuda")
    expected = _write("torch", x, cos, sin, fmt, M, row_index)
    actual = _write("triton", x, cos, sin, fmt, M, row_index, **knobs)
    _assert_rows_equal(actual, expected, f"{fmt} B={B} T={T} {dtype} {knobs}")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(128, 1), (1, 8192), (3, 1000)])
@pytest.mark.parametrize("hw_e4m3", [True, False])
def test_gpu_matches_twin(fmt, shape, hw_e4m3):
    _gpu_case(fmt, *shape, torch.bfloat16, hw_e4m3=hw_e4m3)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_dispatch_fp32_and_knobs(fmt):
    _gpu_case(fmt, 2, 777, torch.float32)  # through ops, default knobs
    for knobs in ({"block_t": 1, "num_warps": 2}, {"block_t": 16, "num_warps": 8}):
        _gpu_case(fmt, 1, 300, torch.bfloat16, **knobs)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hw_e4m3", [True, False])
def test_gpu_edge_values(fmt, dtype, hw_e4m3):
    D, R = FULL[fmt]
    x, cos, sin = _edge_inputs(fmt, D, R, dtype, "cuda")
    N = x.size(1)
    row_index = torch.arange(N, device="cuda").flip(0).view(1, N)
    _assert_rows_equal(_write("triton", x, cos, sin, fmt, N, row_index, hw_e4m3=hw_e4m3),
                       _write("torch", x, cos, sin, fmt, N, row_index), f"{fmt} {dtype} edge values")
    cos, sin = _angles(1, N, R, torch.Generator().manual_seed(1), "cuda")
    _assert_rows_equal(_write("triton", x, cos, sin, fmt, N, row_index, hw_e4m3=hw_e4m3),
                       _write("torch", x, cos, sin, fmt, N, row_index), f"{fmt} {dtype} rotated edge values")


# ------------------------------------------------------------------------------------------------
# The window ring's write after a prefill chunk (`ops.ring_write`): Triton = twin = the formula

RING_SHAPES = [(3, 5, 8), (2, 8, 8), (3, 20, 8), (1, 1, 4)]  # (B, T, W): T < W, T == W, T > W, one key


def _ring_case(B: int, T: int, R: int, ragged: bool, seed: int, device="cpu") -> dict:
    """Random rows, positions past 2^32, ring rows distinct over the batch (each sequence owns its slot's rows) in a
    ring of random bytes; ragged: a full row, a row of one real key (its first key fills every place) and random
    counts in [1, T] between them."""
    g = torch.Generator().manual_seed(seed)
    M = B * T + 5
    case = dict(chunk=torch.randint(0, 256, (B, T, R), generator=g, dtype=torch.uint8),
                positions=torch.randint(0, 1 << 40, (B, T), generator=g),
                ring_row=torch.randperm(M, generator=g)[:B * T].view(B, T), valid=None,
                ring_rows=torch.randint(0, 256, (M, R), generator=g, dtype=torch.uint8),
                ring_pos=torch.randint(-1, 1 << 40, (M,), generator=g))
    if ragged:
        valid = torch.randint(1, T + 1, (B,), generator=g)
        valid[0], valid[-1] = T, 1
        case["valid"] = valid.to(torch.int32) if R % 4 else valid  # int32 counts too
    return {k: None if v is None else v.to(device) for k, v in case.items()}


def _ring_write(backend: str, case: dict, W: int, **knobs) -> tuple[torch.Tensor, torch.Tensor]:
    """(ring_rows, ring_pos) after ring_write with `backend` on copies of the ring (knobs: a direct Triton call)."""
    out = dict(case, ring_rows=case["ring_rows"].clone(), ring_pos=case["ring_pos"].clone())
    if knobs:
        from dsv41.kernels.triton.cache_write import ring_write

        ring_write(**out, window=W, **knobs)
    else:
        with use_backend(backend):
            ops.ring_write(**out, window=W)
    return out["ring_rows"], out["ring_pos"]


def _assert_ring_equal(actual: tuple, expected: tuple, what: str) -> None:
    _assert_rows_equal(actual[0], expected[0], f"{what} ring rows")
    if not torch.equal(actual[1], expected[1]):
        bad = (actual[1] != expected[1]).nonzero().flatten().tolist()
        raise AssertionError(f"{what}: ring positions differ at rows {bad}")


@pytest.mark.parametrize("shape", RING_SHAPES)
@pytest.mark.parametrize("R", [528, 17])  # a D = 512 window row (4-byte words), an odd row (bytes, masked)
@pytest.mark.parametrize("ragged", [False, True])
def test_ring_write_triton_matches_twin(shape, R, ragged):
    B, T, W = shape
    case = _ring_case(B, T, R, ragged, seed=B * 1000 + T * 10 + W + R + ragged)
    expected = _ring_write("torch", case, W)
    actual = _ring_write("triton", case, W)
    _assert_ring_equal(actual, expected, f"B={B} T={T} W={W} R={R} ragged={ragged}")
    assert not torch.equal(expected[0], case["ring_rows"]), "fixture: the write must change the ring"


@pytest.mark.parametrize("shape", RING_SHAPES)
@pytest.mark.parametrize("ragged", [False, True])
def test_ring_write_twin_is_the_formula(shape, ragged):
    """Twin == a loop over (b, j): t = max(v_b − w + j, 0), ring_rows[ring_row[b, t]] = chunk[b, t]; nothing else."""
    B, T, W = shape
    case = _ring_case(B, T, 17, ragged, seed=7 + B + T + W)
    rows, pos = case["ring_rows"].clone(), case["ring_pos"].clone()
    w = min(W, T)
    for b in range(B):
        v = T if case["valid"] is None else int(case["valid"][b])
        for j in range(w):
            t = max(v - w + j, 0)
            r = int(case["ring_row"][b, t])
            rows[r], pos[r] = case["chunk"][b, t], case["positions"][b, t]
    _assert_ring_equal(_ring_write("torch", case, W), (rows, pos), f"twin B={B} T={T} W={W} ragged={ragged}")


def test_ring_write_knobs_and_strides():
    """One key per program and two, a byte-strided chunk (the 4-byte word view does not apply: bytes, R = 528)."""
    B, T, W, R = 3, 12, 8, 528
    case = _ring_case(B, T, R, True, seed=13)
    expected = _ring_write("torch", case, W)
    wide = torch.randint(0, 256, (B, T, R + 4), dtype=torch.uint8, generator=torch.Generator().manual_seed(14))
    wide[..., 1:R + 1] = case["chunk"]
    strided = dict(case, chunk=wide[..., 1:R + 1])
    for knobs in ({"block_j": 1}, {"block_j": 2}):
        _assert_ring_equal(_ring_write("triton", case, W, **knobs), expected, str(knobs))
        _assert_ring_equal(_ring_write("triton", strided, W, **knobs), expected, f"byte-strided {knobs}")


def test_ring_write_bad_arguments():
    case = _ring_case(2, 4, 17, False, seed=1)
    for backend in ("torch", "triton"):
        with pytest.raises(ValueError, match="ring_rows"):
            _ring_write(backend, dict(case, ring_rows=case["ring_rows"][:, :16]), 4)
        with pytest.raises(ValueError, match="ring_row must"):
            _ring_write(backend, dict(case, ring_row=case["ring_row"].int()), 4)
        with pytest.raises(ValueError, match="valid"):
            _ring_write(backend, dict(case, valid=torch.ones(3, dtype=torch.long)), 4)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [64, 128, 300, 8192])
@pytest.mark.parametrize("ragged", [False, True])
def test_gpu_ring_write_matches_twin(T, ragged):
    """The v41-flash window (W = 128, 528 B rows) on CUDA, a batch of prefill rows; then the same launch captured
    in a CUDA graph and replayed with new counts (no host sync, no data-dependent shape)."""
    W, B = 128, 4
    case = _ring_case(B, T, 528, ragged, seed=T + ragged, device="cuda")
    expected = _ring_write("torch", case, W)
    _assert_ring_equal(_ring_write("triton", case, W), expected, f"T={T} ragged={ragged}")
    if ragged:
        rows, pos = case["ring_rows"].clone(), case["ring_pos"].clone()
        live = dict(case, ring_rows=rows, ring_pos=pos)
        with use_backend("triton"):
            ops.ring_write(**live, window=W)  # compiled before the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                ops.ring_write(**live, window=W)
        case["valid"].copy_(torch.tensor([1, T, T // 2, 2], device="cuda"))
        rows.copy_(case["ring_rows"])
        pos.copy_(case["ring_pos"])
        graph.replay()
        _assert_ring_equal((rows, pos), _ring_write("torch", case, W), f"T={T} graph replay")
