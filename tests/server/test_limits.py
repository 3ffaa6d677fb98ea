"""Limits on a live server: 401 without the key, 413 for a huge body, 429 when the waiting queue is full,
and a streaming client's disconnect cancels its sequence (the running batch shrinks)."""

from __future__ import annotations

import threading

import httpx
import pytest
from tests.server.conftest import MODEL_NAME, wait_for

from dsv41.server.metrics import parse

KEY = "limits-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def body(max_tokens: int, stream: bool = False, prompt: str = "The river") -> dict:
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(api_key=KEY, max_batch=2, max_queue=1, max_body_bytes=64 * 1024)


class Stream:
    """A streaming completion on its own connection, read up to its first chunk."""

    def __init__(self, server, max_tokens: int = 400):
        self.client = httpx.Client(base_url=server.url, timeout=60)
        self.response = self.client.send(self.client.build_request("POST", "/v1/completions", headers=AUTH,
                                                                   json=body(max_tokens, stream=True)), stream=True)
        assert self.response.status_code == 200
        self.lines = self.response.iter_lines()
        assert next(line for line in self.lines if line.startswith("data: "))

    def disconnect(self) -> None:
        self.response.close()
        self.client.close()


def test_401_without_or_with_a_wrong_key(server):
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": KEY}):
        r = httpx.get(server.base_url + "/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.base_url + "/models", headers=AUTH).status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200  # health and metrics stay open


def test_413_for_a_huge_body(server):
    huge = b'{"model": "' + b"x" * (1024 * 1024) + b'"}'
    r = httpx.post(server.base_url + "/completions", content=huge, headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"

    def chunked():  # no Content-Length: counted while read
        for _ in range(40):
            yield b" " * 4096

    r = httpx.post(server.base_url + "/completions", content=chunked(), headers={**AUTH,
                                                                                "content-type": "application/json"})
    assert r.status_code == 413
    assert httpx.post(server.base_url + "/completions", json=body(1), headers=AUTH).status_code == 200


def test_disconnect_cancels_and_full_queue_is_429(server):
    scheduler = server.scheduler
    a, b = Stream(server), Stream(server)
    wait_for(lambda: len(scheduler.engine.running) == 2, what="two running sequences")
    pools = scheduler.engine.pools
    assert pools.free_slots == pools.max_slots - 2
    a.disconnect()
    wait_for(lambda: len(scheduler.engine.running) == 1, what="the disconnected sequence to leave the batch")
    assert pools.free_slots == pools.max_slots - 1  # its slot and pages went back at once

    c = Stream(server)  # the batch is full again (max_batch=2)
    results = {}
    queued = threading.Thread(target=lambda: results.setdefault("r", httpx.post(
        server.base_url + "/completions", json=body(2), headers=AUTH, timeout=60)))
    queued.start()
    wait_for(lambda: scheduler.counts()["waiting"] == 1, what="one queued request")
    r = httpx.post(server.base_url + "/completions", json=body(2), headers=AUTH)
    assert r.status_code == 429
    assert r.json()["error"]["type"] == "rate_limit_error" and r.json()["error"]["code"] == "queue_full"

    b.disconnect()
    c.disconnect()
    queued.join(60)
    assert results["r"].status_code == 200 and results["r"].json()["choices"][0]["finish_reason"] == "length"
    wait_for(lambda: not scheduler.engine.running and pools.free_slots == pools.max_slots, what="an idle engine")
    assert all(pools.free_pages(s) == p.n_pages for s, p in pools.sources.items())
    samples = parse(httpx.get(server.url + "/metrics").text)
    assert samples['dsv41_requests_finished_total{reason="cancelled"}'] >= 3
    assert samples['dsv41_http_requests_total{route="/v1/completions",status="429"}'] == 1
    assert samples["dsv41_requests_running"] == 0 and samples["dsv41_kv_cache_used_bytes"] == 0
    assert samples["dsv41_kv_cache_capacity_bytes"] == scheduler.kv_capacity_bytes > 0


def test_non_streaming_disconnect_cancels_too(server):
    scheduler = server.scheduler
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
        httpx.post(server.base_url + "/completions", json=body(400), headers=AUTH, timeout=httpx.Timeout(60, read=1.0))
    pools = scheduler.engine.pools
    wait_for(lambda: not scheduler.engine.running and pools.free_slots == pools.max_slots,
             what="the abandoned request to leave the batch")
