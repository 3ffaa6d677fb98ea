"""Crash safety of the persistent prefix store under SIGKILL, and what its durability costs per unit.

Question (SPEC §6, persistent KV cache): killed at any moment, does the store ever serve a corrupt unit or lose a
unit whose `put` had returned? Writers (tests/engine/crash_writer.py) put units whose bytes follow from their
key, two at a time on one root; the older one is SIGKILLed at a random moment, the store is reopened (cleanup
runs while the other writer keeps going) and every row and every committed key is checked. Every count named
corrupt / unreadable / lost / left / died / mismatch must be 0.

Cost: put and get of one 4096-token v41-flash unit (890 B/token of packed global KV), against the floor measured
in the same run: writing the same bytes to a fresh file + fsync (put) and reading them back (get; also shown with
the SHA-256 every get verifies).

    python benchmarks/prefix_crash.py                 # 100 kills
    python benchmarks/prefix_crash.py --kills 20
Writes benchmarks/results/prefix_crash-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "engine"))
import crash_writer  # noqa: E402

from dsv41.engine.prefix_store import PersistentStore  # noqa: E402

BAD = ("corrupt_served", "rows_unreadable", "committed_lost", "temp_left", "orphans_left", "writer_mismatches",
       "writers_died")


def filesystem_of(path: Path) -> str:
    best = ("?", "")
    with open("/proc/mounts") as f:
        for line in f:
            _, mount, fstype, *_ = line.split()
            if str(path.resolve()).startswith(mount) and len(mount) >= len(best[1]):
                best = (fstype, mount)
    return best[0]


def unit_cost(root: Path, reps: int) -> dict:
    """Median put/get of a 4096-token v41-flash unit vs raw write+fsync / read of the same bytes."""
    g = torch.Generator().manual_seed(0)
    kv = torch.randint(0, 256, (4096 * 890,), dtype=torch.uint8, generator=g)
    store = PersistentStore(root / "store", touch_interval_s=0)
    put, get, floor_w, floor_r, floor_rs = [], [], [], [], []
    raw = kv.numpy().tobytes()
    for i in range(reps):
        key = f"{i:064x}"
        t = time.perf_counter()
        assert store.put(key, {"kv": kv}, {"n_tokens": 4096})
        put.append(time.perf_counter() - t)
        t = time.perf_counter()
        assert store.get(key) is not None
        get.append(time.perf_counter() - t)
        path = root / f"raw{i}.bin"
        t = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        os.write(fd, raw)
        os.fsync(fd)
        os.close(fd)
        floor_w.append(time.perf_counter() - t)
        t = time.perf_counter()
        data = path.read_bytes()
        floor_r.append(time.perf_counter() - t)
        hashlib.sha256(data).digest()  # get also verifies the checksum: its share of the get time
        floor_rs.append(time.perf_counter() - t)
    store.close()
    ms = lambda xs: round(statistics.median(xs) * 1e3, 3)
    return dict(unit_bytes=len(raw), put_ms=ms(put), floor_write_fsync_ms=ms(floor_w),
                put_over_floor=round(ms(put) / ms(floor_w), 2), get_ms=ms(get), floor_read_ms=ms(floor_r),
                get_over_floor=round(ms(get) / ms(floor_r), 2), floor_read_sha256_ms=ms(floor_rs), reps=reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reps", type=int, default=20, help="repetitions of the unit put/get timing")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        counts = crash_writer.run_crash_rounds(root / "crash", kills=args.kills, seed=args.seed)
        cost = unit_cost(root, args.reps)
        fs = filesystem_of(root)
    result = dict(
        benchmark="prefix_crash", date=dt.date.today().isoformat(), kills=args.kills, seed=args.seed,
        device=dict(cpu=platform.processor() or platform.machine(), cores=os.cpu_count(), filesystem=fs,
                    python=platform.python_version(), torch=torch.__version__),
        ok=all(counts[k] == 0 for k in BAD), counts=counts, unit_cost=cost,
    )
    width = max(map(len, counts))
    for k, v in counts.items():
        print(f"{k:<{width}} {v}{'   <-- must be 0' if k in BAD and v else ''}")
    print(f"4096-token unit ({cost['unit_bytes'] / 2**20:.1f} MiB): put {cost['put_ms']} ms "
          f"(write+fsync floor {cost['floor_write_fsync_ms']} ms, x{cost['put_over_floor']}), "
          f"get {cost['get_ms']} ms (read floor {cost['floor_read_ms']} ms, x{cost['get_over_floor']}; "
          f"read + SHA-256 {cost['floor_read_sha256_ms']} ms)")
    print("OK: nothing corrupt served, nothing committed lost" if result["ok"] else "FAILED")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"prefix_crash-{result['date']}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
