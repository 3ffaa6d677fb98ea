"""Every layer's attention inside `Transformer.forward` / `Transformer.losses` against the dense float64
CSA2 reference of `csa2_reference.py` (SPEC §1a, §3, §6), on fresh random weights and tokens.

What each layer actually ran is recorded (forward hooks + the traced ForwardContext), then recomputed
from the formulas: RoPE / YaRN, compressor, index scores, verified top-k and candidate blocks, window ∪
selected entries in one softmax with the sink, the bounded-replay window, inverse RoPE, grouped output;
and the indexer KL loss of each index source.
"""

from __future__ import annotations

import torch
from tests.conftest import randomize_mixing
from tests.model.csa2_reference import DenseCSA2Reference, instrumented, sharpen_attention, window_mask

from dsv41 import load_config
from dsv41.model.transformer import Transformer
from dsv41.plan import FULL, REINDEX, REUSE, WINDOW

# float32 model vs float64 reference, relative to the largest |output| of the layer. Measured on
# these cases: ≤ 5.3e-7 (outputs) and ≤ 5e-8 relative (KL); the bounds sit about 4× above that.
OUT_TOL = 2e-6
KL_RTOL = 2e-7


def _model(seed: int) -> Transformer:
    model = Transformer(load_config("tiny")).init_weights(seed=seed)
    randomize_mixing(model, seed)
    sharpen_attention(model, seed)
    return model


def _batch(seed: int, T: int = 96):
    """Two rows: one document of T tokens; and two packed documents of 59 (odd: a partial m=2 group)
    and T − 59 tokens."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, 16384, (2, T), generator=g)
    doc_ids = torch.ones(2, T, dtype=torch.long)
    doc_ids[1, 59:] = 2
    return tokens, doc_ids


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def _check_layers(model, rec, reference) -> dict[int, object]:
    """Compare every layer's recorded attention output with the reference; returns the LayerRefs."""
    trace = rec.trace()
    plans = {p.layer_id: p for p in model.plan}
    assert sorted(rec.inputs) == list(range(model.config.n_layers))
    assert sorted(trace) == [i for i, p in plans.items() if p.mode != WINDOW]
    assert {p.mode for p in plans.values()} == {WINDOW, FULL, REINDEX, REUSE}
    refs, errors = {}, {}
    for i in range(model.config.n_layers):
        refs[i] = reference.layer(i, rec.inputs[i], trace.get(i))
        errors[i] = _rel_err(rec.outputs[i], refs[i].out)
    worst = max(errors, key=errors.get)
    listing = ", ".join(f"{k}: {v:.1e}" for k, v in errors.items())
    assert errors[worst] <= OUT_TOL, (
        f"layer {worst} ({plans[worst].mode}) attention differs from the fp64 reference: "
        f"max rel err {errors[worst]:.2e} > {OUT_TOL:.0e}; all: {listing}")
    return refs


def test_forward_every_layer_matches_dense_fp64_reference(monkeypatch):
    torch.manual_seed(0)
    model = _model(seed=11).eval()
    tokens, doc_ids = _batch(seed=12)
    with instrumented(model, monkeypatch) as rec:
        model(tokens, doc_ids=doc_ids)
    refs = _check_layers(model, rec, DenseCSA2Reference(model, doc_ids))
    # the case exercises sparsity: the top-k and the candidate pool are smaller than what is visible
    c = model.config
    assert int(refs[2].allowed.sum(-1).max()) > c.index_topk
    pool = refs[6].allowed.sum(-1).max()
    assert int(refs[4].allowed.sum(-1).max()) > int(pool) > 0


def test_losses_with_window_start_match_reference_and_kl(monkeypatch):
    """`Transformer.losses(window_start=...)`: the bounded-replay window rule in every layer (compressed
    entries stay visible) and each index source's KL, against the fp64 reference."""
    torch.manual_seed(1)
    model = _model(seed=21).train()
    tokens, doc_ids = _batch(seed=22)
    T = tokens.shape[1]
    t = torch.arange(T)
    window_start = torch.stack([torch.where(t >= 45, 45, 0), torch.where(t >= 70, 70, 0)])  # (B, T)
    targets = tokens.roll(-1, 1)
    with instrumented(model, monkeypatch) as rec:
        losses = model.losses(tokens, targets, doc_ids=doc_ids, window_start=window_start)
    reference = DenseCSA2Reference(model, doc_ids, window_start)
    refs = _check_layers(model, rec, reference)

    # the replay start changes what the window sees, by far more than the tolerance
    assert bool((window_mask(doc_ids, model.config.window_size, None) != reference.window).any())
    unreplayed = DenseCSA2Reference(model, doc_ids).layer(0, rec.inputs[0], None).out
    moved = _rel_err(rec.outputs[0], unreplayed)
    assert moved > 100 * OUT_TOL, f"replay start barely changed layer 0 ({moved:.2e}): the case cannot tell"

    # indexer KL: one loss per index source, in layer order, and their mean in Losses.indexer
    (ctx,) = rec.contexts
    sources = [i for i, p in enumerate(model.plan) if p.mode in (FULL, REINDEX)]
    assert len(ctx.indexer_losses) == len(sources)
    for got, i in zip(ctx.indexer_losses, sources):
        want = refs[i].kl
        rel = abs(got.item() - want.item()) / want.item()
        assert rel <= KL_RTOL, f"layer {i}: indexer KL {got.item():.6f} vs fp64 {want.item():.6f} (rel {rel:.1e})"
    mean = torch.stack([refs[i].kl for i in sources]).mean()
    assert abs(losses.indexer.item() - mean.item()) <= KL_RTOL * mean.item()
