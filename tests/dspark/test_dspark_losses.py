"""DSpark training targets and loss terms against from-formula computations on random inputs.

The formulas (DeepSpec `compute_dspark_loss`): w = supervised · exp(−k/γ); CE, ‖p − q‖₁ and
BCE(σ(c), 1 − ½‖p − q‖₁) as w-weighted means; total = 0.1·CE + 0.9·L1 + 1.0·BCE. Computed here with
Python floats, one position at a time.
"""

from __future__ import annotations

import math

import torch

from dsv41.train.dspark import LossWeights, block_targets, dspark_loss_terms, position_weights, sample_anchors


def _softmax(row: list[float]) -> list[float]:
    m = max(row)
    e = [math.exp(v - m) for v in row]
    return [v / sum(e) for v in e]


def test_loss_terms_equal_the_formulas():
    g = torch.Generator().manual_seed(0)
    B, A, K, V = 2, 3, 4, 7
    draft = torch.randn(B, A, K, V, generator=g) * 2
    target = torch.randn(B, A, K, V, generator=g) * 2
    labels = torch.randint(0, V, (B, A, K), generator=g)
    conf = torch.randn(B, A, K, generator=g)
    supervised = (torch.rand(B, A, K, generator=g) < 0.8).long().cumprod(-1).bool()
    gamma = 1.7
    terms = dspark_loss_terms(draft, target, labels, conf, supervised, LossWeights(0.1, 0.9, 1.0, gamma))
    num = {"ce": 0.0, "l1": 0.0, "bce": 0.0}
    den = 0.0
    accept_sum, count = [0.0] * K, [0] * K
    for b in range(B):
        for a in range(A):
            for k in range(K):
                if not supervised[b, a, k]:
                    continue
                w = math.exp(-k / gamma)
                p, q = _softmax(draft[b, a, k].tolist()), _softmax(target[b, a, k].tolist())
                l1 = sum(abs(x - y) for x, y in zip(p, q))
                acc = 1 - l1 / 2
                s = 1 / (1 + math.exp(-conf[b, a, k].item()))
                num["ce"] += w * -math.log(p[labels[b, a, k]])
                num["l1"] += w * l1
                num["bce"] += w * -(acc * math.log(s) + (1 - acc) * math.log(1 - s))
                den += w
                accept_sum[k] += acc
                count[k] += 1
    want = {key: v / den for key, v in num.items()}
    got = {"ce": terms["ce"].item(), "l1": terms["l1"].item(), "bce": terms["confidence"].item()}
    for key in want:
        assert math.isclose(got[key], want[key], rel_tol=1e-5), f"{key}: {got[key]} vs {want[key]}"  # ~1e-7 seen
    total = 0.1 * want["ce"] + 0.9 * want["l1"] + 1.0 * want["bce"]
    assert math.isclose(terms["total"].item(), total, rel_tol=1e-5), (terms["total"].item(), total)
    for k in range(K):
        assert math.isclose(terms["accept"][k].item(), accept_sum[k] / max(count[k], 1), rel_tol=1e-5, abs_tol=1e-7)


def test_position_weights():
    w = position_weights(6, 4.0)
    assert torch.allclose(w, torch.tensor([math.exp(-k / 4.0) for k in range(6)])), w
    assert torch.equal(position_weights(3, 0.0), torch.ones(3))


def test_block_targets_follow_the_row_and_the_document():
    g = torch.Generator().manual_seed(1)
    B, T, K = 2, 20, 4
    targets = torch.randint(0, 100, (B, T), generator=g)
    loss_mask = torch.rand(B, T, generator=g) < 0.85
    anchors = torch.tensor([[0, 5, 17, 19], [3, 8, 9, 0]])
    keep = torch.tensor([[True, True, True, True], [True, True, True, False]])
    labels, supervised, rows = block_targets(targets, loss_mask, anchors, keep, K)
    for b in range(B):
        for j in range(anchors.size(1)):
            alive = bool(keep[b, j])
            for k in range(K):
                r = int(anchors[b, j]) + k
                alive = alive and r < T and bool(loss_mask[b, r])
                assert bool(supervised[b, j, k]) == alive, (b, j, k)
                if r < T:
                    assert labels[b, j, k] == targets[b, r] and rows[b, j, k] == r


def test_anchors_are_distinct_valid_sorted_and_uniform():
    g = torch.Generator().manual_seed(2)
    loss_mask = torch.rand(3, 40, generator=g) < 0.5
    loss_mask[2] = False
    loss_mask[2, :3] = True  # fewer candidates than anchors
    counts = torch.zeros(40)
    n_draws = 400
    for _ in range(n_draws):
        anchors, keep = sample_anchors(loss_mask, 5, g)
        for b in range(3):
            picked = anchors[b][keep[b]].tolist()
            assert picked == sorted(set(picked)) and all(loss_mask[b, a] for a in picked)
            assert len(picked) == min(5, int(loss_mask[b].sum()))
        counts += torch.bincount(anchors[0][keep[0]], minlength=40).float()
    valid = loss_mask[0]
    expected = n_draws * 5 / int(valid.sum())
    assert counts[~valid].sum() == 0
    chi2 = (((counts[valid] - expected) ** 2) / expected).sum().item()
    dof = int(valid.sum()) - 1
    assert chi2 < dof + 6 * math.sqrt(2 * dof), f"chi2 {chi2:.1f} for {dof} dof"  # far from uniform fails


def test_the_markov_head_is_teacher_forced_with_the_token_before_each_position(monkeypatch):
    """Block position k's Markov input is the true token before it: the anchor's token at k = 0, then the
    label of position k − 1 (never position k's own label, which would leak the answer)."""
    from dsv41.config import load_config, with_dspark
    from dsv41.model.dspark import DSpark
    from dsv41.model.transformer import Transformer
    from dsv41.train.dspark import drafter_losses

    c = with_dspark(load_config("tiny"))
    main = Transformer(c).init_weights(seed=0)
    drafter = DSpark(c).init_weights(seed=1).bind(main)
    g = torch.Generator().manual_seed(5)
    B, T = 2, 48
    seq = torch.randint(20, c.vocab_size, (B, T + 1), generator=g)
    batch = {"tokens": seq[:, :-1], "targets": seq[:, 1:], "doc_ids": torch.ones(B, T, dtype=torch.long),
             "loss_mask": torch.ones(B, T, dtype=torch.bool)}
    seen = {}
    original = DSpark.head_outputs

    def spy(self, hidden, prev):
        seen["prev"] = prev.clone()
        return original(self, hidden, prev)

    monkeypatch.setattr(DSpark, "head_outputs", spy)
    drafter_losses(drafter, batch, n_anchors=4, weights=LossWeights(), generator=torch.Generator().manual_seed(0))
    prev = seen["prev"]  # (B, A, K)
    anchors, keep = sample_anchors(batch["loss_mask"], 4, torch.Generator().manual_seed(0))
    labels, _, _ = block_targets(batch["targets"], batch["loss_mask"], anchors, keep, drafter.block_size)
    for b in range(B):
        for j in range(anchors.size(1)):
            a = int(anchors[b, j])
            assert prev[b, j, 0] == batch["tokens"][b, a], (b, j)
            assert torch.equal(prev[b, j, 1:], labels[b, j, :-1]), (b, j, prev[b, j], labels[b, j])
