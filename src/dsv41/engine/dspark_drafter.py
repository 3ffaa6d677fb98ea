"""The DSpark drafter behind the engine's `Drafter` protocol, on fixed device state (SPEC §5 "DSpark";
docs/dspark.md).

Protocol (the engine side — verification, rollback, scheduling — lives in the engine):
    k                      tokens proposed per step = dspark_block_size (a block of K positions
                           proposes K tokens: position i predicts the token after it, as the release's
                           forward_head samples block_size tokens)
    features_wanted()      backbone layers whose features the engine hands over (`features_at = "input"`,
                           the engine's `Capture(at="input")`): the target layers; the
                           feature of layer i at a position is the mean over the hc streams of the
                           streams *entering* block i (after its Engram) — `capture_features` records
                           exactly that with forward pre-hooks on the blocks, in any forward
    start(seq) / finish(seq)
    observe(seq, tokens (n,), features {layer: (m, dim)})
                           committed tokens in order, features of the LAST m of them (m ≤ n; the decoder's
                           bounded replay only runs the prompt's last window, and the drafter needs only the
                           last `window_size` positions, so m ≥ min(n, window) keeps it exact)
    observe_many(seqs, tokens (B, T), features {layer: (B, T, dim)}, keep)
                           row b commits its first keep[b] positions (after a verification), in one batched
                           forward; equal to `observe` row by row
    propose(seqs, last_tokens (B,)) → Proposal(tokens (B, k), confidence (B, k) in [0, 1], probs (B, k, V) | None)
                           last_tokens = each sequence's newest token, the one without features yet (the
                           bonus token of the last verification); it is the anchor of the draft block.

State (allocated once): per stage one ring pool (max_sequences + 1, W, D) of context keys (each stage's
own `kv_norm(wkv(main_x))`, rotated at its position, slot = position % W); a started sequence holds one
pool slot (free list), the last slot is a dummy that padding rows and dropped positions write to; the
count of observed positions per slot, on the host (a list) and in a device buffer. Observing only
accepted positions means nothing ever rolls back here.

Key idea of `propose`: it is a function of persistent buffers only — the slots and anchors of the rows
(one packed host → device copy per call), the observed counts and the rings — gathered into the same
(B, 1, W, D) windows the training form gathers from a row (so drafting equals `DSpark.forward` on the
whole sequence, tests/dspark/test_dspark_attention.py), padded to a batch bucket, with no host read
and no data-dependent branch. Greedy drafting on CUDA therefore replays a CUDA graph per bucket
(`ProposeGraphs`); on the CPU the same function runs eagerly. Sampled drafting (temperature > 0) stays
eager and unpadded: `torch.multinomial` with a host generator is not capturable.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from dsv41.engine.graphs import batch_buckets, bucket, capture_graph
from dsv41.model.dspark import DSpark


@dataclass
class Proposal:
    tokens: Tensor  # (B, k) long: the drafted tokens
    confidence: Tensor  # (B, k) float in [0, 1]: predicted acceptance of each position given the earlier ones
    probs: Tensor | None = None  # (B, k, V) float: the distribution each token was drawn from (None when greedy)


class DrafterFull(RuntimeError):
    """Every drafter slot is held by a started sequence."""


class _PackedInputs:
    """Per-call int64 inputs: a (fields, rows) host buffer (pinned on CUDA, written through numpy) and its
    device twin, sent in one non-blocking copy (as `engine.runner.DecodeIO`). Before the host buffer is
    rewritten, `host()` waits for the previous copy out of it (an event wait, not a stream sync)."""

    def __init__(self, n_fields: int, rows: int, device: torch.device):
        cuda = device.type == "cuda"
        self.buffer = torch.zeros(n_fields, rows, dtype=torch.long, pin_memory=cuda)
        self.view = self.buffer.numpy()  # (fields, rows)
        self.device = torch.zeros(n_fields, rows, dtype=torch.long, device=device)
        self._sent = torch.cuda.Event() if cuda else None

    def host(self) -> np.ndarray:
        if self._sent is not None:
            self._sent.synchronize()  # returns at once unless the last copy is still queued
        return self.view

    def send(self) -> Tensor:
        self.device.copy_(self.buffer, non_blocking=True)
        if self._sent is not None:
            self._sent.record()
        return self.device


class ProposeGraphs:
    """CUDA graphs of the static greedy propose, one per batch bucket (engine/graphs.py's DecodeGraphs for
    the drafter). `step(Bb)` reads only persistent buffers — the rows from `inputs` — and writes persistent
    outputs; `padding` is `inputs` with every row a padding row. Capture: two warm-up runs on a side stream
    on padding rows (kernels compiled and loaded, lazy probes run, outside the capture), then the capture
    into a pool shared by all buckets; the real inputs are restored before the first replay."""

    def __init__(self, step: Callable[[int], None], inputs: Tensor, padding: Tensor):
        if inputs.device.type != "cuda":
            raise ValueError("ProposeGraphs: CUDA graphs need the drafter on a CUDA device")
        self.step, self.inputs, self.padding = step, inputs, padding
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.captures = 0

    def run(self, Bb: int) -> None:
        """Replay (capturing first if needed) the step of a padded batch of Bb rows."""
        graph = self.graphs.get(Bb)
        if graph is None:
            graph = self.graphs[Bb] = self._capture(Bb)
        graph.replay()

    def _capture(self, Bb: int) -> torch.cuda.CUDAGraph:
        real = self.inputs.clone()
        self.inputs.copy_(self.padding)  # warm-up rows are padding: nothing of a sequence is read
        graph = capture_graph(lambda: self.step(Bb), self.pool)
        self.inputs.copy_(real)
        self.captures += 1
        return graph


class DSparkDrafter:
    """`Drafter` of the engine backed by a trained DSpark (bound to the engine's backbone).

    max_sequences = sequences started at once (drafter slots); cuda_graphs: replay greedy proposals from
    CUDA graphs (default: on CUDA; never for temperature > 0). With graphs, the drafter's MoE layers
    with n_routed ≤ 4·topk switch to the static "dense" dispatch, as `Engine` does for the backbone."""

    features_at = "input"  # the engine's Capture(at="input"): the streams entering each target block
    SLOT, ANCHOR = 0, 1  # fields of the propose inputs
    START, COUNT = 1, 2  # fields of the observe inputs (SLOT = 0 too)

    def __init__(self, drafter: DSpark, temperature: float = 0.0, generator: torch.Generator | None = None, *,
                 max_sequences: int = 64, cuda_graphs: bool | None = None):
        if max_sequences < 1:
            raise ValueError(f"DSparkDrafter: max_sequences must be ≥ 1, got {max_sequences}")
        self.drafter = drafter.eval()
        self.k = drafter.block_size
        self.temperature = temperature
        self.generator = generator
        self.window = W = drafter.window
        self.max_sequences = max_sequences
        ref = drafter.first.attn.wkv.weight
        self.device, self.dtype = ref.device, ref.dtype
        D = drafter.config.head_dim
        self.dummy = max_sequences  # the pool slot of padding rows and dropped positions
        self.rings = [torch.zeros(max_sequences + 1, W, D, dtype=ref.dtype, device=ref.device) for _ in drafter.mtp]
        self.observed = torch.zeros(max_sequences + 1, dtype=torch.long, device=ref.device)  # per slot
        self.observed_host = [0] * (max_sequences + 1)  # the same counts, read without a sync
        self._slots: dict[int, int] = {}  # sequence id → pool slot
        self._free = list(range(max_sequences - 1, -1, -1))  # pop() hands out the lowest free slot
        self.buckets = batch_buckets(max_sequences)
        self._ring_slot = torch.arange(W, device=ref.device)  # (W,)
        self._propose_in = _PackedInputs(2, max_sequences, ref.device)
        self._observe_in = _PackedInputs(3, max_sequences, ref.device)
        self._out_tokens = torch.zeros(max_sequences, self.k, dtype=torch.long, device=ref.device)
        self._out_confidence = torch.zeros(max_sequences, self.k, dtype=torch.float32, device=ref.device)
        use_graphs = (ref.device.type == "cuda" if cuda_graphs is None else cuda_graphs) and temperature <= 0
        self.graphs: ProposeGraphs | None = None
        if use_graphs:
            padding = torch.zeros_like(self._propose_in.device)
            padding[self.SLOT] = self.dummy  # anchor token 0 at position 0 of the dummy slot
            self.graphs = ProposeGraphs(self._greedy_step, self._propose_in.device, padding)
            for moe in drafter.moe_layers():  # capturable MoE dispatch: every expert on every token
                if moe.n_routed <= 4 * moe.topk:
                    moe.moe_impl = "dense"

    # ------------------------------------------------------------------ sequences
    def features_wanted(self) -> list[int]:
        return list(self.drafter.target_layer_ids)

    def start(self, seq_id: int) -> None:
        if seq_id in self._slots:
            raise KeyError(f"DSparkDrafter: sequence {seq_id} already started")
        if not self._free:
            raise DrafterFull(f"DSparkDrafter: all {self.max_sequences} drafter slots are held by started "
                              f"sequences; finish one first or build the drafter with a larger max_sequences")
        slot = self._free.pop()
        self._slots[seq_id] = slot
        self.observed_host[slot] = 0
        self.observed[slot] = 0  # the ring's old rows stay, masked by the count

    def finish(self, seq_id: int) -> None:
        slot = self._slots.pop(seq_id, None)
        if slot is not None:
            self._free.append(slot)

    def slot(self, seq_id: int) -> int:
        """The pool slot of a started sequence."""
        try:
            return self._slots[seq_id]
        except KeyError:
            raise KeyError(f"DSparkDrafter: sequence {seq_id} was not started") from None

    # ------------------------------------------------------------------ observing committed positions
    @torch.no_grad()
    def observe(self, seq_id: int, tokens: Tensor, features: dict[int, Tensor]) -> None:
        slot = self.slot(seq_id)
        n = int(tokens.numel())
        if n == 0:
            return
        rows = self._feature_rows(features, None)  # (m, n_targets·dim)
        m = rows.size(0)
        if m > n:
            raise ValueError(f"DSparkDrafter.observe: features of {m} positions for {n} tokens")
        keep = min(m, self.window)  # older positions fall out of every ring anyway
        first = self.observed_host[slot] + n - keep  # position of the first kept row
        self._commit([slot], [first], rows[m - keep:].unsqueeze(0), [keep])  # (1, keep, n_targets·dim)

    @torch.no_grad()
    def observe_many(self, seq_ids: list[int], tokens: Tensor, features: dict[int, Tensor],
                     keep: list[int]) -> None:
        """Row b commits its first keep[b] ≤ T positions (tokens (B, T), features {layer: (B, T, dim)}):
        the same rings and counts as `observe(seq_ids[b], tokens[b, :keep[b]], {i: f[b, :keep[b]]})` for
        every b, in one batched forward; the positions not kept are computed and written to the dummy slot."""
        if tokens.dim() != 2 or tokens.size(0) != len(seq_ids) or len(keep) != len(seq_ids):
            raise ValueError(f"DSparkDrafter.observe_many: tokens {tuple(tokens.shape)}, {len(seq_ids)} sequences "
                             f"and {len(keep)} keep counts do not agree")
        B, T = tokens.shape
        if len(set(seq_ids)) != B:
            raise ValueError("DSparkDrafter.observe_many: a sequence appears twice in one call")
        keep = [int(n) for n in keep]
        if any(not 0 <= n <= T for n in keep):
            raise ValueError(f"DSparkDrafter.observe_many: keep {keep} outside 0 … {T}")
        slots = [self.slot(s) for s in seq_ids]
        if not any(keep):
            return
        rows = self._feature_rows(features, (B, T))  # (B, T, n_targets·dim)
        self._commit(slots, [self.observed_host[s] for s in slots], rows, keep)

    def _feature_rows(self, features: dict[int, Tensor], lead: tuple[int, int] | None) -> Tensor:
        """The target layers' features concatenated: (..., n_targets·dim), leading dims checked."""
        missing = [i for i in self.drafter.target_layer_ids if i not in features]
        if missing:
            raise KeyError(f"DSparkDrafter: features of target layers {missing} missing")
        parts = [features[i] for i in self.drafter.target_layer_ids]
        if lead is not None and any(tuple(p.shape[:2]) != lead or p.dim() != 3 for p in parts):
            shapes = [tuple(p.shape) for p in parts]
            raise ValueError(f"DSparkDrafter.observe_many: features of shapes {shapes}, ({lead[0]}, {lead[1]}, dim) "
                             "expected")
        return torch.cat(parts, dim=-1)

    def _commit(self, slots: list[int], starts: list[int], rows: Tensor, counts: list[int]) -> None:
        """Row b's positions starts[b] + t, t < counts[b], get the context keys of rows[b, t] (rows (B, T, F));
        then the slot has observed starts[b] + counts[b] positions. One packed copy, one batched forward."""
        B, T = rows.shape[:2]
        W = self.window
        v = self._observe_in.host()
        v[0, :B], v[self.START, :B], v[self.COUNT, :B] = slots, starts, counts
        d = self._observe_in.send()
        slot, start, count = (d[f, :B].unsqueeze(1) for f in (0, self.START, self.COUNT))  # (B, 1) each
        if T:
            t = torch.arange(T, device=self.device)  # (T,)
            positions = start + t  # (B, T)
            # kept, and not overwritten by a later position of the same row (only the last W land)
            written = (t < count) & (t >= count - W)  # (B, T)
            target = torch.where(written, slot * W + positions % W, self.dummy * W + t % W).reshape(-1)  # (B·T,)
            main_x = self.drafter.main_x(rows.to(self.device, self.dtype))  # (B, T, dim)
            for ring, kv in zip(self.rings, self.drafter.context_keys(main_x, positions)):
                flat = ring.view(-1, ring.size(-1))  # ((max_sequences + 1)·W, D)
                flat.index_copy_(0, target, kv.reshape(B * T, -1).to(ring.dtype))  # (B·T, D)
        self.observed.index_copy_(0, d[0, :B], d[self.START, :B] + d[self.COUNT, :B])
        for s, first, n in zip(slots, starts, counts):
            self.observed_host[s] = first + n

    # ------------------------------------------------------------------ drafting
    @torch.no_grad()
    def propose(self, seq_ids: list[int], last_tokens: Tensor) -> Proposal:
        B = len(seq_ids)
        if int(last_tokens.numel()) != B:
            raise ValueError(f"DSparkDrafter.propose: {last_tokens.numel()} anchors for {B} sequences")
        if B == 0:
            empty = torch.zeros(0, self.k, dtype=torch.long, device=self.device)
            return Proposal(tokens=empty, confidence=empty.float())
        greedy = self.temperature <= 0
        Bb = bucket(B, self.buckets) if greedy else B  # sampled drafting is eager: no padding rows
        slots = [self.slot(s) for s in seq_ids]
        v = self._propose_in.host()
        v[self.SLOT, :B], v[self.SLOT, B:] = slots, self.dummy
        v[self.ANCHOR, B:] = 0
        on_host = last_tokens.device.type == "cpu"
        if on_host:
            v[self.ANCHOR, :B] = last_tokens.reshape(-1).long().numpy()
        d = self._propose_in.send()
        if not on_host:  # the engine's anchors are already on the device: a device copy, ordered after send
            d[self.ANCHOR, :B].copy_(last_tokens.reshape(-1))
        if greedy:
            if self.graphs is not None:
                self.graphs.run(Bb)
            else:
                self._greedy_step(Bb)
            return Proposal(tokens=self._out_tokens[:B].clone(), confidence=self._out_confidence[:B].clone())
        hidden, anchors = self._block(B)
        tokens, probs, conf = self.drafter.sample(hidden, anchors, self.temperature, self.generator)
        return Proposal(tokens=tokens, confidence=torch.sigmoid(conf), probs=probs)

    def _block(self, Bb: int) -> tuple[Tensor, Tensor]:
        """The draft blocks of the first Bb input rows from the persistent state → (hidden (Bb, K, dim),
        anchors (Bb,)). Device ops only, shapes fixed by Bb."""
        d = self._propose_in.device
        slots, anchors = d[self.SLOT, :Bb], d[self.ANCHOR, :Bb]  # (Bb,) each
        observed = self.observed.index_select(0, slots)  # (Bb,): the anchor's position
        valid = (self._ring_slot.unsqueeze(0) < observed.unsqueeze(1)).unsqueeze(1)  # (Bb, 1, W): filled slots
        contexts = [(ring.index_select(0, slots).unsqueeze(1), valid) for ring in self.rings]  # (Bb, 1, W, D)
        hidden = self.drafter.block_hidden(anchors.view(Bb, 1), observed.view(Bb, 1), contexts)  # (Bb, 1, K, dim)
        return hidden[:, 0], anchors

    @torch.no_grad()
    def _greedy_step(self, Bb: int) -> None:
        """The static greedy proposal of Bb rows into the persistent outputs (what a CUDA graph captures)."""
        hidden, anchors = self._block(Bb)
        tokens, _, conf = self.drafter.sample(hidden, anchors, 0.0, return_probs=False)
        self._out_tokens[:Bb].copy_(tokens)
        self._out_confidence[:Bb].copy_(torch.sigmoid(conf))
