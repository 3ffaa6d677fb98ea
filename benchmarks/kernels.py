"""Kernel speed against the hardware limit: each Triton kernel vs its ceiling and its torch twin.

    python benchmarks/kernels.py                      # H200: every case, ceilings measured first
    python benchmarks/kernels.py --only attention     # one family (benchmarks/kernel_cases/<family>.py)

The two ceilings are measured in the same run (METHOD.md): a device-to-device copy of 4 GiB
(bytes read + written over time) and an 8192³ bf16 matmul on random data. Each case (defined in
benchmarks/kernel_cases/*.py) counts its own minimum work — FLOPs (2·MACs) for compute-bound
kernels, bytes (inputs read once + outputs written once) for memory-bound ones — and is timed as
the median of CUDA-graph replays (launch overhead excluded; plain CUDA events when a twin cannot
be captured), the twin likewise; `launch_ms` adds the eager call (launcher overhead included).
Reported per case: time, TFLOP/s or GB/s, fraction of its ceiling, the floor (work / ceiling) and
the speed-up over the twin.

Engine section (`--engine-contexts`): decode tokens/s of the `small` model (random weights, bf16) at
each context length, with the kernels (`auto`) and with the torch twins (`torch`), same caches —
one sequence, and a batch of `--engine-batch` sequences sharing the context length.
Writes benchmarks/results/kernels-<date>.json (kernels-<date>-2.json, … for later runs of the day).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_file import dated_path  # noqa: E402

FAMILIES = ("attention", "indexer", "mhc", "mhc_train", "cache_write", "markov")


def median_ms(fn, warmup_ms: int = 50, rep_ms: int = 300, graph: bool = True) -> float:
    """Median time of fn in ms: replays of a captured CUDA graph (launch overhead excluded), or plain
    event timing when fn cannot be captured (host syncs) or graph=False."""
    from triton.testing import do_bench, do_bench_cudagraph

    if graph:
        try:
            fn()  # compile outside the capture
            torch.cuda.synchronize()
            return float(do_bench_cudagraph(fn, rep=rep_ms, return_mode="median"))
        except Exception:  # not capturable: fall back to event timing
            torch.cuda.synchronize()
    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def ceilings(device: torch.device) -> dict:
    n = 1 << 31  # 2 GiB read + 2 GiB written per copy
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src), graph=False)
    size = 8192
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    mm_ms = median_ms(lambda: a @ b, graph=False)
    return dict(copy_gbps=2 * n / copy_ms / 1e6, matmul_tflops=2 * size**3 / mm_ms / 1e9,
                copy_ms=copy_ms, matmul_ms=mm_ms)


def run_case(case: dict, ceil: dict) -> dict:
    unit, work = case["unit"], case["work"]
    t = median_ms(case["triton"])
    launch = median_ms(case["triton"], graph=False)
    rate = work / t / 1e9 if unit == "flop" else work / t / 1e6  # TFLOP/s or GB/s
    peak = ceil["matmul_tflops"] if case["ceiling"] == "matmul" else ceil["copy_gbps"]
    floor_ms = work / (peak * (1e9 if unit == "flop" else 1e6))
    row = dict(name=case["name"], shape=case["shape"], unit=unit, work=work, ceiling=case["ceiling"],
               triton_ms=t, launch_ms=launch, rate=rate, rate_unit="TFLOP/s" if unit == "flop" else "GB/s",
               fraction_of_ceiling=rate / peak, floor_ms=floor_ms, note=case.get("note", ""))
    if case.get("torch") is not None:
        row["torch_ms"] = median_ms(case["torch"], warmup_ms=20, rep_ms=200)
        row["speedup_vs_torch"] = row["torch_ms"] / t
    return row


def engine_decode(contexts: list[int], batch: int, device: torch.device) -> list[dict]:
    """Decode step time of `small` at each context, kernels vs twins (same caches, same tokens)."""
    from dsv41 import load_config
    from dsv41.engine.cache import SequenceCache, private_pools
    from dsv41.engine.prefill import prefill
    from dsv41.engine.runner import Runner
    from dsv41.kernels.ops import use_backend
    from dsv41.model.transformer import Transformer

    torch.manual_seed(0)
    config = load_config("small")
    model = Transformer(config).init_weights(seed=0).to(device=device, dtype=torch.bfloat16).eval()
    runner = Runner(model)
    gen = torch.Generator().manual_seed(1)
    rows = []
    for n in contexts:
        for b in sorted({1, batch}):
            pools = private_pools(config, device, max_tokens=n + 8192, max_slots=b)  # room for the timed steps
            seqs = [SequenceCache(config, device, pools) for _ in range(b)]
            ids = torch.randint(3, config.vocab_size, (n,), generator=gen).tolist()
            with use_backend("auto"):
                for s in seqs:  # every sequence gets the same (random) context
                    prefill(runner, s, ids, chunk=8192)
            tok = torch.randint(3, config.vocab_size, (b, 1), generator=gen).to(device)
            start = torch.tensor([s.n_tokens for s in seqs], device=device)
            row = dict(context=n, batch=b)
            for name in ("auto", "torch"):
                def step() -> None:  # one real decode step: every sequence advances by one token
                    runner.logits(*runner.forward(seqs, tok, start, range(config.n_layers)))
                    for s in seqs:
                        s.tokens.append(7)
                    start.add_(1)

                with use_backend(name):
                    ms = median_ms(step, warmup_ms=100, rep_ms=1000 if name == "auto" else 300, graph=False)
                row[f"{name}_step_ms"] = ms
                row[f"{name}_tokens_per_s"] = b * 1e3 / ms
            row["speedup"] = row["torch_step_ms"] / row["auto_step_ms"]
            rows.append(row)
            print(f"engine decode small ctx {n:>7} batch {b:>3}: kernels {row['auto_step_ms']:8.2f} ms "
                  f"({row['auto_tokens_per_s']:8.1f} tok/s)  torch {row['torch_step_ms']:8.2f} ms "
                  f"({row['torch_tokens_per_s']:8.1f} tok/s)  {row['speedup']:.2f}x", flush=True)
            torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", choices=FAMILIES, default=list(FAMILIES))
    ap.add_argument("--engine-contexts", type=int, nargs="*", default=[4096, 32768, 131072])
    ap.add_argument("--engine-batch", type=int, default=16)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    sys.path.insert(0, str(Path(__file__).parent))
    ceil = ceilings(device)
    print(f"ceilings: copy {ceil['copy_gbps']:.0f} GB/s, bf16 matmul {ceil['matmul_tflops']:.0f} TFLOP/s", flush=True)
    rows, failures = [], []
    for family in args.only:
        module = importlib.import_module(f"kernel_cases.{family}")
        for case in module.cases(device):
            try:
                rows.append(dict(family=family, **run_case(case, ceil)))
            except Exception as e:  # keep the other cases' numbers
                failures.append(dict(family=family, name=case["name"], error=f"{type(e).__name__}: {e}"))
                print(f"{family}/{case['name']}: FAILED {failures[-1]['error']}", flush=True)
                continue
            r = rows[-1]
            twin = f"{r['speedup_vs_torch']:6.1f}x twin" if "speedup_vs_torch" in r else "   (no twin)"
            print(f"{family:>11}/{r['name']:<28} {r['triton_ms']:9.4f} ms  {r['rate']:8.1f} {r['rate_unit']:<7} "
                  f"{100 * r['fraction_of_ceiling']:5.1f}% of {r['ceiling']}  {twin}", flush=True)
            del case
        torch.cuda.empty_cache()
    engine = engine_decode(args.engine_contexts, args.engine_batch, device) \
        if args.engine_contexts else []
    path = dated_path(args.out, "kernels")  # a second run on the same day keeps the first one's file
    path.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                    triton=importlib.import_module("triton").__version__, ceilings=ceil,
                                    cases=rows, failures=failures, engine_decode=engine), indent=1))
    print(f"wrote {path}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
