"""ParallelConfig parsing, stage cuts, CLI errors (fast), and `torchrun -m dsv41 train --parallel` end to end
against `dsv41 train` on one device (opt-in: DSV41_PARALLEL_FULL=1, ~2 min)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dsv41.config import ConfigError
from dsv41.parallel.config import ParallelConfig, parse_parallel

ROOT = Path(__file__).resolve().parents[2]


def test_parse_and_validate() -> None:
    c = parse_parallel("dp=2,ep=2,pp=2,cp=1,cuts=5,schedule=gpipe")
    assert (c.dp, c.ep, c.pp, c.cp, c.cuts, c.schedule, c.world_size, c.n_microbatches) == \
        (2, 2, 2, 1, (5,), "gpipe", 4, 2)
    assert parse_parallel("fsdp=4").dp == 4 and parse_parallel("").world_size == 1
    assert parse_parallel("dp=2").engram_sharded and not parse_parallel("pp=2").engram_sharded
    assert [list(r) for r in parse_parallel("pp=2,cuts=5").stage_layers(8)] == [[0, 1, 2, 3, 4], [5, 6, 7]]
    assert [len(r) for r in parse_parallel("pp=3").stage_layers(8)] == [3, 2, 3]
    for bad, key in [("dp=0", "dp"), ("dp=2,ep=3", "ep"), ("tp=2", "tp"), ("dp=two", "dp"), ("schedule=zb", "schedule"),
                     ("pp=2,cuts=5:6", "cuts"), ("dp", "dp"), ("mixed=fp8", "mixed")]:
        with pytest.raises(ConfigError, match=f"'{key}"):
            parse_parallel(bad)
    with pytest.raises(ConfigError, match="cuts"):
        ParallelConfig(pp=2, cuts=(9,)).stage_layers(8)


def _dsv41(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dsv41", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src"), **(env or {})})


def test_cli_errors_exit_2(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    from dsv41.cli import main

    assert main(["train", "--parallel", "dp=2,zz=1", "--steps", "1"]) == 2
    assert "parallel option 'zz'" in capsys.readouterr().err
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert main(["train", "--parallel", "dp=2", "--grad_accum", "2", "--steps", "1",
                 "--out", "/nonexistent-never-written"]) == 2
    assert "torchrun" in capsys.readouterr().err
    assert not Path("/nonexistent-never-written").exists()


def _train_records(out: Path) -> list[dict]:
    return [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if '"train"' in ln]


@pytest.mark.skipif(not os.environ.get("DSV41_PARALLEL_FULL"), reason="set DSV41_PARALLEL_FULL=1 (minutes)")
def test_torchrun_train_equals_one_device(tmp_path: Path) -> None:
    common = ["--preset", "tiny", "--steps", "3", "--grad_accum", "2", "--seq_len", "64", "--batch_size", "2",
              "--eval_every=-1", "--baseline=false", "--progress=false", "--threads", "1", "--log_every", "1",
              "--cache_dir", str(tmp_path / "cache")]
    one = _dsv41("train", *common, "--out", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    par = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "dsv41", "train", *common,
                          "--parallel", "dp=2", "--out", str(tmp_path / "par")], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"})
    assert par.returncode == 0, par.stderr[-3000:]
    a, b = _train_records(tmp_path / "one"), _train_records(tmp_path / "par")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3]
    for x, y in zip(a, b):
        assert abs(x["loss"] - y["loss"]) <= 1e-5 * abs(x["loss"]), (x["loss"], y["loss"])
    ckpt = tmp_path / "par" / "ckpt-000003"
    conv = subprocess.run([sys.executable, "-m", "dsv41.parallel.checkpoint", str(ckpt), str(tmp_path / "single")],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert conv.returncode == 0, conv.stderr
    assert (tmp_path / "single" / "model.safetensors").exists()
