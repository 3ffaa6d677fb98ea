"""The server's thread / queue adapter against a scripted engine (no model): FIFO hand-over while the engine
holds fewer than max_batch, context-length refusal, the bounded queue, cancellation leaving the running batch,
deadlines. (Memory admission, chunked prefill and preemption are the engine's: tests/engine/.)"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import pytest

from dsv41.engine.engine import StepOutput
from dsv41.engine.sampling import SamplingParams
from dsv41.server.scheduler import Failure, Finish, QueueFull, Scheduler, ShuttingDown, Token, TooLarge


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

    def __init__(self, max_batch: int, step_s: float = 0.0, max_seq_len: int = 64):
        self.max_batch, self.step_s, self.max_seq_len = max_batch, step_s, max_seq_len
        self.running: list[FakeRequest] = []
        self.waiting: list[FakeRequest] = []
        self.prefix_cache = None
        self.prefilled: list[list[int]] = []  # prompt ids prefilled per step
        self._next = 0

    def add_request(self, prompt, params, namespace=None):
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


def make(max_batch=8, step_s=0.0, **kw) -> Scheduler:
    return Scheduler(FakeEngine(max_batch, step_s), **kw)


def test_hand_over_in_fifo_order_while_the_engine_has_room():
    s = make(max_batch=2, step_s=0.01)
    inboxes = [Inbox() for _ in range(3)]
    s.start()
    try:
        for box in inboxes:
            s.submit([1] * 10, SamplingParams(max_tokens=5), box)
        for box in inboxes:
            assert box.done.wait(5)
    finally:
        s.stop()
    assert s.engine.prefilled[0] == [1, 2]  # the third waited for room in the batch
    assert [3] in s.engine.prefilled
    assert all(isinstance(b.events[-1], Finish) and b.events[-1].completion_tokens == 5 for b in inboxes)
    assert not s._active
    with pytest.raises(TooLarge):  # a prompt that can never fit the context: refused at once
        s.submit([1] * 64, SamplingParams(max_tokens=5), Inbox())
    s.submit([1] * 63, SamplingParams(max_tokens=5), Inbox())  # the engine cuts it at the context end


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


def test_a_cancel_during_a_step_delivers_nothing_after_it():
    """The client goes away while the engine computes a step that emits its token: that token is not delivered
    (the step's outputs are read after the cancel), nor any later one."""
    s = make(max_batch=2)
    box, hook = Inbox(), {}
    real_step = s.engine.step

    def step():
        outs = real_step()
        if "ticket" in hook and len(box.events) >= 2:  # two tokens delivered: cancel inside the third step
            s.cancel(hook.pop("ticket"))
            hook["seen"] = len(box.events)
        return outs

    s.engine.step = step
    hook["ticket"] = s.submit([1], SamplingParams(max_tokens=1000), box)
    s.start()
    try:
        deadline = time.monotonic() + 5
        while "seen" not in hook and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.05)
    finally:
        s.stop()
    assert hook.get("seen") == 2 and len(box.events) == 2 and all(isinstance(e, Token) for e in box.events)


def test_a_draining_scheduler_refuses_new_requests_and_serves_the_queued():
    """`begin_drain`: a submission afterwards is ShuttingDown (HTTP 503); one queued before still finishes."""
    s = make(max_batch=1)
    queued = Inbox()
    s.submit([1], SamplingParams(max_tokens=3), queued)
    s.begin_drain(5.0)
    with pytest.raises(ShuttingDown):
        s.submit([1], SamplingParams(max_tokens=3), Inbox())
    s.start()
    try:
        assert queued.done.wait(5)
    finally:
        s.stop()
    assert isinstance(queued.events[-1], Finish) and queued.events[-1].completion_tokens == 3
