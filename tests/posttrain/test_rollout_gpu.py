"""The rollout claims on CUDA (Triton kernels; decode eager and CUDA-graphed): interrupt/resume = uninterrupted
greedy run with no prefill on resume, and replayed routing reproduces the rollout's log-probabilities — also when
the routing was recorded from graph replays (the hook's buffer writes are captured with the step)."""

from __future__ import annotations

import pytest
import torch
from tests.conftest import engine_test_model
from tests.posttrain.test_rollout import _prompts, _run

from dsv41.engine.engine import Engine
from dsv41.posttrain.grpo import token_logprobs
from dsv41.posttrain.rollout import Group, Rollouts, Sample, replay_routing, training_batch

pytestmark = pytest.mark.gpu


def test_interrupt_resume_on_cuda():
    model = engine_test_model(21).cuda()
    prompts = _prompts(3, 21)
    reference, _, _ = _run(model, prompts, 24)
    resumed, prefills, forwards = _run(model, prompts, 24, interrupt_at=9)
    assert [s.tokens for s in reference] == [s.tokens for s in resumed]
    assert prefills == 0 and forwards == 0


@pytest.mark.parametrize("graphs", [False, True])
def test_routing_replay_on_cuda(graphs):
    model = engine_test_model(22).cuda()
    engine = Engine(model, max_batch=4, cuda_graphs=graphs)
    ro = Rollouts(engine, stop_ids=(10,), temperature=1.0)
    samples = [Sample(i, Group(0, "t", 3), 50, p, 16, seed=i) for i, p in enumerate(_prompts(3, 22))]
    for s in samples:
        ro.submit(s)
    while ro.in_flight:
        ro.step()
    ro.close()
    batch = training_batch(samples, 0, 4)
    with torch.no_grad(), replay_routing(model, batch.routing, batch.tokens.size(1)):
        logp = token_logprobs(model(batch.tokens.cuda()), batch.targets.cuda()).cpu()
    err = (logp - batch.logp_behaviour)[batch.mask].abs().max().item()
    print(f"replayed training forward vs rollout log-probs on CUDA: max err {err:.2e}")
    assert err < 2e-3
