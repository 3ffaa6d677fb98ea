"""DSpark attention and the whole drafter against independent computations.

1. One stage's attention (window over the main features + the block's own keys, non-causal inside the
   block, sink, inverse RoPE, grouped output) equals a dense masked fp64 computation written here from
   the release's DSparkAttention: every query against all T main keys and all block keys, with the mask
   built from the rule (main key s visible iff anchor − W ≤ s < anchor in the anchor's document; block
   key visible iff same block).
2. The engine adapter (rings filled by `observe` in chunks, only the last window of features handed
   over) drafts exactly what the training form computes from the whole sequence.
"""

from __future__ import annotations

import math

import torch
from tests.conftest import assert_close, randomize_mixing

from dsv41.config import load_config, with_dspark
from dsv41.engine.dspark_drafter import DSparkDrafter
from dsv41.model.dspark import DSpark, capture_features, dspark_attention, stack_features
from dsv41.model.transformer import Transformer


def _config(window: int = 8):
    return with_dspark(load_config("tiny").replace(window_size=window))


def _rms(v: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(v: torch.Tensor, pos: torch.Tensor, rd: int, theta: float, inverse: bool = False) -> torch.Tensor:
    """Adjacent pairs of the last rd channels as complex numbers times exp(±i·pos·θ^(−2j/rd))."""
    freqs = theta ** (-torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    angle = pos.double().unsqueeze(-1) * freqs  # (..., rd/2)
    while angle.dim() < v.dim():
        angle = angle.unsqueeze(-2)  # broadcast over heads
    rot = torch.polar(torch.ones_like(angle), -angle if inverse else angle)
    z = torch.view_as_complex(v[..., -rd:].contiguous().view(*v.shape[:-1], rd // 2, 2)) * rot
    return torch.cat([v[..., :-rd], torch.view_as_real(z).flatten(-2)], dim=-1)


def _dense_reference(attn, c, x, main_x, main_pos, block_pos, doc_ids, anchors, K, W):
    B, Q, _ = x.shape
    H, D, rd, G = c.n_heads, c.head_dim, c.rope_head_dim, c.o_groups
    q = _rms(x @ attn.wq_a.weight.T, attn.q_norm.weight, c.norm_eps) @ attn.wq_b.weight.T
    q = _rope(q.view(B, Q, H, D), block_pos, rd, c.rope_theta)
    main_k = _rope(_rms(main_x @ attn.wkv.weight.T, attn.kv_norm.weight, c.norm_eps), main_pos, rd, c.rope_theta)
    own_k = _rope(_rms(x @ attn.wkv.weight.T, attn.kv_norm.weight, c.norm_eps), block_pos, rd, c.rope_theta)
    keys = torch.cat([main_k, own_k], dim=1)  # (B, T + Q, D)
    T = main_x.size(1)
    mask = torch.zeros(B, Q, T + Q, dtype=torch.bool)
    for b in range(B):
        for i in range(Q):
            a = int(anchors[b, i // K])
            for s in range(T):
                mask[b, i, s] = a - W <= s < a and doc_ids[b, s] == doc_ids[b, a]
            for t in range(Q):
                mask[b, i, T + t] = t // K == i // K
    scores = torch.einsum("bqhd,bsd->bhqs", q, keys) / math.sqrt(D)
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    sink = attn.attn_sink.view(1, H, 1, 1).expand(B, H, Q, 1)
    probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
    o = _rope(torch.einsum("bhqs,bsd->bqhd", probs, keys), block_pos, rd, c.rope_theta, inverse=True)
    o = o.reshape(B, Q, G, H * D // G)
    wo_a = attn.wo_a.weight.view(G, c.o_lora_rank, H * D // G)
    mid = torch.cat([o[:, :, g] @ wo_a[g].T for g in range(G)], dim=-1)  # group g: its heads only
    return mid @ attn.wo_b.weight.T


def test_stage_attention_equals_dense_masked_fp64():
    c = _config(window=8)
    torch.manual_seed(0)
    drafter = DSpark(c).double()
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    stage = drafter.mtp[1]
    B, T, K, A = 2, 24, c.dspark_block_size, 3
    doc_ids = torch.ones(B, T, dtype=torch.long)
    doc_ids[0, 10:] = 2  # two documents in row 0: positions restart
    main_pos = torch.stack([torch.cat([torch.arange(10), torch.arange(14)]), torch.arange(T)])
    anchors = torch.tensor([[4, 12, 23], [0, 9, 20]])
    block_pos = (main_pos.gather(1, anchors).unsqueeze(-1) + torch.arange(K)).reshape(B, A * K)
    main_x = torch.randn(B, T, c.dim, dtype=torch.float64)
    x = torch.randn(B, A * K, c.dim, dtype=torch.float64)
    ctx = drafter.context_windows(stage.context_kv(main_x, main_pos), doc_ids, anchors)
    got = dspark_attention(stage.attn, x, block_pos.view(B, A, K), *ctx, block_size=K)
    with torch.no_grad():
        want = _dense_reference(stage.attn, c, x, main_x, main_pos, block_pos, doc_ids, anchors, K, c.window_size)
    # RoPE angles are fp32 in the model (rope_angles), so ~1e-7 relative error on the rotated channels:
    # measured max |err| / max |want| = 1.5e-7; a wrong mask or a missing sink is off by O(1)
    scale = want.abs().max()
    assert_close(got, want, rtol=1e-6, atol=1e-6 * float(scale), what="DSpark attention")


def _models(seed: int):
    c = _config(window=8)
    main = Transformer(c).init_weights(seed=seed).eval()
    randomize_mixing(main, seed)
    drafter = DSpark(c).init_weights(seed=seed + 1).bind(main).eval()
    with torch.no_grad():
        for stage in drafter.mtp:
            stage.attn.attn_sink.normal_(0, 1.0)
    return main, drafter


@torch.no_grad()
def test_engine_adapter_drafts_what_the_training_form_computes():
    main, drafter = _models(seed=3)
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(17, 16384, (2, 40), generator=g)
    with capture_features(main, drafter.target_layer_ids) as found:
        main(tokens)
    feats = {i: found[i] for i in drafter.target_layer_ids}
    anchors = torch.tensor([[29], [17]])
    hidden = drafter(stack_features(found, drafter.target_layer_ids), tokens, torch.arange(40).expand(2, -1),
                     torch.ones_like(tokens), anchors)
    want_tokens, _, want_conf = drafter.sample(hidden[:, 0], tokens.gather(1, anchors)[:, 0])

    adapter = DSparkDrafter(drafter)
    for seq, chunks in ((0, [(0, 13), (13, 20), (20, 29)]), (1, [(0, 11), (11, 17)])):
        adapter.start(seq)
        for lo, hi in chunks:  # the first chunk hands over only its last window of features (bounded replay)
            first = max(lo, hi - adapter.window) if lo == 0 else lo
            adapter.observe(seq, tokens[seq, lo:hi], {i: f[seq, first:hi] for i, f in feats.items()})
    got = adapter.propose([0, 1], tokens.gather(1, anchors)[:, 0])
    assert adapter.k == drafter.block_size == got.tokens.shape[1]
    assert torch.equal(got.tokens, want_tokens), (got.tokens, want_tokens)
    assert_close(got.confidence, torch.sigmoid(want_conf), rtol=1e-4, atol=1e-5, what="confidence")
    assert got.probs is None and bool(((got.confidence > 0) & (got.confidence < 1)).all())
    sampled = DSparkDrafter(drafter, temperature=1.0, generator=torch.Generator().manual_seed(0))
    sampled.start(0)
    sampled.observe(0, tokens[0, :29], {i: f[0, :29] for i, f in feats.items()})
    prop = sampled.propose([0], tokens[0, 29:30])
    assert prop.probs.shape == (1, adapter.k, 16384)
    assert torch.allclose(prop.probs.sum(-1), torch.ones(1, adapter.k), atol=1e-5)
    assert bool((prop.probs.gather(-1, prop.tokens.unsqueeze(-1)) > 0).all())  # drawn from those distributions


@torch.no_grad()
def test_features_are_the_stream_mean_entering_the_target_block():
    """The release: `if i in target_layer_ids: main_hiddens.append(h.mean(dim=2))` before block i runs."""
    main, _ = _models(seed=5)
    tokens = torch.randint(17, 16384, (2, 12), generator=torch.Generator().manual_seed(6))
    outputs = {}

    def keep(module, args, out) -> None:  # returns None: the output is unchanged
        outputs[1] = out[0]

    hook = main.layers[1].register_forward_hook(keep)
    try:
        with capture_features(main, [0, 2]) as found:
            main(tokens)
    finally:
        hook.remove()
    assert_close(found[0], main.embed(tokens), what="layer 0: the embedding (4 equal streams)")
    assert_close(found[2], outputs[1].mean(dim=2), what="layer 2: block 1's output streams, averaged")
    assert not torch.allclose(found[2], outputs[1][:, :, 0]), "streams differ: a mean, not one stream"
