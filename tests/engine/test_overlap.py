"""`Engine(overlap=True)`: a decode step launches the next one from its tokens on the device before the host
reads them. Claims (CPU, fp32, against the plain engine — the independent reference is the engine that waits):
the same tokens and finish reasons for greedy and seeded sampled requests of different lengths joining and
leaving mid-run, stops and length limits included; steps really overlap, and rows that end while their next
step is in flight take the junk path; such a row's saved prefix resumes exactly (window pool hit) to the
tokens a cold run gives; an abort while in flight leaves the other requests' tokens unchanged."""

from __future__ import annotations

import pytest
import torch
from tests.conftest import engine_test_model

from dsv41.engine.engine import Engine
from dsv41.engine.prefix import PrefixCache
from dsv41.engine.prefix_store import InProcessSWAPool, PersistentStore
from dsv41.engine.sampling import SamplingParams


def _prompts(seed: int, lengths) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in lengths]


def _run(model, requests, late, overlap: bool, abort_at: int | None = None, **kw):
    """requests: (prompt, params) added at once; late: added after 4 steps. Returns (outputs, reasons, engine)."""
    engine = Engine(model, max_batch=8, overlap=overlap, **kw)
    seqs = [engine.add_request(p, sp) for p, sp in requests]
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
        if steps == 4:
            seqs += [engine.add_request(p, sp) for p, sp in late]
        if abort_at is not None and steps == abort_at:
            engine.abort(seqs[0])
    return [s.output for s in seqs], [s.finish_reason for s in seqs], engine


def _requests(model, seed: int, stops: dict[int, int] | None = None):
    stops = stops or {}
    prompts = _prompts(seed, (5, 40, 130, 17, 260, 9, 70))
    params = []
    for i in range(len(prompts)):
        sampled = dict(temperature=0.9, top_p=0.95, top_k=50, seed=100 + i) if i % 2 else {}
        params.append(SamplingParams(max_tokens=(12, 30, 7, 25, 18, 30, 22)[i],
                                     stop_token_ids=[stops[i]] if i in stops else [], **sampled))
    return list(zip(prompts, params))


def test_overlapped_decode_emits_the_plain_engines_tokens(monkeypatch):
    model = engine_test_model(81)
    base = _requests(model, 81)
    plain, _, _ = _run(model, base[:5], base[5:], overlap=False)
    # stop ids the requests really sample: rows end by a stop while their next step is in flight
    stops = {0: plain[0][6], 1: plain[1][10], 3: plain[3][4], 5: plain[5][8]}
    reqs = _requests(model, 81, stops)
    want, want_reasons, _ = _run(model, reqs[:5], reqs[5:], overlap=False)
    junk = []
    drop = Engine._drop_junk
    monkeypatch.setattr(Engine, "_drop_junk", lambda self, seq: (junk.append(seq.id), drop(self, seq))[1])
    got, reasons, engine = _run(model, reqs[:5], reqs[5:], overlap=True)
    assert got == want and reasons == want_reasons
    assert "stop" in reasons and "length" in reasons
    assert engine.stats.overlapped_steps > 20, engine.stats
    assert len(junk) >= 4, junk  # stops and length ends taken while the next step ran
    assert engine.pools.free_slots == engine.max_batch  # every slot back


def test_a_row_that_stops_in_flight_persists_a_prefix_that_resumes_exactly(tmp_path):
    model = engine_test_model(82)
    W = model.config.window_size
    g = torch.Generator().manual_seed(82)
    first = torch.randint(3, 1000, (3 * W + 7,), generator=g).tolist()
    follow_up = torch.randint(3, 1000, (W + 9,), generator=g).tolist()
    probe = Engine(model).generate([first], max_tokens=20)[0]
    stop = probe[11]
    results = {}
    for overlap in (False, True):
        cache = PrefixCache(model.config, PersistentStore(tmp_path / str(overlap)), InProcessSWAPool())
        engine = Engine(model, prefix_cache=cache, overlap=overlap)
        seq = engine.add_request(first, SamplingParams(max_tokens=20, stop_token_ids=[stop]))
        while engine.has_work():
            engine.step()
        assert seq.finish_reason == "stop"
        turn2 = engine.add_request(first + seq.output + follow_up, SamplingParams(max_tokens=12))
        while engine.has_work():
            engine.step()
        results[overlap] = (seq.output, turn2.output, engine.metrics(), engine.stats.overlapped_steps)
    (out1, out2, m, n_plain), (o_out1, o_out2, o_m, n_over) = results[False], results[True]
    cold = Engine(model).generate([first + out1 + follow_up], max_tokens=12)[0]
    assert o_out1 == out1 == probe[:11] and o_out2 == out2 == cold
    assert o_m["exact_resumes"] == m["exact_resumes"] == 1 and o_m["pool"]["hits"] == 1
    assert n_plain == 0 and n_over > 5


def test_an_abort_in_flight_leaves_the_others_unchanged():
    model = engine_test_model(83)
    reqs = _requests(model, 83)
    want, _, _ = _run(model, reqs[:5], reqs[5:], overlap=False, abort_at=6)
    got, reasons, engine = _run(model, reqs[:5], reqs[5:], overlap=True, abort_at=6)
    assert reasons[0] == "cancelled" and got[1:] == want[1:]
    assert engine.stats.overlapped_steps > 0 and engine.pools.free_slots == engine.max_batch


def test_logprob_rows_overlap_with_the_waiting_engines_logprobs():
    """Rows asking for log-probabilities (k = 0, 2, 5) beside rows that do not, greedy and sampled: the same
    tokens, logprobs and top alternatives as the engine that waits, computed at launch (the next step
    overwrites the logits before the tokens are read), and the steps overlapped."""
    model = engine_test_model(84)
    prompts = _prompts(84, (10, 30, 17, 44))
    params = [SamplingParams(max_tokens=9, logprobs=2), SamplingParams(max_tokens=7),
              SamplingParams(max_tokens=9, temperature=0.9, seed=4, logprobs=5),
              SamplingParams(max_tokens=8, temperature=0.7, seed=5, logprobs=0)]

    want, n_plain = outputs_with_logprobs(Engine(model, overlap=False), prompts, params)
    got, n_over = outputs_with_logprobs(Engine(model, overlap=True), prompts, params)
    assert n_plain == 0 and n_over > 5
    assert_same_outputs(want, got)


def outputs_with_logprobs(engine: Engine, prompts, params) -> tuple[list[list[tuple]], int]:
    """Run the requests to the end: per request its (token, logprob, top alternatives) of every step output,
    and the engine's overlapped steps."""
    seqs = [engine.add_request(p, q) for p, q in zip(prompts, params)]
    got = {s.id: [] for s in seqs}
    while engine.has_work():
        for out in engine.step():
            got[out.request.id].append((out.token, out.logprob, out.top_logprobs))
    return [got[s.id] for s in seqs], engine.stats.overlapped_steps


def assert_same_outputs(want: list[list[tuple]], got: list[list[tuple]], tol: float = 1e-5) -> None:
    """Same tokens; logprobs and top alternatives (ids exactly, values within tol) where the waiting run had them."""
    for w_rows, g_rows in zip(want, got, strict=True):
        assert [t for t, _, _ in g_rows] == [t for t, _, _ in w_rows]
        for (_, w_lp, w_top), (_, g_lp, g_top) in zip(w_rows, g_rows):
            assert (g_lp is None) == (w_lp is None) and (g_top is None) == (w_top is None)
            if w_lp is not None:
                assert g_lp == pytest.approx(w_lp, abs=tol)
                assert [i for i, _ in g_top] == [i for i, _ in w_top]
                assert [v for _, v in g_top] == pytest.approx([v for _, v in w_top], abs=tol)


def test_a_row_ending_in_flight_is_finished_with_the_plain_engines_cache_state(monkeypatch):
    """What `_finish` persists: the token count and entry counts of the plain engine, and its window-ring
    positions except the one slot the in-flight step overwrote (position p, p = the token count), which is
    empty instead of holding p − W (no query from p on reads p − W; the snapshot never claims a token the
    sequence does not hold)."""
    model = engine_test_model(85)
    W = model.config.window_size
    base = _requests(model, 85)
    plain, _, _ = _run(model, base[:5], base[5:], overlap=False)
    stops = {0: plain[0][6], 2: plain[2][3], 4: plain[4][9]}
    reqs = _requests(model, 85, stops)
    states: dict[bool, dict[int, tuple]] = {}
    finish = Engine._finish
    for overlap in (False, True):
        seen = states[overlap] = {}

        def capture(self, seq, seen=seen):
            c = seq.cache
            seen[seq.id] = (c.n_tokens, {s: st.n_entries for s, st in c.entry_stores.items()},
                            self.pools.ring_positions[:, c.slot].clone())
            return finish(self, seq)

        monkeypatch.setattr(Engine, "_finish", capture)
        _run(model, reqs[:5], reqs[5:], overlap=overlap)
    assert states[False].keys() == states[True].keys() and len(states[True]) == 7
    junk_checked = 0
    for sid, (n, entries, ring) in states[False].items():
        o_n, o_entries, o_ring = states[True][sid]
        assert (o_n, o_entries) == (n, entries), sid
        expected = ring.clone()
        if not torch.equal(o_ring, ring):  # the in-flight step wrote position n
            expected[:, n % W] = -1
            junk_checked += 1
        assert torch.equal(o_ring, expected), sid
    assert junk_checked >= 3


def test_overlap_is_on_by_default_only_on_cuda():
    """Default: on CUDA devices, with a drafter too (`test_engine_gpu.py` checks that side); on the CPU nothing
    runs beside the host, so the engine waits unless asked — with or without a drafter."""
    from tests.engine.test_speculative import FLAT

    from dsv41.engine.speculative import NoisyDrafter

    model = engine_test_model(85)
    assert not Engine(model, max_batch=2).overlap
    assert Engine(model, max_batch=2, overlap=True).overlap
    drafter = NoisyDrafter(model.config.vocab_size, 2)
    assert not Engine(model, max_batch=2, drafter=drafter, step_time=FLAT).overlap  # the CPU: when asked
    assert Engine(model, max_batch=2, drafter=drafter, step_time=FLAT, overlap=True).overlap


def test_a_speculative_engine_overlaps_the_plain_steps_its_cost_model_chooses(monkeypatch):
    """With a drafter, the plain steps `speculate="auto"` chooses overlap and verification steps do not: the
    cost model's choice forced by state (three plain steps, then a verification, again), the waiting and the
    overlapping speculative engines make the same choices and emit plain greedy decoding's tokens, and the
    drafter, a script of that greedy output that counts the tokens it observed, has every draft accepted — it
    was handed every plainly decoded token (`_catch_up`), none of the in-flight placeholders."""
    from tests.engine.test_speculative import FLAT, ScriptedDrafter

    model = engine_test_model(86)
    prompts = _prompts(86, (5, 40, 21))
    max_tokens = [24, 15, 20]
    plain = [Engine(model, max_batch=1, max_seq_len=128).generate([p], max_tokens=m)[0]
             for p, m in zip(prompts, max_tokens)]
    monkeypatch.setattr(Engine, "_worth_drafting", lambda self, seqs: (
        self.stats.speculative.plain_steps >= 3 * (self.stats.speculative.forwards + 1)))
    runs = {}
    for overlap in (False, True):
        drafter = ScriptedDrafter(4, {tuple(p): o for p, o in zip(prompts, plain)})
        engine = Engine(model, max_batch=4, max_seq_len=128, drafter=drafter, step_time=FLAT, overlap=overlap)
        seqs = [engine.add_request(p, SamplingParams(max_tokens=m)) for p, m in zip(prompts, max_tokens)]
        while engine.has_work():
            engine.step()
        runs[overlap] = ([s.output for s in seqs], engine.stats)
    (want, waiting), (got, overlapped) = runs[False], runs[True]
    assert got == want == plain
    assert waiting.overlapped_steps == 0 and overlapped.overlapped_steps >= 4
    sw, so = waiting.speculative, overlapped.speculative
    assert so.forwards == sw.forwards >= 3
    assert so.plain_steps - sw.plain_steps in (0, 1)  # + the last launch, when every row ended in flight
    assert so.accepted == so.drafted > 0 and sw.accepted == sw.drafted


def test_overlap_across_page_ends_and_the_context_end_keeps_the_plain_engines_tokens():
    """Small pages (every eighth entry starts one), a pool too small for every sequence at once (preemption) and a
    context that ends mid-generation: an overlapped step never runs a position whose pages are not yet held
    (`_can_continue` hands such a step to the scheduler, which grows them or preempts), nor one past the context
    (`_overlappable`). The same tokens and finish reasons as the waiting engine, steps overlapped, every page and
    slot back at the end."""
    model = engine_test_model(86)
    g = torch.Generator().manual_seed(86)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (21, 44, 58, 9)]
    params = [SamplingParams(max_tokens=n) for n in (60, 60, 60, 30)]  # the first three run into the context end
    runs = []
    for overlap in (False, True):
        engine = Engine(model, max_batch=4, overlap=overlap, page_rows=8, max_seq_len=80, max_tokens=160)
        free = {s: engine.pools.free_pages(s) for s in engine.pools.sources}
        seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        while engine.has_work():
            engine.step()
        runs.append(([s.output for s in seqs], [s.finish_reason for s in seqs], engine.stats.overlapped_steps))
        assert engine.stats.preemptions > 0  # the pool is too small for all four at once
        assert {s: engine.pools.free_pages(s) for s in engine.pools.sources} == free
        assert engine.pools.free_slots == engine.max_batch
    (want, want_reasons, _), (got, reasons, overlapped) = runs
    assert got == want and reasons == want_reasons
    assert [len(o) for o in got[:3]] == [80 - len(p) for p in prompts[:3]]  # cut by the context
    assert overlapped > 10, overlapped


def test_a_request_arriving_while_rows_overlap_starts_when_the_waiting_engine_starts_it():
    """Overlap never keeps a waiting request out: the step it arrives at resolves the step in flight and the
    scheduler admits it, so its first token comes at most one step later than in the waiting engine."""
    model = engine_test_model(87)
    g = torch.Generator().manual_seed(87)
    first = []
    for overlap in (False, True):
        engine = Engine(model, max_batch=4, overlap=overlap)
        for n in (12, 30):
            engine.add_request(torch.randint(3, 1000, (n,), generator=g).tolist(), SamplingParams(max_tokens=40))
        steps, late = 0, None
        while engine.has_work():
            engine.step()
            steps += 1
            if steps == 6:
                late = engine.add_request(torch.randint(3, 1000, (17,), generator=g).tolist(),
                                          SamplingParams(max_tokens=3))
            if late is not None and late.output and len(first) < (2 if overlap else 1):
                first.append(steps)
        assert engine.stats.overlapped_steps > 0 or not overlap
    plain_step, overlap_step = first
    assert overlap_step <= plain_step + 1, first
