"""Asynchronous vs synchronous RL rollouts on one device: samples per second on long-tailed reply lengths.

Question: with reply lengths drawn from a long-tailed distribution (most short, a few 10× longer — what
reasoning RL sees), how many samples per second does the time-sliced loop train on when prompts are dispatched
at sample level (the report's rule, `rollout.Dispatcher`) against prompt-level dispatch and the synchronous
batch-level baseline (the next batch starts only once the longest sample of the last one ended)? Same model,
same training step (a real forward / backward / optimizer step on every batch), same number of trained groups.
Lengths are scripted (no stop token: sample i runs exactly L_i tokens), so the comparison is about scheduling,
not about what the model writes; accuracy at equal steps is the RL run's business (scripts/posttrain_small.sh).

    python benchmarks/rollouts.py                                   # CUDA, the shipped small model
    python benchmarks/rollouts.py --device cpu --preset tiny --steps 2 --prompts-per-step 2   # CPU smoke

Writes benchmarks/results/rollouts-<date>.json (device, sizes, per mode: samples/s, engine steps, ms per
engine step, mean concurrency, train share; the ratio to the batch baseline measured in the same run) —
rewritten after every mode, so a run cut short keeps the modes it finished. --dtype: as the post-training
commands (auto = bf16 on CUDA: a bf16 rollout engine and bf16-autocast updates). The 2026-12-04 H200 run
(fp32, before batched prefill) did not finish the first mode in 300 s.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import random
import time
from pathlib import Path

import torch

from dsv41.config import resolve_dtype
from dsv41.posttrain.common import autocast, load_policy, optimizer_for, resolve_device
from dsv41.posttrain.grpo import token_logprobs
from dsv41.posttrain.loop import AsyncLoop, LoopConfig
from dsv41.posttrain.rollout import replay_routing, training_batch
from dsv41.posttrain.tasks import FAMILIES, generate


def long_tail(mean: int, alpha: float, cap: int, seed: int):
    """uid → reply length: Pareto(alpha) scaled to the requested mean, clipped to [4, cap] (deterministic per uid)."""
    scale = mean * (alpha - 1) / alpha

    def length(uid: int) -> int:
        u = random.Random(seed * 7919 + uid).random()
        return int(min(cap, max(4, scale / (1 - u) ** (1 / alpha))))
    return length


def train_fn(policy, lr: float, dtype: str = "fp32"):
    """A real RL-sized update per batch: replayed-routing forward, token log-probs, backward, optimizer step."""
    optimizer = optimizer_for(policy, lr, dtype)
    device = next(policy.parameters()).device

    def step(samples, version):
        batch = training_batch(samples, version, max_staleness=1 << 30)
        tokens, targets, mask = batch.tokens.to(device), batch.targets.to(device), batch.mask.to(device)
        with replay_routing(policy, batch.routing, tokens.size(1)), autocast(device, dtype):
            logp = token_logprobs(policy(tokens, attention="sparse"), targets)
        loss = -(logp * mask).sum() / mask.sum().clamp(min=1) * 1e-3  # small: the weights stay sane
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return {"loss": float(loss.detach())}
    return step


def run_mode(mode: str, args, device) -> dict:
    torch.manual_seed(args.seed)
    policy, tok = load_policy(args.checkpoint, args.preset, device, seed=args.seed)
    problems = generate(FAMILIES, 512, 3, seed=args.seed)
    cfg = LoopConfig(steps=args.steps, prompts_per_step=args.prompts_per_step,
                     samples_per_effort=args.samples_per_effort, dispatch=mode, max_in_flight=args.max_in_flight,
                     max_staleness=args.max_staleness,
                     max_offpolicy=args.max_offpolicy, temperature=1.0, seed=args.seed, dtype=args.dtype)
    lengths = long_tail(args.mean_len, args.alpha, args.max_len, args.seed)
    loop = AsyncLoop(policy, tok, problems, cfg, max_tokens_fn=lengths, stop_ids=())
    t0 = time.perf_counter()
    records = loop.run(train_fn(policy, args.lr, args.dtype))
    wall = time.perf_counter() - t0
    loop.close()
    trained = loop.counters["trained_samples"]
    conc = [n for _, n in loop.concurrency]
    train_s = records[-1]["train_s"] if records else 0.0
    return {"mode": mode, "steps": len(records), "trained_samples": trained, "wall_s": round(wall, 3),
            "samples_per_s": trained / wall, "engine_steps": loop.rollouts.steps,
            "ms_per_engine_step": 1e3 * (records[-1]["rollout_s"] if records else 0.0) / max(loop.rollouts.steps, 1),
            "prefill_forwards": loop.engine.stats.prefill_forwards, "prefill_pieces": loop.engine.stats.prefill_pieces,
            "mean_in_flight": sum(conc) / max(len(conc), 1), "train_share": train_s / wall,
            "mean_offpolicy_ratio": sum(r["offpolicy_ratio"] for r in records) / max(len(records), 1),
            "stale_dropped": loop.counters.get("dropped_stale", 0)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                   help="auto (default): bf16 on CUDA (bf16 rollout engine, bf16-autocast updates), fp32 elsewhere")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", type=Path, help="default: models/dsv41-small")
    src.add_argument("--preset", help="random weights of a preset (CPU smoke: tiny)")
    p.add_argument("--modes", default="batch,prompt,sample")
    p.add_argument("--steps", type=int, default=12, help="optimizer steps per mode")
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--samples-per-effort", type=int, default=2, help="× 4 effort levels = the group size")
    p.add_argument("--max-in-flight", type=int, default=128)
    p.add_argument("--mean-len", type=int, default=48)
    p.add_argument("--alpha", type=float, default=1.5, help="Pareto tail index (smaller = longer tail)")
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--max-staleness", type=int, default=4)
    p.add_argument("--max-offpolicy", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args(argv)
    device = resolve_device(args.device)
    args.dtype = resolve_dtype(args.dtype, device)
    if args.preset is not None:  # smoke sizes follow the preset's context
        args.max_len = min(args.max_len, 64)
        args.mean_len = min(args.mean_len, 12)
    results = []
    for mode in args.modes.split(","):
        results.append(run_mode(mode, args, device))
        r = results[-1]
        print(f"{mode}: {r['samples_per_s']:.2f} samples/s, {r['engine_steps']} engine steps "
              f"({r['ms_per_engine_step']:.1f} ms each), {r['wall_s']:.1f} s", flush=True)
        path = write_report(args, device, results)
    print(f"{'mode':>7s} {'samples/s':>10s} {'vs batch':>9s} {'engine steps':>13s} {'in flight':>10s} {'train %':>8s}")
    for r in results:
        print(f"{r['mode']:>7s} {r['samples_per_s']:10.2f} {r['ratio_vs_batch']:9.2f} {r['engine_steps']:13d} "
              f"{r['mean_in_flight']:10.1f} {100 * r['train_share']:7.1f}%")
    print(f"wrote {path}")
    return 0


def write_report(args, device, results: list[dict]) -> Path:
    """The JSON of the modes run so far (ratios to the batch baseline once it has run)."""
    base = next((r for r in results if r["mode"] == "batch"), results[0])
    for r in results:
        r["ratio_vs_batch"] = r["samples_per_s"] / base["samples_per_s"]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    report = {"date": dt.date.today().isoformat(), "device": name, "model": str(args.checkpoint or args.preset
                                                                                 or "models/dsv41-small"),
              "workload": {"mean_len": args.mean_len, "alpha": args.alpha, "max_len": args.max_len,
                           "group_size": 4 * args.samples_per_effort, "prompts_per_step": args.prompts_per_step,
                           "max_in_flight": args.max_in_flight, "steps": args.steps},
              "dtype": args.dtype, "baseline": "batch", "results": results}
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "-smoke" if args.preset else ""
    path = args.out / f"rollouts-{report['date']}{suffix}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    return path


if __name__ == "__main__":
    raise SystemExit(main())
