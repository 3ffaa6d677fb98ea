"""Prefill cut at layer granularity (issue 15, acceptance 4): a chunk or the decoder replay run through a
few layers per engine step, the streams carried on the job between pieces.

Claims checked (fp32 on the CPU, random weights, `tiny` with the cache formats on and a custom config
with Engram in both halves and a short window):
  * a run cut into layer pieces = the same run whole, bit for bit (logits, drafter features, and every
    byte the sequence holds in the pools: window rings, ring positions, FP4 entries and index keys,
    compressor partial groups);
  * any chunking × any layer split = one-shot prefill (the chunking itself changes the fp32 summation
    order, so: logits within fp32 tolerance, pool bytes equal but for rare FP4/FP8 rounding flips);
  * every (position, layer) of the prompt runs exactly once — a skipped or repeated piece fails;
  * in the engine: with streams decoding, no step carries more than `prefill_layers` layer passes, every
    decoding stream gets its token every step, and the sliced requests give the tokens and logits they
    give alone with one-shot prefill — with preemption to host memory between pieces, too.
"""

from __future__ import annotations

import random
from collections import defaultdict

import pytest
import torch
from tests.conftest import engine_test_model

from dsv41.engine.cache import SequenceCache, private_pools
from dsv41.engine.engine import Engine
from dsv41.engine.prefill import PrefillJob, prefill
from dsv41.engine.runner import Runner
from dsv41.engine.sampling import SamplingParams

# Engram in the encoder (layer 1) and in the decoder (layer 6, a Reindex layer using candidates): the
# decoder replay's pieces hash too; window 8 so chunks and the replay cut the window often
CUSTOM = dict(engram_layer_ids=[1, 6], engram_num_embeddings=[6126, 6400], window_size=8)
CONFIGS = {"tiny": {}, "custom": CUSTOM}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def run_job(job: PrefillJob, chunks: list[int] | None, rng: random.Random | None, max_layers: int = 3):
    """Drive a job to its logits: new runs of the next size in `chunks` (None: the job's chunk), each
    piece through 1..max_layers layers drawn from rng (None: whole runs)."""
    sizes = list(chunks or [])
    while True:
        layers = None if rng is None else rng.randint(1, max_layers)
        n = None if job.in_progress or job.decoder_pending or not sizes else sizes.pop(0)
        logits = job.step(n, layers)
        if logits is not None:
            assert job.done and not job.in_progress
            return logits


def cache_state(cache: SequenceCache) -> dict[str, torch.Tensor]:
    """Every byte the sequence holds in the pools (the swap-out copy) plus its token ids."""
    state = cache.swap_out()
    state["tokens"] = torch.tensor(cache.tokens)
    return state


def fresh_job(runner: Runner, prompt: list[int], chunk: int, **kw) -> PrefillJob:
    return PrefillJob(runner, SequenceCache(runner.config), prompt, chunk=chunk, **kw)


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("exact", [False, True])
def test_a_run_cut_into_layer_pieces_is_bit_identical_to_the_whole_run(config, exact):
    torch.manual_seed(60)
    model = engine_test_model(60, **CONFIGS[config])
    runner = Runner(model)
    L, capture = model.config.n_layers, (1, 3, 5, 7)
    rng = random.Random(60)
    for trial in range(2):
        prompt = torch.randint(3, model.config.vocab_size, (rng.randint(20, 45),)).tolist()
        chunks = [rng.randint(1, 25) for _ in range(10)]
        whole = fresh_job(runner, prompt, 4096, exact=exact, capture_layers=capture)
        ref = run_job(whole, chunks, None)
        sliced = fresh_job(runner, prompt, 4096, exact=exact, capture_layers=capture)
        got = run_job(sliced, chunks, rng, max_layers=L - 1)
        assert torch.equal(got, ref), f"trial {trial}: logits differ by {rel_err(got, ref):.2e} (rel)"
        assert whole.features.keys() == sliced.features.keys()
        for i in whole.features:
            assert torch.equal(sliced.features[i], whole.features[i]), f"drafter features of layer {i} differ"
        a, b = cache_state(sliced.seq), cache_state(whole.seq)
        assert a.keys() == b.keys()
        for k in b:
            assert torch.equal(a[k], b[k]), f"trial {trial}: pool bytes {k!r} differ ({(a[k] != b[k]).sum()} bytes)"


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("seed", [61, 62])
def test_any_chunking_and_layer_split_equals_one_shot_prefill(config, seed):
    torch.manual_seed(seed)
    model = engine_test_model(seed, **CONFIGS[config])
    runner = Runner(model)
    rng = random.Random(seed)
    prompt = torch.randint(3, model.config.vocab_size, (rng.randint(40, 90),)).tolist()
    one_shot = fresh_job(runner, prompt, 4096)
    ref = run_job(one_shot, None, None)
    chunks = [rng.randint(1, 17) for _ in range(40)]
    job = fresh_job(runner, prompt, 4096)
    got = run_job(job, chunks, rng)
    err = rel_err(got, ref)
    print(f"logits rel err vs one-shot: {err:.2e}")
    assert err <= 1e-5, err
    a, b = cache_state(job.seq), cache_state(one_shot.seq)
    assert torch.equal(a["tokens"], b["tokens"])
    for k in b:
        if k.endswith(("pending_kv", "pending_score")):  # fp32 projections of the unfinished group only
            m = one_shot.seq.entry_stores[int(k.split(".")[0])].ratio
            r = len(prompt) % m
            assert r == 0 or (a[k][:r] - b[k][:r]).abs().max() <= 1e-5 * b[k][:r].abs().max() + 1e-6, k
            continue
        assert a[k].shape == b[k].shape, k
        flipped = (a[k] != b[k]).float().mean().item()
        print(f"{k}: {flipped:.2%} bytes differ")
        # a wrong row or a skipped layer changes most bytes of a tensor; an fp32 rounding flip, a few
        assert flipped <= 0.01, (k, flipped)


def test_every_position_runs_through_every_layer_exactly_once(monkeypatch):
    """Count (position, layer) visits of every host forward: encoder layers see each prompt position once,
    decoder layers each replayed position once — a piece skipped or run twice fails."""
    torch.manual_seed(63)
    model = engine_test_model(63, **CUSTOM)
    runner = Runner(model)
    c = model.config
    visits: dict[tuple[int, int], int] = defaultdict(int)
    forward = Runner.forward

    def spy(self, seqs, tokens, start, layers, *a, **k):
        for pos in range(int(start[0]), int(start[0]) + tokens.size(1)):
            for i in layers:
                visits[pos, i] += 1
        return forward(self, seqs, tokens, start, layers, *a, **k)

    monkeypatch.setattr(Runner, "forward", spy)
    rng = random.Random(63)
    prompt = torch.randint(3, c.vocab_size, (53,)).tolist()
    job = fresh_job(runner, prompt, 4096)
    run_job(job, [rng.randint(1, 12) for _ in range(20)], rng)
    W = c.window_size
    want = {(p, i): 1 for p in range(len(prompt)) for i in range(c.encoder_layers)}
    want.update({(p, i): 1 for p in range(len(prompt) - W, len(prompt)) for i in range(c.encoder_layers, c.n_layers)})
    assert dict(visits) == want, sorted(set(visits.items()) ^ set(want.items()))[:8]


def test_plan_lists_the_pieces_step_runs_within_both_budgets():
    model = engine_test_model(64)
    runner = Runner(model)
    c = model.config
    job = fresh_job(runner, list(range(3, 43)), 16)  # 40 tokens: chunks 16, 16, 8, then the replay
    enc, dec = c.encoder_layers, c.n_layers - c.encoder_layers
    W = c.window_size
    assert [(p.tokens, p.layers, p.new) for p in job.plan(100)] == [(16, enc, True), (16, enc, True), (8, enc, True),
                                                                    (W, dec, True)]
    pieces = job.plan(20, layers=enc + 1)  # the first chunk whole, one layer of the second (4 tokens: budget)
    assert [(p.tokens, p.layers, p.new) for p in pieces] == [(16, enc, True), (4, 1, True)]
    job.step(16, 3)
    assert job.in_progress
    # the run in progress continues without token budget; its tokens were counted when it started
    assert [(p.tokens, p.layers, p.new) for p in job.plan(0, layers=2)] == [(16, enc - 3, False)]
    with pytest.raises(ValueError):
        job.step(8)  # a 16-token run is in progress
    job.step(None, 1)
    while not job.decoder_pending:
        job.step()
    assert job.plan(W - 1, alone=False) == []  # the replay waits for room for its n_win tokens
    assert [(p.tokens, p.layers, p.kind) for p in job.plan(W - 1, alone=True, layers=2)] == [(W, 2, "decoder")]
    assert job.step(layers=2) is None and job.in_progress
    assert [(p.tokens, p.layers, p.new) for p in job.plan(0, layers=1)] == [(W, 1, False)]
    assert job.step() is not None and job.done


def drive(engine: Engine, prompts: list[list[int]], outputs: list[int], arrive_every: int = 1,
          layers: int | None = None):
    """Run requests arriving one every `arrive_every` steps to the end; check on the way that no step
    with decode rows carries more than `layers` layer passes and every decoding stream got its token.
    Returns (sequences, logits rows per request, scheduled batches)."""
    seen: dict[int, list[torch.Tensor]] = defaultdict(list)
    emit, schedule = engine._emit, engine.scheduler.schedule
    batches = []

    def spy_emit(seqs, logits, *sampled):
        for seq, row in zip(seqs, logits):
            seen[seq.id].append(row.detach().clone())
        return emit(seqs, logits, *sampled)

    engine._emit = spy_emit
    engine.scheduler.schedule = lambda: (batches.append(schedule()), batches[-1])[1]
    seqs, pending, steps = [], list(range(len(prompts))), 0
    while pending or any(not s.finished for s in seqs):
        if pending and steps % arrive_every == 0:
            i = pending.pop(0)
            seqs.append(engine.add_request(prompts[i], SamplingParams(max_tokens=outputs[i])))
        before = {s.id: len(s.output) for s in seqs}
        engine.step()
        batch = batches[-1]
        if batch.decode and layers is not None:
            assert batch.n_layer_passes <= layers, f"step {steps}: {batch.n_layer_passes} layer passes"
        for s in batch.decode:  # every decoding stream got its token this step
            assert len(s.output) == before[s.id] + 1 or s.finished, f"step {steps}: request {s.id} stalled"
        steps += 1
        assert steps < 2000, "the engine stopped making progress"
    return seqs, seen, batches


@pytest.fixture(scope="module")
def alone_runs():
    """The model, the requests, and each request alone with one-shot prefill (tokens, logits rows)."""
    torch.manual_seed(65)
    model = engine_test_model(65, **CUSTOM)
    lengths, outputs = [40, 6, 33, 58, 21], [16, 20, 14, 10, 18]
    prompts = [torch.randint(3, model.config.vocab_size, (n,)).tolist() for n in lengths]
    alone = []
    for prompt, n_out in zip(prompts, outputs):
        engine = Engine(model, max_batch=1, prefill_chunk=4096, prefill_layers=None, max_seq_len=80)
        (seq,), seen, _ = drive(engine, [prompt], [n_out])
        alone.append((seq.output, seen[seq.id]))
    return model, prompts, outputs, alone


@pytest.mark.parametrize("layers,tight", [(1, False), (2, True)])
def test_layer_pieces_mixed_with_decodes_equal_each_request_alone(alone_runs, layers, tight):
    model, prompts, outputs, alone = alone_runs
    engine = Engine(model, max_batch=4, prefill_chunk=7, token_budget=12, prefill_layers=layers, page_rows=4,
                    max_seq_len=80, max_tokens=80 if tight else 1024)
    seqs, seen, batches = drive(engine, prompts, outputs, layers=layers)
    sliced = sum(1 for b in batches for _, p in b.prefill if p.layers < 4)
    assert sliced > 10, f"only {sliced} pieces were cut at a layer"
    assert any(b.decode and b.prefill for b in batches), "prefill never ran beside decodes"
    assert (engine.stats.preemptions > 0) == tight, engine.stats.preemptions
    errs = []
    for seq, (out, rows) in zip(seqs, alone):
        assert seq.output == out, f"request {seq.id} tokens differ ({seq.n_preemptions} preemptions)"
        errs += [rel_err(a, b) for a, b in zip(seen[seq.id], rows)]
    errs = torch.tensor(errs)
    print(f"rel err vs alone with one-shot prefill: median {errs.median():.2e}, max {errs.max():.2e}")
    assert errs.max() <= 2e-3 and errs.median() <= 1e-5
    pools = engine.pools
    assert pools.free_slots == pools.max_slots
    assert all(pools.free_pages(s) == p.n_pages for s, p in pools.sources.items())


def test_a_sequence_swapped_out_between_two_layer_pieces_resumes_bit_identically():
    """Preemption in the middle of a run: the pools' bytes go to the host and come back (maybe to another
    slot, after another sequence used the pools); the streams stayed on the job."""
    torch.manual_seed(66)
    model = engine_test_model(66, **CUSTOM)
    runner, c = Runner(model), model.config
    prompt = torch.randint(3, c.vocab_size, (45,)).tolist()
    ref = fresh_job(runner, prompt, 11)
    want = run_job(ref, None, random.Random(66))
    pools = private_pools(c, max_tokens=128, max_slots=2)
    job = PrefillJob(runner, SequenceCache(c, pools=pools), prompt, chunk=11)
    job.step(None, 2)  # into the first chunk's encoder
    job.step()
    job.step(None, 3)  # the second chunk, part-way
    assert job.in_progress
    state = job.seq.swap_out()
    other = SequenceCache(c, pools=pools)  # takes the freed slot and pages, writes its own bytes
    prefill(runner, other, torch.randint(3, c.vocab_size, (30,)).tolist(), chunk=7)
    job.seq.swap_in(state)
    assert job.seq.slot != other.slot
    got = run_job(job, None, random.Random(67))
    assert torch.equal(got, want), rel_err(got, want)
    a, b = cache_state(job.seq), cache_state(ref.seq)
    for k in b:
        assert torch.equal(a[k], b[k]), k
