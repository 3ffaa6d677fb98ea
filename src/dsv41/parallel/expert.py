"""Expert parallelism: the routed experts split over an expert group, tokens sent to them by all-to-all.

Rank j of an ep-rank group holds experts [j·E/ep, (j+1)·E/ep) of every MoE layer (the stacked
GroupedExperts weights cut between experts). The gate and the shared expert stay replicated (FSDP
shards them like any dense weight). `ExpertParallel` is installed as `MoE.expert_dispatch`:

  1. sort the (token, slot) pairs by expert (as the single-device dispatch does) and count per expert;
  2. all-to-all the counts, then the rows and their routing weights (`comm.all_to_all`, uneven splits);
  3. the received rows arrive grouped by source rank; a stable sort by local expert makes one segment
     per expert, and the unchanged `GroupedExperts.forward` (one grouped GEMM per projection) runs them;
  4. undo the sort, all-to-all back, un-sort to (token, slot) order and sum the k slots.

Gradients take the transposed path (the all-to-all's backward). Loads for the aux-loss-free bias are
counted by the gate on every rank and summed over all data ranks before the bias step
(`optim.update_biases_global`), so every rank applies the same global step.

Each expert's gradient already sums the tokens of its whole expert group, so after FSDP's average over
the edp replicas it is ep times the data-parallel average: `scale_expert_grads` divides by ep.
Cost per MoE layer and micro-batch: 2 all-to-alls of N·k·dim activations forward, 2 backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dsv41.model.moe import MoE, _use_grouped, moe_modules
from dsv41.parallel.comm import all_to_all
from dsv41.parallel.fsdp import local


class ExpertParallel:
    """MoE.expert_dispatch over `group`: this rank holds `n_local` experts starting at `rank · n_local`."""

    def __init__(self, group: dist.ProcessGroup, n_experts: int):
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        if n_experts % self.size:
            raise ValueError(f"expert parallelism: {n_experts} experts do not split over ep={self.size}")
        self.n_local = n_experts // self.size

    def __call__(self, moe: MoE, x: Tensor, weights: Tensor, indices: Tensor) -> Tensor:
        N, k = indices.shape
        idx = indices.reshape(-1)  # (N·k,)
        order = idx.argsort(stable=True)
        counts = torch.zeros(moe.n_routed, dtype=torch.long, device=x.device).scatter_add_(0, idx, torch.ones_like(idx))
        xs = x.index_select(0, order // k)  # (N·k, dim) sorted by expert = by destination rank
        ws = weights.reshape(-1, 1).index_select(0, order)  # (N·k, 1) fp32
        send = counts.view(self.size, self.n_local)  # (ep, E_local) rows for each rank's experts
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)  # recv[src, e]: rows from src for local expert e
        in_splits, out_splits = send.sum(1).tolist(), recv.sum(1).tolist()
        xr = all_to_all(xs, out_splits, in_splits, self.group)  # (M, dim) by source rank, then expert
        wr = all_to_all(ws, out_splits, in_splits, self.group)
        expert_of_row = torch.arange(self.n_local, device=x.device).repeat(self.size).repeat_interleave(recv.flatten())
        perm = expert_of_row.argsort(stable=True)  # (M,) one contiguous segment per local expert
        out = moe.experts(xr.index_select(0, perm), wr.index_select(0, perm), recv.sum(0),
                          grouped=_use_grouped(moe.moe_impl, x))
        out = torch.empty_like(out).index_copy_(0, perm, out)  # back to arrival order
        back = all_to_all(out, in_splits, out_splits, self.group)  # (N·k, dim) expert-sorted
        y = torch.empty_like(back).index_copy_(0, order, back)  # (token, slot) order
        return y.float().view(N, k, -1).sum(dim=1)


@torch.no_grad()
def shard_experts(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Keep this rank's experts of every MoE (in place) and install the all-to-all dispatch."""
    for _, moe in moe_modules(model):
        ep = ExpertParallel(group, moe.n_routed)
        lo, n = ep.rank * ep.n_local, ep.n_local
        experts = moe.experts
        for w in ("w1", "w2", "w3"):
            setattr(experts, w, nn.Parameter(getattr(experts, w)[lo:lo + n].clone()))
        experts.n_experts = n
        experts.expert_offset, experts.global_experts = lo, moe.n_routed  # for checkpoints
        moe.expert_dispatch = ep


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for _, moe in moe_modules(model) for p in moe.experts.parameters()]


@torch.no_grad()
def scale_expert_grads(model: nn.Module, ep: int) -> None:
    """Divide the experts' gradients by ep (see the module docstring)."""
    if ep == 1:
        return
    for p in expert_parameters(model):
        if p.grad is not None:
            local(p.grad).div_(ep)
