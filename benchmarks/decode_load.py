"""Gaps between tokens of running streams while long prompts arrive (chunked prefill under load).

    python benchmarks/decode_load.py                         # H200: 64 streams, four 32K prompts
    python benchmarks/decode_load.py --device cpu --preset tiny --streams 4 --context 256 \\
        --prompts 2 --prompt-len 600 --budgets 64 --steps 5      # a smoke run without a GPU

64 streams decode from synthetic contexts (`engine/synthetic.py`); their gap between tokens is the
engine's step time. First the unloaded gaps (p50), then four long prompts arrive at once and are
prefilled in pieces that ride along with the streams' decode steps, within each step's token
budget: the gaps while they prefill (p50 / p99 / max) against the unloaded p50, and the prompts'
time to first token — for each token budget given. Writes benchmarks/results/decode_load-<date>.json.
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
from dsv41.engine.engine import Engine
from dsv41.engine.sampling import SamplingParams
from dsv41.engine.synthetic import synthetic_running
from dsv41.model.transformer import Transformer

RESULTS = Path(__file__).resolve().parent / "results"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(model, args, budget: int, device: str) -> dict:
    n_ctx = args.context + args.steps * 4 + 4096
    engine = Engine(model, max_batch=args.streams + args.prompts, max_seq_len=max(n_ctx, args.prompt_len + 64),
                    max_tokens=args.streams * n_ctx + args.prompts * (args.prompt_len + 64),
                    prefill_chunk=min(budget, args.chunk), token_budget=budget + args.streams)
    synthetic_running(engine, args.streams, args.context)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def timed_step() -> float:
        t0 = time.perf_counter()
        engine.step()
        sync()
        return time.perf_counter() - t0

    for _ in range(5):
        timed_step()
    unloaded = [timed_step() for _ in range(args.steps)]
    V = model.config.vocab_size
    prompts = [engine.add_request(torch.randint(3, V, (args.prompt_len,)).tolist(), SamplingParams(max_tokens=2))
               for _ in range(args.prompts)]
    t0 = time.perf_counter()
    loaded, first_token = [], {}
    while any(not p.output for p in prompts):
        loaded.append(timed_step())
        for p in prompts:
            if p.output and p.id not in first_token:
                first_token[p.id] = time.perf_counter() - t0
        if len(loaded) > 100000:
            raise RuntimeError("the prompts never finished prefilling")
    p50 = statistics.median(unloaded)
    return {"token_budget": budget, "prefill_chunk": engine.prefill_chunk,
            "unloaded_gap_ms": {"p50": p50 * 1e3, "p99": pct(unloaded, 0.99) * 1e3},
            "loaded_gap_ms": {"p50": statistics.median(loaded) * 1e3, "p99": pct(loaded, 0.99) * 1e3,
                              "max": max(loaded) * 1e3},
            "p99_loaded_over_p50_unloaded": pct(loaded, 0.99) / p50,
            "loaded_steps": len(loaded), "ttft_s": sorted(first_token.values()),
            "prefill_tok_s_while_decoding": args.prompts * args.prompt_len / (time.perf_counter() - t0)}


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
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=60, help="unloaded steps measured")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("decode_load: no CUDA device (use --device cpu for a smoke run)", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    config = load_config(args.preset)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = Transformer(config).init_weights(seed=0).to(device=args.device, dtype=dtype).eval()
    report = {"benchmark": "decode_load", "date": dt.date.today().isoformat(), "preset": args.preset,
              "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
              "streams": args.streams, "context": args.context, "prompts": args.prompts,
              "prompt_len": args.prompt_len, "runs": []}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"decode_load-{report['date']}.json"
    for budget in args.budgets:
        r = run(model, args, budget, args.device)
        report["runs"].append(r)
        path.write_text(json.dumps(report, indent=1))  # after every budget: a run cut short keeps what it measured
        print(json.dumps(r, default=lambda v: round(v, 3)))
    print(f"wrote {path}")
    for r in report["runs"]:
        print(f"budget {r['token_budget']:>6}: unloaded p50 {r['unloaded_gap_ms']['p50']:.2f} ms, loaded p99 "
              f"{r['loaded_gap_ms']['p99']:.2f} ms = {r['p99_loaded_over_p50_unloaded']:.2f}x, TTFT {r['ttft_s']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
