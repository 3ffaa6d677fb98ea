"""Profile one benchmark case's kernels with Nsight Compute and say what limits them.

    python benchmarks/ncu.py attention "decode B=64"
    python benchmarks/ncu.py mhc "mhc_post prefill" --knobs '{"split": 1}' --top 20

The case comes from benchmarks/kernel_cases/<family>.py (its Triton function, or its `sweep` entry
with --knobs). The script re-runs itself under `ncu --set full` with profiling switched on for one
call only (after warm-up), so every kernel of that call is profiled once and nothing else. Printed
per kernel: duration, DRAM and SM throughput, issue-slot use, occupancy and registers, cycles per
issued instruction, executed warp-instructions per unit of the case's work (per KB moved or per
MFLOP), where the warps stall (the PC-sampling reasons, share of all samples) and the SASS
instructions that collect the most samples. A JSON of the same goes to benchmarks/results/
(ncu-<family>-<case>-<date>.json). Needs a CUDA device and `ncu` (Nsight Compute, on PATH or in
/usr/local/cuda/bin); the clocks are left alone (`--clock-control none`).
"""

from __future__ import annotations

import argparse
import collections
import csv
import datetime
import importlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
RESULTS = HERE / "results"

# Details-page metrics reported, by the name Nsight Compute prints (section "Speed of light" etc.)
DETAILS = ("Duration", "DRAM Throughput", "Compute (SM) Throughput", "L2 Hit Rate", "Issue Slots Busy",
           "Warp Cycles Per Issued Instruction", "Eligible Warps Per Scheduler", "Registers Per Thread",
           "Dynamic Shared Memory Per Block", "Achieved Occupancy", "Executed Instructions", "Grid Size",
           "Block Size")
SAMPLES = "Warp Stall Sampling (All Samples)"


def find_ncu() -> str | None:
    """`ncu` on PATH, else CUDA's default install location."""
    return shutil.which("ncu") or shutil.which("/usr/local/cuda/bin/ncu")


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except (AttributeError, ValueError):
        return None


def parse_details(text: str) -> dict[str, dict[str, tuple[float | None, str]]]:
    """`ncu --page details --csv` → {"<ID> <kernel>": {metric name: (value, unit)}} for the DETAILS metrics."""
    out: dict[str, dict[str, tuple[float | None, str]]] = {}
    rows = csv.DictReader(io.StringIO(text[text.find('"ID"'):] if '"ID"' in text else ""))
    for row in rows:
        name = row.get("Metric Name")
        if name not in DETAILS:
            continue
        kernel = f'{row.get("ID", "?")} {row.get("Kernel Name", "?")}'
        out.setdefault(kernel, {})[name] = (_number(row.get("Metric Value", "")), row.get("Metric Unit", ""))
    return out


def parse_source(text: str) -> dict[str, list[dict[str, str]]]:
    """`ncu --page source --csv --print-source sass` → {kernel: rows}: a block per kernel, each opened by a
    '"Kernel Name","<name>"' line and then a header row and one row per SASS instruction."""
    blocks: dict[str, list[dict[str, str]]] = {}
    kernel, lines = None, []

    def close() -> None:
        if kernel is not None and lines:
            blocks[kernel] = list(csv.DictReader(io.StringIO("".join(lines))))

    for line in text.splitlines(keepends=True):
        if line.startswith('"Kernel Name"'):
            close()
            kernel, lines = next(csv.reader([line]))[1], []
        elif kernel is not None and line.strip():
            lines.append(line)
    close()
    return blocks


def opcode(sass: str) -> str:
    """The opcode of a SASS line without its predicate and modifiers: '@!P0 LDG.E.128 R4, [...]' → 'LDG'."""
    words = [w for w in sass.split() if not w.startswith("@")]
    return words[0].split(".")[0] if words else "?"


def summarize_source(rows: list[dict[str, str]], top: int) -> dict:
    """Stall reasons as shares of all PC samples, executed warp-instructions by opcode and the `top` SASS
    instructions by samples (with their three largest reasons)."""
    reasons = [k for k in (rows[0] if rows else {}) if k.startswith("stall_") and "Not Issued" not in k]
    total = sum(_number(r.get(SAMPLES, "")) or 0 for r in rows)
    stalls = collections.Counter()
    mix = collections.Counter()
    executed = 0.0
    for r in rows:
        for k in reasons:
            stalls[k[len("stall_"):]] += _number(r.get(k, "")) or 0
        n = _number(r.get("Instructions Executed", "")) or 0
        executed += n
        mix[opcode(r.get("Source", ""))] += n
    hot = sorted(rows, key=lambda r: -(_number(r.get(SAMPLES, "")) or 0))[:top]
    return dict(
        samples=total,
        stalls={k: round(v / total, 4) for k, v in stalls.most_common() if v} if total else {},
        executed=executed,
        mix={k: round(v / executed, 4) for k, v in mix.most_common(12) if v} if executed else {},
        hot=[dict(sass=r.get("Source", "").strip(), share=round((_number(r.get(SAMPLES, "")) or 0) / total, 4),
                  reasons={k[len("stall_"):]: _number(r.get(k, "")) for k in
                           sorted(reasons, key=lambda k: -(_number(r.get(k, "")) or 0))[:3]
                           if (_number(r.get(k, "")) or 0) > 0})
             for r in hot] if total else [])


def _load_case(family: str, name: str):
    import torch

    sys.path.insert(0, str(HERE))
    module = importlib.import_module(f"kernel_cases.{family}")
    return next((c for c in module.cases(torch.device("cuda")) if c["name"] == name), None)


def _child(family: str, name: str, knobs: dict | None) -> int:
    """Under ncu: warm the case up, then run it once with profiling on."""
    import torch

    case = _load_case(family, name)
    fn = (lambda: case["sweep"](**knobs)) if knobs else case["triton"]
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return 0


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("family")
    ap.add_argument("case")
    ap.add_argument("--knobs", default=None, help="JSON object of launcher knobs (the case's sweep entry)")
    ap.add_argument("--kernel", default=None, help="profile only kernels whose name matches this regex")
    ap.add_argument("--top", type=int, default=12, help="SASS instructions listed per kernel")
    ap.add_argument("--out", default=str(RESULTS), help="folder of the JSON (default benchmarks/results)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        knobs = json.loads(args.knobs) if args.knobs else None
    except json.JSONDecodeError as e:
        print(f"--knobs is not JSON: {e}", file=sys.stderr)
        return 2
    if knobs is not None and not isinstance(knobs, dict):
        print("--knobs must be a JSON object", file=sys.stderr)
        return 2
    if args.child:
        return _child(args.family, args.case, knobs)

    import torch

    if not torch.cuda.is_available():
        print("benchmarks/ncu.py needs a CUDA device", file=sys.stderr)
        return 2
    ncu = find_ncu()
    if ncu is None:
        print("benchmarks/ncu.py needs Nsight Compute (`ncu` on PATH or /usr/local/cuda/bin/ncu)", file=sys.stderr)
        return 2
    try:
        case = _load_case(args.family, args.case)
    except ModuleNotFoundError:
        case = None
    if case is None or (knobs and "sweep" not in case):
        print(f"no {'sweepable ' if knobs else ''}case {args.case!r} in kernel_cases/{args.family}.py",
              file=sys.stderr)
        return 2

    with tempfile.TemporaryDirectory() as tmp:
        rep = os.path.join(tmp, "profile")
        cmd = [ncu, "--clock-control", "none", "--set", "full", "--profile-from-start", "off", "-f", "-o", rep]
        if args.kernel:
            cmd += ["-k", f"regex:{args.kernel}"]
        cmd += [sys.executable, os.path.abspath(__file__), "--child", args.family, args.case]
        cmd += ["--knobs", json.dumps(knobs)] if knobs else []
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0 or not os.path.exists(rep + ".ncu-rep"):
            print(f"ncu failed (exit {run.returncode}):\n{run.stdout[-2000:]}{run.stderr[-2000:]}", file=sys.stderr)
            return 1
        details = subprocess.run([ncu, "--import", rep + ".ncu-rep", "--page", "details", "--csv"],
                                 capture_output=True, text=True).stdout
        source = subprocess.run([ncu, "--import", rep + ".ncu-rep", "--page", "source", "--csv", "--print-source",
                                 "sass"], capture_output=True, text=True).stdout
    metrics, blocks = parse_details(details), parse_source(source)

    unit, scale = ("KB moved", case["work"] / 1e3) if case["unit"] == "byte" else ("MFLOP", case["work"] / 1e6)
    report = dict(family=args.family, case=args.case, knobs=knobs, device=torch.cuda.get_device_name(),
                  date=datetime.date.today().isoformat(), kernels=[])
    names = list(metrics) or [f"? {k}" for k in blocks]
    for i, kernel in enumerate(names):
        name = kernel.split(" ", 1)[1]
        # the source page lists kernels in profiling order, without IDs: match by name, then by position
        rows = blocks.get(name) or (list(blocks.values())[i] if i < len(blocks) else [])
        src = summarize_source(rows, args.top)
        got = metrics.get(kernel, {})
        m, units = {k: v for k, (v, _) in got.items()}, {k: u for k, (_, u) in got.items()}
        report["kernels"].append(dict(kernel=name, metrics=m, units=units, **src))
        print(f"== {name}")
        for k in DETAILS:
            if m.get(k) is not None:
                print(f"   {k:38s} {m[k]:>14,.2f} {units[k]}")
        if src["executed"]:
            print(f"   warp-instructions per {unit}: {src['executed'] / scale:,.2f}")
        print("   stalls (share of PC samples): " + ", ".join(f"{k} {v:.0%}" for k, v in
                                                            list(src["stalls"].items())[:8]))
        print("   executed mix: " + ", ".join(f"{k} {v:.0%}" for k, v in src["mix"].items()))
        for h in src["hot"]:
            why = " ".join(f"{k}={v:.0f}" for k, v in h["reasons"].items())
            print(f"   {h['share']:6.1%}  {h['sass'][:70]:70s} {why}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"ncu-{args.family}-{_slug(args.case)}-{report['date']}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
