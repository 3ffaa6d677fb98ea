"""`Transformer.losses`: each auxiliary loss enters `Losses.total` with its own configured weight."""

from __future__ import annotations

import torch

from dsv41 import load_config
from dsv41.model.transformer import Transformer


def test_total_is_lm_plus_weighted_indexer_and_balance_losses():
    # distinct, non-default weights: a term left out or weighted by the other's weight shows
    c = load_config("tiny").replace(indexer_loss_weight=0.37, balance_loss_weight=0.21)
    torch.manual_seed(51)
    model = Transformer(c).init_weights(seed=51).train()
    tokens = torch.randint(3, c.vocab_size, (2, 97))
    mask = torch.rand(2, 96) < 0.8
    losses = model.losses(tokens[:, :-1], tokens[:, 1:], loss_mask=mask)
    per_layer = [m.last_balance_loss for m in model.moe_layers()]
    assert len(per_layer) == c.n_layers and all(b is not None for b in per_layer)
    balance = torch.stack(per_layer).mean()
    assert torch.allclose(losses.balance, balance, rtol=1e-6), (losses.balance, balance)
    assert losses.indexer.item() > 1e-3 and losses.balance.item() > 0.5  # both terms are far from zero
    want = losses.lm + 0.37 * losses.indexer + 0.21 * losses.balance
    err = abs(losses.total.item() - want.item())
    assert err <= 1e-6 * want.item(), f"total {losses.total.item():.7f} vs lm + weighted aux {want.item():.7f}"
    # and the weighted balance loss trains the router: its gradient reaches every gate
    gate_grads = torch.autograd.grad(losses.total - losses.lm - 0.37 * losses.indexer,
                                     [m.gate.weight for m in model.moe_layers()])
    assert all(g.abs().sum() > 0 for g in gate_grads)
