"""Decode throughput with the SWA pool's Redis hung (issue 17, acceptance 5).

Question: does a stalled Redis slow decoding? The script runs the same load against `dsv41 serve` (tiny preset,
random weights, one torch thread, a prefix store) three times: Redis off (the in-process pool), Redis hung
(`--swa-pool redis://…`, the redis-server SIGSTOPped after the warm-up, so connections are accepted and never
answered), and Redis off again (the box is shared: the two off runs bound the noise). The load: C streaming chat
clients sharing a long system prompt (so every prefill hits its cached units and consults the window pool) with
their own question, back to back for T seconds; each prompt end and output end writes a window snapshot.
Reported per run: completion tokens/s, requests, errors, cached and replayed prompt tokens (from /metrics).
Target: hung / off >= 0.9, and the hung run still serves hits through bounded replay.

    python benchmarks/serve_redis.py
    python benchmarks/serve_redis.py --clients 8 --duration 25
Writes benchmarks/results/serve_redis-<date>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from serve_load import free_port

SHARED = ("The harbour master keeps a ledger of every ship that enters the bay, with its name, its cargo, the tide "
          "it came in on and the berth it was given, and each evening he reads the day's entries aloud to the "
          "keeper of the lighthouse, who writes down the ones he wants to remember. ") * 3


def start(cmd: list[str], url: str) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit("server did not become healthy in 300 s")
        time.sleep(0.2)


async def client(i: int, http: httpx.AsyncClient, args, stop_at: float, stats: dict) -> None:
    n = 0
    while time.perf_counter() < stop_at:
        body = {"model": "dsv41-tiny", "messages": [{"role": "system", "content": SHARED},
                                                    {"role": "user", "content": f"Question {i}.{n}: which ship?"}],
                "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        n += 1
        usage = None
        try:
            async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            stats["errors"].append(chunk["error"]["message"])
                        usage = chunk.get("usage") or usage
        except httpx.HTTPError as e:
            stats["errors"].append(repr(e))
            continue
        if usage is None:
            stats["errors"].append("no usage")
            continue
        stats["requests"] += 1
        stats["tokens"] += usage["completion_tokens"]
        stats["cached"] += usage["prompt_tokens_details"]["cached_tokens"] > 0


async def load(url: str, args) -> dict:
    stats = {"requests": 0, "tokens": 0, "cached": 0, "errors": []}
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(300.0)) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(i, http, args, t0 + args.duration, stats) for i in range(args.clients)))
        stats["wall_s"] = time.perf_counter() - t0
        metrics = (await http.get("/metrics")).text
    from dsv41.server.metrics import parse

    m = parse(metrics)
    stats["tokens_per_s"] = round(stats["tokens"] / stats["wall_s"], 2)
    stats["server_cached_tokens"] = m.get("dsv41_prefix_cached_tokens_total")
    stats["server_replayed_tokens"] = m.get("dsv41_prefix_replayed_tokens_total")
    stats["errors"] = stats["errors"][:5] + ([f"... {len(stats['errors'])} in all"] if len(stats["errors"]) > 5 else [])
    return stats


def run(args, name: str, redis_url: str | None, redis_proc: subprocess.Popen | None) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as store:
        cmd = [sys.executable, "-m", "dsv41", "serve", "--preset", "tiny", "--random-init", "--device", "cpu",
               "--threads", "1", "--port", str(port), "--max-batch", str(args.clients), "--prefix-store", store,
               "--log-level", "warning", "--shutdown-timeout", "2"]
        if redis_url:
            cmd += ["--swa-pool", redis_url]
        server = start(cmd, url)
        try:
            for i in range(3):  # warm-up: units and (healthy) window snapshots of the shared prefix exist
                httpx.post(url + "/v1/chat/completions", timeout=300, json={
                    "model": "dsv41-tiny", "max_tokens": 4, "messages": [
                        {"role": "system", "content": SHARED}, {"role": "user", "content": f"Warm-up {i}."}]},
                           ).raise_for_status()
            if redis_proc is not None:
                os.kill(redis_proc.pid, signal.SIGSTOP)
            try:
                stats = asyncio.run(load(url, args))
            finally:
                if redis_proc is not None:
                    os.kill(redis_proc.pid, signal.SIGCONT)
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
    log = server.stderr.read().decode(errors="replace")
    stats["server_logged_redis_unreachable"] = "unreachable" in log  # the breaker opened (hung run)
    print(f"{name:>12}: {stats['tokens_per_s']:8.2f} tok/s  {stats['requests']:4d} requests  "
          f"{len(stats['errors'])} errors  cached {stats['server_cached_tokens']}  replayed "
          f"{stats['server_replayed_tokens']}")
    return {"name": name, **stats}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--duration", type=float, default=25.0)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args()
    if shutil.which("redis-server") is None:
        raise SystemExit("redis-server is not installed (apt-get install redis-server)")
    rport = free_port()
    redis_proc = subprocess.Popen(["redis-server", "--port", str(rport), "--bind", "127.0.0.1", "--save", "",
                                   "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        runs = [run(args, "redis off", None, None),
                run(args, "redis hung", f"redis://127.0.0.1:{rport}/0", redis_proc),
                run(args, "redis off 2", None, None)]
    finally:
        redis_proc.terminate()
        redis_proc.wait(10)
    off = (runs[0]["tokens_per_s"] + runs[2]["tokens_per_s"]) / 2
    ratio = runs[1]["tokens_per_s"] / off
    result = {
        "benchmark": "serve_redis",
        "date": dt.date.today().isoformat(),
        "device": {"cpu": platform.machine(), "cores": os.cpu_count(), "python": platform.python_version(),
                   "load_average": os.getloadavg()},
        "settings": {"clients": args.clients, "duration_s": args.duration, "max_tokens": args.max_tokens,
                     "model": "tiny (random weights)", "server_threads": 1,
                     "hung": "redis-server SIGSTOPped after the warm-up, SIGCONTed after the run"},
        "runs": runs,
        "baseline_tokens_per_s": round(off, 2),
        "ratio_hung_to_off": round(ratio, 3),
        "target_ratio": 0.9,
        "met": ratio >= 0.9 and not runs[1]["errors"] and (runs[1]["server_replayed_tokens"] or 0) > 0
        and runs[1]["server_logged_redis_unreachable"],
    }
    print(f"hung / off = {ratio:.3f} (target >= 0.9); met: {result['met']}")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"serve_redis-{result['date']}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
