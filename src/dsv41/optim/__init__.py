"""Training optimizers of SPEC §7: Muon (head-wise for Q/K), Sinkhorn-balanced tables, AdamW, LR schedule."""

from dsv41.optim.groups import CombinedOptimizer, GroupingSummary, assign, build_optimizer
from dsv41.optim.muon import Muon, newton_schulz
from dsv41.optim.schedule import LRSchedule
from dsv41.optim.sinkhorn import SinkhornBalanced, sinkhorn_balance

__all__ = [
    "CombinedOptimizer",
    "GroupingSummary",
    "LRSchedule",
    "Muon",
    "SinkhornBalanced",
    "assign",
    "build_optimizer",
    "newton_schulz",
    "sinkhorn_balance",
]
