"""Prefill and decode cost of the engine: encoder-only vs exact prefill, decode step vs context.

Question: does encoder-only prefill cost about half of exact prefill (report: O(N·L/2 + n_win·L/2)),
and does a decode step stay nearly flat from 4K to 128K (1M) tokens of context? Beside each
measured ratio stands the accounting's FLOP ratio for the same config and lengths, so the gap
between the eager engine and the arithmetic is visible.

    python benchmarks/prefill.py                      # CUDA, small preset, random weights
    python benchmarks/prefill.py --preset tiny --device cpu --prefill 512 1024 --decode 256 1024

Writes benchmarks/results/prefill-<date>.json (device, sizes, both paths, ratios).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import time
from pathlib import Path

import torch

from dsv41 import load_config
from dsv41.accounting import decode_flops, prefill_flops
from dsv41.engine.cache import SequenceCache, private_pools
from dsv41.engine.engine import cast_for_engine
from dsv41.engine.prefill import prefill
from dsv41.engine.runner import Runner
from dsv41.model.transformer import Transformer


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--prefill", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--decode", type=int, nargs="+", default=[4096, 32768, 131072])
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args(argv)
    if min(args.prefill + args.decode) < 1 or args.decode_steps < 1 or args.chunk < 1:
        print("prefill.py: --prefill, --decode, --decode-steps and --chunk take positive numbers", flush=True)
        return 2

    torch.manual_seed(0)
    config = load_config(args.preset)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model = cast_for_engine(Transformer(config).init_weights(seed=0).to(args.device), dtype).eval()
    runner = Runner(model)
    V = config.vocab_size
    gen = torch.Generator().manual_seed(1)

    def prompt(n: int) -> list[int]:
        return torch.randint(3, V, (n,), generator=gen).tolist()

    def fresh(n: int) -> SequenceCache:
        """A lone sequence with pools for n tokens plus the decode steps (a private cache's default pools are
        sized by the preset's max_seq_len, which the lengths here exceed)."""
        return SequenceCache(config, pools=private_pools(config, args.device, max_tokens=n + args.decode_steps + 8))

    prefill(runner, fresh(512), prompt(512), chunk=args.chunk)  # warm-up
    prefill(runner, fresh(512), prompt(512), chunk=args.chunk, exact=True)

    rows = []
    for n in args.prefill:
        ids = prompt(n)
        fast = timed(lambda: prefill(runner, fresh(n), ids, chunk=args.chunk), args.device)
        exact = timed(lambda: prefill(runner, fresh(n), ids, chunk=args.chunk, exact=True), args.device)
        flops = prefill_flops(config, n)
        rows.append(dict(tokens=n, encoder_only_s=fast, exact_s=exact, measured_ratio=fast / exact,
                         flop_ratio=flops["encoder_only_per_token"] / flops["exact_per_token"]))
        print(f"prefill {n:>7} tok: encoder-only {fast:7.2f} s  exact {exact:7.2f} s  ratio {fast / exact:.3f}"
              f"  (FLOP ratio {rows[-1]['flop_ratio']:.3f})", flush=True)

    decode_rows = []
    for n in args.decode:
        seq = fresh(n)
        try:
            build = timed(lambda: prefill(runner, seq, prompt(n), chunk=args.chunk), args.device)
            step_times = []
            for _ in range(args.decode_steps):
                tok = torch.randint(3, V, (1, 1), generator=gen).to(args.device)
                start = torch.tensor([seq.n_tokens], device=args.device)

                def one() -> None:
                    runner.logits(*runner.forward([seq], tok, start, range(config.n_layers)))

                step_times.append(timed(one, args.device))
                seq.tokens.append(int(tok))
        except torch.OutOfMemoryError:
            print(f"decode at {n}: out of memory, skipped", flush=True)
            break
        step = sorted(step_times)[len(step_times) // 2]
        decode_rows.append(dict(context=n, step_ms=step * 1e3, prefill_s=build,
                                flops=decode_flops(config, n)["total"],
                                kv_bytes=seq.global_kv_bytes(), bytes_per_token=seq.bytes_per_token()))
        print(f"decode at {n:>8}: {step * 1e3:8.2f} ms/step  ({decode_rows[-1]['flops'] / 1e9:.3f} GFLOP/token)",
              flush=True)
    base = decode_rows[0] if decode_rows else None
    for r in decode_rows:
        r["measured_vs_first"] = r["step_ms"] / base["step_ms"]
        r["flops_vs_first"] = r["flops"] / base["flops"]

    result = dict(
        benchmark="prefill", date=dt.date.today().isoformat(), preset=args.preset, dtype=args.dtype,
        device=torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu",
        torch=torch.__version__, chunk=args.chunk, prefill=rows, decode=decode_rows,
        targets=dict(prefill_ratio_max=0.55, decode_growth_max=1.3),
        note="one prompt at a time, no CUDA graphs (the engine graphs decode steps; peer_decode.py compares with the"
             " dense peer); random weights",
    )
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"prefill-{result['date']}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
