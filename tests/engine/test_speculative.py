"""Speculative decoding in the engine (`tiny`, CPU): rollback leaves the bytes of a run that never saw the
rejected tokens; greedy speculation = plain greedy on 100 prompts; sampled speculation draws every token
from plain sampling's conditional distribution; full / no acceptance; prefix cache; drafter features."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tests.conftest import engine_test_model

from dsv41.engine.block_manager import BlockManager
from dsv41.engine.cache import SequenceCache
from dsv41.engine.engine import Engine
from dsv41.engine.prefill import prefill
from dsv41.engine.prefix import PrefixCache
from dsv41.engine.prefix_store import InProcessSWAPool, PersistentStore
from dsv41.engine.runner import Capture, DecodeIO, Runner
from dsv41.engine.sampling import SamplingParams, sampling_probs
from dsv41.engine.speculative import CostModel, NoisyDrafter, OracleDrafter, Proposal, StepTimeCurve, VerifyRollback

FLAT = StepTimeCurve([(1, 1.0)])  # memory-bound: the scheduler verifies every draft it may


class ScriptedDrafter:
    """Proposes the continuation a plain greedy run produced (the main model's own greedy output, recorded),
    padded with a fixed token past its end. Wrapped in NoisyDrafter it is a corrupted oracle that costs
    no model."""

    pure_propose = True  # its proposals follow from what it observed: the engine may launch them early

    def __init__(self, k: int, continuations: dict[tuple[int, ...], list[int]]):
        self.k, self.continuations = k, continuations
        self.history: dict[int, list[int]] = {}
        self.script: dict[int, list[int]] = {}

    def features_wanted(self) -> list[int]:
        return []

    def start(self, seq_id: int) -> None:
        self.history[seq_id] = []

    def observe(self, seq_id: int, tokens, features) -> None:
        if not self.history[seq_id]:
            self.script[seq_id] = list(tokens.tolist()) + self.continuations[tuple(tokens.tolist())]
        self.history[seq_id] += tokens.tolist()

    def propose(self, seq_ids, last_tokens) -> Proposal:
        rows = []
        for i in seq_ids:
            n = len(self.history[i]) + 1  # the pending token sits at position n − 1
            rows.append((self.script[i][n:n + self.k] + [7] * self.k)[:self.k])
        tokens = torch.tensor(rows)
        return Proposal(tokens, torch.full(tokens.shape, 0.9))

    def finish(self, seq_id: int) -> None:
        self.history.pop(seq_id)


def cache_bytes(pools: BlockManager, cache: SequenceCache) -> dict[str, torch.Tensor]:
    """Everything of one sequence a later step can read: its ring slots (rows and positions) in every
    layer, its packed entries and index keys, the live part of its partial groups, its token ids, its pages."""
    out = {"ring_rows": pools.ring_rows[:, cache.slot].clone(), "tokens": torch.tensor(cache.tokens),
           "ring_positions": pools.ring_positions[:, cache.slot].clone()}
    for s, store in cache.entry_stores.items():
        out[f"{s}.kv"] = store.kv.read().clone()
        out[f"{s}.index"] = store.index_k.read().clone()
        out[f"{s}.pages"] = torch.tensor(len(cache.pages[s]))
    for s, (kv, score) in cache.pending.items():
        out[f"{s}.pending_kv"], out[f"{s}.pending_score"] = kv.clone(), score.clone()
    return out


@pytest.mark.parametrize("path", ["host", "static"])  # Runner.forward / the static verification step (DecodeIO T = 5)
@pytest.mark.parametrize("prompt_len", [37, 38])  # the ratio-2 sources' partial group is open / closed at the start
def test_rollback_leaves_the_bytes_of_a_run_that_never_saw_the_rejected_tokens(prompt_len, path):
    """Rows keep 0..5 of a 5-token verification block. (1) Twin rows, verified in the same batched forward
    with other tokens after the kept prefix, end byte-identical in every quantized cache, their fp32 partial
    groups equal up to the row-position rounding of a CPU GEMM: the rejected tokens leave no trace. (2) A run
    that never saw them (plain decode steps of the kept tokens) holds the same bytes in every quantized cache
    (FP8 rings, FP4 entries and index keys), positions, token ids and pages; its fp32 partial-group projections
    differ only by matmul rounding (1-row vs T-row products), and one more step gives the same logits. The
    block runs through the host-driven forward or through the engine's static verification step (entry rows
    reserved by the host, partial groups continued branch-free on the device)."""
    torch.manual_seed(prompt_len)
    model = engine_test_model(prompt_len)
    c = model.config
    runner = Runner(model)
    keeps = [0, 1, 2, 3, 4, 5]  # block tokens each row keeps (5 = everything)
    n, T = len(keeps), 5
    pools = BlockManager(c, "cpu", max_slots=3 * n, max_tokens=3 * n * 128, max_seq_len=128, page_rows=4)
    io = DecodeIO(c, pools, n)
    g = torch.Generator().manual_seed(prompt_len)
    prompt = torch.randint(3, c.vocab_size, (prompt_len,), generator=g).tolist()
    block = torch.randint(3, c.vocab_size, (n, T), generator=g)  # rows differ: different drafts
    twin = torch.randint(3, c.vocab_size, (n, T), generator=g)
    for b, keep in enumerate(keeps):
        twin[b, :keep] = block[b, :keep]  # the same kept prefix, other rejected tokens
    first = SequenceCache(c, pools=pools)
    prefill(runner, first, prompt)  # W < prompt_len: the ring has wrapped
    state = first.swap_out()  # bit-exact copies of one prefill for every row

    def copy() -> SequenceCache:
        cache = SequenceCache(c, pools=pools)
        cache.release()
        cache.swap_in(state)
        cache.tokens = list(prompt)
        return cache

    spec, twins, ref = ([copy() for _ in keeps] for _ in range(3))
    # one batched verification of T positions per row, then each row keeps its own prefix
    rows = spec + twins
    starts = [s.n_tokens for s in rows]
    rollback = VerifyRollback(pools, rows, starts, T) if path == "host" else None
    tokens = torch.cat((block, twin))
    if path == "host":
        capture = Capture(projections=True)
        runner.forward(rows, tokens, starts, range(c.n_layers), capture=capture)
        projections = capture.kv_projections
    else:
        vio = DecodeIO(c, pools, 2 * n, T, projections=True, rollback=True)  # the step snapshots, as the engine's
        vio.fill_batch(rows, tokens.tolist())
        vio.send()
        runner.decode(vio, 2 * n, vio.max_entries(2 * n))
        projections = vio.projections
        assert projections and all(kv.shape == (2 * n, T, c.head_dim) for kv, _ in projections.values())
    for cache, row in zip(rows, tokens.tolist()):
        cache.tokens.extend(row)
    whole = keeps.index(T)  # the row that keeps every block token: its state before the rollback is final
    before = {name: t for name, t in cache_bytes(pools, spec[whole]).items() if ".pending_" in name}
    if rollback is not None:
        rollback.restore(keeps + keeps, projections)
    else:  # the device half (what the engine replays from a graph), then the host's truncation
        vio.send_keep(keeps + keeps)
        runner.restore(vio, 2 * n)
        for cache, start, keep in zip(rows, starts, keeps + keeps):
            cache.truncate(start + keep)
    # the reference never sees the rejected tokens: plain decode steps (the static step) of the kept ones
    for b, keep in enumerate(keeps):
        for t in block[b, :keep].tolist():
            io.fill_batch([ref[b]], [t])
            io.send()
            runner.decode(io, 1, io.max_entries(1))
            ref[b].tokens.append(t)
    for b, keep in enumerate(keeps):
        got, other, want = cache_bytes(pools, spec[b]), cache_bytes(pools, twins[b]), cache_bytes(pools, ref[b])
        assert got.keys() == want.keys() == other.keys(), (b, got.keys() ^ want.keys())
        for name in want:
            if ".pending_" in name:  # fp32: a row's matmul result may depend on its row index (CPU GEMM tiling)
                err = ((got[name] - other[name]).abs().max() / other[name].abs().max()).item()
                assert err < 1e-6, f"row keeping {keep}: {name} rel err {err:.2e} vs its twin"
            else:
                n_diff = (got[name] != other[name]).sum().item()
                assert torch.equal(got[name], other[name]), \
                    f"row keeping {keep}: {name} differs from its twin in {n_diff}"
            if ".pending_" in name:
                err = ((got[name] - want[name]).abs().max() / want[name].abs().max()).item()
                assert err < 1e-6, f"row keeping {keep}: {name} rel err {err:.2e} vs plain decode"
            else:
                assert torch.equal(got[name], want[name]), \
                    f"row keeping {keep}: {name} differs in {(got[name] != want[name]).sum().item()} elements"
    # the step alone (no rollback) continued the partial groups as T plain steps do
    want = cache_bytes(pools, ref[whole])
    for name, got in before.items():
        err = ((got - want[name]).abs().max() / want[name].abs().max()).item()
        assert err < 1e-6, f"{path} step: {name} before the rollback, rel err {err:.2e} vs plain decode"
    # all continue alike: one more plain step on every row
    nxt = torch.randint(3, c.vocab_size, (n,), generator=g).tolist()
    logits = []
    for caches in (spec, twins, ref):
        io.fill_batch(caches, nxt)
        io.send()
        logits.append(runner.decode(io, n, io.max_entries(n)).clone())
    twin_err = ((logits[0] - logits[1]).abs().max() / logits[1].abs().max()).item()
    assert twin_err < 1e-6, f"next-step logits rel err {twin_err:.2e} vs the twins"
    err = ((logits[0] - logits[2]).abs().max() / logits[2].abs().max()).item()
    assert err < 1e-5, f"next-step logits rel err {err:.2e}"


def _prompts(model, n: int, seed: int) -> tuple[list[list[int]], list[int]]:
    g = torch.Generator().manual_seed(seed)
    W = model.config.window_size
    lengths = torch.randint(1, W + 13, (n,), generator=g).tolist()  # mixed, some past the window
    prompts = [torch.randint(3, model.config.vocab_size, (m,), generator=g).tolist() for m in lengths]
    return prompts, torch.randint(1, 9, (n,), generator=g).tolist()


def _run(engine: Engine, prompts, max_tokens, stops=None) -> list[tuple[list[int], str]]:
    stops = stops or [[] for _ in prompts]
    seqs = [engine.add_request(p, SamplingParams(max_tokens=m, stop_token_ids=s))
            for p, m, s in zip(prompts, max_tokens, stops)]
    while engine.has_work():
        engine.step()
    return [(s.output, s.finish_reason) for s in seqs]


def test_greedy_with_the_noisy_drafter_equals_plain_decode_on_100_prompts():
    """100 prompts of 1–44 tokens (W = 32), 1–8 new tokens each, a third of them with a stop id their
    plain output reaches, batched 50 at a time; drafts = the plain continuation corrupted at 35 % of the
    positions (partial acceptance, mixed verification lengths and finishes inside a block)."""
    model = engine_test_model(41)
    prompts, max_tokens = _prompts(model, 100, 41)
    plain = _run(Engine(model, max_batch=50, max_seq_len=128), prompts, max_tokens)
    # a stop id inside the plain output for every third prompt (plain decoding with it stops there)
    stops = [[out[len(out) // 2]] if i % 3 == 0 and len(out) > 1 else [] for i, (out, _) in enumerate(plain)]
    expected = []
    for (out, reason), stop in zip(plain, stops):
        cut = out.index(stop[0]) if stop else len(out)
        expected.append((out[:cut], "stop" if stop else reason))
    drafter = NoisyDrafter(model.config.vocab_size, 4, base=ScriptedDrafter(4, {tuple(p): o for p, (o, _) in
                                                                                  zip(prompts, plain)}), noise=0.35)
    engine = Engine(model, max_batch=50, max_seq_len=128, drafter=drafter, step_time=FLAT)
    got = _run(engine, prompts, max_tokens, stops)
    wrong = [i for i, (a, b) in enumerate(zip(got, expected)) if a != b]
    assert not wrong, f"{len(wrong)} prompts differ, first {wrong[0]}: {got[wrong[0]]} vs {expected[wrong[0]]}"
    st = engine.stats.speculative
    hist = st.histogram
    assert hist[0] > 0 and sum(hist[1:-1]) > 0 and hist[-1] > 0, hist  # none, some and all accepted
    assert len(set(i for i, n in enumerate(st.length_histogram) if n)) >= 3, st.length_histogram
    assert sum(len(o) for o, _ in got) + sum(r == "stop" for _, r in got) == st.emitted + st.plain_tokens + len(prompts)


def test_the_oracle_drafts_are_all_accepted_and_random_drafts_none():
    model = engine_test_model(43)
    prompts, _ = _prompts(model, 3, 43)
    plain = _run(Engine(model, max_batch=3, max_seq_len=128), prompts, [9] * 3)
    oracle = Engine(model, max_batch=3, max_seq_len=128, drafter=OracleDrafter(model, 4, max_sequences=3,
                                                                                 max_seq_len=128), step_time=FLAT)
    assert _run(oracle, prompts, [9] * 3) == plain
    st = oracle.stats.speculative
    assert st.accepted == st.drafted > 0, st.summary()
    seq = oracle.add_request(prompts[0], SamplingParams(max_tokens=11))  # 1 from prefill, then 5 + 5
    while oracle.has_work():
        oracle.step()
    assert seq.spec_tokens == 5.0  # its own average: k + 1 per verification, the finishing one not counted
    random = Engine(model, max_batch=3, max_seq_len=128, drafter=NoisyDrafter(model.config.vocab_size, 4),
                    step_time=FLAT)
    assert _run(random, prompts, [9] * 3) == plain
    st = random.stats.speculative
    assert st.accepted == 0 and st.drafted > 0 and st.histogram[0] == st.verifications, st.summary()


def test_the_static_step_verifies_every_draft_it_computed_even_on_a_steep_curve():
    """The static verification step computes k + 1 positions whatever the lengths: shortening them after the
    forward (what `choose_lengths` would do on a compute-bound, steep step-time curve) would only throw
    accepted drafts away. With the oracle every row verifies its whole cap and accepts all of it."""
    model = engine_test_model(44)
    prompts, _ = _prompts(model, 3, 44)
    plain = _run(Engine(model, max_batch=3, max_seq_len=128), prompts, [13] * 3)
    steep = StepTimeCurve([(1, 1.0), (1000, 1000.0)])  # a step costs its tokens: the scheduler would verify none
    engine = Engine(model, max_batch=3, max_seq_len=128, drafter=OracleDrafter(model, 4, max_sequences=3,
                                                                                 max_seq_len=128),
                    step_time=steep, speculate="always")
    assert engine.vio is not None  # the static step
    assert _run(engine, prompts, [13] * 3) == plain
    st = engine.stats.speculative
    # 12 tokens after the prefill's first: verifications of 4 + 1, 4 + 1, then a cap of 1 (tokens left − 1)
    assert st.length_histogram[4] == 2 * len(prompts), st.length_histogram
    assert st.accepted == st.drafted == sum(n * c for n, c in enumerate(st.length_histogram)), st.summary()


def test_sampled_speculation_draws_every_token_from_plain_samplings_conditional():
    """Each token of a sampled speculative run must be distributed as p(· | the tokens before it), the
    distribution plain sampling draws from (temperature 1.2, top-k 8, from the full forward of the
    model: exact prefill makes the engine's cached forward the same function). Randomized probability
    integral transform: u = F(x − 1) + v·p(x), v ~ U(0, 1), is i.i.d. uniform iff every x ~ p — tested by
    χ² over 10 bins on 32 sequences × 40 tokens, with a random proposal distribution q ≠ p. And the
    probability of the emitted token, Σ_t p_t(x_t), against its exact mean Σ_t Σ_y p_t(y)² and variance
    (a martingale: |z| < 4), and how often tokens with p < 0.1 are emitted against their exact share — both
    sensitive to low-probability tokens emitted too often (a biased acceptance)."""
    V = 12
    model = engine_test_model(45, vocab_size=V)
    with torch.no_grad():
        model.head.weight.mul_(6.0)  # peaked, varied distributions (a random tiny head is near uniform)
    params = [SamplingParams(temperature=1.2, top_k=8, max_tokens=40, seed=100 + i) for i in range(32)]
    drafter = NoisyDrafter(V, 4, distribution=True, noise=1.0, seed=3)
    engine = Engine(model, max_batch=32, max_seq_len=128, drafter=drafter, step_time=FLAT)
    g = torch.Generator().manual_seed(45)
    prompts = [torch.randint(3, V, (int(n),), generator=g).tolist() for n in torch.randint(1, 6, (32,), generator=g)]
    seqs = [engine.add_request(p, prm, exact_prefill=True) for p, prm in zip(prompts, params)]
    while engine.has_work():
        engine.step()
    st = engine.stats.speculative
    assert 0 < st.accepted < st.drafted, st.summary()  # drafts tested, some accepted, some replaced
    u_all, z_num, z_var, tail_num, tail_var = [], 0.0, 0.0, 0.0, 0.0
    for seq, prm in zip(seqs, params):
        full = torch.tensor([seq.prompt + seq.output])
        with torch.no_grad():
            logits = model(full)[0, len(seq.prompt) - 1:-1].double()  # (n_out, V): p of each emitted token
        p = sampling_probs(logits.float(), [prm] * logits.size(0)).double()
        x = torch.tensor(seq.output)
        px = p.gather(1, x.unsqueeze(1)).squeeze(1)
        assert bool((px > 0).all()), f"a token outside top-k / with probability 0 was emitted: {px.min()}"
        below = (p.cumsum(1) - p).gather(1, x.unsqueeze(1)).squeeze(1)
        v = torch.rand(len(x), generator=g, dtype=torch.float64)
        u_all.append(below + v * px)
        mean, second = (p ** 2).sum(1), (p ** 3).sum(1)  # E p(x), E p(x)² under x ~ p
        z_num += float((px - mean).sum())
        z_var += float((second - mean ** 2).sum())
        tail = (p * (p < 0.1)).sum(1)  # P(p(x) < 0.1) under x ~ p: the rare tokens' share
        tail_num += float(((px < 0.1).double() - tail).sum())
        tail_var += float((tail * (1 - tail)).sum())
    u = torch.cat(u_all).numpy()
    counts = np.bincount(np.minimum((u * 10).astype(int), 9), minlength=10)
    expected = len(u) / 10
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 27.88, f"chi2 {chi2:.1f} (df 9) over {len(u)} tokens; bins {counts}"  # p = 0.001
    z, z_tail = z_num / z_var ** 0.5, tail_num / tail_var ** 0.5
    print(f"chi2 {chi2:.1f}, z {z:.2f}, z_tail {z_tail:.2f} over {len(u)} tokens")
    assert abs(z) < 4, f"the emitted tokens' probability is off by z = {z:.2f} over {len(u)} tokens"
    assert abs(z_tail) < 4, f"tokens with p < 0.1 emitted off their share by z = {z_tail:.2f} over {len(u)} tokens"


def test_a_prefix_save_after_speculation_stores_only_accepted_tokens(tmp_path):
    model = engine_test_model(47)
    W = model.config.window_size
    g = torch.Generator().manual_seed(47)
    first = torch.randint(3, model.config.vocab_size, (2 * W + 5,), generator=g).tolist()
    follow = torch.randint(3, model.config.vocab_size, (W + 3,), generator=g).tolist()
    cold = Engine(model, max_batch=1, max_seq_len=256)
    plain1 = cold.generate([first], max_tokens=9)[0]
    turn2 = first + plain1 + follow
    plain2 = cold.generate([turn2], max_tokens=8)[0]
    cache = PrefixCache(model.config, PersistentStore(tmp_path), InProcessSWAPool())
    saved = []
    save = cache.save
    cache.save = lambda seq, ends, **kw: (saved.append((list(seq.tokens), list(ends))), save(seq, ends, **kw))[1]
    script = ScriptedDrafter(4, {tuple(first): plain1, tuple(turn2): plain2})
    drafter = NoisyDrafter(model.config.vocab_size, 4, base=script, noise=0.3, seed=5)
    engine = Engine(model, max_batch=1, max_seq_len=256, prefix_cache=cache, drafter=drafter, step_time=FLAT)
    out1 = _run(engine, [first], [9])[0][0]
    assert out1 == plain1 and 0 < engine.stats.speculative.accepted < engine.stats.speculative.drafted
    assert saved[-1] == (first + out1[:-1], [len(first) + len(out1) - 1])  # what plain decoding held at the end
    warm = engine.add_request(turn2, SamplingParams(max_tokens=8))
    while not warm.finished:
        engine.step()
    assert warm.cached_tokens >= len(first) + len(out1) - 1 - cache.lcm  # resumed from the speculative run's save
    assert warm.output == plain2


@pytest.mark.parametrize("many", [False, True])  # the drafter has observe_many: batched hand-overs and catch-ups
@pytest.mark.parametrize("plain", [False, True])  # True: two of three steps decode plainly (the cost model's choice)
def test_the_drafter_sees_committed_tokens_and_the_main_models_hidden_states(plain, many):
    """Every committed token reaches the drafter once, in order, with the main model's hidden states at its
    position — also tokens decoded by plain steps, which the drafter catches up on from the feature ring."""
    model = engine_test_model(49)
    c = model.config
    layers = [c.n_layers - 2, c.n_layers - 1]
    seen: list[tuple[list[int], dict]] = []

    class Recording(NoisyDrafter):
        def features_wanted(self):
            return layers

        def observe(self, seq_id, tokens, features):
            seen.append((tokens.tolist(), {i: f.clone() for i, f in features.items()}))

    class RecordingMany(Recording):
        def observe_many(self, seq_ids, tokens, features, keep):
            for b, n in enumerate(keep):
                if n:
                    self.observe(seq_ids[b], tokens[b, :n], {i: f[b, :n] for i, f in features.items()})

    prompt = torch.randint(3, c.vocab_size, (11,), generator=torch.Generator().manual_seed(49)).tolist()
    drafter = (RecordingMany if many else Recording)(c.vocab_size, 3, base=None, noise=0.5)
    # plain=False drafts every step (speculate="always"): under "auto" the cost model measures real step times and
    # this bad drafter (nothing accepted) loses, so on a loaded CPU it once decoded plainly there (a flaky test)
    engine = Engine(model, max_batch=1, max_seq_len=128, drafter=drafter, step_time=FLAT,
                    speculate="auto" if plain else "always")
    if plain:
        turns = iter([True, False, False] * 20)
        engine._worth_drafting = lambda seqs: next(turns)
    out = _run(engine, [prompt], [24 if plain else 9])[0][0]
    assert (engine.stats.speculative.plain_steps > 3) == plain
    committed = [t for tokens, _ in seen for t in tokens]
    # every verification but the finishing one reports its kept tokens
    assert committed == (prompt + out)[:len(committed)] and len(committed) > len(prompt)
    # reference: the block outputs of the full forward, mean over the streams (prompt < W: prefill is exact)
    hooks, ref = [], {}
    for i in layers:
        hooks.append(model.layers[i].register_forward_hook(
            lambda mod, args, output, i=i: ref.__setitem__(i, output[0].mean(dim=2)[0])))
    with torch.no_grad():
        model(torch.tensor([committed]))
    for h in hooks:
        h.remove()
    pos = 0
    for tokens, feats in seen:
        for i in layers:
            assert feats[i].shape == (len(tokens), c.dim), (i, feats[i].shape)
            want = ref[i][pos:pos + len(tokens)]
            err = ((feats[i] - want).abs().max() / want.abs().max()).item()
            assert err < 1e-4, f"layer {i} at {pos}: rel err {err:.2e}"
        pos += len(tokens)


def test_a_swapped_out_state_survives_its_slot_being_reused():
    """swap_out on the CPU copies (`.cpu()` alone returns views: the slot's next owner overwrote the state)."""
    model = engine_test_model(51)
    c = model.config
    runner = Runner(model)
    pools = BlockManager(c, "cpu", max_slots=1, max_tokens=128, max_seq_len=128)
    prompt = torch.randint(3, c.vocab_size, (37,), generator=torch.Generator().manual_seed(51)).tolist()
    a = SequenceCache(c, pools=pools)
    prefill(runner, a, prompt)
    before = cache_bytes(pools, a)
    state = a.swap_out()
    b = SequenceCache(c, pools=pools)  # takes the same slot and clears it
    prefill(runner, b, prompt[::-1])
    b.release()
    a.swap_in(state)
    after = cache_bytes(pools, a)
    assert all(torch.equal(before[k], after[k]) for k in before), [k for k in before if not torch.equal(before[k],
                                                                                                          after[k])]


def test_the_cost_model_drafts_only_where_measured_speculative_steps_beat_plain_ones():
    """`CostModel` (speculate="auto"), by hand: per batch bucket, tokens per row per second of speculative steps
    (median time of the last 5 counted, tokens a moving average over every bucket) against plain steps
    (median, or the profiled curve until one is counted); a bucket's first step of each kind is not counted
    (graph capture); drafts until 2 speculative steps are counted; probes after 32 plain steps in a row; the
    rows' own tokens per verification, where known, replace the average."""
    model = CostModel(FLAT)  # the curve: 1 s per step of any size
    assert model.worth_drafting(8)  # nothing measured: draft
    model.record("spec", 8, 8, 50.0, 8)  # the capture step: not counted
    assert model.worth_drafting(8) and model.tokens is None
    for t in (0.004, 0.1):  # one slow step among them (a hand-over graph captured, say)
        assert model.worth_drafting(8)  # fewer than 2 counted: still measuring
        model.record("spec", 8, 8, 8 * t, 8 * 2.0)  # 2 tokens per row
    assert model.median("spec", 8) == pytest.approx(0.052)
    model.record("spec", 8, 8, 8 * 0.004, 8 * 2.0)
    assert model.median("spec", 8) == 0.004 and model.tokens == 2.0  # 500 tokens/s per row
    assert CostModel.row_average(None, 4) == 4.0 and CostModel.row_average(4.0, 1) == pytest.approx(3.1)
    # no plain step counted yet: the curve (1 s per step of 8 rows = 0.125 s per row) is far slower
    assert model.worth_drafting(8)
    model.record("plain", 8, 8, 1.0, 8)  # the capture step: not counted
    model.record("plain", 8, 8, 8 * 0.0025, 8)  # 400 tokens/s per row: speculation still wins
    assert model.worth_drafting(8)
    model.record("plain", 8, 8, 8 * 0.0015, 8)  # median of 2.5 and 1.5 ms = 2.0 ms: 500 tokens/s, not more
    assert not model.worth_drafting(8)
    model.record("spec", 8, 8, 8 * 0.004, 8 * 3.0)  # tokens 0.9·2 + 0.1·3 = 2.1 per row: 525 tokens/s
    assert model.tokens == pytest.approx(2.1) and model.worth_drafting(8)
    for _ in range(3):
        model.record("plain", 8, 8, 8 * 0.0015, 8)  # median of the last 5 plain: 1.5 ms, 667 tokens/s
    assert not model.worth_drafting(8)
    assert not model.worth_drafting(8, [None] * 8)  # rows without a history of their own: the average
    assert model.worth_drafting(8, [3.0] * 6 + [None] * 2)  # (6·3 + 2·2.1) / 8 = 2.775 per row: 694 tokens/s
    assert not model.worth_drafting(8, [2.4] * 8)  # 600 tokens/s
    assert model.worth_drafting(2)  # another bucket: unmeasured
    for _ in range(32 - 3 - 1):
        model.record("plain", 8, 8, 8 * 0.0015, 8)
    assert not model.worth_drafting(8)
    model.record("plain", 8, 8, 8 * 0.0015, 8)
    assert model.worth_drafting(8)  # 32 plain steps in a row: probe once
    model.record("spec", 8, 8, 8 * 0.001, 8 * 2.1)  # the probe is fast: spec times (4, 100, 4, 4, 1) ms → 4
    assert not model.worth_drafting(8)
    for _ in range(2):
        model.record("spec", 8, 8, 8 * 0.001, 8 * 2.1)  # (100, 4, 4, 1, 1) → 4, then (4, 4, 1, 1, 1) → 1 ms
    assert model.median("spec", 8) == 0.001 and model.worth_drafting(8)
    summary = model.summary()
    assert summary["spec @ batch 8"] == {"s_per_row": 0.001, "steps": 8} and summary["plain @ batch 8"]["steps"] == 35
    # every recorded step, the uncounted capture steps included, in order (the benchmark's timeline)
    assert len(model.timeline) == 8 + 35 and model.timeline[0] == ("spec", 8, 8, 50.0, 8)
    assert model.timeline[-1] == ("spec", 8, 8, 8 * 0.001, 8 * 2.1)
    with pytest.raises(ValueError, match="kind"):
        model.record("other", 8, 8, 1.0, 8)
    model.reset()
    assert model.worth_drafting(8) and model.summary() == {"spec tokens_per_row": None}
    # the engine asks its cost model per bucket of the batch size, with its rows' own averages
    m = engine_test_model(52)
    engine = Engine(m, max_batch=8, max_seq_len=64, step_time=FLAT, drafter=NoisyDrafter(m.config.vocab_size, 3))
    for _ in range(4):
        engine._measure("spec", 7, 7 * 0.004, 7 * 2.0)  # batch 7 → bucket 8
    for _ in range(3):
        engine._measure("plain", 8, 8 * 0.001, 8)
    rows = [SimpleNamespace(spec_tokens=None, params=SimpleNamespace(max_tokens=16), output=[]) for _ in range(7)]
    assert engine.cost_model.median("spec", 8) == 0.004 and not engine._worth_drafting(rows)
    for row in rows:
        row.spec_tokens = 5.0  # 1,250 tokens/s per row beats 1,000; draining: 3.2 × 4 ms < 16 × 1 ms
    assert engine._worth_drafting(rows)
    # one row whose drafts fail: by the mean (4.43 tokens, 1,107 per s) it drafts, draining (no request waits)
    # its 16 steps × 4 ms lose to 16 plain steps × 1 ms; with a request waiting, the mean decides
    rows[-1].spec_tokens = 1.0
    assert not engine._worth_drafting(rows)
    engine.scheduler.waiting.append(SimpleNamespace())
    assert engine._worth_drafting(rows)
    engine.scheduler.waiting.clear()
    engine.reset_cost_model()
    assert engine._worth_drafting(rows[:1])


def test_a_step_beside_prefill_refreshes_no_measured_time_and_plain_time_scales_from_a_measured_bucket():
    """`CostModel.record(mixed=True)` (a step the device ran after prefill pieces): its time is kept only while its
    kind and bucket have fewer than 2 counted times; it still counts as a step. `plain_estimate`: the median, else
    the nearest measured bucket's scaled by the curve, else the curve. `drafts_at`: the mean rule on measurements
    alone, None where the bucket's speculative steps are not measured."""
    curve = StepTimeCurve([(1, 1.0), (8, 2.0)])  # per row: 1 s at 1, 0.25 s at 8
    model = CostModel(curve)
    assert model.plain_estimate(8) == pytest.approx(0.25) and model.plain_estimate(1) == pytest.approx(1.0)
    model.record("plain", 8, 8, 1.0, 8)  # the capture step
    model.record("plain", 8, 8, 8 * 0.003, 8, mixed=True)  # bucket not measured yet: kept
    model.record("plain", 8, 8, 8 * 0.005, 8, mixed=True)
    assert model.median("plain", 8) == pytest.approx(0.004)
    model.record("plain", 8, 8, 8 * 0.5, 8, mixed=True)  # measured now: not kept, but counted as a step
    assert model.median("plain", 8) == pytest.approx(0.004) and model.steps[("plain", 8)] == 4
    assert len(model.timeline) == 4 and model.plain_run[8] == 4
    model.record("plain", 8, 8, 8 * 0.001, 8)  # a clean step is: (3, 5, 1) ms → 3
    assert model.median("plain", 8) == pytest.approx(0.003)
    # bucket 1 unmeasured: bucket 8's 3 ms × (1 / 0.25) from the curve
    assert model.plain_estimate(1) == pytest.approx(0.012) and model.plain_estimate(8) == pytest.approx(0.003)
    assert model.drafts_at(8) is None  # no speculative step measured
    for _ in range(3):
        model.record("spec", 8, 8, 8 * 0.004, 8 * 2.0)  # 2 tokens per row in 4 ms: 500 per s against 333
    assert model.drafts_at(8) is True and model.drafts_at(8, [1.0] * 8) is False  # 250 per s
    assert model.drafts_at(1) is None and model.worth_drafting(8)


def test_while_prompts_wait_the_batch_they_make_decides():
    """`Engine._worth_drafting` with prompts prefilling or waiting: the bucket of the batch they make decides where
    its speculative steps are measured (there drafting loses: plain, though the rows' own bucket would draft);
    unmeasured there, or `project_batch` off, the rows' own bucket decides."""
    m = engine_test_model(52)
    engine = Engine(m, max_batch=8, max_seq_len=64, step_time=FLAT, drafter=NoisyDrafter(m.config.vocab_size, 3))
    for _ in range(3):
        engine._measure("spec", 2, 2 * 0.002, 2 * 2.0)  # bucket 2: 1,000 tokens/s per row drafting
        engine._measure("plain", 2, 2 * 0.0015, 2)  # 667 plain
    rows = [SimpleNamespace(spec_tokens=None, params=SimpleNamespace(max_tokens=16), output=[]) for _ in range(2)]
    engine.scheduler.running.extend(rows)  # the decoding rows
    assert engine._worth_drafting(rows)
    engine.scheduler.waiting.extend(SimpleNamespace() for _ in range(5))  # 2 + 5 rows: bucket 8, unmeasured
    assert engine._worth_drafting(rows)
    for _ in range(3):
        engine._measure("spec", 8, 8 * 0.004, 8 * 2.0)  # 500 per s drafting
        engine._measure("plain", 8, 8 * 0.001, 8)  # 1,000 plain
    assert not engine._worth_drafting(rows)
    engine.scheduler.waiting.pop()  # 6 rows still make bucket 8
    assert not engine._worth_drafting(rows)
    engine.project_batch = False
    assert engine._worth_drafting(rows)
    engine.project_batch = True
    engine.scheduler.waiting.clear()
    engine.scheduler.running.append(SimpleNamespace())  # one prompt prefilling: 3 rows, bucket 4
    assert engine._worth_drafting(rows)  # (bucket 4 unmeasured)
    for _ in range(3):
        engine._measure("spec", 4, 4 * 0.004, 4 * 2.0)
        engine._measure("plain", 4, 4 * 0.001, 4)
    assert not engine._worth_drafting(rows)
    engine.scheduler.running.clear()


def test_the_two_steps_after_prefill_pieces_are_measured_as_mixed():
    """The engine tells its cost model which decode steps ran while the device may still have worked on prefill
    pieces (`record(mixed=True)`): the two measurements after a step that ran pieces; later ones are clean."""
    model = engine_test_model(53)
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(53)
    engine = Engine(model, max_batch=4, max_seq_len=128, prefill_chunk=8, prefill_layers=None, step_time=FLAT,
                    drafter=NoisyDrafter(V, 3, base=None, noise=1.0))
    since = {"n": None}  # measurements since the last step that ran prefill pieces (None: none ran yet)
    log = []  # (mixed, measurements since pieces)
    record = engine.cost_model.record

    def logged(*args, mixed=False):
        if since["n"] is not None:
            log.append((mixed, since["n"]))
            since["n"] += 1
        return record(*args, mixed=mixed)

    engine.cost_model.record = logged
    first = engine.add_request(torch.randint(3, V, (6,), generator=g).tolist(), SamplingParams(max_tokens=40))
    while not first.output:
        engine.step()
    engine.add_request(torch.randint(3, V, (30,), generator=g).tolist(), SamplingParams(max_tokens=10))
    while engine.has_work():
        pieces = engine.stats.prefill_pieces
        engine.step()
        if engine.stats.prefill_pieces > pieces:
            since["n"] = 0
    assert sum(m for m, _ in log) >= 2 and sum(not m for m, _ in log) >= 5, log
    assert all(mixed == (n < 2) for mixed, n in log), log


def _assert_block_outputs(model, layer: int, ids: list[int], feats, what: str) -> None:
    """feats (m, dim) are the main model's hidden states at the last m positions of `ids` after block `layer` (its
    output, the mean over the streams), from a reference forward of the whole sequence; relative error < 1e-4."""
    ref = {}
    hook = model.layers[layer].register_forward_hook(
        lambda mod, args, output: ref.__setitem__("h", output[0].mean(dim=2)[0]))
    with torch.no_grad():
        model(torch.tensor([ids]))
    hook.remove()
    want = ref["h"][len(ids) - len(feats):]
    err = ((feats - want).abs().max() / want.abs().max()).item()
    assert err < 1e-4, f"{what}: rel err {err:.2e}"


@pytest.mark.parametrize("skips", [False, True])
def test_rows_more_than_a_window_behind_catch_up_on_their_last_window(skips):
    """After more than W plain steps, the first verification hands the drafter each row's last W committed tokens
    with their features from the feature ring: with a drafter that skips (`observe_many_skips`) in one batched
    `observe_many` (skip = lag − W), else row by row through `observe` — the same tokens and features."""
    model = engine_test_model(49)
    c = model.config
    W = c.window_size
    calls = []

    class Recording(NoisyDrafter):
        observe_many_skips = skips

        def features_wanted(self):
            return [c.n_layers - 1]

        def observe(self, seq_id, tokens, features):
            calls.append(("one", seq_id, tokens.clone(), {i: f.clone() for i, f in features.items()}))

        def observe_many(self, seq_ids, tokens, features, keep, skip=None):
            calls.append(("many", list(seq_ids), tokens.clone(), {i: f.clone() for i, f in features.items()},
                          list(keep), skip))

    g = torch.Generator().manual_seed(49)
    prompts = [torch.randint(3, c.vocab_size, (n,), generator=g).tolist() for n in (9, 14)]
    engine = Engine(model, max_batch=2, max_seq_len=256, drafter=Recording(c.vocab_size, 3, base=None, noise=0.5),
                    step_time=FLAT)
    turns = iter([False] * (W + 10) + [True] * 1000)
    engine._worth_drafting = lambda seqs: next(turns)
    outs = [o for o, _ in _run(engine, prompts, [W + 20] * 2)]
    # the plain step's features go to the ring only (nothing reads a copy of them); a verification's to `features`
    assert engine.io.features is None and engine.io.feature_ring is engine.feature_ring
    assert engine.vio.features is not None and engine.vio.feature_ring is None
    layer = c.n_layers - 1
    got = {}  # seq id → (tokens, features, positions skipped)
    if skips:
        kind, ids, tokens, feats, keep, skip = next(call for call in calls if call[0] == "many")  # the catch-up
        assert len(ids) == 2 and keep == [W, W] and min(skip) > 0, (ids, keep, skip)
        got = {i: (tokens[b], feats[layer][b], skip[b]) for b, i in enumerate(ids)}
    else:
        assert not any(call[0] == "many" and len(call[2][0]) == W for call in calls)
        for _, i, tokens, feats in [call for call in calls if call[0] == "one" and len(call[2]) > W][:2]:
            got[i] = (tokens[-W:], feats[layer], len(tokens) - W)
    assert len(got) == 2
    for seq_id, prompt, out in zip(sorted(got), prompts, outs):
        tokens, feats, skipped = got[seq_id]
        n = len(prompt) + skipped + W  # the drafter saw the prompt at its prefill
        assert tokens.tolist() == (prompt + out)[n - W:n] and feats.shape == (W, c.dim)
        _assert_block_outputs(model, layer, (prompt + out)[:n], feats, f"sequence {seq_id}")


@pytest.mark.parametrize("overlap", [False, True])
def test_lean_plain_steps_leave_the_ring_and_the_catch_up_waits_for_a_full_window(overlap):
    """Plain steps far from the next draft skip the feature ring (`Engine._lean`: the cost model's next probe more
    than a window away). When the engine then decides to draft, the rows' rings lack the lean positions: it keeps
    stepping plainly, writing the ring, until each row holds a full window (`_ring_ready`), and only then catches the
    drafter up — on the same tokens and features (the main model's, from a reference forward) as an engine without
    lean steps. Greedy output equals the plain engine's."""
    model = engine_test_model(57)
    c = model.config
    W = c.window_size
    layer = c.n_layers - 1
    g = torch.Generator().manual_seed(57)
    prompts = [torch.randint(3, c.vocab_size, (n,), generator=g).tolist() for n in (9, 14)]
    lean_steps = W + 7  # plain steps decided far from a probe; then the cost model wants to draft
    new = lean_steps + W + 12
    plain = [o for o, _ in _run(Engine(model, max_batch=2, max_seq_len=320), prompts, [new] * 2)]

    class Recording(NoisyDrafter):
        observe_many_skips = True

        def features_wanted(self):
            return [layer]

        def observe(self, seq_id, tokens, features):  # the prompt, after its prefill
            pass

        def observe_many(self, seq_ids, tokens, features, keep, skip=None):
            self.calls.append((list(seq_ids), tokens.clone(), features[layer].clone(), list(keep), skip, steps["n"]))

    steps = {"n": 0}  # plain decode launches so far
    engine = Engine(model, max_batch=2, max_seq_len=320, step_time=FLAT, overlap=overlap,
                    drafter=Recording(c.vocab_size, 3, base=None, noise=0.5))
    engine.drafter.calls = []
    cm = engine.cost_model
    cm.times[("spec", 2)] = [1.0] * cm.warmup  # bucket 2 measured: its next probe is `probe_gap` steps away
    cm.probe_gap[2] = 10 ** 6
    engine._worth_drafting = lambda seqs: steps["n"] >= lean_steps
    decode, lean, written = engine.runner.decode, [], []

    def counted(io, B, n_max, *, features=True):
        if io is not engine.io:
            return decode(io, B, n_max, features=features)
        steps["n"] += 1
        lean.append(not features)
        before = engine.feature_ring.clone()
        out = decode(io, B, n_max, features=features)
        written.append(not torch.equal(before, engine.feature_ring))
        return out

    engine.runner.decode = counted
    outs = [o for o, _ in _run(engine, prompts, [new] * 2)]
    assert outs == plain
    # lean from the second step at the bucket (its first plain one) until the draft was wanted, then never
    assert sum(lean[:lean_steps]) >= lean_steps - 3 and not any(lean[lean_steps + 1:]), lean
    assert written == [not x for x in lean]  # a lean step leaves the ring as it was, any other writes it
    first = lean_steps + 1
    catch_up = [call for call in engine.drafter.calls if call[3] == [W, W]]
    assert catch_up, [call[3] for call in engine.drafter.calls]
    ids, tokens, feats, keep, skip, at = catch_up[0]
    assert at >= first + W - 1, (at, first)  # a window of written positions before the drafter caught up
    assert engine.stats.speculative.forwards > 0
    for b, (seq_id, prompt, out) in enumerate(zip(ids, prompts, outs)):
        n = len(prompt) + skip[b] + W  # the drafter saw the prompt at its prefill
        assert tokens[b].tolist() == (prompt + out)[n - W:n]
        _assert_block_outputs(model, layer, (prompt + out)[:n], feats[b], f"sequence {seq_id}")


def test_a_draining_batch_that_will_not_probe_again_steps_lean():
    """Within a window of its next probe, a batch with no request waiting still steps lean once its slowest row has
    less than twice the probe's wait left (`CostModel.plain_ahead(slowest=)`: such a batch never probes again),
    and not before."""
    model = engine_test_model(58)
    c = model.config
    W = c.window_size
    g = torch.Generator().manual_seed(58)
    prompts = [torch.randint(3, c.vocab_size, (n,), generator=g).tolist() for n in (7, 11)]

    class Wanting(NoisyDrafter):
        def features_wanted(self):
            return [c.n_layers - 1]

    engine = Engine(model, max_batch=2, max_seq_len=4 * W, step_time=FLAT,
                    drafter=Wanting(c.vocab_size, 3, base=None, noise=0.5))
    cm = engine.cost_model
    cm.times[("spec", 2)] = [1.0] * cm.warmup
    cm.probe_gap[2] = W  # the next probe never more than a window away
    engine._worth_drafting = lambda seqs: False
    decode, lean, left = engine.runner.decode, [], []

    def counted(io, B, n_max, *, features=True):
        if io is engine.io:
            lean.append(not features)
            left.append(max(s.params.max_tokens - len(s.output) for s in engine.scheduler.running))
        return decode(io, B, n_max, features=features)

    engine.runner.decode = counted
    _run(engine, prompts, [2 * W + 20] * 2)
    assert sum(n >= 2 * W for n in left) >= 10 and sum(lean) >= W  # both kinds of step were there
    assert not any(x for x, n in zip(lean, left) if n >= 2 * W)  # the batch might still probe: its rings full
    assert all(x for x, n in zip(lean[2:], left[2:]) if n < 2 * W)  # it never will: lean


def test_decides_plain_only_where_a_static_verification_fits():
    """`Engine._decides_plain` (asked before every overlapped plain step): plain where the cost model says so and
    every row's block of k + 1 positions fits max_seq_len (`_verify_caps`' batch bound ≥ k); a row past that goes
    to the host-driven verification (`_speculate`), whatever the cost model says."""
    m = engine_test_model(52)
    engine = Engine(m, max_batch=8, max_seq_len=64, step_time=FLAT, drafter=NoisyDrafter(m.config.vocab_size, 3))
    for _ in range(3):
        engine._measure("spec", 2, 2 * 0.004, 2 * 2.0)
        engine._measure("plain", 2, 2 * 0.001, 2)  # plain wins at bucket 2
    k = engine.drafter.k
    for last in range(64 - k - 4, 64):
        rows = [SimpleNamespace(spec_tokens=None, params=SimpleNamespace(max_tokens=200), output=[],
                                num_cached_tokens=n) for n in (10, last)]
        assert engine._decides_plain(rows) == (engine._verify_caps(rows)[1] >= k) == (last <= 64 - 1 - k), last


def test_a_probe_that_loses_doubles_the_wait_for_the_next():
    """Probes back off: after 32 plain steps the model drafts once; if the decision stays plain, the next probe
    comes after 64, then 128 (up to probe_max); a decision to draft on the measurements resets the wait to 32.
    (probe_budget=None: doubling alone; the budget's longer waits: the next test.)"""
    model = CostModel(FLAT, probe_max=128, probe_budget=None)
    for _ in range(3):
        model.record("spec", 8, 8, 8 * 0.004, 8 * 2.0)  # 500 tokens/s per row
    for _ in range(3):
        model.record("plain", 8, 8, 8 * 0.001, 8)  # 1,000: plain wins

    def plain_steps_until_probe() -> int:
        n = 0
        while not model.worth_drafting(8):
            model.record("plain", 8, 8, 8 * 0.001, 8)
            n += 1
        model.record("spec", 8, 8, 8 * 0.004, 8 * 2.0)  # the probe: still slow
        return n

    assert plain_steps_until_probe() == 32 - 3  # three plain steps recorded already
    assert [plain_steps_until_probe() for _ in range(3)] == [64, 128, 128]
    for _ in range(5):
        model.record("spec", 8, 8, 8 * 0.0005, 8 * 2.0)  # fast now: 4,000 tokens/s per row
    assert model.worth_drafting(8) and 8 not in model.probe_gap  # drafting on the measurements: reset
    for _ in range(5):
        model.record("spec", 8, 8, 8 * 0.004, 8 * 2.0)
    assert plain_steps_until_probe() == 32


@pytest.mark.parametrize("budget", [0.01, 0.05])
def test_a_probe_waits_until_its_loss_is_within_the_budget_of_the_plain_time(budget):
    """After a probe the wait is the larger of twice the last one and the plain steps whose time its loss is
    `probe_budget` of — loss: the probe's time less what plain steps take for its tokens. Counted by hand: plain
    steps of 8 rows at 1 ms per row (8 ms a step, 1 ms a token); a probe of 8 rows emitting 16 tokens in 8 × 4.5 ms
    = 36 ms loses 36 − 16 = 20 ms, which is `budget` of 20 / (8 × budget) plain steps. A probe that loses nothing
    just doubles the wait; the wait never passes probe_max."""
    model = CostModel(FLAT, probe_max=4096, probe_budget=budget)
    for _ in range(3):
        model.record("spec", 8, 8, 8 * 0.0045, 8 * 2.0)
        model.record("plain", 8, 8, 8 * 0.001, 8)
    assert not model.worth_drafting(8)  # plain wins: 2 tokens per 4.5 ms against 1 per ms
    for _ in range(32):
        model.record("plain", 8, 8, 8 * 0.001, 8)
    assert model.worth_drafting(8)  # the probe's turn
    model.record("spec", 8, 8, 8 * 0.0045, 8 * 2.0)
    expected = round(0.020 / (8 * 0.001 * budget))  # 250 plain steps at 1 %, 50 at 5 %
    assert model.probe_gap[8] == max(64, expected)
    model.record("plain", 8, 8, 8 * 0.001, 8)
    assert model.plain_ahead(8) == max(64, expected) - 1  # what the engine's lean steps count down
    # a probe that costs what its tokens cost plain: twice the wait
    model.probe_gap[8] = 40
    for _ in range(40):
        model.record("plain", 8, 8, 8 * 0.001, 8)
    model.record("spec", 8, 8, 16 * 0.001, 16)
    assert model.probe_gap[8] == 80
    # a probe far slower: capped
    model.probe_gap[8] = 40
    for _ in range(40):
        model.record("plain", 8, 8, 8 * 0.001, 8)
    model.record("spec", 8, 8, 100.0, 16)
    assert model.probe_gap[8] == 4096
    with pytest.raises(ValueError, match="probe_budget"):
        CostModel(FLAT, probe_budget=0.0)


def test_plain_ahead_counts_the_plain_steps_to_the_next_probe():
    """`CostModel.plain_ahead` (the engine's lean plain steps): 0 while a bucket's speculative steps are unmeasured
    or its last step drafted; else the probe's wait less the plain steps since — counted down to the step where
    `worth_drafting` probes; infinite for a draining batch whose slowest row has less than twice the wait left
    (which `worth_drafting` never probes)."""
    model = CostModel(FLAT, probe_budget=None)  # waits that double (the budget's: the test above)
    assert model.plain_ahead(8) == 0
    model.record("spec", 8, 8, 8 * 0.004, 8 * 2.0)
    model.record("plain", 8, 8, 8 * 0.001, 8)
    assert model.plain_ahead(8) == 0  # one counted speculative step of warmup = 2
    model.record("spec", 8, 8, 8 * 0.004, 8 * 2.0)
    model.record("spec", 8, 8, 8 * 0.004, 8 * 2.0)
    assert model.plain_ahead(8) == 0  # the last step drafted
    for step in range(1, 40):
        model.record("plain", 8, 8, 8 * 0.001, 8)
        ahead = model.plain_ahead(8)
        assert ahead == 32 - step, (step, ahead)
        assert model.worth_drafting(8) == (ahead <= 0), step
        if ahead <= 0:
            break
    model.record("spec", 8, 8, 8 * 0.004, 8 * 2.0)  # the probe loses: the next waits 64
    model.record("plain", 8, 8, 8 * 0.001, 8)
    assert model.plain_ahead(8) == 63
    assert model.plain_ahead(8, slowest=127) == float("inf")
    assert model.plain_ahead(8, slowest=128) == 63
    assert model.plain_ahead(4) == 0  # another bucket: unmeasured


def test_cost_model_when_the_batch_drains():
    """`CostModel.worth_drafting(..., remaining=)`, by hand: with no request waiting, drafting goes on while the
    row that finishes last would finish sooner with it — most verifications left (remaining / tokens per
    verification) × the speculative step's time against most remaining tokens × the plain step's; a bucket it
    shrinks into is estimated, not measured, and a probe interrupts it only while a row has twice the wait left."""
    model = CostModel(FLAT)
    for _ in range(3):
        model.record("spec", 8, 8, 8 * 0.004, 8 * 2.0)  # the first is not counted: 4 ms per row, 2 tokens
    for _ in range(3):
        model.record("plain", 8, 8, 8 * 0.0025, 8)  # 2.5 ms per row
    assert model.worth_drafting(8, [2.0] * 8)  # 500 tokens/s per row against 400
    assert model.worth_drafting(8, [2.0] * 8, [100] * 8)  # 50 × 4 = 200 ms against 100 × 2.5 = 250 ms
    assert model.worth_drafting(8, [None] * 8, [100] * 8)  # no history of their own: the average, 2.0
    fails = [2.0] * 7 + [1.2]
    assert model.worth_drafting(8, fails)  # the mean, 1.9 tokens: 475 per s, still ahead of 400
    assert not model.worth_drafting(8, fails, [100] * 8)  # that row: 83.3 × 4 = 333 ms against 250
    assert model.worth_drafting(8, fails, [100] * 7 + [20])  # nearly done (16.7 × 4 ms): the others decide, 200
    assert model.worth_drafting(8, [2.0] * 8, [100] * 7 + [200])  # the longest: 100 × 4 = 400 ms against 500 ms
    assert not model.worth_drafting(8, fails[:7] + [1.2], [20] * 7 + [200])  # 167 × 4 = 667 ms against 500 ms
    with pytest.raises(ValueError, match="remaining"):
        model.worth_drafting(8, fails, [1, 2])
    # the batch shrinks into bucket 4, where no speculative step ran: not measured while draining — the estimate
    # is bucket 8's 4 ms per row × the curve's plain s per row at 4 over at 8 (1/4 ÷ 1/8: FLAT) = 8 ms
    assert model.spec_estimate(4) == pytest.approx(0.008)
    for _ in range(3):
        model.record("plain", 4, 4, 4 * 0.005, 4)  # 5 ms per row
    assert model.worth_drafting(4, [2.0] * 4, [100] * 4)  # 50 × 8 = 400 ms against 100 × 5 = 500 ms
    assert not model.worth_drafting(4, [2.0] * 3 + [1.2], [100] * 4)  # 83.3 × 8 = 667 ms against 500 ms
    assert model.worth_drafting(4, [2.0] * 3 + [1.2])  # not draining: bucket 4 is measured first
    assert model.steps.get(("spec", 4)) is None
    # a probe while draining only where the slowest row has twice the wait (32 plain steps) left: 40 plain steps
    # in a row at bucket 8, then a short tail stays on the measurements and a long one probes
    for _ in range(40):
        model.record("plain", 8, 8, 8 * 0.0025, 8)
    assert not model.worth_drafting(8, [1.5] * 8, [63] * 8)  # 42 × 4 = 168 ms against 158 ms; no probe
    assert model.worth_drafting(8, [1.5] * 8, [20] * 7 + [64])  # a probe
    assert model.worth_drafting(8, [1.5] * 8)  # a batch that refills probes (its measurements: 375 < 400 per s)
    assert CostModel(FLAT).spec_estimate(4) is None  # nothing measured: nothing to scale


def _run_logprobs(engine: Engine, prompts, max_tokens, k: int):
    """Each request's (token, logprob, top ids, top logprobs) per emitted token, from the step outputs."""
    seqs = [engine.add_request(p, SamplingParams(max_tokens=m, logprobs=k)) for p, m in zip(prompts, max_tokens)]
    rows = {s.id: [] for s in seqs}
    while engine.has_work():
        for out in engine.step():
            top = out.top_logprobs or []
            rows[out.request.id].append((out.token, out.logprob, [t for t, _ in top], [lp for _, lp in top]))
    return [rows[s.id] for s in seqs]


def test_logprobs_under_speculation_equal_plain_decodes():
    """Every token a speculative step emits — accepted drafts, the correction, the bonus token — reports the
    logprob and top alternatives plain decoding reports for it (log-softmax of the unmodified logits at that
    position), none missing; the drafts are the plain continuation corrupted at 35 % of the positions."""
    model = engine_test_model(47)
    prompts, max_tokens = _prompts(model, 24, 47)
    max_tokens = [m + 4 for m in max_tokens]  # several verifications per request
    plain = _run_logprobs(Engine(model, max_batch=12, max_seq_len=128), prompts, max_tokens, k=3)
    continuations = {tuple(p): [t for t, *_ in rows] for p, rows in zip(prompts, plain)}
    drafter = NoisyDrafter(model.config.vocab_size, 4, base=ScriptedDrafter(4, continuations), noise=0.35)
    engine = Engine(model, max_batch=12, max_seq_len=128, drafter=drafter, step_time=FLAT)
    spec = _run_logprobs(engine, prompts, max_tokens, k=3)
    st = engine.stats.speculative
    assert st.accepted > 0 and st.accepted < st.drafted  # partial acceptance: drafts, corrections and bonuses
    for i, (a_rows, b_rows) in enumerate(zip(spec, plain)):
        assert [r[0] for r in a_rows] == [r[0] for r in b_rows], i
        for (tok, lp, ids, lps), (_, lp_p, ids_p, lps_p) in zip(a_rows, b_rows):
            assert lp is not None and len(ids) == 3, (i, tok)
            assert abs(lp - lp_p) < 1e-4 and ids == ids_p, (i, tok, lp, lp_p)
            assert max(abs(x - y) for x, y in zip(lps, lps_p)) < 1e-4


def test_a_drafter_engine_admits_prompts_beside_decoding_rows_as_a_plain_engine_does():
    """Each decoding row of a drafter's engine claims k + 1 tokens of the step budget (its verification), so the
    default budget grows by max_batch × k, not max_batch: otherwise, once budget / (k + 1) rows decode, no prompt is
    admitted or prefilled until one finishes (2026-12-07, H100: a closed batch of 64 never had more than 32 rows
    decoding). Eight requests, four of them arriving while the first four decode: every one is decoding after as
    many steps as in the plain engine."""
    model = engine_test_model(88)
    g = torch.Generator().manual_seed(88)
    prompts = [torch.randint(3, 1000, (20,), generator=g).tolist() for _ in range(8)]
    steps_until_all_decode = {}
    for drafter in (None, NoisyDrafter(model.config.vocab_size, 4, noise=1.0)):
        engine = Engine(model, max_batch=8, max_seq_len=256, prefill_chunk=32, prefill_layers=None, drafter=drafter,
                        step_time=FLAT if drafter is not None else None, speculate="always" if drafter else "auto")
        seqs = [engine.add_request(p, SamplingParams(max_tokens=200)) for p in prompts[:4]]
        while not all(s.output for s in seqs):
            engine.step()
        seqs += [engine.add_request(p, SamplingParams(max_tokens=200)) for p in prompts[4:]]
        steps = 0
        while not all(s.output for s in seqs):
            engine.step()
            steps += 1
            assert steps < 100, [len(s.output) for s in seqs]
        steps_until_all_decode[drafter is not None] = steps
    assert steps_until_all_decode[True] <= steps_until_all_decode[False], steps_until_all_decode


def test_spec_beside_prefill_decodes_plainly_in_the_steps_that_prefill_above_its_rows():
    """`Engine(spec_beside_prefill=2)`: a step that carries prefill pieces and more than 2 decoding rows decodes
    plainly (no verification forward), decode-only steps still verify, and the greedy tokens equal the plain
    engine's. Four requests decode, then three arrive (prefilled in chunks beside them)."""
    model = engine_test_model(89)
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(89)
    prompts = [torch.randint(3, V, (int(n),), generator=g).tolist() for n in (5, 9, 14, 20, 70, 90, 75)]
    n_out = [40] * 7

    def run(engine, record=None):
        seqs = [engine.add_request(p, SamplingParams(max_tokens=n)) for p, n in zip(prompts[:4], n_out)]
        while not all(s.output for s in seqs):
            engine.step()
        seqs += [engine.add_request(p, SamplingParams(max_tokens=n)) for p, n in zip(prompts[4:], n_out[4:])]
        while engine.has_work():
            if record is None:
                engine.step()
                continue
            st, n_batches = engine.stats.speculative, len(record["batches"])
            forwards, plain = st.forwards, st.plain_steps
            engine.step()
            if len(record["batches"]) > n_batches:  # a scheduled step (not a chained one)
                batch = record["batches"][-1]
                if batch.decode:
                    record["steps"].append((bool(batch.prefill), len(batch.decode), st.forwards - forwards,
                                            st.plain_steps - plain))
        return [s.output for s in seqs]

    want = run(Engine(model, max_batch=8, max_seq_len=256, prefill_chunk=16, prefill_layers=None))
    script = ScriptedDrafter(3, {tuple(p): o for p, o in zip(prompts, want)})
    engine = Engine(model, max_batch=8, max_seq_len=256, prefill_chunk=16, prefill_layers=None, step_time=FLAT,
                    drafter=NoisyDrafter(V, 3, base=script, noise=0.3), speculate="always", spec_beside_prefill=2)
    record = {"batches": [], "steps": [], "calls": []}
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: record["batches"].append(schedule()) or record["batches"][-1]
    emit, run_pieces = engine._emit, engine._run_pieces

    def emit_logged(seqs, *args, **kwargs):
        record["calls"].append(("emit", len(record["batches"]), tuple(s.id for s in seqs)))
        return emit(seqs, *args, **kwargs)

    def pieces_logged(pieces, outputs):
        record["calls"].append(("pieces", len(record["batches"]), ()))
        return run_pieces(pieces, outputs)

    engine._emit, engine._run_pieces = emit_logged, pieces_logged
    assert run(engine, record) == want
    mixed = [s for s in record["steps"] if s[0] and s[1] > 2]
    assert mixed and all(verified == 0 and plain == 1 for _, _, verified, plain in mixed), record["steps"]
    # those plain steps read their tokens after the pieces are launched (as a plain engine's: the pieces' host work
    # runs beside the device's decode), not before
    for i, batch in enumerate(record["batches"], start=1):
        if batch.prefill and len(batch.decode) > 2:
            calls = [c for c in record["calls"] if c[1] == i]
            decode_ids = tuple(s.id for s in batch.decode)
            at = next(j for j, c in enumerate(calls) if c[0] == "emit" and c[2] == decode_ids)
            assert any(c[0] == "pieces" for c in calls[:at]), calls
    assert any(verified == 1 for prefill, _, verified, _ in record["steps"] if not prefill)
    with pytest.raises(ValueError, match="spec_beside_prefill"):
        Engine(model, max_batch=2, step_time=FLAT, drafter=NoisyDrafter(V, 3), spec_beside_prefill=-1)
