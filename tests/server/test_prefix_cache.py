"""The prefix cache through the server: a repeated request reports `prompt_tokens_details.cached_tokens` > 0
(and the same text as the cold run), /metrics counters move, and a follow-up turn with a different reasoning
effort still resumes from the conversation's cached prefix."""

from __future__ import annotations

import httpx
import pytest
from tests.server.conftest import MODEL_NAME

from dsv41.engine.prefix import PrefixCache
from dsv41.engine.prefix_store import InProcessSWAPool, PersistentStore
from dsv41.server.metrics import parse

LONG_PROMPT = ("The lighthouse keeper counted the ships that passed each night, writing their names in a ledger "
               "that had belonged to his grandfather, and wondered who would read it after him. Some nights the "
               "fog was so thick that he only heard the horns, and he wrote down the sounds instead of names, "
               "one line for every horn.")


@pytest.fixture(scope="module")
def server(start_server, tiny, tmp_path_factory):
    model, _ = tiny
    cache = PrefixCache(model.config, PersistentStore(tmp_path_factory.mktemp("kv")), InProcessSWAPool())
    return start_server(prefix_cache=cache, max_batch=2)


def metrics(server) -> dict[str, float]:
    return parse(httpx.get(server.url + "/metrics").text)


def test_repeat_reports_cached_tokens_and_metrics_move(server, tiny):
    _, tok = tiny
    req = {"model": MODEL_NAME, "prompt": LONG_PROMPT, "max_tokens": 4, "temperature": 0}
    assert len(tok.encode(LONG_PROMPT, add_bos=True)) > 2 * server.scheduler.engine.config.window_size
    before = metrics(server)
    cold = httpx.post(server.base_url + "/completions", json=req, timeout=60).json()
    warm = httpx.post(server.base_url + "/completions", json=req, timeout=60).json()
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < warm["usage"]["prompt_tokens"]
    after = metrics(server)
    assert after["dsv41_prefix_cache_hits_total"] - before["dsv41_prefix_cache_hits_total"] == 1
    assert after["dsv41_prefix_cache_lookups_total"] - before["dsv41_prefix_cache_lookups_total"] == 2
    assert after["dsv41_prefix_cached_tokens_total"] - before["dsv41_prefix_cached_tokens_total"] == cached
    assert after["dsv41_prompt_tokens_total"] - before["dsv41_prompt_tokens_total"] == 2 * warm["usage"][
        "prompt_tokens"]
    assert after["dsv41_time_to_first_token_seconds_count"] - before["dsv41_time_to_first_token_seconds_count"] == 2


def test_new_effort_on_the_next_turn_keeps_the_conversation_prefix(server):
    messages = [{"role": "system", "content": LONG_PROMPT}, {"role": "user", "content": "Who reads the ledger?"}]
    first = httpx.post(server.base_url + "/chat/completions", timeout=60, json={
        "model": MODEL_NAME, "messages": messages, "max_tokens": 4, "temperature": 0,
        "reasoning_effort": "high"}).json()
    reply = first["choices"][0]["message"]["content"]
    turn2 = messages + [{"role": "assistant", "content": reply, "reasoning_effort": "high"},
                        {"role": "user", "content": "And after that?"}]
    second = httpx.post(server.base_url + "/chat/completions", timeout=60, json={
        "model": MODEL_NAME, "messages": turn2, "max_tokens": 4, "temperature": 0, "reasoning_effort": 20}).json()
    # the whole first prompt (system + user + its effort line + <|assistant|>) is reused, up to unit alignment
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= first["usage"]["prompt_tokens"] - 2, (cached, first["usage"])
