"""benchmarks/speculative.py on the CPU (`tiny`, random weights, the oracle drafter): one run writes its JSON with
both engines warmed up, their decode windows, stalls and the cost model's timeline; its prompts of held-out text
are distinct windows while there are enough. (A broken benchmark otherwise shows up on the GPU box,
where device time is scarce.)"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import speculative

DATA = Path(__file__).resolve().parents[1] / "data" / "sample"


def test_a_cpu_run_writes_both_engines_windows(tmp_path):
    rc = speculative.main(["--device", "cpu", "--preset", "tiny", "--batches", "2", "--prompt-len", "8",
                           "--new-tokens", "4", "--out", str(tmp_path), "--tag", "t", "--spec-beside-prefill", "1",
                           "--speculate", "always", "--spec-first", "--rounds", "3"])  # (auto: CPU timings decide)
    assert rc == 0
    (path,) = tmp_path.glob("speculative-*-t.json")
    report = json.loads(path.read_text())
    assert report["spec_beside_prefill"] == 1 and report["spec_overlap"] is False  # the CPU: no overlap
    (run,) = report["runs"]
    assert run["batch"] == 2 and run["lossless_requests"] == "2/2"  # the oracle drafter is the model: greedy equal
    assert set(run["warm_up_s"]) == {"plain", "speculative"} and all(s > 0 for s in run["warm_up_s"].values())
    assert report["project_batch"] is True and report["lean_plain"] is True
    assert report["order"] == "speculative first" and report["rounds"] == 3
    # three rounds, the order alternating; each round's ratios, their medians
    assert [r["first"] for r in run["rounds"]] == ["spec", "plain", "spec"]
    assert all(r["lossless_requests"] == 2 and r["parting_positions"] == [] for r in run["rounds"])
    assert all(r["plain_as_round_1"] == r["spec_as_round_1"] == 2 for r in run["rounds"])  # reused: as before
    first = run["rounds"][0]
    assert first["plain_closed_s"] == run["plain"]["closed_s"] and first["closed_speedup"] == run["closed_speedup"]
    assert all(r["closed_speedup"] == r["plain_closed_s"] / r["spec_closed_s"] for r in run["rounds"])
    assert run["median_closed_speedup"] == sorted(r["closed_speedup"] for r in run["rounds"])[1]
    for name in ("plain", "speculative"):
        r = run[name]
        assert r["closed_tokens"] == 2 * 4 and isinstance(r["stalls"], list)
        # the step log covers the timed run: every decoded token and prefill piece, the ramp first
        assert sum(step[3] for step in r["steps"]) == r["closed_tokens"] - 2  # (each prompt's first: its prefill)
        assert sum(step[2] for step in r["steps"]) == r["counts"]["prefill_pieces"]
        assert 0 < r["ramp_steps"] < len(r["steps"]) and all(step[0] > 0 for step in r["steps"])
    assert sum(step[4] for step in run["speculative"]["steps"]) > 0 == sum(step[4] for step in run["plain"]["steps"])
    assert 0 < len(run["timeline"]) == run["speculative"]["window_steps"]  # (the CPU profiles no steps after it)
    assert run["mean_tokens_per_verification"] > 1  # drafts were accepted


def test_parting_positions():
    assert speculative.parting([[1, 2, 3], [4, 5], [6]], [[1, 2, 3], [4, 9], [6, 7]]) == [1, 1]


def test_held_out_prompts_are_distinct_windows_while_there_are_enough():
    prompts = speculative.text_prompts(DATA, 512, 64)
    assert len(prompts) == 64 and all(len(p) == 512 for p in prompts)
    assert len({tuple(p) for p in prompts}) == 64
    more = speculative.text_prompts(DATA, 512, 200)  # more than the corpus has: cycled
    assert len(more) == 200 and len({tuple(p) for p in more}) < 200
