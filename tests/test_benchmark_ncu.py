"""benchmarks/ncu.py: the Nsight Compute CSV readers (checked against sums of the rows written here) and
its command-line errors. The profiling itself needs a GPU and ncu (see docs/kernels.md)."""

from __future__ import annotations

import csv
import io
import random

import pytest
from benchmarks import ncu

REASONS = ("barrier", "long_sb", "short_sb", "wait", "mio")
SASS = ("@!P0 BRA 0x7f10", "LDG.E.128 R4, desc[UR4][R2.64]", "HGMMA.64x32x16.F32.BF16 R24, R64, gdesc[UR8], R24",
        "FFMA R1, R2, R3, R4", "@P3 LDG.E.U16 R197, desc[UR34][R172.64]", "PRMT R64, R93, 0x5410, R94")


def _source_block(name: str, rows: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, quoting=csv.QUOTE_ALL)
    w.writerow(["Kernel Name", name, ""])
    cols = (["Address", "Source", ncu.SAMPLES, "Instructions Executed"] + [f"stall_{r}" for r in REASONS]
            + [f"stall_{r} (Not Issued)" for r in REASONS])
    w.writerow(cols)
    for r in rows:
        w.writerow([r["addr"], "      " + r["sass"], f"{r['samples']:,}", f"{r['executed']:,}"]
                   + [str(r[k]) for k in REASONS] + ["0"] * len(REASONS))
    return buf.getvalue()


def _random_rows(rng: random.Random, n: int) -> list[dict]:
    rows = []
    for i in range(n):
        parts = {k: rng.randrange(0, 2000) for k in REASONS}
        rows.append(dict(addr=hex(0x1000 + 16 * i), sass=rng.choice(SASS), samples=sum(parts.values()),
                         executed=rng.randrange(0, 5_000_000), **parts))
    return rows


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_source_page_summary_matches_row_sums(seed):
    rng = random.Random(seed)
    a, b = _random_rows(rng, 40), _random_rows(rng, 25)
    blocks = ncu.parse_source(_source_block("_kernel_a", a) + _source_block("_kernel_b", b))
    assert list(blocks) == ["_kernel_a", "_kernel_b"] and len(blocks["_kernel_b"]) == 25

    s = ncu.summarize_source(blocks["_kernel_a"], top=5)
    total = sum(r["samples"] for r in a)
    assert s["samples"] == total
    for k in REASONS:  # each reason's share is its column sum over all samples
        assert s["stalls"][k] == pytest.approx(sum(r[k] for r in a) / total, abs=1e-4)
    assert sum(s["stalls"].values()) == pytest.approx(1.0, abs=1e-3)
    executed = sum(r["executed"] for r in a)
    assert s["executed"] == executed
    ldg = sum(r["executed"] for r in a if "LDG" in r["sass"])
    assert s["mix"].get("LDG", 0) == pytest.approx(ldg / executed, abs=1e-4)
    best = sorted(a, key=lambda r: -r["samples"])[:5]
    assert [h["share"] for h in s["hot"]] == [round(r["samples"] / total, 4) for r in best]
    top = best[0]
    assert list(s["hot"][0]["reasons"]) == sorted((k for k in REASONS if top[k]), key=lambda k: -top[k])[:3]


def test_opcode_drops_predicates_and_modifiers():
    assert ncu.opcode("@!P0 LDG.E.128 R4, [R2]") == "LDG"
    assert ncu.opcode("HGMMA.64x32x16.F32.BF16 R24") == "HGMMA"
    assert ncu.opcode("   ") == "?"


def test_details_page_keeps_the_reported_metrics_per_kernel():
    buf = io.StringIO()
    w = csv.writer(buf, quoting=csv.QUOTE_ALL)
    w.writerow(["ID", "Kernel Name", "Section Name", "Metric Name", "Metric Unit", "Metric Value"])
    w.writerow(["0", "_k", "GPU Speed Of Light Throughput", "Duration", "us", "572.67"])
    w.writerow(["0", "_k", "GPU Speed Of Light Throughput", "DRAM Throughput", "%", "60.76"])
    w.writerow(["0", "_k", "Instruction Statistics", "Executed Instructions", "inst", "184,321,792"])
    w.writerow(["0", "_k", "GPU Speed Of Light Throughput", "SM Frequency", "Ghz", "1.77"])  # not reported
    w.writerow(["1", "_finish", "Launch Statistics", "Registers Per Thread", "register/thread", "40"])
    got = ncu.parse_details("==PROF== noise before the table\n" + buf.getvalue())
    assert got == {"0 _k": {"Duration": (572.67, "us"), "DRAM Throughput": (60.76, "%"),
                            "Executed Instructions": (184321792.0, "inst")},
                   "1 _finish": {"Registers Per Thread": (40.0, "register/thread")}}
    assert ncu.parse_details("no table here") == {}


@pytest.mark.parametrize("argv", [["mhc", "mhc_post prefill", "--knobs", "{not json"],
                                  ["mhc", "mhc_post prefill", "--knobs", "[1, 2]"]])
def test_bad_knobs_exit_2(argv, capsys):
    assert ncu.main(argv) == 2
    assert "--knobs" in capsys.readouterr().err


def test_without_cuda_exit_2(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert ncu.main(["attention", "decode B=64"]) == 2
    assert "CUDA" in capsys.readouterr().err


def test_report_joins_both_pages_per_kernel(tmp_path, monkeypatch, capsys):
    """main() end to end with ncu replaced by canned pages: the JSON holds each kernel's details metrics and
    its source-page summary, and the per-unit instruction count is the executed total over the case's work."""
    import json
    import subprocess
    import types

    import torch

    rng = random.Random(5)
    rows = {"_k": _random_rows(rng, 12), "_finish": _random_rows(rng, 5)}
    buf = io.StringIO()
    w = csv.writer(buf, quoting=csv.QUOTE_ALL)
    w.writerow(["ID", "Kernel Name", "Section Name", "Metric Name", "Metric Unit", "Metric Value"])
    w.writerow(["0", "_k", "SOL", "Duration", "us", "12.5"])
    w.writerow(["1", "_finish", "SOL", "DRAM Throughput", "%", "n/a"])  # unparsable: reported as None
    pages = {"details": buf.getvalue(), "source": "".join(_source_block(k, v) for k, v in rows.items())}

    def fake_run(cmd, capture_output, text):
        if "--import" not in cmd:  # the profiling run: leave a report behind
            open(cmd[cmd.index("-o") + 1] + ".ncu-rep", "w").close()
            return types.SimpleNamespace(returncode=0, stdout="", stderr="")
        return types.SimpleNamespace(returncode=0, stdout=pages[cmd[cmd.index("--page") + 1]], stderr="")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "test GPU")
    monkeypatch.setattr(ncu, "find_ncu", lambda: "ncu")
    monkeypatch.setattr(ncu, "_load_case", lambda family, name: dict(unit="byte", work=4e6))
    monkeypatch.setattr(subprocess, "run", fake_run)
    assert ncu.main(["mhc", "some case", "--out", str(tmp_path)]) == 0
    report = json.loads(next(tmp_path.glob("ncu-mhc-some-case-*.json")).read_text())
    k, f = report["kernels"]
    assert (k["kernel"], k["metrics"], k["units"]) == ("_k", {"Duration": 12.5}, {"Duration": "us"})
    assert f["kernel"] == "_finish" and f["metrics"] == {"DRAM Throughput": None}
    assert k["executed"] == sum(r["executed"] for r in rows["_k"])
    assert f["samples"] == sum(r["samples"] for r in rows["_finish"])
    out = capsys.readouterr().out
    assert f"warp-instructions per KB moved: {k['executed'] / 4e3:,.2f}" in out
