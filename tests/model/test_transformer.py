"""Acceptance tests of the text model on the `tiny` preset (issue: the model).

Every test draws fresh random inputs and compares against an independent computation or a
property that a wrong implementation breaks.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from tests.conftest import assert_close, randomize_mixing

from dsv41 import load_config
from dsv41.accounting import compute
from dsv41.model.attention import Attention
from dsv41.model.state import ForwardContext
from dsv41.model.transformer import Transformer
from dsv41.plan import REINDEX, REUSE, layer_plan


def tiny_model(seed: int, **changes) -> Transformer:
    config = load_config("tiny")
    if changes:
        config = config.replace(**changes)
    return Transformer(config).init_weights(seed=seed)




# ----------------------------------------------------------------------------- 1. causality
def test_causality_changing_token_t_never_changes_earlier_logits():
    torch.manual_seed(101)
    model = tiny_model(1)
    randomize_mixing(model, 1)
    T = 200
    tokens = torch.randint(3, model.config.vocab_size, (1, T))
    base = model(tokens)
    for t in (0, 37, 64, 101, 150, 199):  # odd and even: partial m=2 groups included
        changed = tokens.clone()
        changed[0, t] = (changed[0, t] + 1 + torch.randint(0, 100, ()).item()) % model.config.vocab_size
        out = model(changed)
        assert_close(out[:, :t], base[:, :t], what=f"logits before t={t}")
        assert not torch.allclose(out[:, t], base[:, t]), "the changed position itself must change"


# ----------------------------------------------------------------------------- 2. dense equivalence
def test_sparse_attention_equals_dense_window_plus_all_visible_entries():
    torch.manual_seed(202)
    config = load_config("tiny").replace(index_topk=10_000, candidate_source_layer=-1)
    model = Transformer(config).init_weights(seed=2)
    randomize_mixing(model, 2)
    B, T = 2, 90
    for layer_id in (2, 4):  # Full m=2 (encoder) and Full m=1 (decoder)
        attn: Attention = model.layers[layer_id].attn
        x = torch.randn(B, T, config.dim)
        ctx = ForwardContext.build(torch.zeros(B, T, dtype=torch.long))
        out = attn(x, ctx)
        # independent computation: explicit key lists per query, float64
        m = attn.ratio
        pos = torch.arange(T).expand(B, T)
        cos, sin = attn.angles(pos)
        _, q = attn.query(x, cos, sin)
        kv_w = attn.window_kv(x, cos, sin)
        n_groups = T // m
        ends = torch.arange(m - 1, n_groups * m, m).expand(B, n_groups)
        latent = attn.compressor(x, ends)
        entries, _ = attn.entries(latent, (ends - (m - 1)))
        o = torch.empty(B, T, config.n_heads, config.head_dim, dtype=torch.float64)
        for b in range(B):
            for t in range(T):
                keys = [kv_w[b, u] for u in range(max(0, t - config.window_size + 1), t + 1)]
                keys += [entries[b, s] for s in range((t + 1) // m)]
                K = torch.stack(keys).double()  # (S, D)
                logits = q[b, t].double() @ K.T * config.head_dim ** -0.5  # (H, S)
                sink = attn.attn_sink.double()[:, None]
                z = torch.cat([logits, sink], dim=1)
                p = torch.softmax(z, dim=1)[:, :-1]
                o[b, t] = p @ K
        expected = attn.output(o.float(), cos, sin)
        # measured: max abs err 1.9e-9 on outputs of size ~1e-2 (worst ratio 0.19 to this bound)
        assert_close(out, expected, rtol=1e-6, atol=1e-8, what=f"layer {layer_id}")


# ----------------------------------------------------------------------------- 3. compressor
def test_compressor_m2_equals_hand_computation_and_m1_is_rmsnorm_wkv():
    torch.manual_seed(303)
    model = tiny_model(3)
    c2 = model.layers[2].attn.compressor
    c1 = model.layers[4].attn.compressor
    with torch.no_grad():
        c2.norm.weight.uniform_(0.5, 1.5)
        c1.norm.weight.uniform_(0.5, 1.5)
    B, T, D = 2, 11, model.config.head_dim
    x = torch.randn(B, T, model.config.dim)
    ends = torch.arange(1, T, 2).expand(B, -1)  # groups (0,1), (2,3), ... — token 10 waits
    got = c2(x, ends)
    Wkv, Wg = c2.wkv.weight.double(), c2.wgate.weight.double()
    expected = torch.empty(B, T // 2, D, dtype=torch.float64)
    for b in range(B):
        for j in range(T // 2):
            a, bb = x[b, 2 * j].double(), x[b, 2 * j + 1].double()
            ka, kb, za, zb = Wkv @ a, Wkv @ bb, Wg @ a, Wg @ bb
            wa = torch.exp(za) / (torch.exp(za) + torch.exp(zb))
            pooled = wa * ka + (1 - wa) * kb
            rms = torch.sqrt((pooled ** 2).mean() + model.config.norm_eps)
            expected[b, j] = pooled / rms * c2.norm.weight.double()
    assert_close(got, expected, what="m=2 compressor")
    ends1 = torch.arange(T).expand(B, -1)
    got1 = c1(x, ends1)
    proj = x.double() @ c1.wkv.weight.double().T
    exp1 = proj / torch.sqrt((proj ** 2).mean(-1, keepdim=True) + model.config.norm_eps) * c1.norm.weight.double()
    assert_close(got1, exp1, what="m=1 compressor")


# ----------------------------------------------------------------------------- 4. sharing
def test_reuse_and_reindex_read_exactly_their_sources():
    torch.manual_seed(404)
    model = tiny_model(4)
    randomize_mixing(model, 4)
    config = model.config
    B, T = 2, 300
    tokens = torch.randint(3, config.vocab_size, (B, T))
    ctx = ForwardContext.build(tokens, trace=[])
    model(tokens, ctx=ctx)
    by_layer = {rec["layer"]: rec for rec in ctx.trace}
    plans = {p.layer_id: p for p in layer_plan(config)}
    assert sorted(by_layer) == [p.layer_id for p in plans.values() if p.ratio]
    for layer, rec in by_layer.items():
        p = plans[layer]
        assert rec["kv_source"] == p.kv_source and rec["topk_source"] == p.topk_source
        if p.mode == REUSE:
            src = by_layer[p.topk_source]
            assert rec["topk"] is src["topk"], f"layer {layer} must reuse layer {p.topk_source}'s indices"
            assert rec["kv"] is by_layer[p.kv_source]["kv"], f"layer {layer} must reuse the source entries"
    rec = by_layer[6]
    assert plans[6].mode == REINDEX and plans[6].uses_candidates
    cand = rec["candidates"]
    assert rec["topk"] is not by_layer[4]["topk"], "a Reindex layer computes its own top-k"
    # every index it selected lies inside the candidate pool
    sel = rec["topk"]
    valid = sel >= 0
    picked_in_pool = cand.gather(-1, sel.clamp(min=0))
    assert bool(picked_in_pool[valid].all()), "Reindex layer selected outside the candidate pool"
    # pool ⊂ visible, at most blocks × block_size, holds the newest visible entry's block
    slots = ForwardContext.build(tokens).slots(1)
    visible = slots.visible(ctx.doc_ids, ctx.token_index)
    assert not bool((cand & ~visible).any()), "candidate pool must lie inside the visible entries"
    limit = config.candidate_topk_blocks * config.candidate_block_size
    assert int(cand.sum(-1).max()) <= limit
    newest = (ctx.positions + 1).clamp(max=T) - 1  # m = 1: the newest visible entry is the query itself
    assert bool(cand.gather(-1, newest.unsqueeze(-1)).all()), "pool must hold the newest block"
    assert int(visible.sum(-1).max()) > limit, "test must exercise a pool smaller than the visible set"


# ----------------------------------------------------------------------------- 6. one training step
def test_training_step_gives_every_trainable_parameter_a_finite_nonzero_gradient():
    torch.manual_seed(606)
    model = tiny_model(6)
    B, T = 2, 256
    tokens = torch.randint(3, model.config.vocab_size, (B, T + 1))
    losses = model.losses(tokens[:, :-1], tokens[:, 1:])
    assert losses.indexer.item() > 0 and losses.balance.item() > 0
    losses.total.backward()
    bad = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            assert name.endswith(("gate.bias", "gate.bias_vl")), f"{name} unexpectedly frozen"
            assert p.grad is None
            continue
        if p.grad is None or not torch.isfinite(p.grad).all() or p.grad.abs().sum() == 0:
            bad.append(name)
    assert not bad, f"no finite non-zero gradient: {bad}"
    # the indexer learns only from its own loss: LM loss alone gives it no gradient
    model.zero_grad()
    model.losses(tokens[:, :-1], tokens[:, 1:]).lm.backward()
    assert model.layers[2].attn.indexer.wq_b.weight.grad is None or \
        model.layers[2].attn.indexer.wq_b.weight.grad.abs().sum() == 0


# ----------------------------------------------------------------------------- 7. packing
def test_packed_documents_match_each_document_alone():
    torch.manual_seed(707)
    model = tiny_model(7)
    randomize_mixing(model, 7)
    V = model.config.vocab_size
    a = torch.randint(3, V, (1, 101))  # odd length: its last m=2 group is partial
    b = torch.randint(3, V, (1, 150))
    packed = torch.cat([a, b], dim=1)
    doc_ids = torch.cat([torch.full((1, 101), 1), torch.full((1, 150), 2)], dim=1)
    out = model(packed, doc_ids=doc_ids)
    # measured: max abs err 3.0e-7 on logits of size ~1 (worst ratio 0.3 to this bound)
    assert_close(out[:, :101], model(a), rtol=1e-5, atol=1e-6, what="document A")
    assert_close(out[:, 101:], model(b), rtol=1e-5, atol=1e-6, what="document B")
    # and without doc ids the second document does see the first
    assert not torch.allclose(model(packed)[:, 101:], out[:, 101:], atol=1e-4)


# ----------------------------------------------------------------------------- 9. state dict
def official_shapes(c) -> dict[str, tuple[int, ...]]:
    """The official reference's parameter names and shapes (dtype bf16, no DSpark/vision), written
    out from its module structure independently of our model code."""
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (c.vocab_size, c.dim), "norm.weight": (c.dim,),
                                          "head.weight": (c.vocab_size, c.dim)}
    mix = (2 + c.hc_mult) * c.hc_mult
    for i in range(c.n_layers):
        p = f"layers.{i}."
        r = c.compress_ratios[i]
        shapes.update({
            p + "hc_attn_fn": (mix, c.hc_mult * c.dim), p + "hc_ffn_fn": (mix, c.hc_mult * c.dim),
            p + "hc_attn_base": (mix,), p + "hc_ffn_base": (mix,), p + "hc_attn_scale": (3,), p + "hc_ffn_scale": (3,),
            p + "attn_norm.weight": (c.dim,), p + "ffn_norm.weight": (c.dim,),
            p + "attn.attn_sink": (c.n_heads,), p + "attn.wq_a.weight": (c.q_lora_rank, c.dim),
            p + "attn.q_norm.weight": (c.q_lora_rank,), p + "attn.wq_b.weight": (c.n_heads * c.head_dim, c.q_lora_rank),
            p + "attn.wkv.weight": (c.head_dim, c.dim), p + "attn.kv_norm.weight": (c.head_dim,),
            p + "attn.wo_a.weight": (c.o_groups * c.o_lora_rank, c.n_heads * c.head_dim // c.o_groups),
            p + "attn.wo_b.weight": (c.dim, c.o_groups * c.o_lora_rank),
            p + "ffn.gate.weight": (c.n_routed_experts, c.dim), p + "ffn.gate.bias": (c.n_routed_experts,),
        })
        if i in c.kv_source_layers:
            shapes[p + "attn.compressor.wkv.weight"] = (c.head_dim, c.dim)
            shapes[p + "attn.compressor.norm.weight"] = (c.head_dim,)
            if r > 1:
                shapes[p + "attn.compressor.wgate.weight"] = (c.head_dim, c.dim)
            shapes[p + "attn.indexer.wk.weight"] = (c.index_head_dim, c.head_dim)
            shapes[p + "attn.indexer.k_norm.weight"] = (c.index_head_dim,)
        if i in c.index_source_layers:
            shapes[p + "attn.indexer.wq_b.weight"] = (c.index_n_heads * c.index_head_dim, c.q_lora_rank)
            shapes[p + "attn.indexer.weights_proj.weight"] = (c.index_n_heads, c.dim)
        for e in [f"experts.{k}" for k in range(c.n_routed_experts)] + ["shared_experts"]:
            shapes[p + f"ffn.{e}.w1.weight"] = (c.moe_inter_dim, c.dim)
            shapes[p + f"ffn.{e}.w2.weight"] = (c.dim, c.moe_inter_dim)
            shapes[p + f"ffn.{e}.w3.weight"] = (c.moe_inter_dim, c.dim)
        if i in c.engram_layer_ids:
            k = c.engram_layer_ids.index(i)
            cols = (c.engram_max_ngram_size - 1) * c.engram_n_heads
            shapes[p + "engram.embed.weight"] = (c.engram_num_embeddings[k], c.engram_head_dim)
            shapes[p + "engram.wkv.weight"] = ((c.hc_mult + 1) * c.dim, cols * c.engram_head_dim)
            shapes[p + "engram.q_weight"] = (c.hc_mult, c.dim)
            shapes[p + "engram.k_weight"] = (c.hc_mult, c.dim)
    return shapes


@pytest.mark.parametrize("preset", ["tiny", "v41-flash"])
def test_state_dict_names_and_shapes_equal_the_official_list(preset):
    config = load_config(preset)
    if preset == "v41-flash":  # the text model: DSpark and vision have their own modules
        config = config.replace(n_mtp_layers=0, dspark_block_size=0, dspark_target_layer_ids=[],
                                compress_ratios=config.compress_ratios[:config.n_layers], vision_n_layers=0)
    with torch.device("meta"):
        model = Transformer(config)
    got = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    expected = official_shapes(config)
    assert set(got) == set(expected), (sorted(set(got) - set(expected))[:5], sorted(set(expected) - set(got))[:5])
    assert got == expected
    acc = compute(config)  # the text model: no vision (so no gate.bias_vl), no DSpark
    n = model.num_parameters()
    assert n == acc["backbone_params"] + acc["engram_params"], (n, acc["backbone_params"], acc["engram_params"])
    # the official dict loads strictly (names and shapes only; meta tensors carry no data)
    model.load_state_dict({k: torch.empty(s, device="meta") for k, s in expected.items()}, strict=True, assign=True)


# ----------------------------------------------------------------------------- 10. isolation
def test_two_models_in_one_process_and_unrelated_sequences_in_one_batch():
    torch.manual_seed(1010)
    m1, m2 = tiny_model(11), tiny_model(12)
    randomize_mixing(m1, 11)
    randomize_mixing(m2, 12)
    V = m1.config.vocab_size
    x = torch.randint(3, V, (3, 120))
    alone1, alone2 = m1(x), m2(x)
    # interleaved use: no state leaks from one model (or forward) into the other
    again1, again2 = m1(x), m2(x)
    assert torch.equal(alone1, again1) and torch.equal(alone2, again2)
    assert not torch.allclose(alone1, alone2)
    for i in range(3):  # each row of the batch equals that sequence run alone
        assert_close(alone1[i:i + 1], m1(x[i:i + 1]), rtol=1e-6, atol=1e-7, what=f"row {i}")  # measured: 0


def test_loss_is_log_vocab_at_init_and_grad_flows_through_packing_mask():
    torch.manual_seed(1111)
    model = tiny_model(13)
    V = model.config.vocab_size
    tokens = torch.randint(3, V, (2, 129))
    mask = torch.ones(2, 128, dtype=torch.bool)
    mask[:, 100:] = False
    losses = model.losses(tokens[:, :-1], tokens[:, 1:], loss_mask=mask)
    assert losses.n_tokens == 200
    assert abs(losses.lm.item() - math.log(V)) < 0.5  # small init ⇒ near-uniform predictions
    logits = model(tokens[:, :-1])
    ce = F.cross_entropy(logits[:, :100].flatten(0, 1), tokens[:, 1:101].flatten())
    assert_close(losses.lm, ce, what="masked LM loss")
