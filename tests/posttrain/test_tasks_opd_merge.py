"""Tasks (answers, verifier, format), OPD's reverse KL against fp64, merging against a hand average, SFT masks."""

from __future__ import annotations

import random

import pytest
import torch

from dsv41.posttrain.merge import merge_state_dicts
from dsv41.posttrain.opd import Teachers, reverse_kl
from dsv41.posttrain.sft import sft_batch
from dsv41.posttrain.tasks import (
    END_TURN_ID,
    FAMILIES,
    effort_level,
    generate,
    make_problem,
    prompt_ids,
    reasoning,
    reasoning_length,
    sft_example,
    verify,
)
from dsv41.train.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def test_answers_are_exact_and_the_verifier_reads_the_reply(tok):
    rng = random.Random(0)
    for _ in range(50):
        a = make_problem("add", rng.randint(1, 6), rng)
        x, y = (int(part.replace(" ", "")) for part in a.question[4:].split(" + "))
        assert a.answer.replace(" ", "") == str(x + y)
        m = make_problem("mul", 4, rng)
        x, y = (int(part.replace(" ", "")) for part in m.question[4:].split(" * "))
        assert m.answer.replace(" ", "") == str(x * y)
        s = make_problem("sort", 7, rng)
        assert s.answer.split() == sorted(s.question.split()[1:])
        c = make_problem("copy", 5, rng)
        ds = [int(v) for v in c.question.split()[1:]]
        assert c.answer == " ".join(map(str, ds)) + f" # {sum(ds) % 10}"
    p = make_problem("add", 3, random.Random(1))
    for b in (25, 50, 75, 100):
        ids, n_prompt = sft_example(tok, p, b)
        assert ids[:n_prompt] == prompt_ids(tok, p, b)
        reply = ids[n_prompt:]
        assert verify(tok, p, reply) and reply[-1] == END_TURN_ID
        assert reasoning_length(tok, reply) == len(tok.encode(reasoning(p, effort_level(b))))
        wrong = tok.encode_chat([{"role": "assistant", "content": p.answer + " 1", "reasoning_content": "x"}],
                                add_generation_prompt=False)[2:]
        assert not verify(tok, p, wrong)
    assert not verify(tok, p, tok.encode(p.answer))  # no </think>: not an answer
    lengths = [len(reasoning(p, level)) for level in range(4)]
    assert lengths == sorted(lengths) and lengths[0] == 0 < lengths[3]
    assert {q.family for q in generate(FAMILIES, 8, (2, 4), seed=0)} == set(FAMILIES)


def test_sft_mask_covers_the_reply_only(tok):
    ps = generate(["add", "copy"], 2, 3, seed=2)
    batch = sft_batch(tok, ps, [25, 100])
    for b, (p, e) in enumerate(zip(ps, [25, 100])):
        ids, n_prompt = sft_example(tok, p, e)
        picked = batch["targets"][b][batch["loss_mask"][b]].tolist()
        assert picked == ids[n_prompt:]


def test_reverse_kl_equals_an_fp64_formula():
    g = torch.Generator().manual_seed(4)
    B, T, V = 2, 5, 37
    s = torch.randn(B, T, V, generator=g) * 2
    t = torch.randn(B, T, V, generator=g) * 2
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 1, 1, 1, 1]], dtype=torch.bool)
    got = reverse_kl(s, t, mask)
    total, n = 0.0, 0
    for b in range(B):
        for i in range(T):
            if mask[b, i]:
                ps = s[b, i].double().softmax(-1)
                pt = t[b, i].double().softmax(-1)
                total += float((ps * (ps.log() - pt.log())).sum())
                n += 1
    assert float(got) == pytest.approx(total / n, rel=1e-5)  # fp32 log-softmax; measured ~1e-7
    assert float(reverse_kl(s, s, mask)) == pytest.approx(0.0, abs=1e-6)
    # the reverse direction, not the forward one
    forward = (t.softmax(-1) * (t.log_softmax(-1) - s.log_softmax(-1))).sum(-1)[mask].mean()
    assert abs(float(forward) - float(got)) > 1e-3


class _Fixed(torch.nn.Module):
    def __init__(self, logits):
        super().__init__()
        self.logits = logits

    def forward(self, tokens):
        return self.logits[: tokens.size(0)]


def test_teacher_switch_changes_the_target():
    g = torch.Generator().manual_seed(5)
    B, T, V = 3, 4, 11
    student = torch.randn(B, T, V, generator=g)
    la, lb = torch.randn(B, T, V, generator=g), torch.randn(B, T, V, generator=g)
    teachers = Teachers({"a": _Fixed(la), "b": _Fixed(lb)}, {"*": ["a"]})
    tokens, mask = torch.zeros(B, T, dtype=torch.long), torch.ones(B, T, dtype=torch.bool)
    before = teachers.loss(student, tokens, mask, ["add"] * B)
    assert float(before) == pytest.approx(float(reverse_kl(student, la, mask)), rel=1e-6)
    assert teachers.switch({"*": ["b"]}) == 1
    after = teachers.loss(student, tokens, mask, ["add"] * B)
    assert float(after) == pytest.approx(float(reverse_kl(student, lb, mask)), rel=1e-6)
    teachers.switch({"*": ["a", "b"]})
    both = teachers.loss(student, tokens, mask, ["add"] * B)
    assert float(both) == pytest.approx((float(before) + float(after)) / 2, rel=1e-6)
    with pytest.raises(ValueError):
        teachers.switch({"*": ["c"]})


def test_merge_is_the_weighted_average():
    g = torch.Generator().manual_seed(6)
    states = [{"w": torch.randn(3, 4, generator=g), "n": torch.tensor([1, 2])} for _ in range(3)]
    out = merge_state_dicts(states, [1.0, 2.0, 1.0])
    hand = (states[0]["w"] + 2 * states[1]["w"] + states[2]["w"]) / 4
    assert torch.allclose(out["w"], hand, atol=1e-6)
    assert torch.equal(out["n"], torch.tensor([1, 2]))
    assert torch.allclose(merge_state_dicts(states)["w"], sum(s["w"] for s in states) / 3, atol=1e-6)
    with pytest.raises(ValueError):
        merge_state_dicts(states, [1.0, 1.0])
    with pytest.raises(ValueError):
        merge_state_dicts([states[0], {"w": states[1]["w"], "n": torch.tensor([1, 3])}])
