"""Checkpoint save/load: float round trip, the release's FP8/MXFP4 layout, sharding, HF config, bad input."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import dsv41
from dsv41.checkpoint import (
    CheckpointError,
    checkpoint_info,
    load_checkpoint,
    load_state_dict_file,
    read_header,
    read_state_dict,
    save_checkpoint,
    save_state_dict_file,
)
from dsv41.checkpoint.files import atomic_write, atomic_write_bytes
from dsv41.config import _HF_TEXT
from dsv41.model.transformer import Transformer
from dsv41.quant.fp4 import mxfp4_dequantize_weight, mxfp4_quantize_weight
from dsv41.quant.fp8 import fp8_block_dequantize_weight, fp8_block_quantize_weight, quantize_fp8

EXPERT = "layers.3.ffn.experts.5.w2.weight"
# the release's layout (dsv41.checkpoint.release_format; tests/test_checkpoint_release.py checks every tensor)
FP8_NAMES = ["layers.0.attn.wq_a.weight", "layers.0.attn.wq_b.weight", "layers.0.attn.wkv.weight",
             "layers.0.attn.wo_a.weight", "layers.0.attn.wo_b.weight", "layers.2.attn.indexer.wq_b.weight",
             "layers.5.ffn.shared_experts.w1.weight", "layers.1.engram.wkv.weight"]
ROW_NAMES = ["layers.1.engram.embed.weight"]
BF16_NAMES = ["embed.weight", "head.weight", "layers.2.attn.indexer.weights_proj.weight",
              "layers.2.attn.indexer.wk.weight", "layers.1.engram.q_weight", "layers.0.ffn.gate.weight",
              "layers.2.attn.compressor.wkv.weight", "layers.2.attn.compressor.wgate.weight",
              "layers.0.attn.q_norm.weight", "norm.weight"]
FP32_NAMES = ["layers.0.hc_attn_fn", "layers.0.hc_ffn_base", "layers.0.attn.attn_sink", "layers.0.ffn.gate.bias"]
# our float format with dtype=bf16 keeps these FP32 (keeps_fp32)
FLOAT_FP32_NAMES = FP32_NAMES + ["layers.0.ffn.gate.weight", "layers.2.attn.compressor.wkv.weight",
                                 "layers.2.attn.compressor.wgate.weight", "layers.0.attn.q_norm.weight",
                                 "norm.weight"]


def _random_tiny(seed: int) -> Transformer:
    """tiny preset, training init plus noise on every tensor (no all-ones norms, no zero biases)."""
    model = Transformer(dsv41.load_config("tiny")).init_weights(seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.01)
    return model


@pytest.fixture(scope="module")
def tiny() -> Transformer:
    return _random_tiny(0)


@pytest.fixture(scope="module")
def fp8_dir(tiny, tmp_path_factory) -> Path:
    return save_checkpoint(tiny, tmp_path_factory.mktemp("fp8") / "ckpt", fmt="official-fp8")


@pytest.fixture(scope="module")
def fp8_model(fp8_dir) -> Transformer:
    return load_checkpoint(fp8_dir)


def _hashes(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def _assert_state_equal(a: Transformer, b: Transformer) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].dtype == sb[name].dtype, name
        assert torch.equal(sa[name], sb[name]), name


# ---------------------------------------------------------------------- independent decoders (no dsv41.quant)
def _e4m3_table() -> np.ndarray:
    table = np.zeros(256)
    for b in range(256):
        sign, exp, man = -1.0 if b & 0x80 else 1.0, (b >> 3) & 0xF, b & 7
        if exp == 15 and man == 7:
            table[b] = np.nan
        elif exp == 0:
            table[b] = sign * man / 8 * 2.0**-6
        else:
            table[b] = sign * (1 + man / 8) * 2.0 ** (exp - 7)
    return table


E4M3 = _e4m3_table()
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy().astype(np.int64)


def _e8m0(t: torch.Tensor) -> np.ndarray:
    return np.ldexp(1.0, _bytes(t) - 127)


def _decode_fp8(w: torch.Tensor, scale: torch.Tensor) -> np.ndarray:
    out_dim, in_dim = w.shape
    s = np.repeat(np.repeat(_e8m0(scale), 32, axis=0), 32, axis=1)[:out_dim, :in_dim]
    return E4M3[_bytes(w)] * s


def _decode_fp8_rows(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    decoded = E4M3[_bytes(values)] * np.repeat(_e8m0(scale), 32, axis=1)[:, :values.shape[1]]
    return torch.from_numpy(decoded).float()


def _decode_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> np.ndarray:
    b = _bytes(packed)
    codes = np.stack([b & 0xF, b >> 4], axis=-1).reshape(b.shape[0], -1)  # element 2i = low nibble
    return E2M1[codes] * np.repeat(_e8m0(scale), 32, axis=1)


# ---------------------------------------------------------------------- float
def test_float_round_trip_is_bit_exact(tiny, tmp_path):
    directory = save_checkpoint(tiny, tmp_path / "ckpt", metadata={"step": 7}, extra_files={"notes.txt": "hi"})
    assert sorted(p.name for p in directory.iterdir()) == ["config.json", "model.safetensors", "notes.txt"]
    loaded = load_checkpoint(directory)
    _assert_state_equal(tiny, loaded)
    assert loaded.config == tiny.config
    for (name, p), (_, q) in zip(tiny.named_parameters(), loaded.named_parameters()):
        assert p.requires_grad == q.requires_grad, name
    for (name, b), (_, c) in zip(tiny.named_buffers(), loaded.named_buffers()):
        assert c.device.type == "cpu" and torch.equal(b, c), name
    assert read_header(directory / "model.safetensors")["__metadata__"]["step"] == "7"
    # the loaded tensors are not views of the file: rewriting it in place changes nothing
    path = directory / "model.safetensors"
    path.write_bytes(bytes(path.stat().st_size))
    _assert_state_equal(tiny, loaded)


def test_float_save_in_bf16_keeps_the_fp32_set(tiny, tmp_path):
    directory = save_checkpoint(tiny, tmp_path / "ckpt", dtype=torch.bfloat16)
    header = read_header(directory / "model.safetensors")
    for name in FLOAT_FP32_NAMES:
        assert header[name]["dtype"] == "F32", name
    for name in set(BF16_NAMES + FP8_NAMES + ROW_NAMES + [EXPERT]) - set(FLOAT_FP32_NAMES):
        assert header[name]["dtype"] == "BF16", name
    loaded = load_checkpoint(directory, dtype=torch.bfloat16)
    ref = tiny.state_dict()
    for name, value in loaded.state_dict().items():
        expected_dtype = torch.float32 if name.endswith("gate.bias") else torch.bfloat16
        assert value.dtype == expected_dtype, name
        assert torch.equal(value.float(), ref[name].bfloat16().float() if header[name]["dtype"] == "BF16"
                           else ref[name].to(value.dtype).float()), name


# ---------------------------------------------------------------------- official FP8 / MXFP4
def test_official_fp8_layout_has_release_names_dtypes_and_shapes(tiny, fp8_dir):
    raw = load_state_dict_file(fp8_dir / "model.safetensors")
    header = read_header(fp8_dir / "model.safetensors")
    params = tiny.state_dict()
    for name in FP8_NAMES:
        out_dim, in_dim = params[name].shape
        scale = name[:-len("weight")] + "scale"
        assert raw[name].dtype == torch.float8_e4m3fn and raw[name].shape == (out_dim, in_dim), name
        assert raw[scale].dtype == torch.float8_e8m0fnu, scale
        assert raw[scale].shape == (math.ceil(out_dim / 32), math.ceil(in_dim / 32)), scale
        assert (header[name]["dtype"], header[scale]["dtype"]) == ("F8_E4M3", "F8_E8M0")
    experts = [n for n in params if ".ffn.experts." in n]
    assert len(experts) == 8 * 8 * 3
    for name in experts:
        out_dim, in_dim = params[name].shape
        scale = name[:-len("weight")] + "scale"
        assert raw[name].dtype == torch.int8 and raw[name].shape == (out_dim, in_dim // 2), name
        assert raw[scale].dtype == torch.float8_e8m0fnu and raw[scale].shape == (out_dim, in_dim // 32), scale
        assert (header[name]["dtype"], header[scale]["dtype"]) == ("I8", "F8_E8M0")
    for name in ROW_NAMES:  # Engram tables: FP8 rows, one E8M0 scale per 32 channels (16-wide rows: one)
        rows, dim = params[name].shape
        scale = name[:-len("weight")] + "scale"
        assert raw[name].dtype == torch.float8_e4m3fn and raw[name].shape == (rows, dim), name
        assert raw[scale].dtype == torch.float8_e8m0fnu and raw[scale].shape == (rows, math.ceil(dim / 32)), scale
    for name in BF16_NAMES:
        assert raw[name].dtype == torch.bfloat16 and name[:-len("weight")] + "scale" not in raw, name
    for name in FP32_NAMES:
        assert raw[name].dtype == torch.float32, name
    # every stored tensor is a model tensor or the scale of one
    assert set(raw) - set(params) == {n[:-len("weight")] + "scale" for n in params
                                      if raw[n].dtype in (torch.float8_e4m3fn, torch.int8)}
    config = json.loads((fp8_dir / "config.json").read_text())
    assert (config["dtype"], config["expert_dtype"]) == ("fp8", "fp4")


def test_official_fp8_load_equals_independent_dequantization(tiny, fp8_dir, fp8_model):
    raw = load_state_dict_file(fp8_dir / "model.safetensors")
    loaded = fp8_model.state_dict()
    original = tiny.state_dict()
    assert all(v.dtype == torch.float32 for v in loaded.values())
    fp8 = [n for n in original if raw[n].dtype == torch.float8_e4m3fn and n not in ROW_NAMES]
    fp4 = [n for n in original if raw[n].dtype == torch.int8]
    assert len(fp8) == 8 * 8 + 3 + 1 and len(fp4) == 8 * 8 * 3  # 8 per layer, indexer wq_b x3, engram wkv
    for name in ROW_NAMES:
        got = loaded[name]
        assert torch.equal(got, _decode_fp8_rows(raw[name], raw[name[:-len("weight")] + "scale"])), name
        rel = ((got - original[name]).norm() / original[name].norm()).item()
        assert 0 < rel < 0.05, f"{name}: relative error {rel:.4f}"
    for name in fp8:
        w, got, scale = original[name], loaded[name], raw[name[:-len("weight")] + "scale"]
        independent = _decode_fp8(raw[name], scale)
        assert np.array_equal(got.double().numpy(), independent), name
        assert torch.equal(got, fp8_block_dequantize_weight(*fp8_block_quantize_weight(w))), name
        s = np.repeat(np.repeat(_e8m0(scale), 32, 0), 32, 1)[:w.shape[0], :w.shape[1]]
        err = np.abs(independent - w.double().numpy())
        assert (err <= 2.0**-4 * np.abs(w.double().numpy()) + s * 2.0**-10).all(), name
    # experts all share one shape in tiny: check them stacked
    w = torch.stack([original[n] for n in fp4])  # (E, out, in)
    got = torch.stack([loaded[n] for n in fp4])
    packed = torch.stack([raw[n] for n in fp4])
    scale = torch.stack([raw[n[:-len("weight")] + "scale"] for n in fp4])
    independent = np.stack([_decode_mxfp4(p, q) for p, q in zip(packed, scale)])
    assert np.array_equal(got.double().numpy(), independent)
    assert torch.equal(got, mxfp4_dequantize_weight(*mxfp4_quantize_weight(w)))
    s = np.repeat(_e8m0(scale), 32, axis=-1)
    assert (np.abs(independent - w.double().numpy()) <= 0.25 * np.maximum(np.abs(w.double().numpy()), s)).all()
    for name, w in original.items():
        if name in fp8 or name in fp4 or name in ROW_NAMES:
            continue
        expected = w.bfloat16().float() if raw[name].dtype == torch.bfloat16 else w
        assert raw[name].dtype in (torch.bfloat16, torch.float32) and torch.equal(loaded[name], expected), name


def test_fp8_model_logits_track_the_float_model(tiny, fp8_model):
    tokens = torch.randint(0, tiny.config.vocab_size, (1, 24))
    with torch.no_grad():
        a, b = tiny(tokens), fp8_model(tokens)
    cosine = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()
    assert cosine > 0.99, f"cosine {cosine:.5f}"
    assert not torch.equal(a, b)  # the quantization did something


def test_fp4_bytes_fp32_scales_and_row_scales_load_too(tiny, fp8_dir, fp8_model, tmp_path):
    """The other spellings the loader accepts: packed experts as F4 / U8, FP8 scales as FP32 values,
    FP8 with one scale per 1x32 row block (the report's Engram-table form)."""
    raw = load_state_dict_file(fp8_dir / "model.safetensors")
    rows = "layers.6.attn.wo_b.weight"
    values, scales = quantize_fp8(tiny.state_dict()[rows], block=32)
    raw[rows] = values.view(torch.float8_e4m3fn)
    raw[rows[:-len("weight")] + "scale"] = scales.view(torch.float8_e8m0fnu)
    assert scales.shape == (64, 2)
    fp8, fp4 = FP8_NAMES[0], EXPERT
    raw[fp4] = raw[fp4].view(torch.float4_e2m1fn_x2)
    raw[fp8[:-len("weight")] + "scale"] = raw[fp8[:-len("weight")] + "scale"].float()
    other = "layers.4.ffn.experts.1.w1.weight"
    raw[other] = raw[other].view(torch.uint8)
    (tmp_path / "config.json").write_bytes((fp8_dir / "config.json").read_bytes())
    save_state_dict_file(raw, tmp_path / "model.safetensors")
    assert read_header(tmp_path / "model.safetensors")[fp4]["dtype"] == "F4"
    loaded, reference = load_checkpoint(tmp_path).state_dict(), fp8_model.state_dict()
    assert torch.equal(loaded[rows], _decode_fp8_rows(values, scales))
    assert not torch.equal(loaded[rows], reference[rows])
    assert loaded.keys() == reference.keys()
    for name in reference:  # everything else is bit-identical
        assert name == rows or torch.equal(loaded[name], reference[name]), name


# ---------------------------------------------------------------------- HF config, sharding, info
def _hf_config(config) -> dict:
    flat = config.to_dict()
    text = {hf: flat[ours] for hf, ours in _HF_TEXT.items()}
    text["rope_scaling"] = {"rope_type": "yarn", "factor": flat["rope_factor"], "beta_fast": flat["beta_fast"],
                            "beta_slow": flat["beta_slow"],
                            "original_max_position_embeddings": flat["original_seq_len"]}
    text["num_key_value_heads"] = 1
    return {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "text_config": text}


def test_hf_style_config_directory_loads(tiny, tmp_path):
    directory = save_checkpoint(tiny, tmp_path / "ckpt")
    (directory / "config.json").write_text(json.dumps(_hf_config(tiny.config)))
    loaded = load_checkpoint(directory)
    assert loaded.config == tiny.config
    _assert_state_equal(tiny, loaded)


def test_sharded_round_trip_and_resave_in_place(tiny, tmp_path):
    directory = save_checkpoint(tiny, tmp_path / "ckpt", max_shard_bytes=1 << 20)
    shards = sorted(p.name for p in directory.glob("model-*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert not (directory / "model.safetensors").exists()
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tiny.state_dict()) and set(index["weight_map"].values()) == set(shards)
    sizes = sum(v.numel() * v.element_size() for v in tiny.state_dict().values())
    assert index["metadata"]["total_size"] == sizes
    _assert_state_equal(tiny, load_checkpoint(directory))
    raw = read_state_dict(directory)  # the model-free reader sees the same tensors
    assert raw.keys() == tiny.state_dict().keys()
    assert all(torch.equal(raw[k], v) for k, v in tiny.state_dict().items())
    # a single-file save over it: the stale shards and index go, and it loads
    save_checkpoint(tiny, directory, dtype=torch.bfloat16)
    assert sorted(p.name for p in directory.iterdir()) == ["config.json", "model.safetensors"]
    assert load_checkpoint(directory).embed.weight.equal(tiny.embed.weight.bfloat16().float())


def test_checkpoint_info_summarizes_from_headers(fp8_dir):
    info = checkpoint_info(fp8_dir)
    assert info["format"] == "official-fp8" and info["quantized"] == ["fp8_rows", "fp8_tiles", "mxfp4"]
    assert info["release_layout"] == {"conforms": True, "problems": 0, "first": []}
    assert info["config"]["n_layers"] == 8 and info["files"] == ["model.safetensors"]
    assert info["tensors"] == sum(v["tensors"] for v in info["dtypes"].values())
    assert info["bytes"] == sum(v["bytes"] for v in info["dtypes"].values())
    assert info["bytes"] < (fp8_dir / "model.safetensors").stat().st_size
    assert info["dtypes"]["I8"]["tensors"] == 8 * 8 * 3
    json.dumps(info)  # printable as JSON


# ---------------------------------------------------------------------- skipping and strictness
def test_mtp_and_vision_tensors_are_skipped_with_a_note(tiny, tmp_path, caplog):
    directory = save_checkpoint(tiny, tmp_path / "ckpt")
    raw = load_state_dict_file(directory / "model.safetensors")
    raw["mtp.0.main_proj.weight"] = torch.randn(8, 8)
    raw["vision.blocks.0.attn.qkv.weight"] = torch.randn(8, 8)
    save_state_dict_file(raw, directory / "model.safetensors")
    with caplog.at_level(logging.INFO, logger="dsv41.checkpoint"):
        _assert_state_equal(tiny, load_checkpoint(directory))
    assert "skipping 2 tensors" in caplog.text and "mtp.0.main_proj.weight" in caplog.text


def test_strict_false_initializes_what_is_missing(tiny, tmp_path):
    directory = save_checkpoint(tiny, tmp_path / "ckpt")
    raw = load_state_dict_file(directory / "model.safetensors")
    del raw["layers.2.attn.wq_a.weight"]
    save_state_dict_file(raw, directory / "model.safetensors")
    loaded = load_checkpoint(directory, strict=False).state_dict()
    for name, value in tiny.state_dict().items():
        if name == "layers.2.attn.wq_a.weight":
            assert torch.isfinite(loaded[name]).all() and not torch.equal(loaded[name], value)
        else:
            assert torch.equal(loaded[name], value), name


# ---------------------------------------------------------------------- bad input
@pytest.fixture
def saved(tiny, tmp_path) -> Path:
    return save_checkpoint(tiny, tmp_path / "ckpt")


def _expect_error(directory: Path, *needles: str, **kwargs) -> None:
    before = _hashes(directory) if directory.is_dir() else None
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(directory, **kwargs)
    message = str(e.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message
    if before is not None:
        assert _hashes(directory) == before


def test_missing_directory_and_config(saved, tmp_path):
    _expect_error(tmp_path / "nope", "nope")
    (saved / "config.json").unlink()
    _expect_error(saved, "config.json")
    (saved / "config.json").write_text("{not json")
    _expect_error(saved, "config.json")
    (saved / "config.json").write_text(json.dumps({"dim": -1}))
    _expect_error(saved, "config.json", "dim")


def _reversed_offsets(data: bytearray) -> bytearray:
    """The same file with one tensor's data_offsets swapped (a malformed entry, sizes unchanged)."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(bytes(data[8:8 + n]))
    name = next(k for k, v in header.items() if k != "__metadata__" and v["data_offsets"][1] > v["data_offsets"][0])
    header[name]["data_offsets"] = header[name]["data_offsets"][::-1]
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (n - len(raw))  # same header length: only the entry is wrong
    assert len(raw) == n
    return data[:8] + bytearray(raw) + data[8 + n:]


@pytest.mark.parametrize("damage", ["truncate", "short", "header", "appended", "offsets"])
def test_corrupt_safetensors_names_the_file(saved, damage):
    """A damaged file is a CheckpointError naming it: cut short, garbage in the header, bytes appended after the
    tensors (their offsets no longer end the file), a tensor whose data ends before it starts."""
    path = saved / "model.safetensors"
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "short":
        data = data[:5]
    elif damage == "header":
        data[8:40] = b"\xff" * 32
    elif damage == "appended":
        data += b"\x00" * 64
    else:
        data = _reversed_offsets(data)
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model.safetensors"):
        read_header(path)
    _expect_error(saved, "model.safetensors")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_state_dict_file(path)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        checkpoint_info(saved)


def test_missing_unexpected_and_misshaped_tensors_are_named(saved):
    path = saved / "model.safetensors"
    raw = load_state_dict_file(path)
    good = dict(raw)
    del raw["layers.6.attn.wo_b.weight"]
    raw["layers.0.attn.bogus.weight"] = torch.randn(4, 4)
    save_state_dict_file(raw, path)
    _expect_error(saved, "layers.6.attn.wo_b.weight", "layers.0.attn.bogus.weight", "missing 1", "unexpected 1")
    good["norm.weight"] = torch.randn(65)
    save_state_dict_file(good, path)
    _expect_error(saved, "norm.weight", "[65]")
    good["norm.weight"] = torch.randn(64)
    good["layers.0.attn.wq_a.weight"] = fp8_block_quantize_weight(good["layers.0.attn.wq_a.weight"])[0]
    save_state_dict_file(good, path)
    _expect_error(saved, "layers.0.attn.wq_a.scale", "missing")


def test_index_naming_a_missing_shard(tiny, tmp_path):
    directory = save_checkpoint(tiny, tmp_path / "ckpt", max_shard_bytes=1 << 20)
    victim = sorted(directory.glob("model-*.safetensors"))[1]
    victim.unlink()
    _expect_error(directory, victim.name)
    (directory / "model.safetensors.index.json").unlink()
    _expect_error(directory, "model.safetensors")


def test_interrupted_save_leaves_a_directory_that_does_not_load(tiny, saved, monkeypatch):
    import dsv41.checkpoint.save as ckpt

    calls = {"n": 0}
    real = ckpt._stored

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 50:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(ckpt, "_stored", failing)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tiny, saved, max_shard_bytes=1 << 19)
    assert not list(saved.glob(".*tmp*"))  # no temporary files left behind
    _expect_error(saved, "config.json")


def test_an_interrupted_file_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    """`atomic_write`: the new bytes go to a temporary sibling, fsynced before the rename over the target — a write
    that fails half-way leaves the old file byte for byte and no temporary behind."""
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"old contents")
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append("replace"), real_replace(a, b))[1])

    def half(tmp: Path) -> None:
        tmp.write_bytes(b"new con")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, half)
    assert path.read_bytes() == b"old contents" and sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    assert "replace" not in events
    atomic_write_bytes(path, b"new contents")
    assert path.read_bytes() == b"new contents" and sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    assert events[:2] == ["fsync", "replace"]  # the data is on disk before the name points at it


def test_save_rejects_bad_arguments(tiny, tmp_path):
    with pytest.raises(ValueError, match="fmt"):
        save_checkpoint(tiny, tmp_path / "a", fmt="gguf")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="extra file"):
        save_checkpoint(tiny, tmp_path / "b", extra_files={"config.json": "{}"})
    with pytest.raises(ValueError, match="extra file"):
        save_checkpoint(tiny, tmp_path / "c", extra_files={"../x": "{}"})
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
