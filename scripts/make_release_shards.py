"""Write synthetic release-format shards (random weights, the release's exact dtypes and shapes).

For running the release's shapes where the real checkpoint is not at hand: a truncated v41-flash
(`--max-layers`, every layer role kept) in `official-fp8` layout, which `load_checkpoint(...,
weights="as-released")` streams onto a GPU. Engram tables at the release's size (98 GB each) do not
fit one GPU's disk beside the rest, so `--engram-vocab-size` shrinks their buckets (default 1M:
~24M rows, 6.3 GB per table; 0 keeps the release's 16M).

    python scripts/make_release_shards.py --out /tmp/v41-6 --max-layers 6              # on the GPU box
    python scripts/make_release_shards.py --out /tmp/tiny --preset tiny --device cpu   # a CPU check

Prints the tensors, bytes and seconds; exit code 2 with one line on bad arguments.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="directory to write (created)")
    ap.add_argument("--preset", default="v41-flash")
    ap.add_argument("--max-layers", type=int, default=None, help="truncate, keeping every layer role")
    ap.add_argument("--engram-vocab-size", type=int, default=1_000_000,
                    help="Engram bucket start, when smaller than the config's (0 = as the config)")
    ap.add_argument("--routed-experts", type=int, default=0, help="routed experts per layer (0 = as the config)")
    ap.add_argument("--shard-gb", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None, help="where to draw the random values (default: cuda if present)")
    args = ap.parse_args(argv)

    import torch

    from dsv41.checkpoint.release_format import stored_bytes
    from dsv41.checkpoint.synthetic import model_tensors, resize_engram, write_synthetic_release
    from dsv41.config import ConfigError, load_config

    try:
        config = load_config(args.preset)
        if args.max_layers is not None:
            config = config.truncated(args.max_layers)
        if args.engram_vocab_size:
            config = resize_engram(config, args.engram_vocab_size)
        if args.routed_experts:
            config = config.replace(n_routed_experts=args.routed_experts)
        if args.shard_gb <= 0:
            raise ConfigError(f"--shard-gb must be positive, got {args.shard_gb}")
    except ConfigError as e:
        print(f"make_release_shards: error: {e}", file=sys.stderr)
        return 2
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    tensors = model_tensors(config)
    size = sum(stored_bytes(n, s) for n, s in tensors)
    print(f"{len(tensors)} tensors, {size / 1e9:.2f} GB in the release's format -> {args.out} (values on {device})")
    t0 = time.perf_counter()
    write_synthetic_release(config, args.out, seed=args.seed, device=device, max_shard_bytes=int(args.shard_gb * 1e9))
    print(f"written in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
