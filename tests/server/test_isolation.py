"""Per-request isolation (issue 17, acceptance 2): a request that fails inside the engine fails alone, the batch and
every other stream go on; a request the sampler could not run never gets that far."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import httpx
import pytest
from tests.server.conftest import MODEL_NAME
from tests.server.test_scheduler import FakeEngine, Inbox

import dsv41.engine.engine as engine_module
from dsv41.engine.sampling import SamplingParams
from dsv41.server.scheduler import Failure, Finish, Scheduler, Token

BOOM_SEED = 666


@dataclass
class Out:
    request: object
    token: int | None
    finished: bool
    error: str | None = None


class OneBadRow(FakeEngine):
    """Fails the request whose seed is BOOM_SEED at its third token, as an engine with per-row retry reports it."""

    def step(self):
        outs = []
        for o in super().step():
            if o.request.params.seed == BOOM_SEED and len(o.request.output) == 3:
                self.abort(o.request)
                outs.append(Out(o.request, None, True, "RuntimeError: sampler exploded"))
            else:
                outs.append(Out(o.request, o.token, o.finished))
        return outs


def test_a_request_failing_in_the_engine_fails_alone():
    s = Scheduler(OneBadRow(max_batch=8, step_s=0.002))
    good, bad = [Inbox() for _ in range(3)], Inbox()
    s.start()
    try:
        for i, box in enumerate(good):
            s.submit([1, 2], SamplingParams(max_tokens=20, seed=i), box)
        s.submit([3], SamplingParams(max_tokens=20, seed=BOOM_SEED), bad)
        for box in (*good, bad):
            assert box.done.wait(10)
    finally:
        s.stop()
    assert isinstance(bad.events[-1], Failure) and bad.events[-1].status == 500
    assert "sampler exploded" in bad.events[-1].message
    assert sum(isinstance(e, Token) for e in bad.events) == 2  # what it had before the failure
    for box in good:
        assert isinstance(box.events[-1], Finish) and box.events[-1].completion_tokens == 20
        assert sum(isinstance(e, Token) for e in box.events) == 20
    assert s.alive is False and not s._active


@pytest.fixture
def exploding_sampler(monkeypatch):
    """The engine's sampler raises whenever the batch holds the BOOM_SEED request (as a bug in one request's
    parameters would)."""
    real = engine_module.sample

    def sample(logits, params_list, generators):
        if any(p.seed == BOOM_SEED for p in params_list):
            raise RuntimeError("sampler exploded")
        return real(logits, params_list, generators)

    monkeypatch.setattr(engine_module, "sample", sample)


def test_a_request_crashing_inside_the_sampler_fails_only_itself(start_server, exploding_sampler):
    server = start_server(max_batch=8)
    body = {"model": MODEL_NAME, "prompt": "The river", "max_tokens": 120, "temperature": 0, "stream": True}
    results: dict[str, tuple[bool, bool]] = {}  # name → (saw an error event, saw [DONE])
    running = {f"good{i}": threading.Event() for i in range(3)}

    def stream(name: str, **extra) -> None:
        error = done = False
        with httpx.Client(timeout=60) as client, client.stream("POST", server.base_url + "/completions",
                                                               json={**body, **extra}) as r:
            if r.status_code != 200:
                results[name] = (True, False)
                return
            for line in r.iter_lines():
                error |= line.startswith("data: {\"error\"")
                done |= line == "data: [DONE]"
                if name in running and line.startswith("data: {"):
                    running[name].set()
        results[name] = (error, done)

    threads = [threading.Thread(target=stream, args=(f"good{i}",)) for i in range(3)]
    for t in threads:
        t.start()
    for event in running.values():  # the good streams are decoding when the bad request arrives
        assert event.wait(60)
    stream("bad", temperature=1.0, seed=BOOM_SEED)
    for t in threads:
        t.join(60)
    assert results["bad"][0], results
    assert all(results[f"good{i}"] == (False, True) for i in range(3)), results
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
