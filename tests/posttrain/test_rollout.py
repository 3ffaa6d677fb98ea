"""Asynchronous rollouts: interrupt/resume without re-prefill, routing replay, staleness masking, the
off-policy cap in a simulated run, and the three dispatch rules on a scripted timeline."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from tests.conftest import engine_test_model

from dsv41.engine.engine import Engine
from dsv41.posttrain.grpo import ClipConfig, grpo_loss, token_logprobs
from dsv41.posttrain.rollout import (
    Dispatcher,
    Group,
    Rollouts,
    Sample,
    offpolicy_ratio,
    replay_routing,
    select_groups,
    staleness_mask,
    training_batch,
)


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(17, 16000, (15 + 9 * i,), generator=g).tolist() for i in range(n)]


def _run(model, prompts, max_tokens, interrupt_at=None, seed=0):
    """Greedy rollouts of `prompts`; optionally interrupt once when sample 0 has `interrupt_at` tokens, push the
    same weights back in (a training step that changed nothing) and resume. Returns (samples, prefill calls
    after the resume, runner.forward calls after the resume)."""
    engine = Engine(model, max_batch=4, cuda_graphs=False)
    ro = Rollouts(engine, stop_ids=(10,), temperature=0.0)
    group = Group(0, "t", len(prompts))
    samples = [Sample(i, group, 50, p, max_tokens) for i, p in enumerate(prompts)]
    for s in samples:
        ro.submit(s)
    calls = []
    original = engine.runner.forward
    engine.runner.forward = lambda *a, **k: (calls.append(1), original(*a, **k))[1]
    after = None
    while ro.in_flight:
        ro.step()
        if interrupt_at is not None and after is None and len(samples[0].tokens) == interrupt_at:
            assert ro.interrupt() == len(prompts)
            assert not engine.scheduler.running
            state = {k: v.clone() for k, v in model.state_dict().items()}
            ro.load_weights(state, version=1)
            after = (engine.stats.prefill_pieces, len(calls))
            ro.resume()
    ro.close()
    if after is None:
        return samples, 0, 0
    return samples, engine.stats.prefill_pieces - after[0], len(calls) - after[1]


def test_interrupted_and_resumed_sample_equals_uninterrupted_run_without_prefill():
    model = engine_test_model(11)
    prompts = _prompts(3, 11)
    reference, _, _ = _run(model, prompts, 16)
    cut = random.Random(11).randint(1, 14)  # a random token of sample 0
    resumed, prefills, forwards = _run(model, prompts, 16, interrupt_at=cut)
    for a, b in zip(reference, resumed):
        assert a.tokens == b.tokens, f"cut at {cut}: {a.tokens} vs {b.tokens}"
    assert prefills == 0 and forwards == 0, f"resume ran {prefills} prefill pieces / {forwards} host forwards"
    # every token after the cut carries the new version tag, every one before it the old
    assert resumed[0].versions == [0] * cut + [1] * (len(resumed[0].tokens) - cut)


def test_training_forward_with_replayed_routing_equals_the_rollout_forward():
    model = engine_test_model(12)
    engine = Engine(model, max_batch=4, cuda_graphs=False)
    ro = Rollouts(engine, stop_ids=(10,), temperature=1.0)
    group = Group(0, "t", 2)
    samples = [Sample(i, group, 50, p, 10, seed=i) for i, p in enumerate(_prompts(2, 12))]
    for s in samples:
        ro.submit(s)
    while ro.in_flight:
        ro.step()
    ro.close()
    batch = training_batch(samples, current=0, max_staleness=4)
    # the trainer's copy with different selection biases: its own routing differs from the rollout's
    trainer = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    for moe in trainer.moe_layers():
        moe.gate.bias.add_(torch.randn(moe.gate.bias.shape, generator=g))
    T = batch.tokens.size(1)
    seen = []
    with torch.no_grad():
        with replay_routing(trainer, batch.routing, T):
            replayed = token_logprobs(trainer(batch.tokens), batch.targets)
        own = token_logprobs(trainer(batch.tokens), batch.targets)
        for moe in trainer.moe_layers():  # the trainer's own choice at the recorded positions
            moe.gate.route_hook = lambda idx: (seen.append(idx.clone()), idx)[1]
        trainer(batch.tokens)
    err = (replayed - batch.logp_behaviour)[batch.mask].abs().max().item()
    assert err < 1e-4, f"replayed training forward vs rollout log-probs: max err {err:.2e}"  # measured 1e-6
    diff = (own - batch.logp_behaviour)[batch.mask].abs().max().item()
    assert diff > 1e-2, f"without replay the changed routing should show ({diff:.2e})"
    differs = 0
    for layer, ids in enumerate(seen):  # (B·T, k) per MoE layer
        own_ids = ids.view(len(samples), T, -1)
        for b, s in enumerate(samples):
            n = len(s.prompt) + len(s.tokens) - 1  # positions the rollout ran (the last token never was)
            recorded = batch.routing[b][layer][:n]
            assert (recorded >= 0).all(), f"layer {layer} sample {b}: positions without recorded ids"
            differs += int((own_ids[b, :n] != recorded).any(-1).sum())
    assert differs > 0


def test_tokens_beyond_the_staleness_cap_get_zero_loss():
    g = torch.Generator().manual_seed(3)
    group = Group(0, "t", 2)
    current, cap = 7, 2
    samples = []
    for i, versions in enumerate([[3, 4, 5, 5, 6, 7], [5, 6, 6, 7]]):
        n = len(versions)
        s = Sample(i, group, 50, torch.randint(17, 99, (4 + i,), generator=g).tolist(), n)
        s.tokens = torch.randint(17, 99, (n,), generator=g).tolist()
        s.logprobs = (-torch.rand(n, generator=g)).tolist()
        s.versions = versions
        samples.append(s)
    batch = training_batch(samples, current, cap)
    for b, s in enumerate(samples):  # by hand: target j of the reply sits at position len(prompt) − 1 + j
        p = len(s.prompt)
        want = [current - v <= cap for v in s.versions]
        assert batch.mask[b, p - 1:p - 1 + len(want)].tolist() == want
        assert not batch.mask[b, :p - 1].any() and not batch.mask[b, p - 1 + len(want):].any()
    logp = (batch.logp_behaviour + 0.1 * torch.randn(batch.mask.shape, generator=g)).requires_grad_()
    loss, _ = grpo_loss(logp, batch.logp_behaviour, torch.tensor([1.0, -0.5]), batch.mask, ClipConfig(0.9, 0.9))
    loss.backward()
    assert (logp.grad[~batch.mask] == 0).all()
    assert (logp.grad[batch.mask] != 0).all()
    assert staleness_mask(torch.tensor([4, 5, 6]), 7, 2).tolist() == [False, True, True]


def test_offpolicy_cap_is_never_exceeded_in_a_simulated_run():
    rng = random.Random(5)
    group = Group(0, "t", 1)
    cap, staleness, version = 0.4, 3, 0
    ready: list[list[Sample]] = []
    uid = 0
    trained = 0
    for _ in range(300):  # groups finish with tokens sampled across 0..3 weight updates
        for _ in range(rng.randint(0, 3)):
            n = rng.randint(1, 40)
            start = max(0, version - rng.choice([0, 0, 0, 1, 2, 5]))
            cuts = sorted(rng.randint(0, n) for _ in range(version - start))
            versions = [start + sum(c <= j for c in cuts) for j in range(n)]
            s = Sample(uid, group, 50, [1], n)
            s.versions = versions
            uid += 1
            ready.append([s])
        chosen, ready, dropped = select_groups(ready, 4, version, cap, staleness)
        batch = [s for g in chosen for s in g]
        assert offpolicy_ratio(batch, version) <= cap + 1e-12
        for g in dropped:
            assert all(version - v > staleness for s in g for v in s.versions)
        if batch:
            trained += 1
            version += 1
    assert trained > 100  # the cap still lets training go on


def _timeline(mode: str, events: list[int]):
    """Groups of sizes 4, 2, 3, 2, 4 (datasets a/b), cap 8; samples finish one at a time: `events` names the
    group of each finished sample (a script valid for the mode: only dispatched groups finish)."""
    groups = [Group(0, "a", 4), Group(1, "b", 2), Group(2, "a", 3), Group(3, "b", 2), Group(4, "a", 4)]
    d = Dispatcher(groups, mode, max_in_flight=8, batch_prompts=2)
    started = [g.id for g in d.start()]
    after = [[g.id for g in d.finished(groups[gid])] for gid in events]
    assert d.in_flight == 0 and not d.queue
    return started, after


def test_dispatch_order_follows_each_rule_on_a_scripted_timeline():
    # start (every rule): 4 + 2 fit in 8, group 2 would make 9.
    # sample rule: dispatch the next prompt when the samples finished since the last dispatch reach its group
    # size: group 2 (3) after events 1-3, group 3 (2) after events 4-5, group 4 (4) after events 6-9.
    started, after = _timeline("sample", [0, 1, 1, 0, 2, 0, 3, 0, 2, 3, 2, 4, 4, 4, 4])
    assert started == [0, 1]
    assert after == [[], [], [2], [], [3], [], [], [], [4], [], [], [], [], [], []]
    # prompt rule: one new prompt per whole finished group: group 1 ends at event 3, group 0 at 7, group 2 at 10
    started, after = _timeline("prompt", [0, 1, 1, 0, 2, 0, 0, 2, 3, 2, 3, 4, 4, 4, 4])
    assert started == [0, 1]
    assert after == [[], [], [2], [], [], [], [3], [], [], [4], [], [], [], [], []]
    # batch rule: the next two prompts once every sample of the batch finished (event 6, then event 11)
    started, after = _timeline("batch", [0, 1, 1, 0, 0, 0, 2, 3, 2, 3, 2, 4, 4, 4, 4])
    assert started == [0, 1]
    assert after == [[], [], [], [], [], [2, 3], [], [], [], [], [4], [], [], [], []]


def test_dataset_caps_hold_back_one_dataset_only():
    groups = [Group(0, "a", 2), Group(1, "a", 2), Group(2, "b", 2)]
    d = Dispatcher(groups, "sample", max_in_flight=8, dataset_caps={"a": 2})
    assert [g.id for g in d.start()] == [0, 2]  # group 1 waits for dataset a's cap, b goes ahead
    assert [g.id for g in d.finished(groups[0])] == []
    assert [g.id for g in d.finished(groups[0])] == [1]
    with pytest.raises(ValueError):
        Dispatcher([Group(0, "a", 9)], max_in_flight=8)


def test_recording_the_decode_step_adds_no_host_sync_so_it_can_be_graph_captured(monkeypatch):
    """With the recorder attached, the static decode step stays sync-free (what CUDA-graph capture needs: the
    hook only copies ids into a device buffer) and the buffer holds every real row's expert ids after it. That
    those ids are the right ones is the routing-replay test above (its decode steps take this path too)."""
    from tests.engine.test_decode_step import _kernels_opaque

    from dsv41.testing.sync import NoSyncMode

    model = engine_test_model(13)
    engine = Engine(model, max_batch=4, cuda_graphs=False)
    ro = Rollouts(engine, stop_ids=(), temperature=1.0)
    samples = [Sample(i, Group(0, "t", 3), 50, p, 6, seed=i) for i, p in enumerate(_prompts(3, 13))]
    for s in samples:
        ro.submit(s)
    while any(s.seq.prefilling or s.seq.next_token is None for s in samples):
        ro.step()
    _kernels_opaque(monkeypatch)
    io, caches, B = engine.io, [s.seq.cache for s in samples], len(samples)
    io.fill_batch(caches, [s.seq.next_token for s in samples])
    io.send()
    ro.recorder._buffer.fill_(-1)
    with NoSyncMode(), torch.no_grad():
        engine.runner.decode(io, B, io.max_entries(B))
    written = ro.recorder._buffer[:, :B]
    assert (written >= 0).all() and (written < model.config.n_routed_experts).all(), written
    ro.close()
