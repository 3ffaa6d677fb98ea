"""Benchmark cases of the sparse attention (SPEC §3) at the v41-flash sizes: H = 64, D = 512,
window 128, top-k 512, bf16 queries.

Work counts 4·H·D FLOPs per (query, visible key) — QK and PV — with 128 visible window keys and
512 valid entries per query (640 keys). Each sequence's page table points at 256 random pages of
256 entries (64K entries) in a shared pool of at least 1M entries (~300 MB, several times the L2),
so the top-k gathers are scattered 288-byte rows. The torch twin dequantizes the window and the
gathered entries to fp32 and runs `attend_gathered` (einsums).
"""

from __future__ import annotations

import torch

from dsv41.kernels.ref import attention as twin
from dsv41.kernels.triton import attention as fused
from dsv41.quant.fp4 import KV_BLOCK, quantize_fp4
from dsv41.quant.fp8 import quantize_fp8

H, D, W, K, PAGE_ROWS = 64, 512, 128, 512, 256
PAGES_PER_SEQ = 256  # 64K entries per sequence
MIN_POOL_PAGES = 4096  # 1M entries, ~300 MB


def _rows(fmt: str, n: int, g: torch.Generator, device: torch.device, D: int = D) -> torch.Tensor:
    """n random rows in a cache format, quantized in slices (bounded temporaries)."""
    out = []
    for i in range(0, n, 1 << 18):
        x = torch.randn(min(1 << 18, n - i), D, generator=g, device=device)
        x = x * torch.exp(torch.randn(x.size(0), 1, generator=g, device=device))
        values, scales = quantize_fp8(x) if fmt == "fp8" else quantize_fp4(x, KV_BLOCK, "e4m3")
        out.append(torch.cat((values, scales), dim=-1))
    return torch.cat(out)


def _case(name: str, B: int, T: int, device: torch.device, note: str) -> dict:
    g = torch.Generator(device=device).manual_seed(B * 7919 + T)
    start = 1 << 16  # every sequence is 64K tokens in
    q_pos = start + torch.arange(T, device=device).expand(B, T).contiguous()
    q = torch.randn(B, T, H, D, generator=g, device=device).bfloat16()
    sink = torch.randn(H, generator=g, device=device)
    ring_ids = torch.randperm(B, generator=g, device=device)
    last = start if T == 1 else start - 1  # decode: the step's own key is already in the ring
    positions = torch.arange(last - W + 1, last + 1, device=device)  # the ring is full
    ring_pos = torch.empty(W, dtype=torch.long, device=device)
    ring_pos[positions % W] = positions  # slot = position % W
    ring_pos = ring_pos.expand(B, W).contiguous()
    ring_kv = _rows("fp8", B * W, g, device).view(B, W, -1)
    chunk_kv = _rows("fp8", B * T, g, device).view(B, T, -1) if T > 1 else None
    n_pages = max(MIN_POOL_PAGES, B * PAGES_PER_SEQ)
    pool = _rows("fp4", n_pages * PAGE_ROWS, g, device)  # (rows, 288)
    page_table = torch.stack([torch.randperm(n_pages, generator=g, device=device)[:PAGES_PER_SEQ]
                              for _ in range(B)]).int()
    topk = torch.randint(0, PAGES_PER_SEQ * PAGE_ROWS, (B, T, K), generator=g, device=device)
    args = dict(q=q, q_pos=q_pos, sink=sink, scale=D ** -0.5, window=W, ring_kv=ring_kv, ring_pos=ring_pos,
                ring_ids=ring_ids, chunk_kv=chunk_kv, entry_pool=pool, page_table=page_table,
                page_rows=PAGE_ROWS, topk=topk)

    # visible window keys per query (128 by construction), + K entries each
    kpos = torch.cat((ring_pos, q_pos) if T > 1 else (ring_pos,), dim=1)[:, None, :]
    qp = q_pos[:, :, None]
    visible = int(((kpos >= 0) & (kpos <= qp) & (kpos > qp - W)).sum()) + B * T * K
    return _entry(name, f"B={B} T={T} H={H} D={D} window={W} top-k={K} ({W + K} keys/query), bf16 q",
                  4 * H * D * visible, args, note)


def _entry(name: str, shape: str, work: int, args: dict, note: str) -> dict:
    """A case of `benchmarks/kernels.py` (and `sweep.py`) calling the kernel and its twin on `args`."""

    @torch.no_grad()
    def run_triton():
        fused.sparse_attention(**args)

    @torch.no_grad()
    def run_torch():
        twin.sparse_attention(**args)

    return dict(name=name, shape=shape, unit="flop", work=work, ceiling="matmul", triton=run_triton,
                torch=run_torch, note=note, sweep=lambda **knobs: fused.sparse_attention(**args, **knobs))


def _small_prefill_case(name: str, T: int, device: torch.device, note: str, *, ring: bool = True,
                        chunk: bool = True, entries: bool = True) -> dict:
    """The `small` preset's encoder prefill from an empty cache (H = 6, D = 128, window 128, top-k 128 of the
    T/2 entries of a ratio-2 layer): one prompt of T tokens, the ring of its slot empty (as the engine passes
    it), with parts left out to see where the time goes."""
    h, d, k, page_rows = 6, 128, 128, 256
    g = torch.Generator(device=device).manual_seed(T)
    q_pos = torch.arange(T, device=device)[None].contiguous()
    q = torch.randn(1, T, h, d, generator=g, device=device).bfloat16()
    sink = torch.randn(h, generator=g, device=device)
    n_entries = T // 2
    n_pages = -(-n_entries // page_rows)
    args = dict(q=q, q_pos=q_pos, sink=sink, scale=d ** -0.5, window=W)
    if ring:
        args.update(ring_kv=_rows("fp8", W, g, device, d).view(1, W, -1),
                    ring_pos=torch.full((1, W), -1, dtype=torch.long, device=device))
    if chunk:
        args.update(chunk_kv=_rows("fp8", T, g, device, d).view(1, T, -1))
    if entries:
        # causal top-k: query t picks among the entries complete by t (t // 2 of them), −1 beyond
        avail = (torch.arange(T, device=device) // 2 + 1)[:, None]
        topk = (torch.rand(T, k, generator=g, device=device) * avail).long()
        topk = torch.where(torch.arange(k, device=device)[None] < avail, topk, -1)[None]
        args.update(entry_pool=_rows("fp4", n_pages * page_rows, g, device, d), page_rows=page_rows,
                    page_table=torch.randperm(n_pages, generator=g, device=device)[None].int(), topk=topk)
    visible = (min(T, W) * (min(T, W) + 1) // 2 + max(0, T - W) * W) if chunk else 0
    if entries:
        visible += int((args["topk"] >= 0).sum())
    parts = "+".join(p for p, on in (("ring", ring), ("chunk", chunk), ("entries", entries)) if on)
    return _entry(name, f"B=1 T={T} H={h} D={d} window={W} top-k={k} ({parts}), bf16 q", 4 * h * d * visible, args,
                  note)


def cases(device: torch.device) -> list[dict]:
    return [
        _case("decode B=1", 1, 1, device,
              "one query: 10 splits of 64 keys + combine, page-gather latency bound"),
        _case("decode B=64", 64, 1, device,
              "2 key splits → 128 programs + combine (fp32 partials, 16 MB); QK streams q in 128-wide "
              "chunks from L2 per 64-key tile, PV decodes the keys again; bf16 wgmma at M = 64 heads"),
        _case("decode B=128", 128, 1, device, "128 programs, one per query, no split"),
        _case("prefill B=1 T=1024", 1, 1024, device,
              "one program per query: ring (2 tiles, mostly masked) + its band of the chunk (2 tiles) + 8 entry tiles"),
        _small_prefill_case("small prefill T=16K", 16384, device, "the engine's call: empty ring, chunk band, entries"),
        _small_prefill_case("small prefill T=16K chunk+entries", 16384, device, "no ring", ring=False),
        _small_prefill_case("small prefill T=16K chunk", 16384, device, "window only", ring=False, entries=False),
        _small_prefill_case("small prefill T=16K entries", 16384, device, "entries only", ring=False, chunk=False),
    ]
