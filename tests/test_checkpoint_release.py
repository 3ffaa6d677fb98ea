"""An `official-fp8` save is exactly the release's layout, tensor by tensor (issue 23, acceptance 1).

The expectation is restated here from the official inference code (model.py / convert.py of
DeepSeek-V4.1-Flash, revision dba1be0a), independently of `dsv41.checkpoint.release_format`: a
canonical name (layer and expert indices → N) → form, and the stored dtypes and shapes computed
from the model's own shapes. Both the table and a real save of `tiny` and `small` are checked
against it, so changing any tensor's stored dtype, shape or scale layout fails here.
"""

from __future__ import annotations

import math
import re

import pytest

import dsv41
from dsv41.accounting import compute
from dsv41.checkpoint import read_header, save_checkpoint
from dsv41.checkpoint.release_format import ReleaseFormatError, storage_of, stored_bytes
from dsv41.model.transformer import Transformer

TILES, ROWS, FP4, BF16, F32 = "fp8_tiles", "fp8_rows", "mxfp4", "bf16", "f32"
EXPECTED = {
    # FP8 E4M3 + E8M0 per 32x32 tile: Linear with the fp8 default dtype; wo_a too (convert.py pops its scale)
    "layers.N.attn.wq_a.weight": TILES, "layers.N.attn.wq_b.weight": TILES, "layers.N.attn.wkv.weight": TILES,
    "layers.N.attn.wo_a.weight": TILES, "layers.N.attn.wo_b.weight": TILES,
    "layers.N.attn.indexer.wq_b.weight": TILES,
    "layers.N.ffn.shared_experts.w1.weight": TILES, "layers.N.ffn.shared_experts.w2.weight": TILES,
    "layers.N.ffn.shared_experts.w3.weight": TILES, "layers.N.engram.wkv.weight": TILES,
    # FP8 rows + E8M0 per 32 channels: ParallelEngramEmbedding
    "layers.N.engram.embed.weight": ROWS,
    # MXFP4: routed experts (expert_dtype fp4)
    "layers.N.ffn.experts.N.w1.weight": FP4, "layers.N.ffn.experts.N.w2.weight": FP4,
    "layers.N.ffn.experts.N.w3.weight": FP4,
    # FP32: hc_* under set_dtype(float32), attn_sink, gate biases
    "layers.N.hc_attn_fn": F32, "layers.N.hc_attn_base": F32, "layers.N.hc_attn_scale": F32,
    "layers.N.hc_ffn_fn": F32, "layers.N.hc_ffn_base": F32, "layers.N.hc_ffn_scale": F32,
    "layers.N.attn.attn_sink": F32, "layers.N.ffn.gate.bias": F32,
    # BF16: everything else the model holds
    "embed.weight": BF16, "head.weight": BF16, "norm.weight": BF16,
    "layers.N.attn_norm.weight": BF16, "layers.N.ffn_norm.weight": BF16,
    "layers.N.attn.q_norm.weight": BF16, "layers.N.attn.kv_norm.weight": BF16,
    "layers.N.attn.compressor.wkv.weight": BF16, "layers.N.attn.compressor.wgate.weight": BF16,
    "layers.N.attn.compressor.norm.weight": BF16,
    "layers.N.attn.indexer.wk.weight": BF16, "layers.N.attn.indexer.k_norm.weight": BF16,
    "layers.N.attn.indexer.weights_proj.weight": BF16,
    "layers.N.ffn.gate.weight": BF16, "layers.N.engram.q_weight": BF16, "layers.N.engram.k_weight": BF16,
}


def _canonical(name: str) -> str:
    return re.sub(r"\.\d+(?=\.)", ".N", name)


def _expected_files(name: str, shape: tuple[int, ...]) -> dict[str, tuple[str, list[int]]]:
    """Stored name → (safetensors dtype, shape), by the formulas of model.py's Linear / table / experts."""
    form = EXPECTED[_canonical(name)]
    scale = name.removesuffix("weight") + "scale"
    if form == TILES:
        out_dim, in_dim = shape
        return {name: ("F8_E4M3", [out_dim, in_dim]),
                scale: ("F8_E8M0", [(out_dim + 31) // 32, (in_dim + 31) // 32])}
    if form == ROWS:
        rows, dim = shape
        return {name: ("F8_E4M3", [rows, dim]), scale: ("F8_E8M0", [rows, math.ceil(dim / 32)])}
    if form == FP4:
        out_dim, in_dim = shape
        return {name: ("I8", [out_dim, in_dim // 2]), scale: ("F8_E8M0", [out_dim, in_dim // 32])}
    return {name: ("BF16" if form == BF16 else "F32", list(shape))}


@pytest.fixture(scope="module", params=["tiny", pytest.param("small", marks=pytest.mark.slow)])
def model(request) -> Transformer:
    return Transformer(dsv41.load_config(request.param)).init_weights(seed=3)


def test_the_table_stores_every_model_tensor_as_the_release_does(model):
    seen = set()
    for name in model.state_dict():
        canonical = _canonical(name)
        assert canonical in EXPECTED, f"{name}: a tensor the release expectation above does not list"
        assert storage_of(name) == EXPECTED[canonical], f"{name}: table says {storage_of(name)}"
        seen.add(canonical)
    if model.config.engram_layer_ids:  # tiny and small build every kind of tensor the text model has
        assert seen == set(EXPECTED), sorted(set(EXPECTED) - seen)


def test_official_fp8_save_has_exactly_the_release_layout(model, tmp_path):
    directory = save_checkpoint(model, tmp_path / "ckpt", fmt="official-fp8", max_shard_bytes=8 << 20)
    header: dict = {}
    for path in sorted(directory.glob("*.safetensors")):
        header.update({k: v for k, v in read_header(path).items() if k != "__metadata__"})
    expected: dict[str, tuple[str, list[int]]] = {}
    total = 0
    for name, value in model.state_dict().items():
        files = _expected_files(name, tuple(value.shape))
        expected.update(files)
        total += stored_bytes(name, tuple(value.shape))
        for stored, (dtype, shape) in files.items():
            assert stored in header, f"{stored} missing from the save"
            got = (header[stored]["dtype"], header[stored]["shape"])
            assert got == (dtype, shape), f"{stored}: saved {got}, the release stores {(dtype, shape)}"
            begin, end = header[stored]["data_offsets"]
            assert end - begin == math.prod(shape) * (4 if dtype == "F32" else 2 if dtype == "BF16" else 1), stored
    assert set(header) == set(expected), sorted(set(header) ^ set(expected))[:5]
    written = sum(e - b for b, e in (h["data_offsets"] for h in header.values()))
    assert written == total
    # `dsv41 accounting` prints exactly what the save wrote (it sums Param rows, not the model)
    stored = compute(model.config)["checkpoint_bytes"]
    assert stored["total"] == written and sum(stored["by_group"].values()) == written
    assert stored["by_part"]["backbone"] + stored["by_part"]["engram"] == written


def test_accounting_gives_the_release_checkpoint_size_to_the_byte():
    """v41-flash in the release's format = the release's model.safetensors.index.json total_size:
    510,286,023,000 bytes (text, Engram, DSpark and vision; scales included)."""
    stored = compute(dsv41.load_config("v41-flash"))["checkpoint_bytes"]
    assert stored["total"] == 510_286_023_000, f"{stored['total']:,}"
    form = stored["by_form"]
    assert form["mxfp4"] > 0.58 * stored["total"] and form["fp8_rows"] > 0.39 * stored["total"]


def test_a_tensor_outside_the_table_is_refused(tmp_path):
    with pytest.raises(ReleaseFormatError, match="no rule"):
        storage_of("layers.0.attn.brand_new.weight")
    with pytest.raises(ReleaseFormatError, match="multiple of 32"):
        stored_bytes("layers.0.ffn.experts.0.w1.weight", (64, 48))
