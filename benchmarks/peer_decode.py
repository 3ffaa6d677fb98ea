"""Decode and prefill speed of the engine vs a dense GQA Llama of the same active size, one run.

    python benchmarks/peer_decode.py                              # the H200 grid (issue 15)
    python benchmarks/peer_decode.py --device cpu --preset tiny --batches 1 2 --contexts 256 \\
        --prefill 256 --steps 3 --no-peer                         # a smoke run without a GPU

dsv41 (`small`, random weights, bf16) decodes through its engine — fixed pools, the static decode
step replayed from CUDA graphs — from caches filled synthetically to the context length (packed
FP4 entries and index keys, FP8 windows, written by the engine's own quantizing kernels), so a
128K context costs no 128K prefill; the timed loop is `Engine.step()` itself (host bookkeeping,
one input copy, graph replay, sampling, the token read back).

The peer is a Hugging Face `transformers` Llama with about the same active parameters per token
(`peer_config`), random weights, bf16, its KV cache filled with random keys/values of the same
context, on three paths: (i) eager forward with `DynamicCache` (what `generate` runs), (ii)
`StaticCache` + `torch.compile(mode="reduce-overhead")` (HF's fastest documented path; compiled
for the cells in --compile-cells only, each compile costs minutes), (iii) a plain-torch decode step
over the same weights captured in a CUDA graph (GQA as a query-length-G SDPA over the static
cache). Prefill: one prompt at each --prefill length, dsv41 encoder-only and exact vs the peer's
eager forward (SDPA flash attention); each prefill also records its host share (`*_queued_ms`: the time
until prefill() returns, against `*_min_ms` once the device is done), and `--profile-prefill` /
`--profile-exact` profile chosen lengths (kernels, GPU time, where the host's time goes). `--topk-method`
runs the indexer's top-k with one method (an A/B of the prefill wall time). The hardware ceilings
(bf16 8192³ matmul, device copy) are measured in the same run, and `torch.profiler` counts kernels per
eager decode step and the GPU-busy fraction. Writes benchmarks/results/peer_decode-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_file import dated_path  # noqa: E402

from dsv41 import load_config  # noqa: E402
from dsv41.accounting import compute
from dsv41.engine.cache import SequenceCache, private_pools
from dsv41.engine.engine import IDLE_PREFILL_CHUNK, Engine, cast_for_engine
from dsv41.engine.prefill import prefill
from dsv41.engine.runner import Runner
from dsv41.engine.sampling import SamplingParams
from dsv41.engine.synthetic import synthetic_running
from dsv41.model.transformer import Transformer

RESULTS = Path(__file__).resolve().parent / "results"


# ---------------------------------------------------------------------------------------------- helpers
def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str, repeat: int = 1) -> float:
    """Seconds per call (host clock after a device sync)."""
    sync(device)
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / repeat


def ceilings(device: str) -> dict:
    if not device.startswith("cuda"):
        return {}
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    s = timed(lambda: a @ b, device, 10)
    x = torch.randn(2**29 // 2, device=device, dtype=torch.bfloat16)  # 512 MiB
    y = torch.empty_like(x)
    y.copy_(x)
    c = timed(lambda: y.copy_(x), device, 20)
    return {"bf16_matmul_tflops": 2 * n**3 / s / 1e12, "copy_gb_s": 2 * x.numel() * 2 / c / 1e9}


def peer_config(config, context: int):
    """A dense GQA Llama with about dsv41's active parameters per token and 4096 B/token of KV."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=config.vocab_size, hidden_size=384, intermediate_size=1664, num_hidden_layers=8,
                       num_attention_heads=6, num_key_value_heads=2, head_dim=64, max_position_embeddings=context,
                       rms_norm_eps=1e-6, tie_word_embeddings=False, attn_implementation="sdpa")


def count_params(module) -> int:
    return sum(p.numel() for p in module.parameters())


# ---------------------------------------------------------------------------------------------- dsv41
def dsv41_decode(model, B: int, context: int, steps: int, device: str, graphs: bool, overlap: bool = False) -> dict:
    engine = Engine(model, max_batch=max(B, 1), max_seq_len=context + steps + 8,
                    max_tokens=B * (context + steps + 8), cuda_graphs=graphs, overlap=overlap)
    synthetic_running(engine, B, context, seed=0)
    for _ in range(3):  # warm-up (captures the graph)
        engine.step()
    engine.stats.host_s.clear()
    t = timed(engine.step, device, steps)
    # where the step's wall time goes (Engine.phase_ms): on a GPU `sample` holds the wait for the step's device work
    out = {"step_ms": t * 1e3, "tok_s": B / t, "graphs": engine.graphs.captures if engine.graphs else 0,
           "phase_ms": engine.phase_ms(steps), "overlapped_steps": engine.stats.overlapped_steps}
    if engine.graphs is not None:  # the replay alone (GPU time of the step)
        key = next(iter(engine.graphs.graphs))
        graph = engine.graphs.graphs[key]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        out["replay_ms"] = start.elapsed_time(end) / steps
    out["kv_pool_gib"] = engine.pools.allocated_bytes()["global_kv"] / 2**30
    return out


def dsv41_profile(model, B: int, context: int, device: str) -> dict:
    """Kernels per eager decode step and the GPU-busy fraction (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    engine = Engine(model, max_batch=B, max_seq_len=context + 16, max_tokens=B * (context + 16), cuda_graphs=False)
    synthetic_running(engine, B, context, seed=1)
    for _ in range(2):
        engine.step()
    sync(device)
    n = 3
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            engine.step()
        sync(device)
    wall = time.perf_counter() - t0
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time for e in kernels) / 1e6  # µs → s
    return {"batch": B, "context": context, "kernels_per_step": len(kernels) / n, "gpu_busy_fraction": busy / wall,
            "eager_step_ms": wall / n * 1e3, "gpu_ms_per_step": busy / n * 1e3, "top_kernels": top_kernels(kernels, n)}


def top_kernels(kernels, n: int, k: int = 15) -> list[dict]:
    """The k kernels with the most GPU time per step: name, launches and µs per step."""
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name[:90], []).append(e.device_time)
    rows = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:k]
    return [{"kernel": name, "launches": len(t) / n, "us": sum(t) / n} for name, t in rows]


def dsv41_prefill_profile(model, n: int, device: str, chunk: int, exact: bool = False) -> dict:
    """Where prefill time goes (torch.profiler, one prompt of n tokens; encoder-only, or exact)."""
    from torch.profiler import ProfilerActivity, profile

    c = model.config
    runner = Runner(model)
    ids = torch.randint(3, c.vocab_size, (n,)).tolist()

    def run() -> None:
        prefill(runner, SequenceCache(c, pools=private_pools(c, device, max_tokens=n + 8)), ids, chunk=chunk,
                exact=exact)

    run()
    sync(device)
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        sync(device)
    wall = time.perf_counter() - t0
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    out = {"tokens": n, "chunk": chunk, "exact": exact, "wall_ms": wall * 1e3, "kernels": len(kernels),
           "gpu_ms": sum(e.device_time for e in kernels) / 1e3, "top_kernels": top_kernels(kernels, 1)}
    out["host"] = host_profile(prof, run, device)
    return out


def host_profile(prof, run, device: str, k: int = 20) -> dict:
    """Where the host's time goes in `run` (already profiled as `prof`): the host waits (stream / device
    synchronizations and device → host copies, with their count and time), the aten ops with the most
    self CPU time, and — from a second, unprofiled run under cProfile — the Python functions with the most
    own time (the launch overhead of the Triton kernels and of the eager ops shows up here)."""
    import cProfile
    import pstats

    waits: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CPU and any(
                w in e.name for w in ("Synchronize", "cudaMemcpy", "_local_scalar_dense", "aten::item", "nonzero")):
            waits.setdefault(e.name, []).append(e.cpu_time_total)
    by_self: dict[str, float] = {}
    for e in prof.key_averages():
        if e.key.startswith("aten::"):
            by_self[e.key] = e.self_cpu_time_total
    cp = cProfile.Profile()
    cp.enable()
    run()
    sync(device)
    cp.disable()
    st = pstats.Stats(cp)
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:k]  # (file, line, fn) → (cc, nc, tottime, cumtime, ...)
    return {"waits": {name: {"count": len(t), "ms": sum(t) / 1e3} for name, t in waits.items()},
            "top_aten_self_ms": {name: ms / 1e3 for name, ms in sorted(by_self.items(), key=lambda kv: -kv[1])[:k]},
            "python_tottime_ms": [{"fn": f"{Path(f).name}:{line}:{fn}", "calls": nc, "tottime_ms": tt * 1e3,
                                   "cumtime_ms": ct * 1e3} for (f, line, fn), (_, nc, tt, ct, _) in rows],
            "cprofile_wall_ms": st.total_tt * 1e3}


def dsv41_static_prefill(model, n: int, device: str, chunk: int, repeats: int = 20) -> dict:
    """Encoder-only and exact prefill of one n-token prompt through `StaticPrefill` (the engine's path for whole
    runs: pieces of up to `chunk` tokens at power-of-two shapes and the window, from CUDA graphs on CUDA, captured by
    a first run of the same shapes); `repeats` synced runs of each, the two kinds taking turns so that both see the
    same host (a run is 9–70 ms; the fastest of 10 back-to-back runs gave an 8K ratio of 0.551, 0.570 and 0.553 on
    three H100s, 2026-12-06, for the same 0.53 of device time), the fastest of each and their ratio, and the ratio
    of the medians."""
    from dsv41.engine.engine import layout_for_graphs
    from dsv41.engine.static_prefill import StaticPrefill

    c = model.config
    if device.startswith("cuda"):  # the MoE dispatch an Engine with graphs sets (the replay's 128 tokens: dense)
        layout_for_graphs(model, 1)
    runner = Runner(model)
    pools = private_pools(c, device, max_tokens=n + 8)
    static = StaticPrefill(runner, pools, chunk=chunk)
    # the prompt as an int64 array (the peer's is a device tensor): converting a Python list of 8K ids took
    # 0.14–0.21 ms (`timeit` of np.fromiter) before the first launch, ~2% of an 8K encoder-only prefill
    ids = torch.randint(3, c.vocab_size, (n,)).numpy()
    out = {"tokens": n, "chunk": static.chunk, "ids": "int64 array"}
    def run(exact: bool) -> None:
        seq = SequenceCache(c, pools=pools)
        static(seq, ids, exact=exact)
        seq.release()  # its slot and pages back for the next run

    kinds = (("static", False), ("static_exact", True))
    used: dict[str, dict] = {}
    for name, exact in kinds:
        run(exact)  # captures
        pieces, replays = static.pieces, dict(static.replays)
        run(exact)
        out[f"{name}_pieces"] = static.pieces - pieces  # graph replays per prompt (with graphs)
        used[name] = {k: v - replays.get(k, 0) for k, v in static.replays.items() if v > replays.get(k, 0)}
    times: dict[str, list[float]] = {name: [] for name, _ in kinds}
    for _ in range(repeats):
        for name, exact in kinds:
            times[name].append(timed(lambda exact=exact: run(exact), device, 1))
    for name, _ in kinds:
        best = min(times[name])
        out[f"{name}_ms"], out[f"{name}_tok_s"] = best * 1e3, n / best
        out[f"{name}_median_ms"] = statistics.median(times[name]) * 1e3
        if static.graphs:  # the device time of one prompt: each graph it replays, replayed alone between events
            per_graph = {k: graph_ms(static._graphs[k][0], device) for k in used[name]}
            out[f"{name}_gpu_ms"] = sum(m * per_graph[k] for k, m in used[name].items())
            # e.g. {"encoder 8192": 8.2, "replay 128": 1.7}: where a prompt's device time goes (kind, shape)
            out[f"{name}_graph_ms"] = {f"{k[0]} {k[1]}": {"ms": ms, "replays": used[name][k], **graph_kernels(
                static._graphs[k][0])} for k, ms in per_graph.items()}
    out["encoder_over_exact_median"] = out["static_median_ms"] / out["static_exact_median_ms"]
    out.update(encoder_over_exact=out["static_ms"] / out["static_exact_ms"], graphs=static.graphs,
               captures=static.captures)
    if static.graphs:
        out["gpu_encoder_over_exact"] = out["static_gpu_ms"] / out["static_exact_gpu_ms"]
    return out


def graph_kernels(graph) -> dict:
    """One replay of a captured graph under torch.profiler: its kernels, their summed µs and the largest."""
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return {"kernels": len(kernels), "kernel_us": sum(e.device_time for e in kernels),
            "top_kernels": top_kernels(kernels, 1)}


def graph_ms(graph, device: str, repeat: int = 5) -> float:
    """Milliseconds of device time per replay of a captured graph (CUDA events around `repeat` replays)."""
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        graph.replay()
    end.record()
    sync(device)
    return start.elapsed_time(end) / repeat


def dsv41_prefill(model, n: int, device: str, chunk: int) -> dict:
    c = model.config
    runner = Runner(model)
    ids = torch.randint(3, c.vocab_size, (n,)).tolist()

    def run(exact: bool) -> None:
        prefill(runner, SequenceCache(c, pools=private_pools(c, device, max_tokens=n + 8)), ids, chunk=chunk,
                exact=exact)

    run(False)  # warm-up: kernels compiled
    run(True)
    out = {"tokens": n}
    for name, exact_ in (("encoder_only", False), ("exact", True)):
        # 3 runs each, the device idle at the start of each: the mean and the fastest, and the host's share —
        # the time until prefill() returns (it queues the work; only the logits read at the end waits)
        queued, total = [], []
        for _ in range(3):
            sync(device)
            t0 = time.perf_counter()
            run(exact_)
            queued.append(time.perf_counter() - t0)
            sync(device)
            total.append(time.perf_counter() - t0)
        out[f"{name}_ms"] = sum(total) / len(total) * 1e3
        out[f"{name}_queued_ms"], out[f"{name}_min_ms"] = min(queued) * 1e3, min(total) * 1e3
    out["encoder_over_exact"] = out["encoder_only_ms"] / out["exact_ms"]
    out["encoder_only_tok_s"] = n / (out["encoder_only_ms"] / 1e3)
    return out


def dsv41_ttft(model, n: int, device: str, idle_chunks: list[int]) -> dict:
    """Time to the first token of one n-token prompt through `Engine.step()` (scheduler, prefill pieces,
    sampling): with each `idle_prefill_chunk` (0: the engine's prefill_chunk of 2048 throughout) on the host path
    (`static_prefill=False`), then the engine's defaults (`static_ms`: whole runs from static steps)."""
    c = model.config
    ids = torch.randint(3, c.vocab_size, (n,)).tolist()
    out = {"tokens": n}
    for idle in [*idle_chunks, None]:
        static = idle is None
        engine = Engine(model, max_batch=1, max_seq_len=n + 16, max_tokens=n + 16, idle_prefill_chunk=idle,
                        static_prefill=static)

        def first_token() -> None:
            seq = engine.add_request(ids, SamplingParams(max_tokens=1))
            while not seq.finished:
                engine.step()

        first_token()  # warm-up: kernels compiled for these chunk shapes (and graphs captured)
        steps = engine.stats.steps
        name = "static" if static else f"idle_{idle}"
        out[f"{name}_ms"] = timed(first_token, device, 2) * 1e3
        out[f"{name}_steps"] = (engine.stats.steps - steps) / 2  # engine steps per prompt
    return out


# ---------------------------------------------------------------------------------------------- the peer
class PeerGraphStep:
    """Plain-torch decode step of the HF Llama's weights over a static KV cache, CUDA-graphable."""

    def __init__(self, hf, B: int, length: int, device: str):
        cfg = hf.config
        self.hf, self.B, self.L = hf, B, length
        self.kvh, self.hd, self.h = cfg.num_key_value_heads, cfg.head_dim, cfg.num_attention_heads
        self.G = self.h // self.kvh
        shape = (B, self.kvh, length, self.hd)
        self.k = [torch.randn(shape, device=device, dtype=torch.bfloat16) for _ in hf.model.layers]
        self.v = [torch.randn(shape, device=device, dtype=torch.bfloat16) for _ in hf.model.layers]
        self.tokens = torch.randint(3, cfg.vocab_size, (B, 1), device=device)
        self.pos = torch.zeros((), dtype=torch.long, device=device)
        self.inv_freq = hf.model.rotary_emb.inv_freq.to(device)
        self.ar = torch.arange(length, device=device)

    def _rope(self, x, cos, sin):
        half = x.size(-1) // 2
        x1, x2 = x[..., :half], x[..., half:]
        return x * cos + torch.cat((-x2, x1), -1) * sin

    @torch.no_grad()
    def step(self) -> torch.Tensor:
        B, hf = self.B, self.hf
        h = hf.model.embed_tokens(self.tokens)  # (B, 1, d)
        freqs = self.pos.float() * self.inv_freq
        emb = torch.cat((freqs, freqs), -1)
        cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
        mask = (self.ar <= self.pos).view(1, 1, 1, -1)
        for i, layer in enumerate(hf.model.layers):
            a = layer.self_attn
            x = layer.input_layernorm(h)
            q = a.q_proj(x).view(B, self.kvh, self.G, self.hd)  # heads grouped by their KV head
            k = a.k_proj(x).view(B, self.kvh, 1, self.hd)
            v = a.v_proj(x).view(B, self.kvh, 1, self.hd)
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            self.k[i].index_copy_(2, self.pos.view(1), k)
            self.v[i].index_copy_(2, self.pos.view(1), v)
            o = torch.nn.functional.scaled_dot_product_attention(q, self.k[i], self.v[i], attn_mask=mask)
            h = h + a.o_proj(o.reshape(B, 1, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        logits = hf.lm_head(hf.model.norm(h)).float()
        self.pos.add_(1)
        return logits


def peer_graph(hf, B: int, context: int, steps: int, device: str) -> dict:
    step = PeerGraphStep(hf, B, context + steps * 8 + 8, device)
    step.pos.fill_(context)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step.step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = step.step()

    def one():
        graph.replay()
        step.tokens.copy_(logits[:, -1].argmax(-1, keepdim=True))  # greedy, stays on the device
        step.tokens[0, 0].item()  # the token read back, as a server must

    for _ in range(3):
        one()
    t = timed(one, device, steps)
    return {"step_ms": t * 1e3, "tok_s": B / t}


def _prefilled_cache(hf, kind: str, B: int, context: int, length: int, device: str):
    from transformers import DynamicCache, StaticCache

    cfg = hf.config
    shape = (B, cfg.num_key_value_heads, context, cfg.head_dim)
    if kind == "dynamic":
        cache = DynamicCache(config=cfg)
        for i in range(cfg.num_hidden_layers):
            cache.update(torch.randn(shape, device=device, dtype=torch.bfloat16),
                         torch.randn(shape, device=device, dtype=torch.bfloat16), i)
        return cache
    cache = StaticCache(config=cfg, max_cache_len=length)
    for layer in cache.layers:
        layer.lazy_initialization(torch.zeros(B, cfg.num_key_value_heads, 1, cfg.head_dim, device=device,
                                              dtype=torch.bfloat16),
                                  torch.zeros(B, cfg.num_key_value_heads, 1, cfg.head_dim, device=device,
                                              dtype=torch.bfloat16))
        layer.keys[:, :, :context].normal_()
        layer.values[:, :, :context].normal_()
        layer.cumulative_length.fill_(context)
    return cache


def peer_hf(hf, B: int, context: int, steps: int, device: str, compiled: bool) -> dict:
    cache = _prefilled_cache(hf, "static" if compiled else "dynamic", B, context, context + steps * 8 + 8, device)
    forward = torch.compile(hf.forward, mode="reduce-overhead", fullgraph=True) if compiled else hf.forward
    tok = torch.randint(3, hf.config.vocab_size, (B, 1), device=device)
    pos = [context]

    @torch.no_grad()
    def one():
        out = forward(input_ids=tok, position_ids=torch.full((B, 1), pos[0], device=device),
                      past_key_values=cache, use_cache=True, logits_to_keep=1)
        tok.copy_(out.logits[:, -1].argmax(-1, keepdim=True))
        tok[0, 0].item()
        pos[0] += 1

    t_compile = timed(one, device)  # first call compiles
    for _ in range(3):
        one()
    t = timed(one, device, steps)
    return {"step_ms": t * 1e3, "tok_s": B / t, "first_call_s": t_compile}


def peer_prefill(hf, n: int, device: str) -> dict:
    ids = torch.randint(3, hf.config.vocab_size, (1, n), device=device)

    @torch.no_grad()
    def run():
        hf(input_ids=ids, use_cache=True, logits_to_keep=1)

    run()
    t = timed(run, device)
    return {"tokens": n, "ms": t * 1e3, "tok_s": n / t}


# ---------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 16, 64])
    ap.add_argument("--contexts", type=int, nargs="*", default=[4096, 32768, 131072],
                    help="decode contexts (none: prefill only)")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prefill", type=int, nargs="*", default=[8192, 32768])
    ap.add_argument("--prefill-chunk", type=int, nargs="+", default=[8192],
                    help="prefill chunk sizes to time (each prompt at each; the fastest encoder-only one is reported)")
    ap.add_argument("--compile-cells", nargs="*", default=["1x4096", "64x32768"],
                    help="BxT cells where the peer's torch.compile path runs (each compile costs minutes)")
    ap.add_argument("--overlap-cells", nargs="*", default=["64x4096", "1x4096", "64x32768"],
                    help="BxT cells where dsv41 also runs with Engine(overlap=True) (the next step launched first)")
    ap.add_argument("--ttft", type=int, nargs="*", default=[32768],
                    help="prompt lengths whose time to first token through Engine.step() is measured, with the idle "
                         "prefill chunk off (0) and at its default")
    ap.add_argument("--profile-prefill", type=int, nargs="*", default=None,
                    help="prompt lengths whose prefill is profiled (default: the longest --prefill)")
    ap.add_argument("--profile-exact", action="store_true", help="profile exact prefill too")
    ap.add_argument("--static-prefill", action="store_true",
                    help="also time each --prefill prompt through StaticPrefill (static steps, CUDA graphs)")
    ap.add_argument("--topk-method", choices=("auto", "keys", "threshold"), default=None,
                    help="the indexer's top-k method for this run (default: the library's, TOPK_METHOD)")
    ap.add_argument("--no-peer", action="store_true", help="dsv41 only (no transformers needed)")
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--profile", nargs="*", default=["64x32768"], help="BxT cells to profile (eager step)")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("peer_decode: no CUDA device (use --device cpu for a smoke run)", file=sys.stderr)
        return 2
    device = args.device
    if args.topk_method:
        from dsv41.kernels.triton import indexer as triton_indexer

        triton_indexer.TOPK_METHOD = args.topk_method
    torch.manual_seed(0)
    config = load_config(args.preset)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = cast_for_engine(Transformer(config).init_weights(seed=0).to(device), dtype).eval()
    report = {"benchmark": "peer_decode", "date": dt.date.today().isoformat(), "preset": args.preset,
              "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
              "torch": torch.__version__, "topk_method": args.topk_method or "default",
              "dsv41_active_params": compute(config)["active_params_decode"],
              "dsv41_kv_bytes_per_token": compute(config)["global_kv_bytes_per_token"],
              "ceilings": ceilings(device), "cells": [], "prefill": [], "profile": [], "errors": []}
    hf = None
    if not args.no_peer:
        from transformers import LlamaForCausalLM

        hf = LlamaForCausalLM(peer_config(config, max(args.contexts + args.prefill + [4096]) * 2))
        hf = hf.to(device=device, dtype=torch.bfloat16).eval()
        pc = hf.config
        report["peer"] = {"params": count_params(hf), "layers": pc.num_hidden_layers, "hidden": pc.hidden_size,
                          "kv_heads": pc.num_key_value_heads, "head_dim": pc.head_dim,
                          "kv_bytes_per_token": 2 * pc.num_hidden_layers * pc.num_key_value_heads * pc.head_dim * 2}
    print(json.dumps({k: report[k] for k in ("device", "ceilings", "dsv41_active_params")}, default=str))
    path = dated_path(args.out, "peer_decode", report["date"])

    def save() -> None:  # after every cell: a run cut short keeps what it measured
        path.write_text(json.dumps(report, indent=1, default=str))

    def attempt(what: str, fn):
        try:
            return fn()
        except Exception as err:  # noqa: BLE001 - a failed cell is reported, the run goes on
            traceback.print_exc()
            report["errors"].append(f"{what}: {type(err).__name__}: {err}"[:500])
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
            return None

    for T in args.contexts:
        for B in args.batches:
            cell = {"batch": B, "context": T}
            cell["dsv41"] = attempt(f"dsv41 {B}x{T}", lambda: dsv41_decode(model, B, T, args.steps, device,
                                                                            not args.no_graphs and device != "cpu"))
            if f"{B}x{T}" in args.overlap_cells:
                cell["dsv41_overlap"] = attempt(f"dsv41 overlap {B}x{T}", lambda: dsv41_decode(
                    model, B, T, args.steps, device, not args.no_graphs and device != "cpu", overlap=True))
            if hf is not None:
                cell["peer_graph"] = attempt(f"peer graph {B}x{T}", lambda: peer_graph(hf, B, T, args.steps, device))
                cell["peer_eager_dynamic"] = attempt(f"peer eager {B}x{T}",
                                                     lambda: peer_hf(hf, B, T, max(4, args.steps // 4), device, False))
                if f"{B}x{T}" in args.compile_cells:
                    cell["peer_compile_static"] = attempt(f"peer compile {B}x{T}",
                                                          lambda: peer_hf(hf, B, T, args.steps, device, True))
            ours = (cell.get("dsv41") or {}).get("tok_s")
            overlapped = (cell.get("dsv41_overlap") or {}).get("tok_s")
            for k in ("peer_graph", "peer_eager_dynamic", "peer_compile_static"):
                theirs = (cell.get(k) or {}).get("tok_s")
                if ours and theirs:
                    cell[f"ratio_vs_{k}"] = ours / theirs
                if overlapped and theirs:
                    cell[f"overlap_ratio_vs_{k}"] = overlapped / theirs
            report["cells"].append(cell)
            save()
            print(json.dumps(cell, default=lambda v: round(v, 4) if isinstance(v, float) else v))
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
    best_chunk = {}
    for n in args.prefill:
        by_chunk = [r for r in (attempt(f"dsv41 prefill {n} chunk {c}", lambda c=c: {
            "chunk": c, **dsv41_prefill(model, n, device, c)}) for c in args.prefill_chunk) if r]
        row = {"tokens": n, "dsv41": min(by_chunk, key=lambda r: r["encoder_only_ms"]) if by_chunk else None,
               "by_chunk": by_chunk}
        best_chunk[n] = row["dsv41"]["chunk"] if row["dsv41"] else args.prefill_chunk[0]
        if args.static_prefill:
            row["dsv41_static"] = attempt(f"dsv41 static prefill {n}", lambda: dsv41_static_prefill(
                model, n, device, max(2048, IDLE_PREFILL_CHUNK)))  # the engine's largest piece
        if hf is not None:
            row["peer"] = attempt(f"peer prefill {n}", lambda: peer_prefill(hf, n, device))
            if row["dsv41"] and row["peer"]:
                row["encoder_only_vs_peer_throughput"] = row["dsv41"]["encoder_only_tok_s"] / row["peer"]["tok_s"]
            if row.get("dsv41_static") and row["peer"]:
                row["static_vs_peer_throughput"] = row["dsv41_static"]["static_tok_s"] / row["peer"]["tok_s"]
        report["prefill"].append(row)
        save()
        print(json.dumps(row, default=str))
    for n in args.ttft:
        row = attempt(f"dsv41 ttft {n}", lambda: dsv41_ttft(model, n, device, [0, max(2048, IDLE_PREFILL_CHUNK)]))
        if row:
            report.setdefault("ttft", []).append(row)
            save()
            print("ttft", json.dumps(row, default=lambda v: round(v, 2) if isinstance(v, float) else v))
    profiled = args.profile_prefill if args.profile_prefill is not None else args.prefill[-1:] and [max(args.prefill)]
    for n in profiled if device.startswith("cuda") else []:
        for exact in (False, True) if args.profile_exact else (False,):
            prof = attempt(f"prefill profile {n}", lambda: dsv41_prefill_profile(
                model, n, device, best_chunk.get(n, args.prefill_chunk[-1]), exact))
            if prof:
                if "prefill_profile" not in report:  # the first one (encoder-only at the longest prompt)
                    report["prefill_profile"] = prof
                else:
                    report.setdefault("prefill_profiles", []).append(prof)
                save()
                print(json.dumps(prof, default=lambda v: round(v, 2) if isinstance(v, float) else v))
    for cell in args.profile:
        B, T = (int(v) for v in cell.split("x"))
        if device.startswith("cuda"):
            prof = attempt(f"profile {cell}", lambda: dsv41_profile(model, B, T, device))
            if prof:
                report["profile"].append(prof)
                save()
                print(json.dumps(prof, default=lambda v: round(v, 2) if isinstance(v, float) else v))
    save()
    print(f"wrote {path}")
    print_table(report)
    return 0


def print_table(report: dict) -> None:
    print(f"{'B':>4} {'ctx':>7} {'dsv41 tok/s':>12} {'graph peer':>11} {'eager peer':>11} {'compiled':>9} "
          f"{'÷graph':>7} {'÷eager':>7} {'÷compiled':>9}")
    f = lambda d, k="tok_s": f"{d[k]:.0f}" if d and k in d else "-"
    r = lambda c, k: f"{c[k]:.2f}" if k in c else "-"
    for c in report["cells"]:
        print(f"{c['batch']:>4} {c['context']:>7} {f(c.get('dsv41')):>12} {f(c.get('peer_graph')):>11} "
              f"{f(c.get('peer_eager_dynamic')):>11} {f(c.get('peer_compile_static')):>9} "
              f"{r(c, 'ratio_vs_peer_graph'):>7} {r(c, 'ratio_vs_peer_eager_dynamic'):>7} "
              f"{r(c, 'ratio_vs_peer_compile_static'):>9}")
    for p in report["prefill"]:
        print("prefill", json.dumps(p, default=lambda v: round(v, 3) if isinstance(v, float) else v))
    if report["errors"]:
        print("errors:", *report["errors"], sep="\n  ")


if __name__ == "__main__":
    sys.exit(main())
