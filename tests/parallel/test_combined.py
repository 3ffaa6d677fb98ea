"""The CI test of issue 22 (gloo, CPU): one combination on 4 ranks — pipeline (2 stages, Reuse and Reindex
consumers after the cut, shadow indexers) × context parallelism (2 chunks) × expert parallelism (over the
chunk ranks) × FSDP2, Engram tables row-sharded — equal to single-device training for 2 steps (every loss,
gradient and parameter; a step from updated weights, MoE biases and optimizer states included); its
distributed checkpoint reloads on 2 ranks (dp=2: FSDP only) and on 1 process and continues the same loss
curve for 2 more steps (the single-device continuation: the combination's losses of steps 3 and 4 equal
single-device training from its checkpoint); the checkpoint converts to the single-file safetensors format.
The ranks fork from a server that imported torch and dsv41 once (`harness.fork_server`).

The single layouts (dp, ep, cp, pp alone) run with DSV41_PARALLEL_FULL=1 (tests/parallel/test_layouts.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tests.parallel.equality import run_layout
from tests.parallel.harness import fork_server, make_batches, make_model, reference_optimizer, reference_step, spawn
from tests.parallel.test_pipeline import check_shadows_after_step

COMBINED = "pp=2,cp=2,ep=2,cuts=5"
SAVED_AT, MORE = 2, 2  # steps before the checkpoint, steps after it
GLOBAL_MICRO = 2  # micro-batches per step (pp=2 · 1 dp rank; dp=2 · 1; one device · 2)


def _save(rank: int, world: int, folder: str) -> None:
    from dsv41.parallel.checkpoint import save_distributed

    par, *_ = run_layout(COMBINED, steps=SAVED_AT, after_step=check_shadows_after_step)
    assert par.pipeline.shadow_plan == [(4, 1)]
    assert bool(par.tables) == (par.dims.pp_rank == 0)  # the Engram layer (1) is on stage 0, its table sharded
    save_distributed(par, folder, extra={"step": SAVED_AT})
    curve = [par.train_step(_mine(par, s)).total for s in range(SAVED_AT, SAVED_AT + MORE)]
    if rank == 0:
        (Path(folder) / "curve.json").write_text(json.dumps(curve))
        print(f"{COMBINED}: equal single-device for {SAVED_AT} steps; saved; continued {curve}", flush=True)


def _mine(par, step: int) -> list[dict[str, torch.Tensor]]:
    batches = make_batches(100 + step, GLOBAL_MICRO)
    micro = GLOBAL_MICRO // par.dims.config.dp
    return batches[par.dims.dp_rank * micro:(par.dims.dp_rank + 1) * micro]


def _reload(rank: int, world: int, folder: str) -> None:
    from tests.parallel.harness import OPTIMIZER

    from dsv41.parallel import ParallelDims, Parallelize, parse_parallel
    from dsv41.parallel.checkpoint import load_distributed

    par = Parallelize(make_model(seed=1), ParallelDims.build(parse_parallel("dp=2")), **OPTIMIZER)  # other init
    extra = load_distributed(par, folder)
    assert extra["step"] == SAVED_AT
    expected = json.loads((Path(folder) / "curve.json").read_text())
    got = [par.train_step(_mine(par, s)).total for s in range(SAVED_AT, SAVED_AT + MORE)]
    for a, e in zip(got, expected):
        assert abs(a - e) <= 1e-5 * abs(e), f"reloaded at 2 ranks: loss {got} vs {expected}"
    if rank == 0:
        print(f"reloaded on 2 ranks (dp=2): {got}", flush=True)


# what every rank imports (torch, dsv41, the harness), loaded once by the fork server
PRELOAD = ["tests.parallel.equality", "dsv41.parallel", "dsv41.parallel.checkpoint", "dsv41.checkpoint"]


def test_combined_checkpoint_reshards(tmp_path: Path) -> None:
    from dsv41.checkpoint import load_checkpoint
    from dsv41.parallel.checkpoint import load_single, to_safetensors

    folder = str(tmp_path / "dcp")
    with fork_server(PRELOAD):
        spawn(_save, 4, folder, start_method="forkserver")
        spawn(_reload, 2, folder, start_method="forkserver")
    # one process, no process group: the single-device model and optimizer continue the curve
    model, expected = make_model(seed=2), json.loads((Path(folder) / "curve.json").read_text())
    optimizer = reference_optimizer(model)
    assert load_single(model, optimizer, folder)["step"] == SAVED_AT
    got = [reference_step(model, optimizer, make_batches(100 + s, GLOBAL_MICRO))["total"]
           for s in range(SAVED_AT, SAVED_AT + MORE)]
    for a, e in zip(got, expected):
        assert abs(a - e) <= 1e-5 * abs(e), f"reloaded on one device: loss {got} vs {expected}"
    # conversion: the single-file checkpoint holds the saved weights
    out = to_safetensors(folder, tmp_path / "single")
    assert (out / "model.safetensors").exists()
    converted, fresh = load_checkpoint(out), make_model(seed=3)
    load_single(fresh, reference_optimizer(fresh), folder)
    for name, p in fresh.state_dict().items():
        assert torch.equal(converted.state_dict()[name], p), name
