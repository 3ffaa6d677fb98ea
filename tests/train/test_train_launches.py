"""benchmarks/train_launches.py: phases add up to the total, and the Sinkhorn rounds show in the count."""

from __future__ import annotations

import json

from tests.conftest import load_script


def test_fewer_sinkhorn_rounds_launch_fewer_kernels_and_phases_add_up(tmp_path):
    script = load_script("benchmarks/train_launches.py")
    totals = {}
    for iters in (4, 1):
        out = tmp_path / str(iters)
        assert script.main(["--preset", "tiny", "--seq", "32", "--sinkhorn-iters", str(iters), "--out", str(out)]) == 0
        (f,) = out.glob("train_launches-*.json")
        d = json.loads(f.read_text())
        assert sum(d["phases"].values()) == d["total"] and set(d["phases"]) == {"forward", "backward", "optimizer"}
        totals[iters] = d
    # each extra round is a row and a column normalization in every split, forward and backward
    assert totals[4]["total"] > totals[1]["total"]
    assert totals[4]["phases"]["optimizer"] == totals[1]["phases"]["optimizer"]
    assert script.main(["--batch", "0", "--out", str(tmp_path)]) == 2
