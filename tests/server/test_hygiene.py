"""Input hygiene on a live server (issue 17, Build 5–6): Host allow-list, required JSON Content-Type, lone surrogates
and invalid UTF-8, a body read timeout, unknown models as 404, opt-in CORS, and tokenization off the event loop
(/health answers while a multi-megabyte prompt is being tokenized)."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
from tests.server.conftest import MODEL_NAME

BODY = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 1, "temperature": 0}


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(max_batch=2, body_timeout_s=1.0)


def error(r: httpx.Response) -> dict:
    return r.json()["error"]


def test_host_allow_list(server):
    url = server.base_url + "/completions"
    for host in ("evil.example", "127.0.0.1.evil.example", f"attacker:{server.port}"):
        r = httpx.post(url, json=BODY, headers={"host": host})
        assert r.status_code == 400 and error(r)["code"] == "invalid_host", (host, r.text)
    for host in (f"127.0.0.1:{server.port}", f"localhost:{server.port}", "localhost", f"[::1]:{server.port}"):
        assert httpx.post(url, json=BODY, headers={"host": host}).status_code == 200, host


def test_json_content_type_is_required(server):
    raw = b'{"model": "dsv41-tiny", "prompt": "hello", "max_tokens": 1}'
    for headers in ({}, {"content-type": "text/plain"}, {"content-type": "application/x-www-form-urlencoded"}):
        r = httpx.post(server.base_url + "/completions", content=raw, headers=headers)
        assert r.status_code == 415 and error(r)["code"] == "unsupported_media_type", headers
    ok = httpx.post(server.base_url + "/completions", content=raw,
                    headers={"content-type": "application/json; charset=utf-8"})
    assert ok.status_code == 200


def test_lone_surrogates_and_invalid_utf8_are_400(server):
    j = {"content-type": "application/json"}
    r = httpx.post(server.base_url + "/completions", headers=j,
                   content=b'{"model": "dsv41-tiny", "prompt": "a\\ud800b", "max_tokens": 1}')
    assert r.status_code == 400 and error(r)["code"] == "invalid_unicode" and error(r)["param"] == "prompt"
    r = httpx.post(server.base_url + "/chat/completions", headers=j, content=(
        b'{"model": "dsv41-tiny", "messages": [{"role": "user", "content": "\\udfff"}]}'))
    assert r.status_code == 400 and error(r)["param"] == "messages.[0].content"
    r = httpx.post(server.base_url + "/completions", headers=j,
                   content=b'{"model": "dsv41-tiny", "prompt": "caf\xe9", "max_tokens": 1}')
    assert r.status_code == 400 and error(r)["code"] == "invalid_utf8"
    good = httpx.post(server.base_url + "/completions", headers=j, content=(
        b'{"model": "dsv41-tiny", "prompt": "caf\\u00e9 \\ud83d\\ude00", "max_tokens": 1}'))  # a real pair is fine
    assert good.status_code == 200


def test_a_short_body_gets_408_after_the_body_timeout(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 200\r\n\r\n{\"model\":")
        t0 = time.monotonic()
        reply = sock.recv(65536)
        waited = time.monotonic() - t0
        while chunk := sock.recv(65536):  # the server closes the connection after the 408
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 408") and b"body_timeout" in reply, reply[:300]
    assert 0.8 < waited < 5, waited


def test_unknown_model_is_404(server):
    r = httpx.post(server.base_url + "/completions", json={**BODY, "model": "gpt-4o"})
    assert r.status_code == 404 and error(r)["code"] == "model_not_found" and error(r)["param"] == "model"
    assert httpx.get(server.base_url + "/models/gpt-4o").status_code == 404


def test_cors_is_opt_in(server, start_server):
    preflight = {"origin": "https://app.example", "access-control-request-method": "POST"}
    r = httpx.options(server.base_url + "/completions", headers=preflight)
    assert "access-control-allow-origin" not in r.headers
    cors = start_server(max_batch=1, cors_origins=["https://app.example"])
    r = httpx.options(cors.base_url + "/completions", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    r = httpx.options(cors.base_url + "/completions", headers={**preflight, "origin": "https://evil.example"})
    assert r.headers.get("access-control-allow-origin") != "https://evil.example"


def test_a_prompt_too_long_in_bytes_is_refused_before_tokenizing(server):
    serving = server.app.state.serving
    limit = serving.max_token_bytes * serving.max_model_len  # bytes no prompt that fits can exceed
    r = httpx.post(server.base_url + "/completions", json={**BODY, "prompt": "a" * limit}, timeout=30)
    assert r.status_code == 400 and error(r)["code"] == "context_length_exceeded" and "bytes" in error(r)["message"]
    r = httpx.post(server.base_url + "/completions", json={**BODY, "prompt": "a" * (limit // 8)}, timeout=30)
    assert r.status_code == 400 and "bytes" not in error(r)["message"]  # tokenized, then refused by count


def test_health_answers_while_a_huge_prompt_is_tokenized(server, monkeypatch):
    monkeypatch.setattr(server.app.state.serving, "max_token_bytes", 10**9)  # as for a long-context model
    prompt = "The quick brown fox jumps over the lazy dog. " * 80_000  # 3.6 MB: seconds of BPE
    result = {}

    def big():
        result["r"] = httpx.post(server.base_url + "/completions", json={**BODY, "prompt": prompt}, timeout=120)

    t = threading.Thread(target=big)
    t.start()
    worst = 0.0
    while t.is_alive():
        t0 = time.monotonic()
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        worst = max(worst, time.monotonic() - t0)
        time.sleep(0.05)
    t.join()
    print(f"worst /health latency while tokenizing: {worst * 1e3:.0f} ms")
    assert result["r"].status_code == 400 and error(result["r"])["code"] == "context_length_exceeded"
    assert worst < 1.0
