"""Batched prefill: pieces of different sequences with one key run as one forward (`PrefillJob.step_batch`).

Claims checked (fp32 on the CPU, random weights, `tiny` with the cache formats on and a custom config with
Engram in both halves and a window of 8, exact and encoder-only prefill, with and without a layer bound):
  * requests of equal prompt length arriving together — at the start and while others decode — give the
    tokens and logits each gives alone with one-shot prefill, and the pools are all free at the end;
  * the batching happened: fewer prefill forwards than pieces, riders in steps with decode rows, and no such
    step runs more than `prefill_layers` layer passes of forwards;
  * riders cost no layer budget: a group arriving beside decodes finishes its prefill in the steps one of
    them takes alone (without batching the last one waits for the others);
  * `step_batch` refuses jobs whose next pieces differ or cannot be batched, before touching any of them;
  * a batched forward that fails ends its own requests with an error; the other requests finish unchanged;
  * follow-ups after prefix hits of different lengths batch (rows at different positions) and equal cold runs.
"""

from __future__ import annotations

import pytest
import torch
from tests.conftest import engine_test_model
from tests.engine.test_layer_pieces import CUSTOM, rel_err

from dsv41.engine.cache import SequenceCache, private_pools
from dsv41.engine.engine import Engine
from dsv41.engine.prefill import PrefillJob
from dsv41.engine.runner import Runner
from dsv41.engine.sampling import SamplingParams

CONFIGS = {"tiny": {}, "custom": CUSTOM}
# (arrival step, prompt length, new tokens): a group of four at the start, one of another length, then a group
# of three arriving while the first ones decode
REQUESTS = [(0, 19, 9), (0, 19, 6), (0, 19, 12), (0, 19, 7), (0, 11, 8), (3, 23, 6), (3, 23, 10), (3, 23, 5)]


def run(engine: Engine, prompts: list[list[int]], requests=REQUESTS):
    """Drive `engine` with `requests` (arrival step, _, new tokens); returns (sequences, logits rows per request
    id, scheduled batches)."""
    seen: dict[int, list[torch.Tensor]] = {}
    emit, schedule = engine._emit, engine.scheduler.schedule
    batches = []

    def spy_emit(seqs, logits, *sampled):
        for seq, row in zip(seqs, logits):
            seen.setdefault(seq.id, []).append(row.detach().clone())
        return emit(seqs, logits, *sampled)

    engine._emit = spy_emit
    engine.scheduler.schedule = lambda: (batches.append(schedule()), batches[-1])[1]
    seqs: list = [None] * len(requests)
    step = 0
    while step == 0 or any(s is None or not s.finished for s in seqs):
        for i, (at, _, n_out) in enumerate(requests):
            if at == step:
                seqs[i] = engine.add_request(prompts[i], SamplingParams(max_tokens=n_out))
        engine.step()
        step += 1
        assert step < 500, "the engine stopped making progress"
    return seqs, seen, batches


@pytest.fixture(scope="module", params=list(CONFIGS))
def setup(request):
    torch.manual_seed(71)
    model = engine_test_model(71, **CONFIGS[request.param])
    prompts = [torch.randint(3, model.config.vocab_size, (n,)).tolist() for _, n, _ in REQUESTS]
    alone = {}
    for exact in (True, False):
        rows = []
        for prompt, (_, _, n_out) in zip(prompts, REQUESTS):
            engine = Engine(model, max_batch=1, prefill_chunk=4096, prefill_layers=None, exact_prefill=exact,
                            max_seq_len=80, batch_prefill=False)
            (seq,), seen, _ = run(engine, [prompt], [(0, 0, n_out)])
            rows.append((seq.output, seen[seq.id]))
        alone[exact] = rows
    return model, prompts, alone


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "encoder-only"])
@pytest.mark.parametrize("layers", [None, 2])
def test_batched_prefill_equals_each_request_alone(setup, exact, layers):
    model, prompts, alone = setup
    engine = Engine(model, max_batch=8, prefill_layers=layers, exact_prefill=exact, max_seq_len=80)
    seqs, seen, batches = run(engine, prompts)
    errs = []
    for seq, (out, rows) in zip(seqs, alone[exact]):
        assert seq.error is None and seq.output == out, f"request {seq.id} differs from its run alone"
        assert len(seen[seq.id]) == len(rows)
        errs += [rel_err(a, b) for a, b in zip(seen[seq.id], rows)]
    errs = torch.tensor(errs)
    print(f"rel err vs alone: median {errs.median():.2e}, max {errs.max():.2e}")
    assert errs.max() <= 2e-3 and errs.median() <= 1e-5
    stats = engine.stats
    assert stats.prefill_forwards < stats.prefill_pieces, (stats.prefill_forwards, stats.prefill_pieces)
    if layers is not None:
        assert any(b.decode and b.riders for b in batches), "no piece rode along beside decodes"
        for b in batches:
            if b.decode:
                assert b.n_layer_passes <= layers, b.n_layer_passes
    pools = engine.pools
    assert pools.free_slots == pools.max_slots
    assert all(pools.free_pages(s) == p.n_pages for s, p in pools.sources.items())


def prefill_span(model, prompts, requests, batch_prefill: bool) -> int:
    """Engine steps from the first to the last that carried a prefill piece of requests[1:]."""
    engine = Engine(model, max_batch=8, prefill_layers=2, exact_prefill=True, max_seq_len=80,
                    batch_prefill=batch_prefill)
    seqs, _, batches = run(engine, prompts, requests)
    steps = [i for i, b in enumerate(batches) if any(s is seq for s, _ in b.prefill for seq in seqs[1:])]
    assert all(batches[i].decode for i in steps)  # the first request decoded beside them all along
    return steps[-1] - steps[0] + 1


def test_riders_cost_no_layer_budget(setup):
    """Four equal prompts arriving while one request decodes: batched, they prefill in the steps one alone
    needs (n_layers / 2 pieces of 2 layers); run one by one under the 2-layer bound, in four times as many."""
    model, prompts, _ = setup
    requests = [(0, 19, 30)] + [(2, 23, 4)] * 4
    chosen = [prompts[0]] + [prompts[5]] * 4
    n_layers = model.config.n_layers
    assert prefill_span(model, chosen, requests, batch_prefill=True) == n_layers // 2
    assert prefill_span(model, chosen, requests, batch_prefill=False) == 4 * n_layers // 2


def test_step_batch_refuses_pieces_that_differ_and_touches_nothing():
    torch.manual_seed(72)
    model = engine_test_model(72)
    runner, c = Runner(model), model.config
    pools = private_pools(c, max_tokens=256, max_slots=4)
    same = [torch.randint(3, c.vocab_size, (12,)).tolist() for _ in range(2)]
    jobs = [PrefillJob(runner, SequenceCache(c, pools=pools), p, exact=True) for p in same]
    other = PrefillJob(runner, SequenceCache(c, pools=pools), torch.randint(3, c.vocab_size, (10,)).tolist(),
                       exact=True)
    with pytest.raises(ValueError, match="differ"):
        PrefillJob.step_batch(jobs + [other], 12, c.n_layers)
    assert all(j.run is None and j.cursor == 0 for j in jobs + [other])
    jobs[1].capture_layers = (1,)  # features for a drafter: not batchable
    with pytest.raises(ValueError, match="cannot be batched"):
        PrefillJob.step_batch(jobs, 12, c.n_layers)
    assert all(j.run is None and j.cursor == 0 for j in jobs)
    jobs[1].capture_layers = ()
    first, second = PrefillJob.step_batch(jobs, 12, 2)  # two layers of the run: no logits yet
    assert first is None and second is None and all(j.in_progress and j.run.next_layer == 2 for j in jobs)
    out = PrefillJob.step_batch(jobs, 12, c.n_layers)
    assert all(o is not None and o.shape == (c.vocab_size,) for o in out) and all(j.done for j in jobs)


def test_a_failing_batched_forward_ends_only_its_requests(setup, monkeypatch):
    model, prompts, alone = setup
    engine = Engine(model, max_batch=8, prefill_layers=2, exact_prefill=True, max_seq_len=80)
    real, calls = PrefillJob.step_batch, []

    def flaky(jobs, n, layers):
        calls.append(len(jobs))
        if len(jobs) == 3:  # the group arriving at step 3
            raise RuntimeError("injected")
        return real(jobs, n, layers)

    monkeypatch.setattr(PrefillJob, "step_batch", staticmethod(flaky))
    seqs, _, _ = run(engine, prompts)
    assert 3 in calls
    for (at, _, _), seq, (out, _) in zip(REQUESTS, seqs, alone[True]):
        if at == 3:
            assert seq.finish_reason == "error" and "injected" in seq.error
        else:
            assert seq.error is None and seq.output == out
    pools = engine.pools
    assert pools.free_slots == pools.max_slots
    assert all(pools.free_pages(s) == p.n_pages for s, p in pools.sources.items())


def test_the_layer_budget_riders_leave_goes_to_other_prompts(setup):
    """Under a 3-layer bound an 8-layer run goes 3 + 3 + 2: in the step of its last piece the one layer left
    goes to a prompt of another length — the leader's riders took none of it."""
    model, prompts, _ = setup
    requests = [(0, 19, 30)] + [(2, 23, 4)] * 3 + [(2, 11, 4)]
    chosen = [prompts[0]] + [prompts[5]] * 3 + [prompts[4]]
    engine = Engine(model, max_batch=8, prefill_layers=3, exact_prefill=True, max_seq_len=80)
    seqs, _, batches = run(engine, chosen, requests)
    assert model.config.n_layers == 8
    shared = [b for b in batches if b.decode and b.riders and len({p.key for _, p in b.prefill}) > 1]
    assert shared, "no step ran the riders' group beside another prompt's piece"
    assert all(b.n_layer_passes <= 3 for b in batches if b.decode)
    assert all(s.error is None for s in seqs)


def test_warm_prefix_hits_at_different_positions_batch_and_equal_cold_runs(tmp_path):
    """Two conversations of different lengths, then both follow-ups (equal length) at once: their new tokens'
    encoder chunks start at different positions after the hits (per-row starts, partial compressor groups,
    Engram history) and run as one forward; each reply equals its cold run alone."""
    from dsv41.engine.prefix import PrefixCache
    from dsv41.engine.prefix_store import InProcessSWAPool, PersistentStore

    torch.manual_seed(73)
    model = engine_test_model(73, **CUSTOM)
    V, W = model.config.vocab_size, model.config.window_size
    firsts = [torch.randint(3, V, (n,)).tolist() for n in (3 * W + 5, 5 * W + 2)]
    follow = [torch.randint(3, V, (W + 6,)).tolist() for _ in firsts]
    cache = PrefixCache(model.config, PersistentStore(tmp_path), InProcessSWAPool())
    engine = Engine(model, prefix_cache=cache, max_batch=4)
    outs = engine.generate(firsts, max_tokens=5)
    turns = [f + o + u for f, o, u in zip(firsts, outs, follow)]
    before = engine.stats.prefill_forwards, engine.stats.prefill_pieces
    reqs = [engine.add_request(t, SamplingParams(max_tokens=8)) for t in turns]
    while not all(r.finished for r in reqs):
        engine.step()
    forwards, pieces = engine.stats.prefill_forwards - before[0], engine.stats.prefill_pieces - before[1]
    assert all(r.cached_tokens > 0 for r in reqs) and reqs[0].cached_tokens != reqs[1].cached_tokens
    assert forwards < pieces, (forwards, pieces)
    for r, turn in zip(reqs, turns):
        assert r.output == Engine(model, batch_prefill=False).generate([turn], max_tokens=8)[0]
