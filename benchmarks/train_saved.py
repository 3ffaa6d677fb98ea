"""What one training forward keeps for its backward: saved-activation bytes per token, by the code that saved them.

Question: of a training step's peak memory (issue 18: `small` at 2.7x the dense peer's on the H200), how much is
activations saved for the backward, and which lines of the model save them? Every tensor autograd saves during
one forward (bf16 autocast by default) is counted once per storage through `torch.autograd.graph.saved_tensors_hooks`,
attributed to the innermost dsv41 source line on the stack; parameters are left out. Shapes and dtypes decide
the bytes, so the census is the same on any device for the same code path — except where the device picks
another path: on CUDA the training attention is the fused Triton kernel (no gathered (B, T, W + K, D) rows),
on the CPU the torch twin `attend_sparse` gathers them (reported apart as `attention_gather`). With
`transformers` installed the dense peer of train_peer.py is counted the same way (its `modeling_*` lines).

    python benchmarks/train_saved.py                         # CPU, small, 2 x 512, bf16 autocast
    python benchmarks/train_saved.py --device cuda --batch 16 --seq 1024

Writes benchmarks/results/train_saved-<date>[-N].json (per-site MiB, bytes per token, the top shapes).
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_file import write_result  # noqa: E402

RESULTS = Path(__file__).parent / "results"
GATHER_SITE = "model/sparse_attention.py"  # the CPU twin's gathered rows (the CUDA path does not save them)


def census(run, params: set[int], marker: str) -> tuple[collections.Counter, collections.Counter]:
    """Bytes saved for backward while `run()` executes, by source line containing `marker` (innermost)."""
    by_site: collections.Counter = collections.Counter()
    by_shape: collections.Counter = collections.Counter()
    seen: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr in params or ptr in seen:
            return t
        seen.add(ptr)
        n = t.untyped_storage().nbytes()
        frames = [f for f in traceback.extract_stack(limit=16) if marker in f.filename]
        site = f"{frames[-1].filename.split(marker)[-1]}:{frames[-1].lineno} {frames[-1].name}" if frames else "?"
        by_site[site] += n
        by_shape[f"{site} {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"] += n
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return by_site, by_shape


def _autocast(device: str, dtype: torch.dtype | None):
    if dtype is None:
        return torch.autocast(device.split(":")[0], enabled=False)
    return torch.autocast(device.split(":")[0], dtype=dtype)


def report(by_site, by_shape, tokens: int, top: int) -> dict:
    total = sum(by_site.values())
    gather = sum(n for s, n in by_site.items() if s.startswith(GATHER_SITE) and "attend_sparse" in s)
    return {"saved_mib": total / 2**20, "saved_kib_per_token": total / tokens / 1024,
            "attention_gather_mib": gather / 2**20,
            "saved_kib_per_token_without_gather": (total - gather) / tokens / 1024,
            "sites_mib": {s: n / 2**20 for s, n in by_site.most_common(top)},
            "top_shapes_mib": {s: n / 2**20 for s, n in by_shape.most_common(top)}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="autocast dtype (fp32: none)")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if args.batch < 1 or args.seq < 2:
        print("train_saved: --batch >= 1 and --seq >= 2", file=sys.stderr)
        return 2
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("train_saved: no CUDA device", file=sys.stderr)
        return 2
    from dsv41 import load_config
    from dsv41.model.transformer import Transformer

    dtype = torch.bfloat16 if args.dtype == "bf16" else None
    config = load_config(args.preset)
    torch.manual_seed(0)
    model = Transformer(config).init_weights(seed=0).to(args.device).train()
    tokens = torch.randint(3, config.vocab_size, (args.batch, args.seq + 1), device=args.device)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def ours():
        with _autocast(args.device, dtype):
            model.losses(tokens[:, :-1], tokens[:, 1:], attention="sparse")

    n_tok = args.batch * args.seq
    result = {"benchmark": "train_saved", "date": dt.date.today().isoformat(), "preset": args.preset,
              "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
              "torch": torch.__version__, "batch": args.batch, "seq": args.seq, "autocast": args.dtype,
              "dsv41": report(*census(ours, params, "src/dsv41/"), n_tok, args.top)}
    if not args.no_peer:
        try:
            from peer_decode import peer_config
            from transformers import LlamaForCausalLM
        except ImportError:
            result["peer"] = None
            print("train_saved: transformers is not installed; the peer is skipped")
        else:
            peer = LlamaForCausalLM(peer_config(config, args.seq)).to(args.device).train()
            peer_params = {p.untyped_storage().data_ptr() for p in peer.parameters()}

            def theirs():
                with _autocast(args.device, dtype):
                    peer(input_ids=tokens[:, :-1], labels=tokens[:, :-1])

            result["peer"] = report(*census(theirs, peer_params, "transformers/"), n_tok, args.top)
            result["saved_ratio"] = result["dsv41"]["saved_mib"] / result["peer"]["saved_mib"]
    d = result["dsv41"]
    print(f"dsv41 {args.preset} {args.batch}x{args.seq} ({args.dtype}): {d['saved_mib']:.1f} MiB saved, "
          f"{d['saved_kib_per_token']:.1f} KiB/token ({d['saved_kib_per_token_without_gather']:.1f} without the "
          f"CPU attention gather)")
    for site, mib in list(d["sites_mib"].items())[:12]:
        print(f"  {mib:9.1f} MiB  {site}")
    if result.get("peer"):
        print(f"peer: {result['peer']['saved_kib_per_token']:.1f} KiB/token; ratio {result['saved_ratio']:.2f}")
    write_result(args.out, "train_saved", result, result["date"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
