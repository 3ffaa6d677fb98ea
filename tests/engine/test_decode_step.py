"""The static decode step can be captured: no host sync, no data-dependent shape, shapes fixed by
(batch, entry bound), and padding rows touch no sequence (issue 15, item 4).

On the CPU the kernel ops run their torch twins, which may sync (they are the executable spec, not
the captured path); on a GPU they are Triton launches, checked without a sync by
`tests/engine/test_engine_gpu.py`. Here every op between the kernels is checked by `NoSyncMode`."""

from __future__ import annotations

import pytest
import torch
from tests.conftest import engine_test_model
from torch.utils._python_dispatch import _disable_current_modes

import dsv41.kernels.ops as ops_module
from dsv41.engine.engine import Engine
from dsv41.engine.graphs import batch_buckets, bucket, entry_bound, reachable_bounds
from dsv41.engine.sampling import SamplingParams
from dsv41.testing.sync import HostSyncError, NoSyncMode, OpCounter


def _kernels_opaque(monkeypatch) -> None:
    """Kernel ops run with the sync checks suspended (their GPU versions are Triton launches)."""
    impl = ops_module._impl

    def opaque(family, name, *tensors, supported=True):
        fn = impl(family, name, *tensors, supported=supported)

        def call(*args, **kwargs):
            with _disable_current_modes(), torch._C.DisableTorchFunction():
                return fn(*args, **kwargs)

        return call

    monkeypatch.setattr(ops_module, "_impl", opaque)


def _engine_with_running(seed: int, lengths=(20, 47, 9)) -> Engine:
    torch.manual_seed(seed)
    model = engine_test_model(seed)
    engine = Engine(model, max_batch=4, prefill_chunk=64, page_rows=8, max_seq_len=256)
    seqs = [engine.add_request(torch.randint(3, 1000, (n,)).tolist(), SamplingParams(max_tokens=40)) for n in lengths]
    while any(s.prefilling or s.next_token is None for s in seqs):
        engine.step()
    return engine


def _fill(engine: Engine) -> tuple[int, dict[int, int]]:
    io = engine.io
    io.fill_batch([s.cache for s in engine.running], [s.next_token for s in engine.running])
    B = len(engine.running)
    io.send()
    return B, io.max_entries(B)


def test_the_decode_step_makes_no_host_sync_between_kernels(monkeypatch):
    engine = _engine_with_running(60)
    _kernels_opaque(monkeypatch)
    B, n_max = _fill(engine)
    with NoSyncMode(), torch.no_grad():
        engine.runner.decode(engine.io, B, n_max)
    # and the check can fail: the host-driven forward builds host tensors and reads counts
    seqs = [s.cache for s in engine.running]
    tokens = torch.tensor([[5]] * len(seqs))
    with pytest.raises(HostSyncError), NoSyncMode(), torch.no_grad():
        engine.runner.forward(seqs, tokens, torch.tensor([s.n_tokens for s in seqs]), range(2))


def test_padding_rows_leave_every_sequence_untouched_and_the_real_rows_unchanged():
    """A batch padded to its bucket with dummy-slot rows gives the real rows the same logits and
    writes nothing into any real sequence's rows beyond what the unpadded step writes."""
    engine = _engine_with_running(61)
    pools, io = engine.pools, engine.io
    before = (pools.ring_rows.clone(), pools.ring_positions.clone(),
              {s: (p.kv.clone(), p.index.clone()) for s, p in pools.sources.items()})
    B, n_max = _fill(engine)
    with torch.no_grad():
        plain = engine.runner.decode(io, B, n_max).clone()
    after_plain = (pools.ring_rows.clone(), pools.ring_positions.clone(),
                   {s: (p.kv.clone(), p.index.clone()) for s, p in pools.sources.items()})
    # the same step again, padded to 4 rows and with the entry bounds rounded up
    pools.ring_rows.copy_(before[0])
    pools.ring_positions.copy_(before[1])
    for s, p in pools.sources.items():
        p.kv.copy_(before[2][s][0])
        p.index.copy_(before[2][s][1])
    io.pad(B, 4)
    io.send()
    with torch.no_grad():
        padded = engine.runner.decode(io, 4, {s: entry_bound(n, 64) for s, n in n_max.items()})[:B].clone()
    torch.testing.assert_close(padded, plain, rtol=1e-5, atol=1e-5)
    real = slice(0, pools.dummy_slot)  # every slot but the dummy one
    assert torch.equal(pools.ring_rows[:, real], after_plain[0][:, real])
    assert torch.equal(pools.ring_positions[:, real], after_plain[1][:, real])
    for s, p in pools.sources.items():
        assert torch.equal(p.kv, after_plain[2][s][0]) and torch.equal(p.index, after_plain[2][s][1])


def test_graph_keys_are_batch_buckets_and_power_of_two_entry_bounds():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert batch_buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    assert [bucket(n, batch_buckets(64)) for n in (1, 3, 17, 64)] == [1, 4, 32, 64]
    with pytest.raises(ValueError):
        bucket(65, batch_buckets(64))
    assert [entry_bound(n, 1024) for n in (0, 5, 1024, 1025, 70000)] == [1024, 1024, 1024, 2048, 131072]


@pytest.mark.parametrize("seed", range(6))
def test_the_entry_bounds_a_warm_up_captures_are_every_key_a_step_can_reach(seed):
    """`reachable_bounds` (what `Engine.capture_decode_graphs` captures at each bucket) against every length
    one at a time: the keys of sequences of 0 … max_tokens tokens (entries ⌊L / ratio⌋ per source, each bound
    the power of two ≥ them, at least `minimum`), in order, none missing and none extra."""
    g = torch.Generator().manual_seed(seed)
    ratios = {s: int(m) for s, m in zip(range(0, 12, 3), torch.randint(1, 9, (int(torch.randint(1, 4, (1,),
                                                                                                   generator=g)),),
                                                                            generator=g))}
    minimum = int(2 ** torch.randint(0, 5, (1,), generator=g))
    max_tokens = int(torch.randint(200, 700, (1,), generator=g))  # ≥ 25 entries at ratio 8: past every minimum
    want = []
    for n in range(max_tokens + 1):
        key = {s: entry_bound(n // m, minimum) for s, m in ratios.items()}
        if not want or key != want[-1]:
            want.append(key)
    assert reachable_bounds(ratios, max_tokens, minimum) == want
    assert len(want) > 1  # the draws cross a power of two


def test_reachable_bounds_by_hand():
    # ratios 4 and 1, at least 8: 40 tokens → 10 and 40 entries; the key changes at 9 tokens (ratio 1's entries
    # pass 8), at 17 (they pass 16), at 33 (they pass 32) and at 36 (ratio 4's 9 entries pass 8)
    assert reachable_bounds({2: 4, 5: 1}, 40, 8) == [{2: 8, 5: 8}, {2: 8, 5: 16}, {2: 8, 5: 32}, {2: 8, 5: 64},
                                                     {2: 16, 5: 64}]
    # the key the engine's plain batch met on 2026-12-07 (`test_speculative_gpu.py`, graph_min_entries=16): ratios
    # 2 and 1 at 129 tokens hold 64 and 129 entries — bounds 64 and 256, a key between those of 128 and 130 tokens
    assert {2: 64, 4: 256} in reachable_bounds({2: 2, 4: 1}, 257, 16)
    assert reachable_bounds({2: 4}, 0, 1024) == [{2: 1024}]


@pytest.mark.parametrize("speculative", [False, True])
def test_every_key_a_decoding_engine_steps_at_is_one_a_warm_up_captures(monkeypatch, speculative):
    """The engine's own static steps (plain, and the drafter's verifications) against `reachable_bounds`: a batch
    whose rows finish one by one and pass entry bounds (graph_min_entries=16) steps only at (bucket, key) pairs
    `Engine.capture_decode_graphs` captures — on the CPU, where the keys are computed but no graph runs. (A
    chain built on ⌈L / ratio⌉ entries missed the key of 129 tokens here, and the GPU run of 2026-12-07 captured
    it mid-decode.)"""
    from tests.engine.test_speculative import FLAT, _run

    from dsv41.engine.speculative import NoisyDrafter

    model = engine_test_model(62)
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(62)
    prompts = [torch.randint(3, V, (int(n),), generator=g).tolist() for n in torch.randint(96, 126, (6,), generator=g)]
    drafter = NoisyDrafter(V, 3, noise=0.5) if speculative else None
    engine = Engine(model, max_batch=6, max_seq_len=200, graph_min_entries=16, step_time=FLAT, drafter=drafter,
                    speculate="always")
    seen = set()
    launch = Engine._launch_static

    def spy(self, io, graphs, B, Bb, n_max, n_entries, lean=False):
        seen.add((io.T, bucket(B, self.buckets), tuple(sorted((s, entry_bound(n, 16)) for s, n in n_entries.items()))))
        return launch(self, io, graphs, B, Bb, n_max, n_entries, lean)

    monkeypatch.setattr(Engine, "_launch_static", spy)
    _run(engine, prompts, [6 * (i + 1) for i in range(6)])
    ratios = {s: pool.ratio for s, pool in engine.pools.sources.items()}
    keys = {T: [tuple(sorted(k.items())) for k in reachable_bounds(ratios, engine.max_seq_len + T, 16)]
            for T in {T for T, _, _ in seen}}
    assert len({key for _, _, key in seen}) > 1 and len({b for _, b, _ in seen}) > 2  # bounds passed, buckets drained
    assert {T for T, _, _ in seen} == ({4} if speculative else {1})  # every step verifies (speculate="always")
    missed = sorted((T, b, key) for T, b, key in seen if key not in keys[T] or b not in engine.buckets)
    assert not missed, missed


class _Graphs:
    """Stands in for `DecodeGraphs` (CUDA only) in `capture_decode_graphs`: records what it is asked to capture
    (its keys: (bucket, sorted bounds), or ("restore", bucket)) and counts captures, and raises on its capture
    number `fail_at` (1-based) as an out-of-memory capture would."""

    def __init__(self, io, fail_at: int | None = None):
        self.io, self.min_entries, self.fail_at, self.asked, self.captures = io, 16, fail_at, [], 0

    def ensure(self, Bb, n_max, lean=False):
        key = ("restore", Bb) if n_max is None else (Bb, tuple(sorted(n_max.items()))) + (("lean",) if lean else ())
        if key not in self.asked:
            if self.fail_at is not None and len(self.asked) + 1 == self.fail_at:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            self.asked.append(key)
            self.captures += 1
        return key


def test_capture_decode_graphs_asks_for_every_bucket_and_key_and_survives_a_failed_capture(caplog):
    """`Engine.capture_decode_graphs` with stand-in graphs: the plain step at every (key, bucket) of
    `reachable_bounds` (T = 1) — in both variants, with and without features (`Engine._lean`), for a drafter
    that wants features —, the verification at every one of its own (T = k + 1) and the rollback at every
    bucket; a capture that fails ends the warm-up's captures with a warning and keeps the graphs (the rest are
    captured when first needed)."""
    from dsv41.engine.speculative import NoisyDrafter

    model = engine_test_model(63)
    V = model.config.vocab_size

    class Wanting(NoisyDrafter):
        def features_wanted(self):
            return [model.config.n_layers - 1]

    engine = Engine(model, max_batch=4, max_seq_len=100, graph_min_entries=16, drafter=Wanting(V, 3),
                    step_time=lambda n: 1e-3)
    ratios = {s: pool.ratio for s, pool in engine.pools.sources.items()}
    engine.graphs, engine.vgraphs = _Graphs(engine.io), _Graphs(engine.vio)
    n = engine.capture_decode_graphs()
    keys = {T: [tuple(sorted(k.items())) for k in reachable_bounds(ratios, 100 + T, 16)] for T in (1, 4)}
    assert len(keys[4]) > 1
    assert sorted(engine.graphs.asked) == sorted((Bb, k) + lean for Bb in (1, 2, 4) for k in keys[1]
                                                 for lean in ((), ("lean",)))
    assert sorted(engine.vgraphs.asked, key=str) == sorted([(Bb, k) for Bb in (1, 2, 4) for k in keys[4]]
                                                           + [("restore", Bb) for Bb in (1, 2, 4)], key=str)
    assert n == len(engine.graphs.asked) + len(engine.vgraphs.asked)
    assert engine.capture_decode_graphs() == 0  # all there: nothing captured again
    plain, verify = _Graphs(engine.io), _Graphs(engine.vio, fail_at=2)
    engine.graphs, engine.vgraphs = plain, verify
    assert engine.capture_decode_graphs() == len(plain.asked) + 1
    assert engine.graphs is plain and engine.vgraphs is verify and len(verify.asked) == 1
    assert "capture failed" in caplog.text


@pytest.mark.parametrize("decode_graphs", [True, False])
def test_warm_up_captures_the_decode_graphs_unless_told_not_to(monkeypatch, decode_graphs):
    engine = Engine(engine_test_model(64), max_batch=2, max_seq_len=64)
    calls = []
    monkeypatch.setattr(engine, "capture_decode_graphs", lambda: calls.append(1) or 0)
    engine.warm_up(groups=((3,),), beside=False, decode_graphs=decode_graphs)
    assert calls == ([1] if decode_graphs else [])
    assert not engine.has_work()


def test_the_decode_step_launches_the_same_ops_whatever_the_data(monkeypatch):
    """What makes one CUDA graph per (batch bucket, entry bound) valid: the static decode step's op sequence
    depends on those shapes only — not on the tokens, the positions, how many entries each row has or how many
    rows are real. Counted per op name over: the step now, the next step (every row one token further, other
    tokens), and the same step padded from 3 real rows to the bucket of 4 (a dummy-slot row). Prints the count
    (what a graph saves)."""
    engine = _engine_with_running(62)
    _kernels_opaque(monkeypatch)  # a kernel call counts as one op (on the GPU: one Triton launch)
    io = engine.io

    def count(B: int, pad_to: int | None = None) -> OpCounter:
        io.fill_batch([s.cache for s in engine.running], [s.next_token for s in engine.running])
        if pad_to is not None:
            io.pad(B, pad_to)
        io.send()
        rows = pad_to or B
        with OpCounter() as counter, torch.no_grad():
            engine.runner.decode(io, rows, {s: entry_bound(n, 64) for s, n in io.max_entries(B).items()})
        return counter

    B = len(engine.running)
    first = count(B, 4)
    engine.step()  # every row one token further (and its caches advanced)
    assert len(engine.running) == B
    second = count(B, 4)
    assert second.counts == first.counts and second.kernels == first.kernels
    assert first.total > 0 and len(first.counts) > 10
    print(f"decode step, tiny, {B} rows padded to 4: {first.total} aten ops, {first.kernels} kernels")
    # the unpadded step at B = 3 launches the same kernels (only shapes and a few views differ)
    third = count(B)
    assert third.kernels == first.kernels


def test_fill_batch_writes_each_field_from_its_formula():
    """The host buffer of a decode step, row by row from the definitions: token, position = tokens
    cached, slot, the k previous tokens (−1 before the start), and per kv source of ratio m the entry
    count after the step and the pool row of the entry the token completes — page id · R + offset of
    entry n_entries in its page — when (position + 1) % m == 0, else −1. Over enough steps that every
    source completes entries and crosses pages."""
    engine = _engine_with_running(63, lengths=(20, 47, 9, 30))
    io, k = engine.io, engine.io.k
    completed = 0
    for step in range(12):
        seqs = engine.running
        before = [{s: c.entry_stores[s].n_entries for s in io.sources} for c in (q.cache for q in seqs)]
        io.fill_batch([q.cache for q in seqs], [q.next_token for q in seqs])
        v = io.view
        for b, q in enumerate(seqs):
            c, pos = q.cache, q.cache.n_tokens
            assert (v[io.TOK, b], v[io.POS, b], v[io.SLOT, b]) == (q.next_token, pos, c.slot)
            hist = ([-1] * k + c.tokens[-k:])[-k:] if k else []
            assert list(v[io.HIST:io.HIST + k, b]) == hist, (step, b)
            for s in io.sources:
                m, R, e = c.entry_stores[s].ratio, engine.pools.page_rows, before[b][s]
                done = (pos + 1) % m == 0
                want = c.pages[s][e // R] * R + e % R if done else -1
                assert v[io.ROW[s], b] == want, (step, b, s, v[io.ROW[s], b], want)
                assert v[io.CNT[s], b] == e + done
                completed += done
        for q in seqs:  # the step's token joins the cache, as the engine's decode does
            q.cache.tokens.append(q.next_token)
            q.next_token = (q.next_token * 7 + step) % 997 + 3
    assert completed > 12 and all(len(p) > 1 for q in engine.running for p in q.cache.pages.values())


@pytest.mark.parametrize("T", [48, 200])  # inside one window, and past it (window_size 128)
def test_a_static_step_of_more_than_a_window_is_an_exact_prefill_chunk(T):
    """The static step (`DecodeIO` rows of T positions, `Runner.decode`) run over a prompt in chunks of T — a
    fresh sequence, then the same one continuing — gives the last position's logits of `prefill(exact=True)`,
    fp32, and the same cache (entries, window ring): the shape-static path a graph-captured prefill chunk would
    replay. last_only keeps the logits to the last position."""
    from dsv41.engine.block_manager import BlockManager
    from dsv41.engine.cache import SequenceCache
    from dsv41.engine.prefill import prefill
    from dsv41.engine.runner import DecodeIO, Runner

    model = engine_test_model(90)
    c = model.config
    runner = Runner(model)
    ids = torch.randint(3, 1000, (2 * T + 5,), generator=torch.Generator().manual_seed(T)).tolist()
    pools = BlockManager(c, torch.device("cpu"), max_slots=2, max_tokens=2048, max_seq_len=1024, page_rows=16)
    ref = SequenceCache(c, pools=pools)
    want = prefill(runner, ref, ids[:2 * T], chunk=T, exact=True)
    seq = SequenceCache(c, pools=pools)
    io = DecodeIO(c, pools, 1, T, last_only=True)
    for k in range(2):
        chunk = ids[k * T:(k + 1) * T]
        io.fill_batch([seq], [chunk])
        io.send()
        got = runner.decode(io, 1, io.max_entries(1))[0]
        seq.tokens.extend(chunk)
    assert io.logits.shape == (1, c.vocab_size)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6 * float(want.abs().max()))
    assert seq.n_tokens == ref.n_tokens == 2 * T
    for s in pools.sources:  # the same entries, as the rows each sequence's pages hold
        a, b = ref.entry_stores[s], seq.entry_stores[s]
        assert a.n_entries == b.n_entries > 0
        assert torch.equal(a.kv.read(), b.kv.read()) and torch.equal(a.index_k.read(), b.index_k.read())
    for layer in range(c.n_layers):  # the window rings hold the same positions and keys
        assert torch.equal(pools.ring_positions[layer][ref.slot], pools.ring_positions[layer][seq.slot])
        assert torch.equal(pools.ring_rows[layer][ref.slot], pools.ring_rows[layer][seq.slot])
    with pytest.raises(ValueError, match="window_size"):
        DecodeIO(c, pools, 1, c.window_size + 1, rollback=True, projections=True)


@pytest.mark.parametrize("T", [47, 201])  # a window of 32: the second turn's replay overlaps the first's (47)
def test_static_encoder_chunks_and_replay_are_the_encoder_only_prefill(T):
    """Encoder-only prefill from static steps: each chunk of T tokens through the encoder layers
    (`Runner.static_layers`), the decoder's kv source compressed from their output (`static_produce`), then
    the decoder's bounded replay of the last window from the encoder's tail (replay=True: the window starts at
    the replay, no entry written, no partial group touched) — a prompt of two chunks, then a second turn of one
    more on the same sequence, in a config whose decoder has a ratio-2 kv source and an Engram layer. The last
    position's logits of `prefill(exact=False)` (fp32) and byte-equal entries, index keys, partial groups and
    window rings of every layer: what graph-captured encoder-only chunks would replay."""
    from dsv41.engine.block_manager import BlockManager
    from dsv41.engine.cache import SequenceCache
    from dsv41.engine.prefill import prefill
    from dsv41.engine.runner import DecodeIO, Runner

    model = engine_test_model(91, compress_ratios=[0, 0, 2, 2, 2, 2, 2, 2], engram_layer_ids=[1, 5],
                              engram_num_embeddings=[6126, 6400])
    c = model.config
    runner = Runner(model)
    enc, W = c.encoder_layers, c.window_size
    assert model.plan[enc].mode == "full" and model.plan[5].engram  # a decoder kv source, a decoder Engram layer
    ids = torch.randint(3, 1000, (3 * T,), generator=torch.Generator().manual_seed(T + 1)).tolist()
    pools = BlockManager(c, torch.device("cpu"), max_slots=2, max_tokens=2048, max_seq_len=1024, page_rows=16)
    ref, seq = SequenceCache(c, pools=pools), SequenceCache(c, pools=pools)
    io = DecodeIO(c, pools, 1, T, last_only=True)
    rio = DecodeIO(c, pools, 1, W, last_only=True)
    for turn in (ids[:2 * T], ids[2 * T:]):
        want = prefill(runner, ref, turn, chunk=T)
        tails = []
        for k in range(0, len(turn), T):
            chunk = turn[k:k + T]
            io.fill_batch([seq], [chunk])
            io.send()
            n_max = io.max_entries(1)
            h, pre = runner.static_layers(io, 1, n_max, range(enc))
            runner.static_produce(io, 1, n_max, enc, h, pre)
            seq.tokens.extend(chunk)
            tails.append((h, pre))
        h = torch.cat([t[0] for t in tails], dim=1)[:, -W:]
        pre = torch.cat([t[1] for t in tails], dim=1)[:, -W:]
        rio.fill_batch([seq], [seq.tokens[-W:]], positions=[seq.n_tokens - W], reserve=False)
        rio.send()
        h, pre = runner.static_layers(rio, 1, rio.max_entries(1), range(enc, c.n_layers), h, pre,
                                      compress=False, replay=True)
        got = runner.logits(h, pre)[0]
        torch.testing.assert_close(got, want, rtol=0, atol=2e-6 * float(want.abs().max()))
        for s, src in pools.sources.items():
            a, b = ref.entry_stores[s], seq.entry_stores[s]
            assert a.n_entries == b.n_entries > 0
            assert torch.equal(a.kv.read(), b.kv.read()) and torch.equal(a.index_k.read(), b.index_k.read())
            r = seq.n_tokens % src.ratio  # the open group's members so far (one after the odd second turn)
            assert torch.equal(src.pending_kv[ref.slot, :r], src.pending_kv[seq.slot, :r])
            assert torch.equal(src.pending_score[ref.slot, :r], src.pending_score[seq.slot, :r])
        for layer in range(c.n_layers):
            assert torch.equal(pools.ring_positions[layer][ref.slot], pools.ring_positions[layer][seq.slot])
            assert torch.equal(pools.ring_rows[layer][ref.slot], pools.ring_rows[layer][seq.slot])
    assert seq.n_tokens % 2 == 1


@pytest.mark.parametrize("T, steps, ragged", [(7, 9, False), (300, 3, False), (301, 3, True)])
def test_fill_batch_reserves_the_rows_of_a_block_where_its_tokens_complete_groups(T, steps, ragged):
    """A block of T positions from any start: per kv source of ratio m, the positions t with (pos + t + 1) % m == 0
    get the next entry rows in order (page id · R + offset), the others −1, the count grows by their number;
    reserve=False (a replay of cached tokens) reserves none. T = 300: more than 64 rows per source at once (the
    numpy path of a prefill piece); ragged: a row of fewer tokens pads the positions after them (token 0, no row)."""
    from dsv41.engine.block_manager import BlockManager
    from dsv41.engine.cache import SequenceCache
    from dsv41.engine.runner import DecodeIO

    model = engine_test_model(64, compress_ratios=[0, 0, 4, 4, 2, 2, 2, 2])
    c = model.config
    pools = BlockManager(c, torch.device("cpu"), max_slots=1, max_tokens=2048, max_seq_len=1024, page_rows=4)
    seq = SequenceCache(c, pools=pools)
    io = DecodeIO(c, pools, 1, T, ragged=ragged)
    for step in range(steps):
        n = T - 1 - 2 * step if ragged else T  # the row's real tokens (ragged: fewer each step)
        pos, before = seq.n_tokens, {s: seq.entry_stores[s].n_entries for s in io.sources}
        block = [7 + (pos + t) % 50 for t in range(n)]
        io.fill_batch([seq], [block])
        assert list(io.view[io.TOK:io.TOK + T, 0]) == block + [0] * (T - n)
        for s in io.sources:
            m, R = seq.entry_stores[s].ratio, pools.page_rows
            ends = [t for t in range(n) if (pos + t + 1) % m == 0]
            want = [-1] * T
            for j, t in enumerate(ends):
                e = before[s] + j
                want[t] = seq.pages[s][e // R] * R + e % R
            assert list(io.view[io.ROW[s]:io.ROW[s] + T, 0]) == want, (step, s)
            assert io.view[io.CNT[s], 0] == before[s] + len(ends)
            assert seq.entry_stores[s].index_k.n_rows == seq.entry_stores[s].kv.n_rows
        seq.tokens.extend(block)
    assert {seq.entry_stores[s].ratio for s in io.sources} == {4, 2}
    io.fill_batch([seq], [[5] * n], positions=[seq.n_tokens - n], reserve=False)
    for s in io.sources:
        assert list(io.view[io.ROW[s]:io.ROW[s] + T, 0]) == [-1] * T


def test_reserve_gives_the_page_rows_of_the_next_entries_for_any_count():
    """`PagedRows.reserve`: the next n logical rows as pool row ids (page id · R + offset), the same for a
    decode step's single row (Python) and a prefill chunk's many (numpy), across page boundaries."""
    from dsv41.engine.block_manager import BlockManager
    from dsv41.engine.cache import SequenceCache

    model = engine_test_model(65)
    c = model.config
    pools = BlockManager(c, torch.device("cpu"), max_slots=2, max_tokens=4096, max_seq_len=2048, page_rows=8)
    other = SequenceCache(c, pools=pools)
    seq = SequenceCache(c, pools=pools)
    s = next(iter(pools.sources))
    rows, got = seq.entry_stores[s].kv, []
    for i, n in enumerate((1, 64, 65, 3, 300, 1, 97)):
        got += rows.reserve(n) if i % 2 == 0 else rows.reserve_array(n).tolist()  # list and array: the same ids
        other.entry_stores[s].kv.reserve(5)  # interleaved pages: the sequence's pages are not contiguous
    R, pages = pools.page_rows, seq.pages[s]
    assert got == [pages[i // R] * R + i % R for i in range(rows.n_rows)] and rows.n_rows == 531
    theirs = {other.pages[s][i // R] * R + i % R for i in range(other.entry_stores[s].kv.n_rows)}
    assert len(set(got)) == len(got) and not set(got) & theirs  # no row given twice, none of another sequence's
