"""Distributed checkpoints (`torch.distributed.checkpoint`) that reload on any layout, and their
conversion to the project's single-file safetensors checkpoint.

Every tensor is saved under its single-device name as a DTensor that says which global piece this
rank holds: FSDP2 parameters already are; expert-parallel experts and Engram row shards (plain local
tensors) are wrapped with `DTensor.from_local` over their meshes (experts: Shard(0) over ep, then over
edp when FSDP shards them further). Optimizer states get the wrapping of their parameter, so the
momentum of an expert shard is saved as that shard of the global momentum. DCP writes each piece
once and, on load, reads whatever pieces the new layout needs — a run saved on 4 ranks (any mix of
pp, dp, cp, ep) continues on 2 or on 1. Shadow indexers are not saved (owners are).

    save_distributed(par, folder, extra={"step": ...})     collective; extra (JSON) written by rank 0
    load_distributed(par, folder) -> extra                 collective; any layout
    load_single(model, optimizer, folder) -> extra         one process, no process group
    to_safetensors(folder, out, config)                    a `dsv41.checkpoint` directory (float format)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard

from dsv41.config import ModelConfig, load_config
from dsv41.model.transformer import Transformer
from dsv41.optim import CombinedOptimizer

EXTRA_FILE = "dsv41_extra.json"
CONFIG_FILE = "config.json"


def _wrapper(par, name: str, p: Tensor):
    """A function turning a tensor shaped like this rank's piece of parameter `name` into what DCP saves."""
    if isinstance(p, DTensor) or par is None:
        return lambda t: t
    dims = par.dims
    table = next((t for t in par.tables if t.weight is p), None)
    if table is not None:
        mesh = dims.fsdp_mesh
        shape = torch.Size((table.num_embeddings, table.embedding_dim))
        return lambda t: DTensor.from_local(t, mesh, [Shard(0)], run_check=False, shape=shape,
                                            stride=(shape[1], 1))
    experts = getattr(par.module.get_submodule(name.rsplit(".", 1)[0]), "global_experts", None)
    if experts is not None:
        mesh = dims.expert["ep"]
        shape = torch.Size((experts, *p.shape[1:]))
        stride = tuple(torch.empty(shape, device="meta").stride())
        return lambda t: DTensor.from_local(t, mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)
    return lambda t: t


def _expert_fsdp_wrapper(par, name: str, p: Tensor):
    """Experts sharded by FSDP over edp *and* by expert parallelism: DTensor over (ep, edp)."""
    experts = getattr(par.module.get_submodule(name.rsplit(".", 1)[0]), "global_experts", None)
    if experts is None or not isinstance(p, DTensor):
        return None
    mesh = par.dims.expert["ep", "edp"]
    shape = torch.Size((experts, *p.shape[1:]))
    stride = tuple(torch.empty(shape, device="meta").stride())
    return lambda t: DTensor.from_local(t.to_local() if isinstance(t, DTensor) else t, mesh, [Shard(0), Shard(0)],
                                        run_check=False, shape=shape, stride=stride)


def _wrappers(par, module: nn.Module) -> dict[str, Any]:
    out = {}
    for name, p in module.named_parameters():
        out[name] = (_expert_fsdp_wrapper(par, name, p) if par is not None else None) or _wrapper(par, name, p)
    return out


def _init_states(optimizer: CombinedOptimizer) -> None:
    """Create every optimizer state a step would create (zeros), so a load has tensors to fill."""
    for kind, opt in optimizer.optimizers.items():
        for group in opt.param_groups:
            for p in group["params"]:
                state = opt.state[p]
                if kind == "adamw":
                    state.setdefault("step", torch.zeros((), dtype=torch.float32))
                    state.setdefault("exp_avg", torch.zeros_like(p, memory_format=torch.preserve_format))
                    state.setdefault("exp_avg_sq", torch.zeros_like(p, memory_format=torch.preserve_format))
                else:
                    state.setdefault("momentum_buffer", torch.zeros_like(p, memory_format=torch.preserve_format))


def state_dict(module: nn.Module, optimizer: CombinedOptimizer, par=None) -> dict[str, Tensor]:
    """Flat {name: tensor} of weights ("model.<param>") and optimizer states ("optim.<kind>.<param>.<key>")."""
    wrap = _wrappers(par, module)
    names = {p: n for n, p in module.named_parameters()}
    out: dict[str, Tensor] = {f"model.{n}": wrap[n](p.detach()) for n, p in module.named_parameters()}
    _init_states(optimizer)
    for kind, opt in optimizer.optimizers.items():
        for group in opt.param_groups:
            for p in group["params"]:
                for key, value in opt.state[p].items():
                    if isinstance(value, Tensor):
                        full = value.dim() > 0
                        out[f"optim.{kind}.{names[p]}.{key}"] = wrap[names[p]](value) if full else value
    return out


def save_distributed(par, folder: str | Path, extra: dict[str, Any] | None = None) -> Path:
    """Collective: every rank writes its pieces; rank 0 adds the config and `extra` (JSON)."""
    folder = Path(folder)
    sd = state_dict(par.module, par.optimizer, par)
    dcp.save(sd, checkpoint_id=str(folder))
    if dist.get_rank() == 0:
        (folder / CONFIG_FILE).write_text(par.config.to_json() + "\n")
        (folder / EXTRA_FILE).write_text(json.dumps(extra or {}) + "\n")
    dist.barrier()
    return folder


def _read_extra(folder: Path) -> dict[str, Any]:
    path = folder / EXTRA_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def load_distributed(par, folder: str | Path) -> dict[str, Any]:
    """Collective: fill this layout's pieces of weights and optimizer states from `folder`."""
    folder = Path(folder)
    sd = state_dict(par.module, par.optimizer, par)
    dcp.load(sd, checkpoint_id=str(folder))
    _write_back(par.module, par.optimizer, sd, par)
    if par.pipeline is not None:
        par.pipeline.sync_shadows()
    return _read_extra(folder)


def load_single(model: Transformer, optimizer: CombinedOptimizer, folder: str | Path) -> dict[str, Any]:
    """One process, no process group: a single-device model and optimizer (`dsv41.optim.build_optimizer`)."""
    folder = Path(folder)
    sd = state_dict(model, optimizer)
    dcp.load(sd, checkpoint_id=str(folder), no_dist=True)
    _write_back(model, optimizer, sd)
    return _read_extra(folder)


@torch.no_grad()
def _write_back(module: nn.Module, optimizer: CombinedOptimizer, sd: dict[str, Tensor], par=None) -> None:
    """DCP loads in place; wrapped pieces share storage with their tensors, 0-d states are replaced."""
    names = {p: n for n, p in module.named_parameters()}
    for kind, opt in optimizer.optimizers.items():
        for group in opt.param_groups:
            for p in group["params"]:
                for key, value in list(opt.state[p].items()):
                    loaded = sd.get(f"optim.{kind}.{names[p]}.{key}")
                    if isinstance(value, Tensor) and value.dim() == 0 and loaded is not None:
                        opt.state[p][key] = loaded


def to_safetensors(folder: str | Path, out: str | Path, config: ModelConfig | None = None) -> Path:
    """A distributed checkpoint → a single-file `dsv41.checkpoint` directory (float format)."""
    from dsv41.checkpoint import save_checkpoint
    from dsv41.optim import build_optimizer

    folder = Path(folder)
    model = Transformer(config or load_config(folder / CONFIG_FILE))
    load_single(model, build_optimizer(model, 0.0), folder)
    return save_checkpoint(model, out)


def main(argv: list[str] | None = None) -> int:
    """`python -m dsv41.parallel.checkpoint CKPT OUT`: a distributed checkpoint → a single-file one."""
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="python -m dsv41.parallel.checkpoint", description=main.__doc__)
    p.add_argument("checkpoint", type=Path, help="a distributed checkpoint folder (ckpt-XXXXXX of a --parallel run)")
    p.add_argument("out", type=Path, help="output folder (config.json + model.safetensors)")
    args = p.parse_args(argv)
    if not (args.checkpoint / ".metadata").exists() or not (args.checkpoint / CONFIG_FILE).exists():
        print(f"error: {args.checkpoint} is not a distributed checkpoint (no .metadata / config.json)", file=sys.stderr)
        return 2
    print(to_safetensors(args.checkpoint, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
