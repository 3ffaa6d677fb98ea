"""The CUDA-graphed training step (train/graphs.py, `TrainConfig.cuda_graphs`): what the capture relies on, checked
on the CPU — the step's device work makes no host sync (model, Muon, Sinkhorn, clip, MoE bias update), Muon and
SinkhornBalanced take a tensor lr with the same result as a number, the schedule fills a tensor lr in place, a new
key runs eagerly before its capture — and on the GPU: graphed training = eager training."""

from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
import torch
from tests.train.test_trainer import tiny

from dsv41.config import ConfigError
from dsv41.model.transformer import Transformer
from dsv41.optim import LRSchedule, build_optimizer
from dsv41.testing.sync import HostSyncError, NoSyncMode
from dsv41.train.graphs import StepGraph, tensor_lrs, tree_map
from dsv41.train.trainer import MICRO_INPUTS, TrainConfig, Trainer, read_metrics, replay_window_start


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tokcache")


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_muon_and_sinkhorn_take_a_tensor_lr_with_the_result_of_a_number():
    """Two optimizer steps of a tiny model from the same gradients: lrs as 0-d tensors (the graphed step's) vs
    numbers — every parameter within fp32 rounding; a wrong sign or a dropped lr would move them by ~lr."""
    from dsv41 import load_config

    c = load_config("tiny")
    runs = []
    for as_tensor in (False, True):
        torch.manual_seed(0)
        model = Transformer(c).init_weights(seed=0)
        opt = build_optimizer(model, lr=3e-3)
        if as_tensor:
            tensor_lrs(opt, torch.device("cpu"))
            groups = [g for name in ("muon", "sinkhorn") for g in opt[name].param_groups]
            assert groups and all(isinstance(g["lr"], torch.Tensor) for g in groups)
        g = torch.Generator().manual_seed(1)
        for _ in range(2):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
        runs.append(_params(model))
    start = _params(Transformer(c).init_weights(seed=0))
    for name, ref in runs[0].items():
        moved = (ref - start[name]).abs().max().item()
        err = (runs[1][name] - ref).abs().max().item()
        assert err <= 1e-6 * max(1.0, ref.abs().max().item()), (name, err, moved)
    assert sum((runs[1][n] - start[n]).abs().max().item() > 1e-4 for n in start) > 10  # the steps moved things


def test_the_schedule_fills_a_tensor_lr_in_place():
    model = torch.nn.Linear(4, 4, bias=False)
    opt = torch.optim.SGD([{"params": model.parameters(), "lr": 1.0, "lr_mult": 5.0}], lr=1.0)
    lr = torch.tensor(0.0)
    opt.param_groups[0]["lr"] = lr
    sched = LRSchedule(peak=2e-3, final=2e-4, warmup_tokens=0, constant_until_tokens=100, decay_until_tokens=200)
    base = sched.apply(opt, 150)
    assert opt.param_groups[0]["lr"] is lr  # the captured tensor, not a new number
    assert math.isclose(lr.item(), 5.0 * base, rel_tol=1e-6) and math.isclose(base, sched.lr_at(150))


def test_the_device_step_makes_no_host_sync(tmp_path, cache_dir):
    """The trainer's device work of a step (forward, backward, MoE bias update, clip, Muon, Sinkhorn, zeroing) under
    NoSyncMode, with replay simulation on and two micro-batches: nothing reads the device from the host (AdamW is
    torch's and runs `capturable` on CUDA; its CPU path reads its step counter, so it sits this one out)."""
    tr = Trainer(tiny(tmp_path, cache_dir, steps=3, replay_sim=True, grad_accum=2))
    tr.train_step()  # optimizer state exists, as after the graphed step's warm-up
    adamw = tr.optimizer.optimizers.pop("adamw")
    assert adamw.param_groups
    inputs = {}
    for micro in range(2):
        batch = next(tr._batches)
        for name in MICRO_INPUTS[:-1]:
            inputs[f"{name}_{micro}"] = batch[name]
        rng = np.random.default_rng([0, 9, micro])
        inputs[f"window_start_{micro}"] = replay_window_start(*batch["tokens"].shape, 0.5, rng)
    before = _params(tr.model)
    with NoSyncMode():
        sums, grad_norm, n_targets, loads = tr._device_step(**inputs)
    assert torch.isfinite(sums).all() and grad_norm > 0 and n_targets > 0 and loads
    assert any(not torch.equal(p, before[n]) for n, p in tr.model.named_parameters())
    with pytest.raises(HostSyncError):  # the check itself: a host read in the step is caught
        with NoSyncMode():
            tr._device_step(**inputs)[1].item()


def test_a_step_graph_runs_its_function_directly_when_disabled_and_refuses_no_warmup():
    calls = []
    graph = StepGraph(lambda x: calls.append(x) or x * 2, enabled=False)
    assert torch.equal(graph({"x": torch.ones(2)}), torch.full((2,), 2.0)) and len(calls) == 1
    with pytest.raises(ValueError, match="warm-up"):
        StepGraph(lambda: None, enabled=True, warmup=0)
    assert tree_map(lambda t: t + 1, {"a": [torch.zeros(1)], "b": 3})["a"][0].item() == 1


def _fake_cuda_graphs(monkeypatch, graph: StepGraph) -> None:
    """CUDA graphs on the CPU for StepGraph's bookkeeping: the capture runs fn once (as the real one records it),
    a replay runs fn again on the captured inputs and writes the captured output in place."""
    class FakeGraph:
        def replay(self) -> None:
            graph.out.copy_(graph.fn(**graph.static))

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda g: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(graph, "_eager", lambda inputs: graph.fn(**inputs))


def test_a_step_graph_captures_per_key_after_its_warmup_and_keeps_the_newest(monkeypatch):
    """Per key (the caller's + every input's shape): `warmup` eager calls, then a capture and replays that read the
    new inputs; another shape or caller key warms up and captures again, and only the newest graph is held."""
    shapes = []
    graph = StepGraph(lambda x: shapes.append(tuple(x.shape)) or x * 2, enabled=True, warmup=1)
    _fake_cuda_graphs(monkeypatch, graph)
    assert graph({"x": torch.ones(2)}).tolist() == [2.0, 2.0] and graph.captures == 0  # warm-up, eager
    out = graph({"x": torch.full((2,), 3.0)})
    assert out.tolist() == [6.0, 6.0] and (graph.captures, graph.replays) == (1, 1)
    assert graph({"x": torch.full((2,), 5.0)}) is out and out.tolist() == [10.0, 10.0]  # a replay, new inputs
    assert graph({"x": torch.ones(3)}).tolist() == [2.0] * 3 and graph.captures == 1  # a new shape: eager first
    assert graph({"x": torch.ones(3)}).tolist() == [2.0] * 3 and graph.captures == 2
    assert graph({"x": torch.ones(3)}, key=True).tolist() == [2.0] * 3 and graph.captures == 2  # a new caller key
    assert graph({"x": torch.full((2,), 4.0)}).tolist() == [8.0, 8.0] and graph.captures == 3  # warmed up: capture
    assert graph.replays == 4 and shapes.count((3,)) == 4  # eager, capture, replay, eager
    graph.drop()  # what the step reads was replaced: warm up and capture again
    assert graph({"x": torch.full((2,), 4.0)}).tolist() == [8.0, 8.0] and graph.captures == 3
    assert graph({"x": torch.full((2,), 4.0)}).tolist() == [8.0, 8.0] and graph.captures == 4


def test_loading_a_checkpoint_drops_the_captured_step(tmp_path, cache_dir):
    """`Trainer.load` replaces the optimizer's state and lrs (new tensors): a graph captured before would go on
    reading the old ones, so the load drops it and the next steps warm up and capture again."""
    tr = Trainer(tiny(tmp_path, cache_dir, steps=2))
    tr.train_step()
    folder = tr.save()
    tr._step_graph.key, tr._step_graph.eager_calls["k"] = "held", 2  # as after a capture
    tr.load(folder)
    assert tr._step_graph.key is None and not tr._step_graph.eager_calls


def test_a_failed_capture_resets_and_runs_eagerly_from_then_on(monkeypatch, caplog):
    """The key's warm-up calls run eagerly, the capture that follows fails (an op that cannot be captured): `reset`
    runs (the training step's: the aborted capture's gradients), then the same call eagerly, with a warning and the
    error kept; every later call runs `fn` directly."""
    calls, resets = [], []
    graph = StepGraph(lambda x: calls.append(x.item()) or x + 1, enabled=True, warmup=2,
                      reset=lambda: resets.append(len(calls)))
    monkeypatch.setattr(graph, "_eager", lambda inputs: graph.fn(**inputs))  # the CPU has no side stream
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    def refuse(full, inputs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graph, "_capture", refuse)
    outs = [graph({"x": torch.tensor(float(i))}).item() for i in range(5)]
    assert outs == [1.0, 2.0, 3.0, 4.0, 5.0] and calls == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert resets == [2] and not graph.enabled and "not permitted" in graph.error
    assert graph.captures == 0 and graph.replays == 0
    assert any("capture failed" in r.message for r in caplog.records)


def test_cuda_graphs_needs_cuda_and_no_compile(tmp_path, cache_dir):
    with pytest.raises(ConfigError, match="cuda_graphs"):
        TrainConfig(preset="tiny", cuda_graphs=True, compile=True)
    with pytest.raises(ConfigError, match="cuda_graphs"):
        TrainConfig(preset="tiny", cuda_graphs=True, parallel="dp=2")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="needs a CUDA device"):
            Trainer(tiny(tmp_path, cache_dir, steps=2, cuda_graphs=True))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gpu_graphed_training_equals_eager(tmp_path, cache_dir, dtype):
    """8 steps of `tiny` with a learning-rate schedule, two micro-batches and replay simulation, three times with
    the same graphed-step configuration (tensor lrs, capturable AdamW, no autocast cast cache): twice never captured
    (every call eager: the device's run-to-run noise) and once replayed from the CUDA graph after 2 warm-up steps:
    every step's loss within a few times the two eager runs' difference plus a rounding floor — each replayed step
    trains on its own batch (a graph that kept reading the captured batch or lr would leave the losses).

    Weights are compared one step at a time (the next test): after 8 steps two *eager* runs already differ by
    up to 1.5× a tensor's largest value (H100, 2026-12-07: fp32 `hc_attn_fn`, Adam amplifying atomics' noise where
    a gradient is near zero; `gate.bias` moving by whole sign steps), so final weights tell nothing apart. Losses
    measured then: eager vs eager up to 3e-5 (fp32) / 7e-4 (bf16), replayed vs eager up to 1.5e-4 / 1.1e-3."""
    def train(name: str, capture: bool):
        kw = dict(steps=8, device="cuda", dtype=dtype, grad_accum=2, replay_sim=True, cuda_graphs=True)
        tr = Trainer(tiny(tmp_path / name, cache_dir, **kw))
        if not capture:
            tr._step_graph.warmup = 10**9  # the same step function, every call eager on the side stream
        tr.run()
        losses = [r["loss"] for r in read_metrics(tr.out / "metrics.jsonl") if r["type"] == "train"]
        return losses, tr._step_graph

    (a, ga), (b, _), (g, gg) = train("a", False), train("b", False), train("g", True)
    assert ga.captures == 0 and gg.captures == 1 and gg.replays == 6 and gg.error is None
    assert len(a) == len(b) == len(g) == 8
    floor = 5e-5 if dtype == "fp32" else 2e-4  # of the loss: 3x / 1.7x the largest replayed-vs-eager difference
    noise = max(abs(x - y) for x, y in zip(a, b))
    for x, y in zip(a, g):
        assert abs(x - y) <= 4 * noise + floor * abs(x), (a, b, g)


def _step_state(tr: Trainer) -> list[torch.Tensor]:
    """Every tensor a training step writes: the model's parameters and buffers, the optimizers' state."""
    out = list(tr.model.state_dict(keep_vars=True).values())
    for opt in getattr(tr.optimizer, "optimizers", {"": tr.optimizer}).values():
        for st in opt.state.values():
            out += [v for v in st.values() if isinstance(v, torch.Tensor)]
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gpu_a_replayed_training_step_is_the_eager_step(tmp_path, cache_dir, dtype):
    """One step from one state: after 4 graphed steps of `tiny` (2 eager warm-ups, the capture), the state is
    saved; the captured step replayed once, then — from the saved state again — the same step function run eagerly
    on the same inputs, twice. Loss sums, the grad norm and every written tensor (weights, MoE biases, optimizer
    momenta and counters) of the replay are within 4× the two eager runs' difference plus a floor: 1e-3 (fp32) /
    2e-2 (bf16) of the step's own change of that tensor — a graph that replayed a stale lr or skipped a write is off
    by about the whole change."""
    kw = dict(steps=4, device="cuda", dtype=dtype, grad_accum=2, replay_sim=True, cuda_graphs=True)
    tr = Trainer(tiny(tmp_path, cache_dir, **kw))
    tr.run()
    sg = tr._step_graph
    assert sg.captures == 1 and sg.replays == 2 and sg.error is None
    state = _step_state(tr)
    saved = [t.detach().clone() for t in state]

    def from_saved(step):
        with torch.no_grad():
            for t, s0 in zip(state, saved):
                t.copy_(s0)
        out = tree_map(torch.clone, step())
        torch.cuda.synchronize()
        return out, [t.detach().clone() for t in state]

    (g_sums, g_norm, _, _), g = from_saved(lambda: (sg.graph.replay(), sg.out)[1])
    (e_sums, e_norm, _, _), e = from_saved(lambda: sg._eager(sg.static))
    (e2_sums, e2_norm, _, _), e2 = from_saved(lambda: sg._eager(sg.static))
    floor = 1e-3 if dtype == "fp32" else 2e-2
    for got, want, again in ((g_sums, e_sums, e2_sums), (g_norm, e_norm, e2_norm)):
        assert (got - want).abs().max() <= 4 * (again - want).abs().max() + 1e-6 * want.abs().max(), (got, want)
    changed = 0
    for i, (t0, tg, te, te2) in enumerate(zip(saved, g, e, e2)):
        if not t0.is_floating_point():
            assert torch.equal(tg, te), i
            continue
        step = (te.double() - t0.double()).norm()
        changed += bool(step > 0)
        off, noise = (tg.double() - te.double()).norm(), (te2.double() - te.double()).norm()
        assert off <= 4 * noise + floor * step, (i, tuple(t0.shape), float(off), float(noise), float(step))
    assert changed > len(tr.params)  # weights and optimizer state moved
