"""benchmarks/batched_prefill.py: both modes give the same replies (else exit 1), the batched one in fewer
prefill forwards and — while replies decode beside the prompts (4 tokens each), under the layer bound — fewer
engine steps; bad sizes exit 2."""

from __future__ import annotations

import json

from tests.conftest import load_script


def test_batched_mode_needs_fewer_forwards_and_steps_for_the_same_replies(tmp_path):
    script = load_script("benchmarks/batched_prefill.py")
    assert script.main(["--problems", "40", "--max-tokens", "4", "--out", str(tmp_path)]) == 0
    (f,) = tmp_path.glob("batched_prefill-*.json")
    d = json.loads(f.read_text())
    batched, plain = d["modes"]
    assert d["requests"] == 160 and batched["batch_prefill"] and not plain["batch_prefill"]
    assert plain["prefill_forwards"] == plain["prefill_pieces"] == batched["prefill_pieces"]
    assert batched["prefill_forwards"] < plain["prefill_forwards"] and batched["engine_steps"] < plain["engine_steps"]
    assert script.main(["--problems", "0", "--out", str(tmp_path)]) == 2
