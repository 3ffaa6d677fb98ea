"""Multi-process CPU (gloo) harness: spawn ranks, a tiny model, random packed batches, the single-device
reference step, and full gradients / parameters gathered from any layout.

Every rank computes the single-device reference itself (the model is tiny) and compares what it holds:
its stage's parameters, gathered over FSDP / expert / Engram shards. A failing rank raises; the spawn
in the parent re-raises with the rank's traceback.
"""

from __future__ import annotations

import math
import multiprocessing.forkserver as forkserver
import os
import socket
import traceback
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tests.conftest import assert_close, randomize_mixing

from dsv41 import load_config
from dsv41.model.moe import update_moe_biases
from dsv41.model.transformer import Transformer
from dsv41.optim import build_optimizer

T, B = 32, 2  # sequence length, rows per micro-batch


def tiny_config(**changes):
    """`tiny` with a small vocabulary and window and selective top-k / candidates (T = 32 keeps them busy)."""
    return load_config("tiny").replace(vocab_size=256, window_size=8, index_topk=4, candidate_topk_blocks=2,
                                       candidate_block_size=4, **changes)


def make_model(seed: int = 0, **changes) -> Transformer:
    model = Transformer(tiny_config(**changes)).init_weights(seed=seed)
    randomize_mixing(model, seed)
    return model.train()


def make_batches(seed: int, n: int, rows: int = B, seq: int = T, vocab: int = 256) -> list[dict[str, torch.Tensor]]:
    """n micro-batches of packed rows: 1–3 documents per row, a few masked targets."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        tokens = torch.randint(3, vocab, (rows, seq), generator=g)
        doc_ids = torch.zeros(rows, seq, dtype=torch.long)
        for r in range(rows):
            for cut in torch.randint(1, seq, (int(torch.randint(0, 3, (1,), generator=g)),), generator=g).tolist():
                doc_ids[r, cut:] += 1
        loss_mask = torch.rand(rows, seq, generator=g) > 0.1
        out.append({"tokens": tokens, "targets": torch.randint(0, vocab, (rows, seq), generator=g),
                    "doc_ids": doc_ids, "loss_mask": loss_mask})
    return out


# ---------------------------------------------------------------------- single-device reference
def reference_step(model: Transformer, optimizer, batches, grad_clip: float = 1.0, step: bool = True) -> dict:
    """The Trainer's step on one device: accumulate over `batches`, bias step from summed loads, clip, step."""
    loads: dict = {}
    sums = torch.zeros(4)
    for b in batches:
        losses = model.losses(b["tokens"], b["targets"], doc_ids=b["doc_ids"], loss_mask=b["loss_mask"],
                              window_start=b.get("window_start"))
        (losses.total / len(batches)).backward()
        sums += torch.stack([losses.lm, losses.indexer, losses.balance, losses.total]).detach()
        for layer in model.layers:
            acc = loads.setdefault(f"layers.{layer.layer_id}.ffn", {k: torch.zeros_like(v)
                                                                     for k, v in layer.ffn.last_load.items()})
            for k, v in layer.ffn.last_load.items():
                acc[k] += v
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    out = dict(zip(("lm", "indexer", "balance", "total"), (sums / len(batches)).tolist()), grads=grads, loads=loads)
    if step:
        out.update(reference_finish(model, optimizer, loads, grad_clip))
    return out


def reference_finish(model: Transformer, optimizer, loads: dict, grad_clip: float = 1.0) -> dict:
    """The rest of the Trainer's step, from the gradients in .grad: bias step, clipping, optimizer step."""
    update_moe_biases(model, loads)
    clip = grad_clip if grad_clip > 0 else math.inf
    norm = float(torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"grad_norm": norm}


# AdamW's ε = 1e-20 turns a rounding-noise gradient (|g| ≈ 1e-16, measured on hc_attn_fn entries) into a
# full ±lr step whose sign no two summation orders agree on; multi-step comparisons use ε = 1e-8.
# Newton–Schulz runs in fp64 in the multi-step checks (tests/parallel/equality.py says why).
OPTIMIZER = dict(lr=3e-3, adam_eps=1e-8, ns_dtype=torch.float64)


def reference_optimizer(model: Transformer):
    return build_optimizer(model, **OPTIMIZER)


# ---------------------------------------------------------------------- gathering
def gather_full(par, name: str, t: torch.Tensor) -> torch.Tensor:
    """The whole single-device tensor of parameter `name` (or its grad) held in pieces by this layout.
    Collective within the groups holding it: call in the same order on every rank of the stage."""
    from torch.distributed.tensor import DTensor

    from dsv41.parallel.engram import ShardedEngramTable

    if isinstance(t, DTensor):
        t = t.full_tensor()
    dims = par.dims
    if ".ffn.experts.w" in name and dims.config.ep > 1:
        parts = [torch.empty_like(t) for _ in range(dims.config.ep)]
        dist.all_gather(parts, t.contiguous(), group=dims.ep_group)
        t = torch.cat(parts)
    if name.endswith("engram.embed.weight") and par.tables:
        table: ShardedEngramTable = par.tables[0]
        pad = torch.zeros(table.rows_per_rank, t.shape[1], dtype=t.dtype)
        pad[:t.shape[0]] = t
        parts = [torch.empty_like(pad) for _ in range(table.size)]
        dist.all_gather(parts, pad, group=table.group)
        t = torch.cat(parts)[:table.num_embeddings]
    return t


def compare_params(par, reference: Transformer, what: str, grads: dict | None = None, rtol=1e-5, atol=1e-6,
                   exact: bool = False, norm_rtol: float = 0.0) -> int:
    """Compare every parameter (or gradient, when `grads` = reference grads) this rank's stage holds:
    elementwise (rtol, atol), bitwise (`exact`) or, with `norm_rtol`, by ‖a − e‖ ≤ norm_rtol·‖e‖ per tensor."""
    ref_params = dict(reference.named_parameters())
    n = 0
    worst = (0.0, "")
    for name, p in par.named_parameters().items():
        if grads is not None:
            if not p.requires_grad:
                continue
            mine = gather_full(par, name, p.grad if p.grad is not None else torch.zeros_like(p))
            expected = grads.get(name, torch.zeros_like(ref_params[name]))
        else:
            mine = gather_full(par, name, p.detach())
            expected = ref_params[name].detach()
        if exact:
            assert torch.equal(mine, expected), f"{what} {name} differs"
        elif norm_rtol:
            err = ((mine.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)).item()
            worst = max(worst, (err, name))
            assert err <= norm_rtol, f"{what} {name}: relative L2 error {err:.3e} > {norm_rtol}"
        else:
            assert_close(mine, expected, rtol=rtol, atol=atol, what=f"{what} {name}")
        n += 1
    if os.environ.get("DSV41_PARALLEL_DEBUG") and norm_rtol:
        print(f"{what}: worst relative L2 error {worst[0]:.2e} ({worst[1]})", flush=True)
    return n


# ---------------------------------------------------------------------- spawning
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()


def spawn(fn, world: int, *args, start_method: str = "spawn") -> None:
    """Run fn(rank, world, *args) on `world` gloo ranks (fn must be importable: a module-level function);
    start_method "forkserver" forks them from the server `fork_server` preloaded."""
    mp.start_processes(_entry, args=(world, free_port(), fn, args), nprocs=world, join=True,
                       start_method=start_method)


@contextmanager
def fork_server(preload: list[str]) -> Iterator[None]:
    """Inside, ranks spawned with start_method="forkserver" fork from one server that imported `preload` once
    (by importable names: the server does not take the parent's sys.path, so pytest's names for test modules are
    skipped). Spawned, each rank imports torch and dsv41 itself (~5 s of CPU on the 2-core CI box) and tears its
    interpreter down at exit: more than the training a short test runs. A server started earlier without the
    preload is stopped first (the preload only applies at start; `_stop` is the stdlib's own, private), and this
    one afterwards."""
    server = forkserver._forkserver
    before = server._preload_modules
    server._stop()
    forkserver.set_forkserver_preload(preload)
    try:
        yield
    finally:
        server._stop()
        forkserver.set_forkserver_preload(before)
