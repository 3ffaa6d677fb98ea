"""Prefill of plain prompts from static steps, replayed from CUDA graphs on CUDA.

The host-driven prefill (`prefill.PrefillJob` over `Runner.forward`) launches ~820 kernels per chunk whatever its
length; on the H100/H200 that host work is most of its wall time (2026-12-06, H100: 51 ms for 9 ms of kernels at
8K tokens, docs/benchmarks.md). Here the same function is computed from the static step (`Runner.static_layers`,
`Runner.static_produce`, `DecodeIO`), whose inputs all sit in persistent device buffers, so that each piece is
one graph replay:

  * `encode(seq, tokens)`: the tokens through the encoder layers (with the decoder's kv-source compression), or
    with `exact=True` through every layer, in pieces of at most `chunk` tokens;
  * `replay(seq, n, h, pre)`: the decoder's bounded replay of the last n tokens from their encoder streams;
  * `__call__(seq, tokens)`: both, the last position's logits (what `prefill()` returns).

Every piece runs at a **bucket** shape — the next power of two ≥ its tokens, from `min_tokens` up to `chunk` —
over a ragged `DecodeIO` (`runner.DecodeIO(ragged=True)`: the padded positions after the real ones are computed
but write nothing of theirs into the sequence's state). With graphs on, each (kind, bucket, entry bounds) is
captured the first time it is needed and replayed after, so the graphs are bounded (log2(chunk / min_tokens) + 1
shapes per kind and entry bound) and a prompt of any length replays graphs only. Text prompts only: no images,
no encoder replay of cached tokens, no decoder windows continued from an earlier exact turn (`PrefillJob` runs
those on the host path and hands the rest here: `PrefillJob(static=...)`, `Engine(static_prefill=...)`).
"""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np
import torch
from torch import Tensor

from dsv41.engine.block_manager import BlockManager
from dsv41.engine.cache import SequenceCache
from dsv41.engine.graphs import capture_graph, entry_bound
from dsv41.engine.prefill import encoder_only_supported, static_capture_fits
from dsv41.engine.runner import Capture, DecodeIO, Runner
from dsv41.plan import FULL

log = logging.getLogger(__name__)


def token_buckets(min_tokens: int, chunk: int) -> list[int]:
    """The piece shapes: powers of two from min_tokens up to the first ≥ chunk."""
    out, b = [], 1 << (max(1, min_tokens) - 1).bit_length()
    while b < chunk:
        out.append(b)
        b *= 2
    return out + [b]


class StaticPrefill:
    """Prefill pieces of plain prompts from static steps over ragged power-of-two shapes (module docstring).

    chunk: the longest piece (longer inputs are cut); min_tokens: the smallest shape; graphs: replay each shape
    from a CUDA graph (default: on CUDA pools); min_entries: the smallest entry bound of a graph (as the decode
    graphs: bounds are powers of two)."""

    def __init__(self, runner: Runner, pools: BlockManager, *, chunk: int = 16384, min_tokens: int = 64,
                 graphs: bool | None = None, min_entries: int = 1024):
        if not encoder_only_supported(runner):
            raise ValueError("StaticPrefill runs encoder-only prefill; this model has no encoder / decoder split")
        if chunk < 1 or min_tokens < 1:
            raise ValueError(f"StaticPrefill: chunk and min_tokens must be >= 1, got {chunk}, {min_tokens}")
        c = runner.config
        self.runner, self.pools, self.config = runner, pools, c
        self.buckets = token_buckets(min(min_tokens, chunk), chunk)
        self.chunk = chunk
        self.graphs = pools.device.type == "cuda" if graphs is None else graphs
        if self.graphs and pools.device.type != "cuda":
            raise ValueError("StaticPrefill: CUDA graphs need CUDA pools")
        self.min_entries = min_entries
        self._ios: dict[int, DecodeIO] = {}  # bucket → its ragged io (one row)
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, tuple[Tensor, Tensor]]] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.graphs else None
        self._replay_in: dict[int, tuple[Tensor, Tensor]] = {}  # bucket → the replay's input streams (graph reads)
        self.captures = 0
        self.pieces = 0  # static pieces run (replays or eager), for tests and benchmarks
        self.replays: Counter[tuple] = Counter()  # graph key → replays (benchmarks/peer_decode.py: GPU time)

    def bucket(self, n: int) -> int:
        """The shape a piece of n ≤ chunk tokens runs at."""
        for b in self.buckets:
            if n <= b:
                return b
        raise ValueError(f"a static prefill piece of {n} tokens is longer than the largest shape {self.buckets[-1]}")

    def _io(self, n: int) -> DecodeIO:
        T = self.bucket(n)
        if T not in self._ios:
            self._ios[T] = DecodeIO(self.config, self.pools, 1, T, ragged=True)
        return self._ios[T]

    # ------------------------------------------------------------------ entry points
    @torch.no_grad()
    def __call__(self, seq: SequenceCache, tokens: list[int] | np.ndarray, *, exact: bool = False,
                 capture: Capture | None = None) -> Tensor:
        """Prefill `tokens` (a list or a 1-D integer array) after what seq holds: encoder-only with the decoder's
        bounded replay, or every layer (`exact`); the last position's logits (vocab,) fp32. `capture`: decoder
        layers' features of the replayed window for a drafter (`replay`); encoder-only only."""
        if len(tokens) == 0:
            raise ValueError("prefill needs at least one token")
        if capture is not None and exact:
            raise ValueError("StaticPrefill captures features in the decoder replay: encoder-only prefill only")
        self._capture_layers(capture)  # refused before anything runs
        if len(tokens) > self.chunk:
            h, pre = self.encode(seq, tokens, exact=exact)
            n = h.size(1)
        else:  # one piece: its graph's outputs are read at once, no copy of its tail (~10 µs of device time)
            (h, pre, n), = self._pieces(seq, tokens, exact)
        if exact:
            return self.runner.logits(h[:, :n], pre[:, :n])[0]
        m = min(self.config.window_size, n)
        return self.replay(seq, m, h[:, n - m:n], pre[:, n - m:n], capture=capture)

    @torch.no_grad()
    def encode(self, seq: SequenceCache, tokens: list[int] | np.ndarray, *, exact: bool = False
               ) -> tuple[Tensor, Tensor]:
        """`tokens` (a list or a 1-D integer array — an array saves the conversion of a list before the first
        launch: 0.14–0.21 ms for 8K ids, `timeit` of `np.fromiter`) after what seq holds through the encoder
        layers (the decoder's kv source compressed from their output) or, `exact`, through every layer; appends
        them to seq.tokens.
        Returns the streams (h, pre_mix) of the last min(window, len(tokens)) positions (fresh tensors: the
        decoder replay's input, valid across later replays)."""
        W = self.config.window_size
        tail: list[tuple[Tensor, Tensor]] = []
        for h, pre, n in self._pieces(seq, tokens, exact):
            keep = min(W, n)
            tail.append((h[:, n - keep:n].clone(), pre[:, n - keep:n].clone()))  # a graph's outputs: its next replay
            while sum(t[0].size(1) for t in tail[1:]) >= W:  # the pieces that hold the last W positions
                tail.pop(0)
        h = torch.cat([t[0] for t in tail], dim=1)[:, -W:]
        pre = torch.cat([t[1] for t in tail], dim=1)[:, -W:]
        return h, pre

    def _pieces(self, seq: SequenceCache, tokens: list[int] | np.ndarray, exact: bool):
        """Run `tokens` in pieces of at most `chunk`, appending them to seq.tokens; yields each piece's streams
        (1, T, ...) and its n real positions — a graph's outputs, overwritten by that graph's next replay."""
        if isinstance(tokens, np.ndarray):
            if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
                raise ValueError(f"prefill tokens as an array must be 1-D integers, got {tokens.dtype} {tokens.shape}")
            tokens = tokens.astype(np.int64, copy=False)
        for lo in range(0, len(tokens), self.chunk):
            piece = tokens[lo:lo + self.chunk]
            n = len(piece)
            io = self._io(n)
            io.wait_sent()  # the last copy out of its pinned host buffer is done before it is written again
            io.fill_batch([seq], [piece])
            io.send()
            h, pre, _ = self._run(io, "exact" if exact else "encoder", n)
            seq.tokens.extend(piece if isinstance(piece, list) else piece.tolist())  # after the launch: overlapped
            yield h, pre, n

    @torch.no_grad()
    def replay(self, seq: SequenceCache, n: int, h: Tensor, pre: Tensor, *, capture: Capture | None = None
               ) -> Tensor:
        """The decoder's bounded replay of seq's last n (≤ window) tokens from their encoder streams h (1, n, hc,
        dim), pre (1, n, hc): the window starts at their first position, their entries are cached already. The
        last position's logits (vocab,) fp32.

        capture: `Capture(layers, at)` of decoder layers (what a speculative drafter wants, as `PrefillJob`'s
        capture_layers); capture.features gets, per layer, the mean over streams at the n replayed positions
        (1, n, dim) — fresh tensors."""
        if not 1 <= n <= self.config.window_size or h.size(1) != n:
            raise ValueError(f"a decoder replay of {n} tokens (streams of {h.size(1)}); 1 <= n <= window size")
        layers = self._capture_layers(capture)
        io = self._io(n)
        io.wait_sent()
        io.fill_batch([seq], [seq.tokens[-n:]], positions=[seq.n_tokens - n], reserve=False)
        io.send()
        T = io.T
        if T not in self._replay_in:  # persistent inputs (a graph reads them where it was captured)
            self._replay_in[T] = (h.new_zeros(1, T, *h.shape[2:]), pre.new_zeros(1, T, *pre.shape[2:]))
        h_in, pre_in = self._replay_in[T]
        h_in[:, :n].copy_(h)
        pre_in[:, :n].copy_(pre)
        h, pre, features = self._run(io, "replay", n, h_in, pre_in, layers)
        if capture is not None:
            capture.features.update({i: f[:, :n].clone() for i, f in features.items()})
        return self.runner.logits(h[:, :n], pre[:, :n])[0]

    def _capture_layers(self, capture: Capture | None) -> tuple[tuple[int, ...], str] | None:
        """A replay's capture as part of its graph key: (layers, at), checked to be decoder layers."""
        if capture is None:
            return None
        c = self.config
        if capture.projections or not static_capture_fits(c, capture.layers, exact=False):
            raise ValueError(f"StaticPrefill captures features of decoder layers [{c.encoder_layers}, {c.n_layers}) "
                             f"(no projections); got layers {capture.layers}, projections={capture.projections}")
        return tuple(capture.layers), capture.at

    # ------------------------------------------------------------------ one piece
    def _run(self, io: DecodeIO, kind: str, n: int, h: Tensor | None = None, pre: Tensor | None = None,
             capture: tuple[tuple[int, ...], str] | None = None) -> tuple[Tensor, Tensor, dict[int, Tensor]]:
        """One piece of `kind` ("encoder", "exact" or "replay") at io's shape, from its graph when graphs are on,
        else eagerly; the streams out (1, T, ...), real at [0, n), and the captured layers' features (1, T, dim)
        (a replay with `capture` = (layers, at))."""
        self.pieces += 1
        n_max = io.max_entries(1)
        if not self.graphs:
            return self._step(io, kind, n_max, h, pre, capture)
        n_max = {s: entry_bound(v, self.min_entries) for s, v in n_max.items()}
        key = (kind, io.T, tuple(sorted(n_max.items()))) + ((capture,) if capture else ())
        if key not in self._graphs:
            try:
                self._graphs[key] = self._capture(io, kind, n_max, h, pre, capture)
            except RuntimeError as err:  # a step that cannot be captured: every piece eagerly from now on
                log.warning("StaticPrefill: CUDA-graph capture failed (%s); running its pieces eagerly", err)
                self.graphs = False
                torch.cuda.synchronize()
                return self._step(io, kind, io.max_entries(1), h, pre, capture)
        graph, out = self._graphs[key]
        graph.replay()
        self.replays[key] += 1
        return out

    def _step(self, io: DecodeIO, kind: str, n_max: dict[int, int], h: Tensor | None, pre: Tensor | None,
              capture: tuple[tuple[int, ...], str] | None = None) -> tuple[Tensor, Tensor, dict[int, Tensor]]:
        c, runner = self.config, self.runner
        enc = c.encoder_layers
        if kind == "exact":
            return *runner.static_layers(io, 1, n_max, range(c.n_layers)), {}
        if kind == "encoder":
            h, pre = runner.static_layers(io, 1, n_max, range(enc))
            if c.compress_ratios[enc] and runner.plans[enc].mode == FULL:  # `PrefillJob._finish`'s rule
                runner.static_produce(io, 1, n_max, enc, h, pre)
            return h, pre, {}
        cap = Capture(layers=capture[0], at=capture[1]) if capture else None
        h, pre = runner.static_layers(io, 1, n_max, range(enc, c.n_layers), h, pre, compress=False, replay=True,
                                      capture=cap)
        return h, pre, (cap.features if cap is not None else {})

    def _capture(self, io: DecodeIO, kind: str, n_max: dict[int, int], h: Tensor | None, pre: Tensor | None,
                 capture: tuple[tuple[int, ...], str] | None = None):
        """Capture the step on all-padding inputs (the dummy slot: warm-up writes touch no sequence), then put
        the real inputs back (`graphs.DecodeGraphs._capture`'s rule); the outputs stay where the graph writes."""
        real = io.device.clone()
        io.device.copy_(io.pad_device)
        out: dict[str, tuple] = {}  # the captured run's streams and features (the warm-ups' are overwritten)
        try:
            graph = capture_graph(lambda: out.update(streams=self._step(io, kind, n_max, h, pre, capture)), self._pool)
        finally:
            io.device.copy_(real)
        self.captures += 1
        return graph, out["streams"]
