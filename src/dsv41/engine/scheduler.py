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

No torch here: the engine supplies the capacity checks and carries out admissions and
preemptions through the `Capacity` interface.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from dsv41.engine.sequence import Sequence, SequenceStatus


class Capacity(Protocol):
    def can_admit(self, seq: Sequence, prefilling: list[Sequence]) -> bool: ...

    def can_grow(self, seq: Sequence, n_tokens: int) -> bool: ...

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
    def __init__(self, capacity: Capacity, *, max_batch: int = 64, token_budget: int = 2048):
        if max_batch < 1 or token_budget < 1:
            raise ValueError(f"max_batch and token_budget must be >= 1, got {max_batch}, {token_budget}")
        self.capacity = capacity
        self.max_batch, self.token_budget = max_batch, token_budget
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
        # 1. one decode token for every running sequence past its prefill; make room by preempting
        #    the newest running sequence when a page is missing
        for seq in list(self.running):
            if seq not in self.running or seq.prefilling:
                continue
            while not self.capacity.can_grow(seq, 1):
                victim = next((s for s in reversed(self.running) if s is not seq), None)
                self._preempt(victim or seq, out)
                if victim is None:
                    break
            if seq in self.running:
                out.decode.append(seq)
        budget -= len(out.decode)
        # 2. the next piece of every sequence still prefilling, oldest first
        for seq in self.running:
            if seq.prefilling and budget > 0:
                budget -= self._piece(seq, budget, out)
        # 3. admit from the queue (FIFO, no overtaking) while the budget and the batch have room
        while self.waiting and budget > 0 and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            if not self.capacity.can_admit(seq, [s for s in self.running if s.prefilling]):
                break
            self.waiting.popleft()
            self.capacity.admit(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.admitted.append(seq)
            if seq.prefilling:
                budget -= self._piece(seq, budget, out)
            elif self.capacity.can_grow(seq, 1):  # swapped back in mid-decode
                out.decode.append(seq)
                budget -= 1
        return out

    def _piece(self, seq: Sequence, budget: int, out: ScheduledBatch) -> int:
        """Schedule the prefill pieces of `seq` that fit in the budget; returns the tokens taken."""
        pieces = seq.job.plan(budget, alone=not out)
        while pieces and not self.capacity.can_grow(seq, sum(pieces)):
            pieces.pop()  # waits for pages (a later step, or after a finish frees some)
        out.prefill.extend((seq, n) for n in pieces)
        return sum(pieces)

    def _preempt(self, seq: Sequence, out: ScheduledBatch) -> None:
        self.capacity.preempt(seq)
        self.running.remove(seq)
        if seq in out.decode:
            out.decode.remove(seq)
        out.prefill = [(s, n) for s, n in out.prefill if s is not seq]
        seq.status = SequenceStatus.PREEMPTED
        seq.n_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
