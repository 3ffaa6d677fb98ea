"""Scheduler: which sequences run in the next engine step, and how many tokens each — policy only.

Each step has a **token budget** (vLLM v1's scheduler; nano-vllm's `scheduler.py`): every running
sequence that is decoding gets one token, and what is left goes to prefill pieces — chunks of the
encoder pass of sequences still prefilling (oldest first), then newly admitted requests. So a long
prompt is cut into pieces that ride along with the running streams' decode steps instead of
stalling them (chunked prefill); a piece that cannot be split (the decoder's bounded replay) waits
for a step with room for it, or runs alone.

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
from typing import Protocol

from dsv41.engine.sequence import Sequence, SequenceStatus


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
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens of its next piece)
    admitted: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def n_tokens(self) -> int:
        return len(self.decode) + sum(n for _, n in self.prefill)

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill)


class Scheduler:
    def __init__(self, capacity: Capacity, *, max_batch: int = 64, token_budget: int = 2048, decode_tokens: int = 1):
        if max_batch < 1 or token_budget < 1 or decode_tokens < 1:
            raise ValueError(f"max_batch, token_budget and decode_tokens must be >= 1, got {max_batch}, "
                             f"{token_budget}, {decode_tokens}")
        self.capacity = capacity
        self.max_batch, self.token_budget = max_batch, token_budget
        self.decode_tokens = decode_tokens  # positions a decode row may run this step (k + 1 when speculating)
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
        # 2. the next pieces of every sequence still prefilling, oldest first
        for seq in self.running:
            if seq.prefilling and budget > 0:
                budget -= self._piece(seq, budget, out, plan)
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
                budget -= self._piece(seq, budget, out, plan)
            elif plan.claim(seq, self.capacity.pages_to_grow(seq, self.decode_tokens)):  # swapped back in mid-decode
                out.decode.append(seq)
                budget -= self.decode_tokens
        return out

    def _piece(self, seq: Sequence, budget: int, out: ScheduledBatch, plan: _Pages) -> int:
        """Schedule the prefill pieces of `seq` that fit in the budget; returns the tokens taken."""
        pieces = seq.job.plan(budget, alone=not out)
        while pieces and not plan.claim(seq, self.capacity.pages_to_grow(seq, sum(pieces))):
            pieces.pop()  # waits for pages (a later step, or after a finish frees some)
        out.prefill.extend((seq, n) for n in pieces)
        return sum(pieces)

    def _preempt(self, seq: Sequence, out: ScheduledBatch, plan: _Pages) -> None:
        self.capacity.preempt(seq)
        plan.release(seq)
        self.running.remove(seq)
        if seq in out.decode:
            out.decode.remove(seq)
        out.prefill = [(s, n) for s, n in out.prefill if s is not seq]
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
