"""Scheduler policy against a scripted engine (no model): KV-budget admission in FIFO order, the bounded queue,
cancellation leaving the running batch, deadlines, and the per-step prefill allowance."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import pytest

from dsv41.engine.engine import StepOutput
from dsv41.engine.sampling import SamplingParams
from dsv41.server.scheduler import Failure, Finish, KVBudget, QueueFull, Scheduler, Token, TooLarge, kv_estimate


@dataclass
class FakeRequest:
    id: int
    prompt: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    cached_tokens: int = 0
    replayed_tokens: int = 0
    exact_prefill: bool = False
    cache: None = None


class FakeEngine:
    """Engine's scheduling surface: each step admits every waiting request and emits one token per request."""

    def __init__(self, max_batch: int, step_s: float = 0.0):
        self.max_batch, self.step_s = max_batch, step_s
        self.running: list[FakeRequest] = []
        self.waiting: list[FakeRequest] = []
        self.prefix_cache = None
        self.prefilled: list[list[int]] = []  # prompt ids prefilled per step
        self._next = 0

    def add_request(self, prompt, params):
        self._next += 1
        self.waiting.append(FakeRequest(self._next, prompt, params))
        return self.waiting[-1]

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, req) -> None:
        req.finished = True
        req.finish_reason = req.finish_reason or "cancelled"
        for queue in (self.running, self.waiting):
            if req in queue:
                queue.remove(req)

    def step(self):
        time.sleep(self.step_s)
        self.prefilled.append([r.id for r in self.waiting])
        self.running += self.waiting
        self.waiting = []
        outs = []
        for r in self.running:
            r.output.append(7)
            if len(r.output) >= r.params.max_tokens:
                r.finished, r.finish_reason = True, "length"
            outs.append(StepOutput(r, 7, r.finished))
        self.running = [r for r in self.running if not r.finished]
        return outs


class Inbox:
    def __init__(self):
        self.events, self.done = [], threading.Event()

    def __call__(self, event):
        self.events.append(event)
        if not isinstance(event, Token):
            self.done.set()


def make(max_batch=8, budget=10**9, step_s=0.0, **kw) -> Scheduler:
    return Scheduler(FakeEngine(max_batch, step_s), kv_budget_bytes=budget, bytes_per_token=10, window_bytes=100,
                     **kw)


def test_kv_budget_policy():
    b = KVBudget(1000)
    assert b.fits(1000) and not b.fits(1001)
    b.reserve(600)
    assert not b.fits(500) and b.fits(400)
    b.release(600)
    assert b.reserved == 0
    assert kv_estimate(prompt_tokens=20, max_tokens=30, bytes_per_token=52.5, window_bytes=8448) == 50 * 52 + 25 + 8448


def test_admission_waits_for_budget_in_fifo_order():
    # each request reserves (10 + 5) * 10 + 100 = 250 bytes; the budget holds two
    s = make(budget=500, step_s=0.01)
    inboxes = [Inbox() for _ in range(3)]
    s.start()
    try:
        for box in inboxes:
            s.submit([1] * 10, SamplingParams(max_tokens=5), box)
        for box in inboxes:
            assert box.done.wait(5)
    finally:
        s.stop()
    assert s.engine.prefilled[0] == [1, 2]  # the third waited for a release
    assert [3] in s.engine.prefilled
    assert all(isinstance(b.events[-1], Finish) and b.events[-1].completion_tokens == 5 for b in inboxes)
    assert s.budget.reserved == 0
    with pytest.raises(TooLarge):  # could never fit: refused at once
        s.submit([1] * 100, SamplingParams(max_tokens=5), Inbox())


def test_queue_bound_and_cancel():
    s = make(max_batch=1, max_queue=1)  # not started: everything stays queued
    s.submit([1], SamplingParams(), Inbox())
    with pytest.raises(QueueFull):
        s.submit([1], SamplingParams(), Inbox())

    s = make(max_batch=4, step_s=0.01)
    s.start()
    try:
        long, other = Inbox(), Inbox()
        t_long = s.submit([1, 2], SamplingParams(max_tokens=10_000), long)
        s.submit([3], SamplingParams(max_tokens=10_000), other)
        deadline = time.monotonic() + 5
        while len(s.engine.running) < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        s.cancel(t_long)
        while len(s.engine.running) != 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert len(s.engine.running) == 1 and s.engine.running[0].prompt == [3]
        n = len(long.events)
        time.sleep(0.05)
        assert len(long.events) == n  # nothing delivered after the cancel
    finally:
        s.stop()


def test_deadlines_cut_running_and_fail_queued():
    s = make(max_batch=1, step_s=0.01, timeout_s=0.3)
    running = Inbox()
    s.start()
    try:
        s.submit([1], SamplingParams(max_tokens=10_000), running)
        assert running.done.wait(5)
        finish = running.events[-1]
        assert isinstance(finish, Finish) and finish.reason == "length" and 0 < finish.completion_tokens < 10_000

        blocker, queued = Inbox(), Inbox()
        ticket = s.submit([1], SamplingParams(max_tokens=10_000), blocker)
        ticket.deadline = None  # holds the only batch slot
        s.submit([2], SamplingParams(max_tokens=10_000), queued)
        assert queued.done.wait(5)
        assert isinstance(queued.events[-1], Failure) and queued.events[-1].status == 503
        assert queued.events[-1].code == "timeout" and not blocker.done.is_set()
    finally:
        s.stop()


def test_prefill_allowance_spreads_a_burst_of_long_prompts():
    s = make(prefill_tokens_per_step=100, step_s=0.005)
    boxes = [Inbox() for _ in range(4)]
    for box in boxes:
        s.submit([1] * 60, SamplingParams(max_tokens=3), box)
    s.start()
    try:
        for box in boxes:
            assert box.done.wait(5)
    finally:
        s.stop()
    assert [len(p) for p in s.engine.prefilled if p] == [1, 1, 1, 1]  # 60 + 60 > 100: one per step
