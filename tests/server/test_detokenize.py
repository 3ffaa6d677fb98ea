"""The streaming detokenizer alone (`server/detokenize.py`): deltas concatenate to the decoded output,
and a stop string is cut before anything of it is sent — also when it spans several tokens — against the
plain decode of the whole output."""

from __future__ import annotations

import random

import pytest

from dsv41.server.detokenize import TextStream
from dsv41.train.tokenizer import load_tokenizer

TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be "
        "in want of a wife. However little known the feelings or views of such a man may be on his first "
        "entering a neighbourhood, this truth is so well fixed in the minds of the surrounding families.")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def stream(tok, ids: list[int], stop: list[str]) -> tuple[list[str], TextStream]:
    s = TextStream(tok, stop, split_reasoning=False)
    deltas = [s.feed(t).text.get("content", "") for t in ids]
    deltas.append(s.finish().text.get("content", ""))
    return deltas, s


def test_deltas_concatenate_to_the_decoded_text(tok):
    ids = tok.encode(TEXT)
    deltas, _ = stream(tok, ids, [])
    assert "".join(deltas) == tok.decode(ids, skip_special=True)
    assert sum(1 for d in deltas if d) > len(ids) // 2  # it streams (not everything at the end)


def test_a_stop_string_spanning_tokens_is_never_sent_in_part(tok):
    ids = tok.encode(TEXT)
    text = tok.decode(ids, skip_special=True)
    rng = random.Random(0)
    multi = 0
    for _ in range(60):
        i, k = rng.randrange(1, len(text) - 8), rng.randrange(2, 8)
        stop = text[i:i + k]
        cut = text.find(stop)
        deltas, s = stream(tok, ids, [stop, "§never§"])
        sent = "".join(deltas)
        assert sent == text[:cut], (stop, sent[-20:], text[:cut][-20:])
        assert s.stopped
        # how many tokens the stop string spans (the hold-back matters when it is more than one)
        ends = [len(tok.decode(ids[:j], skip_special=True)) for j in range(len(ids) + 1)]
        multi += sum(cut < e < cut + len(stop) for e in ends) > 0
    assert multi >= 10  # many cases really straddle token boundaries
