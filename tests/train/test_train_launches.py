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


def test_the_kernel_backend_counts_only_the_glue_between_kernels(tmp_path, monkeypatch):
    """`--backend triton` runs the training kernels (the CPU interpreter here): the ops they replace leave the
    count and the interpreter's own tensor ops are not counted, so the step has fewer kernel ops than on the
    twins (2 layers of `tiny`, 16 tokens, to keep the interpreter short)."""
    script = load_script("benchmarks/train_launches.py")
    tiny = script.load_config("tiny")
    monkeypatch.setattr(script, "load_config", lambda name: tiny.replace(
        n_layers=2, compress_ratios=[0, 2], kv_source_layers=[1], index_source_layers=[1], candidate_source_layer=1,
        engram_layer_ids=[1]))
    counts = {}
    for backend in ("torch", "triton"):
        out = tmp_path / backend
        assert script.main(["--preset", "tiny", "--seq", "16", "--sinkhorn-iters", "1", "--backend", backend,
                            "--top", "100", "--out", str(out)]) == 0
        (f,) = out.glob("train_launches-*.json")
        counts[backend] = json.loads(f.read_text())
    twins, kernels = counts["torch"], counts["triton"]
    assert kernels["backend"] == "triton" and sum(kernels["phases"].values()) == kernels["total"]
    # measured: forward 476 vs 876 ops, backward 384 vs 980
    assert kernels["phases"]["forward"] < 0.7 * twins["phases"]["forward"], (kernels["phases"], twins["phases"])
    assert kernels["phases"]["backward"] < 0.6 * twins["phases"]["backward"], (kernels["phases"], twins["phases"])
    # the launchers' own torch ops (42 here); the interpreter's ops, if counted, would land there by the thousand
    in_launchers = sum(n for site, n in kernels["sites"].items() if "kernels/triton/" in site)
    assert in_launchers < 0.15 * (kernels["phases"]["forward"] + kernels["phases"]["backward"]), kernels["sites"]
