"""A training step replayed from a CUDA graph (`TrainConfig.cuda_graphs`, `train_peer.py --cuda-graphs`).

Key idea: `small`'s eager step is thousands of small kernels (forward, backward, optimizer); wherever the host that
launches them one by one is slower than the GPU that runs them, the step waits on the host. The step is sync-free
and its shapes follow from the batch shape (tests/train/test_graphs.py checks both on the CPU), so the whole of it —
forward, backward, MoE bias update, gradient clip, optimizer, zeroing — can be captured once into a CUDA graph and
replayed with the next batch copied into the captured input buffers: one launch per step (PyTorch's "whole-network
capture").

What the capture needs and where it comes from:
- every buffer that outlives a step exists before the capture (optimizer momenta and AdamW's step counters, created by
  eager warm-up steps — real training steps of the run — on a side stream, as `torch.cuda.graphs` asks);
- nothing host-side changes inside it between steps: the learning rate is a 0-d device tensor per parameter group
  that the schedule fills in place (`tensor_lrs`, `optim.schedule.LRSchedule.apply`; Muon and SinkhornBalanced take
  a tensor lr, AdamW runs `capturable`);
- anything that does change the computation (the batch shape under the sequence-length schedule, QAT switching on,
  replay simulation's input being present) is part of the graph's key: a new key runs `warmup` eager steps, then
  captures; only the newest graph is kept (its memory pool is released with the old one);
- outputs are the captured tensors, overwritten by the next replay: a caller that keeps them clones them.

On the CPU (and without CUDA) the step runs eagerly: the same function, called directly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import Tensor

log = logging.getLogger(__name__)

WARMUP_STEPS = 2  # eager steps per new key before its capture (lazy state, Triton / cuBLAS choices)


def tensor_lrs(optimizer: Any, device: torch.device) -> None:
    """Every parameter group's lr as a 0-d fp32 tensor on `device` (in place from then on: a captured step reads
    it where it was captured), and AdamW's `capturable` on, so that its step counter stays on the device. torch's
    Adam(W) is capturable on CUDA only: on other devices its groups keep numbers (the CPU tests of the tensor lr)."""
    for opt in getattr(optimizer, "optimizers", {"": optimizer}).values():
        adam = isinstance(opt, torch.optim.AdamW | torch.optim.Adam)
        if adam and device.type != "cuda":
            continue
        for group in opt.param_groups:
            if not isinstance(group["lr"], Tensor):
                group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)
            if adam:
                group["capturable"] = True
                group["foreach"] = True


def tree_map(fn: Callable[[Tensor], Any], obj: Any) -> Any:
    """fn over every tensor of nested dicts / lists / tuples (other leaves as they are)."""
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: tree_map(fn, v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(tree_map(fn, v) for v in obj)
    return obj


class StepGraph:
    """`fn(**inputs)` (keyword tensors, or None) replayed from a CUDA graph per key.

    `__call__(inputs, key)`: the key is the caller's (QAT on, ...) plus every input's shape and dtype (and which are
    None). The first `warmup` calls of a key run `fn` eagerly on a side stream; the next captures it on copies of
    its inputs and replays it; later calls copy their inputs into the captured ones and replay. The returned
    structure is the captured outputs (overwritten by the next replay). `enabled=False` (the CPU): `fn` directly.
    A capture that fails (an op that cannot be captured) leaves a warning and `error`, calls `reset` (a training
    step's: drop the gradients the aborted capture assigned) and runs `fn` eagerly, now and from then on.
    """

    def __init__(self, fn: Callable[..., Any], *, enabled: bool, warmup: int = WARMUP_STEPS,
                 reset: Callable[[], None] | None = None):
        if warmup < 1:
            raise ValueError(f"StepGraph needs at least one eager warm-up step per key, got warmup={warmup}")
        self.fn, self.enabled, self.warmup, self.reset = fn, enabled, warmup, reset
        self.error: str | None = None  # why a capture failed (the step runs eagerly from then on)
        self.key: Hashable | None = None  # the key of the graph held (None: none)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static: dict[str, Tensor | None] = {}
        self.out: Any = None
        self.eager_calls: dict[Hashable, int] = {}
        self.captures = 0
        self.replays = 0

    @staticmethod
    def _signature(inputs: dict[str, Tensor | None]) -> tuple:
        return tuple((name, None if t is None else (tuple(t.shape), t.dtype, t.device))
                     for name, t in sorted(inputs.items()))

    def __call__(self, inputs: dict[str, Tensor | None], key: Hashable = ()) -> Any:
        if not self.enabled:
            return self.fn(**inputs)
        full = (key, self._signature(inputs))
        if full != self.key:
            done = self.eager_calls.get(full, 0)
            if done < self.warmup:
                self.eager_calls[full] = done + 1
                return self._eager(inputs)
            try:
                self._capture(full, inputs)
            except RuntimeError as err:  # something in fn cannot be captured: eager from now on, said once
                self.enabled, self.error = False, f"{type(err).__name__}: {err}"
                self.drop()
                log.warning("StepGraph: the CUDA-graph capture failed (%s); the step runs eagerly", self.error)
                torch.cuda.synchronize()
                if self.reset is not None:  # what the aborted capture left behind (its gradients, say)
                    self.reset()
                return self.fn(**inputs)
        for name, t in inputs.items():
            if t is not None:
                self.static[name].copy_(t, non_blocking=True)
        self.graph.replay()
        self.replays += 1
        return self.out

    def drop(self) -> None:
        """Forget the graph and the warm-ups: the next calls warm up and capture again. For when what the step reads
        was replaced rather than written in place (an optimizer's state and lrs after `load_state_dict`)."""
        self.graph = self.out = self.key = None
        self.static = {}
        self.eager_calls.clear()

    def _eager(self, inputs: dict[str, Tensor | None]) -> Any:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = self.fn(**inputs)
        torch.cuda.current_stream().wait_stream(side)
        return out

    def _capture(self, full: Hashable, inputs: dict[str, Tensor | None]) -> None:
        self.graph = self.out = None  # the old graph's pool goes first (its warm-up counts stay)
        self.static = {name: None if t is None else t.clone() for name, t in inputs.items()}
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self.fn(**self.static)
        self.graph, self.out, self.key = graph, out, full
        self.captures += 1
