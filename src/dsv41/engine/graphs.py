"""CUDA graphs of the static decode step, one per (batch bucket, entry bound).

A decode step of B sequences is padded to the next batch bucket (1, 2, 4, …, max_batch) with rows
of the dummy slot, and the indexer's entry bound of every kv source is rounded up to a power of
two (at least `min_entries`): the step's shapes then depend only on that key, and the graph
captured for it the first time it is needed is replayed for every later step with that key
(vLLM's and SGLang's decode graphs). Every input is read from `DecodeIO`'s persistent device
buffer and the logits land in its persistent output, so a replay needs only the one host → device
copy the engine makes anyway. All graphs share one memory pool (they never run concurrently, and
nothing allocated inside them outlives a replay).

Capture runs the step twice on an all-padding batch first (compiles and loads every kernel for the
shapes, outside the capture), then captures; real inputs are restored before the first replay.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from dsv41.engine.runner import DecodeIO, Runner


def batch_buckets(max_batch: int) -> list[int]:
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


def bucket(n: int, buckets: list[int]) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"batch of {n} rows is larger than the largest bucket {buckets[-1]}")


def entry_bound(n: int, minimum: int) -> int:
    """Power-of-two bound ≥ max(n, minimum)."""
    n = max(int(n), int(minimum), 1)
    return 1 << (n - 1).bit_length()


def reachable_bounds(ratios: dict[int, int], max_tokens: int, minimum: int) -> list[dict[int, int]]:
    """Every entry-bound key a step of sequences of at most `max_tokens` tokens can have: per kv source s (its
    compression ratio ratios[s]) the power-of-two bound ≥ its entries, at least `minimum` — one dict per distinct
    key, in order of length. A sequence of L tokens holds ⌊L / ratio⌋ entries of a source (its complete groups;
    the key of the batch is its longest row's); the key is a step function of L that changes only where some
    source's entries pass a power of two."""
    def key(n_tokens: int) -> dict[int, int]:
        return {s: entry_bound(n_tokens // m, minimum) for s, m in sorted(ratios.items())}

    lengths = {0, max(0, max_tokens)}
    for m in set(ratios.values()):
        b = 1
        while m * (b + 1) <= max_tokens:  # the first length whose entries pass b: m·(b + 1) tokens
            lengths.add(m * (b + 1))
            b *= 2
    out: list[dict[int, int]] = []
    for n in sorted(lengths):
        if not out or key(n) != out[-1]:
            out.append(key(n))
    return out


class DecodeGraphs:
    def __init__(self, runner: Runner, io: DecodeIO, *, min_entries: int = 1024):
        if io.pools.device.type != "cuda":
            raise ValueError("CUDA graphs need the engine's pools on a CUDA device")
        self.runner, self.io = runner, io
        self.buckets = batch_buckets(io.max_batch)
        self.min_entries = min_entries
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.captures = 0

    def shape(self, B: int, n_entries: dict[int, int]) -> tuple[int, dict[int, int]]:
        """The padded batch and entry bounds a step of B rows runs at."""
        return bucket(B, self.buckets), {s: entry_bound(n, self.min_entries) for s, n in n_entries.items()}

    def run(self, B: int, n_max: dict[int, int], *, lean: bool = False) -> Tensor:
        """Replay (capturing first if needed) the step for the padded shape; io.logits[:B].
        The caller has padded rows [B, bucket) and sent the inputs. lean: the step's variant that writes no
        features (`Runner.decode(features=False)`; a drafter engine's plain step far from its next draft)."""
        self.ensure(bucket(B, self.buckets), n_max, lean=lean).replay()
        return self.io.logits[:B]

    def restore(self, B: int) -> None:
        """Replay (capturing first if needed) the rollback of the last verification step (`Runner.restore`)
        for the padded batch of B rows; the caller has sent the keep counts (`DecodeIO.send_keep`)."""
        self.ensure(bucket(B, self.buckets), None).replay()

    def ensure(self, Bb: int, n_max: dict[int, int] | None, *, lean: bool = False) -> torch.cuda.CUDAGraph:
        """The graph of bucket Bb and entry bounds n_max (None: the rollback's), captured now if it was not yet
        (as `dspark_drafter.StepGraphs.ensure`; `Engine.capture_decode_graphs` calls it ahead of the steps)."""
        key = ("restore", Bb) if n_max is None else (Bb, tuple(sorted(n_max.items())), lean)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = self._capture(Bb, n_max, lean)
        return graph

    def _capture(self, Bb: int, n_max: dict[int, int] | None, lean: bool = False) -> torch.cuda.CUDAGraph:
        """The step (n_max None: the rollback) of Bb rows, captured on all-padding inputs."""
        io = self.io
        real, real_keep = io.device.clone(), io.keep_device.clone()
        io.device.copy_(io.pad_device)  # every row a dummy: warm-up writes touch no sequence
        io.keep_device.fill_(io.T)
        try:  # the real inputs back whatever happens (a failed capture: the caller runs them eagerly)
            if n_max is None:
                graph = capture_graph(lambda: self.runner.restore(io, Bb), self.pool)
            else:
                graph = capture_graph(lambda: self.runner.decode(io, Bb, n_max, features=not lean), self.pool)
        finally:
            io.device.copy_(real)
            io.keep_device.copy_(real_keep)
        self.captures += 1
        return graph


def capture_graph(step: Callable[[], object], pool, retries: int = 1) -> torch.cuda.CUDAGraph:
    """`step` captured into a CUDA graph in `pool`: two warm-up runs on a side stream first (kernels
    compiled and loaded, lazy set-up done outside the capture), then the capture, thread-local (the
    prefix cache's writer thread may copy rows to the host meanwhile). The caller makes the warm-up
    runs harmless (padding inputs). A capture that fails is tried again `retries` times after the caching
    allocator has released its free blocks: an allocation that the allocator can only serve by freeing cached
    memory synchronizes, which a capture refuses (seen once on the H100, 2026-12-06: the first capture at
    64 × 128K, after the synthetic fill of 8.4M tokens, failed with "operation not permitted when stream is
    capturing"; the next engine's capture of the same shape succeeded)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    attempt = 0
    while True:
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                step()
            return graph
        except RuntimeError:
            if attempt == retries:
                raise
        attempt += 1
        del graph
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
