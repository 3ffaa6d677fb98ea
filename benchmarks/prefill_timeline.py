"""Where one prompt's `StaticPrefill` wall time goes beyond its graphs' device time (issue 15's 8K ratio).

    python benchmarks/prefill_timeline.py                 # 8K, `small`, on the GPU box
    python benchmarks/prefill_timeline.py --device cpu --preset tiny --tokens 512   # a smoke run (no graphs)

Encoder-only and exact prefill of one prompt, as `peer_decode.py --static-prefill` runs them: the fastest of
--repeats synced runs of each, with host marks (ms from the run's start) around the sequence's creation, each
`fill_batch`, each piece's graph launch (`StaticPrefill._run`) and the logits; then one run of each under
`torch.profiler`: when the first and last kernels ran, when the host was done, the host's launch / copy / sync calls
and the largest gaps between kernels. Writes benchmarks/results/prefill_timeline-<date>.json on CUDA (or --out).
The marks wrap the engine's functions from outside (this script's own instances and class), nothing in src changes.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_file import write_result  # noqa: E402

from dsv41 import load_config  # noqa: E402
from dsv41.engine.cache import SequenceCache, private_pools  # noqa: E402
from dsv41.engine.engine import cast_for_engine, layout_for_graphs  # noqa: E402
from dsv41.engine.runner import DecodeIO, Runner  # noqa: E402
from dsv41.engine.static_prefill import StaticPrefill  # noqa: E402
from dsv41.model.transformer import Transformer  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class Marks:
    """Host time stamps of one run; `wrap(obj, name, label)` marks the start and end of obj.name's calls."""

    def __init__(self):
        self.items: list[tuple[str, float]] = []

    def mark(self, name: str) -> None:
        self.items.append((name, time.perf_counter()))

    def wrap(self, obj, name: str, label) -> None:
        inner = getattr(obj, name)

        def marked(*args, **kwargs):
            self.mark(f"{label(args)} start")
            out = inner(*args, **kwargs)
            self.mark(f"{label(args)} end")
            return out

        setattr(obj, name, marked)


def profile_run(run, device: str) -> dict:
    """One run under torch.profiler: kernel span against the host's, its launch / copy / sync calls, largest gaps."""
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        run()
        sync(device)
    kinds = torch.autograd.DeviceType
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    cpu = [e for e in events if e.device_type == kinds.CPU]
    gpu = [e for e in events if e.device_type == kinds.CUDA]
    if not cpu or not gpu:
        return {"kernels": len(gpu)}
    t0 = cpu[0].time_range.start
    calls = [(e.name, e.time_range.start - t0, e.time_range.end - e.time_range.start) for e in cpu
             if any(w in e.name for w in ("GraphLaunch", "Memcpy", "Synchronize"))]
    gaps = sorted(((b.time_range.start - a.time_range.end, a.name[:40], b.name[:40]) for a, b in zip(gpu, gpu[1:])),
                  reverse=True)[:8]
    return {"first_kernel_us": gpu[0].time_range.start - t0, "last_kernel_end_us": gpu[-1].time_range.end - t0,
            "host_end_us": cpu[-1].time_range.end - t0, "kernels": len(gpu), "host_calls_us": calls[:20],
            "largest_gaps_us": gaps}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=16384, help="StaticPrefill's largest piece")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default=None, help=f"results folder (default {RESULTS} on CUDA, none on CPU)")
    args = ap.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("prefill_timeline: no CUDA device (use --device cpu for a smoke run)", file=sys.stderr)
        return 2
    if args.tokens < 1 or args.repeats < 1:
        print("prefill_timeline: --tokens and --repeats must be >= 1", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    c = load_config(args.preset)
    dtype = torch.bfloat16 if cuda else torch.float32
    model = cast_for_engine(Transformer(c).init_weights(seed=0).to(args.device), dtype).eval()
    if cuda:  # the MoE dispatch an Engine with graphs sets, as peer_decode.py's static prefill
        layout_for_graphs(model, 1)
    runner = Runner(model)
    pools = private_pools(c, args.device, max_tokens=args.tokens + 8)
    static = StaticPrefill(runner, pools, chunk=args.chunk)
    ids = torch.randint(3, c.vocab_size, (args.tokens,)).tolist()

    marks = Marks()
    fill = DecodeIO.fill_batch
    try:  # marks around the engine's calls, on this script's instances (fill_batch: the class, restored below)
        marks.wrap(static, "_run", lambda a: f"launch {a[1]}")
        marks.wrap(runner, "logits", lambda a: "logits")

        def fill_marked(io, *a, **k):
            marks.mark(f"fill {io.T} start")
            fill(io, *a, **k)
            marks.mark(f"fill {io.T} end")

        DecodeIO.fill_batch = fill_marked
        report = {"benchmark": "prefill_timeline", "date": dt.date.today().isoformat(), "preset": args.preset,
                  "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                  "tokens": args.tokens, "chunk": static.chunk, "graphs": static.graphs}
        for name, exact in (("encoder_only", False), ("exact", True)):
            def run(exact: bool = exact) -> None:
                marks.mark("sequence")
                seq = SequenceCache(c, pools=pools)
                marks.mark("sequence made")
                static(seq, ids, exact=exact)
                marks.mark("returned")
                seq.release()

            run()  # captures
            run()
            best = None
            for _ in range(args.repeats):
                marks.items.clear()
                sync(args.device)
                t0 = time.perf_counter()
                run()
                sync(args.device)
                wall = time.perf_counter() - t0
                if best is None or wall < best[0]:
                    best = (wall, [(m, (t - t0) * 1e3) for m, t in marks.items])
            report[name] = {"wall_ms": best[0] * 1e3, "marks_ms": best[1], "profile": profile_run(run, args.device)}
            print(name, json.dumps({"wall_ms": best[0] * 1e3, "marks_ms": [(m, round(t, 3)) for m, t in best[1]]}))
    finally:
        DecodeIO.fill_batch = fill
    report["encoder_over_exact"] = report["encoder_only"]["wall_ms"] / report["exact"]["wall_ms"]
    print("encoder_over_exact", round(report["encoder_over_exact"], 4))
    out = args.out or (str(RESULTS) if cuda else None)
    if out:
        print("wrote", write_result(out, "prefill_timeline", report, report["date"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
