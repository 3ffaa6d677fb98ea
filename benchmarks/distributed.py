"""Distributed training throughput and capacity: tokens/s per GPU of a layout vs one GPU, and the largest
model that fits with FSDP2 + expert parallelism vs one device.

    # H200 × N (NCCL; NVLink multicast off), `small` with experts scaled to the GPUs:
    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc-per-node 2 benchmarks/distributed.py \\
        --preset small --parallel dp=2,ep=2 --experts 16 --batch 4 --seq 1024 --fit
    # CPU smoke test (gloo, tiny):
    torchrun --standalone --nproc-per-node 2 benchmarks/distributed.py --preset tiny --parallel dp=2 \\
        --batch 1 --seq 64 --steps 2 --warmup 1

Throughput: `steps` timed steps of `micro` micro-batches of (batch, seq) tokens per data-parallel rank,
after `warmup`; the baseline (same config, one device, the same per-rank micro-batches) runs first on
rank 0 while the others wait. Per GPU = layout tokens/s ÷ world size. Both sides compute in `--dtype`
(bf16 on CUDA by default: autocast on one device, FSDP2 bf16 mixed precision for the layout; fp32 master
weights and reductions in both). `--fit` doubles the routed experts until a step runs out of memory, for
one GPU and for the layout (CUDA only). Writes benchmarks/results/distributed-<date>.json on rank 0 —
first with the throughput, again after the fit search (a rank that runs out of memory inside a collective
can stall the others until NCCL's timeout ends the job; the throughput record is already written then).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from dsv41 import load_config
from dsv41.model.transformer import Transformer
from dsv41.optim import build_optimizer


def batches(config, n: int, batch: int, seq: int, device, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        tokens = torch.randint(3, config.vocab_size, (batch, seq + 1), generator=g)
        out.append({"tokens": tokens[:, :-1].to(device), "targets": tokens[:, 1:].to(device),
                    "doc_ids": torch.zeros(batch, seq, dtype=torch.long, device=device),
                    "loss_mask": torch.ones(batch, seq, dtype=torch.bool, device=device)})
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def single_device(config, args, device) -> dict:
    """The baseline: the Trainer's step on one device over the same per-rank micro-batches."""
    model = Transformer(config).init_weights(seed=0).to(device).train()
    opt = build_optimizer(model, 1e-4)
    data = batches(config, args.micro, args.batch, args.seq, device, 0)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bf16")

    def step():
        for b in data:
            with autocast:
                losses = model.losses(b["tokens"], b["targets"], doc_ids=b["doc_ids"], loss_mask=b["loss_mask"])
            (losses.total / len(data)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _time(step, args, device, args.micro * args.batch * args.seq)


def layout(config, args, device, dims) -> dict:
    from dsv41.parallel import Parallelize

    par = Parallelize(Transformer(config).init_weights(seed=0).to(device), dims, lr=1e-4)
    data = batches(config, args.micro, args.batch, args.seq, device, 1 + dims.dp_rank)
    out = _time(lambda: par.train_step(data), args, device, args.micro * args.batch * args.seq * dims.config.dp)
    out["tokens_per_s_per_device"] = out["tokens_per_s"] / dims.config.world_size
    return out


def _time(step, args, device, tokens_per_step: int) -> dict:
    for _ in range(args.warmup):
        step()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    _sync(device)
    elapsed = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    return {"tokens_per_s": tokens_per_step * args.steps / elapsed, "step_s": elapsed / args.steps,
            "peak_mem_gib": peak}


def fits(run) -> bool:
    try:
        run()
        return True
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return False


def scaled(base, experts: int, layers: int):
    n_layers = max(layers, base.n_layers)
    extra = n_layers - base.n_layers  # repeat the last layer's role for added layers
    return base.replace(n_routed_experts=experts, n_layers=n_layers,
                        compress_ratios=list(base.compress_ratios) + [base.compress_ratios[-1]] * extra)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--parallel", default="dp=2", help="layout (dsv41.parallel.parse_parallel)")
    p.add_argument("--experts", type=int, default=0, help="routed experts (0 = the preset's)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--micro", type=int, default=0, help="micro-batches per data rank and step (0 = pp)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                   help="compute dtype of both sides (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--fit", action="store_true", help="also search the largest model that fits (CUDA)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = p.parse_args()

    from dsv41.parallel import ParallelDims, parse_parallel
    from dsv41.parallel.trainer import init_distributed

    device = init_distributed()
    pconfig = parse_parallel(args.parallel)
    args.micro = args.micro or pconfig.n_microbatches
    if "mixed=" in args.parallel:  # the layout names its precision: the baseline follows
        if args.dtype not in (None, pconfig.mixed):
            p.error(f"--dtype {args.dtype} contradicts mixed={pconfig.mixed} in --parallel")
        args.dtype = pconfig.mixed
    args.dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    import dataclasses

    pconfig = dataclasses.replace(pconfig, mixed=args.dtype)  # the layout computes like the baseline
    if pconfig.pp > 1:
        pconfig = dataclasses.replace(pconfig, microbatches=args.micro)
    dims = ParallelDims.build(pconfig, device)
    config = load_config(args.preset)
    if args.experts:
        config = config.replace(n_routed_experts=args.experts)
    rank = dist.get_rank()
    record = {"date": dt.date.today().isoformat(), "device": torch.cuda.get_device_name() if device.type == "cuda"
              else "cpu", "world_size": pconfig.world_size, "parallel": str(pconfig), "preset": args.preset,
              "config": {"n_layers": config.n_layers, "dim": config.dim, "n_routed_experts": config.n_routed_experts,
                         "batch": args.batch, "seq": args.seq, "micro": args.micro, "dtype": args.dtype},
              "torch": torch.__version__, "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE")}
    if rank == 0:
        record["one_device"] = single_device(config, args, device)
    dist.barrier()
    record["layout"] = layout(config, args, device, dims)
    if rank == 0:
        one = record["one_device"]["tokens_per_s"]
        record["speedup_per_device"] = record["layout"]["tokens_per_s_per_device"] / one
    out = Path(args.out) / f"distributed-{record['date']}.json"
    if rank == 0:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=1) + "\n")
        one, lay = record["one_device"], record["layout"]
        print(f"one device   {one['tokens_per_s']:12.0f} tok/s   peak {one['peak_mem_gib']}")
        print(f"{args.parallel:<12} {lay['tokens_per_s']:12.0f} tok/s   {lay['tokens_per_s_per_device']:.0f} per device"
              f" ({record['speedup_per_device']:.2f}x one device)   peak {lay['peak_mem_gib']}\nwrote {out}",
              flush=True)
    if args.fit and device.type == "cuda":
        record["fit"] = fit_search(config, args, device, dims, rank)
        if rank == 0:
            out.write_text(json.dumps(record, indent=1) + "\n")
            print(f"fit: {record['fit']}\nwrote {out}")
    dist.destroy_process_group()


def fit_search(config, args, device, dims, rank: int) -> dict:
    """Largest routed-expert count (doubling), then layer count, whose step fits: one GPU vs the layout."""
    from dsv41.parallel import Parallelize

    found: dict[str, dict] = {}
    for who in ("one_device", "layout"):
        experts, best = config.n_routed_experts, None
        while experts <= 4096:
            c = scaled(config, experts, config.n_layers)
            if who == "one_device":
                ok = fits(lambda: single_device(c, argparse.Namespace(**{**vars(args), "steps": 1, "warmup": 0}),
                                                device)) if rank == 0 else True
                flag = torch.tensor([int(ok)], device=device)
                dist.broadcast(flag, 0)
                ok = bool(flag.item())
            else:
                def run():
                    par = Parallelize(Transformer(c).init_weights(seed=0).to(device), dims, lr=1e-4)
                    par.train_step(batches(c, args.micro, args.batch, args.seq, device, 0))
                local_ok = torch.tensor([int(fits(run))], device=device)
                dist.all_reduce(local_ok, op=dist.ReduceOp.MIN)
                ok = bool(local_ok.item())
            if not ok:
                break
            with torch.device("meta"):  # count without allocating
                n_params = sum(p.numel() for p in Transformer(c).parameters())
            best = {"n_routed_experts": experts, "params": n_params}
            experts *= 2
        found[who] = best or {}
    return found


if __name__ == "__main__":
    main()
