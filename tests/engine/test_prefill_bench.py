"""benchmarks/prefill.py runs at lengths beyond the preset's max_seq_len (it sizes each lone sequence's pools;
it crashed with OutOfPages at its own documented command), its ratios are those of its own timings, and the
decode rows' cache accounting is the preset's; bad sizes exit 2."""

from __future__ import annotations

import json

from tests.conftest import load_script

from dsv41 import load_config
from dsv41.accounting.kv import global_kv_by_source


def test_prefill_benchmark_runs_past_max_seq_len_and_reports_its_own_ratios(tmp_path):
    script = load_script("benchmarks/prefill.py")
    n = load_config("tiny").max_seq_len + 64
    assert script.main(["--preset", "tiny", "--device", "cpu", "--prefill", "200", str(n), "--decode", str(n),
                        "--decode-steps", "2", "--chunk", "256", "--out", str(tmp_path)]) == 0
    (f,) = tmp_path.glob("prefill-*.json")
    d = json.loads(f.read_text())
    assert [r["tokens"] for r in d["prefill"]] == [200, n]
    for r in d["prefill"]:
        assert r["measured_ratio"] == r["encoder_only_s"] / r["exact_s"] and 0 < r["flop_ratio"] < 1
    (row,) = d["decode"]
    accounted = float(sum(global_kv_by_source(load_config("tiny")).values()))
    assert row["context"] == n and row["bytes_per_token"] == accounted
    assert script.main(["--preset", "tiny", "--device", "cpu", "--prefill", "0", "--out", str(tmp_path)]) == 2
