"""Truncated configs (every layer role kept) and synthetic release-format shards (issue 23, acceptance 3).

A truncated config's layers must play the very roles they played in the full model; synthetic
shards must hold exactly the model's tensors in the release layout and load (float and
as-released) into a model that runs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tests.conftest import load_script

import dsv41
from dsv41.checkpoint import load_checkpoint, read_state_dict
from dsv41.checkpoint.files import TensorStore
from dsv41.checkpoint.load import release_layout_problems
from dsv41.checkpoint.synthetic import model_tensors, resize_engram, write_synthetic_release
from dsv41.config import ConfigError, truncated_layer_ids
from dsv41.model.released import FP8Linear
from dsv41.model.transformer import Transformer
from dsv41.plan import FULL, REINDEX, REUSE, WINDOW, layer_plan

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------- truncation
@pytest.mark.parametrize("preset,n", [("v41-flash", 5), ("v41-flash", 6), ("v41-flash", 9), ("tiny", 5),
                                      ("small", 6)])
def test_truncated_layers_keep_their_roles(preset, n):
    full = dsv41.load_config(preset)
    cut = full.truncated(n)
    ids = truncated_layer_ids(full, n)
    assert cut.n_layers == n == len(ids) and ids == sorted(ids)
    before, after = layer_plan(full), layer_plan(cut)
    for k, old in enumerate(ids):  # the same role, ratio, half, Engram and candidate duty as before
        a, b = before[old], after[k]
        assert (a.mode, a.ratio, a.half, a.engram, a.candidate_source, a.uses_candidates) == \
            (b.mode, b.ratio, b.half, b.engram, b.candidate_source, b.uses_candidates), (old, k)
        if a.kv_source is not None:
            assert ids[b.kv_source] == a.kv_source and ids[b.topk_source] == a.topk_source, (old, k)
    assert {p.mode for p in after} == {WINDOW, FULL, REUSE, REINDEX}
    assert any(p.engram for p in after) and {p.half for p in after} == {"encoder", "decoder"}
    for name in ("dim", "head_dim", "q_lora_rank", "n_routed_experts", "moe_inter_dim", "vocab_size"):
        assert getattr(cut, name) == getattr(full, name), name
    rows = dict(zip(full.engram_layer_ids, full.engram_num_embeddings))
    assert cut.engram_num_embeddings == [rows[ids[i]] for i in cut.engram_layer_ids]
    assert cut.n_mtp_layers == 0 and cut.dspark_block_size == 0


def test_v41_flash_roles_need_five_layers():
    assert truncated_layer_ids(dsv41.load_config("v41-flash"), 5) == [1, 2, 3, 20, 24]
    with pytest.raises(ConfigError, match="at least 5 layers"):
        dsv41.load_config("v41-flash").truncated(4)
    with pytest.raises(ConfigError, match="positive"):
        dsv41.load_config("v41-flash").truncated(0)


def test_cli_max_layers(capsys):
    from dsv41.cli import main

    assert main(["plan", "--preset", "v41-flash", "--max-layers", "6"]) == 0
    out = capsys.readouterr().out
    assert "reindex: [5]" in out and "candidate source: 4" in out
    assert main(["accounting", "--preset", "v41-flash", "--max-layers", "3"]) == 2
    assert "at least 5 layers" in capsys.readouterr().err


# ---------------------------------------------------------------------- synthetic shards
def test_model_tensors_are_the_model_state_dict():
    config = dsv41.load_config("tiny")
    state = Transformer(config).state_dict()
    assert {n: tuple(s) for n, s in model_tensors(config)} == {n: tuple(t.shape) for n, t in state.items()}


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    config = resize_engram(dsv41.load_config("tiny").truncated(6).replace(engram_head_dim=32), 500)
    return write_synthetic_release(config, tmp_path_factory.mktemp("syn") / "ckpt", max_shard_bytes=1 << 20)


def test_synthetic_shards_are_the_release_layout_and_load(shards):
    with TensorStore(shards) as store:
        assert len(store.files) > 2 and release_layout_problems(store) == []
    config = dsv41.load_config(shards)
    assert (config.dtype, config.expert_dtype, config.n_layers) == ("fp8", "fp4", 6)
    assert config.engram_num_embeddings[0] < 10_000  # resized
    values = read_state_dict(shards)
    assert all(torch.isfinite(v).all() for v in values.values())
    w = values["layers.2.attn.wq_a.weight"]
    assert 0.5 < w.std().item() * w.shape[1] ** 0.5 < 2.0  # std ≈ fan_in^-1/2
    tokens = torch.randint(0, config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    outs = []
    for weights in ("float", "as-released"):
        model = load_checkpoint(shards, weights=weights)
        assert any(isinstance(m, FP8Linear) for m in model.modules()) == (weights == "as-released")
        with torch.no_grad():
            outs.append(model(tokens))
        assert torch.isfinite(outs[-1]).all(), weights
    assert not torch.equal(outs[0], outs[1])


def test_the_shard_script_runs_and_refuses_bad_arguments(tmp_path, capsys):
    script = load_script("scripts/make_release_shards.py")
    assert script.main(["--out", str(tmp_path / "a"), "--preset", "tiny", "--device", "cpu"]) == 0
    assert (tmp_path / "a" / "config.json").exists()
    assert script.main(["--out", str(tmp_path / "b"), "--max-layers", "2"]) == 2
    assert script.main(["--out", str(tmp_path / "c"), "--preset", "nope"]) == 2
    assert "error" in capsys.readouterr().err
