"""Evaluation and SFT batches: queuing every (problem, effort) at once gives each request's own greedy reply,
a stage's 'before' is reused only when the checkpoint's stage evaluated the same way, and padding an SFT
batch to a length bucket changes no loss or gradient."""

from __future__ import annotations

import json

import pytest
import torch

from dsv41 import load_config
from dsv41.engine.engine import Engine
from dsv41.engine.sampling import SamplingParams
from dsv41.model.transformer import Transformer
from dsv41.posttrain import cli as post_cli
from dsv41.posttrain.common import clone_model, greedy_replies
from dsv41.posttrain.sft import sft_batch
from dsv41.posttrain.tasks import END_TURN_ID, generate, prompt_ids
from dsv41.train.tokenizer import PAD_ID, load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Transformer(load_config("tiny")).init_weights(seed=3).float()


def test_batched_evaluation_equals_one_request_at_a_time(tok, model):
    problems = generate(("add", "sort", "copy"), 5, (2, 3), seed=7)
    efforts = (25, 100)
    got = greedy_replies(model, tok, problems, efforts, max_tokens=7, max_batch=4)  # 10 requests, 4 rows
    params = SamplingParams(temperature=0.0, max_tokens=7, stop_token_ids=[END_TURN_ID])
    for b in efforts:
        for p, reply in zip(problems, got[b]):
            engine = Engine(clone_model(model), max_batch=1, max_seq_len=256)
            seq = engine.add_request(prompt_ids(tok, p, b), params)
            while engine.has_work():
                engine.step()
            assert reply == seq.output + ([END_TURN_ID] if seq.finish_reason == "stop" else []), (p, b)
    assert len({tuple(r) for rs in got.values() for r in rs}) > 1  # the replies differ: the check can fail


def test_before_is_reused_only_for_the_same_evaluation(tok, tmp_path, monkeypatch):
    held = generate(("add",), 3, 2, seed=1)
    args = type("A", (), {"efforts": [25, 100], "max_tokens": 8, "dtype": "fp32"})()
    calls = []
    monkeypatch.setattr(post_cli, "_evaluate", lambda *a: calls.append(1) or {25: {"accuracy": 0.0}})
    table = {"25": {"accuracy": 0.5, "reasoning_tokens": 3.0, "n": 3}}
    (tmp_path / "eval.json").write_text(json.dumps({"after": table, "eval_key": post_cli._eval_key(held, args)}))
    assert post_cli._evaluate_checkpoint(None, tok, held, args, tmp_path) == {25: table["25"]} and not calls
    other = type("A", (), {"efforts": [25, 100], "max_tokens": 9, "dtype": "fp32"})()  # another token limit
    assert post_cli._evaluate_checkpoint(None, tok, held, other, tmp_path) == {25: {"accuracy": 0.0}}
    bf16 = type("A", (), {"efforts": [25, 100], "max_tokens": 8, "dtype": "bf16"})()  # another engine dtype
    assert post_cli._evaluate_checkpoint(None, tok, held, bf16, tmp_path) == {25: {"accuracy": 0.0}}
    assert post_cli._evaluate_checkpoint(None, tok, held[:2], args, tmp_path) == {25: {"accuracy": 0.0}}
    (tmp_path / "eval.json").write_text("{not json")
    assert post_cli._evaluate_checkpoint(None, tok, held, args, tmp_path) == {25: {"accuracy": 0.0}}
    (tmp_path / "eval.json").write_text("[1, 2]")  # JSON, but not a stage's record
    assert post_cli._evaluate_checkpoint(None, tok, held, args, tmp_path) == {25: {"accuracy": 0.0}}
    assert post_cli._evaluate_checkpoint(None, tok, held, args, None) == {25: {"accuracy": 0.0}}
    assert len(calls) == 6


@pytest.mark.parametrize("attention", ["sparse", "dense"])
def test_padding_an_sft_batch_changes_no_loss_or_gradient(tok, model, attention):
    """Also the indexer KL's: padding queries used to enter its mean (and train the indexer) on both paths."""
    problems = generate(("add", "mul", "copy"), 4, (2, 4), seed=3)
    efforts = [25, 50, 75, 100]
    results = []
    for multiple in (1, 32):
        batch = sft_batch(tok, problems, efforts, pad_multiple=multiple)
        T = batch["tokens"].size(1)
        assert T % multiple == 0
        m = clone_model(model).train()
        out = m.losses(batch["tokens"], batch["targets"], loss_mask=batch["loss_mask"],
                       token_mask=batch["tokens"] != PAD_ID, attention=attention)
        out.total.backward()
        grads = {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None}
        results.append((T, float(out.lm.detach()), float(out.indexer.detach()), grads))
    (t1, lm1, tot1, g1), (t32, lm32, tot32, g32) = results
    assert t32 > t1  # the bucket really added padding
    assert lm32 == pytest.approx(lm1, rel=1e-6) and tot32 == pytest.approx(tot1, rel=1e-6) and tot1 > 0
    assert g1.keys() == g32.keys()
    for name in g1:
        torch.testing.assert_close(g32[name], g1[name], rtol=1e-5, atol=1e-7, msg=name)
    with pytest.raises(ValueError):
        sft_batch(tok, problems, efforts, pad_multiple=0)


def test_max_seconds_stops_sft_and_the_loop_after_whole_steps(tok, model, tmp_path, monkeypatch):
    """A time budget ends training at a step boundary: SFT after its first step (the budget is already spent),
    the loop before its first update; without one both run their step counts."""
    from dsv41.posttrain.common import Metrics
    from dsv41.posttrain.loop import AsyncLoop, LoopConfig
    from dsv41.posttrain.sft import SFTConfig, train_sft

    problems = generate(("add",), 16, 2, seed=4)
    for budget, expected in ((1e-9, 1), (0.0, 3)):
        m = clone_model(model)
        losses = train_sft(m, tok, problems, SFTConfig(steps=3, batch_size=2, max_seconds=budget),
                           Metrics(tmp_path / f"sft{expected}.jsonl"))
        assert len(losses) == expected
    assert json.loads((tmp_path / "sft1.jsonl").read_text().splitlines()[-1])["stopped"] == "max_seconds"
    for budget, expected in ((1e-9, 0), (0.0, 1)):
        cfg = LoopConfig(steps=1, prompts_per_step=1, samples_per_effort=1, efforts=(25,), max_tokens=3,
                         max_in_flight=2, max_staleness=8, max_offpolicy=1.0, max_seconds=budget)
        loop = AsyncLoop(clone_model(model), tok, problems, cfg)
        records = loop.run(lambda samples, version: {})
        loop.close()
        assert len(records) == expected and ("stopped_at_max_seconds" in loop.counters) == (expected == 0)
