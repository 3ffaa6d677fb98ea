"""Cached forward: run a range of layers over a chunk of new tokens for a batch of sequences.

The model's blocks are reused as they are; only attention is replaced by `CachedAttention`, which
reads and writes the per-sequence caches instead of seeing the whole sequence:
  * window keys = the layer's FP8 ring (earlier tokens) ∪ this chunk's new keys, with the bounded
    replay rule: query i sees window keys at positions [max(s, i − W + 1), i] where s is the
    replay start (SPEC §6);
  * a Full layer pools the chunk's complete groups (continuing its partial group), appends the
    packed entries and index keys — unless `compress=False` (a replay over tokens whose global
    KV is already cached: it is never recomputed nor overwritten);
  * Full and Reindex layers score every visible cached index key (Reindex only inside the
    candidate blocks) and publish a top-k; Reuse layers take it; the selected entries are
    gathered from the packed store and dequantized.
All sequences of one call advance by the same number of tokens (a prefill chunk of one sequence,
or one decode token for each of many sequences of different lengths).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from dsv41.engine.cache import SequenceCache
from dsv41.model.attention import (
    Indexer,
    apply_rope,
    attend_gathered,
    select_candidate_blocks,
    select_topk,
)
from dsv41.model.mhc import hc_pre, identity_pre_mix
from dsv41.model.transformer import Transformer
from dsv41.plan import FULL, REINDEX
from dsv41.quant.fp8 import fake_quant_window_fp8


@dataclass
class StepRecord:
    """What source layers publish during one cached forward (replaces the reference's global)."""

    topk: Tensor | None = None  # (B, T, K) entry indices, −1 = none
    candidates: Tensor | None = None  # (B, T, Nmax) bool
    index_keys: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)  # source → (keys, counts)


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
        hash_ids = self._hash_ids(seqs, tokens, start) if any(
            self.plans[i].engram for i in layers) else None
        record = StepRecord()
        for i in layers:
            block = model.layers[i]
            if block.engram is not None:
                h = block.engram(h, hash_ids[:, :, model.engram_index[i]])

            def attention(x: Tensor, i: int = i) -> Tensor:
                return self.attention(i, x, seqs, positions, record, replay_start, compress)

            h, pre_mix = block(h, pre_mix, attention)
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
        self._compress(layer_id, x, seqs, positions)

    # ------------------------------------------------------------------ attention with caches
    def attention(self, layer_id: int, x: Tensor, seqs: list[SequenceCache], positions: Tensor,
                  record: StepRecord, replay_start: Tensor | None, compress: bool) -> Tensor:
        attn = self.model.layers[layer_id].attn
        plan = self.plans[layer_id]
        B, T, _ = x.shape
        cos, sin = attn.angles(positions)
        qr, q = attn.query(x, cos, sin)
        new_kv = apply_rope(attn.kv_norm(attn.wkv(x)), cos, sin)  # (B, T, D) before FP8

        # window keys: ring (earlier positions) ∪ this chunk, under the bounded-replay rule
        rings = [s.windows[layer_id].read() for s in seqs]
        ring_kv = torch.stack([r[0] for r in rings]).to(x.dtype)  # (B, W, D)
        ring_pos = torch.stack([r[1] for r in rings])  # (B, W)
        keys = torch.cat((ring_kv, fake_quant_window_fp8(new_kv)), dim=1)
        key_pos = torch.cat((ring_pos, positions), dim=1)  # (B, W + T)
        qpos, kpos = positions.unsqueeze(-1), key_pos.unsqueeze(1)
        mask = (kpos >= 0) & (kpos <= qpos) & (kpos > qpos - attn.window)
        if replay_start is not None:
            mask &= kpos >= replay_start.view(B, 1, 1)
        for b, s in enumerate(seqs):
            s.windows[layer_id].write(new_kv[b], positions[b])

        entries = valid = None
        if plan.ratio:
            if plan.mode == FULL and compress:
                self._compress(layer_id, x, seqs, positions)
            if plan.mode in (FULL, REINDEX):
                record.topk = self._index(layer_id, x, qr, seqs, positions, record)
            entries, valid = self._gather(plan.kv_source, seqs, record.topk)
        o = attend_gathered(q, keys, mask, entries, valid, attn.attn_sink, attn.scale)
        return attn.output(o, cos, sin)

    def _compress(self, layer_id: int, x: Tensor, seqs: list[SequenceCache], positions: Tensor) -> None:
        """Pool each sequence's newly completed groups and append them to its packed store."""
        attn = self.model.layers[layer_id].attn
        comp, m = attn.compressor, attn.ratio
        for b, s in enumerate(seqs):
            xb, first = x[b], int(positions[b, 0])
            if m == 1:
                latent, group_start = comp.norm(comp.wkv(xb)), positions[b]
            else:
                kv, score = comp.project(xb)  # (T, D) fp32
                if layer_id in s.pending:
                    kv_p, score_p = s.pending.pop(layer_id)
                    kv, score = torch.cat((kv_p, kv)), torch.cat((score_p, score))
                n = kv.size(0) // m
                group0 = first - (kv.size(0) - xb.size(0))  # position of the first pending token
                if kv.size(0) % m:
                    s.pending[layer_id] = (kv[n * m:], score[n * m:])
                if n == 0:
                    continue
                pooled = comp.pool(kv[:n * m].view(n, m, -1), score[:n * m].view(n, m, -1))
                latent = comp.norm(pooled.to(x.dtype))
                group_start = group0 + m * torch.arange(n, device=x.device)
            ent, index_k = attn.entries(latent, group_start, quant=False)
            s.entry_stores[layer_id].append(ent.float(), index_k.float())

    def _index(self, layer_id: int, x: Tensor, qr: Tensor, seqs: list[SequenceCache], positions: Tensor,
               record: StepRecord) -> Tensor:
        """Top-k entry indices (B, T, K) for every query; candidate blocks at the candidate source."""
        attn = self.model.layers[layer_id].attn
        plan = self.plans[layer_id]
        m = attn.ratio
        if plan.kv_source not in record.index_keys:  # dequantize a source's keys once per call
            keys = [s.entry_stores[plan.kv_source].index_keys() for s in seqs]
            counts = torch.tensor([k.size(0) for k in keys], device=x.device)
            n_max = max(int(counts.max()), 1)
            padded = torch.zeros(len(seqs), n_max, self.config.index_head_dim, device=x.device)
            for b, k in enumerate(keys):
                padded[b, :k.size(0)] = k
            record.index_keys[plan.kv_source] = (padded, counts)
        keys, counts = record.index_keys[plan.kv_source]
        cos, sin = attn.angles(positions)
        iq = attn.indexer.queries(qr, cos, sin, True)
        scores = Indexer.scores(iq, attn.indexer.head_weights(x), keys)  # (B, T, N)
        n = keys.size(1)
        s_idx = torch.arange(n, device=x.device)
        visible = (s_idx < ((positions + 1) // m).unsqueeze(-1)) & (s_idx < counts.view(-1, 1, 1))
        scores = scores.masked_fill(~visible, float("-inf"))
        if plan.candidate_source:
            bs = attn.candidate_block_size
            block_id = (s_idx // bs).expand(len(seqs), n)
            newest = torch.where(visible.any(-1), ((positions + 1) // m - 1) // bs, -1)
            keep = select_candidate_blocks(scores, block_id, (n + bs - 1) // bs, newest, attn.candidate_topk_blocks)
            record.candidates = keep & visible
        elif plan.uses_candidates:
            scores = scores.masked_fill(~record.candidates, float("-inf"))
        return select_topk(scores, attn.index_topk)

    def _gather(self, source: int, seqs: list[SequenceCache], topk: Tensor) -> tuple[Tensor, Tensor]:
        """Dequantized selected entries (B, T, K, D) and their validity (B, T, K)."""
        valid = topk >= 0
        out = torch.zeros(*topk.shape, self.config.head_dim, device=topk.device)
        for b, s in enumerate(seqs):
            store = s.entry_stores[source]
            if store.n_entries and bool(valid[b].any()):
                out[b] = store.entries(topk[b].clamp(min=0))
        return out, valid

    def _hash_ids(self, seqs: list[SequenceCache], tokens: Tensor, start: Tensor) -> Tensor:
        k = self.config.engram_max_ngram_size - 1
        history = torch.full((len(seqs), k), -1, dtype=torch.long, device=tokens.device)
        for b, s in enumerate(seqs):
            st = int(start[b])
            prev = s.tokens[max(0, st - k):st]
            if prev:
                history[b, k - len(prev):] = torch.tensor(prev, device=tokens.device)
        return self.model.hasher(tokens, history=history)

