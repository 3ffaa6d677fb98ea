"""Persistent prefix cache on a multi-turn agent workload: bytes on disk per cached token, ours vs V4.

Question (SPEC §6): V4.1 persists only global KV (890 B/token) and replays 128 tokens instead of
storing windows; V4 persisted FP8 global KV (≈3514 B/token) plus window snapshots at every prompt
and output end. How do the bytes on disk per cached token compare on an agent-like workload, what
is the hit rate, and how many prefill tokens do hits save?

Workload: S sessions × K turns; each turn appends a user/tool message of random length to the
conversation (previous prompt + previous output) and generates a short answer.

Ours is measured for real: the engine runs a model whose KV geometry equals v41-flash's (512-dim
latent, 128-dim index keys, three m=2 encoder sources and one m=1 decoder source → 890 B/token;
everything else tiny so it runs on a CPU) with a PersistentStore in a temp dir; bytes on disk are
the blob files' sizes. The V4-style policy runs in the same script on the same unit boundaries and
the same prompt/output ends: it writes, to its own PersistentStore, blobs holding that many tokens
of V4-Flash global KV (21 m=4 layers with 68 B index keys, 20 m=128 layers, 584 B entries) plus a
window snapshot of 43 layers × 128 slots × 584 B at each prompt end and output end.

    python benchmarks/prefix_cache.py                 # 20 sessions × 8 turns
    python benchmarks/prefix_cache.py --sessions 4 --turns 4
Writes benchmarks/results/prefix_cache-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from dsv41 import load_config
from dsv41.accounting import V4FlashCache
from dsv41.engine.engine import Engine
from dsv41.engine.prefix import PrefixCache
from dsv41.engine.prefix_store import InProcessSWAPool, PersistentStore, unit_boundaries
from dsv41.engine.sampling import SamplingParams
from dsv41.model.transformer import Transformer


def v41_kv_twin():
    """tiny everywhere except the KV geometry, which equals v41-flash's (890 B/token)."""
    return load_config("tiny").replace(
        head_dim=512, rope_head_dim=64, index_head_dim=128, n_heads=2, o_groups=2, window_size=128,
        compress_ratios=[0, 2, 2, 2, 1, 1, 1, 1], kv_source_layers=[1, 2, 3, 4], index_source_layers=[1, 2, 3, 4, 6],
        engram_layer_ids=[], engram_num_embeddings=[], max_seq_len=8192, qat=True)


def disk_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in (root / "blobs").rglob("*.bin"))


class V4Policy:
    """Writes V4-Flash-sized blobs for the same units and window snapshots as the engine."""

    def __init__(self, root: Path, geometry: V4FlashCache, ratio_lcm: int, interval: int):
        self.store = PersistentStore(root)
        self.g, self.lcm, self.interval = geometry, ratio_lcm, interval
        self.rng = np.random.default_rng(0)
        self.persisted: dict[int, int] = {}  # session → tokens already stored
        self.tokens_stored = 0

    @staticmethod
    def _key(*parts) -> str:
        return hashlib.sha256("/".join(map(str, parts)).encode()).hexdigest()

    def _blob(self, nbytes: int) -> dict[str, torch.Tensor]:
        return {"kv": torch.from_numpy(self.rng.integers(0, 256, nbytes, dtype=np.uint8))}

    def save(self, session: int, n_tokens: int, ends: list[int], key: str) -> None:
        done = self.persisted.get(session, 0)
        for b in unit_boundaries(n_tokens, interval=self.interval, ratio_lcm=self.lcm, ends=ends):
            if b <= done:
                continue
            self.store.put(self._key(key, b), self._blob(round((b - done) * self.g.global_bytes_per_token)),
                           {"n_tokens": b}, n_tokens=b)
            self.tokens_stored += b - done
            done = b
        self.persisted[session] = done
        snapshot = self._blob(self.g.window_snapshot_bytes)
        self.store.put(self._key(key, "swa", n_tokens), snapshot, {"n_tokens": n_tokens})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=20)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--message", type=int, nargs=2, default=[120, 400], help="user/tool message length range")
    ap.add_argument("--output", type=int, default=24, help="tokens generated per turn")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()

    torch.manual_seed(0)
    config = v41_kv_twin()
    model = Transformer(config).init_weights(seed=0).to(args.device).eval()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as ours_dir, tempfile.TemporaryDirectory() as v4_dir:
        cache = PrefixCache(config, PersistentStore(Path(ours_dir)), InProcessSWAPool())
        engine = Engine(model, prefix_cache=cache)
        v4 = V4Policy(Path(v4_dir), V4FlashCache(), cache.lcm, cache.interval)
        prompt_tokens = computed_tokens = 0
        t0 = time.perf_counter()
        for s in tqdm(range(args.sessions), desc="sessions"):
            context: list[int] = []
            for _ in range(args.turns):
                n_msg = int(rng.integers(*args.message))
                context = context + rng.integers(17, config.vocab_size, n_msg).tolist()
                req = engine.add_request(context, SamplingParams(max_tokens=args.output))
                while not req.finished:
                    engine.step()
                prompt_tokens += len(context)
                computed_tokens += len(context) - req.cached_tokens + req.replayed_tokens
                v4.save(s, len(context), [len(context)], f"s{s}")  # prompt end
                context = context + req.output
                v4.save(s, req.cache.n_tokens, [req.cache.n_tokens], f"s{s}")  # output end
        elapsed = time.perf_counter() - t0
        m = engine.metrics()
        ours_disk, v4_disk = disk_bytes(Path(ours_dir)), disk_bytes(Path(v4_dir))
        ours_tokens = m["unit_tokens_written"]
        result = dict(
            benchmark="prefix_cache", date=dt.date.today().isoformat(), sessions=args.sessions, turns=args.turns,
            device=torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
            message_tokens=args.message, output_tokens=args.output, elapsed_s=elapsed,
            ours=dict(disk_bytes=ours_disk, cached_tokens_stored=ours_tokens,
                      bytes_per_cached_token=ours_disk / ours_tokens,
                      payload_bytes_per_token=m["bytes_per_cached_token"]),
            v4_policy=dict(disk_bytes=v4_disk, cached_tokens_stored=v4.tokens_stored,
                           bytes_per_cached_token=v4_disk / v4.tokens_stored),
            ratio_v4_over_ours=(v4_disk / v4.tokens_stored) / (ours_disk / ours_tokens),
            hit_rate=m["hits"] / m["lookups"], exact_resumes=m["exact_resumes"],
            prompt_tokens=prompt_tokens, prefill_tokens_computed=computed_tokens,
            prefill_tokens_saved=prompt_tokens - computed_tokens,
            prefill_saved_fraction=1 - computed_tokens / prompt_tokens,
            replayed_tokens=m["replayed_tokens"], metrics=m, report_ratio="≈ 8 (⅛)",
        )
    print(f"bytes per cached token on disk: ours {result['ours']['bytes_per_cached_token']:.1f}, "
          f"V4-style {result['v4_policy']['bytes_per_cached_token']:.1f} → ratio {result['ratio_v4_over_ours']:.2f}")
    print(f"hit rate {result['hit_rate']:.2%}, prefill tokens saved {result['prefill_saved_fraction']:.1%}")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"prefix_cache-{result['date']}.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
