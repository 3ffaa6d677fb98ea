"""Torch twin of `ops.markov_greedy`: the DSpark drafter's greedy semi-autoregressive Markov loop (the spec).

Position by position (official forward_head, `model.dspark.DSpark.sample` at temperature 0): the previous
token's Markov embedding e = embed[prev] gives the logit bias head · e and, with the position's hidden state,
the confidence logit w · [hidden, e]; the token is the argmax of base + bias (ties: the lowest index, NaN
counts as the largest, as torch.argmax), and becomes the next position's prev. fp32 products throughout, the
same torch calls as `MarkovHead` / `ConfidenceHead`, so this equals the model's loop bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def markov_greedy(base: Tensor, hidden: Tensor, anchors: Tensor, embed: Tensor, head: Tensor, conf_weight: Tensor
                  ) -> tuple[Tensor, Tensor]:
    """base (B, K, V) fp32, hidden (B, K, dim), anchors (B,) ids, embed / head (V, r), conf_weight
    ((1,) dim + r) → (tokens (B, K) int64, confidence logits (B, K) fp32)."""
    w = conf_weight.reshape(1, -1).float()  # (1, dim + r)
    head = head.float()
    prev = anchors.long()
    tokens, conf = [], []
    for i in range(base.size(1)):
        e = F.embedding(prev, embed).float()  # (B, r)
        logits = base[:, i] + F.linear(e, head)  # (B, V)
        conf.append(F.linear(torch.cat([hidden[:, i].float(), e], dim=-1), w).squeeze(-1))
        prev = logits.argmax(-1)
        tokens.append(prev)
    return torch.stack(tokens, -1), torch.stack(conf, -1)
