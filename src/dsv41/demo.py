"""`dsv41 demo`: the shipped model, served by the engine, with the prefix store at work (CPU, < 1 min).

What it shows, in order:
  1. three long prompts (public-domain passages from the shipped sample), each prefilled
     encoder-only with Decoder SWA Bounded Replay, then a short greedy continuation;
  2. a follow-up turn on the first conversation: its prefix is found in the persistent store and
     the window snapshot in the SWA pool → exact resume, only the new text is prefilled;
  3. the same follow-up with the SWA pool cleared: a global-KV-only hit → Encoder SWA Bounded
     Replay of n_win cached tokens.
Then a table: prompt / cached / replayed tokens, prefill ms, decode tok/s, KV bytes per token and
bytes persisted. The store lives in the user's cache directory (or --prefix-store DIR), so a second
run finds the first run's prefixes on disk.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from dsv41.config import ConfigError
from dsv41.engine.cli import SHIPPED_MODEL

SAMPLE = Path(__file__).resolve().parents[2] / "data" / "sample"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "demo", help="run the shipped model through the engine and the prefix store (the main job)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  dsv41 demo\n  dsv41 demo --fresh --max-tokens 16\n"
               "  dsv41 demo --checkpoint runs/small/latest --prefix-store /tmp/prefix")
    p.add_argument("--checkpoint", type=Path, default=SHIPPED_MODEL, metavar="DIR",
                   help=f"checkpoint directory (default: the shipped model, {SHIPPED_MODEL.name})")
    p.add_argument("--prefix-store", type=Path, default=None, metavar="DIR",
                   help="persistent prefix store (default: ~/.cache/dsv41/prefix, or $DSV41_CACHE_DIR/prefix)")
    p.add_argument("--fresh", action="store_true", help="empty the demo's prefix store first")
    p.add_argument("--max-tokens", type=int, default=24, help="tokens generated per turn (default 24)")
    p.add_argument("--prompt-tokens", type=int, default=320, help="approximate prompt length (default 320)")
    p.add_argument("--json", action="store_true", help="print the table rows as JSON")
    return p


def _passages(n_tokens: int, tok) -> list[str]:
    """First passages of three different sources in the shipped sample, cut to ~n_tokens each."""
    out = []
    for name in ("austen.jsonl", "sotu.jsonl", "devil.jsonl"):
        path = SAMPLE / name
        if not path.exists():
            continue
        texts: list[str] = []
        with path.open() as f:
            for line in f:  # whole documents until the passage is long enough
                texts.append(json.loads(line)["text"])
                if len(tok.encode("\n\n".join(texts))) >= n_tokens:
                    break
        ids = tok.encode("\n\n".join(texts))[:n_tokens]
        out.append(tok.decode(ids))
    if not out:
        raise ConfigError(f"no sample text found under {SAMPLE}")
    return out


def run(args: argparse.Namespace) -> int:
    import shutil

    import torch

    from dsv41.engine.cli import load_checkpoint_and_tokenizer
    from dsv41.engine.engine import Engine
    from dsv41.engine.prefix import PrefixCache
    from dsv41.engine.prefix_store import InProcessSWAPool, PersistentStore, default_cache_root
    from dsv41.engine.sampling import SamplingParams

    if args.max_tokens < 1 or args.prompt_tokens < 8:
        raise ConfigError("--max-tokens must be >= 1 and --prompt-tokens >= 8")
    t_start = time.perf_counter()
    torch.set_num_threads(max(1, min(4, torch.get_num_threads())))
    model, tok = load_checkpoint_and_tokenizer(args.checkpoint)
    store_dir = args.prefix_store or default_cache_root()
    if args.fresh and store_dir.exists():
        shutil.rmtree(store_dir)
    pool = InProcessSWAPool()
    cache = PrefixCache.for_model(model, tok, PersistentStore(store_dir), pool)  # keyed by these weights
    engine = Engine(model, prefix_cache=cache)
    params = SamplingParams(max_tokens=args.max_tokens, stop_token_ids=[tok.eos_id])
    load_s = time.perf_counter() - t_start

    rows = []

    def turn(label: str, ids: list[int]):
        written = cache.stats.unit_bytes_written
        req = engine.add_request(ids, params)
        while not req.finished:
            engine.step()
        decoded = max(len(req.output) - 1, 0)
        rows.append(dict(turn=label, prompt=len(ids), cached=req.cached_tokens, replayed=req.replayed_tokens,
                         prefill_ms=round(req.prefill_ms, 1),
                         decode_tok_s=round(decoded / req.decode_s, 1) if req.decode_s > 0 else None,
                         kv_bytes_per_token=req.cache.bytes_per_token(),
                         bytes_persisted=cache.stats.unit_bytes_written - written,
                         text=tok.decode(req.output, skip_special=True)))
        return req

    passages = _passages(args.prompt_tokens, tok)
    first = None
    for i, text in enumerate(passages):
        req = turn(f"prompt {i + 1}", tok.encode(text, add_bos=True))
        first = first or req
    follow = tok.encode(" And then, after some reflection, the question was put once more to the whole company:")
    conversation = first.prompt + first.output + follow
    turn("follow-up (pool hit)", conversation)
    pool.clear()
    turn("follow-up (pool cleared)", conversation)
    elapsed = time.perf_counter() - t_start

    if args.json:
        print(json.dumps(dict(rows=rows, load_s=load_s, elapsed_s=elapsed, metrics=engine.metrics()), indent=1))
        return 0
    print(f"dsv41 demo — {args.checkpoint.name}: {model.num_parameters() / 1e6:.1f}M parameters, "
          f"window {model.config.window_size}, prefix store {store_dir}")
    for r in rows:
        print(f"\n[{r['turn']}] …{r['text']!r}")
    header = ("turn", "prompt", "cached", "replayed", "prefill ms", "decode tok/s", "KV B/token", "persisted B")
    table = [header] + [(r["turn"], str(r["prompt"]), str(r["cached"]), str(r["replayed"]), f"{r['prefill_ms']:.0f}",
                         "-" if r["decode_tok_s"] is None else f"{r['decode_tok_s']:.1f}",
                         f"{r['kv_bytes_per_token']:g}", f"{r['bytes_persisted']:,}") for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    print()
    for k, row in enumerate(table):
        print("  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(row, widths))))
        if k == 0:
            print("  ".join("-" * w for w in widths))
    m = engine.metrics()
    print(f"\nprefix store: {m['hits']} hits / {m['lookups']} lookups, {m['exact_resumes']} exact resumes, "
          f"{m['replayed_tokens']} replayed tokens, {m['store']['entries']} units on disk "
          f"({m['store']['bytes']:,} B); model load {load_s:.1f} s, total {elapsed:.1f} s")
    return 0
