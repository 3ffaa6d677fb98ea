"""Every request field's range, at both ends: the last value OpenAI's API reference allows parses, the first one
past it is a 400 whose `param` names the field (`server/protocol.py`; what a client that validates against
OpenAI's limits expects). Parsing only: what the engine does with an accepted value is tested elsewhere."""

from __future__ import annotations

import pytest

from dsv41.server.protocol import MAX_N, APIError, ChatCompletionRequest, CompletionRequest, parse_request

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}

# (endpoint, field, the last value allowed, the first value past it, extra fields both need)
BOUNDS = [
    ("chat", "temperature", 2, 2.001, {}),
    ("chat", "temperature", 0, -0.001, {}),
    ("chat", "top_p", 1, 1.001, {}),
    ("chat", "top_p", 1e-9, 0, {}),  # top_p = 0 keeps nothing: OpenAI's range is (0, 1]
    ("chat", "max_tokens", 1, 0, {}),
    ("chat", "max_completion_tokens", 1, 0, {}),
    ("chat", "top_k", 0, -1, {}),  # extension: 0 = off
    ("chat", "n", MAX_N, MAX_N + 1, {}),
    ("chat", "n", 1, 0, {}),
    ("chat", "stop", ["a", "b", "c", "d"], ["a", "b", "c", "d", "e"], {}),  # up to 4 stop sequences
    ("chat", "stop", "a", "", {}),
    ("chat", "top_logprobs", 20, 21, {"logprobs": True}),
    ("chat", "top_logprobs", 0, -1, {"logprobs": True}),
    ("chat", "reasoning_effort", 100, 101, {}),
    ("chat", "reasoning_effort", 1, 0, {}),
    ("chat", "reasoning_effort", "max", "maximum", {}),
    ("chat", "cache_salt", "s" * 256, "s" * 257, {}),
    ("chat", "cache_salt", "s", "", {}),
    ("chat", "messages", CHAT["messages"], [], {}),
    ("completion", "logprobs", 5, 6, {}),  # the legacy endpoint's limit
    ("completion", "best_of", 1, 0, {}),
    ("completion", "prompt", [0, 5], [0, -1], {}),  # token ids are >= 0
    ("completion", "prompt", [5], [], {}),
]


def _parse(endpoint: str, fields: dict):
    cls, base = (ChatCompletionRequest, CHAT) if endpoint == "chat" else (CompletionRequest, COMPLETION)
    return parse_request(cls, {**base, **fields})


@pytest.mark.parametrize("endpoint, field, ok, bad, extra", BOUNDS,
                         ids=[f"{e}-{f}-{b!r}"[:60] for e, f, _, b, _ in BOUNDS])
def test_the_last_allowed_value_parses_and_the_next_is_a_400_naming_the_field(endpoint, field, ok, bad, extra):
    value = getattr(_parse(endpoint, {field: ok, **extra}), field)
    assert len(value) == len(ok) if field == "messages" else value == ok
    with pytest.raises(APIError) as err:
        _parse(endpoint, {field: bad, **extra})
    assert err.value.status == 400
    assert (err.value.param or "").split(".")[0] == field, err.value.body()


@pytest.mark.parametrize("fields, param, fix", [
    ({"top_logprobs": 3}, "top_logprobs", {"logprobs": True}),
    ({"top_logprobs": 3, "logprobs": False}, "top_logprobs", {"logprobs": True}),
    ({"stream_options": {"include_usage": True}}, "stream_options", {"stream": True}),
    ({"stream_options": {"include_usage": True}, "stream": False}, "stream_options", {"stream": True}),
    ({"presence_penalty": 0.5}, "presence_penalty", {"presence_penalty": 0}),
    ({"logit_bias": {"5": 1.0}}, "logit_bias", {"logit_bias": {}}),
])
def test_fields_that_need_another_or_are_not_implemented_are_a_400_naming_them(fields, param, fix):
    """top_logprobs needs logprobs=true, stream_options needs stream=true (OpenAI's rules); penalties and logit_bias
    are refused rather than ignored. With `fix` applied the same request parses."""
    with pytest.raises(APIError) as err:
        _parse("chat", fields)
    assert err.value.status == 400 and err.value.param == param
    _parse("chat", {**fields, **fix})
