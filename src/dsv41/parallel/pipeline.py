"""Pipeline parallelism with `torch.distributed.pipelining`: stages cut between blocks, the CSA2 payload,
shadow indexers and per-micro-batch shared state (SPEC §3 "training with sharing across stages").

* Stages. `StageModule` keeps the model's own modules under their single-device names (`embed`,
  `layers.<i>` in a ModuleDict, `norm`, `head`), so optimizer grouping and checkpoints see the same
  names on any layout. Its forward is one micro-batch of `Transformer.hidden` restricted to its
  layers; the last stage adds the head and the LM loss. Tokens, document ids, targets and the loss
  mask reach every stage as keyword arguments (the schedule splits them per micro-batch); hidden
  streams and the payload go stage to stage by p2p.
* Payload. Besides the streams h and the pre-mix, a boundary carries exactly the shared state that a
  later stage reads (a liveness pass over the layer plan): the current kv source's entries, top-k
  indices (−1 padded) and candidate masks — padded to static shapes (⌈T_r/m⌉ entries) because the
  stages' p2p buffers are fixed. Entries travel in their pre-RoPE form (the compressor output) with
  gradients; the consumer stage applies the parameter-free RoPE + FP4 rounding itself. With context
  parallelism each cp rank sends only its own entries and its own query rows (never a full copy).
* Shadow indexers. A Reindex layer scores with index keys from its kv source's key projection
  (`indexer.wk`, `indexer.k_norm`). When the source sits on an earlier stage, the consumer's stage
  holds a shadow copy of that projection and derives the keys from the shipped entries. The owner (the
  source layer) alone is stepped by the optimizer and checkpointed; shadows are not parameters of the
  stage module. After backward each shadow's gradient (averaged over the data ranks like FSDP) is
  added into the owner's; after the optimizer step the owner's weights are copied to every shadow,
  so owner and shadows stay bit-identical. `ship_index_keys=1` ships index keys instead (no shadows).
* Shared state per micro-batch. Each micro-batch's forward builds its own ForwardContext; payload
  tensors leave with the micro-batch, so concurrent micro-batches of a 1F1B schedule never share state,
  and a source's entries are dropped at the first boundary after their last consumer. Backward frees
  what autograd saved per micro-batch. (Activation recomputation is not built yet.)
* Auxiliary losses of non-last stages (indexer KL, MoE balance) join the backward through an identity
  on the outgoing streams whose backward also seeds them (`_AttachLoss`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from dsv41.model.attention import Attention, Indexer
from dsv41.model.mhc import identity_pre_mix
from dsv41.model.norm import RMSNorm
from dsv41.model.transformer import Transformer
from dsv41.parallel.fsdp import compute_autocast, full, local, shard_of
from dsv41.parallel.mesh import ParallelDims
from dsv41.plan import REINDEX, REUSE


class _AttachLoss(torch.autograd.Function):
    """Identity on h whose backward also back-propagates `loss` (with gradient 1)."""

    @staticmethod
    def forward(ctx, h: Tensor, loss: Tensor) -> Tensor:
        return h.view_as(h)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, torch.ones((), dtype=torch.float32, device=grad.device)


# ---------------------------------------------------------------------- shadows
class _ShadowKeys(nn.Module):
    """The key path of an Indexer (`wk`, `k_norm`), with Indexer's own `keys`."""

    owns_k = True

    def keys(self, latent: Tensor, cos: Tensor, sin: Tensor, quant: bool) -> Tensor:
        """Indexer.keys in the shadow's fp32 (under mixed=bf16 the shipped entries are bf16)."""
        return Indexer.keys(self, latent.to(self.wk.weight.dtype), cos, sin, quant).to(latent.dtype)

    def __init__(self, owner: Indexer):
        super().__init__()
        self.wk = nn.Linear(owner.wk.in_features, owner.wk.out_features, bias=False)
        self.k_norm = RMSNorm(owner.k_norm.weight.numel(), owner.k_norm.eps)
        with torch.no_grad():
            self.wk.weight.copy_(owner.wk.weight)
            self.k_norm.weight.copy_(owner.k_norm.weight)


class _NoKeys:
    owns_k = False  # an entry path that only rotates (its stage has no Reindex consumer of the keys)


class ShadowIndexer(nn.Module):
    """Executable copy of a kv source's entry path on a later stage: `Attention.entries` (RoPE at each
    group's first position, FP4 rounding, index keys) run with the source's frequencies and key weights.
    `keys=False`: rotation and rounding only (no parameters; nothing to synchronise)."""

    angles = Attention.angles
    entries = Attention.entries

    def __init__(self, owner: Attention, keys: bool = True):
        super().__init__()
        self.layer_id, self.plan, self.qat = owner.layer_id, owner.plan, owner.qat
        self.register_buffer("freqs", owner.freqs.clone(), persistent=False)
        self.indexer = _ShadowKeys(owner.indexer) if keys else _NoKeys()

    def synced_parameters(self) -> list[tuple[str, Tensor]]:
        """(owner parameter name inside the source layer, shadow tensor)."""
        if isinstance(self.indexer, _NoKeys):
            return []
        return [("attn.indexer.wk.weight", self.indexer.wk.weight),
                ("attn.indexer.k_norm.weight", self.indexer.k_norm.weight)]


# ---------------------------------------------------------------------- payload plan
@dataclass(frozen=True)
class Boundary:
    """What crosses the boundary after layer `after`."""

    after: int
    kv_source: int | None  # the kv source whose entries a later stage reads (None: nothing)
    ratio: int
    index_keys: bool  # a later Reindex layer needs the source's index keys
    topk_source: int | None
    candidate_source: int | None


def plan_boundary(model: Transformer, after: int) -> Boundary:
    """Liveness of the shared state after layer `after`: fields read by a later layer before replaced."""
    plans = model.plan
    later = plans[after + 1:]
    kv_src = topk_src = cand_src = None
    index_keys = False
    ratio = 0
    for p in later:
        if p.mode in (REUSE, REINDEX) and p.kv_source is not None and p.kv_source <= after:
            kv_src, ratio = p.kv_source, p.ratio
            index_keys |= p.mode == REINDEX
        if p.mode == REUSE and p.topk_source is not None and p.topk_source <= after:
            topk_src = p.topk_source
        if p.uses_candidates:
            srcs = [q.layer_id for q in plans if q.candidate_source and q.layer_id <= after and q.half == p.half]
            if srcs:
                cand_src = srcs[-1]
    return Boundary(after, kv_src, ratio, index_keys, topk_src, cand_src)


# ---------------------------------------------------------------------- the stage module
class StageModule(nn.Module):
    """Layers `layer_ids` of a Transformer, with the payload in and out (module docstring)."""

    def __init__(self, model: Transformer, layer_ids: range, n_stages: int, stage: int, runner: PipelineRunner):
        super().__init__()
        self.config, self.plan = model.config, model.plan
        self.layer_ids, self.stage, self.n_stages = layer_ids, stage, n_stages
        self.is_first, self.is_last = stage == 0, stage == n_stages - 1
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layer_ids})
        if self.is_first:
            self.embed = model.embed
        if self.is_last:
            self.norm, self.head = model.norm, model.head
        self.engram_index = model.engram_index
        if any(model.layers[i].engram is not None for i in layer_ids):
            self.hasher = model.hasher
        self.fuse_across_blocks = False
        self.runner = [runner]  # not a submodule
        self.n_index = sum(p.mode in ("full", "reindex") for p in model.plan)
        self.incoming = plan_boundary(model, layer_ids.start - 1) if not self.is_first else None
        self.outgoing = plan_boundary(model, layer_ids.stop - 1) if not self.is_last else None
        # kv source → its entry path on this stage (plain attributes, not children: shadows are no
        # parameters of the stage, so neither the optimizer nor a checkpoint sees them)
        self.entry_paths: dict[int, ShadowIndexer] = {}
        self.shadows: dict[int, ShadowIndexer] = {}
        self.sums = torch.zeros(4)  # lm, indexer, balance, total parts of this stage, summed over micro-batches

    head_logits = Transformer.head_logits

    # ------------------------------------------------------------------ payload
    def payload_shapes(self, boundary: Boundary, rows: int, chunk: int, dtype: torch.dtype) -> list[Tensor]:
        """Example tensors (static shapes) of the payload after the streams."""
        c = self.config
        out = []
        if boundary.kv_source is not None:
            cap = -(-chunk // boundary.ratio)
            out.append(torch.zeros(rows, cap, c.head_dim, dtype=dtype, requires_grad=True))
            if boundary.index_keys and self.runner[0].ship_index_keys:
                out.append(torch.zeros(rows, cap, c.index_head_dim, dtype=dtype, requires_grad=True))
        # indices and masks travel as fp32 (exact below 2^24): older pipelining versions make every receive
        # buffer require grad, which integer tensors cannot (see `import_payload`)
        if boundary.topk_source is not None:
            out.append(torch.zeros(rows, chunk, c.index_topk, requires_grad=True))
        if boundary.candidate_source is not None:
            total = chunk * self.runner[0].cp
            out.append(torch.zeros(rows, chunk, -(-total // self.plan[boundary.candidate_source].ratio),
                                   requires_grad=True))
        return out

    def export_payload(self, ctx, boundary: Boundary, chunk: int) -> list[Tensor]:
        shared, out = ctx.shared, []
        if boundary.kv_source is not None:
            cap = -(-chunk // boundary.ratio)
            dtype = self.runner[0].entry_dtype  # the buffer's dtype: under mixed=bf16 the entries are bf16
            out.append(_pad(shared.latent.to(dtype), 1, cap, 0.0))
            if boundary.index_keys and self.runner[0].ship_index_keys:
                out.append(_pad(shared.index_k.to(dtype), 1, cap, 0.0))
        if boundary.topk_source is not None:
            out.append(_pad(shared.topk, 2, self.config.index_topk, -1).float())
        if boundary.candidate_source is not None:
            total = chunk * self.runner[0].cp
            width = -(-total // self.plan[boundary.candidate_source].ratio)
            out.append(_pad(shared.candidates.float(), 2, width, 0))
        return out

    def import_payload(self, ctx, boundary: Boundary, payload: list[Tensor]) -> Tensor:
        """Fill ctx.shared from the payload; returns a zero that touches the index / mask inputs, so every
        received tensor gets a (zero) gradient to send back, as the pipeline expects of inputs."""
        shared, it = ctx.shared, iter(payload)
        links = []
        if boundary.kv_source is not None:
            own = ctx.own_slots(boundary.ratio)
            latent = next(it)[:, :own.token.size(1)]  # (B, N_own, D)
            shared.latent, shared.slots, shared.kv_source = latent, ctx.slots(boundary.ratio), boundary.kv_source
            quant = self.layers[str(self.layer_ids.start)].attn.qat
            path = self.entry_paths[boundary.kv_source]  # RoPE + FP4 here; index keys from a shadow
            shared.kv, shared.index_k = path.entries(latent, own.first_position, quant)
            if boundary.index_keys and self.runner[0].ship_index_keys:
                shared.index_k = next(it)[:, :own.token.size(1)]
        if boundary.topk_source is not None:
            topk = next(it)
            shared.topk, shared.topk_source = topk.detach().long(), boundary.topk_source
            links.append(topk)
        if boundary.candidate_source is not None:
            n = ctx.slots(self.plan[boundary.candidate_source].ratio).token.size(1)
            mask = next(it)
            shared.candidates, shared.candidate_source = mask.detach()[..., :n].bool(), boundary.candidate_source
            links.append(mask)
        return sum((t.sum() * 0.0 for t in links), torch.zeros((), device=payload[0].device if payload else None))

    # ------------------------------------------------------------------ forward
    def forward(self, *inputs: Tensor, **kwargs: Tensor) -> Tensor | tuple[Tensor, ...]:
        with compute_autocast(self.runner[0].dims):
            return self._forward(*inputs, **kwargs)

    def _forward(self, *inputs: Tensor, hash_tokens: Tensor, doc_ids: Tensor, targets: Tensor, loss_mask: Tensor,
                 window_start: Tensor | None = None) -> Tensor | tuple[Tensor, ...]:
        runner = self.runner[0]
        ctx = runner.owner.context(doc_ids, window_start)
        mask = runner.owner.chunk(loss_mask)
        if self.is_first:
            h = self.embed(runner.owner.chunk(inputs[0])).unsqueeze(2).repeat(1, 1, self.config.hc_mult, 1)
            pre_mix = identity_pre_mix(h, self.config.hc_mult)  # (B, T_r, n)
        link = None
        if not self.is_first:
            h, pre_mix, *payload = inputs
            link = self.import_payload(ctx, self.incoming, payload)
        hash_ids = runner.owner.hash_ids(hash_tokens, doc_ids) if hasattr(self, "hasher") else None
        entry = None
        for i in self.layer_ids:
            layer = self.layers[str(i)]
            if layer.engram is not None:
                h = layer.engram(h, hash_ids[:, :, self.engram_index[i]])
                entry = None
            h, pre_mix, entry = layer(h, pre_mix, partial(layer.attn, ctx=ctx), token_mask=mask, entry=entry)
        from dsv41.parallel.train import aux_losses

        zero = h.new_zeros((), dtype=torch.float32)
        aux = aux_losses(self, ctx, zero, n_index=self.n_index, n_moe=self.config.n_layers)
        if link is not None:
            aux["aux"] = aux["aux"] + link
        scale = runner.loss_scale
        if self.is_last:
            n = runner.owner.target_count(loss_mask)
            logits = self.head_logits(entry[0])
            ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), runner.owner.chunk(targets).flatten(),
                                                   reduction="none")
            lm = (ce * mask.flatten()).sum() / n.clamp_min(1)
            total = lm + aux["aux"]
            self.sums += torch.stack([lm, aux["indexer"], aux["balance"], total]).detach().float().cpu()
            runner.targets += int(n.item())
            return (total * scale).reshape(1)  # (1,): the schedule concatenates micro-batch outputs
        self.sums += torch.stack([zero, aux["indexer"], aux["balance"], aux["aux"]]).detach().float().cpu()
        h = _AttachLoss.apply(h, aux["aux"] * scale)
        # the residual streams cross in fp32 (as on one device, where autocast leaves them fp32); p2p buffers
        # have fixed dtypes, so every tensor is cast to its buffer's
        return (h.float(), pre_mix.float(), *self.export_payload(ctx, self.outgoing, h.size(1)))


def _pad(t: Tensor, dim: int, size: int, value) -> Tensor:
    """Pad dim `dim` of t up to `size` with `value` (static payload shapes)."""
    extra = size - t.size(dim)
    if extra < 0:
        raise ValueError(f"pipeline payload: {t.size(dim)} rows exceed the static capacity {size}")
    if extra == 0:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t, t.new_full(shape, value)], dim=dim)


# ---------------------------------------------------------------------- the runner
class PipelineRunner:
    """Builds this rank's stage and shadows; runs a step through the schedule; syncs shadows."""

    def __init__(self, model: Transformer, dims: ParallelDims):
        c = dims.config
        self.dims, self.cp, self.ship_index_keys = dims, c.cp, bool(c.ship_index_keys)
        self.stages = c.stage_layers(model.config.n_layers)
        self.stage_of = {i: s for s, r in enumerate(self.stages) for i in r}
        self.stage_module = StageModule(model, self.stages[dims.pp_rank], c.pp, dims.pp_rank, self)
        # every rank knows the whole shadow plan (the collectives below follow it in order)
        self.shadow_plan: list[tuple[int, int]] = []  # (kv source layer, consumer stage)
        if not self.ship_index_keys:
            for s, layers in enumerate(self.stages):
                for i in layers:
                    p = model.plan[i]
                    pair = (p.kv_source, s)
                    if p.mode == REINDEX and self.stage_of[p.kv_source] < s and pair not in self.shadow_plan:
                        self.shadow_plan.append(pair)
        incoming = self.stage_module.incoming
        if incoming is not None and incoming.kv_source is not None:
            src = incoming.kv_source
            path = ShadowIndexer(model.layers[src].attn, keys=(src, dims.pp_rank) in self.shadow_plan)
            self.stage_module.entry_paths[src] = path
            if path.synced_parameters():
                self.stage_module.shadows[src] = path
        self.owner: Any = None  # the Parallelize that holds this runner (context, chunking, counts)
        self.schedule = None
        self.loss_scale = 1.0
        self.targets = 0
        self.entry_dtype = torch.float32  # dtype of the shipped entries (bf16 under mixed=bf16)

    def build_schedule(self, rows: int, seq: int) -> None:
        """The PipelineStage with static payload shapes for micro-batches of (rows, seq), and the schedule."""
        dims, c = self.dims, self.dims.config
        chunk = seq // c.cp
        mod = self.stage_module
        dtype = self.entry_dtype = torch.bfloat16 if c.mixed == "bf16" else torch.float32
        cfg = mod.config

        def streams():
            return [torch.zeros(rows, chunk, cfg.hc_mult, cfg.dim, dtype=torch.float32, requires_grad=True),
                    torch.zeros(rows, chunk, cfg.hc_mult, dtype=torch.float32, requires_grad=True)]

        inputs = (torch.zeros(rows, seq, dtype=torch.long),) if mod.is_first else \
            tuple(streams() + mod.payload_shapes(mod.incoming, rows, chunk, dtype))
        outputs = (torch.zeros(1, requires_grad=True),) if mod.is_last else \
            tuple(streams() + mod.payload_shapes(mod.outgoing, rows, chunk, dtype))
        self.stage = PipelineStage(mod, dims.pp_rank, c.pp, dims.device, input_args=inputs, output_args=outputs,
                                   group=dims.pp_group)
        kind = Schedule1F1B if c.schedule == "1f1b" else ScheduleGPipe
        kwargs: dict[str, Any] = {"loss_fn": lambda out, target: out.sum()}
        if "scale_grads" in inspect.signature(kind.__init__).parameters:
            kwargs["scale_grads"] = False  # the loss is already divided by the micro-batch count
        self.schedule = kind(self.stage, c.n_microbatches, **kwargs)

    def run(self, batches: list[dict[str, Tensor]]) -> tuple[Tensor, int]:
        """One step of this data rank's micro-batches through the pipeline: (loss part sums, targets)."""
        c = self.dims.config
        if len(batches) != c.n_microbatches:
            raise ValueError(f"pipeline: {len(batches)} micro-batches given, schedule runs {c.n_microbatches}")
        if self.schedule is None:
            self.build_schedule(*batches[0]["tokens"].shape)
        self.loss_scale = c.cp / len(batches)
        self.targets = 0
        mod = self.stage_module
        mod.sums = torch.zeros(4)
        cat = {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
        kwargs = dict(hash_tokens=cat["tokens"], doc_ids=cat["doc_ids"], targets=cat["targets"],
                      loss_mask=cat["loss_mask"])
        if "window_start" in cat:
            kwargs["window_start"] = cat["window_start"]
        args = (cat["tokens"],) if mod.is_first else ()
        if mod.is_last:
            self.schedule.step(*args, target=cat["targets"], losses=[], **kwargs)
        else:
            self.schedule.step(*args, **kwargs)
        targets = self.targets
        if not mod.is_last:  # only the last stage counted targets
            targets = 0
        return mod.sums, targets

    # ------------------------------------------------------------------ shadow synchronisation
    def _peers(self, src: int, consumer: int) -> tuple[int, int]:
        """(owner rank, shadow rank) of this rank's data position for the shadow (src, consumer)."""
        data = self.dims.config.data_ranks
        d = self.dims.data_rank
        return self.stage_of[src] * data + d, consumer * data + d

    def _owner_param(self, src: int, name: str) -> nn.Parameter:
        return self.stage_module.layers[str(src)].get_parameter(name)

    @torch.no_grad()
    def reduce_shadow_grads(self) -> None:
        """Each shadow's gradient, averaged over the data ranks, added into its owner's (collective)."""
        data_group = self.dims.data_group if self.dims.config.data_ranks > 1 else None
        for src, consumer in self.shadow_plan:
            owner_rank, shadow_rank = self._peers(src, consumer)
            if self.dims.pp_rank == consumer:
                for _, t in self.stage_module.shadows[src].synced_parameters():
                    g = (t.grad.clone() if t.grad is not None else torch.zeros_like(t)).float()
                    if data_group is not None:
                        dist.all_reduce(g, group=data_group)
                        g /= self.dims.config.data_ranks
                    dist.send(g.contiguous(), owner_rank)
                    t.grad = None
            elif self.dims.pp_rank == self.stage_of[src]:
                for name, t in _names(self, src):
                    p = self._owner_param(src, name)
                    g = torch.empty(t, dtype=torch.float32, device=self.dims.device)
                    dist.recv(g, shadow_rank)
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    local(p.grad).add_(shard_of(g, p).to(local(p.grad).dtype))

    @torch.no_grad()
    def sync_shadows(self) -> None:
        """Copy every owner's weights to its shadows (collective; bit-identical afterwards)."""
        for src, consumer in self.shadow_plan:
            owner_rank, shadow_rank = self._peers(src, consumer)
            if self.dims.pp_rank == self.stage_of[src]:
                for name, _ in _names(self, src):
                    dist.send(full(self._owner_param(src, name)).detach().float().contiguous(), shadow_rank)
            elif self.dims.pp_rank == consumer:
                for _, t in self.stage_module.shadows[src].synced_parameters():
                    w = torch.empty_like(t, dtype=torch.float32)
                    dist.recv(w, owner_rank)
                    t.copy_(w)


def _names(runner: PipelineRunner, src: int) -> list[tuple[str, tuple[int, ...]]]:
    """(owner parameter name inside layer `src`, full shape) of a shadow's synced tensors."""
    attn_cfg = runner.stage_module.config
    return [("attn.indexer.wk.weight", (attn_cfg.index_head_dim, attn_cfg.head_dim)),
            ("attn.indexer.k_norm.weight", (attn_cfg.index_head_dim,))]
