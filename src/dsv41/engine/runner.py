"""Cached forward: run a range of layers over new tokens for a batch of sequences.

The model's blocks are reused as they are; only attention is replaced by the cached version here,
which reads and writes the engine's fixed pools (`BlockManager`) through `kernels.ops` (Triton on
CUDA, the torch twins elsewhere) instead of seeing the whole sequence:
  * window keys = the layer's FP8 ring (earlier tokens) ∪ this chunk's new keys, with the bounded
    replay rule: query i sees window keys at positions [max(s, i − W + 1), i] where s is the
    replay start (SPEC §6). A one-token step writes its key into the ring first and reads the
    ring alone (the slot it overwrites is already out of the window);
  * a Full layer pools the tokens' complete groups (continuing the slot's partial group) and
    writes the packed entries and index keys straight into its pages (RoPE + FP4 in one op) —
    unless `compress=False` (a replay over tokens whose global KV is already cached: it is never
    recomputed nor overwritten);
  * Full and Reindex layers score the packed index keys (the candidate source also picks
    candidate blocks; Reindex layers score only inside them) and publish a top-k; Reuse layers
    take it; the attention kernel reads the selected packed entries directly.

Two ways in, one layer stack (`_layers`):
  * `forward(seqs, tokens, start, layers, ...)` — host-driven, any batch of sequences advancing by
    the same number of tokens (prefill chunks, tests); entry rows are reserved as groups complete;
  * `decode(io, B, n_max)` — the static decode step: every input is a view of the persistent
    device buffers of a `DecodeIO` (token, position, slot, Engram history, entry counts and the
    entry row each token writes), page tables are gathered by slot on the device, the compressor's
    partial groups are updated branch-free, and the indexer scores a fixed entry bound `n_max`
    masked by counts. No host tensor is built and nothing syncs with the host, so the step can be
    captured in a CUDA graph per (batch bucket, entry bound) and replayed (`engine/graphs.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from dsv41.engine.block_manager import BlockManager, to_device
from dsv41.engine.cache import FEW_ROWS, SequenceCache
from dsv41.engine.rollback import RollbackState
from dsv41.kernels import ops
from dsv41.model.mhc import hc_pre, identity_pre_mix
from dsv41.model.transformer import Entry, Transformer
from dsv41.plan import FULL, REINDEX


@dataclass
class Capture:
    """What a forward hands back besides the streams (speculative verification, `engine/speculative.py`):
    the hidden states of some layers for a drafter, and the ratio-m compressors' projections of every
    token (a rollback rebuilds the partial groups of the kept tokens from them)."""

    layers: tuple[int, ...] = ()  # block ids whose hidden state is wanted
    at: str = "output"  # "output": the streams leaving block i; "input": entering it (after its Engram)
    projections: bool = False  # keep (kv, score) of every ratio > 1 compressor
    features: dict[int, Tensor] = field(default_factory=dict)  # layer → (B, T, dim), the mean over streams
    kv_projections: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)  # source → 2 × (B, T, D) fp32

    def __post_init__(self) -> None:
        if self.at not in ("input", "output"):
            raise ValueError(f"Capture.at must be 'input' or 'output', got {self.at!r}")


@dataclass
class Carry:
    """What passes from one layer piece of a chunk to the next (a prefill cut at layer granularity,
    `engine/prefill.py`): the streams, the fused input the last block made for the next one, and the
    selection Reuse layers take — so that pieces [a, b) then [b, c) compute exactly what [a, c) does."""

    stop: int  # end of the whole layer range the pieces cover (the fused hand-over never crosses it)
    h: Tensor | None = None  # (B, T, n, d) streams entering the next piece
    pre_mix: Tensor | None = None  # (B, T, n)
    entry: Entry | None = None  # (collapsed input, attention coefficients) made for the next block
    topk: Tensor | None = None  # (B, T, K) the last index source's selection
    blocks: Tensor | None = None  # (B, T, kb) the candidate source's blocks


@dataclass
class StepRecord:
    """What one cached forward shares across layers (replaces the reference's module global)."""

    pools: BlockManager
    positions: Tensor  # (B, T) absolute positions
    slots: Tensor  # (B,) slot of each row (ring, partial groups, page-table row)
    ring_row: Tensor  # (B, T) flat ring row slot·W + position % W where each token's window key lands
    history: Tensor | None  # (B, k) Engram history (token ids before the chunk, −1 = none)
    replay_start: Tensor | None = None  # (B,) bounded-replay start of the window, None = off
    compress: bool = True
    seqs: list[SequenceCache] | None = None  # host-driven forward; None in the static decode step
    start: list[int] | None = None  # host copy of each row's first position (host-driven only)
    # source → (page table (B, width) int32, entry counts (B,), entry bound); static: set up front
    sources: dict[int, tuple[Tensor, Tensor, int]] = field(default_factory=dict)
    write_rows: dict[int, Tensor] = field(default_factory=dict)  # static: (B, 1) entry row, −1 = none
    topk: Tensor | None = None  # (B, T, K) entry indices, −1 = none
    blocks: Tensor | None = None  # (B, T, kb) candidate block ids of the candidate source, −1 = none
    rotations: dict[bool, tuple[Tensor, Tensor]] = field(default_factory=dict)
    image_mask: Tensor | None = None  # (B, T) image positions of a prefill piece (bias_vl routing, dead for Engram)
    capture: Capture | None = None  # hidden states / projections to hand back
    valid: Tensor | None = None  # (B,) ragged static rows (`DecodeIO(ragged=True)`): block positions [0, valid) are
    # real, the rest padding whose per-slot state (window ring, partial group, entries) is never written
    window_in_block: bool = False  # every window key a query sees is in the block (the static replay: its window
    # starts at the block's first position), so the attention reads no ring
    _chunk_rows: Tensor | None = field(default=None, repr=False)  # `chunk_rows()`

    def chunk_rows(self) -> Tensor:
        """(B, T) int64 0 … B·T − 1: where each token's quantized window key lands in a chunk's own rows (T > 1),
        built once per forward."""
        if self._chunk_rows is None:
            B, T = self.positions.shape
            self._chunk_rows = torch.arange(B * T, device=self.positions.device).view(B, T)
        return self._chunk_rows

    def angles(self, attn) -> tuple[Tensor, Tensor]:
        """cos, sin of the tokens' positions for a layer, computed once per forward for each of the two
        frequency sets (`rope.layer_frequencies`: window-only layers, compressed layers)."""
        key = attn.ratio > 0
        if key not in self.rotations:
            self.rotations[key] = attn.angles(self.positions)
        return self.rotations[key]


class Runner:
    """The cached forward of one model over any pools (each call reads them from its sequences / io)."""

    def __init__(self, model: Transformer):
        self.model = model
        self.config = model.config
        self.plans = model.plan

    # ------------------------------------------------------------------ host-driven entry point
    @torch.no_grad()
    def forward(self, seqs: list[SequenceCache], tokens: Tensor, start: Tensor | list[int], layers: range,
                h: Tensor | None = None, pre_mix: Tensor | None = None, *, replay_start: Tensor | None = None,
                compress: bool = True, image_mask: Tensor | None = None,
                image_embeds: Tensor | None = None, capture: Capture | None = None,
                carry: Carry | None = None) -> tuple[Tensor, Tensor]:
        """Run `layers` over tokens (B, T) at positions start[b] + t. Starting at layer 0 embeds the
        tokens — the M True positions of `image_mask` (B, T) taking `image_embeds` (M, dim), the vision
        stage's output (`prefill.encode_prompt_images`); otherwise (h, pre_mix) are the streams entering
        layers.start. Image positions route with `bias_vl` and are dead for Engram. Tokens before
        start[b] must already be in seqs[b].tokens (Engram history). `capture` collects hidden states and
        compressor projections on the way (speculative verification). With `carry`, `layers` is one
        piece of carry's range: the streams (when layers.start > 0), the fused hand-over and the top-k
        come from it, and go back into it for the next piece."""
        record = self.host_record(seqs, start, tokens.size(1), replay_start=replay_start, compress=compress,
                                  history=any(self.plans[i].engram for i in layers))
        record.image_mask = image_mask
        record.capture = capture
        return self._layers(record, tokens, layers, h, pre_mix, image_embeds, carry)

    def host_record(self, seqs: list[SequenceCache], start: Tensor | list[int], T: int, *,
                    replay_start: Tensor | None = None, compress: bool = True, history: bool = True) -> StepRecord:
        pools = seqs[0].pools
        if any(s.pools is not pools for s in seqs):
            raise ValueError("sequences decoded in one batch must share one BlockManager (create them "
                             "with the same `pools`, as Engine does)")
        device = pools.device
        start = [int(v) for v in (start.tolist() if isinstance(start, Tensor) else start)]
        positions = to_device(start, device).unsqueeze(1) + torch.arange(T, device=device)  # (B, T)
        slots = to_device([s.slot for s in seqs], device)
        hist = None
        if history and self.model.hasher is not None:
            k = self.config.engram_max_ngram_size - 1
            rows = []
            for s, st in zip(seqs, start):
                prev = engram_history(s.tokens[max(0, st - k):st], self.config)
                rows.append([-1] * (k - len(prev)) + prev)
            hist = to_device(rows, device)  # (B, k)
        W = self.config.window_size
        return StepRecord(pools, positions, slots, slots.unsqueeze(1) * W + positions % W, hist,
                          replay_start=replay_start, compress=compress, seqs=seqs, start=start)

    def logits(self, h: Tensor, pre_mix: Tensor) -> Tensor:
        """Final collapse → norm → fp32 head, for the last position of each row: (B, vocab)."""
        return self.model.head_logits(hc_pre(h[:, -1:], pre_mix[:, -1:]))[:, 0]

    @torch.no_grad()
    def produce(self, layer_id: int, seqs: list[SequenceCache], h: Tensor, pre_mix: Tensor,
                start: Tensor | list[int]) -> None:
        """Global KV of a kv-source layer from the streams entering it, without running the layer
        (encoder-only prefill: the decoder's kv source reads the encoder output)."""
        record = self.host_record(seqs, start, h.size(1), history=False)
        x = self.model.layers[layer_id].attn_input(h, pre_mix)
        self._compress_host(layer_id, x, record)

    # ------------------------------------------------------------------ the static decode step
    @torch.no_grad()
    def decode(self, io: DecodeIO, B: int, n_max: dict[int, int], *, features: bool = True) -> Tensor:
        """The first B rows of `io` advance by io.T tokens each through every layer: one token (a decode
        step), a verification block of T positions (speculative decoding) or an exact prefill chunk of any T
        (`test_a_static_step_of_more_than_a_window_is_an_exact_prefill_chunk`). Writes and returns
        io.logits[:B] — (B, vocab) fp32 for T = 1 or io.last_only (the last position), (B, T, vocab) else — and,
        when io.capture_layers is set, the wanted features into io.features (or io.feature_ring) and the
        ratio-m compressors' projections into io.projections. Shapes depend only on (B, n_max): capturable.
        features=False: no features at all (a drafter engine's lean plain step, `Engine._lean`)."""
        record = io.record(B, n_max)
        if io.rollback is not None:  # what the block overwrites, before it does
            io.rollback.snapshot(record.slots, io.device[io.POS, :B])
        layers = io.capture_layers if features else ()
        if layers or io.projections:
            record.capture = Capture(layers=layers, at=io.capture_at, projections=bool(io.projections))
        h, pre_mix = self._layers(record, io.block(B), range(self.config.n_layers))
        out = io.logits[:B]
        out.copy_(self.logits(h, pre_mix) if io.last_only else self.model.head_logits(hc_pre(h, pre_mix)))
        capture = record.capture
        if capture is not None:
            if layers and io.features is not None:
                for j, layer in enumerate(io.capture_layers):
                    io.features[j, :B].copy_(capture.features[layer])  # (B, T, dim)
            if layers and io.feature_ring is not None:  # per-slot ring of the features (a drafter catches up from it)
                stacked = torch.stack([capture.features[i] for i in io.capture_layers], dim=2)  # (B, T, n, dim)
                W = io.feature_ring.size(1)
                io.feature_ring[record.slots.view(B, 1), record.positions % W] = stacked.to(io.feature_ring.dtype)
            for s, (kv_buf, score_buf) in io.projections.items():
                kv, score = capture.kv_projections[s]
                kv_buf[:B].copy_(kv)
                score_buf[:B].copy_(score)
        return out

    @torch.no_grad()
    def static_layers(self, io: DecodeIO, B: int, n_max: dict[int, int], layers: range, h: Tensor | None = None,
                      pre_mix: Tensor | None = None, *, compress: bool = True, replay: bool = False,
                      capture: Capture | None = None) -> tuple[Tensor, Tensor]:
        """The static step of io's first B rows through `layers` only, the streams (h, pre_mix) in (from
        layers.start > 0) and out, no head: an encoder-only prefill chunk (the encoder layers, `compress`),
        or the decoder's bounded replay of a window already in the cache (replay: the window starts at each
        row's first position; compress=False: its entries exist). Device ops only, like `decode`. `capture`:
        its layers' features (B, T, dim) into capture.features (a drafter's, from the replay: `StaticPrefill`)."""
        record = io.record(B, n_max)
        record.compress = compress
        record.capture = capture
        if replay:
            record.replay_start = record.positions[:, 0].contiguous()
            record.window_in_block = True
        return self._layers(record, io.block(B), layers, h, pre_mix)

    @torch.no_grad()
    def static_produce(self, io: DecodeIO, B: int, n_max: dict[int, int], layer_id: int, h: Tensor,
                       pre_mix: Tensor) -> None:
        """`produce` for the static step: the kv source `layer_id`'s entries of io's rows from the streams
        entering it (encoder-only prefill: the decoder's global KV from the encoder output), written to the
        rows `fill_batch` reserved."""
        record = io.record(B, n_max)
        self._compress_static(layer_id, self.model.layers[layer_id].attn_input(h, pre_mix), record)

    @torch.no_grad()
    def restore(self, io: DecodeIO, B: int) -> None:
        """Undo what the last static step of `io` (rollback=True) wrote past each row's keep count
        (`io.send_keep`), for its first B rows: device ops only, capturable (`DecodeGraphs.restore`)."""
        d = io.device
        io.rollback.restore(d[io.SLOT, :B], d[io.POS, :B], io.keep_device[:B],
                            {s: (kv[:B], sc[:B]) for s, (kv, sc) in io.projections.items()})

    # ------------------------------------------------------------------ the layer stack
    def _layers(self, record: StepRecord, tokens: Tensor, layers: range, h: Tensor | None = None,
                pre_mix: Tensor | None = None, image_embeds: Tensor | None = None,
                carry: Carry | None = None) -> tuple[Tensor, Tensor]:
        model, c = self.model, self.config
        image_mask = record.image_mask  # None in the decode step: text tokens only
        entry = None  # (input, coefficients) the previous block's last fused pass made for the next block
        last = layers.stop - 1  # the last block whose hand-over may fuse the next one's projection
        if carry is not None:
            if not carry.stop >= layers.stop:
                raise ValueError(f"layers {layers} run past the carried range's end {carry.stop}")
            if layers.start > 0 and carry.h is not None:
                h, pre_mix = carry.h, carry.pre_mix
            entry, record.topk, record.blocks = carry.entry, carry.topk, carry.blocks
            last = carry.stop - 1
        if layers.start == 0:
            x = model.embed(tokens) if image_embeds is None else model.embed_tokens(tokens, image_mask, image_embeds)
            h = x.unsqueeze(2).repeat(1, 1, c.hc_mult, 1)  # (B, T, n, d)
            pre_mix = identity_pre_mix(h, c.hc_mult)
        hash_ids = None
        if any(self.plans[i].engram for i in layers):
            hash_ids = model.hasher(tokens, history=record.history, dead_mask=image_mask)  # (B, T, n_engram, cols)
        capture = record.capture
        wanted = set(capture.layers) if capture is not None else set()
        for i in layers:
            block = model.layers[i]
            if block.engram is not None:
                h = block.engram(h, hash_ids[:, :, model.engram_index[i]], None if image_mask is None else ~image_mask)
                entry = None
            if i in wanted and capture.at == "input":
                capture.features[i] = h.mean(dim=2)  # (B, T, d)

            def attention(x: Tensor, i: int = i) -> Tensor:
                return self.attention(i, x, record)

            h, pre_mix, entry = block(h, pre_mix, attention, image_mask=image_mask, entry=entry,
                                      next_block=model.next_block(i, last))
            if i in wanted and capture.at == "output":
                capture.features[i] = h.mean(dim=2)  # (B, T, d)
        if carry is not None:
            carry.h, carry.pre_mix, carry.entry = h, pre_mix, entry
            carry.topk, carry.blocks = record.topk, record.blocks
        return h, pre_mix

    # ------------------------------------------------------------------ attention with caches
    def attention(self, layer_id: int, x: Tensor, record: StepRecord) -> Tensor:
        attn = self.model.layers[layer_id].attn
        plan = self.plans[layer_id]
        pools = record.pools
        B, T, _ = x.shape
        W = attn.window
        cos, sin = record.angles(attn)
        q_a, kv_a = attn.project(x)  # wq_a(x), wkv(x): one GEMM when fused (`Attention.fuse_projections`)
        qr, q = attn.query(x, cos, sin, q_a)
        kv = attn.kv_norm(kv_a)  # (B, T, D) before RoPE and FP8
        ring_rows = pools.ring_rows[layer_id].view(-1, pools.ring_bytes)  # (S·W, bytes)
        ring_pos = pools.ring_positions[layer_id]  # (S, W)
        chunk = None
        if T == 1:  # write first: the slot overwritten holds position − W, outside the window
            ops.rope_quantize(kv, cos, sin, "window_fp8", ring_rows, record.ring_row)
            ring_pos.view(-1)[record.ring_row.view(-1)] = record.positions.view(-1)
        else:
            chunk = torch.empty(B * T, pools.ring_bytes, dtype=torch.uint8, device=x.device)
            ops.rope_quantize(kv, cos, sin, "window_fp8", chunk, record.chunk_rows())
            chunk = chunk.view(B, T, -1)

        entry_args = {}
        if plan.ratio:
            if plan.mode == FULL and record.compress:
                if record.seqs is None:
                    self._compress_static(layer_id, x, record)
                else:
                    self._compress_host(layer_id, x, record)
            if plan.mode in (FULL, REINDEX):
                record.topk = self._index(layer_id, x, qr, cos, sin, record)
            table = self._source(plan.kv_source, record)[0]
            src = pools.sources[plan.kv_source]
            entry_args = dict(entry_pool=src.kv_rows, page_table=table, page_rows=src.page_rows, topk=record.topk)
        ring_args = {}
        if chunk is None or not record.window_in_block:  # (a replay's window is its block: the ring is all masked)
            ring_args = dict(ring_kv=pools.ring_rows[layer_id], ring_pos=ring_pos, ring_ids=record.slots)
        o = ops.sparse_attention(q, record.positions, attn.attn_sink, attn.scale, W, chunk_kv=chunk,
                                 window_start=record.replay_start, **ring_args, **entry_args)
        if chunk is not None:  # now the chunk's last W keys replace the oldest ring slots
            # (a ragged row's last W real keys: block positions [valid − w, valid); one kernel on CUDA)
            ops.ring_write(chunk, record.positions, record.ring_row, record.valid, ring_rows, ring_pos.view(-1), W)
        return attn.output(o, cos, sin)

    def _source(self, source: int, record: StepRecord) -> tuple[Tensor, Tensor, int]:
        """(page table (B, width) int32, entry counts (B,), entry bound) of a kv source, built once
        per host-driven call after the source has written (set up front in the static step)."""
        if source not in record.sources:
            pools = record.pools
            pools.sync_tables()
            counts = [s.entry_stores[source].n_entries for s in record.seqs]
            record.sources[source] = (pools.sources[source].table.index_select(0, record.slots),
                                      to_device(counts, pools.device), max(counts))
        return record.sources[source]

    def _compress_host(self, layer_id: int, x: Tensor, record: StepRecord) -> None:
        """Pool each sequence's newly completed groups; write entries and index keys into its pages."""
        attn = self.model.layers[layer_id].attn
        comp, m = attn.compressor, attn.ratio
        pool = record.pools.sources[layer_id]
        rows: list[Tensor] = []
        record.sources.pop(layer_id, None)
        T = x.size(1)
        if m == 1:  # every token is an entry: one projection for the whole batch
            latent, starts = comp.norm(comp.wkv(x)).flatten(0, 1), record.positions.flatten()  # (B·T, D), (B·T,)
            for s in record.seqs:
                rows.append(s.entry_stores[layer_id].reserve_ids(T))
        else:
            latents, group_starts = [], []
            projected = []
            for b, s in enumerate(record.seqs):
                kv, score = comp.project(x[b])  # (T, D) fp32
                projected.append((kv, score))
                r = record.start[b] % m  # tokens of an unfinished group already waiting in the slot
                if r:
                    kv = torch.cat((pool.pending_kv[s.slot, :r], kv))
                    score = torch.cat((pool.pending_score[s.slot, :r], score))
                n, left = divmod(kv.size(0), m)
                if left:
                    pool.pending_kv[s.slot, :left] = kv[n * m:]
                    pool.pending_score[s.slot, :left] = score[n * m:]
                if n == 0:
                    continue
                pooled = comp.pool(kv[:n * m].view(n, m, -1), score[:n * m].view(n, m, -1))  # (n, D)
                latents.append(comp.norm(pooled.to(x.dtype)))
                group_starts.append(record.start[b] - r + m * torch.arange(n, device=x.device))
                rows.append(s.entry_stores[layer_id].reserve_ids(n))
            if record.capture is not None and record.capture.projections:  # a speculative rollback rebuilds
                record.capture.kv_projections[layer_id] = tuple(torch.stack(t) for t in zip(*projected))  # (B, T, D)
            if not latents:
                return
            latent, starts = torch.cat(latents), torch.cat(group_starts)
        row_ids = torch.cat(rows)[None]
        self._write_entries(layer_id, latent.unsqueeze(0), starts.unsqueeze(0), row_ids, pool)

    def _compress_static(self, layer_id: int, x: Tensor, record: StepRecord) -> None:
        """Compression of a static step (T tokens per row) without host work: each token that completes a
        group writes its entry to the row the host reserved for it (−1 otherwise). The group's older
        members come from the slot's partial group, the rest from this step's tokens; afterwards the
        slot's partial group holds the members of the group still open after the T tokens."""
        attn = self.model.layers[layer_id].attn
        comp, m = attn.compressor, attn.ratio
        pool = record.pools.sources[layer_id]
        pos = record.positions  # (B, T)
        B, T = pos.shape
        if m == 1:
            latent, first = comp.norm(comp.wkv(x)), pos  # (B, T, D)
        else:
            kv, score = comp.project(x)  # (B, T, D) fp32
            capture = record.capture
            if capture is not None and capture.projections:  # a speculative rollback rebuilds partial groups
                capture.kv_projections[layer_id] = (kv, score)
            slots = record.slots
            first = pos - (m - 1)
            if T == 1:
                group_kv = torch.cat((pool.pending_kv[slots], kv), dim=1)  # (B, m, D): valid when this token ends it
                group_score = torch.cat((pool.pending_score[slots], score), dim=1)
                latent = comp.norm(comp.pool(group_kv, group_score).to(x.dtype)).unsqueeze(1)  # (B, 1, D)
                # the token joins its slot's partial group unless it completed the group (then it is
                # parked in the dummy slot): index_put, no branch on the host
                j = (pos % m).view(-1)
                keep = torch.where(j < m - 1, slots, torch.full_like(slots, record.pools.dummy_slot))
                jj = j.clamp(max=m - 2)
                pool.pending_kv[keep, jj] = kv[:, 0]
                pool.pending_score[keep, jj] = score[:, 0]
            else:
                # (B, m − 1 + T, D): the slot's partial group (positions g0 …) then the T tokens (positions s …)
                ext_kv = torch.cat((pool.pending_kv[slots], kv), dim=1)
                ext_score = torch.cat((pool.pending_score[slots], score), dim=1)
                s0 = pos[:, :1]  # (B, 1) first position of the step
                g0 = s0 - s0 % m  # (B, 1) first position of the group open before the step

                def gather(where: Tensor) -> tuple[Tensor, Tensor]:
                    """Members at positions `where` (B, N) → their (kv, score) (B, N, D) from ext_*; positions
                    outside [g0, s0 + T) read a clamped row (only ever in groups that are not written)."""
                    idx = torch.where(where >= s0, where - s0 + (m - 1), where - g0).clamp(0, m - 2 + T)
                    idx = idx.unsqueeze(-1).expand(-1, -1, ext_kv.size(-1))  # (B, N, D)
                    return ext_kv.gather(1, idx), ext_score.gather(1, idx)

                members = first.unsqueeze(-1) + torch.arange(m, device=x.device)  # (B, T, m) the group token t ends
                gk, gs = gather(members.view(B, T * m))
                pooled = comp.pool(gk.view(B, T, m, -1), gs.view(B, T, m, -1))  # (B, T, D)
                latent = comp.norm(pooled.to(x.dtype))
                end = s0 + (T if record.valid is None else record.valid.view(B, 1))  # (B, 1) tokens after the step
                open_members = end - end % m + torch.arange(m - 1, device=x.device)  # (B, m − 1)
                pk, ps = gather(open_members)
                pool.pending_kv[slots] = pk  # padding rows all write the dummy slot
                pool.pending_score[slots] = ps
        self._write_entries(layer_id, latent, first, record.write_rows[layer_id], pool)

    def _write_entries(self, layer_id: int, latent: Tensor, first: Tensor, rows: Tensor, pool) -> None:
        """Pre-RoPE latents (1|B, N, D) rotated at their group's first position → FP4 entry rows and
        index-key rows `rows` (−1 skips)."""
        attn = self.model.layers[layer_id].attn
        cos, sin = attn.angles(first)
        index_k = attn.indexer.k_norm(attn.indexer.wk(latent))  # (.., N, Di) pre-RoPE
        ops.rope_quantize(latent, cos, sin, "kv_fp4", pool.kv_rows, rows)
        ops.rope_quantize(index_k, cos, sin, "index_fp4", pool.index_rows, rows)

    def _index(self, layer_id: int, x: Tensor, qr: Tensor, cos: Tensor, sin: Tensor, record: StepRecord) -> Tensor:
        """Top-k entry indices (B, T, K) for every query; candidate blocks at the candidate source."""
        attn = self.model.layers[layer_id].attn
        plan = self.plans[layer_id]
        pool = record.pools.sources[plan.kv_source]
        tables, counts, n_max = self._source(plan.kv_source, record)
        iq = attn.indexer.queries(qr, cos, sin, True)  # (B, T, Hi, Di) FP4 values
        weights = attn.indexer.head_weights(x)  # (B, T, Hi)
        visible_end = (record.positions + 1) // attn.ratio  # entries before it have completed
        bs = attn.candidate_block_size
        if plan.uses_candidates and not plan.candidate_source:
            scores = ops.indexer_scores_blocks(iq, weights, pool.index_rows, tables, pool.page_rows, counts,
                                               visible_end, record.blocks, bs)
            ids = record.blocks.unsqueeze(-1) * bs + torch.arange(bs, device=x.device)  # (B, T, kb, bs)
            return ops.topk_indices(scores, attn.index_topk, ids.flatten(-2))
        scores, block_max = ops.indexer_scores(iq, weights, pool.index_rows, tables, pool.page_rows, counts,
                                               visible_end, n_max, bs if plan.candidate_source else 0)
        if plan.candidate_source:
            n_visible = torch.minimum(visible_end, counts.view(-1, 1))
            newest = torch.where(n_visible > 0, (n_visible - 1) // bs, -1)
            record.blocks = ops.select_blocks(block_max, newest, attn.candidate_topk_blocks)
        return ops.topk_indices(scores, attn.index_topk)


def engram_history(prev: list[int], config) -> list[int]:
    """Engram history ids: image positions are dead (−1), as in training (`NgramHasher(dead_mask=)`)."""
    if not config.vision_enabled:
        return prev
    return [-1 if t == config.image_token_id else t for t in prev]


class DecodeIO:
    """Persistent buffers of the static step for up to `max_batch` rows of T positions each (T = 1: a
    decode step; T > 1: a speculative verification block, or an exact prefill chunk — any T without rollback
    or feature ring, `last_only` for the last position's logits).

    One int64 host buffer (pinned on CUDA) holds every per-row input, one field per row of the
    buffer so that each field's first B entries are a contiguous view; the host fills it and
    `send()` copies it to its device twin in one transfer. Fields: the T tokens, the first position,
    slot, Engram history (k columns: the tokens before the first position), and per kv source its
    entry count after the step and, per position, the pool row of the entry that token completes
    (−1 = none). `logits` is the step's output: (max_batch, vocab) for T = 1 or last_only,
    (max_batch, T, vocab) else. With `capture_layers`, the step also hands back those layers' features (the mean over
    streams, `Capture`) in `features` (n, max_batch, T, dim) — or, when `feature_ring` is given, a
    (slots + 1, W, n, dim) tensor, stores them there per slot and position % W instead (`features` is None: a
    drafter engine's plain decode step, whose features only the ring keeps); with `projections`, the
    ratio-m compressors' projections of every position (a rollback rebuilds partial groups from them).

    `ragged` (T > 1, no rollback or feature ring): row b may run fewer tokens than T — `fill_batch` pads its block
    after them and records its count in a `VALID` field; the step computes the padded positions too (they come
    after every real one, so no real position sees them) but writes nothing of theirs into the sequence's state:
    no entry row is reserved for a group they complete, the window ring takes the row's last real keys, and the
    partial group is the one open after its last real token. So a prefill piece of any length n ≤ T runs at
    the shape T (`engine/static_prefill.py`: a few power-of-two shapes, one CUDA graph each)."""

    def __init__(self, config, pools: BlockManager, max_batch: int, T: int = 1, *,
                 capture_layers: tuple[int, ...] = (), capture_at: str = "output", projections: bool = False,
                 feature_ring: Tensor | None = None, rollback: bool = False, last_only: bool = False,
                 ragged: bool = False):
        if T < 1:
            raise ValueError(f"a static step of {T} positions per row; T >= 1")
        if ragged and (T == 1 or rollback or feature_ring is not None):
            raise ValueError("ragged rows need T > 1 and no rollback or feature ring")
        self.ragged = ragged
        if T > config.window_size and (rollback or feature_ring is not None):
            # the rollback snapshots and the feature ring hold one window of positions per slot
            raise ValueError(f"a static step of {T} positions per row with rollback or a feature ring; "
                             f"T <= window_size = {config.window_size}")
        self.last_only = last_only or T == 1  # logits of each row's last position only
        self.config, self.pools, self.max_batch, self.T = config, pools, max_batch, T
        self.k = config.engram_max_ngram_size - 1 if config.engram_layer_ids else 0
        self.sources = list(pools.sources)
        self.TOK, self.POS, self.SLOT, self.HIST = 0, T, T + 1, T + 2
        self.VALID = T + 2 + self.k  # each row's real tokens (T unless ragged)
        base = T + 3 + self.k
        self.CNT = {s: base + (T + 1) * i for i, s in enumerate(self.sources)}
        self.ROW = {s: base + (T + 1) * i + 1 for i, s in enumerate(self.sources)}  # T fields from here
        n_fields = base + (T + 1) * len(self.sources)
        device = pools.device
        self.host = torch.zeros(n_fields, max_batch, dtype=torch.long, pin_memory=device.type == "cuda")
        self.view = self.host.numpy()  # (F, max_batch) host writes without torch ops
        self.device = torch.zeros(n_fields, max_batch, dtype=torch.long, device=device)
        shape = (max_batch, config.vocab_size) if self.last_only else (max_batch, T, config.vocab_size)
        self.logits = torch.zeros(shape, dtype=torch.float32, device=device)
        self.capture_layers, self.capture_at = tuple(capture_layers), capture_at
        # fp32 holds the model's bf16 features exactly
        self.features = None if feature_ring is not None else torch.zeros(
            len(self.capture_layers), max_batch, T, config.dim, device=device)
        self.feature_ring = feature_ring
        self.projections: dict[int, tuple[Tensor, Tensor]] = {}
        if projections:
            for s, p in pools.sources.items():
                if p.pending_kv is not None:
                    D = p.pending_kv.size(-1)
                    self.projections[s] = (torch.zeros(max_batch, T, D, device=device),
                                           torch.zeros(max_batch, T, D, device=device))
        # the speculative rollback: the step snapshots what it overwrites; `Runner.restore` undoes the
        # positions past each row's keep count (a pinned host mirror, sent after acceptance)
        self.rollback = RollbackState(pools, max_batch, T) if rollback else None
        if rollback and not self.projections and self.rollback.pending:
            raise ValueError("DecodeIO(rollback=True) needs projections=True: partial groups are rebuilt from them")
        self.keep_host = torch.full((max_batch,), T, dtype=torch.long, pin_memory=device.type == "cuda")
        self.keep_device = torch.full((max_batch,), T, dtype=torch.long, device=device)
        self._keep_sent = torch.cuda.Event() if device.type == "cuda" else None
        self._sent = torch.cuda.Event() if device.type == "cuda" else None
        self.pad(0)
        self.pad_device = self.host.to(device, copy=True)  # every row padding (graph warm-up)

    @property
    def tokens(self) -> Tensor:
        """(max_batch,) the first position's token of each row."""
        return self.device[self.TOK]

    def block(self, B: int) -> Tensor:
        """(B, T) the tokens of the first B rows (a view of the device buffer)."""
        return self.device[self.TOK:self.TOK + self.T, :B].t()

    def pad(self, first: int, last: int | None = None) -> None:
        """Rows [first, last) become padding: dummy slot, position 0, no entry written."""
        v, last = self.view, self.max_batch if last is None else last
        v[:, first:last] = 0
        v[self.SLOT, first:last] = self.pools.dummy_slot
        v[self.HIST:self.HIST + self.k, first:last] = -1
        v[self.VALID, first:last] = self.T
        for s in self.sources:
            v[self.ROW[s]:self.ROW[s] + self.T, first:last] = -1

    def fill_batch(self, caches: list[SequenceCache], tokens: list[int] | list[list[int]], *,
                   positions: list[int] | None = None, reserve: bool = True) -> None:
        """Row b runs tokens[b] (one token, or a block of T) at the end of caches[b], for b < B, reserving
        the entry rows the step completes. One host write per field for the whole batch (per-row writes
        cost ~20 µs a row). `positions`: the rows' first positions instead of their ends (tokens already in
        the cache run again — the decoder's bounded replay — with reserve=False: no entry is written).
        A ragged io takes 1 to T tokens per row (its block is padded after them)."""
        v, B, T = self.view, len(caches), self.T
        if positions is None:
            positions = [c.n_tokens for c in caches]
        lengths = [T] * B
        if T == 1:
            v[self.TOK, :B] = tokens
        elif self.ragged:
            lengths = [len(t) for t in tokens]
            if not all(1 <= n <= T for n in lengths):
                raise ValueError(f"a ragged static step of {T} positions per row got rows of {lengths} tokens")
            block = v[self.TOK:self.TOK + T]  # (T, max_batch)
            for b, (row, n) in enumerate(zip(tokens, lengths)):
                # np.fromiter: a Python list of 8K ids in ~0.14 ms, where a slice assignment takes ~0.17
                block[:n, b] = row if isinstance(row, np.ndarray) else np.fromiter(row, np.int64, n)
                block[n:, b] = 0  # padding: token 0
        else:
            v[self.TOK:self.TOK + T, :B] = np.asarray(tokens, dtype=np.int64).reshape(B, T).T
        v[self.VALID, :B] = lengths
        v[self.POS, :B] = positions
        v[self.SLOT, :B] = [c.slot for c in caches]
        k = self.k
        if k:
            pad = [-1] * k
            # (B, k): the k tokens before each row's first token, left-padded with -1 near the start
            hist = [(pad + engram_history(c.tokens[max(0, p - k):p], self.config))[-k:]
                    for c, p in zip(caches, positions)]
            v[self.HIST:self.HIST + k, :B] = np.asarray(hist, dtype=np.int64).T
        for s in self.sources:
            stores = [c.entry_stores[s] for c in caches]
            m = stores[0].ratio if stores else 1
            rows = v[self.ROW[s]:self.ROW[s] + T]  # (T, max_batch)
            rows[:, :B] = -1
            for b, (pos, store, n) in enumerate(zip(positions, stores, lengths)):
                # the real positions whose token completes a compressed entry: their rows are reserved now
                ends = range((m - 1 - pos) % m, n, m) if reserve else range(0)  # (pos + t + 1) % m == 0
                if len(ends) > FEW_ROWS:  # a prefill piece's rows: one array, no Python list (8K tokens: ~1 ms)
                    rows[ends.start:n:m, b] = store.reserve_array(len(ends))
                elif len(ends):
                    rows[ends.start:n:m, b] = store.reserve(len(ends))
            v[self.CNT[s], :B] = [store.n_entries for store in stores]

    def send(self) -> None:
        """Host buffer and changed page tables → device (non-blocking; ordered before the step)."""
        self.device.copy_(self.host, non_blocking=True)
        self.pools.sync_tables()
        if self._sent is not None:
            self._sent.record()

    def wait_sent(self) -> None:
        """Before the host buffer is written again: the last `send`'s copy out of it is done. A step that waits
        for its own tokens has waited for it already; an overlapped one (`Engine(overlap=True)`) fills the next
        step while the device may not have reached the copy yet."""
        if self._sent is not None:
            self._sent.synchronize()

    def send_keep(self, keep: list[int]) -> None:
        """Rows [0, B) keep their first keep[b] block positions (`Runner.restore`); padding rows keep all T."""
        if self._keep_sent is not None:
            self._keep_sent.synchronize()  # the last copy out of the pinned buffer is done (at once, normally)
        v = self.keep_host.numpy()
        v[:len(keep)], v[len(keep):] = keep, self.T
        self.keep_device.copy_(self.keep_host, non_blocking=True)
        if self._keep_sent is not None:
            self._keep_sent.record()

    def max_entries(self, B: int) -> dict[int, int]:
        return {s: int(self.view[self.CNT[s], :B].max()) if B else 0 for s in self.sources}

    def record(self, B: int, n_max: dict[int, int]) -> StepRecord:
        """Views of the first B rows as a step record (device ops only)."""
        d, pools, T = self.device, self.pools, self.T
        first = d[self.POS, :B].view(B, 1)
        positions = first if T == 1 else first + torch.arange(T, device=d.device)  # (B, T)
        slots = d[self.SLOT, :B]
        history = d[self.HIST:self.HIST + self.k, :B].t() if self.k else None  # (B, k)
        W = self.config.window_size
        rec = StepRecord(pools, positions, slots, slots.view(B, 1) * W + positions % W, history, seqs=None,
                         valid=d[self.VALID, :B] if self.ragged else None)
        for s in self.sources:
            table = pools.sources[s].table.index_select(0, slots)  # (B, width) int32
            rec.sources[s] = (table, d[self.CNT[s], :B], max(1, int(n_max[s])))
            rec.write_rows[s] = d[self.ROW[s]:self.ROW[s] + T, :B].t()  # (B, T)
        return rec
