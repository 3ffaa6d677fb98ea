"""Engine acceptance: cached prefill/decode = the model's full forward; packed storage is exact;
batching changes nothing; encoder-only prefill = exact prefill for short prompts."""

from __future__ import annotations

import pytest
import torch
from tests.conftest import engine_test_model

from dsv41 import load_config
from dsv41.engine.cache import SequenceCache, private_pools
from dsv41.engine.engine import Engine
from dsv41.engine.prefill import prefill
from dsv41.engine.runner import Runner
from dsv41.engine.sampling import SamplingParams
from dsv41.model.state import ForwardContext
from dsv41.quant.fp4 import fake_quant_index_fp4, fake_quant_kv_fp4
from dsv41.quant.fp8 import fake_quant_window_fp8


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("prompt_len", [9, 32, 150])  # odd < window, = window, ≫ window (W = 32)
def test_exact_prefill_and_20_decode_steps_equal_full_forward(prompt_len):
    torch.manual_seed(prompt_len)
    model = engine_test_model(prompt_len)
    runner = Runner(model)
    tokens = torch.randint(3, model.config.vocab_size, (1, prompt_len + 20))
    with torch.no_grad():
        reference = model(tokens)[0]  # the training forward over the full sequence
    seq = SequenceCache(model.config)
    logits = prefill(runner, seq, tokens[0, :prompt_len].tolist(), chunk=16, exact=True)
    assert rel_err(logits, reference[prompt_len - 1]) <= 1e-4
    for k in range(20):
        t = prompt_len + k
        h, pre_mix = runner.forward([seq], tokens[:, t:t + 1], torch.tensor([t]), range(model.config.n_layers))
        seq.tokens.append(int(tokens[0, t]))
        assert rel_err(runner.logits(h, pre_mix)[0], reference[t]) <= 1e-4, f"decode step {k}"


def _batched_decode_equals_full_forward(model, reference, lengths: list[int], steps: int) -> None:
    """Exact prefill of each prompt, then `steps` batched cached decode steps of them all: every step's logits equal
    `reference`'s full forward of the whole sequence at that position (relative 1e-4)."""
    runner = Runner(model)
    seqs, refs, toks = [], [], []
    pools = private_pools(model.config, max_slots=len(lengths))  # one batch reads every sequence's pages
    for n in lengths:
        t = torch.randint(3, model.config.vocab_size, (1, n + steps))
        with torch.no_grad():
            refs.append(reference(t)[0])
        seq = SequenceCache(model.config, pools=pools)
        prefill(runner, seq, t[0, :n].tolist(), chunk=32, exact=True)
        seqs.append(seq)
        toks.append(t)
    for k in range(steps):
        batch = torch.stack([t[0, n + k] for t, n in zip(toks, lengths)]).view(-1, 1)
        start = torch.tensor([n + k for n in lengths])
        h, pre_mix = runner.forward(seqs, batch, start, range(model.config.n_layers))
        for s, tok in zip(seqs, batch[:, 0].tolist()):
            s.tokens.append(tok)
        logits = runner.logits(h, pre_mix)
        for b, n in enumerate(lengths):
            assert rel_err(logits[b], refs[b][n + k]) <= 1e-4, f"seq {b} step {k}"


def test_batched_decode_of_three_lengths_equals_full_forward():
    torch.manual_seed(3)
    model = engine_test_model(3)
    _batched_decode_equals_full_forward(model, model, [7, 40, 101], 20)


def test_encoder_only_prefill_equals_exact_when_prompt_fits_the_window():
    torch.manual_seed(5)
    model = engine_test_model(5)
    runner = Runner(model)
    W = model.config.window_size
    for n in (5, W - 1, W):
        ids = torch.randint(3, model.config.vocab_size, (n,)).tolist()
        exact = prefill(runner, SequenceCache(model.config), ids, chunk=8, exact=True)
        fast = prefill(runner, SequenceCache(model.config), ids, chunk=8, exact=False)
        assert rel_err(fast, exact) <= 1e-5, n
    # longer prompts differ (approximate by design) but stay close
    ids = torch.randint(3, model.config.vocab_size, (3 * W,)).tolist()
    exact = prefill(runner, SequenceCache(model.config), ids, chunk=8, exact=True)
    fast = prefill(runner, SequenceCache(model.config), ids, chunk=8, exact=False)
    assert not torch.allclose(fast, exact)
    kl = torch.sum(exact.softmax(-1) * (exact.log_softmax(-1) - fast.log_softmax(-1))).item()
    assert 0 < kl < 1.0


def test_encoder_only_prefill_runs_decoder_on_window_tokens_only():
    model = engine_test_model(6)
    runner = Runner(model)
    calls = []
    original = runner.forward

    def spy(seqs, tokens, start, layers, *args, **kwargs):
        calls.append((layers, tokens.size(1)))
        return original(seqs, tokens, start, layers, *args, **kwargs)

    runner.forward = spy
    ids = torch.randint(3, model.config.vocab_size, (100,)).tolist()
    seq = SequenceCache(model.config)
    prefill(runner, seq, ids, chunk=40, exact=False)
    enc, W = model.config.encoder_layers, model.config.window_size
    encoder_tokens = sum(n for layers, n in calls if layers == range(enc))
    decoder_tokens = sum(n for layers, n in calls if layers.start == enc)
    assert encoder_tokens == 100 and decoder_tokens == W
    # decoder global KV exists for every prompt token; decoder windows hold only the replayed tokens
    assert seq.entry_stores[enc].n_entries == 100
    assert int((seq.windows[enc].positions >= 0).sum()) == W
    assert int(seq.windows[enc].positions.min()) == 100 - W


def test_packed_storage_dequantizes_bit_exactly_to_the_models_fake_quant():
    torch.manual_seed(7)
    model = engine_test_model(7)
    runner = Runner(model)
    tokens = torch.randint(3, model.config.vocab_size, (1, 61))
    seq = SequenceCache(model.config)
    prefill(runner, seq, tokens[0].tolist(), chunk=16, exact=True)
    ctx = ForwardContext.build(tokens, trace=[])
    with torch.no_grad():
        model(tokens, ctx=ctx)
    for rec in ctx.trace:
        if rec["mode"] != "full":
            continue
        layer = rec["layer"]
        store = seq.entry_stores[layer]
        assert torch.equal(store.entries(), rec["kv"][0, :store.n_entries]), f"entries of layer {layer}"
    # and the quantizers themselves: stored → dequantized equals fake-quant on fresh data
    x = torch.randn(13, model.config.head_dim) * 3
    store = SequenceCache(model.config).entry_stores[2]  # a fresh sequence's empty store
    store.append(x, x[:, :model.config.index_head_dim])
    assert torch.equal(store.entries(), fake_quant_kv_fp4(x))
    assert torch.equal(store.index_keys(), fake_quant_index_fp4(x[:, :model.config.index_head_dim]))
    ring = seq.windows[0]
    ring.write(x[:5], torch.arange(200, 205))
    values, positions = ring.read()
    slots = torch.arange(200, 205) % ring.window
    assert torch.equal(values[slots], fake_quant_window_fp8(x[:5]))
    assert torch.equal(positions[slots], torch.arange(200, 205))


def test_batch_gives_the_same_greedy_tokens_as_each_sequence_alone():
    torch.manual_seed(8)
    model = engine_test_model(8)
    prompts = [torch.randint(3, model.config.vocab_size, (n,)).tolist() for n in (5, 44, 77)]
    batched = Engine(model, prefill_chunk=32).generate(prompts, max_tokens=12)
    alone = [Engine(model, prefill_chunk=32).generate([p], max_tokens=12)[0] for p in prompts]
    assert batched == alone
    assert all(len(out) == 12 for out in batched)


def test_sampling_is_reproducible_with_a_seed_and_stop_ids_end_requests():
    model = engine_test_model(9)
    engine = Engine(model)
    prompt = torch.randint(3, model.config.vocab_size, (20,)).tolist()
    a = engine.generate([prompt], max_tokens=10, temperature=1.0, seed=1234)
    b = engine.generate([prompt], max_tokens=10, temperature=1.0, seed=1234)
    assert a == b
    greedy = engine.generate([prompt], max_tokens=10)[0]
    stopped = engine.generate([prompt], max_tokens=10, stop_token_ids=[greedy[3]])[0]
    assert stopped == greedy[:greedy.index(greedy[3])]


def test_bytes_per_token_is_measured_from_the_stored_rows():
    v41 = load_config("v41-flash")
    cache = SequenceCache(v41, "cpu")  # small private pools: cheap even at full size
    assert cache.bytes_per_token() == 890
    tiny = SequenceCache(load_config("tiny"))
    # tiny: a 32-dim latent → 16 + 2 B, 32-dim index key → 16 + 1 B; sources at m=2 and m=1
    assert tiny.bytes_per_token() == (18 + 17) / 2 + (18 + 17)


def test_warm_up_leaves_an_idle_engine_that_serves_as_a_fresh_one(tmp_path):
    """`Engine.warm_up` (serve --warm-up): throwaway prompts through prefill and decode, then nothing of them is
    left — no request, every slot and page free, nothing in the prefix cache — and a request afterwards gets a
    fresh engine's tokens; a busy engine refuses it."""
    from dsv41.engine.prefix import PrefixCache
    from dsv41.engine.prefix_store import InProcessSWAPool, PersistentStore

    model = engine_test_model(88)
    cache = PrefixCache(model.config, PersistentStore(tmp_path / "store"), InProcessSWAPool())
    engine = Engine(model, max_batch=3, prefix_cache=cache)
    free = {s: engine.pools.free_pages(s) for s in engine.pools.sources}
    assert engine.warm_up() > 0
    assert engine.stats.steps > 5 and not engine.has_work()
    assert {s: engine.pools.free_pages(s) for s in engine.pools.sources} == free
    assert engine.pools.free_slots == engine.max_batch
    assert engine.prefix_cache is cache and cache.metrics()["unit_tokens_written"] == 0
    prompt = torch.randint(3, 1000, (40,), generator=torch.Generator().manual_seed(88)).tolist()
    assert engine.generate([prompt], max_tokens=6) == Engine(model).generate([prompt], max_tokens=6)
    engine.add_request(prompt, SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="idle"):
        engine.warm_up()


def test_warm_up_runs_its_prompts_on_the_host_path_and_through_static_prefill():
    """With static prefill on, the warm-up's prompts take both prefill paths — the host path (every piece beside
    decoding streams runs there: its kernels must be compiled before the first loaded step) and `StaticPrefill` —
    and leave the engine's static prefill in place."""
    model = engine_test_model(89)
    for static_prefill in (True, False):
        engine = Engine(model, max_batch=3, static_prefill=static_prefill)
        static, host_forward, host = engine.static, engine.runner.forward, []

        def counted(*args, host=host, host_forward=host_forward, **kwargs):
            host.append(1)
            return host_forward(*args, **kwargs)

        engine.runner.forward = counted  # the host path's forward (StaticPrefill runs static steps instead)
        engine.warm_up(groups=((5,), (9, 3)))
        assert engine.static is static and (static is not None) == static_prefill
        assert len(host) >= 3  # on the host path: each group's encoder pieces and replays
        if static is not None:
            assert static.pieces >= 3 and engine.stats.static_prefill_runs >= 3  # and each prompt through static


@pytest.mark.parametrize("layers", [None, 1])
def test_warm_up_prefills_a_prompt_of_two_chunks_beside_a_decoding_request(layers):
    """`warm_up(beside=True)`: after the groups, a prompt of prefill_chunk + 17 tokens arrives while another request
    decodes — steps with decode rows and prefill pieces together, the prompt in two chunks (and layer pieces with
    `prefill_layers`); the engine is left idle with every page free. beside=False: no such step."""
    model = engine_test_model(90)
    for beside in (True, False):
        engine = Engine(model, max_batch=3, prefill_chunk=16, prefill_layers=layers)
        free = {s: engine.pools.free_pages(s) for s in engine.pools.sources}
        schedule, mixed = engine.scheduler.schedule, []

        def recorded(schedule=schedule, mixed=mixed):
            batch = schedule()
            if batch.decode and batch.prefill:
                mixed.append(batch)
            return batch

        engine.scheduler.schedule = recorded
        engine.warm_up(groups=((5,),), beside=beside)
        assert not engine.has_work() and engine.pools.free_slots == engine.max_batch
        assert {s: engine.pools.free_pages(s) for s in engine.pools.sources} == free
        if not beside:
            assert not mixed
            continue
        assert len(mixed) >= 2  # the arriving prompt's chunks (16 + 16 + 1 tokens) beside the decoding one
        if layers == 1:  # one layer a step: the encoder's layers one piece each
            assert len(mixed) >= 2 * model.config.encoder_layers


def test_decode_with_the_fused_dense_moe_equals_the_unfused_full_forward():
    """What an engine with CUDA graphs sets on its model (`layout_for_graphs`: the dense MoE dispatch for decode
    steps and small pieces, the shared expert fused into it, wq_a and wkv one matrix) keeps prefill + batched cached
    decode equal to the full forward of an untouched copy of the model (the routed dispatch, shared expert apart,
    two input GEMMs) — on the CPU, where an engine never sets it itself."""
    import copy

    from dsv41.engine.engine import layout_for_graphs

    torch.manual_seed(7)
    model = engine_test_model(7)
    reference = copy.deepcopy(model)
    layout_for_graphs(model, 3)
    moe = model.moe_layers()[0]
    assert moe.dense_tokens > 100 and moe._fused_ok()  # tiny: every forward of these prompts runs dense
    assert all(layer.attn._fused_a_ok() for layer in model.layers)  # one input GEMM for wq_a and wkv
    _batched_decode_equals_full_forward(model, reference, [9, 60], 12)


def test_a_second_engine_layout_leaves_the_weights_where_the_first_engines_graphs_read_them():
    """A second engine on the same model calls `layout_for_graphs` again (a benchmark's plain and speculative
    engines; a server that rebuilds its engine): every parameter and fused matrix keeps its storage and values.
    Re-fusing freed the matrices the first engine's CUDA graphs read by address (H100, 2026-12-07: its outputs
    garbage from the first token, then an illegal memory access)."""
    from dsv41.engine.engine import layout_for_graphs

    torch.manual_seed(5)
    model = engine_test_model(5)
    layout_for_graphs(model, 3)
    fused = [(layer.attn._fused_a[0], layer.attn._fused_a[0].data_ptr()) for layer in model.layers]
    fused += [(t, t.data_ptr()) for moe in model.moe_layers() for t in moe._fused[:2]]
    where = {name: (p.data_ptr(), p.detach().clone()) for name, p in model.named_parameters()}
    layout_for_graphs(model, 18)  # the second engine: k + 1 = 6 tokens a row
    assert all(t.data_ptr() == ptr for t, ptr in fused)
    assert all(layer.attn._fused_a[0] is t for layer, (t, _) in zip(model.layers, fused))
    for name, p in model.named_parameters():
        assert p.data_ptr() == where[name][0] and torch.equal(p, where[name][1]), name
    assert all(moe._fused_ok() for moe in model.moe_layers())


def test_dense_piece_tokens_is_the_flop_budget_over_the_extra_experts():
    """`dense_piece_tokens`: DENSE_EXTRA_FLOPS over (E − k) · 6 · dim · inter — by hand, `small` (E 8, k 2, dim
    384, inter 256): 4e9 // 3,538,944 = 1,130 tokens; the release's widths: none; no extra experts: none."""
    from dsv41.engine.engine import DENSE_EXTRA_FLOPS, dense_piece_tokens
    from dsv41.model.moe import MoE

    assert DENSE_EXTRA_FLOPS == 4e9
    small = load_config("small")
    assert dense_piece_tokens(MoE(small.n_layers - 1, small)) == 1130
    with torch.device("meta"):
        flash = load_config("v41-flash")
        assert dense_piece_tokens(MoE(flash.n_layers - 1, flash)) == 0
        every = small.replace(n_activated_experts=small.n_routed_experts)
        assert dense_piece_tokens(MoE(every.n_layers - 1, every)) == 0


def test_the_fused_input_projection_is_both_weights_and_one_gemm():
    """`Attention.fuse_projections` (set by `layout_for_graphs`): wq_a and wkv become views into one matrix — the
    state dict unchanged, `project` = the two linears (fp64 products, fp32 rounding), an in-place update of either
    weight seen by the fused GEMM, a cast or a reassigned weight undoing the fusion (the two linears again), and one
    matmul instead of two."""
    from torch.utils._python_dispatch import TorchDispatchMode

    torch.manual_seed(3)
    model = engine_test_model(3)
    attn = model.layers[2].attn
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert attn.fuse_projections() and attn._fused_a_ok()
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    x = torch.randn(2, 5, model.config.dim)

    def want():
        x64 = x.double()
        return x64 @ attn.wq_a.weight.double().T, x64 @ attn.wkv.weight.double().T

    class Matmuls(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Matmuls.n += func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm)
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Matmuls():
        q_a, kv_a = attn.project(x)
    assert Matmuls.n == 1
    for got, ref in zip((q_a, kv_a), want()):
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        attn.wkv.weight.mul_(-2.0)  # in place: the fused matrix sees it
        q_a, kv_a = attn.project(x)
    torch.testing.assert_close(kv_a.double(), want()[1], rtol=1e-5, atol=1e-5)
    attn.wkv.weight.data = attn.wkv.weight.data.clone()  # reassigned: no longer a view
    assert not attn._fused_a_ok()
    with torch.no_grad():
        attn.wkv.weight.mul_(0.5)
        q_a, kv_a = attn.project(x)
    torch.testing.assert_close(kv_a.double(), want()[1], rtol=1e-5, atol=1e-5)
    assert attn.fuse_projections()
    model.double()  # a cast gives the weights new tensors
    assert attn._fused_a is None
