"""Encoder-only prefill of one prompt from static steps, replayed from CUDA graphs on CUDA (a first cut).

The host-driven prefill (`prefill.PrefillJob`) launches ~820 kernels per prompt whatever its length; on the
H200 that host work is most of its wall time (2026-12-04: 68.7 ms for 8.6 ms of kernels at 8K,
docs/benchmarks.md). Here the same function is computed from the static step (`Runner.static_layers`,
`Runner.static_produce`, `DecodeIO`): the prompt is cut into chunks of `chunk` tokens, each through the
encoder layers and the decoder's kv-source compression, then the decoder's bounded replay of the last window
from the encoder's tail, then the head. Every chunk of the full size and the replay of a full window run from
a CUDA graph keyed by their entry bounds (powers of two, as the decode graphs); a shorter last chunk or window
runs eagerly. Plain text prompts only: no images, no encoder replay of cached tokens, no decoder windows kept
from an earlier turn (`PrefillJob` handles those). Not yet used by the engine: `benchmarks/peer_decode.py
--static-prefill` times it beside the host-driven prefill.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dsv41.engine.block_manager import BlockManager
from dsv41.engine.cache import SequenceCache
from dsv41.engine.graphs import capture_graph, entry_bound
from dsv41.engine.prefill import encoder_only_supported
from dsv41.engine.runner import DecodeIO, Runner
from dsv41.plan import FULL


class StaticPrefill:
    """prefill(runner, seq, tokens) for plain prompts, from static steps (see the module docstring).
    graphs: replay full chunks and full windows from CUDA graphs (default: on CUDA pools)."""

    def __init__(self, runner: Runner, pools: BlockManager, *, chunk: int = 8192, graphs: bool | None = None,
                 min_entries: int = 1024):
        if not encoder_only_supported(runner):
            raise ValueError("StaticPrefill runs encoder-only prefill; this model has no encoder / decoder split")
        if chunk < 1:
            raise ValueError(f"StaticPrefill: chunk must be >= 1, got {chunk}")
        c = runner.config
        self.runner, self.pools, self.chunk, self.config = runner, pools, chunk, c
        self.graphs = pools.device.type == "cuda" if graphs is None else graphs
        if self.graphs and pools.device.type != "cuda":
            raise ValueError("StaticPrefill: CUDA graphs need CUDA pools")
        self.min_entries = min_entries
        self._ios: dict[int, DecodeIO] = {}
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, tuple[Tensor, ...]]] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.graphs else None
        self._replay_in: tuple[Tensor, Tensor] | None = None  # the window's streams, where its graph reads them
        self.captures = 0

    def _io(self, T: int) -> DecodeIO:
        if T not in self._ios:
            self._ios[T] = DecodeIO(self.config, self.pools, 1, T, last_only=True)
        return self._ios[T]

    @torch.no_grad()
    def __call__(self, seq: SequenceCache, tokens: list[int]) -> Tensor:
        """Process `tokens` after what seq holds; the last position's logits (vocab,) fp32."""
        if not tokens:
            raise ValueError("prefill needs at least one token")
        runner, W = self.runner, self.config.window_size
        n_win = min(W, len(tokens))
        tail: list[tuple[Tensor, Tensor]] = []
        for lo in range(0, len(tokens), self.chunk):
            piece = tokens[lo:lo + self.chunk]
            io = self._io(len(piece))
            io.wait_sent()  # the last copy out of its pinned host buffer is done before it is written again
            io.fill_batch([seq], [piece])
            io.send()
            h, pre = self._run(io, "encoder", len(piece) == self.chunk)
            seq.tokens.extend(piece)
            tail.append((h[:, -n_win:].clone(), pre[:, -n_win:].clone()))  # a graph's outputs: its next replay
        h = torch.cat([t[0] for t in tail], dim=1)[:, -n_win:]
        pre = torch.cat([t[1] for t in tail], dim=1)[:, -n_win:]
        rio = self._io(n_win)
        rio.wait_sent()
        rio.fill_batch([seq], [seq.tokens[-n_win:]], positions=[seq.n_tokens - n_win], reserve=False)
        rio.send()
        full = n_win == W and self.graphs
        if full:
            if self._replay_in is None:
                self._replay_in = (torch.empty_like(h), torch.empty_like(pre))
            self._replay_in[0].copy_(h)
            self._replay_in[1].copy_(pre)
            h, pre = self._replay_in
        h, pre = self._run(rio, "replay", full, h, pre)
        return runner.logits(h, pre)[0]

    def _run(self, io: DecodeIO, kind: str, full: bool, h: Tensor | None = None, pre: Tensor | None = None
             ) -> tuple[Tensor, Tensor]:
        """The encoder pass of a chunk (with the decoder's kv source) or the decoder replay, from a graph when
        `full` and graphs are on, else eagerly; the streams out."""
        n_max = io.max_entries(1)
        if full and self.graphs:
            n_max = {s: entry_bound(n, self.min_entries) for s, n in n_max.items()}
            key = (kind, io.T, tuple(sorted(n_max.items())))
            if key not in self._graphs:
                self._graphs[key] = self._capture(io, kind, n_max, h, pre)
            graph, out = self._graphs[key]
            graph.replay()
            return out[0], out[1]
        return self._step(io, kind, n_max, h, pre)

    def _step(self, io: DecodeIO, kind: str, n_max: dict[int, int], h: Tensor | None, pre: Tensor | None
              ) -> tuple[Tensor, Tensor]:
        c, runner = self.config, self.runner
        enc = c.encoder_layers
        if kind == "encoder":
            h, pre = runner.static_layers(io, 1, n_max, range(enc))
            if c.compress_ratios[enc] and runner.plans[enc].mode == FULL:  # `PrefillJob._finish`'s rule
                runner.static_produce(io, 1, n_max, enc, h, pre)
            return h, pre
        return runner.static_layers(io, 1, n_max, range(enc, c.n_layers), h, pre, compress=False, replay=True)

    def _capture(self, io: DecodeIO, kind: str, n_max: dict[int, int], h: Tensor | None, pre: Tensor | None):
        """Capture the step on all-padding inputs (the dummy slot: warm-up writes touch no sequence), then put
        the real inputs back (`graphs.DecodeGraphs._capture`'s rule); the outputs stay where the graph writes."""
        real = io.device.clone()
        io.device.copy_(io.pad_device)
        out: dict[str, tuple[Tensor, Tensor]] = {}  # the captured run's streams (the warm-ups' are overwritten)
        graph = capture_graph(lambda: out.update(streams=self._step(io, kind, n_max, h, pre)), self._pool)
        io.device.copy_(real)
        self.captures += 1
        return graph, out["streams"]
