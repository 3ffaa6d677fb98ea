"""The SPEC §7 optimizers on sharded parameters, global gradient norms, and the global MoE bias step.

Same grouping and hyper-parameters as `dsv41.optim.build_optimizer`; the two matrix-wise optimizers
change how they see a sharded matrix (FSDP2 cuts dim 0, rows; expert parallelism cuts the experts):
* Muon needs the whole matrix (or the whole head slice) for Newton–Schulz. Momentum stays sharded
  (it is elementwise); the Nesterov update of a row-sharded 2-D matrix is all-gathered (`full_tensor`),
  orthogonalized on every rank of the group, and each rank keeps its rows — the choice of DTensor-aware
  Muon ports. Cost per matrix and step: one all-gather of the update (the bytes FSDP gathers for the
  weight in forward) and the Newton–Schulz FLOPs repeated on each of the W ranks (≈ 20·rows·cols·min(rows,
  cols) per rank). Stacked experts (E, out, in) are cut between experts, so each rank orthogonalizes
  its own whole expert matrices with no communication at all.
* Sinkhorn-balanced (embedding, head, Engram tables: tall, rows sharded) keeps its row and column
  scaling vectors; the column statistics (d_r² · G², n floats), the max |G| and the mean row norm are
  all-reduced each iteration, so the full matrix is never gathered: 11 all-reduces of `cols` floats.
* AdamW is elementwise and runs on DTensors unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard

from dsv41.model.moe import bias_step, moe_modules
from dsv41.optim import CombinedOptimizer, build_optimizer
from dsv41.optim.muon import Muon, orthogonalize
from dsv41.optim.sinkhorn import SinkhornBalanced, sinkhorn_balance
from dsv41.parallel.comm import all_reduce
from dsv41.parallel.fsdp import full, local, shard_of, shards_whole_matrices


class ShardedMuon(Muon):
    """Muon whose params may be DTensor shards: gather a matrix only when its rows are split."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                update = self._nesterov(p, group["momentum"], group["nesterov"])  # sharded like p
                whole = shards_whole_matrices(p)
                u = local(update) if whole else full(update)
                (ortho,) = orthogonalize([u], group["heads"], group["rms"], batch_numel=group["batch_numel"],
                                         steps=tuple(group["ns_steps"]), dtype=group["ns_dtype"])
                if not whole:
                    ortho = shard_of(ortho, p)
                w = local(p)
                w.mul_(1 - lr * wd)  # decoupled weight decay with the unscaled lr
                w.add_(ortho, alpha=-lr)
        return loss


def sinkhorn_balance_rows(G: Tensor, group: dist.ProcessGroup | None, tau: float = 1e-3, iters: int = 11,
                          eps: float = 1e-20) -> Tensor:
    """`sinkhorn_balance` of a tall matrix whose rows are split over `group` (G is this rank's rows):
    the same iteration, with max |G|, the mean row norm and the column statistics all-reduced."""
    X = G.double() if G.dtype == torch.float64 else G.float()
    m_local, n = X.shape
    amax = all_reduce(X.abs().amax() if m_local else X.new_zeros(()), group, dist.ReduceOp.MAX)
    X = X / amax.clamp_min(torch.finfo(X.dtype).tiny)
    S = X.square()  # (m_local, n)
    row_norms = S.sum(1).sqrt()  # (m_local,)
    stats = all_reduce(torch.stack([row_norms.sum(), X.new_tensor(float(m_local))]), group)
    d_r = (row_norms > tau * stats[0] / stats[1]).to(X.dtype)
    d_c = torch.ones(n, dtype=X.dtype, device=X.device)
    for k in range(iters):
        if k % 2 == 0:
            d_r = d_r / (d_r * (S @ d_c.square()).sqrt() + eps)
        else:
            d_c = d_c / (d_c * all_reduce(d_r.square() @ S, group).sqrt() + eps)
    return ((n**0.5 * d_r)[:, None] * X * d_c[None, :]).to(G.dtype)


class ShardedSinkhorn(SinkhornBalanced):
    """Sinkhorn-balanced update on row-sharded tables (DTensor Shard(0), or a group given per param)."""

    def __init__(self, params, row_groups: Mapping[Tensor, dist.ProcessGroup] | None = None, **kwargs):
        super().__init__(params, **kwargs)
        self.row_groups = dict(row_groups or {})  # plain-tensor shards sharded by hand (Engram tables)

    def _group_of(self, p: Tensor) -> tuple[bool, dist.ProcessGroup | None]:
        if p in self.row_groups:
            return True, self.row_groups[p]
        if isinstance(p, DTensor):
            dims = [i for i, pl in enumerate(p.placements) if isinstance(pl, Shard)]
            if dims and all(p.placements[i].dim == 0 for i in dims) and len(dims) == 1 and p.shape[0] >= p.shape[1]:
                return True, p.device_mesh.get_group(dims[0])
            return False, None
        return True, None

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            mu = group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.mul_(mu).add_(p.grad)
                update = p.grad.add(buf, alpha=mu) if group["nesterov"] else buf
                rows_split, row_group = self._group_of(p)
                if rows_split:
                    delta = sinkhorn_balance_rows(local(update), row_group, group["tau"], group["iters"], group["eps"])
                else:  # an unusual layout: balance the gathered matrix, keep this rank's piece
                    delta = shard_of(sinkhorn_balance(full(update), group["tau"], group["iters"], group["eps"]), p)
                local(p).add_(delta, alpha=-group["gamma"] * group["lr"])
        return loss


def build_parallel_optimizer(model: nn.Module, lr: float, *,
                             row_groups: Mapping[Tensor, dist.ProcessGroup] | None = None,
                             **kwargs) -> CombinedOptimizer:
    """`build_optimizer`'s groups and settings, with the sharding-aware Muon and Sinkhorn."""
    base = build_optimizer(model, lr, **kwargs)
    optimizers: dict[str, torch.optim.Optimizer] = {}
    for name, opt in base.optimizers.items():
        if name == "muon":
            optimizers[name] = ShardedMuon(opt.param_groups, **opt.defaults)
        elif name == "sinkhorn":
            optimizers[name] = ShardedSinkhorn(opt.param_groups, row_groups=row_groups, **opt.defaults)
        else:
            optimizers[name] = opt
    return CombinedOptimizer(optimizers, base.summary)


# ---------------------------------------------------------------------- gradient norm
def clip_grad_norm(params: Iterable[Tensor], max_norm: float, group: dist.ProcessGroup | None = None) -> Tensor:
    """Global-norm clipping over parameters whose shards are disjoint across `group` (every parameter
    piece is held by exactly one rank of it: FSDP shards, experts, pipeline stages; default: the world).
    Returns the norm."""
    params = [p for p in params if p.grad is not None]
    device = local(params[0].grad).device if params else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for p in params:
        sq += local(p.grad).double().square().sum().to(device)
    total = all_reduce(sq, group if group is not None else dist.group.WORLD).sqrt().float()
    if math.isfinite(max_norm):
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for p in params:
            local(p.grad).mul_(coef.to(local(p.grad).device))
    return total


# ---------------------------------------------------------------------- MoE bias step from global loads
def accumulate_loads(model: nn.Module) -> dict[str, dict[str, Tensor]]:
    """Forward hooks that sum every MoE's `last_load` over the forwards of a step (pipeline micro-batches
    run inside the schedule); returns the dict they fill (clear it after each step)."""
    loads: dict[str, dict[str, Tensor]] = {}

    def hook(name: str):
        def add(moe, args, output):
            if moe.last_load is not None:
                acc = loads.setdefault(name, {k: torch.zeros_like(v) for k, v in moe.last_load.items()})
                for k, v in moe.last_load.items():
                    acc[k] += v
        return add

    for name, moe in moe_modules(model):
        moe.register_forward_hook(hook(name))
    return loads


@torch.no_grad()
def update_biases_global(model: nn.Module, loads: Mapping[str, Mapping[str, Tensor]],
                         group: dist.ProcessGroup | None) -> dict[str, dict[str, Tensor]]:
    """Sum each MoE's loads over `group` (every rank that saw tokens of this stage's layers), then the
    aux-loss-free step on each rank's piece of the bias. Returns the global loads."""
    out: dict[str, dict[str, Tensor]] = {}
    for name, moe in moe_modules(model):
        if name not in loads:
            continue
        out[name] = {}
        for kind, bias in (("text", moe.gate.bias), ("image", moe.gate.bias_vl)):
            if bias is None or kind not in loads[name]:
                continue
            n = all_reduce(loads[name][kind].clone(), group)  # (E,) tokens per expert, all ranks
            out[name][kind] = n
            local(bias).add_(shard_of(bias_step(n.to(local(bias).device), moe.bias_update_speed), bias))
    return out
