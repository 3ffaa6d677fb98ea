"""`StaticPrefill`: prefill from static steps over ragged power-of-two shapes (CUDA graphs on the GPU) is
`prefill()` — encoder-only and exact.

CPU, fp32, against the host-driven prefill (`PrefillJob`, the engine's path — itself checked against the
training forward in test_engine.py): the last position's logits and byte-equal caches — every kv source's
entries, index keys and open partial group, every layer's window ring — for prompts of several lengths
(shorter than a window, a chunk and a remainder, whole chunks; every piece padded to its shape, the padding
crossing group ends and window ends), a second turn on the same sequence, and a config with a ratio-2 decoder
source and a decoder Engram layer. On the GPU: graph replay = eager."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from tests.conftest import engine_test_model

from dsv41.engine.block_manager import BlockManager
from dsv41.engine.cache import SequenceCache
from dsv41.engine.prefill import prefill
from dsv41.engine.runner import Runner
from dsv41.engine.static_prefill import StaticPrefill

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _model(seed: int):
    return engine_test_model(seed, compress_ratios=[0, 0, 2, 2, 2, 2, 2, 2], engram_layer_ids=[1, 5],
                             engram_num_embeddings=[6126, 6400])


def _same_bytes(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Packed FP4 / FP8 bytes equal, but for a rare flip: a padded piece's products run at another shape than the
    host path's (fp32 rounding of their own, ~1e-7), which can move a value across a rounding boundary (one
    in ~10^5; none measured here). A wrong row written is hundreds of bytes; the bound is a tenth of a percent."""
    assert got.shape == want.shape, what
    wrong = (got != want).float().mean().item()
    assert wrong <= 1e-3, f"{what}: {wrong:.2%} of the bytes differ"


def _same_caches(pools: BlockManager, ref: SequenceCache, seq: SequenceCache) -> None:
    assert seq.tokens == ref.tokens
    for s, src in pools.sources.items():
        a, b = ref.entry_stores[s], seq.entry_stores[s]
        assert a.n_entries == b.n_entries
        _same_bytes(b.kv.read(), a.kv.read(), f"source {s} entries")
        _same_bytes(b.index_k.read(), a.index_k.read(), f"source {s} index keys")
        r = seq.n_tokens % src.ratio
        # fp32 projections: a padded piece's products run at another shape (rounding of its own, ~1e-7)
        torch.testing.assert_close(src.pending_kv[seq.slot, :r], src.pending_kv[ref.slot, :r], rtol=0, atol=1e-6)
    for layer in range(len(pools.ring_rows)):
        assert torch.equal(pools.ring_positions[layer][ref.slot], pools.ring_positions[layer][seq.slot])
        _same_bytes(pools.ring_rows[layer][seq.slot], pools.ring_rows[layer][ref.slot], f"layer {layer} ring")


# chunk 24 → shapes 4, 8, 16, 32 (every full piece padded by 8); window 32; ratios 2 (and 4, 128 in tiny's plan)
@pytest.mark.parametrize("exact", [False, True], ids=["encoder-only", "exact"])
@pytest.mark.parametrize("lengths, chunk", [((9,), 24), ((61,), 24), ((100, 45), 24), ((96,), 24), ((3, 1, 30), 24),
                                           ((40, 50), 64)], ids=str)  # the last: one piece of more than a window
def test_static_prefill_is_the_host_driven_prefill(lengths, chunk, exact):
    model = _model(92)
    c = model.config
    runner = Runner(model)
    pools = BlockManager(c, torch.device("cpu"), max_slots=3, max_tokens=2048, max_seq_len=1024, page_rows=16)
    ref, seq = SequenceCache(c, pools=pools), SequenceCache(c, pools=pools)
    other = SequenceCache(c, pools=pools)  # a sequence beside them: padding must never write its state
    prefill(runner, other, torch.randint(3, 1000, (50,), generator=torch.Generator().manual_seed(1)).tolist())
    before = _state(pools, other)
    static = StaticPrefill(runner, pools, chunk=chunk, min_tokens=4)
    g = torch.Generator().manual_seed(sum(lengths))
    for i, n in enumerate(lengths):  # turns on the same sequence
        prompt = torch.randint(3, 1000, (n,), generator=g).tolist()
        want = prefill(runner, ref, prompt, chunk=chunk, exact=exact)
        got = static(seq, prompt if i % 2 == 0 else np.asarray(prompt, dtype=np.int32), exact=exact)  # or an array
        # fp32 at another shape: up to 2.1e-6 of the largest logit measured (40 tokens at the 64 shape)
        torch.testing.assert_close(got, want, rtol=0, atol=5e-6 * float(want.abs().max()))
        _same_caches(pools, ref, seq)
    assert all(torch.equal(a, b) for a, b in zip(before, _state(pools, other)))
    assert static.pieces >= sum(-(-n // chunk) for n in lengths)


def _state(pools: BlockManager, seq: SequenceCache) -> list[torch.Tensor]:
    """Everything of one sequence's cache: entries and index keys of each source, its rings and partial groups."""
    out = []
    for s, src in pools.sources.items():
        out += [seq.entry_stores[s].kv.read().clone(), seq.entry_stores[s].index_k.read().clone()]
        if src.pending_kv is not None:
            out.append(src.pending_kv[seq.slot].clone())
    for layer in range(len(pools.ring_rows)):
        out += [pools.ring_rows[layer][seq.slot].clone(), pools.ring_positions[layer][seq.slot].clone()]
    return out


def test_pieces_run_at_power_of_two_shapes():
    """A piece of n tokens runs at the first shape ≥ n (one io per shape, so a server holds a bounded set);
    the shapes run from min_tokens to the first power of two ≥ chunk."""
    from dsv41.engine.static_prefill import token_buckets

    assert token_buckets(64, 16384) == [64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
    assert token_buckets(5, 24) == [8, 16, 32]
    model = _model(91)
    pools = BlockManager(model.config, torch.device("cpu"), max_slots=1, max_tokens=1024, max_seq_len=512)
    static = StaticPrefill(Runner(model), pools, chunk=100, min_tokens=16)
    assert [static.bucket(n) for n in (1, 16, 17, 100)] == [16, 16, 32, 128]
    with pytest.raises(ValueError, match="longer"):
        static.bucket(129)
    seq = SequenceCache(model.config, pools=pools)
    static(seq, list(range(3, 250)))  # pieces of 100, 100, 47 and a replay of 32
    assert sorted(static._ios) == [32, 64, 128]


def test_static_prefill_refuses_what_it_cannot_run():
    model = _model(93)
    pools = BlockManager(model.config, torch.device("cpu"), max_slots=4, max_tokens=256, max_seq_len=256)
    with pytest.raises(ValueError, match="chunk"):
        StaticPrefill(Runner(model), pools, chunk=0)
    with pytest.raises(ValueError, match="replay"):
        StaticPrefill(Runner(model), pools).replay(SequenceCache(model.config, pools=pools), 0,
                                                   torch.zeros(1, 0, 4, 8), torch.zeros(1, 0, 4))
    with pytest.raises(ValueError, match="CUDA"):
        StaticPrefill(Runner(model), pools, graphs=True)
    with pytest.raises(ValueError, match="token"):
        StaticPrefill(Runner(model), pools)(SequenceCache(model.config, pools=pools), [])
    seq = SequenceCache(model.config, pools=pools)
    for bad in (np.ones((2, 3), dtype=np.int64), np.ones(4, dtype=np.float32)):
        with pytest.raises(ValueError, match="1-D integers"):
            StaticPrefill(Runner(model), pools)(seq, bad)
    assert seq.tokens == [] and seq.n_tokens == 0  # refused before anything was written


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_static_prefill_graphs_equal_eager(dtype):
    """Replayed from CUDA graphs (every piece: shapes 16 … 64 captured on padding; four turns on one sequence, so
    that later pieces replay a graph whose outputs an earlier piece's tail came from, two of them capturing a
    drafter's features in the replay; an exact prompt on a second sequence) = the same steps eagerly, logits,
    features and caches. fp32 captures take the dense MoE dispatch
    (`moe._dense_while_capturing`), so in fp32 the eager run takes it too: this test compares graphs with eager
    steps, not the two dispatches (the next test does). 2026-12-06, H100: with the grouped eager side it failed once
    (first prompt's logits 1 % apart) after the mHC / MoE / Engram GPU tests in the same process; on the same GPU the
    two dispatches' eager runs then agreed to 1.5e-7 — the cause was not found."""
    from dsv41.engine.engine import cast_for_engine
    from dsv41.engine.runner import Capture

    model = cast_for_engine(_model(94).cuda(), dtype)
    if dtype == torch.float32:
        for moe in model.moe_layers():
            moe.moe_impl = "dense"
    c = model.config
    runner = Runner(model)
    out, states, feats = {}, {}, {}
    for graphs in (False, True):
        pools = BlockManager(c, torch.device("cuda"), max_slots=3, max_tokens=4096, max_seq_len=2048)
        static = StaticPrefill(runner, pools, chunk=64, min_tokens=16, graphs=graphs, min_entries=64)
        seq, other = SequenceCache(c, pools=pools), SequenceCache(c, pools=pools)
        g = torch.Generator().manual_seed(5)
        out[graphs], feats[graphs] = [], []
        for i, n in enumerate((300, 128, 77, 5)):  # the second and fourth turns capture a drafter's features
            cap = Capture(layers=(c.encoder_layers, c.n_layers - 1)) if i % 2 else None
            out[graphs].append(static(seq, torch.randint(3, 1000, (n,), generator=g).tolist(), capture=cap))
            if cap is not None:
                feats[graphs] += [cap.features[layer] for layer in cap.layers]
        out[graphs].append(static(other, torch.randint(3, 1000, (150,), generator=g).tolist(), exact=True))
        states[graphs] = _state(pools, seq) + _state(pools, other)
        if graphs:
            assert static.captures >= 4
    for a, b in zip(out[False] + feats[False], out[True] + feats[True]):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5 * float(a.abs().max()))
    # a turn's features cover its decoder replay: its last window_size positions (fewer in a shorter turn)
    assert [f.shape[1] for f in feats[True]] == [min(n, c.window_size) for n in (128, 128, 5, 5)]
    for a, b in zip(states[False], states[True]):
        if a.dtype == torch.uint8:
            _same_bytes(b, a, "packed cache")
        else:
            torch.testing.assert_close(b, a, rtol=0, atol=1e-3 * float(a.abs().max()))


@pytest.mark.gpu
@gpu
def test_gpu_static_prefill_fp32_grouped_dispatch_equals_the_dense_one():
    """fp32 on CUDA, eager: the static prefill's logits with the MoE's own dispatch ("auto") = with the dense one,
    to fp32 rounding (the same function; a session script running this comparison on the H100 measured 1.5e-7 of
    a 0.6 maximum)."""
    from dsv41.engine.engine import cast_for_engine

    model = cast_for_engine(_model(94).cuda(), torch.float32)
    runner, c, out = Runner(model), model.config, {}
    for impl in ("auto", "dense"):
        for moe in model.moe_layers():
            moe.moe_impl = impl
        pools = BlockManager(c, torch.device("cuda"), max_slots=2, max_tokens=4096, max_seq_len=2048)
        static = StaticPrefill(runner, pools, chunk=64, min_tokens=16, graphs=False, min_entries=64)
        seq, g = SequenceCache(c, pools=pools), torch.Generator().manual_seed(5)
        out[impl] = [static(seq, torch.randint(3, 1000, (n,), generator=g).tolist()) for n in (300, 128, 77, 5)]
    for a, b in zip(out["auto"], out["dense"]):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5 * float(a.abs().max()))


@pytest.mark.gpu
@gpu
def test_gpu_engine_with_static_prefill_decodes_as_the_host_path():
    """On CUDA (bf16, graphs): the engine's default static prefill gives the greedy tokens of the host path."""
    from dsv41.engine.engine import Engine, cast_for_engine

    model = cast_for_engine(_model(96).cuda(), torch.bfloat16)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (400, 37, 5, 290)]  # max_seq_len 512
    outputs = {}
    for static in (None, False):
        engine = Engine(model, max_batch=4, prefill_chunk=64, idle_prefill_chunk=256, static_prefill=static)
        assert (engine.static is not None) == (static is None)
        outputs[static] = engine.generate(prompts, max_tokens=8)
        if static is None:
            assert engine.stats.static_prefill_runs >= len(prompts)
    same = sum(a == b for a, b in zip(outputs[None], outputs[False]))
    assert same >= len(prompts) - 1, outputs  # bf16: a near-tie may flip one greedy token (and its stream)


def test_prefill_defaults_follow_where_the_runs_replay_graphs():
    """Without CUDA graphs (here: the CPU, static prefill on or off) the engine prefills beside decoding streams in
    4-layer pieces of 2048-token runs; explicit values are kept; bad ones are refused. (With graphs — whole runs of
    128 tokens, one replay each — `test_gpu_prefill_defaults_are_whole_graphed_runs_of_128_tokens`.)"""
    from dsv41.engine.engine import HOST_PREFILL_CHUNK, Engine

    model = _model(97)
    for static in (None, True):
        engine = Engine(model, max_batch=2, static_prefill=static)
        assert (engine.prefill_chunk, engine.scheduler.prefill_layers) == (HOST_PREFILL_CHUNK, 4) == (2048, 4)
        assert engine.scheduler.token_budget == 2048 + 2
    engine = Engine(model, max_batch=2, prefill_chunk=96, prefill_layers=None)
    assert (engine.prefill_chunk, engine.scheduler.prefill_layers, engine.scheduler.token_budget) == (96, None, 98)
    for bad in (dict(prefill_layers="whole"), dict(prefill_chunk=0)):
        with pytest.raises(ValueError, match="prefill_layers|prefill_chunk"):
            Engine(model, max_batch=2, **bad)
    # the rule itself (what a CUDA engine decides): graphed whole runs only with static prefill, graphs, no drafter
    from dsv41.engine.engine import prefill_defaults

    for static, graphs, drafter in itertools.product((False, True), repeat=3):
        want = (128, None) if static and graphs and not drafter else (2048, 4)
        assert prefill_defaults(None, "auto", static, graphs, drafter) == want, (static, graphs, drafter)
        assert prefill_defaults(300, 2, static, graphs, drafter) == (300, 2)
        assert prefill_defaults(300, None, static, graphs, drafter) == (300, None)


@pytest.mark.gpu
@gpu
def test_gpu_prefill_defaults_are_whole_graphed_runs_of_128_tokens():
    """With CUDA graphs and static prefill (no drafter) the defaults are whole runs of 128 tokens beside the
    streams; without static prefill the host path's 2048-token runs in 4-layer pieces."""
    from dsv41.engine.engine import STATIC_PREFILL_CHUNK, Engine, cast_for_engine

    model = cast_for_engine(_model(98).cuda(), torch.bfloat16)
    engine = Engine(model, max_batch=2)
    assert engine.static is not None and engine.static.graphs
    assert (engine.prefill_chunk, engine.scheduler.prefill_layers) == (STATIC_PREFILL_CHUNK, None) == (128, None)
    engine = Engine(model, max_batch=2, static_prefill=False)
    assert (engine.prefill_chunk, engine.scheduler.prefill_layers) == (2048, 4)


@pytest.mark.parametrize("prefill_layers", [None, 2], ids=["whole-runs", "layer-budget"])
def test_the_engine_runs_whole_prefill_runs_from_static_steps(monkeypatch, prefill_layers):
    """`Engine(static_prefill=True)` (static steps run eagerly on the CPU) samples every token from the logits the
    host path gives, within the rounding of padded shapes: prompts of several lengths (an exact one among them)
    arrive while others decode and when the engine is idle, whole runs go to `StaticPrefill` — every run when no
    layer budget cuts them, the idle steps' runs under one — and the rest to the host path."""
    from tests.engine.test_engine_scheduling import spy_logits

    from dsv41.engine.engine import Engine
    from dsv41.engine.sampling import SamplingParams

    model = _model(95)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (150, 37, 5, 90, 61)]
    seen, outputs, stats = {}, {}, {}
    for static in (False, True):
        logits = spy_logits(monkeypatch)
        engine = Engine(model, max_batch=4, prefill_chunk=16, idle_prefill_chunk=64, prefill_layers=prefill_layers,
                        static_prefill=static)
        assert (engine.static is not None) == static
        seqs = [engine.add_request(p, SamplingParams(max_tokens=6), exact_prefill=i == 3)
                for i, p in enumerate(prompts[:2])]
        for _ in range(3):
            engine.step()
        seqs += [engine.add_request(p, SamplingParams(max_tokens=6), exact_prefill=i == 1)
                 for i, p in enumerate(prompts[2:])]
        while engine.has_work():
            engine.step()
        outputs[static] = [s.output for s in seqs]
        seen[static] = [torch.stack(logits[s.id]) for s in seqs]
        stats[static] = engine.stats.static_prefill_runs
        monkeypatch.undo()
    assert outputs[True] == outputs[False]
    for got, want in zip(seen[True], seen[False]):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * float(want.abs().max()))  # measured ~1e-7
    assert stats[False] == 0
    # runs: each prompt's encoder chunks (16 tokens beside decoding streams, up to 64 when idle) and its replay
    assert stats[True] >= (len(prompts) if prefill_layers else 2 * len(prompts) + 9)


@pytest.mark.gpu
@gpu
def test_gpu_a_failed_capture_is_tried_again_and_static_prefill_falls_back_to_eager(monkeypatch):
    """`capture_graph` tries a capture that failed once more (after the allocator's free blocks are released); a
    StaticPrefill whose captures keep failing runs its pieces eagerly (the same logits), never failing the prompt."""
    from dsv41.engine import graphs as graphs_module
    from dsv41.engine import static_prefill as static_module

    x = torch.ones(4, device="cuda")
    calls = []

    def step() -> None:
        calls.append(torch.cuda.is_current_stream_capturing())
        if calls.count(True) == 1 and calls[-1]:
            raise RuntimeError("simulated: operation not permitted when stream is capturing")
        x.mul_(2)

    graph = graphs_module.capture_graph(step, torch.cuda.graph_pool_handle())
    assert calls == [False, False, True, True]  # two warm-ups, the failed capture, the capture again
    x.fill_(1)
    graph.replay()
    assert torch.equal(x, torch.full_like(x, 2))

    model = _model(97).cuda()
    c = model.config
    runner = Runner(model)
    prompt = torch.randint(3, 1000, (150,), generator=torch.Generator().manual_seed(2)).tolist()
    out = {}
    for failing in (False, True):
        if failing:
            def refuse(*args, **kwargs):
                raise RuntimeError("simulated capture failure")
            monkeypatch.setattr(static_module, "capture_graph", refuse)
        pools = BlockManager(c, torch.device("cuda"), max_slots=1, max_tokens=1024, max_seq_len=512)
        static = StaticPrefill(runner, pools, chunk=64, min_tokens=16, graphs=False, min_entries=64)
        if failing:
            static.graphs, static._pool = True, torch.cuda.graph_pool_handle()  # graphs asked for; captures refused
        out[failing] = static(SequenceCache(c, pools=pools), prompt)
        assert static.graphs is False
    torch.testing.assert_close(out[True], out[False], rtol=0, atol=0)


def test_a_job_hands_static_only_whole_runs_that_start_their_windows_afresh():
    """`PrefillJob(static=)`: a run asked for in full goes to `StaticPrefill`; a piece cut between layers (the layer
    budget beside decoding streams) stays on the host path and so does the rest of its run; a short suffix whose
    decoder windows continue an exact turn (`decoder_windows_valid`) is replayed by the host path without
    truncation — the same logits as the host path alone in each case."""
    from dsv41.engine.prefill import PrefillJob

    c, runner, pools, static = _jobs_setup(98, slots=4)
    g = torch.Generator().manual_seed(9)
    prompt = torch.randint(3, 1000, (90,), generator=g).tolist()

    ref = PrefillJob(runner, SequenceCache(c, pools=pools), prompt, chunk=64)
    job = PrefillJob(runner, SequenceCache(c, pools=pools), prompt, chunk=64, static=static)
    assert ref.step(64, layers=1) is None and job.step(64, layers=1) is None  # a piece of one layer: host path
    assert job.static_runs == 0 and job.run is not None
    while ref.run is not None:
        ref.step()
        job.step()
    assert job.static_runs == 0  # the rest of a run begun on the host path stays there
    want = prefill_rest(ref)
    got = prefill_rest(job)
    assert job.static_runs == 2  # the last chunk and the decoder replay, whole
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6 * float(want.abs().max()))

    # an exact turn, then a suffix shorter than a window that continues its decoder windows
    first, suffix = prompt[:70], prompt[70:]
    caches = []
    for use_static in (False, True):
        seq = SequenceCache(c, pools=pools)
        prefill(runner, seq, first, chunk=64, exact=True)
        out = prefill(runner, seq, suffix, chunk=64, decoder_windows_valid=True, static=static if use_static else None)
        caches.append(out)
    torch.testing.assert_close(caches[1], caches[0], rtol=0, atol=2e-6 * float(caches[0].abs().max()))


def _jobs_setup(seed: int, slots: int):
    """A model's config and runner, CPU pools of `slots` slots and a StaticPrefill of 64-token pieces on them."""
    model = _model(seed)
    runner = Runner(model)
    pools = BlockManager(model.config, torch.device("cpu"), max_slots=slots, max_tokens=2048, max_seq_len=512,
                         page_rows=16)
    return model.config, runner, pools, StaticPrefill(runner, pools, chunk=64, min_tokens=8)


def prefill_rest(job) -> torch.Tensor:
    while True:
        logits = job.step()
        if logits is not None:
            return logits


@pytest.mark.parametrize("at", ["output", "input"])
def test_a_drafters_decoder_features_come_from_the_static_replay(at):
    """A job capturing decoder layers' features for a drafter (`capture_layers`, encoder-only) runs its whole runs
    from static steps: the decoder replay captures them — the same features (the mean over streams at the
    window's positions, every wanted layer) and logits as the host path, fp32. Features of an encoder layer, or of
    an exact prefill, stay on the host path; `StaticPrefill` refuses them."""
    from dsv41.engine.prefill import PrefillJob
    from dsv41.engine.runner import Capture

    c, runner, pools, static = _jobs_setup(99, slots=6)
    g = torch.Generator().manual_seed(4)
    wanted = (c.encoder_layers + 1, c.n_layers - 1)  # decoder layers, not the first
    for n, runs in ((90, 3), (21, 2)):  # two encoder chunks and the replay; one chunk and a replay padded to 32
        prompt = torch.randint(3, 1000, (n,), generator=g).tolist()
        ref = PrefillJob(runner, SequenceCache(c, pools=pools), prompt, chunk=64, capture_layers=wanted,
                         capture_at=at)
        job = PrefillJob(runner, SequenceCache(c, pools=pools), prompt, chunk=64, capture_layers=wanted,
                         capture_at=at, static=static)
        want, got = prefill_rest(ref), prefill_rest(job)
        assert job.static_runs == runs
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6 * float(want.abs().max()))  # measured: 3.0e-7
        assert sorted(job.features) == sorted(ref.features) == sorted(wanted)
        for i in wanted:
            assert job.features[i].shape == ref.features[i].shape == (min(n, c.window_size), c.dim)
            scale = float(ref.features[i].abs().max())  # measured: within 2.4e-7 of it
            torch.testing.assert_close(job.features[i], ref.features[i], rtol=0, atol=1e-6 * scale)
        ref.seq.release()
        job.seq.release()
    # an encoder layer wanted, or an exact prefill: the host path
    for kw in (dict(capture_layers=(1, c.n_layers - 1)), dict(capture_layers=wanted, exact=True)):
        other = PrefillJob(runner, SequenceCache(c, pools=pools), prompt, chunk=64, capture_at=at, static=static, **kw)
        prefill_rest(other)
        assert other.static_runs == 0 and sorted(other.features) == sorted(kw["capture_layers"])
    seq = SequenceCache(c, pools=pools)
    with pytest.raises(ValueError, match="decoder layers"):
        static.replay(seq, 4, torch.zeros(1, 4, c.hc_mult, c.dim), torch.zeros(1, 4, c.hc_mult),
                      capture=Capture(layers=(1,)))
    with pytest.raises(ValueError, match="encoder-only"):
        static(seq, prompt[:10], exact=True, capture=Capture(layers=wanted))
    with pytest.raises(ValueError, match="decoder layers"):
        static(seq, prompt[:10], capture=Capture(layers=wanted, projections=True))
    assert seq.tokens == [] and seq.n_tokens == 0  # refused before any piece ran
