"""Bounded replay and resumes as the layers actually run them (issue 16).

Instrumented: every cached forward the engine makes is recorded (which layers, how many tokens, from
which position, whether it compresses, where the window is truncated), so a replay one token short, a
replay that recomputes or appends global KV, or a decoder pass that is not truncated shows up as a
wrong call, not only as a different number. Against independent references: encoder-only prefill =
the model's training forward with the decoder's windows truncated at the replay start (an independent
composition of the model's own layers); an exact resume from a window snapshot = the same sequence
decoded on without interruption; cached global KV is byte-identical to the stored units."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from tests.conftest import engine_test_model

from dsv41.engine.cache import SequenceCache
from dsv41.engine.engine import Engine
from dsv41.engine.prefill import prefill
from dsv41.engine.prefix import PrefixCache
from dsv41.engine.prefix_store import InProcessSWAPool, PersistentStore, chain_hashes
from dsv41.engine.runner import Runner
from dsv41.engine.sampling import SamplingParams
from dsv41.model.mhc import identity_pre_mix
from dsv41.model.state import ForwardContext

FLIP_RTOL = 2e-3  # one FP4 rounding flip between two computation orders (tests/engine/test_engine_scheduling.py)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@contextmanager
def recorded_calls():
    """Every Runner.forward / Runner.produce call as a dict."""
    calls: list[dict] = []
    forward, produce = Runner.forward, Runner.produce

    def rec_forward(self, seqs, tokens, start, layers, h=None, pre_mix=None, *, replay_start=None, compress=True,
                    **images):  # image_mask / image_embeds (vision models) pass through
        first = int(start[0]) if not isinstance(start, torch.Tensor) else int(start.view(-1)[0])
        calls.append(dict(kind="forward", layers=(layers.start, layers.stop), start=first, n=tokens.size(1),
                          compress=compress, replay_start=None if replay_start is None else int(replay_start[0])))
        return forward(self, seqs, tokens, start, layers, h, pre_mix, replay_start=replay_start, compress=compress,
                       **images)

    def rec_produce(self, layer_id, seqs, h, pre_mix, start):
        first = int(start[0]) if not isinstance(start, torch.Tensor) else int(start.view(-1)[0])
        calls.append(dict(kind="produce", layer=layer_id, start=first, n=h.size(1)))
        return produce(self, layer_id, seqs, h, pre_mix, start)

    Runner.forward, Runner.produce = rec_forward, rec_produce
    try:
        yield calls
    finally:
        Runner.forward, Runner.produce = forward, produce


def test_encoder_only_prefill_runs_the_encoder_over_every_token_and_the_decoder_over_the_last_window():
    torch.manual_seed(70)
    model = engine_test_model(70)
    c = model.config
    W, enc = c.window_size, c.encoder_layers
    N = 2 * W + 13
    prompt = torch.randint(3, c.vocab_size, (N,)).tolist()
    seq = SequenceCache(c)
    with recorded_calls() as calls:
        prefill(Runner(model), seq, prompt, chunk=40)
    encoder = [k for k in calls if k["kind"] == "forward" and k["layers"] == (0, enc)]
    decoder = [k for k in calls if k["kind"] == "forward" and k["layers"] == (enc, c.n_layers)]
    produce = [k for k in calls if k["kind"] == "produce"]
    assert len(encoder) + len(decoder) + len(produce) == len(calls)
    # the encoder: every prompt token once, in order, compressing, no truncation
    assert [(k["start"], k["n"]) for k in encoder] == [(s, min(40, N - s)) for s in range(0, N, 40)]
    assert all(k["compress"] and k["replay_start"] is None for k in encoder)
    # the decoder's global KV comes from the encoder output of every token
    assert [(k["layer"], k["start"], k["n"]) for k in produce] == [(enc, k["start"], k["n"]) for k in encoder]
    # the decoder: exactly the last W tokens, truncated at their first position, writing no global KV
    assert decoder == [dict(kind="forward", layers=(enc, c.n_layers), start=N - W, n=W, compress=False,
                            replay_start=N - W)]
    for s, store in seq.entry_stores.items():  # every entry once: nothing appended twice
        assert store.n_entries == store.index_k.n_rows == N // store.ratio, s


def _truncated_decoder_reference(model, tokens: torch.Tensor) -> torch.Tensor:
    """Last-position logits of encoder-only prefill composed from the model's training path: the encoder
    over every token, then the decoder layers over every token with their windows truncated at N − W
    (tokens before it reach later ones only through the decoder's global KV, a projection of the encoder
    output — so the last position is what Decoder SWA Bounded Replay computes)."""
    c = model.config
    N, W = tokens.size(1), c.window_size
    enc_ctx = ForwardContext.build(tokens)
    dec_ctx = ForwardContext.build(tokens, window_start=torch.full_like(tokens, N - W))
    hash_ids = model.hasher(tokens) if model.hasher is not None else None
    h = model.embed(tokens).unsqueeze(2).repeat(1, 1, c.hc_mult, 1)
    pre_mix = identity_pre_mix(h, c.hc_mult)
    entry = None
    for layer in model.layers:
        ctx = enc_ctx if layer.layer_id < c.encoder_layers else dec_ctx
        if layer.engram is not None:
            h = layer.engram(h, hash_ids[:, :, model.engram_index[layer.layer_id]])
            entry = None

        def attention(x, layer=layer, ctx=ctx):
            return layer.attn(x, ctx)

        h, pre_mix, entry = layer(h, pre_mix, attention, entry=entry, next_block=model.next_block(layer.layer_id))
    return model.head_logits(entry[0])[0, -1]


@pytest.mark.parametrize("n_over", [1, 45, 100])
def test_encoder_only_prefill_equals_the_training_forward_with_truncated_decoder_windows(n_over):
    torch.manual_seed(71 + n_over)
    model = engine_test_model(71 + n_over)
    c = model.config
    tokens = torch.randint(3, c.vocab_size, (1, c.window_size + n_over))
    with torch.no_grad():
        want = _truncated_decoder_reference(model, tokens)
        plain = model(tokens)[0, -1]  # the untruncated forward: what the replay approximates
    got = prefill(Runner(model), SequenceCache(c), tokens[0].tolist(), chunk=32)
    err, gap = rel_err(got, want), rel_err(plain, want)
    print(f"encoder-only vs truncated reference: {err:.2e} (the untruncated forward differs by {gap:.2e})")
    assert err <= FLIP_RTOL and gap > 20 * err  # the reference itself can tell truncation from none


def _conversation(model, seed: int, follow: int):
    g = torch.Generator().manual_seed(seed)
    V, W = model.config.vocab_size, model.config.window_size
    return torch.randint(3, V, (3 * W + 7,), generator=g).tolist(), torch.randint(3, V, (follow,), generator=g).tolist()


def _first_logits(engine: Engine, prompt: list[int]) -> tuple[torch.Tensor, object]:
    seen = {}
    emit = engine._emit

    def capture(seqs, logits, *sampled):
        seen.setdefault("row", logits[0].clone())
        return emit(seqs, logits, *sampled)

    engine._emit = capture
    req = engine.add_request(prompt, SamplingParams(max_tokens=1))
    while not req.finished:
        engine.step()
    engine._emit = emit
    return seen["row"], req


def test_a_global_only_hit_replays_exactly_n_win_through_the_encoder_and_rewrites_no_global_kv(tmp_path):
    torch.manual_seed(72)
    model = engine_test_model(72)
    c = model.config
    W, enc = c.window_size, c.encoder_layers
    engine = Engine(model, prefix_cache=PrefixCache(c, PersistentStore(tmp_path), None))
    first, follow = _conversation(model, 72, W + 9)
    out = engine.generate([first], max_tokens=5)[0]
    turn2 = first + out + follow
    resumed, prefilled = {}, {}
    admit, emit = engine.admit, engine._emit

    def spy_admit(seq):  # right after the resume: the rows that came from the stored units
        admit(seq)
        stores = seq.cache.entry_stores.items()
        resumed.update({s: (st.kv.read().clone(), st.index_k.read().clone()) for s, st in stores})
        resumed["b"] = seq.cache.n_tokens

    def spy_emit(seqs, logits, *sampled):  # when the prefill has finished (before the request frees its pages)
        for s, st in seqs[0].cache.entry_stores.items():
            prefilled[s] = (st.kv.read().clone(), st.index_k.read().clone(), st.n_entries)
        prefilled["n"] = seqs[0].cache.n_tokens
        return emit(seqs, logits, *sampled)

    engine.admit, engine._emit = spy_admit, spy_emit
    with recorded_calls() as calls:
        req = engine.add_request(turn2, SamplingParams(max_tokens=1))
        while not req.finished:
            engine.step()
    b = resumed.pop("b")
    assert req.cached_tokens == b > W and req.replayed_tokens == W
    encoder = [k for k in calls if k["kind"] == "forward" and k["layers"] == (0, enc)]
    # the replay: the last W cached tokens through the encoder only, window KV only, truncated at b − W
    assert [(k["start"], k["n"]) for k in encoder if not k["compress"]] == [(b - W, W)]
    assert all(k["replay_start"] == b - W for k in encoder)  # the suffix keeps the same truncation
    assert sum(k["n"] for k in encoder if k["compress"]) == len(turn2) - b
    assert not [k for k in calls if k["kind"] == "forward" and k["layers"] == (0, c.n_layers)]  # no exact pass
    n = prefilled.pop("n")
    assert n == len(turn2)
    for s, (kv, index) in resumed.items():
        kv_after, index_after, n_entries = prefilled[s]
        assert torch.equal(kv_after[:kv.size(0)], kv) and torch.equal(index_after[:index.size(0)], index), \
            f"source {s}: cached global KV was rewritten"
        assert n_entries == n // engine.pools.sources[s].ratio, f"source {s}: {n_entries} entries for {n} tokens"


def test_an_exact_resume_continues_the_decoder_windows_of_the_cached_sequence(tmp_path):
    """A snapshot hit followed by a short suffix (< n_win) = the same sequence decoded on token by token:
    the decoder's windows are restored and continued, not rebuilt by a bounded replay."""
    torch.manual_seed(73)
    model = engine_test_model(73)
    c = model.config
    engine = Engine(model, prefix_cache=PrefixCache(c, PersistentStore(tmp_path), InProcessSWAPool()))
    first, follow = _conversation(model, 73, 5)
    out = engine.generate([first], max_tokens=6)[0]
    turn2 = first + out + follow
    got, req = _first_logits(engine, turn2)
    assert engine.prefix_cache.stats.exact_resumes == 1 and req.replayed_tokens == 0
    # the reference: the first request's own computation, continued one token at a time
    runner, seq = Runner(model), SequenceCache(c)
    prefill(runner, seq, first)
    h = pre = None
    for t in turn2[len(first):]:
        h, pre = runner.forward([seq], torch.tensor([[t]]), [seq.n_tokens], range(c.n_layers))
        seq.tokens.append(t)
    want = runner.logits(h, pre)[0]
    err = rel_err(got, want)
    print(f"exact resume vs uninterrupted decode: {err:.2e}")
    assert err <= FLIP_RTOL


def test_a_snapshot_of_another_length_is_never_restored(tmp_path):
    """A window snapshot filed under a position whose length it does not hold (a damaged or colliding
    pool entry) is ignored: the resume falls back to the bounded replay."""
    torch.manual_seed(74)
    model = engine_test_model(74)
    c = model.config
    pool = InProcessSWAPool()
    cache = PrefixCache(c, PersistentStore(tmp_path), pool)
    engine = Engine(model, prefix_cache=cache)
    first, follow = _conversation(model, 74, c.window_size + 3)
    out = engine.generate([first], max_tokens=6)[0]
    turn2 = first + out + follow
    q = len(first) + len(out) - 1  # the snapshot at the output end (a resume probes q and q + 1)
    key_q, key_wrong = chain_hashes(turn2, [q, q + 1], cache._salts(None)[1])
    got = pool.get(key_q)
    assert got is not None and got[1]["n_tokens"] == q
    pool.clear()
    pool.put(key_wrong, *got)  # q's state filed under position q + 1, probed first
    _, req = _first_logits(engine, turn2)
    assert cache.stats.exact_resumes == 0 and req.replayed_tokens == c.window_size
