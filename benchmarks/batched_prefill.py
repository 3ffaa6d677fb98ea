"""Batched prefill: an evaluation set on the engine with and without `batch_prefill`, in the same run.

Question: the post-training evaluation queues every (problem, effort) request at once (`posttrain.common.
greedy_replies`); how many prefill forwards and engine steps does it take, and how long, when prompts of one
length share a forward (`Engine(batch_prefill=True)`, the default) against one forward per prompt (False)?
Greedy replies, the same requests, the same model; the outputs must be equal (checked).

    python benchmarks/batched_prefill.py                           # CPU, tiny, 150 problems x 4 efforts
    python benchmarks/batched_prefill.py --device cuda --preset small

Writes benchmarks/results/batched_prefill-<date>[-N].json (per mode: prefill forwards, pieces, engine steps,
seconds; the ratios).
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_file import write_result  # noqa: E402

from dsv41.config import resolve_dtype  # noqa: E402
from dsv41.engine.engine import Engine  # noqa: E402
from dsv41.engine.sampling import SamplingParams  # noqa: E402
from dsv41.posttrain.common import engine_copy, load_policy, resolve_device  # noqa: E402
from dsv41.posttrain.tasks import END_TURN_ID, FAMILIES, generate, prompt_ids  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def run(model, prompts: list[list[int]], args, batch_prefill: bool) -> tuple[dict, list[list[int]]]:
    engine = Engine(model, max_batch=args.max_batch, max_seq_len=min(model.config.max_seq_len, 1024),
                    batch_prefill=batch_prefill)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, stop_token_ids=[END_TURN_ID])
    seqs = [engine.add_request(p, params) for p in prompts]
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    while engine.has_work():
        engine.step()
    sync()
    s = engine.stats
    return ({"batch_prefill": batch_prefill, "seconds": time.perf_counter() - t0, "engine_steps": s.steps,
             "prefill_forwards": s.prefill_forwards, "prefill_pieces": s.prefill_pieces},
            [seq.output for seq in seqs])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto")
    ap.add_argument("--preset", default="tiny", help="random weights of a preset")
    ap.add_argument("--problems", type=int, default=150)
    ap.add_argument("--max-tokens", type=int, default=4, help="reply tokens (the prefill is the question)")
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    if args.problems < 1 or args.max_tokens < 1 or args.max_batch < 1:
        print("batched_prefill: --problems, --max-tokens and --max-batch must be >= 1", file=sys.stderr)
        return 2
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    policy, tok = load_policy(None, args.preset, device)
    problems = generate(list(FAMILIES), args.problems, (2, 4), seed=10_000)
    prompts = [prompt_ids(tok, p, b) for b in (25, 50, 75, 100) for p in problems]
    model = engine_copy(policy, dtype)
    run(model, prompts[:8], args, True)  # warm-up (kernels, graphs)
    batched, out_b = run(model, prompts, args, True)
    plain, out_p = run(model, prompts, args, False)
    if out_b != out_p:
        print("batched_prefill: batched and unbatched replies differ", file=sys.stderr)
        return 1
    result = {"benchmark": "batched_prefill", "date": dt.date.today().isoformat(), "preset": args.preset,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "dtype": dtype,
              "torch": torch.__version__, "requests": len(prompts), "max_tokens": args.max_tokens,
              "modes": [batched, plain], "forwards_ratio": plain["prefill_forwards"] / batched["prefill_forwards"],
              "steps_ratio": plain["engine_steps"] / batched["engine_steps"],
              "speedup": plain["seconds"] / batched["seconds"]}
    for m in (batched, plain):
        print(f"batch_prefill={m['batch_prefill']!s:5}: {m['prefill_forwards']:5d} prefill forwards "
              f"({m['prefill_pieces']} pieces), {m['engine_steps']:5d} steps, {m['seconds']:.2f} s")
    print(f"{len(prompts)} requests: {result['speedup']:.1f}x faster batched, same replies")
    write_result(args.out, "batched_prefill", result, result["date"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
