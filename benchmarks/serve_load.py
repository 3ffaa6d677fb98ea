"""Load on the OpenAI-compatible server: N concurrent streaming clients for T seconds.

Question: under continuous batching, what throughput and time-to-first-token does `dsv41 serve` give, does
anything fail, and does the server's memory stay bounded? The script starts `dsv41 serve` itself on
127.0.0.1 (default: the tiny preset with random weights), warms it up, then runs N clients that each send
streaming completions back to back (prompts of varied length, `stream_options.include_usage`) until T
seconds have passed; in-flight requests finish. Reported: errors, completion tokens/s, p50/p99 TTFT as
the clients saw it, the server's RSS before / max during / after, and the baseline measured in the same
run: the engine's own batched throughput (`Engine.generate` on N prompts in this process, no HTTP).

    python benchmarks/serve_load.py                         # 32 clients, 60 s
    python benchmarks/serve_load.py --clients 8 --duration 20
    python benchmarks/serve_load.py --checkpoint models/dsv41-small --device cuda
Writes benchmarks/results/serve_load-<date>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

WORDS = ("the river ran past the old mill where the miller kept his ledgers and counted sacks of grain each "
         "evening before the lamps were lit along the quiet road to town").split()
RSS_GROWTH_BOUND_MIB = 256  # "bounded": the server's RSS after the run is within this of its RSS before


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompt(i: int) -> str:
    n = 8 + (i * 7) % 40  # 8..47 words
    return " ".join(WORDS[(i + k) % len(WORDS)] for k in range(n))


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def engine_baseline(args) -> dict:
    """Tokens/s of the engine alone: N prompts of the same lengths, batched, max_tokens each (no HTTP)."""
    from dsv41.engine.cli import load_model_and_tokenizer
    from dsv41.engine.engine import Engine

    model, tok = load_model_and_tokenizer(argparse.Namespace(
        checkpoint=args.checkpoint, preset=None if args.checkpoint else args.preset,
        random_init=args.checkpoint is None, tokenizer=None, device=args.device))
    prompts = [tok.encode(prompt(i), add_bos=True) for i in range(args.clients)]
    Engine(model).generate(prompts[:2], max_tokens=2)  # warm-up
    engine = Engine(model, max_batch=args.clients)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, max_tokens=args.max_tokens, stop_token_ids=[tok.eos_id])
    seconds = time.perf_counter() - t0
    tokens = sum(len(o) for o in outs)
    del model, engine
    return {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 2)}


async def client_loop(i: int, http: httpx.AsyncClient, model: str, args, stop_at: float, stats: dict) -> None:
    n = 0
    while time.perf_counter() < stop_at:
        body = {"model": model, "prompt": prompt(i * 1000 + n), "max_tokens": args.max_tokens, "temperature": 0.8,
                "seed": i * 1000 + n, "stream": True, "stream_options": {"include_usage": True}}
        n += 1
        t0 = time.perf_counter()
        first, usage, failed = None, None, False
        try:
            async with http.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    stats["errors"].append(f"HTTP {r.status_code}: {r.text[:200]}")
                    continue
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        failed = True
                        stats["errors"].append(f"stream error: {chunk['error'].get('message')}")
                    elif chunk.get("choices") and first is None:
                        first = time.perf_counter() - t0
                    if chunk.get("usage"):
                        usage = chunk["usage"]
        except (httpx.HTTPError, json.JSONDecodeError) as e:
            stats["errors"].append(f"{type(e).__name__}: {e}")
            continue
        if failed or usage is None:
            if not failed:
                stats["errors"].append("stream ended without usage")
            continue
        stats["ttft"].append(first)
        stats["tokens"] += usage["completion_tokens"]
        stats["requests"] += 1


async def run_load(args, url: str, model: str, pid: int) -> dict:
    stats = {"errors": [], "ttft": [], "tokens": 0, "requests": 0}
    limits = httpx.Limits(max_connections=args.clients + 4, max_keepalive_connections=args.clients + 4)
    rss_max = rss_mib(pid)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(600.0)) as http:
        t0 = time.perf_counter()
        stop_at = t0 + args.duration
        tasks = [asyncio.create_task(client_loop(i, http, model, args, stop_at, stats)) for i in range(args.clients)]
        while not all(t.done() for t in tasks):
            await asyncio.sleep(0.5)
            rss_max = max(rss_max, rss_mib(pid))
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
        server_metrics = (await http.get("/metrics")).text
    return {**stats, "wall_s": wall, "rss_max_mib": rss_max, "metrics_text": server_metrics}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=32, help="concurrent streaming clients (default 32)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load (default 60)")
    p.add_argument("--max-tokens", type=int, default=32, help="max_tokens per request (default 32)")
    p.add_argument("--checkpoint", type=Path, default=None, help="serve a checkpoint instead of tiny random weights")
    p.add_argument("--preset", default="tiny", help="preset with random weights when no --checkpoint (default tiny)")
    p.add_argument("--device", default="cpu", help="device for the server and the baseline (default cpu)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads for the server and the baseline")
    p.add_argument("--no-baseline", action="store_true", help="skip the in-process engine baseline")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args()

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    baseline = None if args.no_baseline else engine_baseline(args)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    source = ["--checkpoint", str(args.checkpoint)] if args.checkpoint else ["--preset", args.preset, "--random-init"]
    cmd = [sys.executable, "-m", "dsv41", "serve", *source, "--host", "127.0.0.1", "--port", str(port),
           "--max-batch", str(args.clients), "--max-queue", str(4 * args.clients), "--device", args.device,
           "--log-level", "warning", *(["--threads", str(args.threads)] if args.threads else [])]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ})
    try:
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None:
                raise SystemExit(f"server exited: {server.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("server did not become healthy in 300 s")
            time.sleep(0.2)
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        for i in range(2):  # warm-up
            httpx.post(url + "/v1/completions", json={"model": model, "prompt": prompt(i), "max_tokens": 4},
                       timeout=120).raise_for_status()
        rss_before = rss_mib(server.pid)
        load = asyncio.run(run_load(args, url, model, server.pid))
        time.sleep(1.0)
        rss_after = rss_mib(server.pid)
    finally:
        server.terminate()
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()

    from dsv41.server.metrics import parse

    server_metrics = parse(load.pop("metrics_text"))
    tokens_per_s = load["tokens"] / load["wall_s"]
    ttft = [x for x in load["ttft"] if x is not None]
    result = {
        "benchmark": "serve_load",
        "date": dt.date.today().isoformat(),
        "device": {"server": args.device, "cpu": platform.machine(), "cores": os.cpu_count(),
                   "python": platform.python_version(), "torch": __import__("torch").__version__},
        "settings": {"clients": args.clients, "duration_s": args.duration, "max_tokens": args.max_tokens,
                     "model": str(args.checkpoint) if args.checkpoint else f"{args.preset} (random weights)",
                     "max_batch": args.clients, "prompt_words": "8..47", "threads": args.threads},
        "results": {
            "requests": load["requests"], "errors": len(load["errors"]), "error_samples": load["errors"][:5],
            "completion_tokens": load["tokens"], "wall_s": round(load["wall_s"], 2),
            "tokens_per_s": round(tokens_per_s, 2),
            "ttft_p50_s": round(percentile(ttft, 50), 4), "ttft_p99_s": round(percentile(ttft, 99), 4),
            "server_ttft_count": server_metrics.get("dsv41_time_to_first_token_seconds_count"),
            "server_5xx": sum(v for k, v in server_metrics.items() if 'status="5' in k),
        },
        "memory": {"rss_before_mib": round(rss_before, 1), "rss_max_mib": round(load["rss_max_mib"], 1),
                   "rss_after_mib": round(rss_after, 1), "growth_mib": round(rss_after - rss_before, 1),
                   "bound_mib": RSS_GROWTH_BOUND_MIB,
                   "bounded": rss_after - rss_before <= RSS_GROWTH_BOUND_MIB},
        "baseline": None if baseline is None else {"what": f"Engine.generate, {args.clients} prompts batched, "
                                                           "same process, no HTTP", **baseline},
        "ratio_served_to_engine": None if baseline is None else round(tokens_per_s / baseline["tokens_per_s"], 3),
    }
    r = result["results"]
    print(f"{'clients':>8} {'seconds':>8} {'requests':>9} {'errors':>7} {'tok/s':>8} {'engine tok/s':>13} "
          f"{'ratio':>6} {'TTFT p50':>9} {'TTFT p99':>9} {'RSS MiB before/max/after':>26}")
    m = result["memory"]
    print(f"{args.clients:>8} {r['wall_s']:>8} {r['requests']:>9} {r['errors']:>7} {r['tokens_per_s']:>8} "
          f"{baseline['tokens_per_s'] if baseline else '-':>13} {result['ratio_served_to_engine'] or '-':>6} "
          f"{r['ttft_p50_s']:>9} {r['ttft_p99_s']:>9} "
          f"{m['rss_before_mib']:>8}/{m['rss_max_mib']}/{m['rss_after_mib']}")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"serve_load-{result['date']}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")
    return 0 if r["errors"] == 0 and m["bounded"] else 1


if __name__ == "__main__":
    sys.exit(main())
