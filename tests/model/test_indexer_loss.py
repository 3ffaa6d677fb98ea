"""The lightning indexer's training signal (SPEC §1a, §3): head-weight scale, scores, the KL loss by hand
(direction KL(target ‖ pred), heads summed and renormalized) and its gradient isolation."""

from __future__ import annotations

import math
import re

import torch

from dsv41 import load_config
from dsv41.model.attention import Indexer, indexer_kl
from dsv41.model.transformer import Transformer

FP32_RTOL = 1e-6  # float32 vs float64 hand sums of a few terms: measured 2.0e-7 relative


def test_kl_by_hand_on_a_small_case():
    g = torch.Generator().manual_seed(31)
    H, D, N, scale = 2, 4, 4, 0.5
    q = torch.randn(1, 3, H, D, generator=g, requires_grad=True)
    entries = torch.randn(1, N, D, generator=g)
    scores = torch.randn(1, 3, N, generator=g, requires_grad=True)
    allowed = torch.tensor([[[True, False, False, False], [True, True, False, True], [False] * 4]])
    got = indexer_kl(q, entries, allowed, scores, scale)

    def hand(reverse: bool = False) -> float:
        total, count = 0.0, 0
        for t in range(3):
            ids = [s for s in range(N) if allowed[0, t, s]]
            if not ids:
                continue  # a query with nothing to select is left out of the mean
            target = [0.0] * len(ids)
            for h in range(H):  # each head's softmax over the allowed entries, summed over heads
                z = [sum(q[0, t, h, k].item() * entries[0, s, k].item() for k in range(D)) * scale for s in ids]
                zmax = max(z)
                w = [math.exp(v - zmax) for v in z]
                target = [a + v / sum(w) for a, v in zip(target, w)]
            target = [v / sum(target) for v in target]  # renormalized: sums to 1, not to H
            raw = [scores[0, t, s].item() for s in ids]
            e = [math.exp(v - max(raw)) for v in raw]
            pred = [v / sum(e) for v in e]
            p, r = (pred, target) if reverse else (target, pred)
            total += sum(a * math.log(a / b) for a, b in zip(p, r))
            count += 1
        return total / count

    want = hand()
    assert math.isclose(got.item(), want, rel_tol=FP32_RTOL), f"KL {got.item():.7f} vs hand {want:.7f}"
    assert abs(hand(reverse=True) - want) > 100 * FP32_RTOL * want, "the case must tell the two directions apart"
    # the target is a constant: gradient reaches the index scores only
    gq, gs = torch.autograd.grad(got, [q, scores], allow_unused=True)
    assert gq is None or not gq.any(), "the main attention's query must get no gradient from the indexer KL"
    assert gs is not None and not gs[~allowed].any()
    assert gs[0, 1][allowed[0, 1]].abs().min() > 0  # (query 0 has one entry: KL 0 and no gradient)


def test_head_weight_scale_and_scores_by_hand():
    with torch.device("meta"):
        flash = Indexer(load_config("v41-flash"), 2)
    assert flash.weight_scale == 128 ** -0.5 * 32 ** -0.5
    g = torch.Generator().manual_seed(32)
    c = load_config("tiny")
    ix = Indexer(c, 2)
    x = torch.randn(2, 5, c.dim, generator=g)
    w = ix.head_weights(x)
    want_w = (x.double() @ ix.weights_proj.weight.double().T) * c.index_head_dim ** -0.5 * c.index_n_heads ** -0.5
    assert torch.allclose(w.double(), want_w, rtol=1e-5, atol=1e-7), "head weights = weights_proj(x)·Di^-½·Hi^-½"
    q = torch.randn(2, 5, c.index_n_heads, c.index_head_dim, generator=g)
    k = torch.randn(2, 7, c.index_head_dim, generator=g)
    got = Indexer.scores(q, w, k)
    want = torch.zeros(2, 5, 7, dtype=torch.float64)
    for b in range(2):
        for t in range(5):
            for s in range(7):
                want[b, t, s] = sum(max(q[b, t, h].double() @ k[b, s].double(), 0.0) * w[b, t, h].double()
                                    for h in range(c.index_n_heads))
    err = ((got.double() - want).abs().max() / want.abs().max()).item()
    assert err <= 1e-5, f"index scores: max rel err {err:.2e}"


INDEXER_PARAM = re.compile(r"\.attn\.indexer\.(wq_b|weights_proj|wk|k_norm)\.weight$")


def test_kl_gradient_reaches_only_the_indexer_and_lm_gradient_never_does():
    """No gradient from the indexer KL reaches wq_a, q_norm, attn_norm, the embedding or any other
    backbone parameter (its query latent, hidden state and entries are detached), while every
    indexer parameter gets one; and the LM loss gives the indexer none."""
    torch.manual_seed(33)
    model = Transformer(load_config("tiny")).init_weights(seed=33).train()
    tokens = torch.randint(3, model.config.vocab_size, (2, 81))
    losses = model.losses(tokens[:, :-1], tokens[:, 1:])
    names, params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad])
    grads = torch.autograd.grad(losses.indexer, params, allow_unused=True, retain_graph=True)
    leaked = [n for n, gr in zip(names, grads) if not INDEXER_PARAM.search(n) and gr is not None and gr.any()]
    assert not leaked, f"indexer KL gradient leaks into {leaked[:8]}"
    indexer = [(n, gr) for n, gr in zip(names, grads) if INDEXER_PARAM.search(n)]
    assert len(indexer) == 4 * 2 + 2 * 1, [n for n, _ in indexer]  # wq_b, weights_proj ×3 sources; wk, k_norm ×2
    silent = [n for n, gr in indexer if gr is None or not gr.any()]
    assert not silent, f"indexer parameters without a KL gradient: {silent}"
    # the named ones, explicitly (they sit on the path into the indexer's query and weights)
    for key in ("layers.2.attn.wq_a.weight", "layers.2.attn.q_norm.weight", "layers.2.attn_norm.weight",
                "embed.weight", "layers.2.attn.compressor.wkv.weight"):
        gr = grads[names.index(key)]
        assert gr is None or not gr.any(), key
    lm = torch.autograd.grad(losses.lm, [p for _, p in zip(names, params) if INDEXER_PARAM.search(_)],
                             allow_unused=True)
    assert all(gr is None or not gr.any() for gr in lm), "the LM loss must not train the indexer"
