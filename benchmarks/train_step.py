"""Training throughput of the eager model: tokens/s and peak memory of forward + backward + step.

    python benchmarks/train_step.py                    # CUDA, small preset, bf16 autocast
    python benchmarks/train_step.py --preset tiny --device cpu --batch 2 --seq 256

The baseline in the same run is the same model with sparse attention disabled in effect
(index_topk and candidates large enough to select everything) — i.e. what CSA2's selection costs
or saves in the eager path — and the 6·N·tokens FLOP estimate over elapsed time (model FLOP/s).
Writes benchmarks/results/train_step-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import time
from pathlib import Path

import torch

from dsv41 import load_config
from dsv41.accounting import compute
from dsv41.model.transformer import Transformer
from dsv41.optim import build_optimizer


def measure(config, args) -> dict:
    torch.manual_seed(0)
    model = Transformer(config).init_weights(seed=0).to(args.device)
    opt = build_optimizer(model, lr=1e-3)
    B, T = args.batch, args.seq
    V = config.vocab_size
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if args.device.startswith("cuda") else \
        torch.autocast("cpu", enabled=False)

    def step() -> float:
        tokens = torch.randint(3, V, (B, T + 1), device=args.device)
        with autocast:
            losses = model.losses(tokens[:, :-1], tokens[:, 1:])
        losses.total.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(losses.lm)

    for _ in range(args.warmup):
        step()
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    tokens = B * T * args.steps
    active = compute(config)["active_params_decode"]
    return dict(tokens_per_s=tokens / elapsed, step_s=elapsed / args.steps,
                peak_mem_gib=(torch.cuda.max_memory_allocated() / 2**30) if args.device.startswith("cuda") else None,
                model_tflops=6 * active * tokens / elapsed / 1e12, params=model.num_parameters())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    config = load_config(args.preset)
    sparse = measure(config, args)
    print(f"{args.preset} B={args.batch} T={args.seq}: {sparse['tokens_per_s']:.0f} tok/s, "
          f"{sparse['step_s'] * 1e3:.0f} ms/step, peak {sparse['peak_mem_gib']} GiB", flush=True)
    dense_cfg = config.replace(index_topk=args.seq, candidate_source_layer=-1)
    dense = measure(dense_cfg, args)
    print(f"baseline (select-all top-k): {dense['tokens_per_s']:.0f} tok/s", flush=True)
    result = dict(benchmark="train_step", date=dt.date.today().isoformat(), preset=args.preset,
                  device=torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                  torch=torch.__version__, batch=args.batch, seq=args.seq, sparse=sparse, select_all_baseline=dense,
                  ratio=sparse["tokens_per_s"] / dense["tokens_per_s"])
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"train_step-{result['date']}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
