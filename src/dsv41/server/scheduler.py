"""Continuous batching for the server: one thread owns the Engine; requests join and leave every step.

HTTP handlers never touch the engine. They `submit` a prompt (token ids) with its sampling parameters
and a `deliver` callback, and receive `Token` / `Finish` / `Failure` events from the engine thread.
The engine thread loops:

    apply cancellations → expire deadlines → admit from the queue → engine.step() → deliver events

This is only the thread / queue adapter: memory, batching and prefill pacing are the engine's own
(`engine/scheduler.py`: fixed pools, a token budget per step with chunked prefill, preemption when
pages run out). Here:
  * requests are handed to the engine in FIFO order while the engine holds fewer than `max_batch`
    (running + its own waiting), so a queued request's deadline and cancellation stay here;
  * a prompt that can never fit the context is refused at `submit` (`TooLarge`, HTTP 400);
  * the waiting queue is bounded: `submit` raises `QueueFull` beyond `max_queue` (HTTP 429).

A cancelled request (client gone, stop string matched) is aborted in the engine between steps (its
pages go back at once). A request past its deadline is cut: still queued → `Failure(503, "timeout")`;
already generating → `Finish("length")` with the tokens produced so far.

Isolation: a request that fails alone (the engine's `StepOutput.error`, or `add_request` refusing it) gets
its own `Failure` and the batch goes on; only an exception out of `engine.step()` itself fails the requests
of that batch (the engine's state for them is unknown), and the scheduler keeps serving.

Draining (graceful shutdown, `begin_drain`): new submissions are refused (`ShuttingDown`, HTTP 503), running
and queued requests go on until the drain deadline, then each remaining one gets `Failure(503, "shutdown")`.

Prefix-cache namespaces (cache salt, API key) go to the engine with each request (`add_request(namespace=)`).

Policy only: no torch here. The engine is used through `add_request`, `step`, `abort`, `running`, `waiting`,
`has_work` and `prefix_cache`.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dsv41.engine.sampling import SamplingParams

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------- events (engine thread → handler)
@dataclass(slots=True)
class Token:
    token: int
    logprob: float | None = None  # log-softmax of the unmodified logits (SamplingParams.logprobs set)
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass(slots=True)
class Finish:
    reason: str  # "stop" (stop token) or "length" (max_tokens, context end or deadline)
    prompt_tokens: int
    completion_tokens: int  # sampled tokens, a final stop token included (it cost a decode step)
    cached_tokens: int  # prompt tokens served from the prefix cache
    replayed_tokens: int


@dataclass(slots=True)
class Failure:
    status: int
    message: str
    type: str = "server_error"
    code: str | None = None


Event = Token | Finish | Failure


class QueueFull(Exception):
    pass


class TooLarge(Exception):
    pass


class ShuttingDown(Exception):
    pass


@dataclass(eq=False)
class Ticket:
    """One request's life in the scheduler (handler side reads only `done`)."""

    id: int
    prompt: list[int]
    params: SamplingParams
    deliver: Callable[[Event], None]
    arrival: float
    deadline: float | None
    namespace: str | None = None  # prefix-cache namespace (tenant)
    images: list | None = None  # the prompt's images (image_processor.ImageInput), in order
    request: Any = None  # the engine's Request once admitted
    done: bool = False
    n_emitted: int = 0
    last_token_at: float = 0.0
    extra: dict = field(default_factory=dict)


# ---------------------------------------------------------------------- the engine thread
class Scheduler:
    def __init__(self, engine, *, max_queue: int = 256, timeout_s: float | None = 600.0, metrics=None):
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.engine = engine
        self.max_queue, self.timeout_s = max_queue, timeout_s
        self.max_batch = engine.max_batch
        self.max_seq_len = getattr(engine, "max_seq_len", None)
        self.metrics = metrics
        self._queue: deque[Ticket] = deque()  # submitted, not yet admitted (FIFO)
        self._cancels: deque[Ticket] = deque()
        self._active: dict[int, Ticket] = {}  # engine request id → ticket
        self._cond = threading.Condition()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stop = False
        self.kv_used_bytes = 0  # measured after each step (engine thread writes, anyone reads)
        self.steps = 0
        self.fatal: str | None = None
        self.draining = False
        self._drain_deadline: float | None = None

    # ------------------------------------------------------------------ handler side (any thread)
    def submit(self, prompt: list[int], params: SamplingParams, deliver: Callable[[Event], None],
               namespace: str | None = None, images: list | None = None) -> Ticket:
        if self.draining:
            raise ShuttingDown("the server is shutting down; retry on another instance")
        if self.max_seq_len is not None and len(prompt) >= self.max_seq_len:
            raise TooLarge(f"the prompt has {len(prompt)} tokens; this model's context holds {self.max_seq_len} "
                           f"(prompt and generated tokens together)")
        now = time.perf_counter()
        with self._cond:
            if len(self._queue) >= self.max_queue:
                raise QueueFull(f"the server's waiting queue is full ({self.max_queue} requests); retry later")
            ticket = Ticket(next(self._ids), prompt, params, deliver, now,
                            now + self.timeout_s if self.timeout_s else None, namespace, images)
            self._queue.append(ticket)
            self._cond.notify()
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """Stop generating for `ticket` (no further events are delivered). Idempotent."""
        with self._cond:
            if ticket.done:
                return
            ticket.done = True
            self._cancels.append(ticket)
            self._cond.notify()

    def counts(self) -> dict[str, int]:
        with self._cond:
            queued = len(self._queue)
        return {"running": len(self.engine.running), "waiting": queued + len(self.engine.waiting),
                "kv_used_bytes": self.kv_used_bytes, "kv_capacity_bytes": self.kv_capacity_bytes}

    @property
    def kv_capacity_bytes(self) -> int:
        """Bytes of the engine's fixed cache pools (0 for an engine without them)."""
        pools = getattr(self.engine, "pools", None)
        return sum(pools.allocated_bytes().values()) if pools is not None else 0

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="dsv41-engine", daemon=True)
            self._thread.start()

    def begin_drain(self, timeout_s: float) -> None:
        """Stop admission now; requests still unfinished after `timeout_s` end with a shutdown failure."""
        with self._cond:
            if not self.draining:
                self.draining = True
                self._drain_deadline = time.perf_counter() + max(0.0, timeout_s)
                log.info("draining: %d running, %d queued; the rest end in %.0f s", len(self._active),
                         len(self._queue), timeout_s)
            self._cond.notify()

    def idle(self) -> bool:
        with self._cond:
            return not (self._queue or self._active)

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        cache = getattr(self.engine, "prefix_cache", None)
        if cache is not None and hasattr(cache, "flush"):  # let queued cache writes land (bounded)
            cache.flush(timeout)

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._stop or self._queue or self._cancels or self.engine.has_work()):
                        self._cond.wait(self._idle_wait())
                        self._expire(time.perf_counter())
                    if self._stop:
                        break
                    if self._drain_deadline is not None and time.perf_counter() >= self._drain_deadline:
                        self._drain_deadline = None
                        self._fail_all(Failure(503, "the server is shutting down; the request was ended before it "
                                                    "finished", code="shutdown"), lock_held=True)
                    cancels = list(self._cancels)
                    self._cancels.clear()
                for ticket in cancels:
                    self._drop(ticket, "cancelled")
                now = time.perf_counter()
                with self._cond:
                    self._expire(now)
                    self._admit()
                if self.engine.has_work():
                    self._step()
        except BaseException as e:  # noqa: BLE001 - a dead engine thread must be visible (/health)
            self.fatal = f"{type(e).__name__}: {e}"
            log.exception("engine thread died")
            raise
        finally:
            self._fail_all(Failure(503, "the server is shutting down" if self._stop else "the engine stopped",
                                   code="engine_stopped"))

    def _idle_wait(self) -> float:
        deadlines = [t.deadline for t in self._queue if t.deadline is not None]
        if self._drain_deadline is not None:
            deadlines.append(self._drain_deadline)
        return max(0.0, min(deadlines) - time.perf_counter()) + 1e-3 if deadlines else 1.0

    def _expire(self, now: float) -> None:
        """(lock held) Cut requests past their deadline."""
        for ticket in [t for t in self._queue if t.deadline is not None and now >= t.deadline]:
            self._queue.remove(ticket)
            self._close(ticket, Failure(503, f"the request waited {self.timeout_s:g} s in the queue without being "
                                             "scheduled; retry later", code="timeout"), "timeout")
        for ticket in [t for t in self._active.values() if t.deadline is not None and now >= t.deadline]:
            self._remove_from_engine(ticket)
            self._close(ticket, self._finish_event(ticket.request, "length"), "timeout")

    def _admit(self) -> None:
        """(lock held) Hand the queue head to the engine, FIFO, while the engine holds fewer than max_batch."""
        while self._queue:
            head = self._queue[0]
            if len(self.engine.running) + len(self.engine.waiting) >= self.max_batch:
                break
            self._queue.popleft()
            try:
                head.request = self.engine.add_request(head.prompt, head.params, namespace=head.namespace,
                                                       **({"images": head.images} if head.images else {}))
            except ValueError as e:  # validated upstream; a mismatch is still the client's input
                self._close(head, Failure(400, str(e), "invalid_request_error"), "error")
                continue
            except Exception as e:  # noqa: BLE001 - this request alone fails
                log.exception("add_request failed for one request")
                self._close(head, Failure(500, f"internal error while admitting the request: {type(e).__name__}"),
                            "error")
                continue
            self._active[head.request.id] = head

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # a server fault: fail this batch, keep serving
            log.exception("engine.step failed; failing %d requests", len(self._active))
            for ticket in list(self._active.values()):
                self._remove_from_engine(ticket)
                self._close(ticket, Failure(500, f"internal error while generating: {type(e).__name__}"), "error")
            return
        self.steps += 1
        now = time.perf_counter()
        m = self.metrics
        for out in outputs:
            ticket = self._active.get(out.request.id)
            if ticket is None:
                continue
            req = out.request
            first = ticket.n_emitted == 0
            if first and m is not None:  # the prefill happened this step
                m.prompt_tokens.inc(len(req.prompt))
                if self.engine.prefix_cache is not None and not req.exact_prefill:
                    m.prefix_lookups.inc()
                    if req.cached_tokens:
                        m.prefix_hits.inc()
                        m.cached_tokens.inc(req.cached_tokens)
                        m.replayed_tokens.inc(req.replayed_tokens)
            ticket.n_emitted += 1
            if m is not None:
                m.completion_tokens.inc()
                if first:
                    m.ttft.observe(now - ticket.arrival)
                else:
                    m.itl.observe(now - ticket.last_token_at)
            ticket.last_token_at = now
            error = getattr(out, "error", None)
            if error:  # this request failed alone (the engine isolated it); the others go on
                log.warning("request %s failed inside the engine: %s", ticket.id, error)
                self._remove_from_engine(ticket)
                self._close(ticket, Failure(500, f"internal error while generating: {error}"), "error")
                continue
            if out.token is not None and not ticket.done:
                ticket.deliver(Token(out.token, getattr(out, "logprob", None), getattr(out, "top_logprobs", None)))
            if out.finished:
                self._close(ticket, self._finish_event(req, req.finish_reason or "length"), req.finish_reason)
        self.kv_used_bytes = sum(r.cache.global_kv_bytes() + r.cache.window_bytes()
                                 for r in self.engine.running if r.cache is not None and not r.cache.released)

    # ------------------------------------------------------------------ bookkeeping
    @staticmethod
    def _finish_event(req, reason: str) -> Finish:
        generated = len(req.output) + (1 if reason == "stop" else 0)
        return Finish(reason, len(req.prompt), generated, req.cached_tokens, req.replayed_tokens)

    def _remove_from_engine(self, ticket: Ticket) -> None:
        req = ticket.request
        if req is None:
            return
        self.engine.abort(req)

    def _drop(self, ticket: Ticket, reason: str) -> None:
        """A cancelled ticket: out of the queue or the engine (pages freed), nothing delivered."""
        with self._cond:
            if ticket in self._queue:
                self._queue.remove(ticket)
        self._remove_from_engine(ticket)
        self._release(ticket, reason)

    def _close(self, ticket: Ticket, event: Event, reason: str | None) -> None:
        if not ticket.done:
            ticket.done = True
            ticket.deliver(event)
        self._release(ticket, reason)

    def _release(self, ticket: Ticket, reason: str | None) -> None:
        if ticket.request is not None:
            self._active.pop(ticket.request.id, None)
        if self.metrics is not None and not ticket.extra.get("counted"):
            ticket.extra["counted"] = True
            self.metrics.finished.inc(reason=reason or "unknown")

    def _fail_all(self, failure: Failure, lock_held: bool = False) -> None:
        if lock_held:
            pending = list(self._queue) + list(self._active.values())
            self._queue.clear()
        else:
            with self._cond:
                pending = list(self._queue) + list(self._active.values())
                self._queue.clear()
        for ticket in pending:
            self._remove_from_engine(ticket)
            self._close(ticket, failure, "error")
