"""GPU checks of speculative decoding (the H200; skipped in CI): greedy speculation on CUDA (Triton kernels,
eager verification) equals the plain engine with CUDA graphs; rejected tokens leave no trace in the quantized
caches; the start-up profile gives a usable curve."""

from __future__ import annotations

import pytest
import torch
from tests.conftest import engine_test_model
from tests.engine.test_speculative import FLAT, ScriptedDrafter, _run, cache_bytes

from dsv41.engine.block_manager import BlockManager
from dsv41.engine.cache import SequenceCache
from dsv41.engine.engine import Engine
from dsv41.engine.prefill import prefill
from dsv41.engine.runner import Capture, Runner
from dsv41.engine.sampling import SamplingParams
from dsv41.engine.speculative import NoisyDrafter, OracleDrafter, VerifyRollback

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_greedy_speculation_on_cuda_equals_the_graph_replayed_plain_engine():
    torch.manual_seed(60)
    model = engine_test_model(60).to("cuda")
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(60)
    prompts = [torch.randint(3, V, (int(n),), generator=g).tolist() for n in torch.randint(1, 300, (24,), generator=g)]
    n_out = torch.randint(1, 40, (24,), generator=g).tolist()
    plain = _run(Engine(model, max_batch=24, max_seq_len=512), prompts, n_out)
    script = ScriptedDrafter(4, {tuple(p): o for p, (o, _) in zip(prompts, plain)})
    noisy = Engine(model, max_batch=24, max_seq_len=512, step_time=FLAT,
                   drafter=NoisyDrafter(V, 4, base=script, noise=0.3))
    got = _run(noisy, prompts, n_out)
    wrong = [i for i in range(len(prompts)) if got[i] != plain[i]]
    assert not wrong, f"{len(wrong)}/{len(prompts)} differ (float near-ties?), first {wrong[0]}"
    oracle = Engine(model, max_batch=24, max_seq_len=512,
                    drafter=OracleDrafter(model, 4, max_sequences=24, max_seq_len=512))  # profiles its curve
    assert _run(oracle, prompts, n_out) == plain
    st = oracle.stats.speculative
    assert st.accepted >= 0.95 * st.drafted, st.summary()
    curve = oracle.step_time
    assert len(curve.points) >= 4 and all(t > 0 for _, t in curve.points), curve.to_dict()
    print(oracle.stats.speculative.summary(), curve.to_dict())


def test_rollback_on_cuda_restores_the_quantized_bytes():
    model = engine_test_model(61).to("cuda")
    c = model.config
    runner = Runner(model)
    pools = BlockManager(c, "cuda", max_slots=8, max_tokens=8 * 256, max_seq_len=256, page_rows=4)
    g = torch.Generator().manual_seed(61)
    prompt = torch.randint(3, c.vocab_size, (45,), generator=g).tolist()
    keeps = [0, 1, 2, 3]
    block = torch.randint(3, c.vocab_size, (len(keeps), 5), generator=g)
    twin = torch.randint(3, c.vocab_size, (len(keeps), 5), generator=g)
    for b, keep in enumerate(keeps):
        twin[b, :keep] = block[b, :keep]
    rows = [SequenceCache(c, pools=pools) for _ in range(2 * len(keeps))]
    for cache in rows:
        prefill(runner, cache, prompt)
    starts = [r.n_tokens for r in rows]
    rollback = VerifyRollback(pools, rows, starts, 5)
    capture = Capture(projections=True)
    tokens = torch.cat((block, twin)).cuda()
    runner.forward(rows, tokens, starts, range(c.n_layers), capture=capture)
    for cache, row in zip(rows, tokens.tolist()):
        cache.tokens.extend(row)
    rollback.restore(keeps + keeps, capture.kv_projections)
    for b, keep in enumerate(keeps):
        got, other = cache_bytes(pools, rows[b]), cache_bytes(pools, rows[len(keeps) + b])
        for name in got:
            if ".pending_" in name:  # fp32: the twins' other rows may route differently through the experts
                err = ((got[name] - other[name]).abs().max() / other[name].abs().max().clamp(min=1e-30)).item()
                assert err < 1e-5, f"row keeping {keep}: {name} rel err {err:.2e}"
            else:
                assert torch.equal(got[name], other[name]), f"row keeping {keep}: {name}"
        assert rows[b].n_tokens == len(prompt) + keep


def test_the_verification_graph_replays_the_eager_static_step():
    """The static verification step (k + 1 positions per row) replayed from its CUDA graph = the same step
    run eagerly, from the same cache states (swapped back in between): logits, the drafter's features, the
    compressor projections and every cache byte the step writes; then the rollback replayed from its graph
    (rows keeping 0 … T positions) = the eager rollback, byte for byte."""
    model = engine_test_model(62).to("cuda")
    c = model.config
    layers = [c.n_layers - 2, c.n_layers - 1]

    class Wanting(NoisyDrafter):
        def features_wanted(self):
            return layers

    engine = Engine(model, max_batch=8, max_seq_len=512, step_time=FLAT, drafter=Wanting(c.vocab_size, 4, noise=1.0))
    assert engine.vgraphs is not None
    g = torch.Generator().manual_seed(62)
    seqs = [engine.add_request(torch.randint(3, c.vocab_size, (n,), generator=g).tolist(),
                               SamplingParams(max_tokens=50)) for n in (5, 37, 130, 200, 261)]
    while any(s.prefilling or s.next_token is None for s in seqs):
        engine.step()
    caches, B, T = [s.cache for s in seqs], len(seqs), engine.drafter.k + 1
    block = torch.randint(3, c.vocab_size, (B, T), generator=g)
    block[:, 0] = torch.tensor([s.next_token for s in seqs])
    block = block.tolist()
    keep = [0, 1, 3, T, 2]  # block positions each row keeps
    saved = [(cache.swap_out(), list(cache.tokens)) for cache in caches]  # bit-exact start states
    runs = []
    for graphs in (None, engine.vgraphs):
        for cache, (state, tokens) in zip(caches, saved):
            cache.swap_in(state)
            cache.tokens = list(tokens)
        starts = [cache.n_tokens for cache in caches]
        logits = engine._run_static(engine.vio, graphs, caches, block).clone()
        features = engine.vio.features[:, :B].clone()
        projections = {s: (kv[:B].clone(), sc[:B].clone()) for s, (kv, sc) in engine.vio.projections.items()}
        for cache, row in zip(caches, block):
            cache.tokens.extend(row)
        written = [cache_bytes(engine.pools, cache) for cache in caches]
        engine.vio.send_keep(keep)
        if graphs is None:
            engine.runner.restore(engine.vio, B)
        else:
            graphs.restore(B)
        for cache, start, n in zip(caches, starts, keep):
            cache.truncate(start + n)
        kept = [cache_bytes(engine.pools, cache) for cache in caches]
        for cache in caches:
            cache.swap_out()  # free the slots for the next run
        runs.append((logits, features, projections, written, kept))
    (l0, f0, p0, w0, k0), (l1, f1, p1, w1, k1) = runs
    assert engine.vgraphs.captures >= 2  # the step and its rollback
    for name, a, b in [("logits", l0, l1), ("features", f0, f1)] + \
            [(f"projections {s}", p0[s][0], p1[s][0]) for s in p0]:
        err = ((a - b).abs().max() / b.abs().max()).item()
        assert err < 1e-5, f"{name}: graph vs eager rel err {err:.2e}"
    for what, x0, x1 in (("written", w0, w1), ("after the rollback", k0, k1)):
        for b in range(B):
            assert x0[b].keys() == x1[b].keys()
            for name in x0[b]:
                if ".pending_" in name:
                    err = ((x0[b][name] - x1[b][name]).abs().max() / x1[b][name].abs().max().clamp(min=1e-30)).item()
                    assert err < 1e-5, f"{what}, row {b}: {name} rel err {err:.2e}"
                else:
                    assert torch.equal(x0[b][name], x1[b][name]), f"{what}, row {b}: {name} differs, graph vs eager"


@pytest.mark.parametrize("speculative", [False, True])
def test_a_warmed_up_engine_captures_no_decode_graph_while_it_decodes(speculative):
    """`Engine.warm_up` captures every decode graph (`capture_decode_graphs`): afterwards a closed batch whose rows
    finish one by one (every batch bucket) and whose longest rows pass an entry bound (graph_min_entries=16)
    captures none — plain steps, verifications and rollbacks — and emits the tokens of an engine that captured
    each graph when a step first needed it."""
    model = engine_test_model(62).to("cuda")
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(62)
    prompts = [torch.randint(3, V, (int(n),), generator=g).tolist() for n in torch.randint(1, 120, (8,), generator=g)]
    n_out = [8 * (i + 1) for i in range(8)]  # rows finish one by one: 8 → 1 through every bucket

    def engine():
        drafter = OracleDrafter(model, 4, max_sequences=8, max_seq_len=256) if speculative else None
        return Engine(model, max_batch=8, max_seq_len=256, graph_min_entries=16, step_time=FLAT, drafter=drafter,
                      speculate="always")

    def captures(e):
        return sum(gr.captures for gr in (e.graphs, e.vgraphs) if gr is not None)

    cold = engine()
    want = _run(cold, prompts, n_out)
    assert captures(cold) > 1  # the cold engine captured while it decoded: the check below has something to catch
    warm = engine()
    warm.warm_up(decode_graphs=False)
    assert warm.capture_decode_graphs() > 0 and warm.capture_decode_graphs() == 0  # the second call finds all
    before = captures(warm)
    assert _run(warm, prompts, n_out) == want
    assert captures(warm) == before
