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
(`StepGraphs`); on the CPU the same function runs eagerly. Sampled drafting (temperature > 0) stays
eager and unpadded: `torch.multinomial` with a host generator is not capturable.

The hand-over (`observe`, `observe_many`) is static the same way: `_commit` packs slot / start / count
(one copy), copies the features into a persistent rows buffer in the drafter dtype (one copy per target
layer), and `_commit_step(Bb, Tb)` — main_x, every stage's keys, one indexed write per ring, the counts —
reads only those buffers. On CUDA it is padded to (batch bucket, next power of two ≥ T, at most W) and
replayed from a graph per (Bb, Tb) at any temperature (nothing in it is random), sharing the propose
graphs' pool; on the CPU it runs eagerly and unpadded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from dsv41.engine.engine import block_fp32_weights, keep_in_fp32
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


def drafter_fp32_weights(drafter: DSpark) -> list[torch.nn.Parameter]:
    """The drafter's weights it only ever multiplies in fp32: each stage's (`engine.block_fp32_weights`: router,
    sink, mHC coefficients) and the last stage's Markov head (embedding and projection) and confidence head.
    `DSparkDrafter` stores them in fp32 (`engine.keep_in_fp32`): a bf16 drafter's proposal at batch 1 spent 0.17
    of its 0.95 ms of kernels in 57 casts of them (H100, 2026-12-07)."""
    last = drafter.last
    return ([w for stage in drafter.mtp for w in block_fp32_weights(stage)]
            + [last.markov_head.embed.weight, last.markov_head.head.weight, last.confidence_head.proj.weight])


class StepGraphs:
    """CUDA graphs of one static step of the drafter, one per shape key (engine/graphs.py's DecodeGraphs for
    the drafter): `step(*key)` reads only persistent buffers — its rows from `inputs` — and writes only
    persistent state or outputs; `padding` is `inputs` with every row a padding row. Capture
    (`graphs.capture_graph`): two warm-up runs on a side stream on padding rows (kernels compiled and loaded,
    lazy probes run, outside the capture), then the capture into `pool`; the real inputs are restored before
    the first replay. The drafter's propose and observe graphs share one pool: they never run concurrently
    and nothing allocated inside a replay outlives it."""

    def __init__(self, step: Callable[..., None], inputs: Tensor, padding: Tensor, pool: tuple | None = None):
        if inputs.device.type != "cuda":
            raise ValueError("DSparkDrafter: CUDA graphs need the drafter on a CUDA device")
        self.step, self.inputs, self.padding = step, inputs, padding
        self.graphs: dict[tuple[int, ...], torch.cuda.CUDAGraph] = {}
        self.pool = torch.cuda.graph_pool_handle() if pool is None else pool
        self.captures = 0

    def run(self, *key: int) -> None:
        """Replay (capturing first if needed) the step of the padded shape `key`."""
        self.ensure(*key).replay()

    def ensure(self, *key: int) -> torch.cuda.CUDAGraph:
        """The graph of `key`, captured now if it was not yet."""
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = self._capture(key)
        return graph

    def _capture(self, key: tuple[int, ...]) -> torch.cuda.CUDAGraph:
        real = self.inputs.clone()
        self.inputs.copy_(self.padding)  # warm-up rows are padding: nothing of a sequence is read or written
        graph = capture_graph(lambda: self.step(*key), self.pool)
        self.inputs.copy_(real)
        self.captures += 1
        return graph


class DSparkDrafter:
    """`Drafter` of the engine backed by a trained DSpark (bound to the engine's backbone).

    max_sequences = sequences started at once (drafter slots); cuda_graphs: replay the hand-over
    (`observe` / `observe_many`) and greedy proposals from CUDA graphs (default: on CUDA; proposals never
    for temperature > 0, the hand-over at any temperature: nothing in it is random). With propose graphs,
    the drafter's MoE layers with n_routed ≤ 4·topk switch to the static "dense" dispatch, as `Engine` does
    for the backbone (the hand-over runs no MoE)."""

    features_at = "input"  # the engine's Capture(at="input"): the streams entering each target block
    SLOT, ANCHOR = 0, 1  # fields of the propose inputs
    START, COUNT = 1, 2  # fields of the observe inputs (SLOT = 0 too)

    def __init__(self, drafter: DSpark, temperature: float = 0.0, generator: torch.Generator | None = None, *,
                 max_sequences: int = 64, cuda_graphs: bool | None = None):
        if max_sequences < 1:
            raise ValueError(f"DSparkDrafter: max_sequences must be ≥ 1, got {max_sequences}")
        self.drafter = drafter.eval()
        keep_in_fp32(drafter_fp32_weights(drafter))
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
        # the hand-over's feature rows, flat so that every (Bb, Tb) block is a contiguous view (`_block_rows`);
        # at most W positions per row land in a ring, so W is the most one commit needs per row
        self._rows = torch.zeros(max_sequences * W, len(self.drafter.target_layer_ids) * drafter.config.dim,
                                 dtype=ref.dtype, device=ref.device)  # (max_sequences·W, n_targets·dim)
        self._pad = ref.device.type == "cuda"  # commits padded to (batch bucket, power of two): graph shapes
        self._out_tokens = torch.zeros(max_sequences, self.k, dtype=torch.long, device=ref.device)
        self._out_confidence = torch.zeros(max_sequences, self.k, dtype=torch.float32, device=ref.device)
        use_graphs = ref.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.graphs: StepGraphs | None = None  # the greedy propose, keyed by (Bb,)
        self.observe_graphs: StepGraphs | None = None  # the hand-over's commit, keyed by (Bb, Tb)
        if use_graphs:
            padding = torch.zeros_like(self._observe_in.device)
            padding[0] = self.dummy  # slot = dummy, start 0, count 0: every position to the dummy slot
            self.observe_graphs = StepGraphs(self._commit_step, self._observe_in.device, padding)
        if use_graphs and temperature <= 0:
            padding = torch.zeros_like(self._propose_in.device)
            padding[self.SLOT] = self.dummy  # anchor token 0 at position 0 of the dummy slot
            self.graphs = StepGraphs(self._greedy_step, self._propose_in.device, padding, self.observe_graphs.pool)
            for moe in drafter.moe_layers():  # capturable MoE dispatch: every expert on every token
                if moe.n_routed <= 4 * moe.topk:
                    moe.moe_impl = "dense"

    @torch.no_grad()
    def warm_up(self, buckets: list[int] | None = None) -> int:
        """Capture every graph a run can ask for, now: the propose graph of each batch bucket and the
        hand-over's commit of each (bucket, power of two ≤ window) — otherwise the first step at a new batch
        size (a closed batch's rows finishing one by one) or the first catch-up after a run of plain steps
        of a new length pays a capture (tens of ms) in the middle of decoding. Captures run on padding rows
        only: no started sequence's state is read or written. Returns the graphs captured; a no-op
        without graphs (the CPU)."""
        before = self.captures
        buckets = [b for b in (buckets or self.buckets) if b <= self.max_sequences]
        spans = sorted({min(self.window, 1 << t) for t in range(self.window.bit_length() + 1)})
        for Bb in buckets:
            for Tb in spans if self.observe_graphs is not None else ():
                self.observe_graphs.ensure(Bb, Tb)
            if self.graphs is not None:
                self.graphs.ensure(Bb)
        return self.captures - before

    @property
    def pure_propose(self) -> bool:
        """Greedy drafting draws nothing at random: a proposal depends on the state and the anchors only, so the
        engine may launch one early and drop it unused (`Engine._chain`)."""
        return self.temperature <= 0

    @property
    def captures(self) -> int:
        """Graphs captured so far (propose and hand-over)."""
        return sum(g.captures for g in (self.graphs, self.observe_graphs) if g is not None)

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
        parts = self._feature_parts(features)  # [(m, dim)] per target layer
        m = parts[0].size(0)
        if any(p.dim() != 2 or p.size(0) != m for p in parts) or m > n:
            shapes = [tuple(p.shape) for p in parts]
            raise ValueError(f"DSparkDrafter.observe: features of shapes {shapes} for {n} tokens, (m ≤ n, dim) "
                             "expected")
        keep = min(m, self.window)  # older positions fall out of every ring anyway
        first = self.observed_host[slot] + n - keep  # position of the first kept row
        self._commit([slot], [first], [p[m - keep:].unsqueeze(0) for p in parts], [keep])  # [(1, keep, dim)]

    observe_many_skips = True  # `observe_many(..., skip=)`: the engine's catch-up of rows a window or more behind

    @torch.no_grad()
    def observe_many(self, seq_ids: list[int], tokens: Tensor, features: dict[int, Tensor],
                     keep: list[int], skip: list[int] | None = None) -> None:
        """Row b commits its first keep[b] ≤ T positions (tokens (B, T), features {layer: (B, T, dim)}):
        the same rings and counts as `observe(seq_ids[b], tokens[b, :keep[b]], {i: f[b, :keep[b]]})` for
        every b, in one batched forward; the positions not kept are computed and written to the dummy slot.
        skip[b] > 0: row b's block starts skip[b] positions after what it has observed — those positions fell out
        of its window, so its block must fill the window (keep[b] = window); the same as `observe` of the skipped
        tokens and the block's with the block's features only."""
        if tokens.dim() != 2 or tokens.size(0) != len(seq_ids) or len(keep) != len(seq_ids):
            raise ValueError(f"DSparkDrafter.observe_many: tokens {tuple(tokens.shape)}, {len(seq_ids)} sequences "
                             f"and {len(keep)} keep counts do not agree")
        B, T = tokens.shape
        if len(set(seq_ids)) != B:
            raise ValueError("DSparkDrafter.observe_many: a sequence appears twice in one call")
        keep = [int(n) for n in keep]
        if any(not 0 <= n <= T for n in keep):
            raise ValueError(f"DSparkDrafter.observe_many: keep {keep} outside 0 … {T}")
        skip = [0] * B if skip is None else [int(n) for n in skip]
        if len(skip) != B or any(n < 0 or (n > 0 and k != self.window) for n, k in zip(skip, keep)):
            raise ValueError(f"DSparkDrafter.observe_many: skip {skip} with keep {keep}: a row may skip positions "
                             f"only with a block that fills its window ({self.window})")
        slots = [self.slot(s) for s in seq_ids]
        if not any(keep):
            return
        parts = self._block_parts("observe_many", features, B, T)
        self._commit(slots, [self.observed_host[s] + n for s, n in zip(slots, skip)], parts, keep)

    @torch.no_grad()
    def observe_many_device(self, seq_ids: list[int], features: dict[int, Tensor], keep: Tensor) -> None:
        """`observe_many` with each row's count still on the device: keep (B,) long in [0, T], T ≤ window (the
        engine's greedy acceptance, launched before the host has read it). The rings and the device counts move as
        `observe_many` moves them; the host mirror stays until the caller tells it the counts (`observed_more`)."""
        B = len(seq_ids)
        if tuple(keep.shape) != (B,):
            raise ValueError(f"DSparkDrafter.observe_many_device: keep of shape {tuple(keep.shape)} for {B} sequences")
        if len(set(seq_ids)) != B:
            raise ValueError("DSparkDrafter.observe_many_device: a sequence appears twice in one call")
        slots = [self.slot(s) for s in seq_ids]
        parts = self._block_parts("observe_many_device", features, B)
        T = parts[0].size(1)
        self._commit(slots, [self.observed_host[s] for s in slots], parts, [T] * B, keep)

    def observed_more(self, seq_ids: list[int], counts: list[int]) -> None:
        """The host mirror catches up with an `observe_many_device`: sequence seq_ids[b] observed counts[b] more."""
        for seq_id, n in zip(seq_ids, counts):
            self.observed_host[self.slot(seq_id)] += int(n)

    def _block_parts(self, caller: str, features: dict[int, Tensor], B: int, T: int | None = None) -> list[Tensor]:
        """The target layers' features of a batched hand-over, each (B, T, dim) — T None: theirs, at most the
        window (the device-count hand-over, whose counts the host cannot check)."""
        parts = self._feature_parts(features)
        free = T is None
        if free:
            T = parts[0].size(1) if parts[0].dim() == 3 else -1
        if any(p.dim() != 3 or tuple(p.shape[:2]) != (B, T) for p in parts) or (free and T > self.window):
            shapes = [tuple(p.shape) for p in parts]
            raise ValueError(f"DSparkDrafter.{caller}: features of shapes {shapes}, "
                             f"({B}, {f'T ≤ {self.window}' if free else T}, dim) expected")
        return parts

    def _feature_parts(self, features: dict[int, Tensor]) -> list[Tensor]:
        """The target layers' features in target order (the column blocks of a feature row), dims checked."""
        missing = [i for i in self.drafter.target_layer_ids if i not in features]
        if missing:
            raise KeyError(f"DSparkDrafter: features of target layers {missing} missing")
        parts = [features[i] for i in self.drafter.target_layer_ids]
        dim = self.drafter.config.dim
        if any(p.size(-1) != dim for p in parts):
            raise ValueError(f"DSparkDrafter: features of shapes {[tuple(p.shape) for p in parts]}, last dim "
                             f"{dim} expected")
        return parts

    def _commit(self, slots: list[int], starts: list[int], parts: list[Tensor], counts: list[int],
                counts_device: Tensor | None = None) -> None:
        """Row b's positions starts[b] + t, t < counts[b], get the context keys of its feature row t (parts:
        per target layer (B, T, dim)); then the slot has observed starts[b] + counts[b] positions. One packed
        host → device copy, one copy per target into the rows buffer, one `_commit_step` (a graph replay).
        counts_device (B,): the counts come from the device instead (T ≤ window), the host mirror stays."""
        B, T = parts[0].shape[:2]
        W = self.window
        if T > W:  # only a row's last W kept positions can land (never from the engine): shift to that window
            offsets = [max(0, n - W) for n in counts]
            starts = [s + o for s, o in zip(starts, offsets)]
            counts = [n - o for n, o in zip(counts, offsets)]
            index = torch.tensor(offsets).unsqueeze(1) + torch.arange(W)  # (B, W)
            rows_of = torch.arange(B).unsqueeze(1)  # (B, 1)
            parts = [p[rows_of.to(p.device), index.to(p.device)] for p in parts]  # [(B, W, dim)]
            T = W
        if self._pad:  # the shapes a graph is keyed by
            Bb, Tb = bucket(B, self.buckets), min(W, 1 << max(T - 1, 0).bit_length())
        else:
            Bb, Tb = B, max(T, 1)
        v = self._observe_in.host()
        v[0, :B], v[self.START, :B], v[self.COUNT, :B] = slots, starts, counts
        v[0, B:], v[self.START, B:], v[self.COUNT, B:] = self.dummy, 0, 0  # padding rows
        d = self._observe_in.send()
        if counts_device is not None:  # ordered after the packed copy on the stream
            d[self.COUNT, :B].copy_(counts_device)
        rows = self._block_rows(Bb, Tb)  # (Bb, Tb, n_targets·dim); rows ≥ B and positions ≥ T stay stale
        dim = self.drafter.config.dim
        for j, part in enumerate(parts):  # cast to the drafter dtype as `.to(dtype)` does
            rows[:B, :T, j * dim:(j + 1) * dim].copy_(part)
        if self.observe_graphs is not None:
            self.observe_graphs.run(Bb, Tb)
        else:
            self._commit_step(Bb, Tb)
        if counts_device is None:
            for s, first, n in zip(slots, starts, counts):
                self.observed_host[s] = first + n

    def _block_rows(self, Bb: int, Tb: int) -> Tensor:
        """The rows buffer as a contiguous (Bb, Tb, n_targets·dim) block (its layout depends on Tb)."""
        return self._rows[:Bb * Tb].view(Bb, Tb, -1)  # (Bb, Tb, n_targets·dim)

    @torch.no_grad()
    def _commit_step(self, Bb: int, Tb: int) -> None:
        """The static commit of Bb rows of Tb positions (what a CUDA graph captures): feature rows from the
        rows buffer, slot / start / count from the packed inputs (padding rows: the dummy slot, count 0).
        Position t of row b lands at ring row start + t mod W of its slot when count − W ≤ t < count, else in
        the dummy slot; then observed[slot] = start + count. Device ops only, shapes fixed by (Bb, Tb)."""
        W = self.window
        d = self._observe_in.device
        slot, start, count = (d[f, :Bb].unsqueeze(1) for f in (0, self.START, self.COUNT))  # (Bb, 1) each
        t = self._ring_slot[:Tb]  # (Tb,) = arange(Tb): Tb ≤ W
        positions = start + t  # (Bb, Tb)
        # kept, and not overwritten by a later position of the same row (only the last W land)
        written = (t < count) & (t >= count - W)  # (Bb, Tb)
        target = torch.where(written, slot * W + positions % W, self.dummy * W + t % W).reshape(-1)  # (Bb·Tb,)
        main_x = self.drafter.main_x(self._block_rows(Bb, Tb))  # (Bb, Tb, dim)
        for ring, kv in zip(self.rings, self.drafter.context_keys(main_x, positions)):
            flat = ring.view(-1, ring.size(-1))  # ((max_sequences + 1)·W, D)
            flat.index_copy_(0, target, kv.reshape(Bb * Tb, -1).to(ring.dtype))  # (Bb·Tb, D)
        self.observed.index_copy_(0, d[0, :Bb], d[self.START, :Bb] + d[self.COUNT, :Bb])

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
