"""Training speed of dsv41 vs a dense Hugging Face Llama of the same active size, one run (issue 18).

    python benchmarks/train_peer.py                                  # the H200 run
    python benchmarks/train_peer.py --device cpu --preset tiny --steps 2   # a smoke run without a GPU

Both models train on random tokens with the same tokens per step (--batch × --seq), bf16 autocast
on CUDA with fp32 master weights: dsv41 (`small`, sparse training attention, its own Muon /
Sinkhorn / AdamW optimizer, optional per-Block activation checkpointing and torch.compile) and the
peer from `peer_decode.peer_config` (a GQA Llama with about dsv41's active parameters, SDPA
attention, fused AdamW). Reported per model: tokens/s, peak memory, and MFU = 6 · active params ·
tokens/s over the bf16 8192³ matmul rate measured in the same run (attention FLOPs not counted, the
same rule for both). Then dsv41 alone at --contexts (batch 1) for peak memory vs context length:
linear memory means the sparse path never builds a (T, T) tensor. `transformers` missing: the peer
part is skipped with a message. Writes benchmarks/results/train_peer-<date>.json on CUDA (or --out).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_decode import ceilings, count_params, peer_config  # noqa: E402
from results_file import write_result  # noqa: E402

from dsv41 import load_config  # noqa: E402
from dsv41.accounting import compute  # noqa: E402
from dsv41.model.transformer import Transformer  # noqa: E402
from dsv41.optim import build_optimizer  # noqa: E402
from dsv41.optim.muon import ns_dtype_for  # noqa: E402
from dsv41.train.graphs import StepGraph, tensor_lrs  # noqa: E402
from dsv41.train.trainer import apply_block_options  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _autocast(device: str, cache: bool = True):
    return torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=cache) if device.startswith("cuda") else \
        torch.autocast("cpu", enabled=False)


def timed_steps(step, device: str, warmup: int, steps: int) -> tuple[float, float | None]:
    """(seconds per step, peak GiB over the timed steps) of `step()` after `warmup` calls."""
    for _ in range(warmup):
        step()
    _sync(device)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None
    return (time.perf_counter() - t0) / steps, peak


def dsv41_train(config, B: int, T: int, args) -> dict:
    torch.manual_seed(0)
    model = Transformer(config).init_weights(seed=0).to(args.device).train()
    apply_block_options(model, checkpoint=args.checkpoint_activations, compile=args.compile)
    opt = build_optimizer(model, lr=1e-4, ns_dtype=NS_DTYPES[args.ns_dtype] or ns_dtype_for(args.device, "bf16"))
    if args.cuda_graphs:
        tensor_lrs(opt, torch.device(args.device))
    V = config.vocab_size

    def body(tokens: torch.Tensor) -> torch.Tensor:
        with _autocast(args.device, cache=not args.cuda_graphs):
            losses = model.losses(tokens[:, :-1], tokens[:, 1:], attention=args.attention)
        losses.total.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return losses.total.detach()

    graph = StepGraph(body, enabled=args.cuda_graphs, reset=lambda: opt.zero_grad(set_to_none=True))

    def step() -> None:
        graph({"tokens": torch.randint(3, V, (B, T + 1), device=args.device)})

    s, peak = timed_steps(step, args.device, args.warmup, args.steps)
    return {"batch": B, "seq": T, "step_s": s, "tokens_per_s": B * T / s, "peak_gib": peak,
            "active_params": compute(config)["active_params_decode"], "graphed": graph.replays > 0,
            "graph_error": graph.error}


def peer_train(config, B: int, T: int, args) -> dict:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(peer_config(config, T)).to(args.device).train()
    fused = args.device.startswith("cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=fused,
                            capturable=args.cuda_graphs)
    V = config.vocab_size

    def body(tokens: torch.Tensor) -> torch.Tensor:
        with _autocast(args.device, cache=not args.cuda_graphs):
            out = model(input_ids=tokens[:, :-1], labels=tokens[:, :-1])  # HF shifts the labels itself
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss.detach()

    graph = StepGraph(body, enabled=args.cuda_graphs, reset=lambda: opt.zero_grad(set_to_none=True))

    def step() -> None:
        graph({"tokens": torch.randint(3, V, (B, T + 1), device=args.device)})

    s, peak = timed_steps(step, args.device, args.warmup, args.steps)
    # active parameters per token: everything but the input embedding (a lookup)
    active = count_params(model) - model.get_input_embeddings().weight.numel()
    return {"batch": B, "seq": T, "step_s": s, "tokens_per_s": B * T / s, "peak_gib": peak, "active_params": active,
            "graphed": graph.replays > 0, "graph_error": graph.error}


# --ns-dtype: auto = the trainer's rule for a bf16 run (bf16 on CUDA, fp32 on the CPU)
NS_DTYPES = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16}


def mfu(row: dict | None, peak_tflops: float | None) -> None:
    if row and peak_tflops:
        row["model_tflops"] = 6 * row["active_params"] * row["tokens_per_s"] / 1e12
        row["mfu"] = row["model_tflops"] / peak_tflops


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=None, help="rows per step (default 16 on CUDA, 2 on CPU)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per row (default 1024 on CUDA, 128 on CPU)")
    ap.add_argument("--contexts", type=int, nargs="*", default=None,
                    help="dsv41 batch-1 contexts (default 16384 32768 65536 on CUDA, 256 512 on CPU)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3 on CUDA, 1 on CPU)")
    ap.add_argument("--attention", choices=("sparse", "dense"), default="sparse")
    ap.add_argument("--checkpoint-activations", action="store_true", help="dsv41: recompute each Block")
    ap.add_argument("--compile", action="store_true", help="dsv41: torch.compile each Block")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="both models: each step (forward, backward, optimizer) replayed from a CUDA graph after "
                         "warm-up steps (dsv41.train.graphs; the peer with a capturable fused AdamW)")
    ap.add_argument("--ns-dtype", choices=tuple(NS_DTYPES), default="auto",
                    help="dsv41: Muon's Newton-Schulz dtype (auto: bf16 on CUDA, as the trainer for a bf16 run)")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--out", default=None, help=f"results folder (default {RESULTS} on CUDA, none on CPU)")
    args = ap.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if args.cuda_graphs and (not cuda or args.compile):
        print("train_peer: --cuda-graphs needs --device cuda and no --compile", file=sys.stderr)
        return 2
    if cuda and not torch.cuda.is_available():
        print("train_peer: no CUDA device (use --device cpu for a smoke run)", file=sys.stderr)
        return 2
    B = args.batch or (16 if cuda else 2)
    T = args.seq or (1024 if cuda else 128)
    contexts = args.contexts if args.contexts is not None else ([16384, 32768, 65536] if cuda else [256, 512])
    args.warmup = args.warmup if args.warmup is not None else (3 if cuda else 1)
    config = load_config(args.preset)
    report = {"benchmark": "train_peer", "date": dt.date.today().isoformat(), "preset": args.preset,
              "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
              "attention": args.attention, "checkpoint_activations": args.checkpoint_activations,
              "compile": args.compile, "cuda_graphs": args.cuda_graphs, "tokens_per_step": B * T,
              "ceilings": ceilings(args.device),
              "ns_dtype": str(NS_DTYPES[args.ns_dtype] or ns_dtype_for(args.device, "bf16")).removeprefix("torch."),
              "triton_sinkhorn_backward": cuda and os.environ.get("DSV41_TRITON_SINKHORN_BACKWARD", "1") != "0",
              "triton_mhc_backward": cuda and os.environ.get("DSV41_TRITON_MHC_BACKWARD", "1") != "0",
              "errors": []}
    peak_tflops = report["ceilings"].get("bf16_matmul_tflops")

    def attempt(what: str, fn):
        try:
            return fn()
        except Exception as err:  # noqa: BLE001 - a failed cell is reported, the run goes on
            traceback.print_exc()
            report["errors"].append(f"{what}: {type(err).__name__}: {err}"[:500])
            return None
        finally:  # the cell's model and optimizer are gone with its frame
            if cuda:
                torch.cuda.empty_cache()

    report["dsv41"] = attempt(f"dsv41 {B}x{T}", lambda: dsv41_train(config, B, T, args))
    mfu(report["dsv41"], peak_tflops)
    print("dsv41", json.dumps(report["dsv41"]))
    report["peer"] = None
    if args.no_peer:
        print("train_peer: peer skipped (--no-peer)")
    else:
        try:
            import transformers  # noqa: F401
        except ImportError:
            print("train_peer: transformers is not installed; the peer part is skipped")
        else:
            report["peer"] = attempt(f"peer {B}x{T}", lambda: peer_train(config, B, T, args))
            mfu(report["peer"], peak_tflops)
            print("peer", json.dumps(report["peer"]))
    ours, theirs = report["dsv41"], report["peer"]
    if ours and theirs:
        report["tokens_per_s_ratio"] = ours["tokens_per_s"] / theirs["tokens_per_s"]  # acceptance: ≥ 0.5
        if ours["peak_gib"] and theirs["peak_gib"]:
            report["peak_memory_ratio"] = ours["peak_gib"] / theirs["peak_gib"]  # acceptance: ≤ 1.5
    report["long_context"] = []
    for n in contexts:
        row = attempt(f"dsv41 1x{n}", lambda: dsv41_train(config, 1, n, args))
        report["long_context"].append(row or {"batch": 1, "seq": n, "failed": True})
        print("dsv41 long", json.dumps(row))
    out = args.out or (str(RESULTS) if cuda else None)
    if out:
        write_result(out, "train_peer", report, report["date"])
    print_table(report)
    return 0


def print_table(report: dict) -> None:
    def cell(r: dict | None, key: str, fmt: str) -> str:
        return format(r[key], fmt) if r and r.get(key) is not None else "-"

    print(f"{'model':<8} {'B×T':>10} {'tok/s':>10} {'peak GiB':>9} {'MFU':>7}")
    for name in ("dsv41", "peer"):
        r = report.get(name)
        bt = f"{r['batch']}×{r['seq']}" if r else "-"
        print(f"{name:<8} {bt:>10} {cell(r, 'tokens_per_s', '.0f'):>10} {cell(r, 'peak_gib', '.2f'):>9} "
              f"{cell(r, 'mfu', '.3f'):>7}")
    for r in report["long_context"]:
        print(f"{'dsv41':<8} {'1×' + str(r['seq']):>10} {cell(r, 'tokens_per_s', '.0f'):>10} "
              f"{cell(r, 'peak_gib', '.2f'):>9}")
    for k in ("tokens_per_s_ratio", "peak_memory_ratio"):
        if k in report:
            print(f"{k}: {report[k]:.3f}")


if __name__ == "__main__":
    sys.exit(main())
