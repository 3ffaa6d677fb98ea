"""The fused sparse training attention kernel vs its torch twin (issue 18): time and memory.

    python benchmarks/train_attention.py                    # the H200: `small` widths, ~2 min
    python benchmarks/train_attention.py --device cpu       # a smoke run (tiny shapes, twin only;
                                                            # TRITON_INTERPRET=1 adds the kernel)

Two parts, each path measured in the same run:
  1. one attention layer at `small` widths (H = 6, D = 128, W = 128, K = 128, N = T / ratio
     entries), bf16, packed documents (every 1/4 of a row a new one): forward alone and forward +
     backward (CUDA events, median of --iters), peak memory above the inputs, at 16 × 1024 and
     1 × 65536 — kernel (`ops.sparse_train_attention`) vs twin (`attend_sparse` on the band and the
     gathered rows);
  2. the whole `small` training step at 16 × 1024 (bf16 autocast, the model's optimizer, random
     tokens, the default `auto` kernel backend) with the attention on the kernel, and on the twin
     (`ops.sparse_train_kernel` answering no: only the attention changes; `DSV41_KERNELS=torch`
     would move every other op to its twin too).
Writes benchmarks/results/train_attention-<date>.json on CUDA (or --out).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from dsv41 import load_config
from dsv41.kernels import ops
from dsv41.model.sparse_attention import attend_sparse, gather_rows, window_band
from dsv41.model.transformer import Transformer
from dsv41.optim import build_optimizer

RESULTS = Path(__file__).resolve().parent / "results"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def layer_inputs(B: int, T: int, H: int, D: int, K: int, ratio: int, device: torch.device, dtype: torch.dtype,
                 seed: int = 0) -> dict:
    """Random bf16 inputs of one layer; top-k picks uniform over each query's complete groups."""
    g = torch.Generator(device=device).manual_seed(seed)
    N = max(1, T // ratio)
    doc = (torch.arange(T, device=device) // max(1, T // 4)).expand(B, T).contiguous()  # 4 documents a row

    def leaf(*shape):
        return torch.randn(*shape, generator=g, device=device).to(dtype).requires_grad_(True)

    t = torch.arange(T, device=device).view(1, T, 1)
    seen = ((t + 1) // ratio).clamp(min=1)  # groups ended by query t (a stand-in for the document's)
    topk = (torch.rand(B, T, K, generator=g, device=device) * seen).long()  # (B, T, K)
    valid = (t + 1) // ratio > topk
    return dict(q=leaf(B, T, H, D), kv=leaf(B, T, D), pool=leaf(B, N, D),
                sink=torch.randn(H, generator=g, device=device).requires_grad_(True),
                doc=doc, topk=topk, valid=valid, scale=D ** -0.5)


def run_layer(path: str, c: dict, window: int) -> torch.Tensor:
    if path == "kernel":
        index = torch.where(c["valid"], c["topk"], -1)
        return ops.sparse_train_attention(c["q"], c["kv"], c["doc"], None, window, c["pool"], index, c["sink"],
                                          c["scale"])[0]
    band = window_band(c["doc"], None, window)
    return attend_sparse(c["q"], c["kv"], band, window, gather_rows(c["pool"], c["topk"]), c["valid"], c["sink"],
                         c["scale"])


def _time(fn, device: torch.device, iters: int) -> float:
    """Median seconds of fn (after one warm-up call)."""
    fn()
    _sync(device)
    out = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return statistics.median(out)


def bench_layer(path: str, c: dict, window: int, device: torch.device, iters: int) -> dict:
    leaves = [c[k] for k in ("q", "kv", "pool", "sink")]
    w = torch.randn_like(c["q"])

    def fwd():
        with torch.no_grad():
            run_layer(path, c, window)

    def fwd_bwd():
        torch.autograd.grad((run_layer(path, c, window) * w).sum(), leaves)

    row = {"forward_ms": _time(fwd, device, iters) * 1e3, "forward_backward_ms": _time(fwd_bwd, device, iters) * 1e3}
    if device.type == "cuda":
        _sync(device)
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fwd_bwd()
        _sync(device)
        row["peak_mib_above_inputs"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    return row


@contextmanager
def attention_on(path: str) -> Iterator[None]:
    """The training attention on the kernel (as dispatched) or on the twin, every other op unchanged."""
    original = ops.sparse_train_kernel
    if path == "twin":
        ops.sparse_train_kernel = lambda *args: False
    try:
        yield
    finally:
        ops.sparse_train_kernel = original


def bench_step(preset: str, B: int, T: int, device: torch.device, path: str, steps: int) -> dict:
    """The whole training step of `preset` with the attention on `path`."""
    config = load_config(preset)
    torch.manual_seed(0)
    model = Transformer(config).init_weights(seed=0).to(device).train()
    opt = build_optimizer(model, lr=1e-4)
    cuda = device.type == "cuda"
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)

    def step():
        tokens = torch.randint(3, config.vocab_size, (B, T + 1), device=device)
        with attention_on(path), autocast:
            loss = model.losses(tokens[:, :-1], tokens[:, 1:], attention="sparse").total
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    for _ in range(2):
        step()
    _sync(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    losses = [step() for _ in range(steps)]
    _sync(device)
    sec = (time.perf_counter() - t0) / steps
    out = {"step_ms": sec * 1e3, "tokens_per_s": B * T / sec, "loss_last": losses[-1]}
    if cuda:
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--steps", type=int, default=6, help="timed training steps per path")
    ap.add_argument("--ratio", type=int, default=1, help="compression ratio of the layer (N = T / ratio)")
    ap.add_argument("--skip-step", action="store_true", help="only the layer benchmark")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        print("train_attention: no CUDA device (use --device cpu for a smoke run)", file=sys.stderr)
        return 2
    interp = ops.HAVE_TRITON and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    paths = ["kernel", "twin"] if cuda or interp else ["twin"]
    H, D, W, K = 6, 128, 128, 128
    shapes = [(16, 1024), (1, 65536)] if cuda else [(1, 160)]
    if not cuda:
        H, D, W, K = 2, 16, 32, 8
    dtype = torch.bfloat16 if cuda else torch.float32
    layer = []
    for B, T in shapes:
        c = layer_inputs(B, T, H, D, K, args.ratio, device, dtype)
        row = {"B": B, "T": T, "H": H, "D": D, "window": W, "topk": K, "entries": c["pool"].size(1)}
        with ops.use_backend("triton" if not cuda else "auto"):
            for path in paths:
                row[path] = bench_layer(path, c, W, device, args.iters)
        if "kernel" in row:
            row["speedup_forward_backward"] = row["twin"]["forward_backward_ms"] / row["kernel"]["forward_backward_ms"]
        print(json.dumps(row))
        layer.append(row)
        del c
        if cuda:
            torch.cuda.empty_cache()
    step = {}
    if not args.skip_step:
        preset, B, T = ("small", 16, 1024) if cuda else ("tiny", 1, 64)
        for name in ("kernel", "twin"):
            if name == "kernel" and not cuda:
                continue  # the interpreter runs a whole model too slowly for a smoke run
            step[name] = bench_step(preset, B, T, device, name, args.steps)
            if cuda:
                torch.cuda.empty_cache()
            print(name, "step", json.dumps(step[name]))
        if "kernel" in step:
            step["tokens_per_s_ratio"] = step["kernel"]["tokens_per_s"] / step["twin"]["tokens_per_s"]
        step.update(preset=preset, batch=B, seq=T)
    report = {"benchmark": "train_attention", "date": dt.date.today().isoformat(),
              "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
              "dtype": str(dtype), "ratio": args.ratio, "layer": layer, "training_step": step}
    out = args.out or (str(RESULTS) if cuda else None)
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        path = Path(out) / f"train_attention-{report['date']}.json"
        path.write_text(json.dumps(report, indent=1))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
