"""What one prefill piece launches, counted on the CPU: aten ops and Triton kernel calls per one-layer piece.

    TRITON_INTERPRET=1 python benchmarks/piece_ops.py                 # `small`, 256-token pieces, every layer
    TRITON_INTERPRET=1 python benchmarks/piece_ops.py --tokens 64 --preset tiny

The Triton kernels run in the interpreter, so the engine takes its GPU path (`use_backend("triton")`); the ops
the interpreter runs inside a kernel are not counted. A prompt's first chunk runs through every layer (warm-up),
then the next two chunks one layer per piece, as the engine's pieces beside decoding streams run (`prefill_layers=1`).
aten ops include views (no launch on a GPU); Triton calls are launches. Comparing two commits (run this file at
each) shows whether a change added host work to the pieces. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--tokens", type=int, default=256, help="tokens per piece")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("piece_ops: run with TRITON_INTERPRET=1 (the Triton kernels in the interpreter)", file=sys.stderr)
        return 2
    if args.tokens < 1:
        print(f"piece_ops: --tokens must be >= 1, got {args.tokens}", file=sys.stderr)
        return 2
    import triton.runtime.interpreter as interpreter

    from dsv41 import load_config
    from dsv41.engine.cache import SequenceCache, private_pools
    from dsv41.engine.prefill import PrefillJob
    from dsv41.engine.runner import Runner
    from dsv41.kernels.ops import use_backend
    from dsv41.model.transformer import Transformer

    aten, launches, inside = collections.Counter(), collections.Counter(), [0]
    run = interpreter.InterpretedFunction.run

    def counted(self, *a, **k):
        launches[self.fn.__name__] += 1
        inside[0] += 1
        try:
            return run(self, *a, **k)
        finally:
            inside[0] -= 1

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not inside[0]:
                aten[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    interpreter.InterpretedFunction.run = counted
    torch.manual_seed(0)
    c = load_config(args.preset)
    model = Transformer(c).init_weights(seed=0).eval()
    T = args.tokens
    job = PrefillJob(Runner(model), SequenceCache(c, pools=private_pools(c, "cpu", max_tokens=4 * T)),
                     torch.randint(3, c.vocab_size, (3 * T,)).tolist(), chunk=T)
    per_piece = []
    with torch.no_grad(), use_backend("triton"):
        job.step(T, c.n_layers if job.exact else c.encoder_layers)  # the first chunk, whole
        for _ in range(2 * c.encoder_layers):  # two chunks, a layer a piece
            aten.clear()
            launches.clear()
            with Count():
                job.step(T, 1)
            per_piece.append({"aten_ops": sum(aten.values()), "triton_launches": sum(launches.values())})
    print(json.dumps({"preset": args.preset, "tokens": T, "pieces": per_piece,
                      "aten_ops": sum(p["aten_ops"] for p in per_piece),
                      "triton_launches": sum(p["triton_launches"] for p in per_piece)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
