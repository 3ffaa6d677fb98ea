"""Layer plan: the published sharing pattern (SPEC §1, §3) comes out of the config."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dsv41.config import load_config
from dsv41.plan import FULL, REINDEX, REUSE, WINDOW, decoder_kv_source, format_plan, layer_plan


def _modes(plans) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {WINDOW: [], FULL: [], REINDEX: [], REUSE: []}
    for p in plans:
        out[p.mode].append(p.layer_id)
    return out


def test_v41_flash_modes() -> None:
    plans = layer_plan(load_config("v41-flash"))
    assert len(plans) == 40
    modes = _modes(plans)
    assert modes[WINDOW] == [0, 1]
    assert modes[FULL] == [2, 8, 14, 20]
    assert modes[REINDEX] == [24, 28, 32, 36]
    assert modes[REUSE] == [i for i in range(40) if i not in (0, 1, 2, 8, 14, 20, 24, 28, 32, 36)]


def test_v41_flash_sources_and_halves() -> None:
    c = load_config("v41-flash")
    plans = layer_plan(c)
    assert [p.layer_id for p in plans if p.half == "encoder"] == list(range(20))
    assert [p.layer_id for p in plans if p.half == "decoder"] == list(range(20, 40))
    assert decoder_kv_source(c) == 20
    for p in plans[2:20]:  # encoder: three groups of six, m = 2, each led by its Full layer
        assert p.ratio == 2 and p.kv_source == 2 + 6 * ((p.layer_id - 2) // 6) == p.topk_source
    for p in plans[20:]:  # decoder: every layer reads layer 20's entries; top-k from the latest index source
        assert p.ratio == 1 and p.kv_source == 20
        assert p.topk_source == 20 + 4 * ((p.layer_id - 20) // 4)
    assert [p.layer_id for p in plans if p.candidate_source] == [20]
    assert [p.layer_id for p in plans if p.uses_candidates] == [24, 28, 32, 36]
    assert [p.layer_id for p in plans if p.engram] == [1, 14]
    assert all(p.rope == "window" for p in plans[:2]) and all(p.rope == "yarn" for p in plans[2:])


def test_plan_of_a_hand_made_config() -> None:
    c = load_config("tiny").replace(
        n_layers=10, compress_ratios=[0, 4, 4, 4, 0, 1, 1, 1, 1, 1], kv_source_layers=[1, 5],
        index_source_layers=[1, 3, 5, 8], candidate_source_layer=5, engram_layer_ids=[2],
        engram_num_embeddings=[6126], n_encoder_layers=5,
    )
    got = [(p.mode, p.kv_source, p.topk_source, p.uses_candidates) for p in layer_plan(c)]
    assert got == [
        (WINDOW, None, None, False), (FULL, 1, 1, False), (REUSE, 1, 1, False), (REINDEX, 1, 3, False),
        (WINDOW, None, None, False), (FULL, 5, 5, False), (REUSE, 5, 5, False), (REUSE, 5, 5, False),
        (REINDEX, 5, 8, True), (REUSE, 5, 8, False),
    ]


def test_tiny_plan_has_every_mode() -> None:
    plans = layer_plan(load_config("tiny"))
    modes = _modes(plans)
    assert all(modes[m] for m in (WINDOW, FULL, REINDEX, REUSE)), modes
    assert {p.half for p in plans} == {"encoder", "decoder"}
    assert {p.ratio for p in plans} >= {0, 1, 2}
    assert any(p.candidate_source for p in plans) and any(p.uses_candidates for p in plans)
    assert any(p.engram for p in plans)


def test_format_plan_summary() -> None:
    text = format_plan(load_config("v41-flash"))
    assert "full: [2, 8, 14, 20]" in text and "reindex: [24, 28, 32, 36]" in text


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dsv41", *args], capture_output=True, text=True, timeout=60)


def test_cli_plan_text() -> None:
    out = _cli("plan", "--preset", "v41-flash")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "full: [2, 8, 14, 20]" in lines
    assert "reindex: [24, 28, 32, 36]" in lines
    assert "window-only: [0, 1]" in lines
    assert "encoder: 0-19" in lines and "decoder: 20-39" in lines
    assert "candidate source: 20" in lines
    row = {ln.split()[0]: ln.split() for ln in lines[2:] if ln[:1].isdigit()}
    assert row["20"][:3] == ["20", "decoder", "full"] and "source" in row["20"]
    assert row["24"][2] == "reindex" and "masked" in row["24"]
    assert row["25"][2] == "reuse" and row["1"][2] == "window"


@pytest.mark.parametrize("preset", ["tiny"])
def test_cli_plan_json(preset: str) -> None:
    out = _cli("plan", "--preset", preset, "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert [r["mode"] for r in rows] == [p.mode for p in layer_plan(load_config(preset))]
