"""`StaticPrefill`: encoder-only prefill from static steps (CUDA graphs on the GPU) is `prefill(exact=False)`.

CPU, fp32, against the host-driven prefill (`PrefillJob`, the engine's path — itself checked against the
training forward in test_engine.py): the last position's logits and byte-equal caches — every kv source's
entries, index keys and open partial group, every layer's window ring — for prompts of several lengths
(shorter than a window, a chunk and a remainder, whole chunks), a second turn on the same sequence, and a
config with a ratio-2 decoder source and a decoder Engram layer. On the GPU: graph replay = eager."""

from __future__ import annotations

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


def _same_caches(pools: BlockManager, ref: SequenceCache, seq: SequenceCache) -> None:
    assert seq.tokens == ref.tokens
    for s, src in pools.sources.items():
        a, b = ref.entry_stores[s], seq.entry_stores[s]
        assert a.n_entries == b.n_entries
        assert torch.equal(a.kv.read(), b.kv.read()) and torch.equal(a.index_k.read(), b.index_k.read())
        r = seq.n_tokens % src.ratio
        assert torch.equal(src.pending_kv[ref.slot, :r], src.pending_kv[seq.slot, :r])
    for layer in range(len(pools.ring_rows)):
        assert torch.equal(pools.ring_positions[layer][ref.slot], pools.ring_positions[layer][seq.slot])
        assert torch.equal(pools.ring_rows[layer][ref.slot], pools.ring_rows[layer][seq.slot])


@pytest.mark.parametrize("lengths", [(9,), (61,), (100, 45), (96,)], ids=str)  # chunk 24, window 32
def test_static_prefill_is_the_host_driven_encoder_only_prefill(lengths):
    model = _model(92)
    c = model.config
    runner = Runner(model)
    pools = BlockManager(c, torch.device("cpu"), max_slots=2, max_tokens=2048, max_seq_len=1024, page_rows=16)
    ref, seq = SequenceCache(c, pools=pools), SequenceCache(c, pools=pools)
    static = StaticPrefill(runner, pools, chunk=24)
    g = torch.Generator().manual_seed(sum(lengths))
    for n in lengths:  # turns on the same sequence
        prompt = torch.randint(3, 1000, (n,), generator=g).tolist()
        want = prefill(runner, ref, prompt, chunk=24)
        got = static(seq, prompt)
        torch.testing.assert_close(got, want, rtol=0, atol=2e-6 * float(want.abs().max()))
        _same_caches(pools, ref, seq)


def test_static_prefill_refuses_what_it_cannot_run():
    model = _model(93)
    pools = BlockManager(model.config, torch.device("cpu"), max_slots=1, max_tokens=256, max_seq_len=256)
    with pytest.raises(ValueError, match="chunk"):
        StaticPrefill(Runner(model), pools, chunk=0)
    with pytest.raises(ValueError, match="CUDA"):
        StaticPrefill(Runner(model), pools, graphs=True)
    with pytest.raises(ValueError, match="token"):
        StaticPrefill(Runner(model), pools)(SequenceCache(model.config, pools=pools), [])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_static_prefill_graphs_equal_eager(dtype):
    """Replayed from CUDA graphs (full chunks and windows, captured on padding; three turns on one sequence,
    so that later chunks replay a graph whose outputs an earlier chunk's tail came from) = the same steps
    eagerly."""
    from dsv41.engine.engine import cast_for_engine

    model = cast_for_engine(_model(94).cuda(), dtype)
    c = model.config
    runner = Runner(model)
    out = {}
    for graphs in (False, True):
        pools = BlockManager(c, torch.device("cuda"), max_slots=2, max_tokens=4096, max_seq_len=2048)
        static = StaticPrefill(runner, pools, chunk=64, graphs=graphs, min_entries=64)
        seq = SequenceCache(c, pools=pools)
        g = torch.Generator().manual_seed(5)
        out[graphs] = [static(seq, torch.randint(3, 1000, (n,), generator=g).tolist()) for n in (300, 128, 77)]
        if graphs:
            assert static.captures >= 2
    for a, b in zip(out[False], out[True]):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5 * float(a.abs().max()))
