"""An 8 MB prompt arriving while 16 streams decode (issue 17, acceptance 3).

Question: does one huge prompt freeze the server? The script starts `dsv41 serve` (tiny preset, random weights,
one torch thread) in a subprocess, runs 16 streaming greedy completions back to back and records the arrival
time of every SSE chunk, and polls /health every 50 ms. After a baseline window it posts one completion whose
prompt is 8 MB of text (the body encoded before the window, so the client does no work then) and keeps
measuring until that request has been answered (a 400: the prompt is far over the context, which the server
only knows once it has tokenized it), plus a short tail. Reported: the streams' p50 / p99 gap between chunks
in the baseline window and in the window of the big request, the growth of the p99, and /health's latency
(max and p99) in each window. Target: p99 gap growth <= 100 ms and /health <= 100 ms.

    python benchmarks/serve_tokenize.py
    python benchmarks/serve_tokenize.py --streams 16 --prompt-mb 8 --baseline-s 10
Writes benchmarks/results/serve_tokenize-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing as mp
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from serve_load import free_port, percentile


def poll_health(url: str, stop, out) -> None:
    """In its own process (so the stream readers' threads cannot delay it): /health every 50 ms."""
    samples = []
    with httpx.Client(base_url=url, timeout=60) as client:
        while not stop.is_set():
            t0 = time.perf_counter()  # CLOCK_MONOTONIC: comparable across processes
            ok = client.get("/health").status_code == 200
            samples.append((t0, time.perf_counter() - t0 if ok else float("inf")))
            time.sleep(0.05)
    out.put(samples)


def start_server(port: int, streams: int, extra: list[str] = ()) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "dsv41", "serve", "--preset", "tiny", "--random-init", "--device", "cpu",
           "--threads", "1", "--port", str(port), "--max-batch", str(streams + 2), "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 300
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


class Recorder:
    """Stream chunk arrival times and /health latencies, stamped with time.perf_counter()."""

    def __init__(self, url: str, streams: int, max_tokens: int):
        self.url, self.max_tokens = url, max_tokens
        self.chunks: list[list[float]] = [[] for _ in range(streams)]  # per stream: arrival times (gaps in a stream)
        self.health: list[tuple[float, float]] = []  # (sent at, latency)
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._stream, args=(i,), daemon=True) for i in range(streams)]
        for t in self.threads:
            t.start()
        ctx = mp.get_context("spawn")
        self._health_stop, self._health_out = ctx.Event(), ctx.Queue()
        self._poller = ctx.Process(target=poll_health, args=(url, self._health_stop, self._health_out), daemon=True)
        self._poller.start()

    def _stream(self, i: int) -> None:
        body = {"model": "dsv41-tiny", "prompt": f"Stream {i}: the river ran past the old mill and",
                "max_tokens": self.max_tokens, "temperature": 0, "stream": True}
        with httpx.Client(base_url=self.url, timeout=120) as client:
            while not self.stop.is_set():
                times: list[float] = []
                try:
                    with client.stream("POST", "/v1/completions", json=body) as r:
                        for line in r.iter_lines():
                            if line.startswith("data: {"):
                                times.append(time.perf_counter())
                except httpx.HTTPError as e:
                    self.errors.append(repr(e))
                self.chunks[i].append(times)  # one request's chunk times; gaps never span two requests

    def gaps(self, lo: float, hi: float) -> list[float]:
        """Gaps between consecutive chunks of one request that end inside [lo, hi)."""
        out = []
        for per_stream in self.chunks:
            for times in per_stream:
                out += [b - a for a, b in zip(times, times[1:]) if lo <= b < hi]
        return out

    def health_in(self, lo: float, hi: float) -> list[float]:
        return [lat for t, lat in self.health if lo <= t < hi]

    def close(self) -> None:
        self.stop.set()
        self._health_stop.set()
        self.health = self._health_out.get(timeout=120)
        self._poller.join(30)
        for t in self.threads:
            t.join(120)


def summary(rec: Recorder, lo: float, hi: float) -> dict:
    gaps, health = rec.gaps(lo, hi), rec.health_in(lo, hi)
    return {"seconds": round(hi - lo, 2), "gaps": len(gaps), "gap_p50_ms": round(percentile(gaps, 50) * 1e3, 1),
            "gap_p99_ms": round(percentile(gaps, 99) * 1e3, 1), "gap_max_ms": round(max(gaps, default=0) * 1e3, 1),
            "health_probes": len(health), "health_p99_ms": round(percentile(health, 99) * 1e3, 1),
            "health_max_ms": round(max(health, default=0) * 1e3, 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--prompt-mb", type=float, default=8.0, help="size of the big prompt's text (default 8 MB)")
    p.add_argument("--baseline-s", type=float, default=10.0)
    p.add_argument("--tail-s", type=float, default=2.0, help="measured after the big request was answered")
    p.add_argument("--max-tokens", type=int, default=200, help="tokens per stream request (default 200)")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args()

    n_bytes = int(args.prompt_mb * 1e6)
    sentence = "The quick brown fox jumps over the lazy dog while the miller counts his sacks. "
    text = (sentence * (n_bytes // len(sentence) + 1))[:n_bytes]
    big_body = json.dumps({"model": "dsv41-tiny", "prompt": text, "max_tokens": 1}).encode()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # the default body limit is 8 MiB: room for an 8 MB prompt and its JSON
    server = start_server(port, args.streams, ["--max-body-bytes", str(len(big_body) + 4096)])
    try:
        rec = Recorder(url, args.streams, args.max_tokens)
        time.sleep(3.0)  # every stream running
        t_base = time.perf_counter()
        time.sleep(args.baseline_s)
        t_big = time.perf_counter()
        r = httpx.post(url + "/v1/completions", content=big_body, headers={"content-type": "application/json"},
                       timeout=600)
        t_answer = time.perf_counter()
        time.sleep(args.tail_s)
        t_end = time.perf_counter()
        rec.close()
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
    base, during = summary(rec, t_base, t_big), summary(rec, t_big, t_end)
    growth = during["gap_p99_ms"] - base["gap_p99_ms"]
    result = {
        "benchmark": "serve_tokenize",
        "date": dt.date.today().isoformat(),
        "device": {"cpu": platform.machine(), "cores": os.cpu_count(), "python": platform.python_version(),
                   "load_average": os.getloadavg()},
        "settings": {"streams": args.streams, "prompt_bytes": n_bytes, "body_bytes": len(big_body),
                     "max_tokens": args.max_tokens, "model": "tiny (random weights)", "server_threads": 1},
        "big_request": {"status": r.status_code, "code": r.json().get("error", {}).get("code"),
                        "answered_after_s": round(t_answer - t_big, 2)},
        "baseline_window": base,
        "big_prompt_window": during,
        "gap_p99_growth_ms": round(growth, 1),
        "targets": {"gap_p99_growth_ms": 100, "health_ms": 100},
        "met": growth <= 100 and during["health_max_ms"] <= 100,
        "stream_errors": rec.errors[:5],
    }
    print(f"big request: HTTP {r.status_code} after {t_answer - t_big:.2f} s")
    for name, w in (("baseline", base), ("8 MB prompt", during)):
        print(f"{name:>12}: gap p50 {w['gap_p50_ms']:7.1f} ms  p99 {w['gap_p99_ms']:7.1f} ms  max "
              f"{w['gap_max_ms']:7.1f} ms | /health p99 {w['health_p99_ms']:6.1f} ms  max {w['health_max_ms']:6.1f} ms")
    print(f"p99 gap growth {growth:+.1f} ms (target <= 100); met: {result['met']}")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"serve_tokenize-{result['date']}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
