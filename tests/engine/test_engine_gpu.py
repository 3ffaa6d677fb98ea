"""GPU checks of the engine (run on the H200 by scripts/gpu_check.sh; skipped in CI):
CUDA-graph replay = the eager static step, and the decode step never syncs with the host."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from tests.conftest import engine_test_model

from dsv41.engine.engine import Engine
from dsv41.engine.sampling import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def run(engine: Engine, prompts: list[list[int]], n_out: list[int], monkeypatch) -> tuple[list[list[int]], dict]:
    seen: dict[int, list[torch.Tensor]] = defaultdict(list)
    emit = Engine._emit

    def spy(self, seqs, logits, *sampled, **kw):
        for seq, row in zip(seqs, logits):
            seen[seq.id].append(row.float().cpu())
        return emit(self, seqs, logits, *sampled, **kw)

    monkeypatch.setattr(Engine, "_emit", spy)
    seqs = [engine.add_request(p, SamplingParams(max_tokens=n)) for p, n in zip(prompts, n_out)]
    while engine.has_work():
        engine.step()
    monkeypatch.setattr(Engine, "_emit", emit)
    return [s.output for s in seqs], {i: seen[s.id] for i, s in enumerate(seqs)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_replay_equals_the_eager_static_step(monkeypatch, dtype):
    torch.manual_seed(50)
    model = engine_test_model(50).to("cuda", dtype)
    V = model.config.vocab_size
    prompts = [torch.randint(3, V, (n,)).tolist() for n in (40, 333, 1100)]
    kw = dict(max_batch=4, max_seq_len=2048, page_rows=64, graph_min_entries=64)
    n_out = [40, 24, 8]  # requests finish at different steps: batches of 3, then 2, then 1
    eager_out, eager_rows = run(Engine(model, cuda_graphs=False, **kw), prompts, n_out, monkeypatch)
    graphs = Engine(model, cuda_graphs=True, **kw)
    graph_out, graph_rows = run(graphs, prompts, n_out, monkeypatch)
    assert graphs.graphs.captures >= 3, graphs.graphs.captures  # one graph per batch bucket (4, 2, 1)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    worst = 0.0
    for i in range(len(prompts)):
        n = min(len(eager_rows[i]), len(graph_rows[i]))
        for a, b in zip(graph_rows[i][:n], eager_rows[i][:n]):
            worst = max(worst, ((a - b).abs().max() / b.abs().max()).item())
    print(f"graph vs eager worst rel err {worst:.2e} ({dtype})")
    assert worst <= tol
    if dtype == torch.float32:
        assert graph_out == eager_out


def test_the_static_decode_step_never_syncs_with_the_host():
    torch.manual_seed(51)
    model = engine_test_model(51).to("cuda", torch.bfloat16)
    engine = Engine(model, max_batch=4, max_seq_len=1024, cuda_graphs=False, overlap=False)
    seqs = [engine.add_request(torch.randint(3, 1000, (n,)).tolist(), SamplingParams(max_tokens=50))
            for n in (30, 200, 470)]
    while any(s.prefilling or s.next_token is None for s in seqs):
        engine.step()
    io = engine.io
    io.fill_batch([s.cache for s in seqs], [s.next_token for s in seqs])
    io.send()
    n_max = io.max_entries(len(seqs))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        engine.runner.decode(io, len(seqs), n_max)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def _streams_and_prompt(engine: Engine, V: int, prompt_len: int) -> tuple[list, object]:
    """Three streams decoding, then a long prompt that arrives while they do (prefilled in layer pieces)."""
    streams = [engine.add_request(torch.randint(3, V, (n,)).tolist(), SamplingParams(max_tokens=400))
               for n in (30, 200, 470)]
    while any(s.prefilling or s.next_token is None for s in streams):
        engine.step()
    return streams, engine.add_request(torch.randint(3, V, (prompt_len,)).tolist(), SamplingParams(max_tokens=3))


def test_a_prefill_piece_beside_decoding_streams_never_syncs_with_the_device():
    """The overlap of `Engine.step` needs the host-driven prefill path to build its tensors without a stream
    sync (`block_manager.to_device`): every piece of a second prompt (the first one compiled the kernels)
    runs under CUDA's sync check."""
    from dsv41.engine.prefill import PrefillJob

    torch.manual_seed(52)
    model = engine_test_model(52).to("cuda", torch.bfloat16)
    V = model.config.vocab_size
    engine = Engine(model, max_batch=8, max_seq_len=2048, prefill_chunk=256, prefill_layers=1, overlap=False)
    _, warm = _streams_and_prompt(engine, V, 900)
    while not warm.finished:
        engine.step()
    step, checked = PrefillJob.step, []

    def checked_step(job, n=None, layers=None):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return step(job, n, layers)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            checked.append(layers)

    prompt = engine.add_request(torch.randint(3, V, (900,)).tolist(), SamplingParams(max_tokens=3))
    PrefillJob.step = checked_step
    try:
        while not prompt.output:
            engine.step()
    finally:
        PrefillJob.step = step
    assert len(checked) > 8, checked  # 4 chunks × the layers, one layer a step


def test_the_overlapped_step_emits_the_tokens_of_a_step_that_waits(monkeypatch):
    """Greedy tokens of streams and prompts are the same whether a step reads its sampled tokens after the
    prefill pieces (pinned copy + event) or right away."""
    outs = []
    for overlap in (True, False):
        torch.manual_seed(53)
        model = engine_test_model(53).to("cuda", torch.float32)
        V = model.config.vocab_size
        engine = Engine(model, max_batch=8, max_seq_len=2048, prefill_chunk=128, prefill_layers=2,
                        overlap=False)
        if not overlap:
            monkeypatch.setattr(engine, "_launch_sample", lambda seqs, logits: (lambda: None))
        streams, prompt = _streams_and_prompt(engine, V, 700)
        second = engine.add_request(torch.randint(3, V, (500,)).tolist(), SamplingParams(max_tokens=3))
        while not (prompt.finished and second.finished):
            engine.step()
        outs.append([s.output[:] for s in streams] + [prompt.output, second.output])
    assert outs[0] == outs[1]


def test_sampling_sampled_rows_never_syncs_with_the_host():
    """`_launch_sample` samples before the step's prefill pieces launch: the host draws of a batch of seeded
    and unseeded sampled rows (top-k / top-p too) reach the device without a stream sync."""
    from dsv41.engine.sampling import make_generator, sample

    logits = torch.randn(16, 1000, device="cuda")
    params = [SamplingParams(temperature=0.7, top_p=0.9 if i % 2 else 1.0, top_k=40 if i % 3 == 0 else 0,
                             seed=i if i % 4 else None) for i in range(16)]
    generators = [make_generator(p.seed) for p in params]
    sample(logits, params, generators)  # warm-up (first-use allocations)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sample(logits, params, generators)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.shape == (16,) and bool(((out >= 0) & (out < 1000)).all())


def test_overlapped_decode_with_graphs_emits_the_waiting_engines_tokens():
    """`Engine(overlap=True)` on CUDA (graph replays fed from the device tokens, two pinned token buffers, the
    input buffer reused only after its copy): the tokens of the engine that waits, stops and samples included."""
    torch.manual_seed(53)
    model = engine_test_model(53).to("cuda")
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(53)
    prompts = [torch.randint(3, V, (n,), generator=g).tolist() for n in (7, 60, 200, 33)]

    def run(overlap: bool, stops=None):
        engine = Engine(model, max_batch=8, overlap=overlap)
        seqs = [engine.add_request(p, SamplingParams(max_tokens=40, temperature=0.8 if i % 2 else 0.0, seed=i,
                                                     stop_token_ids=[stops[i]] if stops else []))
                for i, p in enumerate(prompts)]
        while engine.has_work():
            engine.step()
        return [s.output for s in seqs], engine.stats.overlapped_steps

    first, _ = run(False)
    stops = [out[len(out) // 2] for out in first]
    want, _ = run(False, stops)
    got, overlapped = run(True, stops)
    assert got == want and overlapped > 10


def test_a_cuda_engine_overlaps_by_default():
    from dsv41.engine.speculative import NoisyDrafter

    model = engine_test_model(54).to("cuda")
    assert Engine(model, max_batch=2).overlap and not Engine(model, max_batch=2, overlap=False).overlap
    drafter = NoisyDrafter(model.config.vocab_size, 2)  # with a drafter too (its plain steps; 2026-12-07)
    assert Engine(model, max_batch=2, drafter=drafter, step_time=lambda n: 1e-3).overlap


def test_overlapped_logprob_rows_on_cuda_equal_the_waiting_engines():
    """The logprobs of overlapped rows come from the device at launch through pinned copies and the step's
    event: the waiting engine's tokens, logprobs and top alternatives (graph replays, fp32)."""
    torch.manual_seed(55)
    model = engine_test_model(55).to("cuda")
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(55)
    prompts = [torch.randint(3, V, (n,), generator=g).tolist() for n in (9, 70, 150)]
    params = [SamplingParams(max_tokens=30, logprobs=3), SamplingParams(max_tokens=30, temperature=0.8, seed=2),
              SamplingParams(max_tokens=30, temperature=0.8, seed=3, logprobs=0)]

    from tests.engine.test_overlap import assert_same_outputs, outputs_with_logprobs

    want, _ = outputs_with_logprobs(Engine(model, max_batch=4, overlap=False), prompts, params)
    got, overlapped = outputs_with_logprobs(Engine(model, max_batch=4, overlap=True), prompts, params)
    assert overlapped > 10
    assert_same_outputs(want, got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_engine_decodes_as_before_after_a_second_engine_is_built_on_its_model(dtype):
    """Two engines on one model (the speculative benchmark's rounds; a server that rebuilds its engine): the second
    one's `layout_for_graphs` must leave the weights the first one's captured graphs read by address where they are
    (2026-12-07, H100: re-fusing freed them — the first engine's outputs garbage from their first token, then an
    illegal memory access). The first engine's greedy outputs, graph-replayed, before and after are equal token for
    token (the same engine and batch: deterministic)."""
    from dsv41.engine.speculative import NoisyDrafter

    torch.manual_seed(56)
    model = engine_test_model(56).to("cuda", dtype)
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(56)
    prompts = [torch.randint(3, V, (n,), generator=g).tolist() for n in (12, 90, 200)]

    def outputs(engine):
        seqs = [engine.add_request(p, SamplingParams(max_tokens=40)) for p in prompts]
        while engine.has_work():
            engine.step()
        return [s.output for s in seqs]

    first = Engine(model, max_batch=4)
    assert first.graphs is not None
    want = outputs(first)
    second = Engine(model, max_batch=8, drafter=NoisyDrafter(V, 3), step_time=lambda n: 1e-3)  # 8 × 4 tokens a row
    outputs(second)
    torch.cuda.synchronize()
    assert outputs(first) == want
