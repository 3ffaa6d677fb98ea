"""Prefix-cache lookup time against the number of stored units (issue 17, acceptance 1).

Question: does a lookup stay flat from 1K to 200K stored units? The store is filled with N units of other
prompts (index rows only, written in one transaction: a lookup reads nothing but the index until it has a hit),
plus one real chain of units (with blobs) that the probe prompt extends. Timed, median of repeats, in the same run:

  * ours: `PrefixCache.resume`'s lookup (`_longest`): hash the prompt's stride marks, one indexed anchor query,
    one primary-key probe, then read the chain (the in-memory tier is off, so the blobs come from disk);
  * the old path as the baseline: `SELECT DISTINCT n_tokens` over the whole index, then `longest_hit` probing
    every length (what issue 17 measured at 30 ms / 20K units and 645 ms / 200K).

    python benchmarks/prefix_lookup.py                        # 1K, 10K, 50K, 200K units
    python benchmarks/prefix_lookup.py --units 1000 20000
Writes benchmarks/results/prefix_lookup-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from dsv41 import load_config
from dsv41.engine.prefix import PrefixCache
from dsv41.engine.prefix_store import (
    PersistentStore,
    anchor_keys,
    anchor_position,
    chain_hashes,
    longest_hit,
)


def fill(store: PersistentStore, n: int, stride: int, rng: np.random.Generator) -> None:
    """n index rows of unrelated prefixes: random keys and anchors, lengths spread over 1..100K tokens."""
    now = store.clock()
    rows = []
    for _ in range(n):
        key = rng.bytes(32).hex()
        n_tokens = int(rng.integers(1, 100_000))
        anchor = rng.bytes(32).hex() if anchor_position(n_tokens, stride) else None
        rows.append((key, n_tokens, 1024, "0" * 64, now, now, "{}", None, anchor))
    with store._lock, store._write_txn():
        store._db.executemany("INSERT INTO units VALUES (?,?,?,?,?,?,?,?,?)", rows)


def real_chain(cache: PrefixCache, tokens: list[int], cuts: list[int]) -> None:
    """Units of `tokens` cut at `cuts`, with blobs, parents and anchors as PrefixCache writes them."""
    parent, done = None, 0
    keys = chain_hashes(tokens, cuts, cache.salt)
    for b, key in zip(cuts, keys):
        mark = anchor_position(b, cache.stride)
        anchor = anchor_keys(tokens, [mark], cache.salt)[0].hex()
        tensors = {"2.kv": torch.randint(0, 256, ((b - done) // 2, 288), dtype=torch.uint8)}
        meta = {"n_tokens": b, "parent": parent, "anchor": anchor, "start": done, "end": b}
        assert cache.store.put(key.hex(), tensors, meta, n_tokens=b)
        parent, done = key.hex(), b


def time_it(fn, repeats: int) -> float:
    fn()  # warm (page cache, statement cache)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--units", type=int, nargs="+", default=[1000, 10_000, 50_000, 200_000])
    p.add_argument("--prompt-tokens", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args()

    config = load_config("tiny")
    rng = np.random.default_rng(0)
    prompt = rng.integers(17, 16000, args.prompt_tokens).tolist()
    cuts = [1024, 2048, 4096, 6000]  # the chain the probe extends; the hit ends at 6000
    rows = []
    for n in sorted(args.units):
        with tempfile.TemporaryDirectory() as root:
            store = PersistentStore(root, capacity_bytes=1 << 40)
            cache = PrefixCache(config, store, identity="benchmark", memory_bytes=0)
            fill(store, n, cache.stride, rng)
            real_chain(cache, prompt, cuts)
            probe = prompt[:-1]
            found = cache._longest(probe, cache.salt)
            assert found is not None and found[0] == cuts[-1], found and found[0]
            ours = time_it(lambda: cache._longest(probe, cache.salt), args.repeats)
            old = time_it(lambda: longest_hit(store, probe, cache.salt, min_tokens=config.window_size),
                          max(3, args.repeats // 4))
            assert longest_hit(store, probe, cache.salt, min_tokens=config.window_size).n_tokens == cuts[-1]
            rows.append({"stored_units": n + len(cuts), "lookup_ms": round(ours * 1e3, 3),
                         "scan_baseline_ms": round(old * 1e3, 3), "speedup": round(old / ours, 1)})
            store.close()
        print(f"{rows[-1]['stored_units']:>8} units: lookup {rows[-1]['lookup_ms']:8.3f} ms   "
              f"scan baseline {rows[-1]['scan_baseline_ms']:9.3f} ms")
    flat = rows[-1]["lookup_ms"] / rows[0]["lookup_ms"]
    result = {
        "benchmark": "prefix_lookup",
        "date": dt.date.today().isoformat(),
        "device": {"cpu": platform.machine(), "cores": os.cpu_count(), "python": platform.python_version(),
                   "torch": torch.__version__},
        "settings": {"prompt_tokens": args.prompt_tokens, "hit_tokens": cuts[-1], "chain_units": len(cuts),
                     "stride": PrefixCache(config, None, identity="x").stride, "repeats": args.repeats,
                     "filler": "index rows of unrelated prefixes, lengths uniform in 1..100K"},
        "results": rows,
        "largest_over_smallest": round(flat, 2),
        "baseline": "SELECT DISTINCT n_tokens + longest_hit over every stored length (the pre-issue-17 lookup)",
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"prefix_lookup-{result['date']}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"lookup at {rows[-1]['stored_units']} / {rows[0]['stored_units']} units: x{flat:.2f}; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
