"""The trained-drafter path end to end: a DSpark saved in `MODEL/dspark/` (where `dsv41 train-dspark`
puts it) is what `--speculative dspark` loads, and greedy speculation with it equals plain decode."""

from __future__ import annotations

import pytest
import torch

from dsv41.checkpoint import save_checkpoint
from dsv41.config import load_config, with_dspark
from dsv41.engine.dspark_drafter import DSparkDrafter
from dsv41.engine.engine import Engine
from dsv41.engine.sampling import SamplingParams
from dsv41.engine.speculative import SpeculativeError, StepTimeCurve, build_drafter
from dsv41.model.dspark import DSpark
from dsv41.model.transformer import Transformer


def test_a_saved_drafter_is_found_and_speculation_with_it_equals_plain_decode(tmp_path):
    torch.manual_seed(0)
    main = Transformer(load_config("tiny")).init_weights(seed=0).eval()
    model_dir = tmp_path / "model"
    save_checkpoint(main, model_dir)
    with pytest.raises(SpeculativeError, match="no DSpark drafter"):
        build_drafter("dspark", main, checkpoint=model_dir)
    drafter = DSpark(with_dspark(load_config("tiny"))).init_weights(seed=1)
    save_checkpoint(drafter, model_dir / "dspark")
    found = build_drafter("dspark", main, checkpoint=model_dir)
    assert isinstance(found, DSparkDrafter) and found.k == drafter.block_size
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 400, (n,), generator=g).tolist() for n in (5, 17, 40)]
    plain = Engine(main).generate(prompts, max_tokens=10)
    spec = Engine(main, drafter=found)
    assert spec.generate(prompts, max_tokens=10) == plain
    stats = spec.stats.speculative
    assert stats is not None and stats.verifications > 0, stats


def test_a_drafters_prompts_prefill_from_static_steps_with_the_same_features():
    """With static prefill (eager static steps on the CPU) the engine's prompts prefill from static steps even
    with a drafter (its target layers are decoder layers: the replay captures them) — the drafter observes the
    same features after each prompt as with the host path, within fp32 rounding, and greedy speculation still
    equals plain decode."""
    torch.manual_seed(0)
    main = Transformer(load_config("tiny")).init_weights(seed=0).eval()
    dspark = DSpark(with_dspark(load_config("tiny"))).init_weights(seed=1).bind(main)
    assert min(dspark.target_layer_ids) >= main.config.encoder_layers
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 400, (n,), generator=g).tolist() for n in (5, 40)]
    plain = Engine(main).generate(prompts, max_tokens=4)
    observed, runs = {}, {}
    for static in (False, True):
        drafter = DSparkDrafter(dspark, max_sequences=4)
        drafter.observe = _recording(drafter.observe, observed.setdefault(static, []))
        engine = Engine(main, drafter=drafter, static_prefill=static, max_batch=2, max_seq_len=128,
                        step_time=StepTimeCurve([(1, 1.0)]))  # no start-up profile: a flat curve
        assert engine.generate(prompts, max_tokens=4) == plain
        runs[static] = engine.stats.static_prefill_runs
        assert engine.stats.speculative.verifications > 0  # the drafter drafted (and its drafts were verified)
    assert runs[False] == 0 and runs[True] >= 2 * len(prompts)  # each prompt's chunk(s) and its replay
    prefills = {}  # each sequence's first observation: its prompt, after prefill
    for static, calls in observed.items():
        first = {}
        for seq_id, tokens, features in calls:
            first.setdefault(seq_id, (tokens, features))
        prefills[static] = list(first.values())
    assert [len(t) for t, _ in prefills[True]] == [len(t) for t, _ in prefills[False]] == [5, 40]
    for (tok_a, feat_a), (tok_b, feat_b) in zip(prefills[False], prefills[True]):
        assert tok_a == tok_b and sorted(feat_a) == sorted(feat_b) == sorted(dspark.target_layer_ids)
        for i in feat_a:
            torch.testing.assert_close(feat_b[i], feat_a[i], rtol=0, atol=1e-6 * float(feat_a[i].abs().max()))


def _recording(observe, calls: list):
    """`observe` that first appends (seq_id, tokens, features) to calls."""
    def wrapped(seq_id, tokens, features):
        calls.append((seq_id, tokens.tolist(), {i: f.clone() for i, f in features.items()}))
        return observe(seq_id, tokens, features)
    return wrapped


def _tiny_pair():
    torch.manual_seed(0)
    main = Transformer(load_config("tiny")).init_weights(seed=0).eval()
    return main, DSpark(with_dspark(load_config("tiny"))).init_weights(seed=1).bind(main)


def _draft_mostly(self, seqs):
    """A cost model's choice both runs make alike whenever they ask: plain about one step in five, by the
    rows' cached tokens (the engine asks at the end of a step when it chains, at the start of the next
    otherwise; the caches are the same at both moments)."""
    return 7 * sum(s.cache.n_tokens for s in seqs) % 5 != 0


def test_verifications_launched_early_verify_what_the_step_would_have(monkeypatch):
    """A verification that leaves every row going on launches the next step's proposal, and where that step
    is certain to verify the same rows its verification too, before its own bookkeeping (`Engine._chain`,
    greedy drafting only). Run twice with the same choices — plain steps now and then, a row aborted while a
    launched verification holds it (undone before its slot is freed: `_cancel_chain`; the slot stays clean), a
    request arriving between steps, rows finishing at different lengths, a prompt prefilling in pieces beside
    decoding rows — once launching early and once not: every verification verifies the same drafts (a launched
    verification never keeps a prefill waiting), the outputs are plain greedy decoding's, and early launches
    were used (never across a plain step, the abort or a finished row, where one launched early would be
    stale)."""
    main, dspark = _tiny_pair()
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 400, (n,), generator=g).tolist() for n in (6, 23, 41, 29)]
    max_tokens = [24, 30, 22, 18]
    plain = [Engine(main).generate([p], max_tokens=m)[0] for p, m in zip(prompts, max_tokens)]
    monkeypatch.setattr(Engine, "_worth_drafting", _draft_mostly)
    runs, abort_at = {}, None
    for early in (True, False):
        drafter = DSparkDrafter(dspark, max_sequences=6)
        assert drafter.pure_propose
        engine = Engine(main, drafter=drafter if early else _Impure(drafter), max_batch=4, max_seq_len=128,
                        step_time=StepTimeCurve([(1, 1.0)]))
        verified = _record_verified(engine)
        seqs = [engine.add_request(p, SamplingParams(max_tokens=m)) for p, m in zip(prompts[:3], max_tokens)]
        steps, freed = 0, None
        while engine.has_work():
            engine.step()
            steps += 1
            if freed is not None:  # the aborted row's slot, once the step after the abort ran: clean
                pools = engine.pools
                assert freed in pools._free_slots and bool((pools.ring_positions[:, freed] == -1).all())
                assert all(not p.pending_kv[freed].any() and not p.pending_score[freed].any()
                           for p in pools.sources.values() if p.pending_kv is not None)
                freed = None
            if abort_at is None and steps >= 3 and engine._chained is not None and seqs[0] in engine._chained.seqs:
                abort_at = steps  # the early run picks the moment: a launched verification holds the row
            if steps == abort_at:
                freed = seqs[0].cache.slot
                engine.abort(seqs[0])
            if abort_at is not None and steps == abort_at + 2:
                seqs.append(engine.add_request(prompts[3], SamplingParams(max_tokens=max_tokens[3])))
        runs[early] = ([s.output for s in seqs], verified, engine.stats.speculative)
    (outputs_early, verified_early, stats_early), (outputs, verified, stats) = runs[True], runs[False]
    assert outputs_early == outputs
    assert outputs[1:] == plain[1:] and outputs[0] == plain[0][:len(outputs[0])] and len(outputs[0]) < max_tokens[0]
    assert verified_early == verified and len(verified) >= 10
    assert stats.chained == stats.prelaunched == stats.chain_cancelled == 0
    assert stats_early.chained >= 3 and stats_early.chain_cancelled == 1  # the abort's
    assert stats_early.chained + stats_early.prelaunched < stats_early.forwards == stats.forwards


def test_a_proposal_launched_early_is_not_used_after_a_plain_step(monkeypatch):
    """Rows asking for log-probabilities get only their next proposal launched early (not the verification:
    the logits buffer is shared). When the cost model, asked again at the next step, decodes plainly, that
    proposal is stale by the step after — its rows moved — and is dropped: with the end-of-step question always
    answered "draft", and the start-of-step one as in a run without early launches, both runs verify the same
    drafts, and some early proposals were used, some dropped."""
    main, dspark = _tiny_pair()
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 400, (n,), generator=g).tolist() for n in (7, 26)]
    chain = Engine._chain

    def chain_asking(self, seqs, plans, early=None):
        self.asked_at_end = True
        try:
            return chain(self, seqs, plans, early)
        finally:
            self.asked_at_end = False
    monkeypatch.setattr(Engine, "_chain", chain_asking)
    monkeypatch.setattr(Engine, "_worth_drafting",
                        lambda self, seqs: getattr(self, "asked_at_end", False) or _draft_mostly(self, seqs))
    runs = {}
    for early in (True, False):
        drafter = DSparkDrafter(dspark, max_sequences=4)
        engine = Engine(main, drafter=drafter if early else _Impure(drafter), max_batch=2, max_seq_len=128,
                        step_time=StepTimeCurve([(1, 1.0)]))
        verified = _record_verified(engine)
        seqs = [engine.add_request(p, SamplingParams(max_tokens=30, logprobs=1)) for p in prompts]
        while engine.has_work():
            engine.step()
        runs[early] = ([s.output for s in seqs], verified, engine.stats.speculative)
    (outputs_early, verified_early, stats_early), (outputs, verified, stats) = runs[True], runs[False]
    assert outputs_early == outputs
    assert verified_early == verified and stats.plain_steps == stats_early.plain_steps >= 2
    assert stats_early.chained == 0 and 0 < stats_early.prelaunched < stats_early.forwards == stats.forwards


def test_an_undone_launched_verification_leaves_the_caches_as_they_were():
    """A launched verification whose rows left the schedule before it was used (a caller paused them) is undone
    by the next step (`_cancel_chain`): every cache holds the bytes it held before the launch — rings, entries,
    index keys, partial groups, token ids, pages — and the pools the same free pages; resumed, the rows go on
    to plain greedy decoding's tokens."""
    from tests.engine.test_speculative import cache_bytes

    main, dspark = _tiny_pair()
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, 400, (n,), generator=g).tolist() for n in (9, 30)]
    engine = Engine(main, drafter=DSparkDrafter(dspark, max_sequences=4), max_batch=2, max_seq_len=128,
                    step_time=StepTimeCurve([(1, 1.0)]), speculate="always")
    before = {}
    chain = engine._chain

    def snapshot(seqs, plans, early=None):  # on the CPU the step's own rollback is done by now
        before.clear()
        before.update({s.id: cache_bytes(engine.pools, s.cache) for s in seqs})
        before["free"] = engine.free_pages()
        return chain(seqs, plans, early)
    engine._chain = snapshot
    seqs = [engine.add_request(p, SamplingParams(max_tokens=40)) for p in prompts]
    while engine._chained is None:
        engine.step()
    assert engine.free_pages() != before["free"] or any(
        not torch.equal(cache_bytes(engine.pools, s.cache)["ring_positions"], before[s.id]["ring_positions"])
        for s in seqs)  # the launched verification wrote the caches
    paused = list(engine.scheduler.running)  # a caller takes the rows out of the schedule (`Rollout.interrupt`)
    engine.scheduler.running.clear()
    engine.step()  # the launched verification's rows are not scheduled: it is undone, nothing else runs
    assert engine._chained is None and engine.stats.speculative.chain_cancelled == 1
    assert engine.free_pages() == before["free"]
    for s in seqs:
        after = cache_bytes(engine.pools, s.cache)
        assert after.keys() == before[s.id].keys()
        for name, value in after.items():
            assert torch.equal(value, before[s.id][name]), (s.id, name)
    engine.scheduler.running[:0] = paused  # resumed: they go on to plain greedy decoding's tokens
    while engine.has_work():
        engine.step()
    assert [s.output for s in seqs] == [Engine(main).generate([p], max_tokens=40)[0] for p in prompts]


def _record_verified(engine: Engine) -> list:
    """The drafts of every static verification `engine` runs from now on, appended to the returned list."""
    verified, fetch, accept = [], engine._fetch_proposal, engine._accept_on_device

    def recording(prop, drafts, logits):
        out = fetch(prop, drafts, logits)
        verified.append(out[0])
        return out

    def accepting(*args):  # the device's acceptance: the drafts come with its one read
        accepted = accept(*args)
        wait = accepted.wait

        def recorded():
            out = wait()
            verified.append(out[0])
            return out
        accepted.wait = recorded
        return accepted
    engine._fetch_proposal, engine._accept_on_device = recording, accepting
    return verified


class _Impure:
    """A DSparkDrafter whose proposals the engine must not launch early (`pure_propose` False)."""

    pure_propose = False

    def __init__(self, drafter):
        self._drafter = drafter

    def __getattr__(self, name):
        return getattr(self._drafter, name)


class _HostAccepting(_Impure):
    """A DSparkDrafter whose hand-over counts come from the host only: the engine reads each verification before
    its acceptance, rollback and hand-over (no `observe_many_device`), and launches proposals early as before."""

    pure_propose = True

    def __getattr__(self, name):
        if name in ("observe_many_device", "observed_more"):
            raise AttributeError(name)
        return getattr(self._drafter, name)


def test_greedy_acceptance_on_the_device_keeps_what_the_host_would():
    """Greedy verifications accept on the device (`Engine._accept_on_device`): the rollback, the drafter's
    hand-over and the next proposal are queued before the host reads the step. Against the same run reading
    first (`_HostAccepting`): the same drafts verified, the same outputs (plain greedy decoding's), and every
    finishing sequence's cache — window rings, entries, partial groups, token ids, pages: what the prefix cache
    saves — byte-equal when it finishes. One row stops on a token it accepted as a draft, so the device kept a
    position the emission drops: the rollback runs again from the same snapshot (`_settle_on_device`), and the
    other rows keep their rows of the proposal launched before the stop was known (`_Prelaunched.rows`)."""
    from tests.engine.test_speculative import cache_bytes

    main, dspark = _tiny_pair()
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 400, (n,), generator=g).tolist() for n in (6, 23, 41)]
    max_tokens = [30, 30, 26]
    plain = [Engine(main).generate([p], max_tokens=m)[0] for p, m in zip(prompts, max_tokens)]

    def run(drafter, stop: list[int]):
        engine = Engine(main, drafter=drafter, max_batch=4, max_seq_len=128, step_time=StepTimeCurve([(1, 1.0)]),
                        speculate="always")
        verified, finished, settled = _record_verified(engine), {}, []
        finish, settle = engine._finish, engine._settle_on_device

        def finishing(seq):
            finished[seq.id - seqs[0].id] = cache_bytes(engine.pools, seq.cache)
            return finish(seq)

        def settling(seqs_, starts, kept, device_keep):
            settled.append((kept, device_keep))
            return settle(seqs_, starts, kept, device_keep)
        engine._finish, engine._settle_on_device = finishing, settling
        params = [SamplingParams(max_tokens=m, stop_token_ids=stop if i == 0 else []) for i, m in enumerate(max_tokens)]
        seqs = [engine.add_request(p, prm) for p, prm in zip(prompts, params)]
        while engine.has_work():
            engine.step()
        return [s.output for s in seqs], verified, finished, settled, engine.stats.speculative

    # a token row 0 accepts as its first draft, not emitted before: stopping on it cuts a block the device kept
    outputs, verified, _, settled, _ = run(DSparkDrafter(dspark, max_sequences=4), [])
    assert outputs == plain
    first = next(d[0][0] for d, (kept, _) in zip(verified, settled) if kept[0] >= 2 and d[0][0] not in
                 plain[0][:plain[0].index(d[0][0])])
    device = run(DSparkDrafter(dspark, max_sequences=4), [first])
    host = run(_HostAccepting(DSparkDrafter(dspark, max_sequences=4)), [first])
    assert device[0] == host[0] and device[0][1:] == plain[1:] and device[0][0] == plain[0][:plain[0].index(first)]
    assert device[1] == host[1] and len(device[1]) >= 10  # the same drafts, step by step
    assert host[3] == [] and any(kept != keep for kept, keep in device[3])  # the re-run rollback happened
    assert sorted(device[2]) == sorted(host[2]) == [0, 1, 2]
    for i in range(3):
        for name, value in host[2][i].items():
            assert torch.equal(device[2][i][name], value), (i, name)
    assert device[4].prelaunched > 0 and device[4].forwards == host[4].forwards


class _OutOfVocabulary(_Impure):
    """A DSparkDrafter whose second draft is an id past the vocabulary wherever the anchor is a multiple of 3 —
    a function of the anchors: proposals launched early stay valid (`pure_propose`)."""

    pure_propose = True

    def propose(self, seq_ids, last_tokens):
        prop = self._drafter.propose(seq_ids, last_tokens)
        tokens = prop.tokens.clone()
        tokens[:, 1] = torch.where(last_tokens.reshape(-1) % 3 == 0, 10 ** 6, tokens[:, 1])
        return type(prop)(tokens=tokens, confidence=prop.confidence)


def test_rows_proposing_ids_outside_the_vocabulary_verify_nothing_on_the_device_either():
    """The device's acceptance verifies no draft of a row whose proposal held an id outside the vocabulary — not
    even the valid drafts before it (the host's rule; its ids are clamped into the vocabulary for the forward):
    the same drafts verified, tokens emitted and acceptances as the run reading first."""
    main, dspark = _tiny_pair()
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 400, (n,), generator=g).tolist() for n in (6, 23, 41)]
    plain = [Engine(main).generate([p], max_tokens=24)[0] for p in prompts]
    runs = []
    for device in (True, False):
        drafter = _OutOfVocabulary(DSparkDrafter(dspark, max_sequences=4))
        engine = Engine(main, drafter=drafter if device else _HostAccepting(drafter), max_batch=4, max_seq_len=128,
                        step_time=StepTimeCurve([(1, 1.0)]), speculate="always")
        verified, seen = _record_verified(engine), []
        settle = engine._settle_on_device
        engine._settle_on_device = lambda *a, seen=seen, settle=settle: (seen.append(a[3]), settle(*a))[1]
        assert engine.generate(prompts, max_tokens=24) == plain
        runs.append((verified, seen, engine.stats.speculative.accepted))
    (verified_d, seen_d, accepted_d), (verified_h, seen_h, accepted_h) = runs
    assert verified_d == verified_h and accepted_d == accepted_h > 0 and seen_h == []
    clamped = [(d, keep) for step, keeps in zip(verified_d, seen_d) for d, keep in zip(step, keeps)
               if d[1] == dspark.config.vocab_size - 1]
    assert clamped and all(keep == 1 for _, keep in clamped)  # a clamped row keeps its pending token only
