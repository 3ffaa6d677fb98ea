"""One distributed training step, equal to single-device training with gradient accumulation.

`Parallelize(model, dims, ...)` applies, from outside and in this order, pipeline stages
(`pipeline.py`), expert parallelism (`expert.py`), Engram table sharding (`engram.py`), context
parallelism hooks (`context.py`) and FSDP2 (`fsdp.py`), then builds the sharding-aware optimizers
(`optim.py`). Every rank starts from the same full model (same seed or the same checkpoint).

Semantics: each data-parallel rank gets `n` micro-batches of whole rows per step (its cp ranks cut
every row into chunks; with pp > 1 the n micro-batches go through the pipeline schedule). The step
equals the single-device Trainer step over the dp·n micro-batches (grad_accum = dp·n): loss =
mean over micro-batches of each micro-batch's (lm + w·indexer + w·balance); MoE biases step once from
the loads summed over all micro-batches and ranks; clipping by the global gradient norm.
Gradient scaling: a rank back-propagates its part of a micro-batch loss times cp/n; FSDP averages
over the dp·cp data ranks, which leaves the average over dp·n micro-batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from dsv41.model.moe import moe_modules
from dsv41.model.state import ForwardContext
from dsv41.model.transformer import Transformer
from dsv41.parallel.comm import all_reduce
from dsv41.parallel.context import ContextParallelContext
from dsv41.parallel.engram import ShardedEngramTable, shard_engram_tables
from dsv41.parallel.expert import scale_expert_grads, shard_experts
from dsv41.parallel.fsdp import apply_fsdp, compute_autocast
from dsv41.parallel.mesh import ParallelDims
from dsv41.parallel.optim import accumulate_loads, build_parallel_optimizer, clip_grad_norm, update_biases_global


def chunk_losses(model: nn.Module, tokens: Tensor, targets: Tensor, loss_mask: Tensor, ctx: ForwardContext,
                 hash_ids: Tensor | None, n_targets: Tensor, hidden: Tensor | None = None) -> dict[str, Tensor]:
    """`Transformer.losses` for the rows (or row chunks) this rank holds, as parts of the micro-batch's
    losses: the LM loss divided by the micro-batch's target count `n_targets`, the indexer KL and the
    balance loss already partial through the context's hooks. Parts sum over cp ranks to the loss."""
    if hidden is None:
        hidden = model.hidden(tokens, ctx, token_mask=loss_mask, hash_ids=hash_ids)
    logits = model.head_logits(hidden)
    ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    lm = (ce * loss_mask.flatten()).sum() / n_targets.clamp_min(1)
    aux = aux_losses(model, ctx, lm.new_zeros(()))
    return {"lm": lm, **aux, "total": lm + aux["aux"]}


def aux_losses(model: nn.Module, ctx: ForwardContext, zero: Tensor, n_index: int | None = None,
               n_moe: int | None = None) -> dict[str, Tensor]:
    """Indexer KL and balance loss of the layers that ran in this forward, as their parts of the means
    over all `n_index` index sources and `n_moe` MoE layers of the model (a pipeline stage holds some)."""
    c = model.config
    kl = ctx.indexer_losses
    bal = [m.last_balance_loss for _, m in moe_modules(model) if m.last_balance_loss is not None]
    indexer = torch.stack(kl).sum() / (n_index or len(kl)) if kl else zero
    balance = torch.stack(bal).sum() / (n_moe or len(bal)) if bal else zero
    return {"indexer": indexer, "balance": balance,
            "aux": c.indexer_loss_weight * indexer + c.balance_loss_weight * balance}


class _StepForward(nn.Module):
    """The FSDP2 root: its forward is one micro-batch chunk's losses (root parameters unshard here)."""

    def __init__(self, model: Transformer, dims: ParallelDims):
        super().__init__()
        self.model = model
        self.dims = [dims]  # not a submodule

    def forward(self, tokens, targets, loss_mask, ctx, hash_ids, n_targets):
        with compute_autocast(self.dims[0]):
            return chunk_losses(self.model, tokens, targets, loss_mask, ctx, hash_ids, n_targets)


@dataclass
class StepResult:
    lm: float  # means over the step's micro-batches (all ranks)
    indexer: float
    balance: float
    total: float
    targets: int
    loads: dict[str, dict[str, Tensor]]
    grad_norm: float = math.nan


class Parallelize:
    """A Transformer trained on the meshes of `dims` (see the module docstring)."""

    def __init__(self, model: Transformer, dims: ParallelDims, *, lr: float = 2.6e-4, weight_decay: float = 0.1,
                 engram_lr_mult: float = 5.0, **optimizer_kwargs: Any):
        self.dims, c = dims, dims.config
        self.config = model.config
        model.train()
        self.pipeline = None
        if c.pp > 1:
            from dsv41.parallel.pipeline import PipelineRunner

            self.pipeline = PipelineRunner(model, dims)
            self.module = self.pipeline.stage_module
        else:
            self.module = model
        if c.ep > 1:
            shard_experts(self.module, dims.ep_group)
        self.tables: list[ShardedEngramTable] = []
        if c.engram_sharded:
            self.tables = shard_engram_tables(self.module, dims.data_group)
        if c.cp > 1:
            for _, moe in moe_modules(self.module):
                moe.sequence_reduce = lambda t, g=dims.cp_group: all_reduce(t.detach().clone(), g)
        self.root = _StepForward(self.module, dims) if self.pipeline is None else self.module
        apply_fsdp(self.module, dims, ignored={t.weight for t in self.tables}, root=self.root)
        if self.pipeline is not None:
            self.pipeline.owner = self
        self.optimizer = build_parallel_optimizer(self.module, lr, weight_decay=weight_decay,
                                                  engram_lr_mult=engram_lr_mult,
                                                  row_groups={t.weight: t.group for t in self.tables},
                                                  **optimizer_kwargs)
        self.loads = accumulate_loads(self.module)

    # ------------------------------------------------------------------ per micro-batch inputs
    def chunk(self, t: Tensor | None) -> Tensor | None:
        """This cp rank's chunk of whole rows (B, T) → (B, T/cp, ...)."""
        if t is None or self.dims.config.cp == 1:
            return t
        n = t.size(1) // self.dims.config.cp
        return t[:, self.dims.cp_rank * n:(self.dims.cp_rank + 1) * n]

    def context(self, doc_ids: Tensor, window_start: Tensor | None = None) -> ForwardContext:
        if self.dims.config.cp > 1:
            return ContextParallelContext.for_chunk(doc_ids, self.dims.cp_group, window_start, training_losses=True)
        return ForwardContext.build(doc_ids, doc_ids, training_losses=True, window_start=window_start)

    def hash_ids(self, tokens: Tensor, doc_ids: Tensor) -> Tensor | None:
        """Engram addresses of whole rows, cut to this rank's chunk (history crosses chunk borders)."""
        hasher = getattr(self.module, "hasher", None)
        return None if hasher is None else self.chunk(hasher(tokens, doc_ids=doc_ids))

    def target_count(self, loss_mask: Tensor) -> Tensor:
        """Targets of the whole micro-batch (summed over the cp chunks)."""
        return all_reduce(self.chunk(loss_mask).sum().float(), self.dims.cp_group if self.dims.config.cp > 1 else None)

    def prefetch(self, batches: list[dict[str, Tensor]]) -> None:
        """Engram rows of every micro-batch of the step, fetched from their owners before any layer runs."""
        if not self.tables:
            return
        hashes = [self.hash_ids(b["tokens"], b["doc_ids"]) for b in batches]
        for table in self.tables:
            module = next(m for m in self.module.modules() if getattr(m, "embed", None) is table)
            table.prefetch(torch.stack([h[:, :, module.engram_index] for h in hashes]))

    # ------------------------------------------------------------------ the step
    def forward_backward(self, batches: list[dict[str, Tensor]]) -> StepResult:
        """Forward and backward of this rank's micro-batches (whole rows: tokens, targets, doc_ids,
        loss_mask, optional window_start); gradients left reduced in the parameters' .grad."""
        c = self.dims.config
        for v in self.loads.values():
            v.clear()
        self.loads.clear()
        self.prefetch(batches)
        if self.pipeline is not None:
            sums, targets = self.pipeline.run(batches)
        else:
            scale = c.cp / len(batches)
            sums = torch.zeros(4)
            targets = 0
            for b in batches:
                n = self.target_count(b["loss_mask"])
                ctx = self.context(b["doc_ids"], b.get("window_start"))
                out = self.root(self.chunk(b["tokens"]), self.chunk(b["targets"]), self.chunk(b["loss_mask"]), ctx,
                                self.hash_ids(b["tokens"], b["doc_ids"]), n)
                (out["total"] * scale).backward()
                sums += torch.stack([out[k].detach().float().cpu() for k in ("lm", "indexer", "balance", "total")])
                targets += int(n.item())
        self.finish_backward()
        # losses: parts over cp ranks sum, micro-batches of all dp ranks average
        device = self.dims.device  # NCCL reduces device tensors only
        total = all_reduce(sums.to(device), dist.group.WORLD).cpu()
        total = total / (len(batches) * c.dp)  # stages' parts add up too: no division by pp
        n_targets = int(all_reduce(torch.tensor(float(targets), device=device), self.dims.dp_group).item())
        lm, indexer, balance, tot = total.tolist()
        return StepResult(lm, indexer, balance, tot, n_targets, {})

    def finish_backward(self) -> None:
        """What waits for the end of the backward: Engram row gradients to their owners, expert
        gradient scaling, shadow-indexer gradients into their owners."""
        for table in self.tables:
            table.push_grads(divide=self.dims.config.data_ranks)
        scale_expert_grads(self.module, self.dims.config.ep)
        if self.pipeline is not None:
            self.pipeline.reduce_shadow_grads()

    def optimizer_step(self, grad_clip: float = 1.0) -> tuple[float, dict[str, dict[str, Tensor]]]:
        """Global MoE bias step, global-norm clipping, optimizer step; returns (grad norm, global loads)."""
        loads = update_biases_global(self.module, self.loads, self.dims.data_group)
        clip = grad_clip if grad_clip > 0 else math.inf
        norm = clip_grad_norm([p for p in self.module.parameters() if p.requires_grad], clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.pipeline is not None:
            self.pipeline.sync_shadows()
        return float(norm), loads

    def train_step(self, batches: list[dict[str, Tensor]], grad_clip: float = 1.0) -> StepResult:
        result = self.forward_backward(batches)
        result.grad_norm, result.loads = self.optimizer_step(grad_clip)
        return result

    def named_parameters(self) -> dict[str, Any]:
        """This rank's parameters by their single-device names (shards, experts, its stage only)."""
        return dict(self.module.named_parameters())
