"""`dsv41 train --parallel dp=..,ep=..,pp=..,cp=..` under torchrun: the Trainer on a `Parallelize`d model.

    torchrun --standalone --nproc-per-node 4 -m dsv41 train --preset tiny --steps 100 --grad_accum 4 \\
        --parallel dp=2,pp=2 --out runs/tiny-pp

Same run as on one device: `grad_accum` counts the micro-batches of the whole step (every data-parallel
rank takes grad_accum/dp of them, in order), so the schedule, the token count, the loss curve and the
checkpoints' step numbers are those of `dsv41 train` without --parallel. Every rank reads the same data
stream (deterministic), so the data position is the same everywhere. Rank 0 alone writes metrics and
checkpoint metadata; checkpoints are distributed (`parallel.checkpoint`, reload on any layout;
`python -m dsv41.parallel.checkpoint CKPT OUT` converts one to a single-file checkpoint).
Not done in parallel mode yet: validation (eval records), QAT switching is done, replay simulation too.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from dsv41.config import ConfigError
from dsv41.parallel.checkpoint import load_distributed, save_distributed
from dsv41.parallel.config import parse_parallel
from dsv41.parallel.mesh import ParallelDims
from dsv41.parallel.train import Parallelize
from dsv41.train import state as ckpt
from dsv41.train.trainer import TrainConfig, Trainer, replay_window_start


def init_distributed() -> torch.device:
    """Join the torchrun job (env:// rendezvous): NCCL on CUDA, gloo on CPU. Returns this rank's device."""
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            raise ConfigError("train option 'parallel': launch with torchrun (e.g. torchrun --standalone "
                              "--nproc-per-node 4 -m dsv41 train --parallel dp=2,pp=2 ...)")
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (the lent H200s)
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if cuda else "gloo")
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class ParallelTrainer(Trainer):
    """Trainer whose step, checkpoints and logging are distributed (module docstring)."""

    def __init__(self, tc: TrainConfig, resume: str | Path | None = None):
        pconfig = parse_parallel(tc.parallel)
        if tc.grad_accum % pconfig.dp:
            raise ConfigError(f"train option 'grad_accum': {tc.grad_accum} micro-batches do not split over "
                              f"dp={pconfig.dp}")
        per_rank = tc.grad_accum // pconfig.dp
        if tc.dtype == "bf16":  # FSDP2 mixed precision (bf16 compute, fp32 master weights and reductions)
            pconfig = dataclasses.replace(pconfig, mixed="bf16")
        if pconfig.pp > 1:
            pconfig = dataclasses.replace(pconfig, microbatches=per_rank)
        device = init_distributed()
        self.dims = ParallelDims.build(pconfig, device)
        self.rank = dist.get_rank()
        super().__init__(dataclasses.replace(tc, auto_resume=False, device=str(device),
                                             progress=tc.progress and self.rank == 0), resume=None)
        self.tc = tc
        self.per_rank = per_rank
        self.par = Parallelize(self.model, self.dims, lr=tc.lr, weight_decay=tc.weight_decay,
                               engram_lr_mult=tc.engram_lr_mult)
        self.optimizer = self.par.optimizer
        if resume is None and tc.auto_resume:
            resume = ckpt.resolve_checkpoint(self.out)
        if resume is not None:
            self.load(resume)

    def log(self, record: dict[str, Any]) -> None:
        if self.rank == 0:
            super().log(record)

    def evaluate(self) -> tuple[float, int]:
        return float("nan"), 0  # validation is not distributed yet: no eval records

    def train_step(self) -> dict[str, Any]:
        tc = self.tc
        qat = tc.qat_from_tokens >= 0 and self.tokens >= tc.qat_from_tokens
        self.set_qat(qat)
        lr = self.schedule.apply(self.optimizer, self.tokens + tc.tokens_per_step, self.step + 1)
        batches = []
        for micro in range(tc.grad_accum):  # the whole step's micro-batches, the same on every rank
            b = dict(next(self._batches))
            if tc.replay_sim:
                rng = np.random.default_rng([tc.seed, self.step, micro])
                b["window_start"] = replay_window_start(*b["tokens"].shape, tc.replay_fraction, rng)
            batches.append({k: v.to(self.device) for k, v in b.items()})
        mine = batches[self.dims.dp_rank * self.per_rank:(self.dims.dp_rank + 1) * self.per_rank]
        result = self.par.train_step(mine, tc.grad_clip)
        self.step += 1
        self.tokens += tc.tokens_per_step
        self.last_loads = result.loads
        t = torch.tensor
        return dict(lm=t(result.lm), indexer=t(result.indexer), balance=t(result.balance), total=t(result.total),
                    grad_norm=t(result.grad_norm), lr=lr, qat=qat, targets=result.targets, loads=result.loads)

    def save(self) -> Path:
        name = f"ckpt-{self.step:06d}"
        folder = self.out / name
        state = {"step": self.step, "tokens": self.tokens, "elapsed": self.elapsed,
                 "data": self.dataset.state_dict(), "train_config": dataclasses.asdict(self.tc),
                 "parallel": str(self.dims.config)}
        save_distributed(self.par, folder, extra=state)
        if self.rank == 0:
            (folder / ckpt.STATE_FILE).write_text(json.dumps(state, default=str) + "\n")
            (folder / "tokenizer.json").write_bytes(Path(self.tc.tokenizer).read_bytes())
            ckpt.set_latest(self.out, name)
        dist.barrier()
        return folder

    def load(self, path: str | Path) -> None:
        folder = ckpt.resolve_checkpoint(path)
        if folder is None:
            raise FileNotFoundError(2, "no training checkpoint", str(path))
        state = load_distributed(self.par, folder)
        if not state:
            raise ConfigError(f"train option 'resume': {folder} is not a distributed checkpoint")
        self.step, self.tokens, self.elapsed = int(state["step"]), int(state["tokens"]), float(state["elapsed"])
        self.dataset.load_state_dict(state["data"])
        self._start_batches()
        self.resumed_from = folder
        if self.rank == 0:
            self._truncate_metrics()
