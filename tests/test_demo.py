"""`dsv41 demo` (the README's main job) runs on the CPU and shows the prefix store at work."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, "-m", "dsv41", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


def test_demo_runs_the_shipped_model_with_hits_and_a_replay(tmp_path):
    out = run_cli("demo", "--json", "--fresh", "--prefix-store", str(tmp_path / "prefix"), "--max-tokens", "4",
                  "--prompt-tokens", "200")
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    rows = {r["turn"]: r for r in result["rows"]}
    assert [r["cached"] for r in result["rows"][:3]] == [0, 0, 0]
    warm, cold_pool = rows["follow-up (pool hit)"], rows["follow-up (pool cleared)"]
    assert warm["cached"] > 128 and warm["replayed"] == 0
    assert cold_pool["cached"] > 128 and cold_pool["replayed"] == 128  # n_win of the shipped model
    assert all(r["kv_bytes_per_token"] == 159 for r in result["rows"])  # small: (72+34)/2 + (72+34)
    # units hold whole entries: 159 B per token over an even number of tokens, covering the prompt
    persisted_tokens = rows["prompt 1"]["bytes_persisted"] / 159
    assert persisted_tokens == int(persisted_tokens) and int(persisted_tokens) % 2 == 0
    assert rows["prompt 1"]["prompt"] - 1 <= persisted_tokens <= rows["prompt 1"]["prompt"] + 4


def test_generate_cli_streams_and_summarizes():
    out = run_cli("generate", "--preset", "tiny", "--random-init", "--prompt", "hello there", "--max-tokens", "3")
    assert out.returncode == 0, out.stderr[-2000:]
    summary = out.stderr.strip().splitlines()[-1]
    assert "prefill" in summary and "tok/s" in summary and "B/token" in summary


def test_generate_cli_bad_input_exits_2_with_one_line():
    for args in (["--preset", "tiny", "--prompt", "x"],  # no --random-init, no checkpoint
                 ["--preset", "tiny", "--random-init", "--prompt", "x", "--temperature", "-1"],
                 ["--checkpoint", "/nonexistent/dir", "--prompt", "x"]):
        out = run_cli("generate", *args)
        assert out.returncode == 2, (args, out.stderr[-500:])
        assert len(out.stderr.strip().splitlines()) == 1 and out.stderr.startswith("dsv41: error:"), out.stderr
