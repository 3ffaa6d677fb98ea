"""The scheduler's policy, step by step (`engine/scheduler.py`'s docstring), observed on a running engine: the
tests elsewhere check that every schedule gives the right tokens; these check which schedule it is — the token
and layer budgets, the batch bound, FIFO admission without overtaking, and who is preempted and where it goes."""

from __future__ import annotations

import pytest
import torch
from tests.conftest import engine_test_model

from dsv41.engine.engine import Engine
from dsv41.engine.sampling import SamplingParams


def record(engine: Engine) -> list[dict]:
    """Every ScheduledBatch the engine's scheduler returns, with the queue and the running set around it."""
    sched, steps = engine.scheduler, []
    schedule = sched.schedule

    def recorded():
        waiting_before = list(sched.waiting)
        running_before = list(sched.running)
        batch = schedule()
        steps.append(dict(batch=batch, waiting_before=waiting_before, running_before=running_before,
                          waiting_after=list(sched.waiting), running_after=list(sched.running)))
        return batch

    sched.schedule = recorded
    return steps


def drive(engine: Engine, arrivals: list[tuple[int, list[int], int]], max_steps: int = 2000) -> list:
    """Add (step, prompt, max_tokens) requests at their steps; step until all finish."""
    seqs, step = [], 0
    pending = sorted(arrivals, key=lambda a: a[0])
    while pending or any(not s.finished for s in seqs):
        while pending and pending[0][0] <= step:
            _, prompt, n = pending.pop(0)
            seqs.append(engine.add_request(prompt, SamplingParams(max_tokens=n)))
        engine.step()
        step += 1
        assert step < max_steps
    return seqs


def prompts(seed: int, lengths: list[int], vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("prefill_layers", [1, 2])
def test_budgets_bind_steps_with_decode_rows_and_idle_steps_run_pieces_whole(prefill_layers):
    """With streams decoding, a step's new tokens stay within token_budget (its decode rows count) and its prefill
    forwards within prefill_layers layer passes; a step without decode rows runs each new encoder run through
    all the encoder's layers at once; the running set never exceeds max_batch."""
    model = engine_test_model(61)
    c = model.config
    engine = Engine(model, max_batch=3, prefill_chunk=32, token_budget=20, prefill_layers=prefill_layers,
                    batch_prefill=False)  # chunks longer than the budget: the budget decides the pieces' tokens
    steps = record(engine)
    ps = prompts(61, [9, 7, 70, 45, 12], c.vocab_size)
    drive(engine, [(0, ps[0], 40), (0, ps[1], 40), (4, ps[2], 6), (5, ps[3], 6), (6, ps[4], 6)])
    busy = [s["batch"] for s in steps if s["batch"].decode]
    idle = [s["batch"] for s in steps if not s["batch"].decode and s["batch"].prefill]
    assert busy and idle and any(b.prefill for b in busy)  # pieces ran beside the streams
    assert max(b.n_tokens for b in busy) == 20  # the budget binds: decode rows + new piece tokens fill it
    for b in busy:
        assert b.n_tokens <= 20, (len(b.decode), [(p.tokens, p.new) for _, p in b.prefill])
        assert b.n_layer_passes <= prefill_layers
    for b in idle:
        for _, p in b.prefill:
            if p.new and p.kind == "encoder":
                assert p.layers == c.encoder_layers, p
    assert max(len(s["running_after"]) for s in steps) == 3  # full, never past it


@pytest.mark.parametrize("max_batch, max_tokens", [(3, 100), (4, 130)])
def test_admission_is_fifo_and_the_newest_running_sequence_is_preempted_to_the_head_of_the_queue(max_batch,
                                                                                                   max_tokens):
    """Tight pools and more requests than slots: admissions follow one FIFO queue — arrivals join its back, a
    preempted sequence goes back to its front — checked against a queue kept here from the arrivals and the
    preemptions alone; a preempted sequence is one with at most one running sequence admitted after it (the
    newest, unless the newest is the one that needs the page); no request fails for want of pages."""
    model = engine_test_model(43)
    engine = Engine(model, max_batch=max_batch, prefill_chunk=16, page_rows=4, max_seq_len=80, max_tokens=max_tokens)
    steps = record(engine)
    lengths, outputs = [30, 44, 21, 37, 26, 33], [18, 12, 20, 15, 16, 14]
    ps = prompts(43, lengths, model.config.vocab_size)
    seqs = drive(engine, [(i, p, n) for i, (p, n) in enumerate(zip(ps, outputs))])
    assert engine.stats.failures == 0 and [len(q.output) for q in seqs] == outputs
    queue: list[int] = []  # the FIFO as the policy defines it
    admitted_at: dict[int, int] = {}  # seq id → the step of its last admission
    preempted_with_others_waiting = 0
    for k, s in enumerate(steps):
        b = s["batch"]
        queue += [q.id for q in s["waiting_before"] if q.id not in queue]  # new arrivals, in arrival order
        for victim in b.preempted:
            later = [q for q in s["running_before"]
                     if q is not victim and admitted_at.get(q.id, -1) > admitted_at[victim.id]]
            assert len(later) <= 1, (k, victim.id, [q.id for q in later])
            preempted_with_others_waiting += bool(queue)
            queue.insert(0, victim.id)
        assert [q.id for q in b.admitted] == queue[:len(b.admitted)], (k, queue)
        del queue[:len(b.admitted)]
        for q in b.admitted:
            admitted_at[q.id] = k
    assert engine.stats.preemptions > 0 and preempted_with_others_waiting > 0
