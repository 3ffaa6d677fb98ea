"""Distributed training on torch.distributed: FSDP2, expert, pipeline and context parallelism, Engram
table sharding, distributed checkpoints — applied from outside to the single-device model (issue 22).

    dims = ParallelDims.build(parse_parallel("dp=2,ep=2,pp=2"))   # after init_process_group / torchrun
    par = Parallelize(model, dims, lr=...)                          # every rank: the same full model
    result = par.train_step(micro_batches)                          # equal to grad accumulation on one device

Design and costs: docs/distributed.md.
"""

from dsv41.parallel.config import ParallelConfig, parse_parallel
from dsv41.parallel.mesh import ParallelDims
from dsv41.parallel.train import Parallelize, StepResult

__all__ = ["ParallelConfig", "ParallelDims", "Parallelize", "StepResult", "parse_parallel"]
