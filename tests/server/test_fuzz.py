"""Fuzz: ≥ 500 malformed requests (broken JSON, random JSON, wrong types, missing fields, out-of-range and huge
numbers, unsupported options, bad headers, wrong routes) → only 4xx with an OpenAI error body; then a normal
request still succeeds and the server never answered 500."""

from __future__ import annotations

import json
from collections import Counter

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.server.conftest import MODEL_NAME

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
    "n": st.integers().filter(lambda n: n != 1) | not_int,
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
    "logprobs": st.integers(min_value=0, max_value=5) | st.integers(min_value=6), "suffix": st.text() | not_string,
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
    "logprobs": st.just(True) | st.integers(), "tools": st.lists(json_values, min_size=1, max_size=2),
    "response_format": st.just({"type": "json_object"}) | not_string,
}
KNOWN = set(COMPLETION_FIELDS) | set(CHAT_FIELDS) | {"user", "metadata", "store", "service_tier", "top_logprobs",
                                                     "tool_choice", "parallel_tool_calls"}


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


def test_fuzz_only_4xx_then_normal_request(start_server):
    server = start_server(api_key=KEY, max_batch=2)
    statuses: Counter[int] = Counter()
    client = httpx.Client(base_url=server.url, timeout=30)

    @settings(max_examples=560, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(st.one_of(mutated(), mutated(), garbage(), bad_headers(), wrong_route()))
    def one(case):
        route, raw, headers = case
        r = client.post(route, content=raw, headers=headers)
        statuses[r.status_code] += 1
        assert 400 <= r.status_code < 500, (route, raw[:300], r.status_code, r.text[:300])
        error = r.json()["error"]
        assert isinstance(error["message"], str) and error["type"], r.text

    one()
    for method in ("GET", "PUT", "DELETE"):  # wrong methods
        r = client.request(method, "/v1/chat/completions", headers=AUTH)
        statuses[r.status_code] += 1
        assert r.status_code == 405 and "error" in r.json()
    print("fuzz statuses:", dict(sorted(statuses.items())))
    assert sum(statuses.values()) >= 500

    ok = client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["role"] == "assistant"
    assert client.get("/health").json()["status"] == "ok"
    samples = parse(client.get("/metrics").text)
    assert not any('status="5' in k for k in samples), samples
    client.close()
