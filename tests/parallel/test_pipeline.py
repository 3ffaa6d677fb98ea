"""Pipeline parallelism equals single-device training, with a Reuse and a Reindex consumer on a later stage
than their kv source (tiny: layer 4 is the decoder's Full layer and candidate source; the cut after it
puts Reuse 5, Reindex 6 and Reuse 7 on stage 1), shadow indexers bit-identical to their owner after
every step, and the index-key payload variant. Gloo, CPU."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from tests.parallel.equality import run_layout
from tests.parallel.harness import spawn

FULL = pytest.mark.skipif(not os.environ.get("DSV41_PARALLEL_FULL"), reason="set DSV41_PARALLEL_FULL=1 (minutes)")


def check_shadows_after_step(par, step: int) -> None:
    """Owner and shadow weights bit-identical: the owner sends its current weights afresh."""
    from dsv41.parallel.fsdp import full

    runner = par.pipeline
    if runner is None:
        return
    for src, consumer in runner.shadow_plan:
        owner_rank, shadow_rank = runner._peers(src, consumer)
        if par.dims.pp_rank == runner.stage_of[src]:
            for name in ("attn.indexer.wk.weight", "attn.indexer.k_norm.weight"):
                dist.send(full(runner._owner_param(src, name)).detach().float().contiguous(), shadow_rank)
        elif par.dims.pp_rank == consumer:
            for name, t in runner.stage_module.shadows[src].synced_parameters():
                owner = torch.empty_like(t)
                dist.recv(owner, owner_rank)
                assert torch.equal(owner, t), f"step {step}: shadow of layer {src} {name} on stage {consumer} != owner"


def _pipeline(rank: int, world: int, layouts: list[str]) -> None:
    for layout in layouts:
        par, *_ = run_layout(layout, after_step=check_shadows_after_step)
        if "ship_index_keys=1" not in layout:
            assert par.pipeline.shadow_plan == [(4, 1)], par.pipeline.shadow_plan
        if rank == 0:
            print(f"{layout}: equal single-device; shadows bit-identical after every step", flush=True)


@FULL
def test_pipeline_equal_to_single_device() -> None:
    spawn(_pipeline, 2, ["pp=2,cuts=5", "pp=2,cuts=5,ship_index_keys=1,schedule=gpipe"])
