"""Tokenizer: fixed special ids, lossless round trip, deterministic training, chat template with the
reasoning-effort turn, and the Engram compressed-token map."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv41.train.tokenizer import (
    DATA_DIR,
    EFFORT_LINE,
    SPECIAL_TOKENS,
    Tok,
    apply_chat_template,
    build_compressed_token_map,
    load_tokenizer,
    train_tokenizer,
)


@pytest.fixture(scope="module")
def tok() -> Tok:
    return load_tokenizer()  # the shipped data/tokenizer.json, never retrained here


@pytest.fixture(scope="module")
def sample_texts() -> list[str]:
    return [json.loads(line)["text"] for path in sorted((DATA_DIR / "sample").glob("*.jsonl"))
            for line in path.open(encoding="utf-8")]


def test_special_ids_fixed(tok):
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.tokenizer.token_to_id(t) == i, t
        assert tok.special_ids[t] == i
    assert tok.vocab_size == 16384
    ids = tok.encode("abc", add_bos=True, add_eos=True)
    assert ids[0] == 0 and ids[-1] == 1 and ids[1:-1] == tok.encode("abc")


@settings(max_examples=150, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=200))
def test_roundtrip_random_unicode(tok, s):
    ids = tok.encode(s)
    assert tok.decode(ids) == s
    assert all(i >= len(SPECIAL_TOKENS) for i in ids)  # literal text never yields control tokens


def test_roundtrip_corpus_lines(tok, sample_texts):
    rng = random.Random(0)
    lines = [ln for t in sample_texts for ln in t.split("\n") if ln]
    for line in rng.sample(lines, 500):
        assert tok.decode(tok.encode(line)) == line
    doc = sample_texts[rng.randrange(len(sample_texts))]
    assert tok.decode(tok.encode(doc)) == doc


def test_special_tokens_literal_vs_allowed(tok):
    s = "<|user|>hi<eos><image>"
    assert tok.decode(tok.encode(s)) == s
    assert 1 not in tok.encode(s) and 8 not in tok.encode(s)
    assert tok.encode(s, allow_special=True) == [8, *tok.encode("hi"), 1, 3]


def test_training_is_deterministic(sample_texts):
    texts = sample_texts[::10]  # ~0.3 MB keeps this fast
    a, b = train_tokenizer(texts, vocab_size=1024), train_tokenizer(texts, vocab_size=1024)
    assert a.to_str() == b.to_str()
    assert a.get_vocab_size() == 1024
    assert [a.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))


def _conversation() -> list[dict]:
    return [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "7", "reasoning_content": "small one", "reasoning_effort": 50},
        {"role": "user", "content": "Another?"},
    ]


def test_chat_template_format():
    text = apply_chat_template(_conversation(), reasoning_effort=75)
    effort50 = "<|system|>" + EFFORT_LINE.format(b=50) + "<|end|>"
    effort75 = "<|system|>" + EFFORT_LINE.format(b=75) + "<|end|>"
    assert text == (
        "<bos><|system|>You are terse.<|end|><|user|>Name a prime.<|end|>"
        + effort50 + "<|assistant|><think>small one</think>7<|end|><|user|>Another?<|end|>"
        + effort75 + "<|assistant|>"
    )
    assert EFFORT_LINE.format(b=75) == (
        "Reasoning Effort: 75 (range 1–100; higher values request more thorough reasoning)")
    assert apply_chat_template(_conversation()).endswith("<|user|>Another?<|end|><|assistant|>")
    with pytest.raises(ValueError):
        apply_chat_template(_conversation(), reasoning_effort=0)
    with pytest.raises(ValueError):
        apply_chat_template([{"role": "robot", "content": "x"}])


def test_effort_change_keeps_cached_prefix(tok):
    """Changing the effort changes only tokens after the last user turn, and a finished turn
    replayed with its effort extends the prompt it was generated from token for token."""
    msgs = _conversation()
    history = tok.encode_chat(msgs, add_generation_prompt=False)
    lo, hi = tok.encode_chat(msgs, reasoning_effort=10), tok.encode_chat(msgs, reasoning_effort=100)
    assert lo[:len(history)] == history and hi[:len(history)] == history
    prompt = tok.encode_chat(msgs, reasoning_effort=90)
    reply = {"role": "assistant", "content": "11", "reasoning_effort": 90}
    follow_up = tok.encode_chat([*msgs, reply, {"role": "user", "content": "More"}], reasoning_effort=20)
    assert follow_up[:len(prompt)] == prompt


def test_compressed_token_map(tok):
    lookup, size = build_compressed_token_map(tok)
    assert len(lookup) == tok.vocab_size
    assert 0 < size < tok.vocab_size
    assert set(lookup) == set(range(size))  # ids dense, first-seen order
    assert lookup[:3] == [0, 1, 2]
    assert len({lookup[i] for i in range(len(SPECIAL_TOKENS))}) == len(SPECIAL_TOKENS)
    variants = ["The", "Ġthe", "the", "ĠThe", "THE", "ĠTHE"]  # byte-level: Ġ is the space byte
    ids = [tok.tokenizer.token_to_id(v) for v in variants]
    ids = [i for i in ids if i is not None]
    assert len(ids) >= 4 and len({lookup[i] for i in ids}) == 1
    # a lone continuation byte decodes to U+FFFD and keeps its own key (raw token string)
    partial = [i for i in range(len(SPECIAL_TOKENS), tok.vocab_size) if "\ufffd" in tok.decode([i])]
    assert partial and len({lookup[i] for i in partial}) == len(partial)
    assert build_compressed_token_map(tok) == (lookup, size)
