"""Token-based learning-rate schedule of the pre-training run (SPEC §7).

    lr
    peak ┤   ┌──────────────┐
         │  /                ╲  cosine
   final ┤ /                  ╲_________
         └─┴───────────────┴────────┴──────▶ tokens
          warm-up   constant_until  decay_until   (end)

Report values: linear warm-up over 2000 steps to 2.6e-4, constant to 28T tokens, cosine to 2.6e-5 by
40T, constant to the end at 45T. `scaled` keeps those proportions for a shorter run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

REPORT_TOTAL_TOKENS = 45e12


@dataclass(frozen=True)
class LRSchedule:
    peak: float  # learning rate after warm-up
    final: float  # learning rate after the cosine decay
    warmup_tokens: float  # linear warm-up from 0 over this many tokens (ignored if warmup_steps > 0)
    constant_until_tokens: float  # the cosine starts here
    decay_until_tokens: float  # the cosine ends here; `final` afterwards
    warmup_steps: int = 0  # > 0: warm up over optimizer steps instead (the report's 2000 steps)

    def __post_init__(self):
        if not 0 <= self.warmup_tokens <= self.constant_until_tokens <= self.decay_until_tokens:
            raise ValueError(f"need 0 ≤ warmup ≤ constant_until ≤ decay_until, got {self}")
        if self.warmup_steps < 0 or self.peak < 0 or self.final < 0:
            raise ValueError(f"negative warm-up steps or learning rate in {self}")

    @classmethod
    def report(cls) -> LRSchedule:
        """The report's 45T-token schedule, warm-up counted in steps."""
        return cls(2.6e-4, 2.6e-5, 0.0, 28e12, 40e12, warmup_steps=2000)

    @classmethod
    def scaled(
        cls,
        total_tokens: float,
        *,
        peak: float = 2.6e-4,
        final: float = 2.6e-5,
        warmup_fraction: float = 0.01,
    ) -> LRSchedule:
        """The report's shape over `total_tokens`: constant to 28/45, cosine to 40/45, flat to the end.

        The report's warm-up is given in steps, whose size in tokens it does not state, so the warm-up
        here is a fraction of the run (1% by default).
        """
        return cls(
            peak,
            final,
            warmup_fraction * total_tokens,
            28 / 45 * total_tokens,
            40 / 45 * total_tokens,
        )

    def lr_at(self, tokens_seen: float, step: int | None = None) -> float:
        """Learning rate for the update whose batch brings the count to `tokens_seen` (and `step` ≥ 1).

        Counting the current batch makes the first update non-zero; warm-up ends exactly at
        `warmup_tokens` (or at step `warmup_steps`).
        """
        if self.warmup_steps > 0:
            if step is None:
                raise ValueError("this schedule warms up over steps: pass step=")
            if step < self.warmup_steps:
                return self.peak * step / self.warmup_steps
        elif tokens_seen < self.warmup_tokens:
            return self.peak * tokens_seen / self.warmup_tokens
        if tokens_seen <= self.constant_until_tokens:
            return self.peak
        if tokens_seen >= self.decay_until_tokens:
            return self.final
        span = self.decay_until_tokens - self.constant_until_tokens
        progress = (tokens_seen - self.constant_until_tokens) / span
        return self.final + (self.peak - self.final) * 0.5 * (1 + math.cos(math.pi * progress))

    def apply(self, optimizer, tokens_seen: float, step: int | None = None) -> float:
        """Set every group's lr to lr_at(...) × its `lr_mult` (Engram × 5); returns the base lr. A group whose lr is
        a tensor (a CUDA-graphed step reads it where it was captured: `train.graphs.tensor_lrs`) is filled in place."""
        lr = self.lr_at(tokens_seen, step)
        for group in optimizer.param_groups:
            value = lr * group.get("lr_mult", 1.0)
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(value)
            else:
                group["lr"] = value
        return lr
