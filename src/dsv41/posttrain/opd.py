"""On-policy distillation (OPD): full-vocabulary reverse KL from one or more teachers on the student's samples.

Key ideas (SPEC §8):
- The student samples (on the rollout engine, like RL); at every generated position the loss is the exact
  reverse KL over the whole vocabulary, KL(π_s ‖ π_t) = Σ_v π_s(v)·(log π_s(v) − log π_t(v)), so the gradient
  is analytic (no sampled estimate) and mode-seeking: the student is pushed off what the teacher rules out.
- Several teachers: each dataset (task family) names its active teachers; a sample's loss is the mean of its
  reverse KLs to them. `Teachers.switch` changes the active set mid-run: samples already in flight are kept
  and, once finished, are trained against the teachers active at their training step (the loss target changes;
  nothing is dropped or regenerated). Each switch bumps `version`, which samples record at dispatch
  (`Sample.config_version`) so the metrics show which config a sample was dispatched under.
- Teachers run without gradient (eval mode); routing replay does not apply to them (their own routing).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn


def reverse_kl(student_logits: Tensor, teacher_logits: Tensor, mask: Tensor) -> Tensor:
    """logits (B, T, V), mask (B, T) → mean over masked positions of KL(softmax(student) ‖ softmax(teacher))."""
    ls = student_logits.float().log_softmax(-1)
    lt = teacher_logits.float().log_softmax(-1)
    kl = (ls.exp() * (ls - lt)).sum(-1)  # (B, T)
    m = mask.float()
    return (kl * m).sum() / m.sum().clamp(min=1)


@dataclass
class Teachers:
    """Named teacher models and, per dataset, the names of the active ones ("*" = every dataset)."""

    models: dict[str, nn.Module]
    active: dict[str, list[str]]
    version: int = 0
    history: list[tuple[int, dict[str, list[str]]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._check(self.active)
        for m in self.models.values():
            m.eval().requires_grad_(False)
        self.history.append((self.version, dict(self.active)))

    def _check(self, active: dict[str, list[str]]) -> None:
        for dataset, names in active.items():
            unknown = [n for n in names if n not in self.models]
            if unknown or not names:
                raise ValueError(f"dataset {dataset!r}: unknown or no teachers {unknown or names} "
                                 f"(teachers: {', '.join(self.models)})")

    def switch(self, active: dict[str, list[str]]) -> int:
        """Change the active teachers (cheap: only names change); returns the new config version."""
        self._check(active)
        self.active = dict(active)
        self.version += 1
        self.history.append((self.version, dict(self.active)))
        return self.version

    def for_dataset(self, dataset: str) -> list[str]:
        names = self.active.get(dataset, self.active.get("*"))
        if names is None:
            raise ValueError(f"no active teacher for dataset {dataset!r}")
        return names

    def loss(self, student_logits: Tensor, tokens: Tensor, mask: Tensor, datasets: list[str]) -> Tensor:
        """The OPD loss of a batch: for each sample, the mean reverse KL to its dataset's active teachers,
        weighted by its masked positions (one teacher forward per teacher over the rows that use it)."""
        total = student_logits.new_zeros(())
        n = mask.float().sum().clamp(min=1)
        for name in {t for d in datasets for t in self.for_dataset(d)}:
            rows = [b for b, d in enumerate(datasets) if name in self.for_dataset(d)]
            share = torch.tensor([1.0 / len(self.for_dataset(datasets[b])) for b in rows], device=tokens.device)
            idx = torch.tensor(rows, device=tokens.device)
            with torch.no_grad():
                teacher_logits = self.models[name](tokens.index_select(0, idx))  # (b, T, V)
            ls = student_logits.index_select(0, idx).float().log_softmax(-1)
            lt = teacher_logits.float().log_softmax(-1)
            kl = (ls.exp() * (ls - lt)).sum(-1)  # (b, T)
            total = total + (kl * mask.index_select(0, idx).float() * share[:, None]).sum()
        return total / n
