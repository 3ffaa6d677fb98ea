"""How many kernels one eager training step launches, by phase and by the code that launched them.

Question: the eager `small` step is host-bound on the H200 (~23,000 launches in ~0.36 s); which code launches
them? A dispatch mode counts every aten op that launches a kernel (`dsv41.testing.sync.launches_kernel`: not a
view, not a bare allocation) during one step after a warm-up step — forward, backward (autograd's own ops,
attributed as a whole) and optimizer — by the innermost dsv41 source function. The op sequence is the same on
any device except where the device picks another path (on CUDA: Triton kernels for inference-only ops, the fused
training attention, foreach AdamW), so the CPU count is a map of the eager step, not the GPU's exact number.
`--sinkhorn-iters` changes the mHC Sinkhorn rounds (20 in the release) to show their share.

    python benchmarks/train_launches.py                       # CPU, small, 1 x 256, bf16 autocast
    python benchmarks/train_launches.py --sinkhorn-iters 1    # the same step with one Sinkhorn round
    TRITON_INTERPRET=1 python benchmarks/train_launches.py --preset tiny --seq 64 --backend triton
        # the CUDA path's training kernels (in the interpreter; slow): the torch ops left between them

`--backend triton` leaves the kernels' own launches (one or two per training Function) out of the count and skips
the interpreter's internal tensor ops, so what it counts is the glue a GPU step would launch around the kernels.

Writes benchmarks/results/train_launches-<date>[-N].json.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime as dt
import sys
import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_file import write_result  # noqa: E402

from dsv41 import load_config
from dsv41.kernels.ops import use_backend
from dsv41.model.transformer import Transformer
from dsv41.optim import build_optimizer
from dsv41.testing.sync import launches_kernel

RESULTS = Path(__file__).parent / "results"


class Launches(TorchDispatchMode):
    """Kernel-launching aten ops by (phase, innermost dsv41 function)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.phase = "forward"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if launches_kernel(func):
            stack = traceback.extract_stack(limit=25)
            if any("triton/runtime/interpreter" in f.filename for f in stack):  # the interpreter running a kernel
                return func(*args, **(kwargs or {}))
            frames = [f for f in stack if "src/dsv41/" in f.filename]
            site = f"{frames[-1].filename.split('src/dsv41/')[-1]}:{frames[-1].name}" if frames else "(autograd)"
            self.counts[(self.phase, site)] += 1
        return func(*args, **(kwargs or {}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--sinkhorn-iters", type=int, default=None, help="override hc_sinkhorn_iters")
    ap.add_argument("--backend", choices=("auto", "torch", "triton"), default="auto",
                    help="kernel backend: 'triton' runs the CUDA path's training kernels (on the CPU through Triton's "
                         "interpreter, TRITON_INTERPRET=1; slow): what remains is the glue between them")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if args.batch < 1 or args.seq < 2 or (args.sinkhorn_iters is not None and args.sinkhorn_iters < 1):
        print("train_launches: --batch >= 1, --seq >= 2, --sinkhorn-iters >= 1", file=sys.stderr)
        return 2
    config = load_config(args.preset)
    if args.sinkhorn_iters is not None:
        config = dataclasses.replace(config, hc_sinkhorn_iters=args.sinkhorn_iters)
    torch.manual_seed(0)
    model = Transformer(config).init_weights(seed=0).train()
    opt = build_optimizer(model, lr=1e-4)
    tokens = torch.randint(3, config.vocab_size, (args.batch, args.seq + 1))

    def step(counter: Launches) -> None:
        counter.phase = "forward"
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses = model.losses(tokens[:, :-1], tokens[:, 1:], attention="sparse")
        counter.phase = "backward"
        losses.total.backward()
        counter.phase = "optimizer"
        opt.step()
        opt.zero_grad(set_to_none=True)

    with use_backend(args.backend):
        step(Launches())  # warm-up: optimizer state, first-call paths
        with Launches() as counter:
            step(counter)
    phases: collections.Counter = collections.Counter()
    for (phase, _), n in counter.counts.items():
        phases[phase] += n
    total = sum(phases.values())
    result = {"benchmark": "train_launches", "date": dt.date.today().isoformat(), "preset": args.preset,
              "batch": args.batch, "seq": args.seq, "backend": args.backend,
              "hc_sinkhorn_iters": config.hc_sinkhorn_iters,
              "torch": torch.__version__, "total": total, "phases": dict(phases),
              "sites": {f"{p} {s}": n for (p, s), n in counter.counts.most_common(args.top)}}
    print(f"{args.preset} {args.batch}x{args.seq}, {config.hc_sinkhorn_iters} Sinkhorn rounds: {total} kernel ops "
          + ", ".join(f"{p} {n}" for p, n in phases.items()))
    for site, n in list(result["sites"].items())[:12]:
        print(f"  {n:6d}  {site}")
    write_result(args.out, "train_launches", result, result["date"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
