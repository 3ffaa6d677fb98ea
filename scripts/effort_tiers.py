"""Does the server's `reasoning_effort` change the length of a post-trained model's replies? (issue 21)

    python scripts/effort_tiers.py runs/post/rl                    # H200: the RL checkpoint, 64 held-out problems
    python scripts/effort_tiers.py runs/post/rl --device cpu --problems 4 --max-tokens 16   # a smoke run

Starts the OpenAI-compatible server (`dsv41.server.cli.build_server`, uvicorn on a loopback port) over the
checkpoint, sends each held-out problem of `dsv41 rl`'s evaluation split (same families, digits and seed)
as a chat completion at `reasoning_effort` low / high / max (50 / 75 / 100, SPEC §8) with greedy
sampling, and measures per tier: completion tokens (the server's `usage`), reasoning tokens (the returned
`reasoning_content`, re-tokenized) and accuracy (the answer in `content` against the exact answer). Writes
`--out/effort_tiers.json` (default `benchmarks/results/effort_tiers-<date>.json`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import socket
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
TIERS = {"low": 50, "high": 75, "max": 100}  # the API names (SPEC §8, server/protocol.py)


def start(app):
    """Serve `app` on a free loopback port in a thread: (uvicorn server, base url)."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.05)
    return server, f"http://127.0.0.1:{sock.getsockname()[1]}/v1"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", type=Path, help="a post-trained checkpoint directory (dsv41 sft / rl / opd --out)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--problems", type=int, default=64)
    ap.add_argument("--families", default="add,mul,sort,copy")
    ap.add_argument("--digits", default="2,4")
    ap.add_argument("--seed", type=int, default=0, help="the post-training run's --seed (held-out split)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if not args.checkpoint.is_dir():
        print(f"effort_tiers: checkpoint directory '{args.checkpoint}' not found", file=sys.stderr)
        return 2
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("effort_tiers: no CUDA device (use --device cpu for a smoke run)", file=sys.stderr)
        return 2
    import httpx

    from dsv41.posttrain.common import load_policy
    from dsv41.posttrain.tasks import generate
    from dsv41.server.cli import build_server

    model, tok = load_policy(args.checkpoint, None, torch.device(args.device))
    model.eval()
    lo_hi = [int(d) for d in args.digits.split(",")]
    digits = lo_hi[0] if len(lo_hi) == 1 else (lo_hi[0], lo_hi[1])
    problems = generate(tuple(args.families.split(",")), args.problems, digits, seed=10_000 + args.seed)
    app, scheduler = build_server(model, tok, model_name="dsv41-posttrained", max_batch=64,
                                  kv_budget_bytes=2**30)
    server, base = start(app)
    tiers = {}
    try:
        with httpx.Client(base_url=base, timeout=300) as client:
            for name, b in TIERS.items():
                lengths, reasoning, correct = [], [], []

                def ask(p, name=name) -> dict:
                    r = client.post("/chat/completions", json={
                        "model": "dsv41-posttrained", "messages": [{"role": "user", "content": p.question}],
                        "reasoning_effort": name, "temperature": 0.0, "max_tokens": args.max_tokens})
                    r.raise_for_status()
                    return r.json()

                with ThreadPoolExecutor(len(problems)) as pool:  # concurrent: the engine batches them
                    replies = list(zip(problems, pool.map(ask, problems)))  # a failed request raises here
                for p, body in replies:
                    msg = body["choices"][0]["message"]
                    lengths.append(body["usage"]["completion_tokens"])
                    reasoning.append(len(tok.encode(msg.get("reasoning_content") or "")))
                    answer = msg.get("content")
                    correct.append(answer is not None and " ".join(answer.split()) == p.answer)
                tiers[name] = {"effort": b, "n": len(replies),
                               "completion_tokens_mean": statistics.mean(lengths),
                               "reasoning_tokens_mean": statistics.mean(reasoning),
                               "accuracy": sum(correct) / len(correct)}
                print(f"{name:>6} (b={b:3d}): completion tokens {tiers[name]['completion_tokens_mean']:.1f}, "
                      f"reasoning tokens {tiers[name]['reasoning_tokens_mean']:.1f}, "
                      f"accuracy {tiers[name]['accuracy']:.3f} (n={len(replies)})")
    except httpx.HTTPStatusError as err:
        print(f"effort_tiers: the server answered {err.response.status_code}: {err.response.text}", file=sys.stderr)
        return 1
    finally:
        server.should_exit = True
        scheduler.stop()
    report = {"benchmark": "effort_tiers", "date": dt.date.today().isoformat(), "checkpoint": str(args.checkpoint),
              "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
              "problems": args.problems, "max_tokens": args.max_tokens, "tiers": tiers}
    out = args.out or RESULTS
    out.mkdir(parents=True, exist_ok=True)
    path = out / (f"effort_tiers-{report['date']}.json" if args.out is None else "effort_tiers.json")
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
