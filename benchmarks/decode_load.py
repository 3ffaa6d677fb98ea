"""Gaps between tokens of running streams while long prompts arrive (chunked prefill under load).

    python benchmarks/decode_load.py                         # H200: 64 streams, four 32K prompts
    python benchmarks/decode_load.py --device cpu --preset tiny --streams 4 --context 256 \\
        --prompts 2 --prompt-len 600 --budgets 64 --layers 2 --steps 5      # a smoke run without a GPU

64 streams decode from synthetic contexts (`engine/synthetic.py`); their gap between tokens is the time
between the engine steps that hand them their tokens, as a client sees it (`--gaps emitted`, no device sync
added, so the overlapped step keeps its overlap; `--gaps synced` times each step up to a device sync, the
measure of the runs before 2026-12-04). First the unloaded gaps (p50), then one prompt of the same length is prefilled
beside the streams and decodes its tokens, then is freed (warm-up: every prefill kernel compiled for
the shapes, the decode graph of the larger batch and entry bound captured), then four long prompts
arrive at once and are prefilled in pieces that ride along with the streams' decode steps, within
each step's token budget and layer budget (`Engine(prefill_layers=)`: layer passes per step): the
gaps while they prefill (p50 / p99 / max) against the unloaded p50, the prompts' time to first token,
the number of steps, and the largest prefill piece (its time on the device, from CUDA events: what it
adds to its step), the pieces' host time (`piece_host_ms`) and the engine's host phases per loaded step
(`host_phase_ms_per_step`: schedule, launch, sample, emit, ...) — for each token budget × layers per step given.
Writes benchmarks/results/decode_load-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from dsv41 import load_config
from dsv41.engine.engine import Engine, cast_for_engine
from dsv41.engine.prefill import PrefillJob
from dsv41.engine.sampling import SamplingParams
from dsv41.engine.synthetic import synthetic_running
from dsv41.model.transformer import Transformer

RESULTS = Path(__file__).resolve().parent / "results"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class CompileLog:
    """Every Triton compile while active (`JITFunction._do_compile` wrapped, the in-memory cache's misses):
    (kernel, seconds). A compile inside a live step stalls every stream; `compiles` after the engine's warm-up
    should be few (2026-12-06, H100: 12, 4.5 s in all). Records nothing where Triton is not installed."""

    def __init__(self):
        self.compiles: list[tuple[str, float]] = []
        self._jit = None

    def __enter__(self) -> CompileLog:
        try:
            from triton.runtime import jit
        except ImportError:
            return self
        self._jit, original, compiles = jit, jit.JITFunction._do_compile, self.compiles
        self._original = original

        def logged(fn, *args, **kwargs):
            t0 = time.perf_counter()
            out = original(fn, *args, **kwargs)
            compiles.append((fn.fn.__name__, time.perf_counter() - t0))
            return out

        jit.JITFunction._do_compile = logged
        return self

    def __exit__(self, *exc) -> None:
        if self._jit is not None:
            self._jit.JITFunction._do_compile = self._original

    def summary(self) -> dict:
        return {"count": len(self.compiles), "seconds": sum(s for _, s in self.compiles),
                "kernels": [{"kernel": k, "s": round(s, 3)} for k, s in self.compiles]}


class PieceTimer:
    """Times every `PrefillJob.step` (one piece) without adding a host sync: CUDA events around it,
    read once the device is past them (the host clock on the CPU). `pieces` = (ms, tokens, layers, kind);
    `step` = the engine step the pieces being recorded belong to (set by the caller)."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")
        self.pending: list[tuple] = []
        self.pieces: list[tuple[float, int, int, str]] = []
        self.by_step: dict[int, list[tuple[float, int, int, str]]] = {}
        self.host_ms: list[float] = []  # each piece's host time (its launches and bookkeeping), in order
        self.step = 0
        self.step_fn = PrefillJob.step

    def __enter__(self) -> PieceTimer:
        timer, step = self, self.step_fn

        def timed(job, n=None, layers=None):
            kind = job.run.kind if job.run is not None else "decoder" if job.decoder_pending else \
                "exact" if job.exact else "replayed" if job.cursor < job.start0 else "encoder"
            tokens = job.run.hi - job.run.lo if job.run is not None else n or 0
            t0 = time.perf_counter()
            if timer.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                out = step(job, n, layers)
                b.record()
            else:
                a, out, b = t0, step(job, n, layers), time.perf_counter()
            timer.host_ms.append((time.perf_counter() - t0) * 1e3)
            timer.pending.append((a, b, tokens, layers, kind, timer.step))
            return out

        PrefillJob.step = timed
        return self

    def __exit__(self, *exc) -> None:
        PrefillJob.step = self.step_fn

    def collect(self) -> None:
        """Read the pieces recorded so far (call after a device sync)."""
        for a, b, t, k, kind, step in self.pending:
            piece = ((b - a) * 1e3 if not self.cuda else a.elapsed_time(b), t, k, kind)
            self.pieces.append(piece)
            self.by_step.setdefault(step, []).append(piece)
        self.pending.clear()


def run(model, args, budget: int, layers: int | None, device: str) -> dict:
    n_ctx = args.context + args.steps * 4 + 4096
    engine = Engine(model, max_batch=args.streams + args.prompts, max_seq_len=max(n_ctx, args.prompt_len + 64),
                    max_tokens=args.streams * n_ctx + args.prompts * (args.prompt_len + 64),
                    prefill_chunk=min(budget, args.chunk), token_budget=budget + args.streams, prefill_layers=layers)
    engine.warm_up()  # every prefill piece shape compiled (1-token and odd pieces too) before the streams start
    with CompileLog() as compiles:  # what still compiles live (the synthetic fill included)
        return _measure(engine, args, budget, layers, device) | {"compiles_after_warm_up": compiles.summary()}


def _measure(engine, args, budget: int, layers: int | None, device: str) -> dict:
    streams = {s.id for s in synthetic_running(engine, args.streams, args.context)}
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    V = engine.config.vocab_size
    last = [time.perf_counter()]

    def timed_step() -> float | None:
        """One engine step; the gap since the streams' previous tokens when this step emitted theirs
        (`--gaps emitted`, what a client sees: no device sync added, the overlapped step keeps its
        overlap), or the step's time up to a device sync (`--gaps synced`, earlier runs' measure)."""
        if args.gaps == "synced":
            t0 = time.perf_counter()
            engine.step()
            sync()
            return time.perf_counter() - t0
        outputs = engine.step()
        now = time.perf_counter()
        if not any(o.request.id in streams for o in outputs):
            return None
        gap, last[0] = now - last[0], now
        return gap

    for _ in range(5):
        timed_step()
    unloaded = [g for g in (timed_step() for _ in range(args.steps)) if g is not None]
    # warm-up: one prompt of the same shapes through prefill and its decode, then freed
    t_warm = time.perf_counter()
    warm = engine.add_request(torch.randint(3, V, (args.prompt_len,)).tolist(), SamplingParams(max_tokens=2))
    while not warm.finished:
        timed_step()
    warm_s = time.perf_counter() - t_warm
    prompts = [engine.add_request(torch.randint(3, V, (args.prompt_len,)).tolist(), SamplingParams(max_tokens=2))
               for _ in range(args.prompts)]
    t0 = time.perf_counter()
    loaded, first_token, steps = [], {}, []
    engine.stats.host_s.clear()  # the engine's host phases over the loaded steps only
    steps_before = engine.stats.steps
    with PieceTimer(device) as timer:
        while any(not p.output for p in prompts):
            timer.step = len(steps)
            gap = timed_step()
            steps.append({"ms": None if gap is None else gap * 1e3})
            if gap is not None:
                loaded.append(gap)
            if args.gaps == "synced":
                timer.collect()
            for p in prompts:
                if p.output and p.id not in first_token:
                    first_token[p.id] = time.perf_counter() - t0
            if len(loaded) > 200000:
                raise RuntimeError("the prompts never finished prefilling")
    elapsed = time.perf_counter() - t0
    phases = engine.phase_ms(engine.stats.steps - steps_before)
    sync()
    timer.collect()
    for i, step in enumerate(steps):
        step["pieces"] = [(round(ms, 2), t, k, kind) for ms, t, k, kind in timer.by_step.get(i, [])]
    steps = [s for s in steps if s["ms"] is not None]
    p50 = statistics.median(unloaded)
    piece_ms = [ms for ms, *_ in timer.pieces]
    largest = max(timer.pieces, default=(0.0, 0, 0, ""))
    return {"token_budget": budget, "prefill_chunk": engine.prefill_chunk, "prefill_layers": layers,
            "gaps": args.gaps, "overlap": engine.overlap, "overlapped_steps": engine.stats.overlapped_steps,
            "unloaded_gap_ms": {"p50": p50 * 1e3, "p99": pct(unloaded, 0.99) * 1e3},
            "loaded_gap_ms": {"p50": statistics.median(loaded) * 1e3, "p99": pct(loaded, 0.99) * 1e3,
                              "max": max(loaded) * 1e3},
            "p99_loaded_over_p50_unloaded": pct(loaded, 0.99) / p50,
            "loaded_steps": len(loaded), "ttft_s": sorted(first_token.values()),
            "prefill_tok_s_while_decoding": args.prompts * args.prompt_len / elapsed,
            "warmup_s": warm_s,
            "prefill_pieces": len(timer.pieces),
            "piece_ms": {"p50": statistics.median(piece_ms) if piece_ms else 0.0,
                         "p99": pct(piece_ms, 0.99) if piece_ms else 0.0, "max": largest[0]},
            # the pieces' host time (launches + bookkeeping); piece_ms is the span of their kernels on the device
            "piece_host_ms": {"p50": statistics.median(timer.host_ms) if timer.host_ms else 0.0,
                              "p99": pct(timer.host_ms, 0.99) if timer.host_ms else 0.0},
            "host_phase_ms_per_step": {k: round(v, 3) for k, v in phases.items()},
            "largest_piece": {"ms": largest[0], "tokens": largest[1], "layers": largest[2], "kind": largest[3]},
            "max_layer_passes_per_step": max((sum(k or 0 for _, _, k, _ in s["pieces"]) for s in steps), default=0),
            "slowest_steps": sorted(steps, key=lambda s: -s["ms"])[:5]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--context", type=int, default=4096, help="synthetic context of each stream")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=32768)
    ap.add_argument("--budgets", type=int, nargs="+", default=[256, 1024],
                    help="prefill tokens per step beside the decode tokens")
    ap.add_argument("--layers", type=int, nargs="+", default=[1, 2, 4],
                    help="prefill layer passes per step while streams decode (0: no layer bound, whole chunks)")
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=60, help="unloaded steps measured")
    ap.add_argument("--gaps", choices=("emitted", "synced"), default="emitted",
                    help="emitted: time between the steps that hand the streams their tokens, no sync added "
                         "(default); synced: each step timed up to a device sync (the measure before 2026-12-04)")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("decode_load: no CUDA device (use --device cpu for a smoke run)", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    config = load_config(args.preset)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = cast_for_engine(Transformer(config).init_weights(seed=0).to(args.device), dtype).eval()
    report = {"benchmark": "decode_load", "date": dt.date.today().isoformat(), "preset": args.preset,
              "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
              "streams": args.streams, "context": args.context, "prompts": args.prompts,
              "prompt_len": args.prompt_len, "runs": [],
              "note": "prefill in layer pieces (Engine prefill_layers) and a warm-up prefill before measuring"}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"decode_load-{report['date']}.json"
    for i in range(2, 100):  # never overwrite an earlier run of the same day
        if not path.exists():
            break
        path = out / f"decode_load-{report['date']}-{i}.json"
    for budget in args.budgets:
        for layers in args.layers:
            r = run(model, args, budget, layers or None, args.device)
            report["runs"].append(r)
            path.write_text(json.dumps(report, indent=1))  # after every run: a run cut short keeps what it measured
            print(json.dumps({k: v for k, v in r.items() if k != "slowest_steps"}, default=lambda v: round(v, 3)))
    print(f"wrote {path}")
    for r in report["runs"]:
        big = r["largest_piece"]
        print(f"budget {r['token_budget']:>6} layers/step {r['prefill_layers'] or '-':>2}: unloaded p50 "
              f"{r['unloaded_gap_ms']['p50']:.2f} ms, loaded p50 {r['loaded_gap_ms']['p50']:.2f} / p99 "
              f"{r['loaded_gap_ms']['p99']:.2f} / max {r['loaded_gap_ms']['max']:.2f} ms = "
              f"{r['p99_loaded_over_p50_unloaded']:.2f}x p50, {r['loaded_steps']} steps, largest piece "
              f"{big['ms']:.2f} ms ({big['kind']}, {big['tokens']} tok x {big['layers']} layers), "
              f"TTFT {[round(t, 2) for t in r['ttft_s']]} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
