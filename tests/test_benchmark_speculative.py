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


def test_steps_inside_cost_model_kept_leave_the_decisions_as_they_were():
    """The benchmark's profiled steps (torch.profiler slows the host ~2×) must not enter the cost model that decides
    the next round: everything it measured inside `cost_model_kept` is gone after it, what it measured before kept."""
    import torch
    from tests.conftest import engine_test_model

    from dsv41.engine.engine import Engine
    from dsv41.engine.sampling import SamplingParams
    from dsv41.engine.speculative import NoisyDrafter

    model = engine_test_model(57)
    engine = Engine(model, max_batch=2, max_seq_len=96, drafter=NoisyDrafter(model.config.vocab_size, 2),
                    step_time=lambda n: 1e-3)
    engine._measure("plain", 2, 0.002, 2)
    engine._measure("plain", 2, 0.002, 2)
    before = (dict(engine.cost_model.times), dict(engine.cost_model.steps), list(engine.cost_model.timeline))
    g = torch.Generator().manual_seed(57)
    with speculative.cost_model_kept(engine):
        seqs = [engine.add_request(torch.randint(3, 100, (9,), generator=g).tolist(), SamplingParams(max_tokens=12))
                for _ in range(2)]
        while engine.has_work():
            engine.step()
        assert len(engine.cost_model.timeline) > len(before[2])  # the steps inside were measured …
    assert all(len(s.output) == 12 for s in seqs)
    cm = engine.cost_model
    assert (cm.times, cm.steps, list(cm.timeline)) == before  # … and are gone


def test_bad_rounds_exit_2(tmp_path, capsys):
    assert speculative.main(["--device", "cpu", "--preset", "tiny", "--rounds", "0", "--out", str(tmp_path)]) == 2
    assert "--rounds must be >= 1" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.json"))


def test_parting_positions():
    assert speculative.parting([[1, 2, 3], [4, 5], [6]], [[1, 2, 3], [4, 9], [6, 7]]) == [1, 1]


def test_held_out_prompts_are_distinct_windows_while_there_are_enough():
    prompts = speculative.text_prompts(DATA, 512, 64)
    assert len(prompts) == 64 and all(len(p) == 512 for p in prompts)
    assert len({tuple(p) for p in prompts}) == 64
    more = speculative.text_prompts(DATA, 512, 200)  # more than the corpus has: cycled
    assert len(more) == 200 and len({tuple(p) for p in more}) < 200
