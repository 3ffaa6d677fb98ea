"""Per-forward state: token layout and what CSA2 layers hand down the stack.

The official reference keeps compressed KV, index keys, top-k and candidates in one module-global
object, which breaks with two models or concurrent sequences. Here a `ForwardContext` is created
for every forward and passed down explicitly. It knows the token layout (batch rows may pack
several documents: `doc_ids`, document-relative `positions`), builds the compressed-entry *slots*
once per ratio, and holds a `SharedAttention` record that kv-source layers fill and later layers
read. Auxiliary losses (indexer KL) are collected here too.

Entry slots: the compressed entries of a row are stored compactly in document order. Slot s is the
group that ends at token `slot_token[s]`; it belongs to document `slot_doc[s]`, is group number
`slot_group[s]` inside that document and covers document positions
[slot_group·m, slot_group·m + m). A query at token t may select slot s iff they share a document
and the group has ended (`slot_token[s] <= t`), i.e. `s < (pos_t + 1) // m` within the document.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class EntrySlots:
    """Compressed-entry slots of ratio m for a (B, T) token layout; N = most entries in a row."""

    ratio: int
    token: Tensor  # (B, N) long: token index of the group's last token
    doc: Tensor  # (B, N) long: document id (-1 for unused slots)
    group: Tensor  # (B, N) long: group number inside its document
    valid: Tensor  # (B, N) bool: slot holds a complete group

    @property
    def first_position(self) -> Tensor:
        """Document position of each group's first token (where its entry is rotated)."""
        return self.group * self.ratio

    def visible(self, query_doc: Tensor, query_token: Tensor) -> Tensor:
        """(B, Tq, N) bool: slot s visible to each query (same document, group complete)."""
        same_doc = self.doc.unsqueeze(1) == query_doc.unsqueeze(-1)
        ended = self.token.unsqueeze(1) <= query_token.unsqueeze(-1)
        return same_doc & ended & self.valid.unsqueeze(1)


@dataclass
class SharedAttention:
    """What the latest source layers published, plus who published it (for instrumentation)."""

    kv: Tensor | None = None  # (B, N, head_dim) entries after RoPE and FP4 fake-quant
    latent: Tensor | None = None  # (B, N, head_dim) the same entries before RoPE (what a pipeline stage ships)
    index_k: Tensor | None = None  # (B, N, index_head_dim) index keys after RoPE and FP4 fake-quant
    slots: EntrySlots | None = None
    kv_source: int | None = None  # layer that produced kv / index_k
    topk: Tensor | None = None  # (B, T, K) long slot indices, -1 = none
    topk_source: int | None = None
    candidates: Tensor | None = None  # (B, T, N) bool: slots inside the candidate blocks
    candidate_source: int | None = None
    candidate_blocks: Tensor | None = None  # sparse path: (B, T, Kb) long kept block ids, -1 = none


@dataclass
class ForwardContext:
    """Everything one forward shares across layers. Create a new one per forward."""

    doc_ids: Tensor  # (B, T) long; tokens attend only within their document
    positions: Tensor  # (B, T) long; position inside the document (RoPE, compression groups)
    window_start: Tensor | None = None  # (B, T) long; bounded replay: keys before this token are hidden
    training_losses: bool = False  # compute the indexer KL loss
    query_mask: Tensor | None = None  # (B, T) bool: queries the indexer KL averages over (None: every query)
    attention: str = "dense"  # "dense": masked (B, T, T + N) spec; "sparse": window band ∪ gathered top-k
    score_chunk: int = 512  # sparse path: queries per chunk of index scores (memory O(chunk·N))
    shared: SharedAttention = field(default_factory=SharedAttention)
    indexer_losses: list[Tensor] = field(default_factory=list)
    trace: list[dict] | None = None  # when a list, layers append what they read (tests, debugging)
    _slots: dict[int, EntrySlots] = field(default_factory=dict)
    _cache: dict[tuple, Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.attention not in ("dense", "sparse"):
            raise ValueError(f"attention must be 'dense' or 'sparse', got {self.attention!r}")

    @classmethod
    def build(cls, tokens: Tensor, doc_ids: Tensor | None = None, **kwargs) -> ForwardContext:
        B, T = tokens.shape
        device = tokens.device
        if doc_ids is None:
            doc_ids = torch.zeros(B, T, dtype=torch.long, device=device)
        doc_ids = doc_ids.long()
        idx = torch.arange(T, device=device).expand(B, T)
        starts = torch.ones(B, T, dtype=torch.bool, device=device)
        starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
        doc_start = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values  # (B, T)
        return cls(doc_ids=doc_ids, positions=idx - doc_start, **kwargs)

    @property
    def token_index(self) -> Tensor:
        B, T = self.doc_ids.shape
        return torch.arange(T, device=self.doc_ids.device).expand(B, T)

    def slots(self, ratio: int) -> EntrySlots:
        """Entry slots for compression ratio `ratio` (built once per forward)."""
        if ratio not in self._slots:
            self._slots[ratio] = build_slots(self.doc_ids, self.positions, ratio)
        return self._slots[ratio]

    def window_mask(self, window: int) -> Tensor:
        """(B, T, T) bool: key u visible to query t in the sliding window (same document,
        t − window < u ≤ t, and u ≥ the bounded-replay start when one is set). Built once."""
        key = ("window", window)
        if key not in self._cache:
            self._cache[key] = self._window_mask(window)
        return self._cache[key]

    def visible(self, ratio: int) -> Tensor:
        """(B, T, N) bool: which entry slots of this ratio each token may select. Built once."""
        key = ("visible", ratio)
        if key not in self._cache:
            self._cache[key] = self.slots(ratio).visible(self.doc_ids, self.token_index)
        return self._cache[key]

    # ---------------------------------------------------------------- sequence-split hooks
    # A single device holds the whole sequence, so these are identities. Context parallelism
    # (`dsv41.parallel.context`) overrides them: halos from the previous rank, entries of other ranks.
    def window_keys(self, kv: Tensor, window: int) -> tuple[Tensor, Tensor]:
        """(keys (B, S, D), mask (B, T, S)) of the sliding window, from this layer's window KV (B, T, D)."""
        return kv, self.window_mask(window)

    def own_slots(self, ratio: int) -> EntrySlots:
        """The entry slots whose groups this device compresses (all of them here)."""
        return self.slots(ratio)

    def compressor_input(self, x: Tensor, ratio: int) -> Tensor:
        """The rows `own_slots(ratio).token` index into: the attention input x (B, T, dim) here."""
        return x

    def gather_entries(self, t: Tensor, ratio: int) -> Tensor:
        """Per-slot tensors (B, N_own, ...) of the own slots of `ratio` → all slots (B, N, ...) in slot order."""
        return t

    def count_queries(self, has_any: Tensor) -> Tensor | None:
        """Queries over which a per-query loss is averaged; None = those of this forward."""
        return None

    def _window_mask(self, window: int) -> Tensor:
        t = self.token_index
        qt, kt = t.unsqueeze(-1), t.unsqueeze(-2)
        mask = (kt <= qt) & (kt > qt - window)
        mask &= self.doc_ids.unsqueeze(-1) == self.doc_ids.unsqueeze(-2)
        if self.window_start is not None:
            mask &= kt >= self.window_start.unsqueeze(-1)
        return mask


def build_slots(doc_ids: Tensor, positions: Tensor, ratio: int) -> EntrySlots:
    """Compact the complete groups of every row into slots, in token order. N = T // ratio slots per row,
    a static bound (a complete group holds `ratio` tokens, so no row has more): slots past a row's count are
    padding (valid False). Shapes depend only on (B, T), never on the data: no host sync, and a
    torch.compile'd Block traces once per shape."""
    B, T = doc_ids.shape
    is_end = (positions + 1) % ratio == 0  # (B, T): last token of a complete group
    counts = is_end.sum(dim=1)
    N = T // ratio
    # a stable sort of "not an end" brings the group ends to the front, in token order
    order = torch.sort((~is_end).to(torch.int8), dim=1, stable=True).indices[:, :N]  # (B, N)
    valid = torch.arange(N, device=doc_ids.device).unsqueeze(0) < counts.unsqueeze(1)
    doc = torch.where(valid, doc_ids.gather(1, order), torch.full_like(order, -1))
    group = torch.where(valid, positions.gather(1, order) // ratio, torch.zeros_like(order))
    token = torch.where(valid, order, torch.full_like(order, T))  # unused slots end "after" every query
    return EntrySlots(ratio=ratio, token=token, doc=doc, group=group, valid=valid)
