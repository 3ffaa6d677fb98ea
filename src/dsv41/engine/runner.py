"""Cached forward: run a range of layers over a chunk of new tokens for a batch of sequences.

The model's blocks are reused as they are; only attention is replaced by the cached version here,
which reads and writes the per-sequence caches through `kernels.ops` (Triton on CUDA, the torch
twins elsewhere) instead of seeing the whole sequence:
  * window keys = the layer's FP8 ring (earlier tokens) ∪ this chunk's new keys, with the bounded
    replay rule: query i sees window keys at positions [max(s, i − W + 1), i] where s is the
    replay start (SPEC §6). A one-token step writes its key into the ring first and reads the
    ring alone (the slot it overwrites is already out of the window);
  * a Full layer pools the chunk's complete groups (continuing its partial group) and writes the
    packed entries and index keys straight into its pages (RoPE + FP4 in one op) — unless
    `compress=False` (a replay over tokens whose global KV is already cached: it is never
    recomputed nor overwritten);
  * Full and Reindex layers score the packed index keys (the candidate source also picks
    candidate blocks; Reindex layers score only inside them) and publish a top-k; Reuse layers
    take it; the attention kernel reads the selected packed entries directly.
All sequences of one call advance by the same number of tokens (a prefill chunk of one sequence,
or one decode token for each of many sequences of different lengths) and share one `CachePools`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from dsv41.engine.cache import CachePools, SequenceCache
from dsv41.kernels import ops
from dsv41.model.mhc import hc_pre, identity_pre_mix
from dsv41.model.transformer import Transformer
from dsv41.plan import FULL, REINDEX


@dataclass
class StepRecord:
    """What one cached forward shares across layers (replaces the reference's global)."""

    pools: CachePools
    ring_ids: Tensor  # (B,) ring slot of each sequence
    start: list[int]  # first position of each row (host copy: no device sync per layer)
    topk: Tensor | None = None  # (B, T, K) entry indices, −1 = none
    blocks: Tensor | None = None  # (B, T, kb) candidate block ids of the candidate source, −1 = none
    tables: dict[int, tuple[Tensor, Tensor, Tensor]] = field(default_factory=dict)  # source → (kv, index, counts)


class Runner:
    def __init__(self, model: Transformer):
        self.model = model
        self.config = model.config
        self.plans = model.plan

    # ------------------------------------------------------------------ entry points
    @torch.no_grad()
    def forward(self, seqs: list[SequenceCache], tokens: Tensor, start: Tensor, layers: range,
                h: Tensor | None = None, pre_mix: Tensor | None = None, *, replay_start: Tensor | None = None,
                compress: bool = True) -> tuple[Tensor, Tensor]:
        """Run `layers` over tokens (B, T) at positions start[b] + t. Starting at layer 0 embeds the
        tokens; otherwise (h, pre_mix) are the streams entering layers.start. Tokens before
        start[b] must already be in seqs[b].tokens (Engram history)."""
        model, c = self.model, self.config
        B, T = tokens.shape
        positions = start.unsqueeze(1) + torch.arange(T, device=tokens.device)  # (B, T)
        if layers.start == 0:
            h = model.embed(tokens).unsqueeze(2).repeat(1, 1, c.hc_mult, 1)
            pre_mix = identity_pre_mix(h, c.hc_mult)
        record = self._record(seqs, start)
        hash_ids = self._hash_ids(seqs, tokens, record.start) if any(
            self.plans[i].engram for i in layers) else None
        entry = None  # (input, mixes) the previous block's last fused pass made for the next block
        for i in layers:
            block = model.layers[i]
            if block.engram is not None:
                h = block.engram(h, hash_ids[:, :, model.engram_index[i]])
                entry = None

            def attention(x: Tensor, i: int = i) -> Tensor:
                return self.attention(i, x, seqs, positions, record, replay_start, compress)

            h, pre_mix, entry = block(h, pre_mix, attention, entry=entry, next_fn=model.next_fn(i, layers.stop - 1))
        return h, pre_mix

    def logits(self, h: Tensor, pre_mix: Tensor) -> Tensor:
        """Final collapse → norm → fp32 head, for the last position of each row: (B, vocab)."""
        return self.model.head_logits(hc_pre(h[:, -1:], pre_mix[:, -1:]))[:, 0]

    @torch.no_grad()
    def produce(self, layer_id: int, seqs: list[SequenceCache], h: Tensor, pre_mix: Tensor, start: Tensor) -> None:
        """Global KV of a kv-source layer from the streams entering it, without running the layer
        (encoder-only prefill: the decoder's kv source reads the encoder output)."""
        positions = start.unsqueeze(1) + torch.arange(h.size(1), device=h.device)
        x = self.model.layers[layer_id].attn_input(h, pre_mix)
        self._compress(layer_id, x, seqs, positions, self._record(seqs, start))

    def _record(self, seqs: list[SequenceCache], start: Tensor) -> StepRecord:
        pools = seqs[0].pools
        if any(s.pools is not pools for s in seqs):
            raise ValueError("sequences decoded in one batch must share one CachePools (create them "
                             "with the same `pools`, as Engine does)")
        return StepRecord(pools, torch.tensor([s.ring_slot for s in seqs], device=seqs[0].device), start.tolist())

    # ------------------------------------------------------------------ attention with caches
    def attention(self, layer_id: int, x: Tensor, seqs: list[SequenceCache], positions: Tensor,
                  record: StepRecord, replay_start: Tensor | None, compress: bool) -> Tensor:
        attn = self.model.layers[layer_id].attn
        plan = self.plans[layer_id]
        rings = record.pools.rings
        B, T, _ = x.shape
        W = attn.window
        cos, sin = attn.angles(positions)
        qr, q = attn.query(x, cos, sin)
        kv = attn.kv_norm(attn.wkv(x))  # (B, T, D) before RoPE and FP8
        ring_rows = rings.rows[layer_id].view(-1, rings.row_bytes)  # (S·W, bytes)
        ring_row = record.ring_ids.view(B, 1) * W + positions % W  # (B, T) where each token lands
        chunk = None
        if T == 1:  # write first: the slot overwritten holds position − W, outside the window
            ops.rope_quantize(kv, cos, sin, "window_fp8", ring_rows, ring_row)
            rings.positions[layer_id].view(-1)[ring_row.view(-1)] = positions.view(-1)
        else:
            chunk = torch.empty(B * T, rings.row_bytes, dtype=torch.uint8, device=x.device)
            ops.rope_quantize(kv, cos, sin, "window_fp8", chunk, torch.arange(B * T, device=x.device).view(B, T))
            chunk = chunk.view(B, T, -1)

        entry_args = {}
        if plan.ratio:
            if plan.mode == FULL and compress:
                self._compress(layer_id, x, seqs, positions, record)
            if plan.mode in (FULL, REINDEX):
                record.topk = self._index(layer_id, x, qr, cos, sin, seqs, positions, record)
            kv_table = self._tables(plan.kv_source, seqs, record)[0]
            entry_args = dict(entry_pool=record.pools.kv[plan.kv_source].rows, page_table=kv_table,
                              page_rows=record.pools.kv[plan.kv_source].page_rows, topk=record.topk)
        o = ops.sparse_attention(q, positions, attn.attn_sink, attn.scale, W, ring_kv=rings.rows[layer_id],
                                 ring_pos=rings.positions[layer_id], ring_ids=record.ring_ids, chunk_kv=chunk,
                                 window_start=replay_start, **entry_args)
        if chunk is not None:  # now the chunk's last W keys replace the oldest ring slots
            last_w = torch.arange(T, device=x.device) >= T - W
            keep = ring_row[:, last_w].reshape(-1)
            ring_rows[keep] = chunk[:, last_w].reshape(-1, rings.row_bytes)
            rings.positions[layer_id].view(-1)[keep] = positions[:, last_w].reshape(-1)
        return attn.output(o, cos, sin)

    def _tables(self, source: int, seqs: list[SequenceCache], record: StepRecord) -> tuple[Tensor, Tensor, Tensor]:
        """(kv page table, index-key page table) (B, max pages) int32 and entry counts (B,) of a kv
        source, built once per call after the source has written."""
        if source not in record.tables:
            stores = [s.entry_stores[source] for s in seqs]

            def table(ids: list[list[int]]) -> Tensor:
                width = max(1, max(len(i) for i in ids))
                return torch.tensor([i + [0] * (width - len(i)) for i in ids], dtype=torch.int32)

            device = seqs[0].device
            record.tables[source] = (table([st.kv.page_ids for st in stores]).to(device),
                                     table([st.index_k.page_ids for st in stores]).to(device),
                                     torch.tensor([st.n_entries for st in stores]).to(device))
        return record.tables[source]

    def _compress(self, layer_id: int, x: Tensor, seqs: list[SequenceCache], positions: Tensor,
                  record: StepRecord) -> None:
        """Pool each sequence's newly completed groups; write entries and index keys into its pages."""
        attn = self.model.layers[layer_id].attn
        comp, m = attn.compressor, attn.ratio
        kv_rows: list[int] = []
        index_rows: list[int] = []
        record.tables.pop(layer_id, None)
        if m == 1:  # every token is an entry: one projection for the whole batch
            latent, starts = comp.norm(comp.wkv(x)).flatten(0, 1), positions.flatten()  # (B·T, D), (B·T,)
            for s in seqs:
                kv_rows += s.entry_stores[layer_id].kv.reserve(x.size(1))
                index_rows += s.entry_stores[layer_id].index_k.reserve(x.size(1))
        else:
            latents, group_starts = [], []
            for b, s in enumerate(seqs):
                kv, score = comp.project(x[b])  # (T, D) fp32
                if layer_id in s.pending:
                    kv_p, score_p = s.pending.pop(layer_id)
                    kv, score = torch.cat((kv_p, kv)), torch.cat((score_p, score))
                n = kv.size(0) // m
                group0 = record.start[b] - (kv.size(0) - x.size(1))  # position of the first pending token
                if kv.size(0) % m:
                    s.pending[layer_id] = (kv[n * m:], score[n * m:])
                if n == 0:
                    continue
                pooled = comp.pool(kv[:n * m].view(n, m, -1), score[:n * m].view(n, m, -1))
                latents.append(comp.norm(pooled.to(x.dtype)))
                group_starts.append(group0 + m * torch.arange(n, device=x.device))
                kv_rows += s.entry_stores[layer_id].kv.reserve(n)
                index_rows += s.entry_stores[layer_id].index_k.reserve(n)
            if not latents:
                return
            latent, starts = torch.cat(latents), torch.cat(group_starts)
        latent = latent.unsqueeze(0)  # (1, N, D) pre-RoPE
        cos, sin = attn.angles(starts.unsqueeze(0))  # rotated at each group's first position
        index_k = attn.indexer.k_norm(attn.indexer.wk(latent))  # (1, N, Di) pre-RoPE
        device = x.device
        ops.rope_quantize(latent, cos, sin, "kv_fp4", record.pools.kv[layer_id].rows,
                          torch.tensor(kv_rows, device=device)[None])
        ops.rope_quantize(index_k, cos, sin, "index_fp4", record.pools.index[layer_id].rows,
                          torch.tensor(index_rows, device=device)[None])

    def _index(self, layer_id: int, x: Tensor, qr: Tensor, cos: Tensor, sin: Tensor, seqs: list[SequenceCache],
               positions: Tensor, record: StepRecord) -> Tensor:
        """Top-k entry indices (B, T, K) for every query; candidate blocks at the candidate source."""
        attn = self.model.layers[layer_id].attn
        plan = self.plans[layer_id]
        pool = record.pools.index[plan.kv_source]
        _, tables, counts = self._tables(plan.kv_source, seqs, record)
        n_max = max(s.entry_stores[plan.kv_source].n_entries for s in seqs)
        iq = attn.indexer.queries(qr, cos, sin, True)  # (B, T, Hi, Di) FP4 values
        weights = attn.indexer.head_weights(x)  # (B, T, Hi)
        visible_end = (positions + 1) // attn.ratio  # entries before it have completed
        bs = attn.candidate_block_size
        if plan.uses_candidates and not plan.candidate_source:
            scores = ops.indexer_scores_blocks(iq, weights, pool.rows, tables, pool.page_rows, counts, visible_end,
                                               record.blocks, bs)
            ids = record.blocks.unsqueeze(-1) * bs + torch.arange(bs, device=x.device)  # (B, T, kb, bs)
            return ops.topk_indices(scores, attn.index_topk, ids.flatten(-2))
        scores, block_max = ops.indexer_scores(iq, weights, pool.rows, tables, pool.page_rows, counts, visible_end,
                                               n_max, bs if plan.candidate_source else 0)
        if plan.candidate_source:
            n_visible = torch.minimum(visible_end, counts.view(-1, 1))
            newest = torch.where(n_visible > 0, (n_visible - 1) // bs, -1)
            record.blocks = ops.select_blocks(block_max, newest, attn.candidate_topk_blocks)
        return ops.topk_indices(scores, attn.index_topk)

    def _hash_ids(self, seqs: list[SequenceCache], tokens: Tensor, start: list[int]) -> Tensor:
        k = self.config.engram_max_ngram_size - 1
        rows = []
        for s, st in zip(seqs, start):
            prev = s.tokens[max(0, st - k):st]
            rows.append([-1] * (k - len(prev)) + prev)
        history = torch.tensor(rows, dtype=torch.long, device=tokens.device)  # (B, k), −1 = before the start
        return self.model.hasher(tokens, history=history)
