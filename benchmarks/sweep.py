"""Sweep a kernel's tuning knobs on one benchmark case and print the fastest settings.

    python benchmarks/sweep.py attention "decode B=64" '{"block_n": [32, 64], "num_splits": [1, 2, 4]}'

Cases come from benchmarks/kernel_cases/<family>.py (those with a `sweep` entry); every point of the
grid (the product of the lists) is timed as a CUDA-graph replay median, so launch overhead is out.
Prints the best settings as JSON lines, fastest first; a setting that fails to compile is reported
and skipped. Use the result to set the launcher's defaults.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from kernels import median_ms  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("family")
    ap.add_argument("case")
    ap.add_argument("grid", help="JSON object: knob → list of values")
    ap.add_argument("--top", type=int, default=8)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/sweep.py needs a CUDA device", file=sys.stderr)
        return 2
    try:
        grid = json.loads(args.grid)
    except json.JSONDecodeError as e:
        print(f"grid is not JSON: {e}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"kernel_cases.{args.family}")
    case = next((c for c in module.cases(torch.device("cuda")) if c["name"] == args.case), None)
    if case is None or "sweep" not in case:
        print(f"no sweepable case {args.case!r} in kernel_cases/{args.family}.py", file=sys.stderr)
        return 2
    results = []
    for values in itertools.product(*grid.values()):
        knobs = dict(zip(grid.keys(), values))
        try:
            ms = median_ms(lambda: case["sweep"](**knobs), warmup_ms=10, rep_ms=60)
        except Exception as e:  # a setting that does not compile or fit
            print(f"skip {json.dumps(knobs)}: {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
            continue
        results.append((ms, knobs))
        print(json.dumps(dict(ms=round(ms, 5), **knobs)), flush=True)  # as it goes: a run cut short keeps these
    results.sort(key=lambda r: r[0])
    unit = "TFLOP/s" if case["unit"] == "flop" else "GB/s"
    scale = 1e9 if case["unit"] == "flop" else 1e6
    print(f"{args.family}/{args.case}: {len(results)} settings, best first")
    for ms, knobs in results[:args.top]:
        print(json.dumps(dict(ms=round(ms, 5), rate=round(case["work"] / ms / scale, 1), unit=unit, **knobs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
