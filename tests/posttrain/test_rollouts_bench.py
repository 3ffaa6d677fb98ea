"""benchmarks/rollouts.py: every mode trains the same samples, the report is rewritten after each mode (a run
cut short keeps what finished), and the rollout engine's prefill is batched (fewer forwards than pieces)."""

from __future__ import annotations

import json

import pytest
from tests.conftest import load_script


def script():
    return load_script("benchmarks/rollouts.py")


ARGS = ["--device", "cpu", "--preset", "tiny", "--steps", "1", "--prompts-per-step", "2", "--modes", "batch,sample"]


def test_modes_train_the_same_samples_and_prefill_is_batched(tmp_path):
    assert script().main(ARGS + ["--out", str(tmp_path)]) == 0
    (f,) = tmp_path.glob("rollouts-*-smoke.json")
    d = json.loads(f.read_text())
    assert [r["mode"] for r in d["results"]] == ["batch", "sample"] and d["dtype"] == "fp32"
    batch, sample = d["results"]
    assert batch["ratio_vs_batch"] == 1.0
    assert sample["ratio_vs_batch"] == pytest.approx(sample["samples_per_s"] / batch["samples_per_s"])
    assert batch["trained_samples"] == sample["trained_samples"] == 2 * d["workload"]["group_size"]
    for r in d["results"]:
        assert r["prefill_forwards"] < r["prefill_pieces"], r  # a group's equal prompts share forwards
        assert r["ms_per_engine_step"] > 0


def test_a_run_cut_short_keeps_the_modes_it_finished(tmp_path, monkeypatch):
    module = script()
    real = module.run_mode

    def second_fails(mode, args, device):
        if mode == "sample":
            raise KeyboardInterrupt  # the device call's limit, say
        return real(mode, args, device)

    monkeypatch.setattr(module, "run_mode", second_fails)
    with pytest.raises(KeyboardInterrupt):
        module.main(ARGS + ["--out", str(tmp_path)])
    (f,) = tmp_path.glob("rollouts-*-smoke.json")
    assert [r["mode"] for r in json.loads(f.read_text())["results"]] == ["batch"]
