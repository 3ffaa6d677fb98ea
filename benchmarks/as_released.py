"""The release's FP8 linears vs BF16, and a truncated v41-flash from synthetic release shards.

Questions (issue 23):
  1. At v41 widths, what does the release's FP8 linear cost — activation quantization (1×32, E4M3,
     power-of-two scales) + block-scaled FP8 GEMM (Triton, `dsv41.quant.fp8_gemm_triton`) — against
     a BF16 `F.linear`, per linear of one layer, for decode-sized (M = 1, 64) and prefill-sized
     (M = 4096) inputs? Floors: the FP8 GEMM at peak FP8 tensor-core throughput, the weight bytes
     at HBM bandwidth (decode).
  2. Does a truncated v41-flash (real widths; window, Full, Reuse, Reindex, Engram layers) built
     from synthetic release-format shards run prefill + decode with `weights="as-released"` on one
     GPU; load time, peak memory, prefill and decode tokens/s? Prefill and decode use
     `Engine(model).generate(prompts, max_tokens=...)` only: prefill = a 1-token generate, decode
     = the extra time of a (1 + D)-token generate.

    python benchmarks/as_released.py                                  # H200: both questions
    python benchmarks/as_released.py --device cpu --preset tiny       # CPU check at tiny size

Routed experts stay MXFP4 on the GPU (7.2 GB a layer) and run the release's FP8 × FP4 product.
The default 5 layers (1, 2, 3, 20, 24 of v41-flash) make 46 GB of shards — the one-GPU machine has
a 64 GiB disk; `--max-layers 6` needs 54 GB. Engram tables are shrunk to buckets from 1M
(`--engram-vocab-size`): 24M rows, 6.3 GB, instead of the release's 98 GB each.
Writes benchmarks/results/as_released-<date>[-linears|-model].json (device, sizes, the BF16
baseline of the same run, ratios).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from dsv41 import load_config
from dsv41.checkpoint import load_checkpoint
from dsv41.checkpoint.synthetic import resize_engram, write_synthetic_release
from dsv41.config import ConfigError, ModelConfig
from dsv41.model.released import fp8_linear
from dsv41.quant.fp8 import fp8_block_quantize_weight
from dsv41.quant.fp8_gemm import act_quant, fp8_gemm_twin

H200_FP8_TFLOPS = 1979.0  # dense FP8 tensor-core peak (H200 SXM), for the distance to the floor
H200_HBM_GBS = 4800.0


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bench(fn, device: str, iters: int) -> float:
    """Median seconds of `fn` after warm-up."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def best_of(fn, device: str, n: int) -> float:
    """Fastest of `n` timed runs (no warm-up: the caller warmed up)."""
    times = []
    for _ in range(n):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return min(times)


def layer_linears(c: ModelConfig) -> list[tuple[str, int, int]]:
    """(name, out, in) of the FP8 linears of one layer at the config's widths."""
    out = [("attn.wq_a", c.q_lora_rank, c.dim), ("attn.wq_b", c.n_heads * c.head_dim, c.q_lora_rank),
           ("attn.wkv", c.head_dim, c.dim), ("attn.wo_b", c.dim, c.o_groups * c.o_lora_rank),
           ("attn.indexer.wq_b", c.index_n_heads * c.index_head_dim, c.q_lora_rank),
           ("ffn.shared_experts.w1", c.moe_inter_dim, c.dim), ("ffn.shared_experts.w3", c.moe_inter_dim, c.dim),
           ("ffn.shared_experts.w2", c.dim, c.moe_inter_dim)]
    if c.engram_layer_ids:
        out.append(("engram.wkv", (c.hc_mult + 1) * c.dim, c.n_engram_hash_cols * c.engram_head_dim))
    return out


def linears(c: ModelConfig, device: str, tokens: list[int], iters: int) -> list[dict]:
    rows = []
    g = torch.Generator(device=device).manual_seed(0)
    for name, n, k in layer_linears(c):
        w = torch.randn(n, k, generator=g, device=device) * k ** -0.5
        wq, ws = fp8_block_quantize_weight(w)
        wq, ws = wq.view(torch.float8_e4m3fn), ws.view(torch.float8_e8m0fnu)
        w_bf16 = w.bfloat16()
        for m in tokens:
            x = torch.randn(m, k, generator=g, device=device).bfloat16()
            t_bf16 = bench(lambda: F.linear(x, w_bf16), device, iters)
            t_fp8 = bench(lambda: fp8_linear(x, wq, ws), device, iters)
            xq, xs = act_quant(x)
            if device.startswith("cuda"):
                from dsv41.quant.fp8_gemm_triton import fp8_gemm_triton

                t_gemm = bench(lambda: fp8_gemm_triton(xq, xs, wq, ws, torch.bfloat16), device, iters)
            else:
                t_gemm = bench(lambda: fp8_gemm_twin(xq, xs, wq, ws, torch.bfloat16), device, iters)
            ref = F.linear(x.float(), w)
            rel = ((fp8_linear(x, wq, ws).float() - ref).norm() / ref.norm()).item()
            flops = 2 * m * n * k
            row = {"linear": name, "m": m, "n": n, "k": k, "bf16_ms": t_bf16 * 1e3, "fp8_ms": t_fp8 * 1e3,
                   "fp8_gemm_ms": t_gemm * 1e3, "fp8_vs_bf16": t_bf16 / t_fp8, "fp8_tflops": flops / t_fp8 / 1e12,
                   "gemm_tflops": flops / t_gemm / 1e12, "bf16_tflops": flops / t_bf16 / 1e12,
                   "rel_error_vs_fp32": rel}
            if device.startswith("cuda"):
                floor = max(flops / (H200_FP8_TFLOPS * 1e12), (n * k + m * k) / (H200_HBM_GBS * 1e9))
                row["floor_ms"] = floor * 1e3
                row["gemm_of_floor"] = floor / t_gemm
            rows.append(row)
            print(f"{name:22s} M={m:5d} N={n:6d} K={k:5d}  bf16 {t_bf16 * 1e3:8.3f} ms  fp8 {t_fp8 * 1e3:8.3f} ms "
                  f"(gemm {t_gemm * 1e3:8.3f})  bf16/fp8 {t_bf16 / t_fp8:5.2f}x  err {rel * 100:.2f} %")
    return rows


def model_run(config: ModelConfig, args: argparse.Namespace, out: dict, save) -> dict:
    """Fills `out` phase by phase and calls `save()` after each (a time limit that stops the run keeps
    what was measured)."""
    from dsv41.engine.engine import Engine

    device = args.device
    out["config"] = {"n_layers": config.n_layers, "dim": config.dim, "n_routed_experts": config.n_routed_experts,
                     "engram_num_embeddings": config.engram_num_embeddings,
                     "compress_ratios": config.compress_ratios, "kv_source_layers": config.kv_source_layers,
                     "index_source_layers": config.index_source_layers, "engram_layer_ids": config.engram_layer_ids}
    shards = args.shards or Path(tempfile.mkdtemp(prefix="dsv41-release-"))
    t0 = time.perf_counter()
    if not (shards / "config.json").exists():
        write_synthetic_release(config, shards, device=device, max_shard_bytes=int(4e9))
    write_s = time.perf_counter() - t0
    out.update(shards=str(shards), write_s=write_s)
    print(f"shards in {shards}: written in {write_s:.1f} s", flush=True)
    save()
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = load_checkpoint(shards, device=device, dtype=dtype, weights="as-released")
    sync(device)
    load_s = time.perf_counter() - t0
    weights_gb = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers())) / 1e9
    out.update(load_s=load_s, weights_gb=weights_gb)
    if device.startswith("cuda"):
        out["loaded_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
    print(f"loaded as-released in {load_s:.1f} s: {weights_gb:.1f} GB of weights on {device}", flush=True)
    save()
    engine = Engine(model)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, config.vocab_size, (args.prompt,), generator=g).tolist() for _ in range(args.batch)]
    engine.generate([prompts[0][:16]], max_tokens=2)  # warm-up: kernels compile
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    t_prefill = best_of(lambda: engine.generate(prompts, max_tokens=1), device, args.repeats)
    out.update(batch=args.batch, prompt_tokens=args.prompt, prefill_s=t_prefill,
               prefill_tokens_per_s=args.batch * args.prompt / t_prefill)
    if device.startswith("cuda"):
        out["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
    print(f"prefill {args.batch} x {args.prompt}: {t_prefill:.2f} s", flush=True)
    save()
    t_both = best_of(lambda: engine.generate(prompts, max_tokens=1 + args.decode), device, args.repeats)
    decode_s = t_both - t_prefill  # the D extra decode steps (noise can make it <= 0 at tiny sizes)
    out.update(decode_tokens=args.decode, decode_s=decode_s,
               decode_tokens_per_s=args.batch * args.decode / decode_s if decode_s > 0 else None,
               cuda_graphs=engine.graphs is not None)
    if device.startswith("cuda"):
        out["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
    print(f"model: {config.n_layers} layers, load {load_s:.1f} s ({weights_gb:.1f} GB on {device}), "
          f"prefill {out['prefill_tokens_per_s']:.0f} tok/s, "
          f"decode {out['decode_tokens_per_s'] or float('nan'):.1f} tok/s"
          + (f", peak {out['peak_memory_gb']:.1f} GB" if "peak_memory_gb" in out else ""))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preset", default="v41-flash")
    ap.add_argument("--max-layers", type=int, default=5)
    ap.add_argument("--routed-experts", type=int, default=0, help="fewer routed experts (0 = the config's: 384)")
    ap.add_argument("--engram-vocab-size", type=int, default=1_000_000)
    ap.add_argument("--tokens", type=int, nargs="+", default=None, help="M of the linear benchmark")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=None)
    ap.add_argument("--decode", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=2, help="timed generate calls per measurement (best of)")
    ap.add_argument("--shards", type=Path, default=None, help="existing (or new) synthetic shard directory")
    ap.add_argument("--skip-linears", action="store_true")
    ap.add_argument("--skip-model", action="store_true")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    args.tokens = args.tokens or ([1, 64, 4096] if cuda else [1, 64])
    args.iters = args.iters or (20 if cuda else 3)
    args.prompt = args.prompt or (2048 if cuda else 64)
    args.decode = args.decode or (64 if cuda else 8)

    try:
        full = load_config(args.preset)
        config = full.truncated(args.max_layers) if args.max_layers and args.max_layers < full.n_layers else full
        config = resize_engram(config, args.engram_vocab_size)
        # the synthetic shards hold the text model (`model_tensors`): no ViT, no DSpark stages
        config = config.replace(vision_n_layers=0, n_mtp_layers=0, dspark_block_size=0)
        if args.routed_experts and args.routed_experts < config.n_routed_experts:
            config = config.replace(n_routed_experts=args.routed_experts)
    except (ConfigError, ValueError) as e:
        ap.exit(2, f"as_released.py: {e}\n")
    torch.manual_seed(0)
    device_name = torch.cuda.get_device_name() if cuda else (platform.processor() or "cpu")
    result = {"date": dt.date.today().isoformat(), "device": device_name, "torch": torch.__version__,
              "preset": args.preset, "max_layers": config.n_layers}
    args.out.mkdir(parents=True, exist_ok=True)
    part = "-linears" if args.skip_model else "-model" if args.skip_linears else ""
    path = args.out / f"as_released-{result['date']}{part}{'' if cuda else '-cpu'}.json"

    def save() -> None:
        path.write_text(json.dumps(result, indent=1) + "\n")

    if not args.skip_linears:
        result["linears"] = linears(full, args.device, args.tokens, args.iters)
        save()
    if not args.skip_model:
        result["model"] = {}
        model_run(config, args, result["model"], save)
        result["model"]["complete"] = True
        save()
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
