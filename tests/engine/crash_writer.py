"""Crash harness for the persistent prefix store: writers that get SIGKILLed, and a verifier.

`python crash_writer.py serve ROOT` is a small fork server: it imports torch once, then forks a writer per
`start SEED` line on stdin (so a kill round costs milliseconds, not a torch import). A writer puts units whose
content is derived from their key alone and prints `C <key>` (flushed) after each `put` returns True, so the
verifier knows exactly which keys were committed and what bytes they must hold. `run_crash_rounds` drives it:
up to two writers share the root, the older one is SIGKILLed at a random moment, the store is reopened (orphan
cleanup runs while the other writer keeps writing) and every index row and every committed key is checked.
Used by tests/engine/test_prefix_store.py (20 kills) and benchmarks/prefix_crash.py (100 kills).
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from dsv41.engine.prefix_store.persistent import TEMP_FILE_RE, PersistentStore

REPO = Path(__file__).resolve().parents[2]
BIG = 1 << 40  # capacity / ttl large enough that nothing is evicted or expires during a crash run


def key_for(seed: int, i: int) -> str:
    return hashlib.sha256(f"crash-{seed}-{i}".encode()).hexdigest()


def unit_for(key: str) -> tuple[dict[str, torch.Tensor], dict]:
    """Deterministic content of a unit from its key: 1-3 tensors of random sizes and dtypes."""
    g = torch.Generator().manual_seed(int(key[:15], 16))
    tensors = {}
    for j in range(int(torch.randint(1, 4, (1,), generator=g))):
        n = int(torch.randint(1, 24_000, (1,), generator=g))
        t = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        if j == 1 and n % 4 == 0:
            t = t.view(torch.bfloat16).reshape(2, -1)  # a non-byte dtype and a 2-D shape in some units
        tensors[f"layer{j}.kv"] = t
    return tensors, {"n_tokens": int(key[15:20], 16), "key": key}


def units_equal(got: tuple[dict, dict], expected: tuple[dict, dict]) -> bool:
    (gt, gm), (et, em) = got, expected
    return gm == em and gt.keys() == et.keys() and all(
        gt[k].dtype == et[k].dtype and gt[k].shape == et[k].shape
        and torch.equal(gt[k].view(torch.uint8), et[k].view(torch.uint8)) for k in et)


def _say(line: str) -> None:
    """One os.write per line: writers share the pipe, and a line must never be split by another's (print may
    issue the text and the newline as two writes, e.g. under PYTHONUNBUFFERED)."""
    os.write(sys.stdout.fileno(), (line + "\n").encode())


def _writer(root: str, seed: int, pace_s: float = 0.0) -> None:
    torch.set_num_threads(1)
    _say(f"S {seed} {os.getpid()}")
    store = PersistentStore(root, capacity_bytes=BIG, ttl_s=BIG)
    rng, mine = random.Random(seed), []
    for i in range(1_000_000):
        key = key_for(seed, i)
        if store.put(key, *unit_for(key)):
            _say(f"C {key}")
            mine.append(key)
        if mine and rng.random() < 0.25:  # reads refresh last_access: a write transaction that can be killed too
            old = rng.choice(mine)
            got = store.get(old)
            if got is None or not units_equal(got, unit_for(old)):
                _say(f"X {old}")
        time.sleep(rng.uniform(0, 2 * pace_s))  # bounds the units per run, so verification stays cheap


def serve(root: str) -> None:
    _say("READY")
    children: set[int] = set()
    try:
        for line in sys.stdin:
            cmd, *args = line.split()
            if cmd == "start":
                pid = os.fork()
                if pid == 0:
                    code = 1
                    try:
                        _writer(root, int(args[0]), float(args[1]))
                        code = 0
                    finally:
                        sys.stderr.flush()
                        os._exit(code)
                children.add(pid)
            elif cmd == "reap":
                _, status = os.waitpid(int(args[0]), 0)
                children.discard(int(args[0]))
                _say(f"R {args[0]} {status}")
            elif cmd == "quit":
                break
    finally:  # the verifier went away (EOF) or is done: no writer may outlive the server
        for pid in children:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


class _Server:
    """The fork server as seen from the verifier: starts writers, collects their committed keys."""

    def __init__(self, root: Path):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen([sys.executable, __file__, "serve", str(root)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1, env=env)
        self.committed: list[str] = []
        self.mismatches: list[str] = []
        self.pids: dict[int, int] = {}
        self.reaped: set[int] = set()
        self.died: list[int] = []  # writers that exited on their own (an exception) instead of being killed
        self.ready = False
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        self._wait(lambda: self.ready, 120)

    def _read(self) -> None:
        for line in self.proc.stdout:
            parts = line.split()
            with self._cond:
                if parts == ["READY"]:
                    self.ready = True
                elif len(parts) == 3 and parts[0] == "S":
                    self.pids[int(parts[1])] = int(parts[2])
                elif len(parts) == 2 and parts[0] == "C" and len(parts[1]) == 64:
                    self.committed.append(parts[1])
                elif len(parts) == 2 and parts[0] == "X":
                    self.mismatches.append(parts[1])
                elif len(parts) == 3 and parts[0] == "R":
                    self.reaped.add(int(parts[1]))
                    status = int(parts[2])
                    if not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL):
                        self.died.append(int(parts[1]))
                self._cond.notify_all()

    def _wait(self, pred, timeout: float) -> None:
        with self._cond:
            if not self._cond.wait_for(pred, timeout):
                raise TimeoutError("crash_writer server did not answer")

    def _send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def start(self, seed: int, pace_s: float) -> int:
        self._send(f"start {seed} {pace_s}")
        self._wait(lambda: seed in self.pids, 60)
        return self.pids[seed]

    def kill(self, pid: int) -> None:
        os.kill(pid, signal.SIGKILL)
        self._send(f"reap {pid}")  # a zombie still looks alive to the temp-file cleanup
        self._wait(lambda: pid in self.reaped, 60)

    def close(self) -> None:
        try:
            self._send("quit")  # the server kills and reaps the writers still running
            self.proc.wait(timeout=60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


def verify(root: Path, committed: list[str], verified: set[str], full: bool, strict: bool) -> dict[str, int]:
    """Reopen the store; read back every row not in `verified` (all rows when `full`) and compare with the bytes
    its key determines; check every committed key is still indexed. `strict`: no writer is alive, so no temp file
    and no blob without a row may remain after the open. Adds the rows read back intact to `verified`."""
    store = PersistentStore(root, capacity_bytes=BIG, ttl_s=BIG)
    counts = dict(rows_read=0, corrupt_served=0, rows_unreadable=0, committed_checked=0, committed_lost=0,
                  temp_left=0, orphans_left=0)
    try:
        keys = store.keys()
        for key in keys:
            if key in verified and not full:
                continue
            got = store.get(key)
            counts["rows_read"] += 1
            if got is None:
                counts["rows_unreadable"] += 1
            elif not units_equal(got, unit_for(key)):
                counts["corrupt_served"] += 1
            else:
                verified.add(key)
        live = set(keys)
        counts["committed_checked"] = len(committed)
        counts["committed_lost"] = sum(key not in live for key in committed)
        if strict:
            files = [f for f in (root / "blobs").glob("*/*") if f.is_file()]
            counts["temp_left"] = sum(bool(TEMP_FILE_RE.match(f.name)) for f in files)
            counts["orphans_left"] = sum(f.name.removesuffix(".bin") not in live for f in files
                                         if not TEMP_FILE_RE.match(f.name))
        st = store.stats()
        counts["orphans_removed_at_open"], counts["temp_removed_at_open"] = st["orphans_removed"], st["temp_removed"]
    finally:
        store.close()
    return counts


def run_crash_rounds(root: Path, kills: int, seed: int = 0, delay_s: tuple[float, float] = (0.02, 0.3),
                     pace_s: float = 0.005, full_every: int = 5) -> dict:
    """SIGKILL `kills` writers at random moments (two writers overlap, so the store is reopened and cleaned while
    the other one writes), verifying after each kill: new rows every time, all rows every `full_every` kills and
    after the last. Returns summed counts; everything named corrupt/lost/left/died/mismatch must be 0."""
    rng = random.Random(seed)
    server = _Server(root)
    totals: dict[str, int] = {}
    verified: set[str] = set()
    t0 = time.perf_counter()
    try:
        pids = [server.start(seed * 10_000, pace_s)]
        for r in range(kills):
            if r + 1 < kills:
                pids.append(server.start(seed * 10_000 + r + 1, pace_s))
            time.sleep(rng.uniform(*delay_s))
            server.kill(pids.pop(0))
            with server._cond:
                committed = list(server.committed)
            counts = verify(root, committed, verified, full=(r + 1) % full_every == 0 or not pids, strict=not pids)
            for k, v in counts.items():
                totals[k] = totals.get(k, 0) + v
    finally:
        server.close()
    totals.update(kills=kills, committed_total=len(server.committed), writer_mismatches=len(server.mismatches),
                  writers_died=len(server.died), seconds=round(time.perf_counter() - t0, 2))
    return totals


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "serve":
        serve(sys.argv[2])
    elif len(sys.argv) == 3:
        _writer(sys.argv[1], int(sys.argv[2]))  # a single writer, for poking at by hand
    else:
        sys.exit("usage: crash_writer.py serve ROOT | crash_writer.py ROOT SEED")
