"""Benchmark cases of the lightning indexer (SPEC §3) at the v41-flash sizes: Hi = 32 heads, Di = 128,
top-k 512, candidate blocks of 8 (2048 kept), keys in 256-row pages of 68-byte rows.

Scores are memory-bound by design: work = bytes read once + written once = N·68 key bytes + 4N score
bytes (+ 4N/8 of block maxima), ceiling "copy". The pool holds every sequence's keys in shuffled pages
(1M keys = 68 MB, more than the 60 MB L2; the B = 4 cases read 4× that). The Reindex case scores
2048 blocks × 8 entries per query (page gathers of 544-byte runs). Top-k reads the scores (4N bytes)
— the floor is ~1 µs at 1M, far below its launch and single-program merge latency (see the notes).
The torch twins dequantize all keys to fp32 and run `Indexer.scores` head by head, `torch.sort`.
"""

from __future__ import annotations

import torch

from dsv41.kernels.ref import indexer as twin
from dsv41.kernels.triton import indexer as fused
from dsv41.quant.fp4 import INDEX_BLOCK, fake_quant_index_fp4, quantize_fp4

HI, DI, TOPK, PAGE_ROWS, BLOCK, KEEP_BLOCKS = 32, 128, 512, 256, 8, 2048
ROW_BYTES = DI // 2 + DI // 32
QUANTIZE = True  # benchmarks/sass.py sets False: random bytes build fast, and values never matter for compiling


def _pool(n_pages: int, g: torch.Generator, device: torch.device) -> torch.Tensor:
    """(n_pages, PAGE_ROWS, 68) uint8 of random keys, quantized in slices (bounded temporaries)."""
    out = []
    n = n_pages * PAGE_ROWS
    if not QUANTIZE:
        return torch.randint(0, 256, (n_pages, PAGE_ROWS, ROW_BYTES), generator=g, device=device, dtype=torch.uint8)
    for i in range(0, n, 1 << 20):
        x = torch.randn(min(1 << 20, n - i), DI, generator=g, device=device)
        packed, scales = quantize_fp4(x, INDEX_BLOCK, "e8m0")
        out.append(torch.cat((packed, scales), dim=-1))
    return torch.cat(out).view(n_pages, PAGE_ROWS, ROW_BYTES)


def _inputs(B: int, T: int, n_keys: int, g: torch.Generator, device: torch.device) -> dict:
    pages_per_seq = -(-n_keys // PAGE_ROWS)
    n_pages = B * pages_per_seq + 8
    pool = _pool(n_pages, g, device)
    page_table = torch.randperm(n_pages, generator=g, device=device)[:B * pages_per_seq].view(B, -1).int()
    q = fake_quant_index_fp4(torch.randn(B, T, HI, DI, generator=g, device=device)).bfloat16()
    weights = torch.randn(B, T, HI, generator=g, device=device) * (DI * HI) ** -0.5
    n_keys_t = torch.full((B,), n_keys, device=device)
    visible_end = n_keys_t.view(B, 1) - (T - 1) + torch.arange(T, device=device)  # the last T positions
    return dict(q=q, weights=weights, key_pool=pool, page_table=page_table, page_rows=PAGE_ROWS,
                n_keys=n_keys_t, visible_end=visible_end)


def _scores_case(name: str, B: int, n_keys: int, block_size: int, device: torch.device, note: str,
                 **knobs) -> dict:
    g = torch.Generator(device=device).manual_seed(B * 31 + n_keys)
    args = _inputs(B, 1, n_keys, g, device)
    n_bmax = -(-n_keys // block_size) if block_size else 0
    work = B * (n_keys * (ROW_BYTES + 4) + 4 * n_bmax)

    @torch.no_grad()
    def run_triton():
        fused.indexer_scores(**args, n_max=n_keys, block_size=block_size, **knobs)

    @torch.no_grad()
    def run_torch():
        twin.indexer_scores(**args, n_max=n_keys, block_size=block_size)

    mma = knobs.get("mma", fused.DEFAULT_MMA)
    return dict(name=name, shape=f"B={B} T=1 Hi={HI} Di={DI} N={n_keys} block={block_size or '-'} mma={mma}",
                unit="byte", work=work, ceiling="copy", triton=run_triton, torch=run_torch, note=note,
                sweep=lambda **kn: fused.indexer_scores(**args, n_max=n_keys, block_size=block_size, **kn))


def _prefill_case(device: torch.device) -> dict:
    B, T, n_keys = 1, 256, 1 << 16
    g = torch.Generator(device=device).manual_seed(T)
    args = _inputs(B, T, n_keys, g, device)
    work = 2 * HI * DI * int(args["visible_end"].clamp(max=n_keys).sum())  # causal: the visible keys only

    @torch.no_grad()
    def run_triton():
        fused.indexer_scores(**args, n_max=n_keys, block_size=BLOCK)

    @torch.no_grad()
    def run_torch():
        twin.indexer_scores(**args, n_max=n_keys, block_size=BLOCK)

    return dict(name="scores prefill T=256", shape=f"B={B} T={T} Hi={HI} Di={DI} N={n_keys} block={BLOCK}",
                unit="flop", work=work, ceiling="matmul", triton=run_triton, torch=run_torch,
                note="2 queries per program (N = 64 of the dot), keys re-read T/2 times from L2: FP8 MMA + "
                     "decode ALU bound; ceiling is the bf16 matmul peak (FP8 would be 2×)",
                sweep=lambda **kn: fused.indexer_scores(**args, n_max=n_keys, block_size=BLOCK, **kn))


def _blocks_case(device: torch.device) -> dict:
    B, n_keys = 16, 1 << 20
    g = torch.Generator(device=device).manual_seed(B)
    args = _inputs(B, 1, n_keys, g, device)
    n_blocks = n_keys // BLOCK
    blocks = torch.stack([torch.randperm(n_blocks, generator=g, device=device)[:KEEP_BLOCKS].sort().values
                          for _ in range(B)]).view(B, 1, KEEP_BLOCKS)
    cols = KEEP_BLOCKS * BLOCK
    work = B * cols * (ROW_BYTES + 4) + blocks.numel() * 8

    @torch.no_grad()
    def run_triton():
        fused.indexer_scores_blocks(**args, blocks=blocks, block_size=BLOCK)

    @torch.no_grad()
    def run_torch():
        twin.indexer_scores_blocks(**args, blocks=blocks, block_size=BLOCK)

    return dict(name="scores Reindex blocks B=16", shape=f"B={B} T=1 Hi={HI} Di={DI} {KEEP_BLOCKS}×{BLOCK} entries",
                unit="byte", work=work, ceiling="copy", triton=run_triton, torch=run_torch,
                note="per-entry page lookups, 544-byte runs scattered over 1M-key sequences; 128 programs "
                     "per query: latency of the gathers",
                sweep=lambda **kn: fused.indexer_scores_blocks(**args, blocks=blocks, block_size=BLOCK, **kn))


def _topk_case(name: str, rows: int, N: int, k: int, device: torch.device, note: str, method: str = "keys") -> dict:
    g = torch.Generator(device=device).manual_seed(N + k)
    scores = torch.randn(1, rows, N, generator=g, device=device).relu()  # relu-like: many exact zeros
    scores[..., N - N // 16:] = float("-inf")  # a causal tail nobody sees yet

    @torch.no_grad()
    def run_triton():
        fused.topk_indices(scores, k, method=method)

    @torch.no_grad()
    def run_torch():
        twin.topk_indices(scores, k)

    return dict(name=name, shape=f"rows={rows} N={N} k={k}", unit="byte", work=4 * rows * N, ceiling="copy",
                triton=run_triton, torch=run_torch, note=note)


def cases(device: torch.device) -> list[dict]:
    return [
        _scores_case("scores decode 1M", 1, 1 << 20, 0, device,
                     "the report target: 72 MB, ~17 µs at copy speed; FP8 MMA, ~300 thread-instructions per "
                     "key vs ~540 issue slots: decode ALU and memory overlap"),
        _scores_case("scores decode 1M bf16", 1, 1 << 20, 0, device,
                     "the bf16 MMA path (prmt decode + bf16 scale): ~420 instructions per key, nearer the "
                     "issue limit", mma="bf16"),
        _scores_case("scores decode B=4 512K block max", 4, 1 << 19, BLOCK, device,
                     "ratio-2 layer of 4 sequences with the candidate block maxima (272 MB read)"),
        _prefill_case(device),
        _blocks_case(device),
        _topk_case("topk 1M k=512", 1, 1 << 20, TOPK, device,
                   "order-key pass (8 MB written) + torch.topk radix select over int64 keys + a k-sort"),
        _topk_case("topk B=64 128K k=512", 64, 1 << 17, TOPK, device,
                   "64 decode rows at 128K keys"),
        _topk_case("select blocks 128K k=2048", 1, 1 << 17, KEEP_BLOCKS, device,
                   "candidate blocks of a 1M-key context: keys kernel + radix select"),
        # method "threshold": fp32 radix select for the k-th value + the pick kernel (ties in column order)
        _topk_case("topk 1M k=512 threshold", 1, 1 << 20, TOPK, device, "fp32 torch.topk + _pick_kernel",
                   method="threshold"),
        _topk_case("topk B=64 128K k=512 threshold", 64, 1 << 17, TOPK, device, "fp32 torch.topk + _pick_kernel",
                   method="threshold"),
        _topk_case("topk B=64 4K k=128 keys", 64, 1 << 12, 128, device, "the `small` decode step's top-k"),
        _topk_case("topk B=64 4K k=128 threshold", 64, 1 << 12, 128, device, "the `small` decode step's top-k",
                   method="threshold"),
        _topk_case("topk prefill 32K×32K k=128 keys", 32768, 1 << 15, 128, device, "a 32K prefill chunk at ratio 1"),
        _topk_case("topk prefill 32K×32K k=128 threshold", 32768, 1 << 15, 128, device,
                   "a 32K prefill chunk at ratio 1", method="threshold"),
    ]
