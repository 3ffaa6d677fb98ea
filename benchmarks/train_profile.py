"""Where a dsv41 training step's time and memory go (issue 18): phases, kernels, host syncs.

    python benchmarks/train_profile.py                          # the H200: small, 16 × 1024, sparse
    python benchmarks/train_profile.py --device cpu --preset tiny --batch 2 --seq 128   # a smoke run

The same step as `train_peer.py` (random tokens, bf16 autocast on CUDA, the model's own optimizer).
After warm-up: each phase timed alone with a device sync around it (forward + losses, backward,
optimizer step), the peak memory after the forward and after the backward, then one step under
`torch.profiler`: GPU-busy time vs wall time, kernel launches, host syncs (`aten::item`,
`aten::_local_scalar_dense`, `cudaStreamSynchronize`, device → host copies), the top kernels by GPU
time and the top host ops by self CPU time; `--by-source` also charges every kernel to the innermost function of
dsv41's code whose forward launched it — the backward's kernels to the function whose forward made the autograd
node (matched by the node's sequence number) — and to the phase (forward / backward / optimizer). Writes
benchmarks/results/train_profile-<date>.json on CUDA (or --out).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from dsv41 import load_config
from dsv41.model.transformer import Transformer
from dsv41.optim import build_optimizer
from dsv41.optim.muon import ns_dtype_for
from dsv41.train.trainer import apply_block_options

RESULTS = Path(__file__).resolve().parent / "results"
SYNC_OPS = ("aten::item", "aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize",
            "Memcpy DtoH")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _peak_gib(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None


def frame_label(stack: list[str]) -> str | None:
    """Where dsv41's code made an op, from its profiler stack (innermost frame first): the innermost dsv41 frame
    and the dsv41 frame that called it — 'model/mhc.py:_hc_project_parts < model/mhc.py:forward' — or None."""
    frames = []
    for frame in stack:
        m = re.search(r"dsv41/(.+?\.py)\(\d+\): (\S+)", frame.replace("\\", "/"))
        if m:
            frames.append(f"{m.group(1)}:{m.group(2)}")
            if len(frames) == 2:
                break
    return " < ".join(frames) if frames else None


def attribute(events, cuda: bool) -> dict[tuple[str, str], list[float]]:
    """{(phase, source): [ms, kernels]} from a step profiled `with_stack=True` (`prof.events()`).

    Cost: on CUDA the kernels each CPU op launched (their device time), on the CPU the op's self CPU time.
    An op's source is the innermost frame of dsv41's code in its (or its nearest ancestor's) Python stack
    (forward). In the backward the autograd node above the op (`autograd::engine::evaluate_function: …`)
    carries the sequence number of the forward op that made it, whose source is the node's (else the op's own
    stack: a custom Function's backward). Ops under `Optimizer.step` are the optimizer's (with their source);
    the rest is '(other)'."""
    by_seq: dict[int, str] = {}

    def owner(ev) -> tuple[str, str]:
        node, label = ev, None
        while node is not None:
            label = label or frame_label(node.stack or [])
            if node.name.startswith("autograd::engine::evaluate_function"):
                return "backward", by_seq.get(node.sequence_nr) or label or "(backward, unmatched)"
            if node.name.startswith("Optimizer.step"):
                return "optimizer", node.name.split("#")[-1] + (f" · {label}" if label else "")
            node = node.cpu_parent
        return ("forward", label) if label else ("other", "(other)")

    cpu_events = [ev for ev in events if ev.device_type == torch.autograd.DeviceType.CPU]
    for ev in cpu_events:  # forward ops that made autograd nodes: sequence number → source
        if ev.sequence_nr >= 0 and not ev.name.startswith("autograd::"):
            phase, label = owner(ev)
            if phase == "forward":
                by_seq.setdefault(ev.sequence_nr, label)
    out: dict[tuple[str, str], list[float]] = {}
    for ev in cpu_events:
        if ev.name.startswith("autograd::engine"):
            continue
        if cuda:
            ms, n = sum(k.duration for k in ev.kernels) / 1e3, len(ev.kernels)  # durations in µs
        else:
            ms, n = ev.self_cpu_time_total / 1e3, 1
        if n:
            row = out.setdefault(owner(ev), [0.0, 0])
            row[0] += ms
            row[1] += n
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--attention", choices=("sparse", "dense"), default="sparse")
    ap.add_argument("--checkpoint-activations", action="store_true")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--top", type=int, default=25, help="rows of the kernel / host-op tables")
    ap.add_argument("--by-source", action="store_true",
                    help="charge each kernel to the dsv41 function (and phase) that launched it (slower)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("train_profile: no CUDA device (use --device cpu for a smoke run)", file=sys.stderr)
        return 2
    config = load_config(args.preset)
    torch.manual_seed(0)
    model = Transformer(config).init_weights(seed=0).to(args.device).train()
    apply_block_options(model, checkpoint=args.checkpoint_activations, compile=args.compile)
    opt = build_optimizer(model, lr=1e-4, ns_dtype=ns_dtype_for(args.device, "bf16"))  # bf16 autocast on CUDA
    B, T, V = args.batch, args.seq, config.vocab_size
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)

    def forward():
        tokens = torch.randint(3, V, (B, T + 1), device=args.device)
        with autocast:
            return model.losses(tokens[:, :-1], tokens[:, 1:], attention=args.attention).total

    def step() -> None:
        forward().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    _sync(args.device)
    # phases, each alone between syncs (so host time that overlaps the GPU is not hidden)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    loss = forward()
    _sync(args.device)
    t1 = time.perf_counter()
    peak_forward = _peak_gib(args.device)
    loss.backward()
    _sync(args.device)
    t2 = time.perf_counter()
    peak_backward = _peak_gib(args.device)
    opt.step()
    opt.zero_grad(set_to_none=True)
    _sync(args.device)
    t3 = time.perf_counter()
    phases = {"forward_s": t1 - t0, "backward_s": t2 - t1, "optimizer_s": t3 - t2,
              "peak_gib_after_forward": peak_forward, "peak_gib_after_backward": peak_backward}
    if cuda:  # device time per phase of one step run without syncs (CUDA events between the phases)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        events[0].record()
        loss = forward()
        events[1].record()
        loss.backward()
        events[2].record()
        opt.step()
        opt.zero_grad(set_to_none=True)
        events[3].record()
        _sync(args.device)
        for name, a, b in zip(("forward", "backward", "optimizer"), events, events[1:]):
            phases[f"{name}_events_ms"] = a.elapsed_time(b)
    print("phases", json.dumps(phases))

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    t0 = time.perf_counter()
    # Python stacks of the ops need the verbose experimental config (else they come back empty)
    stacks = dict(with_stack=True, experimental_config=torch._C._profiler._ExperimentalConfig(verbose=True)) \
        if args.by_source else {}
    with profile(activities=activities, **stacks) as prof:
        step()
        _sync(args.device)
    wall = time.perf_counter() - t0
    kernels: Counter = Counter()
    kernel_us: Counter = Counter()
    syncs: Counter = Counter()
    for ev in prof.events():
        # the profiler also puts its user ranges (Optimizer.step#Muon.step, ...) on the device timeline: not kernels
        if cuda and ev.device_type == torch.autograd.DeviceType.CUDA and not getattr(ev, "is_user_annotation", False):
            name = ev.name[:90]
            kernels[name] += 1
            kernel_us[name] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
        for s in SYNC_OPS:
            if ev.name.startswith(s):
                syncs[s] += 1
    host = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[: args.top]
    report = {"benchmark": "train_profile", "date": dt.date.today().isoformat(), "preset": args.preset,
              "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
              "batch": B, "seq": T, "attention": args.attention,
              "checkpoint_activations": args.checkpoint_activations, "compile": args.compile,
              "phases": phases, "profiled_wall_s": wall,
              "gpu_busy_s": sum(kernel_us.values()) / 1e6, "kernel_launches": sum(kernels.values()),
              "host_syncs": dict(syncs),
              "top_kernels": [{"name": n, "ms": kernel_us[n] / 1e3, "count": kernels[n]}
                              for n, _ in kernel_us.most_common(args.top)],
              "top_host_ops": [{"name": e.key[:90], "self_cpu_ms": e.self_cpu_time_total / 1e3, "count": e.count}
                               for e in host]}
    if args.by_source:
        rows = sorted(attribute(prof.events(), cuda).items(), key=lambda kv: -kv[1][0])
        report["by_source"] = [{"phase": ph, "source": src, "ms": ms, "count": n} for (ph, src), (ms, n) in rows]
        report["profiled_with_stacks"] = True  # the profiled step's wall time carries the stack recording
    print(f"profiled step: wall {wall * 1e3:.1f} ms, GPU busy {report['gpu_busy_s'] * 1e3:.1f} ms, "
          f"{report['kernel_launches']} kernels, host syncs {dict(syncs)}")
    print("top kernels (GPU ms, launches):")
    for row in report["top_kernels"]:
        print(f"  {row['ms']:9.2f} {row['count']:6d}  {row['name']}")
    print("top host ops (self CPU ms, calls):")
    for row in report["top_host_ops"]:
        print(f"  {row['self_cpu_ms']:9.2f} {row['count']:6d}  {row['name']}")
    if args.by_source:
        total = sum(row["ms"] for row in report["by_source"])
        print(f"by source ({'GPU' if cuda else 'self CPU'} ms, {'kernels' if cuda else 'ops'}, phase; "
              f"{total:.1f} ms in all):")
        for row in report["by_source"][: 3 * args.top]:
            print(f"  {row['ms']:9.2f} {row['count']:6d}  {row['phase']:9s} {row['source']}")
    out = args.out or (str(RESULTS) if cuda else None)
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        path = Path(out) / f"train_profile-{report['date']}.json"
        path.write_text(json.dumps(report, indent=1, default=str))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
