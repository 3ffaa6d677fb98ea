"""FP8 E4M3 / E8M0 formats against an independent oracle (ml_dtypes casts, frexp, hand tables)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from dsv41.quant import (
    as_e4m3,
    as_e8m0,
    dequantize_fp8,
    e8m0_scale,
    e8m0_to_float,
    fake_quant_fp8,
    fake_quant_window_fp8,
    fp8_block_dequantize_weight,
    fp8_block_quantize_weight,
    fp8_entry_bytes,
    quantize_fp8,
)

E4M3 = ml_dtypes.float8_e4m3fn
E8M0 = ml_dtypes.float8_e8m0fnu


# ---- oracle (numpy + ml_dtypes, no dsv41 code) ------------------------------------------------


def oracle_e8m0_ceil(ratio: np.ndarray) -> np.ndarray:
    """Byte of the smallest power of two >= ratio (ratio > 0, fp32), via frexp."""
    mant, exp = np.frexp(ratio.astype(np.float64))  # ratio = mant * 2**exp, mant in [0.5, 1)
    exp = np.where(mant == 0.5, exp - 1, exp)
    return (exp + 127).astype(np.uint8)


def e8m0_value(b: np.ndarray) -> np.ndarray:
    return b.view(E8M0).astype(np.float32)


def oracle_fp8(x: np.ndarray, block: int, amax_floor: float = 1e-4):
    """(E4M3 bytes, E8M0 bytes, dequantized fp32) of the window-KV format."""
    xb = x.reshape(*x.shape[:-1], -1, block)
    amax = np.abs(xb).max(-1, keepdims=True)
    ratio = np.maximum(amax, np.float32(amax_floor)) / np.float32(448)
    sbytes = oracle_e8m0_ceil(ratio)
    s = e8m0_value(sbytes)
    q = np.clip(xb / s, -448, 448).astype(E4M3)
    deq = (q.astype(np.float32) * s).reshape(x.shape)
    return q.view(np.uint8).reshape(x.shape), sbytes[..., 0], deq


def sample(rng: np.random.Generator, shape: tuple[int, ...], block: int) -> np.ndarray:
    """Normal values with a per-block magnitude in 1e-6..1e4, plus exact zeros and negative zeros."""
    nblocks = shape[:-1] + (shape[-1] // block, 1)
    block_mag = 10.0 ** rng.uniform(-6, 4, size=nblocks)
    x = (rng.standard_normal(shape).reshape(*nblocks[:-1], block) * block_mag).reshape(shape)
    x = x.astype(np.float32)
    u = rng.random(shape)
    x[u < 0.03] = 0.0
    x[(u >= 0.03) & (u < 0.06)] = -0.0
    return x


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (distinguishes -0.0 from 0.0)."""
    itype = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.view(itype[a.dtype]), b.view(itype[b.dtype]))


def assert_bits(ours: torch.Tensor, ref: np.ndarray, what: str) -> None:
    ours_np = ours.numpy()
    mismatch = ours_np.view(np.uint8 if ours_np.dtype == np.uint8 else np.uint32) != ref.view(
        np.uint8 if ref.dtype == np.uint8 else np.uint32
    )
    if mismatch.any():
        idx = np.argwhere(mismatch)[:5]
        pytest.fail(f"{what}: {mismatch.sum()} mismatches, first at {idx.tolist()}: "
                    f"ours {ours_np[tuple(idx[0])]} ref {ref[tuple(idx[0])]}")


# ---- E8M0 -------------------------------------------------------------------------------------


def test_e8m0_scale_rounds_up_to_power_of_two():
    rng = np.random.default_rng(101)
    ratio = (10.0 ** rng.uniform(-35, 35, 4000)).astype(np.float32)
    powers = np.float32(2.0) ** rng.integers(-120, 120, 200).astype(np.float32)
    just_above = np.nextafter(powers, np.float32(np.inf))
    just_below = np.nextafter(powers, np.float32(0))
    ratio = np.concatenate([ratio, powers, just_above, just_below]).astype(np.float32)
    max_value = 448.0
    amax = (ratio.astype(np.float64) * max_value).astype(np.float32)
    # the oracle sees the same fp32 ratio the code forms
    ref = oracle_e8m0_ceil(amax / np.float32(max_value))
    ours = e8m0_scale(torch.from_numpy(amax), max_value)
    assert ours.dtype == torch.uint8
    assert_bits(ours, ref, "e8m0 bytes")
    # the chosen power of two covers the ratio and is the smallest that does
    val = e8m0_value(ref)
    r = amax / np.float32(max_value)
    assert (val >= r).all() and (val / 2 < r).all()


def test_e8m0_scale_zero_amax_and_floor():
    ours = e8m0_scale(torch.tensor([0.0, 1e-45, 448.0 * 2.0**-126]), 448.0)
    assert ours.tolist() == [1, 1, 1]  # floored at 2^-126


def test_e8m0_to_float_all_bytes():
    b = np.arange(256, dtype=np.uint8)
    ref = e8m0_value(b)
    ours = e8m0_to_float(torch.from_numpy(b))
    assert np.isnan(ours[255].item()) and np.isnan(ref[255])
    assert_bits(ours[:255], ref[:255], "e8m0 values")
    assert torch.equal(e8m0_to_float(as_e8m0(torch.from_numpy(b[:255]))), ours[:255])


# ---- window KV quantize / dequantize / fake quant ---------------------------------------------


@pytest.mark.parametrize("shape", [(512,), (3, 7, 512), (2, 64)])
def test_quantize_fp8_matches_oracle(shape):
    rng = np.random.default_rng(sum(shape) + 7)
    x = sample(rng, shape, 32)
    x[..., :32] = rng.standard_normal(32).astype(np.float32) * 1e-6  # below the 1e-4 amax floor
    vals, scales = quantize_fp8(torch.from_numpy(x))
    ref_vals, ref_scales, ref_deq = oracle_fp8(x, 32)
    assert vals.shape == shape and scales.shape == shape[:-1] + (shape[-1] // 32,)
    assert vals.dtype == torch.uint8 and scales.dtype == torch.uint8
    assert_bits(vals, ref_vals, "e4m3 bytes")
    assert_bits(scales, ref_scales, "e8m0 bytes")
    deq = dequantize_fp8(vals, scales)
    assert_bits(deq, ref_deq, "dequantized")
    assert np.isfinite(deq.numpy()).all()
    # float8 views are accepted too
    assert bits_equal(dequantize_fp8(as_e4m3(vals), as_e8m0(scales)), deq)


def test_fp8_ties_and_subnormals():
    # scale 2^0 for every block (amax = 448 exactly); values on E4M3 midpoints → ties to even
    rng = np.random.default_rng(11)
    grid = np.arange(0, 127, dtype=np.uint8).view(E4M3).astype(np.float64)  # 0 .. 448
    mids = ((grid[:-1] + grid[1:]) / 2).astype(np.float32)  # exact in fp32
    x = rng.choice(mids, size=(4, 128)).astype(np.float32) * rng.choice([-1, 1], (4, 128))
    x[:, ::32] = 448.0
    vals, scales = quantize_fp8(torch.from_numpy(x))
    assert (scales == 127).all()
    ref_vals, _, _ = oracle_fp8(x, 32)
    assert_bits(vals, ref_vals, "tie bytes")
    # ties went to the even mantissa
    assert ((vals.numpy() & 1) == 0).all()


def test_fake_quant_fp8_equals_dequantize_of_quantize():
    rng = np.random.default_rng(12)
    x = torch.from_numpy(sample(rng, (4, 5, 512), 32))
    fq = fake_quant_window_fp8(x)
    assert bits_equal(fq, dequantize_fp8(*quantize_fp8(x)))
    xb = x.to(torch.bfloat16)
    assert bits_equal(fake_quant_fp8(xb), dequantize_fp8(*quantize_fp8(xb), dtype=torch.bfloat16))
    assert not torch.isnan(fq).any()


def test_fake_quant_fp8_gradient_is_identity():
    # power-of-two scales round up, so |x / scale| <= 448 everywhere and nothing is clamped
    rng = np.random.default_rng(13)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.from_numpy(sample(rng, (3, 512), 32)).to(dtype).requires_grad_()
        g = torch.randn(3, 512).to(dtype)
        (fake_quant_window_fp8(x) * g).sum().backward()
        assert x.grad.dtype == dtype
        assert bits_equal(x.grad, g)


def test_entry_bytes():
    assert fp8_entry_bytes(512, 32) == 528
    assert fp8_entry_bytes(256, 32) == 264
    with pytest.raises(ValueError, match="divisible"):
        fp8_entry_bytes(500, 32)


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="divisible by block=32"):
        quantize_fp8(torch.randn(3, 40))
    with pytest.raises(ValueError, match="divisible by block=32"):
        fake_quant_fp8(torch.randn(3, 40))
    v, s = quantize_fp8(torch.randn(2, 64))
    with pytest.raises(ValueError, match="scales shape"):
        dequantize_fp8(v, s[:, :1])
    with pytest.raises(TypeError, match="uint8"):
        dequantize_fp8(v.float(), s)


# ---- checkpoint FP8 weights ---------------------------------------------------------------------


def oracle_fp8_weight(w: np.ndarray, block: int = 32):
    out_dim, in_dim = w.shape
    r, c = -(-out_dim // block), -(-in_dim // block)
    pad = np.zeros((r * block, c * block), np.float32)
    pad[:out_dim, :in_dim] = w
    tiles = pad.reshape(r, block, c, block)
    amax = np.abs(tiles).max(axis=(1, 3))
    sbytes = oracle_e8m0_ceil(np.maximum(amax / np.float32(448), np.float32(2.0**-126)))
    s = e8m0_value(sbytes)[:, None, :, None]
    q = np.clip(tiles / s, -448, 448).astype(E4M3).reshape(r * block, c * block)[:out_dim, :in_dim]
    return q.view(np.uint8), sbytes


def test_fp8_weight_dequantize_hand_case():
    w = torch.full((33, 40), 0x38, dtype=torch.uint8)  # E4M3 1.0
    w[0, 0], w[0, 1], w[0, 2], w[32, 39] = 0x01, 0x7E, 0xB8, 0x40  # 2^-9, 448, -1.0, 2.0
    scale = torch.tensor([[127, 128], [126, 129]], dtype=torch.uint8)  # 1, 2, 0.5, 4
    out = fp8_block_dequantize_weight(w, scale)
    expected = torch.ones(33, 40)
    expected[:32, 32:] = 2.0
    expected[32, :32] = 0.5
    expected[32, 32:] = 4.0
    expected[0, 0], expected[0, 1], expected[0, 2], expected[32, 39] = 2.0**-9, 448.0, -1.0, 8.0
    assert bits_equal(out, expected)
    assert fp8_block_dequantize_weight(w, e8m0_to_float(scale), dtype=torch.bfloat16).dtype == torch.bfloat16
    assert bits_equal(fp8_block_dequantize_weight(w, e8m0_to_float(scale)), expected)


def test_fp8_weight_quantize_hand_case():
    w = torch.zeros(32, 32)
    w[0, 0], w[1, 1], w[2, 2] = 896.0, -3.0, 1.0  # amax 896 → scale 2 → 448, -1.5, 0.5
    q, s = fp8_block_quantize_weight(w)
    assert s.tolist() == [[128]]
    assert (q[0, 0].item(), q[1, 1].item(), q[2, 2].item(), q[3, 3].item()) == (0x7E, 0xBC, 0x30, 0x00)


@pytest.mark.parametrize("shape", [(64, 96), (50, 70), (1, 33)])
def test_fp8_weight_quantize_matches_oracle_and_round_trips(shape):
    rng = np.random.default_rng(shape[0] * 1000 + shape[1])
    w = (rng.standard_normal(shape) * 10.0 ** rng.uniform(-4, 3, size=(shape[0], 1))).astype(np.float32)
    w[0, :5] = 0.0
    q, s = fp8_block_quantize_weight(torch.from_numpy(w))
    ref_q, ref_s = oracle_fp8_weight(w)
    assert q.shape == shape and s.shape == (-(-shape[0] // 32), -(-shape[1] // 32))
    assert_bits(q, ref_q, "weight bytes")
    assert_bits(s, ref_s, "weight scales")
    # quantize ∘ dequantize reaches a fixed point: values after one pass, bytes after two
    d1 = fp8_block_dequantize_weight(q, s)
    q2, s2 = fp8_block_quantize_weight(d1)
    d2 = fp8_block_dequantize_weight(q2, s2)
    assert bits_equal(d1, d2)
    q3, s3 = fp8_block_quantize_weight(d2)
    assert torch.equal(q3, q2) and torch.equal(s3, s2)


def test_fp8_weight_bad_shapes_raise():
    q, s = fp8_block_quantize_weight(torch.randn(40, 70))
    with pytest.raises(ValueError, match="scale shape"):
        fp8_block_dequantize_weight(q, s[:, :2])
    with pytest.raises(ValueError, match="2-D"):
        fp8_block_quantize_weight(torch.randn(2, 40, 70))


@pytest.mark.gpu
def test_fp8_cuda_matches_cpu():
    rng = np.random.default_rng(14)
    x = torch.from_numpy(sample(rng, (64, 512), 32))
    v, s = quantize_fp8(x)
    vc, sc = quantize_fp8(x.cuda())
    assert torch.equal(v, vc.cpu()) and torch.equal(s, sc.cpu())
    assert bits_equal(fake_quant_window_fp8(x.cuda()).cpu(), fake_quant_window_fp8(x))
    w = torch.from_numpy(sample(rng, (96, 160), 32))
    q, ws = fp8_block_quantize_weight(w)
    qc, wsc = fp8_block_quantize_weight(w.cuda())
    assert torch.equal(q, qc.cpu()) and torch.equal(ws, wsc.cpu())
    assert bits_equal(fp8_block_dequantize_weight(qc, wsc).cpu(), fp8_block_dequantize_weight(q, ws))
