"""GRPO with reasoning effort: the length reward, sub-group advantages, the clipped token loss (SPEC §8).

Key ideas:
- For each prompt, M_b samples at every effort level b of the training set B. The reward is the verifier's
  0/1 plus the length term r_len = −min(C_max, k(b)·ℓ/L_norm), k(b) = k0·exp(−(b − b_min)/τ),
  τ = λ·(mean gap between consecutive levels of B): low effort pays most per reasoning token, b_min pays k0.
- Advantages are centred within each (prompt, effort) sub-group only — never across effort levels, so the
  length term ranks samples of one effort against each other and the effort line keeps its meaning.
- Token loss (PPO-style, on the behaviour policy's log-probabilities that the rollout recorded per token):
  ratio r = exp(logp − logp_behaviour), loss = −min(r·A, clip(r, 1 − ε_low, 1 + ε_high)·A), plus
  β·KL(π‖π_ref) with the k3 estimator exp(ref − logp) − (ref − logp) − 1 when a reference is given.
  Defaults (documented in docs/post-training.md): ε_low = 0.2, ε_high = 0.28 (asymmetric "clip-higher"),
  β = 0 (no reference model: the length term and clipping keep the policy near the SFT start at this scale).
  Tokens whose mask is 0 (prompt, padding, or too stale: `rollout.staleness_mask`) add nothing; the mean is
  over the unmasked tokens of the batch.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class EffortReward:
    """The length reward's constants: r_len(b, ℓ) = −min(c_max, k(b)·ℓ / l_norm)."""

    levels: tuple[int, ...] = (25, 50, 75, 100)  # B, the training effort levels
    k0: float = 0.5  # k(b_min): the penalty per L_norm tokens at the lowest effort
    lam: float = 0.5  # λ: τ = λ · mean gap of B
    c_max: float = 0.5  # the most the length term can take away (keeps a correct answer's reward > 0)
    l_norm: float = 64.0  # tokens that cost k(b)
    tau: float = field(init=False)

    def __post_init__(self) -> None:
        if len(self.levels) < 2 or sorted(set(self.levels)) != list(self.levels):
            raise ValueError(f"effort levels must be >= 2 distinct increasing values, got {self.levels}")
        if not all(1 <= b <= 100 for b in self.levels):
            raise ValueError(f"effort levels must lie in 1..100, got {self.levels}")
        if self.lam <= 0 or self.l_norm <= 0 or self.c_max < 0 or self.k0 < 0:
            raise ValueError("need lam > 0, l_norm > 0, c_max >= 0, k0 >= 0")
        gaps = [b - a for a, b in zip(self.levels, self.levels[1:])]
        self.tau = self.lam * sum(gaps) / len(gaps)

    @property
    def b_min(self) -> int:
        return self.levels[0]

    def k(self, b: float) -> float:
        return self.k0 * math.exp(-(b - self.b_min) / self.tau)

    def length_term(self, b: float, length: float) -> float:
        return -min(self.c_max, self.k(b) * length / self.l_norm)

    def __call__(self, correct: bool, b: float, length: float) -> float:
        """Total reward of one sample: verifier (1/0) + length term."""
        return float(correct) + self.length_term(b, length)


def subgroup_advantages(rewards: Sequence[float], prompt_ids: Sequence[Hashable], efforts: Sequence[int],
                        scale: bool = False, eps: float = 1e-6) -> Tensor:
    """A_i = r_i − mean of the rewards sharing sample i's (prompt, effort) (÷ their std + eps when `scale`).
    A sub-group of one sample gets 0. Returns (N,) fp32."""
    if not len(rewards) == len(prompt_ids) == len(efforts):
        raise ValueError("rewards, prompt_ids and efforts must have one entry per sample")
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, key in enumerate(zip(prompt_ids, efforts)):
        groups[key].append(i)
    r = torch.tensor([float(x) for x in rewards], dtype=torch.float64)
    adv = torch.zeros_like(r)
    for members in groups.values():
        idx = torch.tensor(members)
        g = r[idx]
        a = g - g.mean()
        if scale and len(members) > 1:
            a = a / (g.std(unbiased=False) + eps)
        adv[idx] = a
    return adv.float()


@dataclass
class ClipConfig:
    eps_low: float = 0.2  # ratio floor 1 − eps_low (for negative advantages)
    eps_high: float = 0.28  # ratio ceiling 1 + eps_high (for positive advantages)
    kl_coef: float = 0.0  # β of the k3 KL to the reference policy (0 = no reference forward)


def token_logprobs(logits: Tensor, tokens: Tensor) -> Tensor:
    """logits (B, T, V) predicting tokens (B, T) → log π(token) (B, T) fp32 (full-vocabulary log-softmax)."""
    return logits.float().log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def grpo_loss(logp: Tensor, logp_behaviour: Tensor, advantages: Tensor, mask: Tensor, clip: ClipConfig,
              logp_ref: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """logp, logp_behaviour, mask (B, T); advantages (B,) → (loss, stats): the clipped surrogate averaged
    over the unmasked tokens, + β·k3 KL when logp_ref is given."""
    m = mask.float()
    n = m.sum().clamp(min=1)
    ratio = (logp - logp_behaviour).exp()  # (B, T)
    a = advantages.to(logp.dtype)[:, None]  # (B, 1)
    surrogate = torch.minimum(ratio * a, ratio.clamp(1 - clip.eps_low, 1 + clip.eps_high) * a)  # (B, T)
    loss = -(surrogate * m).sum() / n
    stats = {"clip_frac": float((((ratio < 1 - clip.eps_low) | (ratio > 1 + clip.eps_high)).float() * m).sum() / n),
             "ratio_mean": float((ratio.detach() * m).sum() / n)}
    if logp_ref is not None and clip.kl_coef > 0:
        d = logp_ref - logp
        kl = ((d.exp() - d - 1) * m).sum() / n
        loss = loss + clip.kl_coef * kl
        stats["kl"] = float(kl.detach())
    return loss, stats
