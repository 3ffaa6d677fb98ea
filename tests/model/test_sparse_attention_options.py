"""Block-level options applied from outside (issue 18): activation checkpointing per Block gives the
same loss and gradients as the plain backward, on both attention paths, although Reuse / Reindex
layers read CSA2 state that later blocks overwrite before the recompute runs."""

from __future__ import annotations

import pytest
import torch
from tests.conftest import randomize_mixing

from dsv41 import load_config
from dsv41.model.transformer import Transformer
from dsv41.train.trainer import apply_block_options


def _grads(model, tokens, doc, attention):
    model.zero_grad(set_to_none=True)
    losses = model.losses(tokens[:, :-1], tokens[:, 1:], doc_ids=doc, attention=attention)
    losses.total.backward()
    return losses, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("attention", ["sparse", "dense"])
def test_checkpointed_blocks_equal_the_plain_backward(attention):
    torch.manual_seed(71)
    config = load_config("tiny")
    plain = Transformer(config).init_weights(seed=71).train()
    randomize_mixing(plain, 71)
    ckpt = Transformer(config).train()
    ckpt.load_state_dict(plain.state_dict())
    apply_block_options(ckpt, checkpoint=True)
    tokens = torch.randint(3, config.vocab_size, (2, 97))
    doc = torch.ones(2, 96, dtype=torch.long)
    doc[1, 37:] = 2
    lp, gp = _grads(plain, tokens, doc, attention)
    lc, gc = _grads(ckpt, tokens, doc, attention)
    assert lc.total.item() == lp.total.item() and lc.indexer.item() == lp.indexer.item()
    assert gp.keys() == gc.keys()
    worst = max(((gc[n] - g).abs().max() / g.abs().max().clamp_min(1e-30)).item() for n, g in gp.items())
    print(f"{attention}: checkpointed vs plain, worst gradient rel err {worst:.1e}")
    assert worst <= 1e-6, f"checkpointed gradients differ: {worst:.1e}"
