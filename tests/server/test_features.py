"""What users of OpenAI-compatible servers expect (issue 17, acceptance 6), through the official `openai` client and
checked against values computed directly from the engine: logprobs (chat and completions), n > 1, /tokenize and
/detokenize, tool calls parsed from the chat template's tool-call tokens (forced through the sampler) and tool
results rendered back."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
from tests.server.conftest import MODEL_NAME

import dsv41.engine.engine as engine_module
from dsv41.engine.engine import Engine
from dsv41.server.detokenize import TextStream, TokenText
from dsv41.train.tokenizer import TOOL_CALL_BEGIN, TOOL_CALL_END

KEY = "features-key"
PROMPT = "Once upon a time, in a quiet village by the sea,"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
FORCE_SEED = 424242  # requests with this seed get the scripted tokens below


@pytest.fixture(scope="module")
def server(start_server, tiny):
    return start_server(api_key=KEY, max_batch=4)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=60)


def reference(model, prompt_ids: list[int], n: int, stop_ids: list[int],
              **sampling) -> tuple[list[int], list[torch.Tensor]]:
    """Tokens (greedy, or sampled with a seed) and each step's fp64 log-softmax, straight from an engine."""
    engine, steps = Engine(model), []
    original = engine._emit

    def capture(reqs, logits, *sampled, **kw):
        steps.append(torch.log_softmax(logits[0].double(), dim=-1))
        return original(reqs, logits, *sampled, **kw)

    engine._emit = capture
    return engine.generate([prompt_ids], max_tokens=n, stop_token_ids=stop_ids, **sampling)[0], steps


def test_completion_logprobs_equal_the_engine(client, tiny):
    model, tok = tiny
    text = TokenText(tok)
    ids = tok.encode(PROMPT, add_bos=True)
    # sampled (seeded), so the chosen tokens are not all the most likely ones
    tokens, steps = reference(model, ids, 8, [tok.eos_id], temperature=1.5, seed=5)
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=1.5, seed=5, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(tokens)
    assert any(steps[i][t] < steps[i].max() for i, t in enumerate(tokens))
    for i, t in enumerate(tokens):
        assert abs(lp.token_logprobs[i] - steps[i][t].item()) < 1e-4, (i, lp.token_logprobs[i], steps[i][t].item())
        best = torch.topk(steps[i], 3).indices.tolist()
        expected: dict[str, float] = {}
        for b in best:  # descending: the first id with a given text carries it
            expected.setdefault(text.token_str(b), steps[i][b].item())
        got = lp.top_logprobs[i]
        assert got.keys() == expected.keys() and all(abs(got[k] - v) < 1e-4 for k, v in expected.items())
    assert "".join(lp.tokens) == r.choices[0].text and lp.text_offset[0] == 0


def test_chat_logprobs_and_top_logprobs_equal_the_engine(client, tiny):
    model, tok = tiny
    ids = tok.encode_chat(MESSAGES)
    tokens, steps = reference(model, ids, 5, [tok.eos_id, tok.end_turn_id])
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, temperature=0,
                                       logprobs=True, top_logprobs=4)
    content = r.choices[0].logprobs.content
    shown = [t for t in tokens if t >= 17]  # content tokens (markers carry no logprob entry)
    assert len(content) == len(shown)
    for entry, t in zip(content, shown):
        step = steps[tokens.index(t)]
        assert abs(entry.logprob - step[t].item()) < 1e-4
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
        top = torch.topk(step, 4)
        assert [round(x.logprob, 4) for x in entry.top_logprobs] == [round(v, 4) for v in top.values.tolist()]
    streamed = list(client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, temperature=0,
                                                   logprobs=True, stream=True))
    entries = [e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [round(e.logprob, 4) for e in entries] == [round(e.logprob, 4) for e in content]


def test_n_choices_each_their_own_sample(client, tiny):
    model, tok = tiny
    greedy = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0, n=3)
    assert [c.index for c in greedy.choices] == [0, 1, 2] and len({c.text for c in greedy.choices}) == 1
    ids = tok.encode(PROMPT, add_bos=True)
    assert greedy.choices[0].text == tok.decode(Engine(model).generate([ids], max_tokens=5,
                                                                       stop_token_ids=[tok.eos_id])[0], True)
    assert greedy.usage.prompt_tokens == len(ids) and greedy.usage.completion_tokens == 15
    kw = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=1.0, seed=7, n=2)
    a, b = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]  # reproducible
    single = client.chat.completions.create(**{**kw, "n": 1, "seed": 8})  # choice 1 is seeded seed + 1
    assert single.choices[0].message.content == a.choices[1].message.content
    chunks = list(client.chat.completions.create(**kw, stream=True))
    by_index = {0: "", 1: ""}
    for c in chunks:
        for ch in c.choices:
            by_index[ch.index] += ch.delta.content or ""
    assert [by_index[0], by_index[1]] == [c.message.content for c in a.choices]


def test_tokenize_and_detokenize_match_the_tokenizer(server, tiny):
    _, tok = tiny
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(server.url + "/tokenize", json={"model": MODEL_NAME, "prompt": PROMPT}, headers=auth).json()
    assert r["tokens"] == tok.encode(PROMPT, add_bos=True) and r["count"] == len(r["tokens"])
    r2 = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}, headers=auth)
    assert r2.json()["tokens"] == tok.encode(PROMPT)
    chat = httpx.post(server.url + "/tokenize", headers=auth, json={"messages": MESSAGES, "reasoning_effort": "high",
                                                                    "tools": TOOLS}).json()
    assert chat["tokens"] == tok.encode_chat(MESSAGES, reasoning_effort=75, tools=TOOLS)
    back = httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}, headers=auth).json()
    assert back["prompt"] == tok.decode(r["tokens"]) == "<bos>" + PROMPT
    assert httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).status_code == 401


@pytest.fixture
def forced(monkeypatch, tiny):
    """Requests seeded FORCE_SEED sample a scripted token sequence (the real engine runs; only the choice of
    token is replaced), so the server's tool-call parsing is tested on a model that never learned the format."""
    _, tok = tiny
    script: dict[str, list[int]] = {}
    real = engine_module.sample

    def sample(logits, params_list, generators):
        out = real(logits, params_list, generators)
        for i, p in enumerate(params_list):
            if p.seed == FORCE_SEED and script["left"]:
                out[i] = script["left"].pop(0)
        return out

    monkeypatch.setattr(engine_module, "sample", sample)

    def set_script(ids: list[int]) -> None:
        script["left"] = list(ids)

    return set_script


def tool_tokens(tok, text: str, calls: list[tuple[str, dict]]) -> list[int]:
    b, e = tok.special_ids[TOOL_CALL_BEGIN], tok.special_ids[TOOL_CALL_END]
    ids = tok.encode(text)
    for name, args in calls:
        ids += [b, *tok.encode(f"{name}\n{json.dumps(args)}"), e]
    return ids + [tok.end_turn_id]


def test_tool_calls_parsed_from_forced_tokens(client, tiny, forced):
    _, tok = tiny
    forced(tool_tokens(tok, "Let me check.", [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Rome"})]))
    r = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Weather?"}],
                                       tools=TOOLS, max_tokens=60, seed=FORCE_SEED, temperature=1.0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    calls = choice.message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "get_weather"]
    assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Oslo"}, {"city": "Rome"}]
    assert len({c.id for c in calls}) == 2

    forced(tool_tokens(tok, "", [("get_weather", {"city": "Oslo"})]))
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "W?"}],
                                                 tools=TOOLS, max_tokens=60, seed=FORCE_SEED, temperature=1.0,
                                                 stream=True))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert len(deltas) == 1 and deltas[0].function.name == "get_weather" and deltas[0].index == 0
    assert json.loads(deltas[0].function.arguments) == {"city": "Oslo"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"

    # the history goes back with the call and its result: rendered by the template, token for token
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": "Let me check.", "tool_calls": [
                   {"id": calls[0].id, "type": "function", "function": {"name": "get_weather",
                                                                        "arguments": calls[0].function.arguments}}]},
               {"role": "tool", "tool_call_id": calls[0].id, "content": '{"temp_c": 4}'}]
    r = client.chat.completions.create(model=MODEL_NAME, messages=history, tools=TOOLS, max_tokens=1, temperature=0)
    assert r.usage.prompt_tokens == len(tok.encode_chat(history, tools=TOOLS))
    # without tools offered, the same tokens are not calls (markers are dropped from the text)
    forced(tool_tokens(tok, "Hi", [("get_weather", {"city": "Oslo"})]))
    plain = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "W?"}],
                                           max_tokens=60, seed=FORCE_SEED, temperature=1.0)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason == "stop"


def test_tool_call_parser_on_token_sequences(tiny):
    _, tok = tiny
    b, e = tok.special_ids[TOOL_CALL_BEGIN], tok.special_ids[TOOL_CALL_END]
    cases = [  # (ids, content, calls)
        (tool_tokens(tok, "ok", [("f", {"a": 1})])[:-1], "ok", [("f", '{"a": 1}')]),
        (tok.encode("héllo") + [b] + tok.encode("g\n{}") + [e] + [b] + tok.encode("h") + [e], "héllo",
         [("g", "{}"), ("h", "{}")]),
        (tok.encode("x") + [b] + tok.encode("unfinished\n{"), "xunfinished\n{", []),  # no closing marker: text
    ]
    for ids, content, calls in cases:
        s = TextStream(tok, [], split_reasoning=True, parse_tools=True)
        got_text, got_calls = "", []
        for t in ids:
            d = s.feed(t)
            got_text += d.text.get("content", "")
            got_calls += [(c.name, c.arguments) for c in d.tool_calls]
        got_text += s.finish().text.get("content", "")
        assert (got_text, got_calls) == (content, calls)
