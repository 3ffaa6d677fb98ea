"""Fuzz (issue 17, acceptance 2): more than 1,000 distinct malformed or hostile requests — hypothesis-built bodies
(broken JSON, random JSON, wrong types, missing fields, out-of-range and huge numbers, unsupported options, bad
headers, wrong routes), schemathesis cases generated from the server's own OpenAPI document (negative mode), and
a hand-written corpus (lone surrogates, invalid UTF-8, sampler-breaking values, foreign Host headers, missing
Content-Type, short bodies, hostile tool definitions) → only 4xx with an OpenAI error body, while greedy streams
run alongside and produce exactly the engine's output; afterwards a normal request succeeds and /metrics shows
no 5xx."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from tests.server.conftest import MODEL_NAME

from dsv41.engine.engine import Engine
from dsv41.server.metrics import parse

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
COMPLETION = {"model": MODEL_NAME, "prompt": "hello there", "max_tokens": 2, "temperature": 0}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
CONTEXT = 512  # the tiny preset's max_seq_len

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12)
huge = st.integers(min_value=10**18, max_value=10**60)
not_number = st.text(max_size=8) | st.booleans() | st.lists(st.integers(), max_size=2) | st.dictionaries(
    st.text(max_size=3), st.integers(), max_size=2)
not_int = st.floats(allow_nan=False, allow_infinity=False).filter(lambda x: x != int(x)) | not_number
not_bool = st.integers() | st.text(max_size=5) | st.floats(allow_nan=False) | st.lists(st.booleans(), max_size=2)
not_string = st.integers() | st.floats(allow_nan=False) | st.booleans() | st.lists(st.text(max_size=3), max_size=2)

# invalid values per field; every value here must be refused
COMMON = {
    "model": st.text(max_size=12).filter(lambda s: s != MODEL_NAME) | not_string | st.none(),
    "max_tokens": st.integers(max_value=0) | st.integers(min_value=CONTEXT) | huge | not_int,
    "temperature": st.floats(min_value=2.0, exclude_min=True) | st.floats(max_value=0.0, exclude_max=True) | huge
    | not_number,
    "top_p": st.floats(max_value=0.0) | st.floats(min_value=1.0, exclude_min=True) | not_number,
    "top_k": st.integers(max_value=-1) | not_int,
    "n": st.integers(max_value=0) | st.integers(min_value=17) | not_int,
    "stream": not_bool,
    "stream_options": st.just({"include_usage": True}) | st.dictionaries(st.text(max_size=5), json_values,
                                                                          min_size=1, max_size=2)
    | not_string,
    "stop": st.integers() | st.lists(st.text(min_size=1), min_size=5, max_size=6) | st.just([""]) | st.just("")
    | st.lists(st.integers(), min_size=1, max_size=2),
    "seed": st.integers(min_value=2**64) | st.integers(max_value=-(2**63) - 1) | not_int,
    "presence_penalty": st.floats(min_value=-2, max_value=2).filter(bool) | st.floats(min_value=2.01) | not_number,
    "frequency_penalty": st.floats(min_value=2.01) | st.floats(max_value=-2.01) | not_number,
    "logit_bias": st.dictionaries(st.text(max_size=4), st.floats(-100, 100), min_size=1, max_size=2) | not_string,
}
COMPLETION_FIELDS = {
    **COMMON,
    "prompt": st.none() | st.integers() | st.floats(allow_nan=False) | st.just([]) | st.just([[]])
    | st.lists(st.integers(max_value=-1), min_size=1, max_size=3)
    | st.lists(st.integers(min_value=16384), min_size=1, max_size=3)
    | st.lists(st.text(max_size=5), min_size=2, max_size=4) | st.lists(st.booleans(), min_size=1, max_size=2),
    "echo": st.just(True) | not_bool, "best_of": st.integers(min_value=2, max_value=20) | st.integers(max_value=0),
    "logprobs": st.integers(max_value=-1) | st.integers(min_value=6) | not_int, "suffix": st.text() | not_string,
}
CHAT_FIELDS = {
    **COMMON,
    "messages": st.none() | st.just([]) | st.text(max_size=5) | st.lists(json_values.filter(
        lambda v: not isinstance(v, dict)), min_size=1, max_size=2)
    | st.lists(st.fixed_dictionaries({"role": st.text(max_size=8).filter(
        lambda r: r not in {"system", "developer", "user", "assistant"}), "content": st.text(max_size=5)}),
        min_size=1, max_size=2)
    | st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": not_string.filter(
        lambda v: not isinstance(v, list) or v)}), min_size=1, max_size=2)
    | st.just([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    | st.just([{"role": "user", "content": "x", "reasoning_effort": 50}]),
    "reasoning_effort": st.sampled_from(["medium", "minimal", "none", "LOW", ""]) | st.integers(max_value=0)
    | st.integers(min_value=101) | st.floats(allow_nan=False) | st.booleans(),
    "max_completion_tokens": st.integers(max_value=0) | huge | not_int,
    "logprobs": not_bool, "tools": st.lists(json_values, min_size=1, max_size=2),
    "response_format": st.just({"type": "json_object"}) | not_string,
}
KNOWN = set(COMPLETION_FIELDS) | set(CHAT_FIELDS) | {"user", "metadata", "store", "service_tier", "top_logprobs",
                                                     "tool_choice", "parallel_tool_calls", "cache_salt"}


@st.composite
def mutated(draw):
    """A valid body with one field broken, removed, or an unknown one added."""
    route, base, fields = draw(st.sampled_from([("/v1/completions", COMPLETION, COMPLETION_FIELDS),
                                                ("/v1/chat/completions", CHAT, CHAT_FIELDS)]))
    body = dict(base)
    how = draw(st.sampled_from(["break", "break", "break", "remove", "unknown"]))
    if how == "break":
        name = draw(st.sampled_from(sorted(fields)))
        body[name] = draw(fields[name])
    elif how == "remove":
        del body[draw(st.sampled_from(["model", "prompt" if "prompt" in body else "messages"]))]
    else:
        body[draw(st.from_regex(r"[a-z_]{1,12}", fullmatch=True).filter(lambda k: k not in KNOWN))] = draw(json_values)
    return route, json.dumps(body).encode(), {**AUTH, "content-type": "application/json"}


@st.composite
def garbage(draw):
    """Random JSON of any shape, broken JSON text, raw bytes, NaN / huge literals."""
    route = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    kind = draw(st.sampled_from(["json", "text", "bytes", "literal"]))
    if kind == "json":
        raw = json.dumps(draw(json_values)).encode()
    elif kind == "text":
        raw = draw(st.text(max_size=40)).encode("utf-8", "surrogatepass")
    elif kind == "bytes":
        raw = draw(st.binary(max_size=40))
    else:
        field = draw(st.sampled_from(["temperature", "max_tokens", "top_p", "seed"]))
        literal = draw(st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "9" * 5000, "[" * 3000]))
        raw = json.dumps(COMPLETION)[:-1].encode() + f', "{field}": {literal}}}'.encode()
    return route, raw, {**AUTH, "content-type": "application/json"}


@st.composite
def bad_headers(draw):
    """A valid body with a wrong key, a broken Authorization header, or a non-JSON content type."""
    route, body = draw(st.sampled_from([("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)]))
    headers = {"content-type": "application/json"}
    how = draw(st.sampled_from(["key", "scheme", "missing", "ctype"]))
    if how == "key":
        headers["authorization"] = "Bearer " + draw(st.text(st.characters(min_codepoint=33, max_codepoint=126),
                                                            min_size=1, max_size=20).filter(lambda k: k != KEY))
    elif how == "scheme":
        headers["authorization"] = draw(st.sampled_from([f"Basic {KEY}", f"bearer{KEY}", f"Token {KEY}", KEY,
                                                         "Bearer", f"{KEY} Bearer", f"Bearer {KEY}x"]))
    elif how == "ctype":
        headers.update(AUTH)
        headers["content-type"] = draw(st.sampled_from(["text/plain", "application/x-www-form-urlencoded",
                                                        "multipart/form-data", "application/xml", "json"]))
    return route, json.dumps(body).encode(), headers


@st.composite
def wrong_route(draw):
    path = draw(st.sampled_from(["/v1/completion", "/v1/chat", "/v2/completions", "/v1/engines", "/"]))
    return path + draw(st.from_regex(r"([a-z][a-z/]{0,5})?", fullmatch=True)), b"{}", {**AUTH,
                                                                              "content-type": "application/json"}


STREAM_PROMPT = "Once upon a time, in a quiet village by the sea,"
STREAM_TOKENS = 24


class Streams:
    """Greedy streams run in a loop alongside the fuzz; each must equal the engine's own output, end to end."""

    def __init__(self, server, expected: str, n: int = 2):
        self.server, self.expected = server, expected
        self.runs, self.failures = 0, []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(n)]
        for t in self.threads:
            t.start()

    def _loop(self) -> None:
        body = {"model": MODEL_NAME, "prompt": STREAM_PROMPT, "max_tokens": STREAM_TOKENS, "temperature": 0,
                "stream": True}
        with httpx.Client(base_url=self.server.url, timeout=60) as client:
            while not self.stop.is_set():
                text, reason, done = "", None, False
                try:
                    with client.stream("POST", "/v1/completions", json=body, headers=AUTH) as r:
                        for line in r.iter_lines():
                            if line == "data: [DONE]":
                                done = True
                            elif line.startswith("data: "):
                                chunk = json.loads(line[6:])
                                assert "error" not in chunk, chunk
                                text += chunk["choices"][0]["text"]
                                reason = chunk["choices"][0]["finish_reason"] or reason
                    assert done and reason is not None and text == self.expected, (text, reason, done)
                except Exception as e:  # noqa: BLE001 - recorded, asserted by the test
                    self.failures.append(repr(e)[:300])
                self.runs += 1

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(90)


@pytest.fixture(scope="module")
def fuzz(start_server, tiny):
    """The fuzzed server (a 1 s body timeout), its concurrent
    streams, and the set of distinct requests sent."""
    model, tok = tiny
    ids = tok.encode(STREAM_PROMPT, add_bos=True)
    expected = tok.decode(Engine(model).generate([ids], max_tokens=STREAM_TOKENS, stop_token_ids=[tok.eos_id])[0],
                          skip_special=True)
    server = start_server(api_key=KEY, max_batch=4, timeout_s=120, body_timeout_s=1.0)
    streams = Streams(server, expected)
    state = {"server": server, "streams": streams, "distinct": set(), "statuses": Counter()}
    yield state
    streams.close()


def check(state, r: httpx.Response, what) -> None:
    state["statuses"][r.status_code] += 1
    assert 400 <= r.status_code < 500, (what, r.status_code, r.text[:300])
    error = r.json()["error"]
    assert isinstance(error["message"], str) and error["type"], r.text


def test_fuzz_only_4xx(fuzz):
    server, statuses = fuzz["server"], fuzz["statuses"]
    client = httpx.Client(base_url=server.url, timeout=30)

    @settings(max_examples=800, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(st.one_of(mutated(), mutated(), garbage(), bad_headers(), wrong_route()))
    def one(case):
        route, raw, headers = case
        fuzz["distinct"].add(("POST", route, raw, tuple(sorted(headers.items()))))
        check(fuzz, client.post(route, content=raw, headers=headers), (route, raw[:300]))

    one()
    for method in ("GET", "PUT", "DELETE"):  # wrong methods
        r = client.request(method, "/v1/chat/completions", headers=AUTH)
        fuzz["distinct"].add((method, "/v1/chat/completions"))
        statuses[r.status_code] += 1
        assert r.status_code == 405 and "error" in r.json()
    client.close()


def test_schemathesis_negative_cases_from_the_openapi_document(fuzz):
    """Schema-violating bodies for every POST operation of /openapi.json, generated by schemathesis."""
    server = fuzz["server"]
    doc = httpx.get(server.url + "/openapi.json").json()
    schema = schemathesis.openapi.from_dict(doc)
    operations = [r.ok() for r in schema.get_all_operations()]
    posts = [op for op in operations if op.method.upper() == "POST"]
    assert {op.path for op in posts} >= {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"}
    client = httpx.Client(base_url=server.url, timeout=30)

    def send(path: str, case) -> None:
        t0 = time.monotonic()
        kwargs = case.as_transport_kwargs(base_url=server.url, headers=AUTH)
        content = kwargs.get("data")
        if "json" in kwargs:
            content = json.dumps(kwargs["json"]).encode()
        headers = {k: v for k, v in (kwargs.get("headers") or {}).items() if k.lower() != "content-length"}
        headers.setdefault("content-type", "application/json")
        content = content if isinstance(content, bytes | type(None)) else str(content).encode()
        fuzz["distinct"].add(("POST", path, content, tuple(sorted(headers.items()))))
        r = client.post(path, content=content, headers=headers)
        if time.monotonic() - t0 > 0.5:
            print("slow case", path, r.status_code, round(time.monotonic() - t0, 2), (content or b"")[:200])
        check(fuzz, r, (path, (content or b"")[:300]))

    slow_to_generate = {"/tokenize", "/v1/chat/completions"}  # oneOf / deep schemas: hypothesis-jsonschema is slow
    for op in posts:
        t0 = time.monotonic()

        @settings(max_examples=30 if op.path in slow_to_generate else 60, deadline=None, database=None,
                  derandomize=True, suppress_health_check=list(HealthCheck))
        @given(op.as_strategy(generation_mode=GenerationMode.NEGATIVE))
        def one(case):
            send(case.operation.path, case)

        one()
        print(f"schemathesis {op.path}: {time.monotonic() - t0:.1f} s")
    client.close()


def hostile_corpus() -> list[tuple[str, bytes, dict]]:
    """(route, raw body, headers) of requests built to break things; every one must get a 4xx."""
    J = {**AUTH, "content-type": "application/json"}
    out: list[tuple[str, bytes, dict]] = []

    def body(route: str, **fields) -> None:
        base = dict(COMPLETION if route == "/v1/completions" else CHAT)
        base.update(fields)
        out.append((route, json.dumps(base).encode(), J))

    for route in ("/v1/completions", "/v1/chat/completions"):
        for k in (2**31, 2**63, 2**63 + 1, 2**64, 10**30, 16385):  # the sampler's int64 / vocabulary
            body(route, top_k=k, temperature=1.0)
        for p in (1.4e-45, 5e-324, 1e-300, 1e-20, 1e-9):  # a nucleus that rounds to nothing in fp32
            body(route, top_p=p, temperature=1.0)
        for name, value in (("max_tokens", 2**63), ("seed", 2**64), ("n", 17), ("n", 2**31), ("temperature", 1e308),
                            ("stop", ["x"] * 5), ("stop", [""]), ("cache_salt", ""), ("cache_salt", "s" * 257),
                            ("user", 5), ("metadata", {"a": 1}), ("presence_penalty", 3)):
            body(route, **{name: value})
    for lp in (-1, 6, 100, True):
        body("/v1/completions", logprobs=lp)
    for fields in ({"logprobs": True, "top_logprobs": 21}, {"top_logprobs": 3}, {"logprobs": 1},
                   {"tool_choice": "required"}, {"tool_choice": {"type": "function", "function": {"name": "f"}}},
                   {"tools": [{"type": "function", "function": {"name": "bad name"}}]},
                   {"tools": [{"type": "function", "function": {"name": "x" * 65}}]},
                   {"tools": [{"type": "code_interpreter"}]}, {"tools": [{"type": "function"}]},
                   {"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
                   {"messages": [{"role": "tool", "content": "42"}]},
                   {"messages": [{"role": "user", "content": "x", "tool_call_id": "c1"}]},
                   {"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
                   {"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                                       "function": {"name": "f"}}]}]},
                   {"model": "gpt-4o"}, {"model": MODEL_NAME + " "}, {"reasoning_effort": "medium"}):
        body("/v1/chat/completions", **fields)
    # lone surrogates and invalid UTF-8, in every kind of place
    for route, field in (("/v1/completions", "prompt"), ("/v1/completions", "stop"), ("/v1/completions", "user"),
                         ("/v1/chat/completions", "user"), ("/v1/chat/completions", "stop")):
        for bad in ("\\ud800", "a\\udfff", "\\ud83d", "x\\udc00y"):
            raw = json.dumps({**(COMPLETION if route == "/v1/completions" else CHAT)})[:-1]
            out.append((route, (raw + f', "{field}": "{bad}"}}').encode(), J))
    for bad in ("\\ud800", "\\udbff\\u0041", "ok\\udfff"):
        raw = f'{{"model": "{MODEL_NAME}", "messages": [{{"role": "user", "content": "{bad}"}}], "max_tokens": 1}}'
        out.append(("/v1/chat/completions", raw.encode(), J))
        out.append(("/tokenize", f'{{"prompt": "{bad}"}}'.encode(), J))
    for raw_bytes in (b"\xff", b"\xc3\x28", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xfe\xfe"):
        out.append(("/v1/completions", b'{"model": "' + MODEL_NAME.encode() + b'", "prompt": "' + raw_bytes + b'"}', J))
        out.append(("/tokenize", b'{"prompt": "a' + raw_bytes + b'"}', J))
    # bodies that are not what they say, or not JSON at all
    good = json.dumps(COMPLETION).encode()
    for ctype in (None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                  "text/html", "application/jsonx", "application/xml"):
        headers = dict(AUTH) if ctype is None else {**AUTH, "content-type": ctype}
        out.append(("/v1/completions", good, headers))
        out.append(("/tokenize", b'{"prompt": "hi"}', headers))
    for host in ("evil.example", "127.0.0.1.evil.example", "localhost.attacker", "[::2]:8000", "10.0.0.1",
                 "rebind.example:80"):
        out.append(("/v1/completions", good, {**J, "host": host}))
        out.append(("/tokenize", b'{"prompt": "hi"}', {**J, "host": host}))
    for depth in (1000, 5000, 100000):
        out.append(("/v1/completions", b"[" * depth + b"]" * depth, J))
    # the token-id helpers
    for bad in ({"tokens": [-1]}, {"tokens": [16384]}, {"tokens": [2**40]}, {"tokens": "abc"}, {"tokens": [1.5]},
                {"tokens": [1], "model": "other"}, {"prompt": 5}, {"prompt": "x", "extra": 1}, {"messages": []},
                {"messages": [{"role": "robot", "content": "x"}]}, {}, {"prompt": "x", "add_special_tokens": 1}):
        route = "/detokenize" if "tokens" in bad else "/tokenize"
        out.append((route, json.dumps(bad).encode(), J))
    return out


def test_hostile_corpus_only_4xx(fuzz):
    server = fuzz["server"]
    corpus = hostile_corpus()
    assert len({(r, b, tuple(sorted(h.items()))) for r, b, h in corpus}) == len(corpus) > 140
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for route, raw, headers in corpus:
            fuzz["distinct"].add(("POST", route, raw, tuple(sorted(headers.items()))))
            check(fuzz, client.post(route, content=raw, headers=headers), (route, raw[:200], headers))


def raw_request(port: int, data: bytes, wait: float = 10.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as sock:
        sock.sendall(data)
        chunks = []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
                if b"\r\n\r\n" in b"".join(chunks) and b"}" in chunk:
                    break
        except TimeoutError:
            pass
    return b"".join(chunks)


def test_short_bodies_and_bad_lengths_get_4xx_and_free_the_connection(fuzz):
    server = fuzz["server"]
    auth = f"Authorization: Bearer {KEY}\r\n".encode()
    cases = [
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" + auth
        + b"Content-Length: 100\r\n\r\n{\"model\":",  # shorter than it says: 408 after the body timeout
        b"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" + auth
        + b"Content-Length: 50\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" + auth
        + b"Content-Length: abc\r\n\r\n{}",
    ]
    for data in cases:
        fuzz["distinct"].add(("RAW", data))
        t0 = time.monotonic()
        reply = raw_request(server.port, data)
        status = int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/1.1 ") else 0
        fuzz["statuses"][status] += 1
        assert 400 <= status < 500 and time.monotonic() - t0 < 8, (data[:80], reply[:200])


def test_after_the_fuzz_streams_were_unaffected_and_the_server_is_healthy(fuzz):
    server, streams = fuzz["server"], fuzz["streams"]
    deadline = time.monotonic() + 60
    while streams.runs < 4 and time.monotonic() < deadline:  # at least a few full streams ran
        time.sleep(0.1)
    streams.close()
    print("fuzz statuses:", dict(sorted(fuzz["statuses"].items())), "distinct requests:", len(fuzz["distinct"]),
          "concurrent streams:", streams.runs)
    assert not streams.failures, streams.failures[:3]
    assert streams.runs >= 4
    assert len(fuzz["distinct"]) >= 1000
    with httpx.Client(base_url=server.url, timeout=30) as client:
        ok = client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["role"] == "assistant"
        assert client.get("/health").json()["status"] == "ok"
        samples = parse(client.get("/metrics").text)
    assert not any('status="5' in k for k in samples), samples
