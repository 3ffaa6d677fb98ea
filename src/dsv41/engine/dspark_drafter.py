"""The DSpark drafter behind the engine's `Drafter` protocol (SPEC §5 "DSpark"; docs/dspark.md).

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
    propose(seqs, last_tokens (B,)) → Proposal(tokens (B, k), confidence (B, k) in [0, 1], probs (B, k, V) | None)
                           last_tokens = each sequence's newest token, the one without features yet (the
                           bonus token of the last verification); it is the anchor of the draft block.

State per sequence: one ring of `window_size` context keys per stage (each stage's own
`kv_norm(wkv(main_x))`, rotated at its position) and the count of observed positions. Observing only
accepted positions means nothing ever rolls back here. `propose` gathers the rings into the same
(B, 1, W, D) windows the training form gathers from a row, so drafting equals `DSpark.forward` on the
whole sequence (tests/dspark/test_dspark_attention.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dsv41.model.dspark import DSpark


@dataclass
class Proposal:
    tokens: Tensor  # (B, k) long: the drafted tokens
    confidence: Tensor  # (B, k) float in [0, 1]: predicted acceptance of each position given the earlier ones
    probs: Tensor | None = None  # (B, k, V) float: the distribution each token was drawn from (None when greedy)


@dataclass
class _Sequence:
    rings: list[Tensor]  # per stage (W, D) context keys, slot = position % W
    observed: int = 0  # positions whose features the rings have seen


class DSparkDrafter:
    """`Drafter` of the engine backed by a trained DSpark (bound to the engine's backbone)."""

    features_at = "input"  # the engine's Capture(at="input"): the streams entering each target block

    def __init__(self, drafter: DSpark, temperature: float = 0.0, generator: torch.Generator | None = None):
        self.drafter = drafter.eval()
        self.k = drafter.block_size
        self.temperature = temperature
        self.generator = generator
        self.window = drafter.window
        self._seqs: dict[int, _Sequence] = {}

    def features_wanted(self) -> list[int]:
        return list(self.drafter.target_layer_ids)

    def start(self, seq_id: int) -> None:
        if seq_id in self._seqs:
            raise KeyError(f"DSparkDrafter: sequence {seq_id} already started")
        ref = self.drafter.first.attn.wkv.weight
        D = self.drafter.config.head_dim
        rings = [torch.zeros(self.window, D, dtype=ref.dtype, device=ref.device) for _ in self.drafter.mtp]
        self._seqs[seq_id] = _Sequence(rings)

    def finish(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)

    @torch.no_grad()
    def observe(self, seq_id: int, tokens: Tensor, features: dict[int, Tensor]) -> None:
        seq = self._seqs[seq_id]
        n = int(tokens.numel())
        if n == 0:
            return
        rows = torch.cat([features[i] for i in self.drafter.target_layer_ids], dim=-1)  # (m, n_targets·dim)
        m = rows.size(0)
        if m > n:
            raise ValueError(f"DSparkDrafter.observe: features of {m} positions for {n} tokens")
        keep = min(m, self.window)  # older positions fall out of every ring anyway
        rows = rows[m - keep:]
        first = seq.observed + n - keep  # position of the first kept row
        positions = torch.arange(first, first + keep, device=rows.device).unsqueeze(0)  # (1, keep)
        ref = seq.rings[0]
        main_x = self.drafter.main_x(rows.unsqueeze(0).to(ref.device, ref.dtype))  # (1, keep, dim)
        slots = positions[0] % self.window
        for ring, kv in zip(seq.rings, self.drafter.context_keys(main_x, positions.to(ref.device))):
            ring[slots.to(ring.device)] = kv[0].to(ring.dtype)
        seq.observed += n

    @torch.no_grad()
    def propose(self, seq_ids: list[int], last_tokens: Tensor) -> Proposal:
        seqs = [self._seqs[s] for s in seq_ids]
        device = seqs[0].rings[0].device
        observed = torch.tensor([s.observed for s in seqs], device=device)  # (B,)
        slot = torch.arange(self.window, device=device)
        valid = (slot.unsqueeze(0) < observed.unsqueeze(1)).unsqueeze(1)  # (B, 1, W): filled slots
        contexts = [(torch.stack([s.rings[k] for s in seqs]).unsqueeze(1), valid) for k in range(len(self.drafter.mtp))]
        anchors = last_tokens.to(device).long().view(-1, 1)  # (B, 1)
        hidden = self.drafter.block_hidden(anchors, observed.view(-1, 1), contexts)  # (B, 1, K, dim)
        tokens, probs, conf = self.drafter.sample(hidden[:, 0], anchors[:, 0], self.temperature, self.generator)
        return Proposal(tokens=tokens, confidence=torch.sigmoid(conf),
                        probs=probs if self.temperature > 0 else None)
