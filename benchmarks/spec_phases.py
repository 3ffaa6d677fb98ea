"""Where a speculative step's time goes: per phase of `Engine._speculate`, wall time and launches.

    python benchmarks/spec_phases.py --checkpoint models/dsv41-small --text data/sample   # H200
    python benchmarks/spec_phases.py --device cpu --preset tiny --drafter oracle --prompt-len 16 \\
        --new-tokens 16                                                                  # a smoke run

One speculative engine (`speculate="always"`) decodes greedy requests; every phase of the step — catch-up,
propose, rollback snapshot, the static verification step, acceptance, rollback, the drafter's hand-over
(with greedy acceptance on the device: that acceptance, then the rollback, hand-over and next proposal it queues,
then the host's settling), log-probs and emission — is wrapped in a timer that synchronizes the device
before and after (so a phase's time is its host time plus the device work it queues; the sum is a synchronized
step, a little slower than a real one). Then a few steps run under torch.profiler: per phase, the kernel
launches (CUDA: launches and graph replays; CPU: top-level aten ops) it issues.
Writes benchmarks/results/spec_phases-<date>-b<batch>-<dtype>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speculative import CHECKPOINT, DTYPES, RESULTS, text_prompts  # noqa: E402

LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch",
            "cudaMemcpyAsync", "cudaMemsetAsync")


class Phases:
    """Wraps functions in timers (synchronized) and profiler labels `phase:<name>`."""

    def __init__(self, sync):
        self.sync, self.seconds, self.calls = sync, defaultdict(float), defaultdict(int)

    def wrap(self, owner, attr: str, name: str) -> None:
        fn = getattr(owner, attr)

        def timed(*args, **kwargs):
            self.sync()
            t0 = time.perf_counter()
            with torch.profiler.record_function(f"phase:{name}"):
                out = fn(*args, **kwargs)
            self.sync()
            self.seconds[name] += time.perf_counter() - t0
            self.calls[name] += 1
            return out

        setattr(owner, attr, timed)


def launches_per_phase(prof, cuda: bool) -> dict[str, int]:
    """Launches (CUDA) or top-level aten ops (CPU) per innermost `phase:` label."""
    counts: dict[str, int] = defaultdict(int)
    for evt in prof.events():
        if cuda:
            if evt.name not in LAUNCHES:
                continue
        elif not evt.name.startswith("aten::"):
            continue
        parent, phase = evt.cpu_parent, None
        nested_op = False
        while parent is not None:
            if parent.name.startswith("aten::"):
                nested_op = True
            if parent.name.startswith("phase:"):
                phase = parent.name[len("phase:"):]
                break
            parent = parent.cpu_parent
        if not cuda and nested_op:
            continue
        counts[phase or "other"] += 1
    return dict(counts)


def graph_kernels(engine, B: int, replays: int = 5, top: int = 25) -> dict:
    """Per captured graph of batch bucket B (the decode step, the verification step, its rollback): kernels
    per replay, their summed time, a replay's wall time and the kernels that take longest. Run after the
    requests finished: a replay re-runs the last step's inputs on slots nobody holds any more."""
    from torch.profiler import ProfilerActivity, profile

    from dsv41.engine.graphs import bucket

    out = {}
    drafter = engine.drafter
    if hasattr(getattr(drafter, "drafter", None), "propose"):
        drafter = drafter.drafter  # under a timing wrapper
    found = [("decode", engine.graphs), ("verification", engine.vgraphs)]
    found += [(f"drafter {attr}", getattr(drafter, attr)) for attr in vars(drafter)
              if attr.endswith("graphs") and hasattr(getattr(drafter, attr), "graphs")]  # propose, hand-over
    for label, graphs in found:
        if graphs is None:
            continue
        Bb = bucket(B, graphs.buckets) if hasattr(graphs, "buckets") else B
        for key, graph in graphs.graphs.items():
            parts = key if isinstance(key, tuple) else (key,)
            if Bb not in parts[:2]:
                continue
            name = f"{label} {parts[0]}" if isinstance(parts[0], str) else label
            if name in out:
                name = f"{name} {key}"
            graph.replay()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(replays):
                graph.replay()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / replays
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(replays):
                    graph.replay()
                torch.cuda.synchronize()
            rows = []
            for evt in prof.key_averages():
                us = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
                if us and evt.count:
                    rows.append({"name": evt.key, "count_per_replay": evt.count / replays,
                                 "ms_per_replay": us / 1e3 / replays})
            rows.sort(key=lambda r: -r["ms_per_replay"])
            out[name] = {"key": str(key), "replay_ms": 1e3 * wall,
                         "kernels_per_replay": sum(r["count_per_replay"] for r in rows),
                         "kernel_ms_per_replay": sum(r["ms_per_replay"] for r in rows), "top": rows[:top]}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, default=None)
    ap.add_argument("--preset", default=None, help="a random-init preset instead of a checkpoint (smoke runs)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--drafter", choices=["oracle", "dspark"], default="dspark")
    ap.add_argument("--text", type=Path, default=None)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--profile-steps", type=int, default=4)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("spec_phases: no CUDA device (use --device cpu for a smoke run)", file=sys.stderr)
        return 2
    from dsv41 import load_config
    from dsv41.engine import engine as engine_mod
    from dsv41.engine.engine import Engine, cast_for_engine
    from dsv41.engine.sampling import SamplingParams
    from dsv41.engine.speculative import SpeculativeError, VerifyRollback, build_drafter
    from dsv41.model.transformer import Transformer

    cuda = args.device.startswith("cuda")
    torch.manual_seed(0)
    if args.preset:
        dtype = DTYPES[args.dtype]
        model = cast_for_engine(Transformer(load_config(args.preset)).init_weights(seed=0).to(args.device),
                                dtype).eval()
    else:
        from dsv41.checkpoint import load_checkpoint

        model = cast_for_engine(load_checkpoint(args.checkpoint or CHECKPOINT, device=args.device),
                                DTYPES[args.dtype]).eval()
    c = model.config
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    k = 4
    if args.drafter == "dspark":
        from dsv41.checkpoint.load import read_config

        k = read_config((args.checkpoint or CHECKPOINT) / "dspark").dspark_block_size
    max_seq_len = args.prompt_len + args.new_tokens + k + 8
    try:
        drafter = build_drafter(args.drafter, model, checkpoint=args.checkpoint or CHECKPOINT, k=k,
                                max_sequences=args.batch, max_seq_len=max_seq_len)
    except SpeculativeError as e:
        print(f"spec_phases: {e}", file=sys.stderr)
        return 2
    engine = Engine(model, max_batch=args.batch, max_seq_len=max_seq_len, drafter=drafter, speculate="always",
                    prefill_layers=None)
    if args.text:
        prompts = text_prompts(args.text, args.prompt_len, args.batch)
    else:
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(3, c.vocab_size, (args.batch, args.prompt_len), generator=g).tolist()
    seqs = [engine.add_request(p, SamplingParams(max_tokens=args.new_tokens)) for p in prompts]
    while any(s.prefilling or s.next_token is None for s in seqs if not s.finished) and engine.has_work():
        engine.step()
    for _ in range(3):  # graphs captured, caches warm
        if engine.has_work():
            engine.step()
    phases = Phases(sync)
    for attr, name in (("_catch_up", "catch-up"), ("_propose", "propose"), ("_run_static", "verification step"),
                       ("_observe", "drafter hand-over"), ("_logprobs", "logprobs"), ("_emission", "emission"),
                       ("_fetch_proposal", "fetch proposal"), ("_accept_on_device", "acceptance (device)"),
                       ("_settle_on_device", "settle (host)")):
        phases.wrap(engine, attr, name)
    # the static rollback's device half (from `_restore_static` or, accepting on the device, `_follow_on_device`)
    phases.wrap(engine.vgraphs or engine.runner, "restore", "rollback")
    if hasattr(engine.drafter, "observe_many_device"):  # the hand-over `_follow_on_device` queues
        phases.wrap(engine.drafter, "observe_many_device", "drafter hand-over")
    phases.wrap(engine_mod, "verify", "acceptance")
    phases.wrap(VerifyRollback, "__init__", "rollback snapshot")
    phases.wrap(VerifyRollback, "restore", "rollback")
    phases.wrap(engine, "step", "step")

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(args.profile_steps):
            if engine.has_work():
                engine.step()
    launches = launches_per_phase(prof, cuda)
    phases.seconds.clear()
    phases.calls.clear()
    steps0 = engine.stats.speculative.forwards
    while engine.has_work():
        engine.step()
    steps = max(engine.stats.speculative.forwards - steps0, 1)
    total = phases.seconds.pop("step", 0.0)
    phases.calls.pop("step", None)
    rows = {name: {"ms_per_step": 1e3 * s / steps, "calls_per_step": phases.calls[name] / steps}
            for name, s in sorted(phases.seconds.items(), key=lambda kv: -kv[1])}
    rows["rest of the step (host)"] = {"ms_per_step": 1e3 * (total - sum(phases.seconds.values())) / steps}
    kernels = graph_kernels(engine, args.batch) if cuda else {}
    report = {"benchmark": "spec_phases", "date": dt.date.today().isoformat(),
              "device": torch.cuda.get_device_name() if cuda else "cpu", "batch": args.batch, "drafter": args.drafter,
              "dtype": args.dtype,
              "k": k, "steps": steps, "step_ms_synchronized": 1e3 * total / steps, "phases": rows,
              "launches_per_step": {name: n / args.profile_steps for name, n in sorted(launches.items())},
              "launch_kind": "CUDA launches + graph replays + async copies" if cuda else "top-level aten ops",
              "tokens_per_verification": engine.stats.speculative.mean_tokens_per_verification,
              "graph_kernels": kernels}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"spec_phases-{report['date']}-b{args.batch}-{args.dtype}.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")
    print(f"step (synchronized) {report['step_ms_synchronized']:.2f} ms over {steps} verifications, "
          f"{report['tokens_per_verification']:.2f} tokens each")
    for name, row in rows.items():
        n = report["launches_per_step"].get(name)
        print(f"  {name:<26} {row['ms_per_step']:8.3f} ms   {'' if n is None else f'{n:7.1f} launches'}")
    for name, k in kernels.items():
        print(f"  graph {name}: {k['kernels_per_replay']:.0f} kernels, {k['kernel_ms_per_replay']:.3f} ms of kernels, "
              f"{k['replay_ms']:.3f} ms a replay; top: " +
              ", ".join(f"{t['name'][:40]} {t['ms_per_replay']:.3f}" for t in k["top"][:6]))
    if "other" in report["launches_per_step"]:
        print(f"  {'(outside the phases)':<26} {'':8}      {report['launches_per_step']['other']:7.1f} launches")
    return 0


if __name__ == "__main__":
    sys.exit(main())
