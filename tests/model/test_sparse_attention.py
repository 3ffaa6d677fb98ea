"""The sparse training attention (`model/sparse_attention.py`, issue 18) against the dense masked spec.

* `Transformer.losses(attention="sparse")` = `attention="dense"` on `tiny` and on a custom config
  (other window, ratio 4, chunked index scores, classic mHC): LM loss, indexer KL and every
  parameter's gradient in fp32, with packed documents, the bounded-replay window and the candidate
  pool active — and the same top-k in every layer.
* the indexer KL runs over the layer's top-k set (`indexer_kl_set = "topk"`), in both paths: the set
  handed to the loss is exactly the chosen entries, strictly fewer than the allowed ones; "allowed"
  still gives the old, different value; `indexer_kl_topk` by hand.
* memory: the largest tensor the sparse path makes (forward + backward, recorded by a dispatch mode)
  grows linearly in T and stays O(T·(2W + K)·H); the dense path's grows quadratically.
"""

from __future__ import annotations

import math

import pytest
import torch
from tests.conftest import randomize_mixing
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from dsv41 import load_config
from dsv41.model import attention as dense_attention
from dsv41.model import sparse_attention
from dsv41.model.sparse_attention import attend_sparse, indexer_kl_topk, window_band
from dsv41.model.state import ForwardContext
from dsv41.model.transformer import Transformer

# fp32 sparse vs dense: both sum the same terms in another order. Per gradient tensor the error is
# ‖Δ‖ / max(‖g‖, SMALL·the largest ‖g‖ of the model): tensors far smaller than the largest (a 3-element
# mHC scale summed over every token, whose terms cancel) carry more fp32 noise of their own (dense in
# fp32 vs the same math at higher precision: up to 6.5e-5 of their size), so they are held to 1e-5 of
# that floor and to OWN_RTOL of themselves. Measured: see the printed numbers (≤ 7e-6 and ≤ 5.5e-5).
RTOL = 1e-5
SMALL = 1e-2
OWN_RTOL = 2e-4


def _custom():
    """Window 24 (T not a multiple), ratio 4 and 1, top-12, 3 candidate blocks of 6, classic mHC."""
    return load_config("tiny").replace(
        window_size=24, compress_ratios=[0, 4, 4, 4, 1, 1, 1, 1], kv_source_layers=[1, 4],
        index_source_layers=[1, 3, 4, 6], index_topk=12, candidate_source_layer=4, candidate_topk_blocks=3,
        candidate_block_size=6, single_pass_mhc=False, n_heads=2, o_groups=1, engram_layer_ids=[2],
        engram_num_embeddings=[6126])


def _batch(T: int, seed: int):
    """Two rows: one document; three packed documents of odd lengths. Replay starts in both rows."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, 16384, (2, T + 1), generator=g)
    doc = torch.ones(2, T, dtype=torch.long)
    doc[1, 41:] = 2
    doc[1, 87:] = 3
    t = torch.arange(T)
    window_start = torch.stack([torch.where(t >= 45, 45, 0), torch.where(t >= 70, 70, 0)])  # (B, T)
    return tokens, doc, window_start


def _run(model, tokens, doc, window_start, attention: str, chunk: int):
    """losses + backward; returns (losses, gradients, layer trace, the entry sets the KL saw)."""
    model.zero_grad(set_to_none=True)
    trace: list[dict] = []
    kl_sets: list[Tensor] = []
    build, dense_kl, sparse_kl = ForwardContext.build, dense_attention.indexer_kl, sparse_attention.indexer_kl_topk

    def traced_build(*a, **k):  # the context `losses` makes, with a trace and this score chunk
        return build(*a, **k, trace=trace, score_chunk=chunk)

    def spy_dense(q, entries, kl_set, scores, scale, n_queries=None):
        kl_sets.append(kl_set)  # (B, T, N) mask
        return dense_kl(q, entries, kl_set, scores, scale, n_queries)

    def spy_sparse(logits, valid, scores):
        kl_sets.append(valid)  # (B, T, K) over the layer's top-k
        return sparse_kl(logits, valid, scores)

    ForwardContext.build, dense_attention.indexer_kl, sparse_attention.indexer_kl_topk = \
        traced_build, spy_dense, spy_sparse
    try:
        losses = model.losses(tokens[:, :-1], tokens[:, 1:], doc_ids=doc, window_start=window_start,
                              attention=attention)
    finally:
        ForwardContext.build, dense_attention.indexer_kl, sparse_attention.indexer_kl_topk = \
            build, dense_kl, sparse_kl
    losses.total.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return losses, grads, trace, kl_sets


def _check_kl_sets(trace: list[dict], dense_sets: list[Tensor], sparse_sets: list[Tensor]) -> None:
    """Both paths hand the KL exactly the layer's top-k (∩ visible): strictly fewer than allowed."""
    sources = [t for t in trace if t["mode"] in ("full", "reindex")]
    assert len(dense_sets) == len(sparse_sets) == len(sources) >= 3
    for t, kl_set, valid in zip(sources, dense_sets, sparse_sets):
        chosen = dense_attention.topk_mask(t["topk"], kl_set.size(-1)) & t["allowed"]
        assert torch.equal(kl_set, chosen), f"layer {t['layer']}: the dense KL set is not the top-k"
        assert int(kl_set.sum()) < int(t["allowed"].sum()), "the case must tell top-k from allowed apart"
        picked = dense_attention.topk_mask(torch.where(valid, t["topk"], -1), kl_set.size(-1))
        assert torch.equal(picked, chosen), f"layer {t['layer']}: the sparse KL set is not the top-k"


@pytest.mark.parametrize("which", ["tiny", "custom"])
def test_sparse_equals_dense_loss_and_every_gradient(which):
    """…and the KL's entry set is the top-k in both paths; on tiny, "allowed" is the old, different
    loss (dense only: the sparse path refuses it)."""
    config, T, chunk, seed = (load_config("tiny"), 120, 512, 61) if which == "tiny" else (_custom(), 110, 37, 62)
    model = Transformer(config).init_weights(seed=seed).train()
    randomize_mixing(model, seed)
    tokens, doc, ws = _batch(T, seed)
    ld, gd, td, kd = _run(model, tokens, doc, ws, "dense", chunk)
    ls, gs, ts, ks = _run(model, tokens, doc, ws, "sparse", chunk)
    # the case is sparse: top-k and the candidate pool are smaller than what is visible
    n_visible = [int(t["allowed"].sum(-1).max()) for t in td if t["allowed"] is not None]
    assert max(n_visible) > config.index_topk
    reindex = [t for t in td if t["mode"] == "reindex"]
    assert reindex and bool((reindex[0]["allowed"].sum(-1) < td[0]["allowed"].sum(-1).amax()).any())
    assert [t["layer"] for t in td] == [t["layer"] for t in ts]
    for a, b in zip(td, ts):
        assert torch.equal(a["topk"], b["topk"]), f"layer {a['layer']}: the paths chose different entries"
    _check_kl_sets(td, kd, ks)
    for name in ("lm", "indexer", "balance", "total"):
        want, got = getattr(ld, name).item(), getattr(ls, name).item()
        rel = abs(got - want) / abs(want)
        print(f"{which} {name}: dense {want:.8f} sparse {got:.8f} rel {rel:.1e}")
        assert rel <= RTOL, f"{name}: sparse {got:.8f} vs dense {want:.8f} (rel {rel:.1e})"
    assert ld.indexer.item() > 1e-4  # the KL is far from zero
    assert gd.keys() == gs.keys(), sorted(set(gd) ^ set(gs))
    biggest = max(g.norm().item() for g in gd.values())
    errs = {n: (gs[n] - g).norm().item() for n, g in gd.items()}
    floored = {n: e / max(gd[n].norm().item(), SMALL * biggest) for n, e in errs.items()}
    own = {n: e / gd[n].norm().item() for n, e in errs.items()}
    worst, worst_own = max(floored, key=floored.get), max(own, key=own.get)
    print(f"{which}: {len(gd)} gradients, worst rel err {floored[worst]:.1e} ({worst}), "
          f"worst of its own size {own[worst_own]:.1e} ({worst_own})")
    assert floored[worst] <= RTOL, f"gradient of {worst}: rel err {floored[worst]:.1e}"
    assert own[worst_own] <= OWN_RTOL, f"gradient of {worst_own}: rel err {own[worst_own]:.1e} of its own size"
    if which != "tiny":
        return
    model.config = config.replace(indexer_kl_set="allowed")
    for layer in model.layers:
        layer.attn.kl_set = "allowed"
    with torch.no_grad():
        allowed = model.losses(tokens[:, :-1], tokens[:, 1:], doc_ids=doc, window_start=ws).indexer.item()
        assert abs(allowed - ld.indexer.item()) > 1e3 * RTOL * allowed, (ld.indexer.item(), allowed)
        with pytest.raises(ValueError, match="top-k set only"):
            model.losses(tokens[:, :-1], tokens[:, 1:], doc_ids=doc, attention="sparse")


def test_band_attention_equals_masked_attend_on_random_masks():
    """`attend_sparse` with the band and gathered entries = `attend` with the (T, T) window mask
    and a (T, N) entry mask holding the same picks — output and input gradients, fp32."""
    g = torch.Generator().manual_seed(63)
    B, T, H, D, N, K, W = 2, 50, 3, 16, 20, 5, 8
    q = torch.randn(B, T, H, D, generator=g, requires_grad=True)
    kv = torch.randn(B, T, D, generator=g, requires_grad=True)
    entries = torch.randn(B, N, D, generator=g, requires_grad=True)
    sink = torch.randn(H, generator=g, requires_grad=True)
    doc = torch.ones(B, T, dtype=torch.long)
    doc[1, 23:] = 2
    ws = torch.where(torch.arange(T) >= 31, 31, 0).expand(B, T)
    topk = torch.randint(-1, N, (B, T, K), generator=g)
    topk = torch.where(torch.rand(B, T, K, generator=g) < 0.2, -1, topk)
    valid = topk >= 0
    dense_mask = ForwardContext.build(doc, doc, window_start=ws).window_mask(W)
    emask = dense_attention.topk_mask(topk, N)
    # a pick repeated in one query's list would count twice in the sparse softmax: keep them unique
    for b in range(B):
        for t in range(T):
            seen = set()
            for k in range(K):
                s = int(topk[b, t, k])
                if s in seen:
                    valid[b, t, k] = False
                seen.add(s)
    band = window_band(doc, ws, W)
    assert int(band.sum()) == int(dense_mask.sum()), "the band holds exactly the window mask's keys"
    got = attend_sparse(q, kv, band, W, sparse_attention.gather_rows(entries, topk), valid, sink, 0.3)
    want = dense_attention.attend(q, kv, dense_mask, entries, emask, sink, 0.3)
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err <= RTOL, f"output rel err {err:.1e}"
    w = torch.randn(got.shape, generator=g)
    ga = torch.autograd.grad((got * w).sum(), [q, kv, entries, sink])
    gb = torch.autograd.grad((want * w).sum(), [q, kv, entries, sink])
    for name, a, b in zip(("q", "kv", "entries", "sink"), ga, gb):
        e = ((a - b).abs().max() / b.abs().max()).item()
        assert e <= RTOL, f"grad {name}: rel err {e:.1e}"


def test_indexer_kl_topk_by_hand():
    g = torch.Generator().manual_seed(65)
    H, K = 2, 4
    logits = torch.randn(1, 3, H, K, generator=g)
    scores = torch.randn(1, 3, K, generator=g, requires_grad=True)
    valid = torch.tensor([[[True, False, True, True], [True] * 4, [False] * 4]])
    got = indexer_kl_topk(logits, valid, scores)
    total, count = 0.0, 0
    for t in range(3):
        ids = [k for k in range(K) if valid[0, t, k]]
        if not ids:
            continue  # a query with nothing selected is left out of the mean
        target = [0.0] * len(ids)
        for h in range(H):  # each head's softmax over the selected entries, summed, renormalized
            e = [math.exp(logits[0, t, h, k].item()) for k in ids]
            target = [a + v / sum(e) for a, v in zip(target, e)]
        target = [v / sum(target) for v in target]
        e = [math.exp(scores[0, t, k].item()) for k in ids]
        pred = [v / sum(e) for v in e]
        total += sum(a * math.log(a / b) for a, b in zip(target, pred))
        count += 1
    want = total / count
    assert math.isclose(got.item(), want, rel_tol=1e-6), f"KL {got.item():.7f} vs hand {want:.7f}"
    (gs,) = torch.autograd.grad(got, [scores])
    assert not gs[~valid].any() and bool((gs[valid[0:1]].abs() > 0).any())


class _LargestOutput(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _largest(config, T: int, attention: str) -> int:
    torch.manual_seed(66)
    model = Transformer(config).init_weights(seed=66).train()
    tokens = torch.randint(3, config.vocab_size, (1, T + 1))
    rec = _LargestOutput()
    build = ForwardContext.build
    ForwardContext.build = lambda *a, **k: build(*a, **k, score_chunk=128)
    try:
        with rec:
            model.losses(tokens[:, :-1], tokens[:, 1:], attention=attention).total.backward()
    finally:
        ForwardContext.build = build
    return rec.largest


def test_sparse_memory_is_linear_in_T_and_dense_is_not():
    """Largest tensor of forward + backward (batch 1, a 256-token vocabulary so that the head's (T, V)
    logits stay small; Full, Reindex with candidates, Reuse): sparse at T = 512 → 1024 grows ≤ 2.1×
    (linear) and stays ≤ 2·T·(2W + K + 1)·H (its attention scores); dense at 128 → 256 ≥ 3.5× (its
    (H, T, T + N) scores). Scores are chunked by 128 queries (memory O(chunk·N))."""
    c = load_config("tiny").replace(vocab_size=256, engram_layer_ids=[], engram_num_embeddings=[], n_layers=4,
                                    compress_ratios=[0, 1, 1, 1], kv_source_layers=[1, 2],
                                    index_source_layers=[1, 2, 3], candidate_source_layer=2)
    W, K, H = c.window_size, c.index_topk, c.n_heads
    s1, s2 = _largest(c, 512, "sparse"), _largest(c, 1024, "sparse")
    bound = 2 * 1024 * (2 * W + K + 1) * H
    print(f"sparse largest tensor: T=512 {s1:,}, T=1024 {s2:,} (ratio {s2 / s1:.2f}, bound {bound:,})")
    assert s2 <= 2.1 * s1 and s2 <= bound
    d1, d2 = _largest(c, 128, "dense"), _largest(c, 256, "dense")
    print(f"dense largest tensor: T=128 {d1:,}, T=256 {d2:,} (ratio {d2 / d1:.2f})")
    assert d2 >= 3.5 * d1


def test_selected_index_scores_custom_backward_equals_autograd_and_saves_no_gathered_keys():
    """The indexer KL's prediction side: the custom backward (keys gathered again, their gradient scattered
    back) gives the plain autograd form's output and gradients, and keeps no (B, T, K, Di) tensor."""
    from dsv41.model.sparse_attention import selected_index_scores, selected_index_scores_reference

    g = torch.Generator().manual_seed(3)
    B, T, N, Hi, Di, K = 2, 24, 10, 3, 16, 5
    iq = torch.randn(B, T, Hi, Di, generator=g).requires_grad_()
    weights = torch.randn(B, T, Hi, generator=g).requires_grad_()
    index_k = torch.randn(B, N, Di, generator=g).requires_grad_()
    topk = torch.randint(-1, N, (B, T, K), generator=g)  # −1 = no entry (reads row 0, as the gather does)
    upstream = torch.randn(B, T, K, generator=g)
    results = []
    for fn in (selected_index_scores, selected_index_scores_reference):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, saved=saved: (saved.append(t.numel()), t)[1],
                                                      lambda t: t):
            out = fn(iq, weights, index_k, topk)
        grads = torch.autograd.grad((out * upstream).sum(), (iq, weights, index_k))
        results.append((out, grads, max(saved)))
    (out, grads, biggest), (ref, ref_grads, ref_biggest) = results
    scale = ref.abs().max()
    assert (out - ref).abs().max() <= 1e-6 * scale, (out - ref).abs().max()
    for name, a, b in zip(("iq", "weights", "index_k"), grads, ref_grads):
        err = ((a - b).abs().max() / b.abs().max()).item()
        assert err < 1e-5, f"d{name}: relative error {err:.2e}"
    gathered = B * T * K * Di
    assert ref_biggest >= gathered and biggest < gathered, (biggest, ref_biggest, gathered)


def test_selected_index_scores_backward_under_cpu_autocast_is_the_fp32_backward():
    """A CPU backward runs inside the caller's autocast (CUDA's runs on the device thread, without it): the custom
    backward must not compute in bf16 there — it once crashed (`index_add_` of a bf16 source into the fp32 sum,
    bf16 training on the CPU). Under autocast its gradients equal the ones taken without autocast from the same
    forward (fp32 both)."""
    from dsv41.model.sparse_attention import _SelectedScores

    g = torch.Generator().manual_seed(4)
    B, T, N, Hi, Di, K = 1, 12, 8, 2, 16, 4
    iq = torch.randn(B, T, Hi, Di, generator=g).bfloat16().requires_grad_()
    weights = torch.randn(B, T, Hi, generator=g).requires_grad_()
    index_k = torch.randn(B, N, Di, generator=g).bfloat16().requires_grad_()
    topk = torch.randint(-1, N, (B, T, K), generator=g)
    upstream = torch.randn(B, T, K, generator=g)
    out = _SelectedScores.apply(iq, weights, index_k, topk)
    plain = torch.autograd.grad((out * upstream).sum(), (iq, weights, index_k), retain_graph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = torch.autograd.grad((out * upstream).sum(), (iq, weights, index_k))
    for name, a, b in zip(("iq", "weights", "index_k"), mixed, plain):
        assert a.dtype == b.dtype and torch.equal(a, b), name
