"""Device meshes of a ParallelConfig: which ranks shard, split sequences, hold experts, form stages.

Rank layout (cp innermost, as torchtitan): rank = pp_rank · (dp·cp) + dp_rank · cp + cp_rank. The dp·cp
ranks of a stage are its *data ranks* d = dp_rank · cp + cp_rank; FSDP2 shards dense parameters over
all of them (sequence chunks of one batch are data like any other). Expert parallelism regroups the
same data ranks as d = ep_rank · edp + edp_rank (edp = dp·cp / ep): an expert group is ep ranks that
exchange tokens; experts are further FSDP-sharded over the edp ranks that hold the same experts.

Three DeviceMesh views over the same ranks (each builds its own process groups):
  dense   ("pp", "dp_cp")        FSDP2 of dense blocks, Engram row shards, the pipeline group
  grid    ("pp", "dp", "cp")     context-parallel groups (sequence chunks)
  expert  ("pp", "ep", "edp")    expert groups and the FSDP2 mesh of the experts
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from dsv41.parallel.config import ParallelConfig


@dataclass
class ParallelDims:
    """This rank's coordinates and the meshes / groups of a ParallelConfig."""

    config: ParallelConfig
    device: torch.device
    rank: int
    pp_rank: int
    dp_rank: int
    cp_rank: int
    ep_rank: int
    edp_rank: int
    dense: DeviceMesh
    grid: DeviceMesh
    expert: DeviceMesh

    @classmethod
    def build(cls, config: ParallelConfig, device: torch.device | str = "cpu") -> ParallelDims:
        """Collective: every rank calls it with the same config once torch.distributed is initialized."""
        if not dist.is_initialized():
            raise RuntimeError("ParallelDims.build needs torch.distributed initialized "
                               "(torchrun or init_process_group)")
        world = dist.get_world_size()
        if world != config.world_size:
            raise ValueError(f"parallel config {config} needs pp·dp·cp = {config.world_size} ranks, got {world}")
        device = torch.device(device)
        c = config
        data = c.data_ranks
        edp = data // c.ep
        ranks = torch.arange(world)
        dense = DeviceMesh(device.type, ranks.view(c.pp, data), mesh_dim_names=("pp", "dp_cp"))
        grid = DeviceMesh(device.type, ranks.view(c.pp, c.dp, c.cp), mesh_dim_names=("pp", "dp", "cp"))
        expert = DeviceMesh(device.type, ranks.view(c.pp, c.ep, edp), mesh_dim_names=("pp", "ep", "edp"))
        rank = dist.get_rank()
        pp_rank, d = divmod(rank, data)
        dp_rank, cp_rank = divmod(d, c.cp)
        ep_rank, edp_rank = divmod(d, edp)
        return cls(c, device, rank, pp_rank, dp_rank, cp_rank, ep_rank, edp_rank, dense, grid, expert)

    # ------------------------------------------------------------------ groups
    @property
    def data_rank(self) -> int:
        return self.dp_rank * self.config.cp + self.cp_rank

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        return self.dense["dp_cp"]

    @property
    def data_group(self) -> dist.ProcessGroup:
        """The stage's dp·cp data ranks (loads, losses and counts are summed over it)."""
        return self.dense.get_group("dp_cp")

    @property
    def cp_group(self) -> dist.ProcessGroup:
        return self.grid.get_group("cp")

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.grid.get_group("dp")

    @property
    def ep_group(self) -> dist.ProcessGroup:
        return self.expert.get_group("ep")

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.dense.get_group("pp")

    @property
    def edp(self) -> int:
        return self.config.data_ranks // self.config.ep
