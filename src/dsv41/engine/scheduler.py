"""Scheduler: which sequences run in the next engine step, and how many tokens each — policy only.

Each step has a **token budget** (vLLM v1's scheduler; nano-vllm's `scheduler.py`): every running
sequence that is decoding gets one token, and what is left goes to prefill pieces — chunks of the
encoder pass of sequences still prefilling (oldest first), then newly admitted requests. So a long
prompt is cut into pieces that ride along with the running streams' decode steps instead of
stalling them (chunked prefill); the decoder's bounded replay starts only in a step with room for
its n_win tokens, or alone.

Time, not only tokens: while any sequence decodes, a step runs at most `prefill_layers` layer passes
of prefill (a piece = one chunk through some consecutive layers, `prefill.Piece`; the streams between
pieces stay on the prefill job). Eager prefill costs about a fixed host time per layer plus GPU time per
token·layer, so a step's prefill work is bounded by `prefill_layers` × (per-layer cost + token_budget ×
per-token·layer cost) whatever the chunk or the prompt. A chunk's tokens count against the token budget
in the step its first piece runs; its later pieces cost layers only. A step without decode rows runs its
pieces whole (no stream waits on it). With `batch_pieces`, a sequence whose next piece has the key of a
piece already scheduled this step (same kind, tokens, first layer and layers; `Piece.key`) rides along:
the engine runs the two as one batched forward, so the rider costs its tokens but no layer budget — the
step's host time is that of its forwards, not of its rows.

A step without decode rows (an idle engine, a burst of new requests) has a larger token budget and chunk,
`idle_chunk` (`Engine(idle_prefill_chunk=)`): a lone long prompt is prefilled in few big chunks, since a
chunk's host cost (its kernel launches) does not grow with its tokens — on the H200 a 32K prompt took 160 ms
in 8K chunks and 63 ms in one (`results/peer_decode-2026-12-04-final.json`). A stream that starts decoding
while such a chunk is part-way through its layers waits on its remaining pieces (at most `prefill_layers`
layer passes a step, as for any run).

Memory: the engine's pools are fixed. A decode token that needs a page when none is free
preempts the most recently admitted running sequence (its cache is swapped to the host; it
returns to the head of the queue); admission is FIFO without overtaking and only when the
request's whole prompt fits beside what the running prefills still need.

Speculative decoding (`engine/speculative.py`) verifies up to k + 1 positions per decoding sequence:
`decode_tokens` = k + 1 then sizes each decode row's page claim and its share of the budget (the
verification length itself is chosen after the drafter has proposed, within that claim).

No torch here: the engine supplies the capacity checks and carries out admissions and
preemptions through the `Capacity` interface.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from dsv41.engine.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:  # policy only: the piece type, never torch at run time
    from dsv41.engine.prefill import Piece


class Capacity(Protocol):
    """What the scheduler asks of the engine's pools (host bookkeeping, page counts per kv source)."""

    def free_pages(self) -> dict[int, int]: ...

    def pages_to_grow(self, seq: Sequence, n_tokens: int) -> dict[int, int]: ...

    def pages_to_admit(self, seq: Sequence) -> dict[int, int] | None:
        """Pages the sequence's whole prompt needs (None: no slot free, or it can never fit)."""

    def admit(self, seq: Sequence) -> None: ...

    def preempt(self, seq: Sequence) -> None: ...


@dataclass
class ScheduledBatch:
    decode: list[Sequence] = field(default_factory=list)  # one token each, in one batched step
    prefill: list[tuple[Sequence, Piece]] = field(default_factory=list)  # (sequence, its next piece), in order
    admitted: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    riders: list[Sequence] = field(default_factory=list)  # their piece shares the forward of an earlier one

    @property
    def n_tokens(self) -> int:
        return len(self.decode) + sum(p.tokens for _, p in self.prefill if p.new)

    @property
    def n_layer_passes(self) -> int:
        """Layer passes of the step's prefill forwards (a rider's piece runs in an earlier piece's forward)."""
        riders = {id(s) for s in self.riders}
        return sum(p.layers for s, p in self.prefill if id(s) not in riders)

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill)


class Scheduler:
    def __init__(self, capacity: Capacity, *, max_batch: int = 64, token_budget: int = 2048, decode_tokens: int = 1,
                 prefill_layers: int | None = None, batch_pieces: bool = False, idle_chunk: int | None = None):
        if max_batch < 1 or token_budget < 1 or decode_tokens < 1:
            raise ValueError(f"max_batch, token_budget and decode_tokens must be >= 1, got {max_batch}, "
                             f"{token_budget}, {decode_tokens}")
        if idle_chunk is not None and idle_chunk < 1:
            raise ValueError(f"idle_chunk must be >= 1 (or None: off), got {idle_chunk}")
        self.idle_chunk = idle_chunk  # a step without decode rows: chunks (and budget) of up to this many tokens
        if prefill_layers is not None and prefill_layers < 1:
            raise ValueError(f"prefill_layers must be >= 1 (or None: no layer bound), got {prefill_layers}")
        self.capacity = capacity
        self.max_batch, self.token_budget = max_batch, token_budget
        self.prefill_layers = prefill_layers  # layer passes of prefill per step while sequences decode
        self.decode_tokens = decode_tokens  # positions a decode row may run this step (k + 1 when speculating)
        self.batch_pieces = batch_pieces  # pieces with one key share a forward and its layer budget
        self._keys: set[tuple] = set()  # keys of this step's pieces that a rider may join
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admitted, in admission order

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Forget a sequence wherever it is (finished or aborted)."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ the policy
    def schedule(self) -> ScheduledBatch:
        out = ScheduledBatch()
        self._keys = set()
        budget = self.token_budget
        plan = _Pages(self.capacity)
        # 1. one decode token for every running sequence past its prefill; make room by preempting
        #    the newest running sequence when pages are missing
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING or seq.prefilling:  # preempted above, or prefilling
                continue
            while not plan.claim(seq, self.capacity.pages_to_grow(seq, self.decode_tokens)):
                victim = next((s for s in reversed(self.running) if s is not seq), None)
                self._preempt(victim or seq, out, plan)
                if victim is None:
                    break
            if seq.status is SequenceStatus.RUNNING:
                out.decode.append(seq)
        budget -= len(out.decode) * self.decode_tokens
        # the layer bound protects decoding streams' gaps; a step without them runs its pieces whole, and in
        # chunks of up to idle_chunk tokens
        layers = self.prefill_layers if out.decode else None
        chunk = None  # this step's chunk bound (None: each job's own)
        if not out.decode and self.idle_chunk:
            chunk = self.idle_chunk
            budget = max(budget, self.idle_chunk)
        # 2. the next pieces of every sequence still prefilling, oldest first (a run in progress
        #    continues whatever the token budget: its tokens were counted when it started)
        for seq in self.running:
            if seq.prefilling and (budget > 0 or seq.job.in_progress) and (layers is None or layers > 0 or self._keys):
                budget, layers = self._piece(seq, budget, layers, out, plan, chunk)
        # 3. admit from the queue (FIFO, no overtaking) while the budget and the batch have room, and
        #    the head's whole prompt fits beside what the running prefills still need
        committed = plan.commitments([s for s in self.running if s.prefilling])
        while self.waiting and budget > 0 and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            need = self.capacity.pages_to_admit(seq)
            if need is None or not plan.fits(need, committed):
                break
            self.waiting.popleft()
            self.capacity.admit(seq)  # may take pages now (prefix-cache rows, a swap-in)
            plan.free = self.capacity.free_pages()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.admitted.append(seq)
            if seq.prefilling:
                committed = plan.commitments([s for s in self.running if s.prefilling])
                budget, layers = self._piece(seq, budget, layers, out, plan, chunk)
            elif plan.claim(seq, self.capacity.pages_to_grow(seq, self.decode_tokens)):  # swapped back in mid-decode
                out.decode.append(seq)
                budget -= self.decode_tokens
        return out

    def _piece(self, seq: Sequence, budget: int, layers: int | None, out: ScheduledBatch,
               plan: _Pages, chunk: int | None) -> tuple[int, int | None]:
        """Schedule the prefill pieces of `seq` that fit in the token and layer budgets (runs of up to `chunk`
        tokens, None: the job's own); returns what is left of both. Pages are claimed for every chunk a piece
        belongs to (taken by its Full layers)."""
        rider = self._ride(seq, budget) if layers is not None else None
        pieces = rider or seq.job.plan(budget, alone=not out, layers=layers, chunk=chunk)
        while pieces and not plan.claim(seq, self.capacity.pages_to_grow(seq, sum(p.grows for p in pieces))):
            pieces.pop()  # waits for pages (a later step, or after a finish frees some)
        out.prefill.extend((seq, p) for p in pieces)
        budget -= sum(p.tokens for p in pieces if p.new)
        if rider and pieces:
            out.riders.append(seq)
            return budget, layers
        if self.batch_pieces and len(pieces) == 1 and seq.job.batchable:
            self._keys.add(pieces[0].key)
        return budget, None if layers is None else layers - sum(p.layers for p in pieces)

    def _ride(self, seq: Sequence, budget: int) -> list[Piece] | None:
        """seq's next piece when it can join the forward of a piece already scheduled this step (one key,
        `batch_pieces`), else None."""
        if not (self.batch_pieces and self._keys and seq.job.batchable):
            return None
        for n_layers in sorted({key[3] for key in self._keys}, reverse=True):
            pieces = seq.job.plan(budget, alone=False, layers=n_layers)  # beside decode rows: the job's own chunk
            if len(pieces) == 1 and pieces[0].key in self._keys:
                return pieces
        return None

    def _preempt(self, seq: Sequence, out: ScheduledBatch, plan: _Pages) -> None:
        self.capacity.preempt(seq)
        plan.release(seq)
        self.running.remove(seq)
        if seq in out.decode:
            out.decode.remove(seq)
        out.prefill = [(s, p) for s, p in out.prefill if s is not seq]
        seq.status = SequenceStatus.PREEMPTED
        seq.n_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)


class _Pages:
    """The pages one step's schedule has claimed so far, against the pools' free pages: each claim is
    checked against what is left after the earlier ones (two decodes that each need the last free
    page must not both be scheduled)."""

    def __init__(self, capacity: Capacity):
        self.capacity = capacity
        self.free = capacity.free_pages()
        self.claims: dict[int, dict[int, int]] = {}  # id(seq) → pages claimed for it this step
        self.total = {s: 0 for s in self.free}

    def fits(self, need: dict[int, int], extra: dict[int, int] | None = None) -> bool:
        extra = extra or {}
        return all(self.total[s] + extra.get(s, 0) + n <= self.free[s] for s, n in need.items())

    def claim(self, seq: Sequence, need: dict[int, int]) -> bool:
        """Claim `need` more pages for seq (replacing an earlier claim of this step); False if short."""
        if not need:  # no new page (almost every decode step)
            self.claims.setdefault(id(seq), {})
            return True
        before = self.claims.get(id(seq), {})
        delta = {s: n - before.get(s, 0) for s, n in need.items()}
        if not self.fits({s: max(0, d) for s, d in delta.items()}):
            return False
        for s, d in delta.items():
            self.total[s] += d
        self.claims[id(seq)] = dict(need)
        return True

    def release(self, seq: Sequence) -> None:
        """seq was preempted: its claim is void and its pages are back in the pools."""
        for s, n in self.claims.pop(id(seq), {}).items():
            self.total[s] -= n
        self.free = self.capacity.free_pages()

    def commitments(self, prefilling: list[Sequence]) -> dict[int, int]:
        """Pages the running prefills will still take beyond this step's claims."""
        out = {s: 0 for s in self.free}
        for seq in prefilling:
            claimed = self.claims.get(id(seq), {})
            for s, n in self.capacity.pages_to_grow(seq, seq.target_tokens() - seq.num_cached_tokens).items():
                out[s] += max(0, n - claimed.get(s, 0))
        return out
