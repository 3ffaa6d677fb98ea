"""FSDP2 per block (torchtitan's `apply_fsdp`), and helpers for tensors that may be DTensor shards.

`apply_fsdp` shards each Block (and its Engram module, called before the block's own forward, as a
unit of its own), the experts over their own mesh when expert parallelism leaves edp > 1 replicas,
then the root (embedding, final norm, head). Mixed precision: parameters all-gathered in
`param_dtype` (bf16 when asked), gradients reduced in fp32. Cross-block mHC fusion is switched off
(`Transformer.fuse_across_blocks`): a block cannot read the next block's still-sharded hc_attn_fn.

DTensor sharding follows torch.chunk along the sharded dim, so `shard_of(full, like)` can cut a rank's
piece out of a full tensor without communication.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from dsv41.parallel.mesh import ParallelDims


def local(t: Tensor) -> Tensor:
    """This rank's piece of t (the tensor itself when it is not a DTensor)."""
    return t.to_local() if isinstance(t, DTensor) else t


def full(t: Tensor) -> Tensor:
    """The whole tensor (collective for a sharded DTensor)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def shard_of(whole: Tensor, like: Tensor) -> Tensor:
    """The piece of `whole` (the global tensor) that this rank holds of `like` (a DTensor or a plain tensor)."""
    if not isinstance(like, DTensor):
        return whole
    coords = like.device_mesh.get_coordinate()
    out = whole
    for mesh_dim, placement in enumerate(like.placements):
        if isinstance(placement, Shard):
            out = out.chunk(like.device_mesh.size(mesh_dim), dim=placement.dim)[coords[mesh_dim]]
    return out


def shards_whole_matrices(p: Tensor) -> bool:
    """Does every rank hold whole (rows, cols) matrices of p? (plain tensors; 3-D stacks split on dim 0)."""
    if not isinstance(p, DTensor):
        return True
    return all(not isinstance(pl, Shard) or pl.dim < p.ndim - 2 for pl in p.placements)


def mixed_precision(mixed: str) -> MixedPrecisionPolicy:
    if mixed == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy(reduce_dtype=torch.float32)


def compute_autocast(dims: ParallelDims) -> torch.autocast:
    """mixed=bf16 where FSDP2 cannot apply it (one data rank per stage: nothing is sharded, see `apply_fsdp`):
    autocast, as the single-device Trainer does for --dtype bf16. Disabled otherwise."""
    enabled = dims.config.mixed == "bf16" and dims.config.data_ranks == 1
    return torch.autocast(dims.device.type, dtype=torch.bfloat16, enabled=enabled)


def apply_fsdp(model: nn.Module, dims: ParallelDims, ignored: set[nn.Parameter] | None = None,
               root: nn.Module | None = None) -> None:
    """fully_shard every block of `model` (a Transformer or a pipeline stage), then `root` (default the
    model: embedding, final norm and head; a wrapper whose forward is the training step's entry)."""
    model.fuse_across_blocks = False
    if dims.config.data_ranks == 1:
        return  # nothing to shard over (pipeline parallelism alone; bf16 then comes from `compute_autocast`)
    mesh, mp = dims.fsdp_mesh, mixed_precision(dims.config.mixed)
    ignored = set(ignored or ())
    layers = model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers
    for block in layers:
        experts = block.ffn.experts
        if dims.config.ep > 1:
            if dims.edp > 1:
                fully_shard(experts, mesh=dims.expert["edp"], mp_policy=mp)
            else:  # each rank holds its experts whole: FSDP leaves them alone
                ignored |= set(experts.parameters())
        if block.engram is not None:
            fully_shard(block.engram, mesh=mesh, mp_policy=mp, ignored_params=ignored & set(block.engram.parameters()))
        fully_shard(block, mesh=mesh, mp_policy=mp, ignored_params=ignored & set(block.parameters()))
    root = model if root is None else root
    fully_shard(root, mesh=mesh, mp_policy=mp, ignored_params=ignored & set(root.parameters()))
