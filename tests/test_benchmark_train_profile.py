"""benchmarks/train_profile.py's `--by-source` attribution: each kernel (CPU: each op) is charged to the dsv41
function whose forward made it and to its phase — checked on a hand-built event tree, where the answer is known,
and on a real `tiny` step on the CPU (every op's self time lands somewhere, the mHC Sinkhorn's backward lands on
the forward function that made it)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from benchmarks import train_profile

CPU = torch.autograd.DeviceType.CPU


def _ev(name, parent=None, stack=(), seq=-1, kernels_us=(), self_us=0.0):
    kernels = [SimpleNamespace(name="k", device=0, duration=d) for d in kernels_us]
    return SimpleNamespace(name=name, cpu_parent=parent, stack=list(stack), sequence_nr=seq, kernels=kernels,
                           device_type=CPU, self_cpu_time_total=self_us)


def test_frame_label_takes_the_innermost_dsv41_frame_and_its_caller():
    stack = ["<built-in function linear>", "torch/nn/modules/linear.py(130): forward",
             "/x/src/dsv41/model/attention.py(311): query", "torch/nn/modules/module.py(1782): _call_impl",
             "C:\\x\\dsv41\\model\\sparse_attention.py(254): attention_forward", "dsv41/model/transformer.py(1): f"]
    assert train_profile.frame_label(stack) == "model/attention.py:query < model/sparse_attention.py:attention_forward"
    assert train_profile.frame_label(["torch/x.py(1): f"]) is None
    assert train_profile.frame_label(["dsv41/a.py(3): g"]) == "a.py:g"


def test_kernels_are_charged_to_the_forward_source_their_autograd_node_came_from():
    fwd_parent = _ev("aten::linear", stack=["dsv41/model/mhc.py(39): mix", "dsv41/model/mhc.py(131): forward"], seq=7)
    fwd_op = _ev("aten::mm", parent=fwd_parent, seq=7, kernels_us=(1000.0, 500.0))  # no stack: its parent's
    other_fwd = _ev("aten::add", stack=["dsv41/model/moe.py(5): route"], seq=9, kernels_us=(250.0,))
    node = _ev("autograd::engine::evaluate_function: MmBackward0", seq=7)
    bwd_op = _ev("aten::mm", parent=node, kernels_us=(2000.0,))
    node9 = _ev("autograd::engine::evaluate_function: AddBackward0", seq=9)
    bwd_custom = _ev("aten::mul", parent=node9, stack=["dsv41/kernels/ref/x.py(2): backward"], kernels_us=(40.0,))
    orphan_node = _ev("autograd::engine::evaluate_function: Foo", seq=99)
    orphan = _ev("aten::mul", parent=orphan_node, stack=["dsv41/kernels/ref/y.py(2): backward"], kernels_us=(8.0,))
    opt = _ev("Optimizer.step#Muon.step")
    opt_op = _ev("aten::mm", parent=opt, stack=["dsv41/optim/muon.py(9): newton_schulz"], kernels_us=(300.0,))
    loose = _ev("aten::copy_", kernels_us=(10.0,))
    idle = _ev("aten::view", stack=["dsv41/model/mhc.py(1): view"])  # no kernels: not counted
    events = [fwd_parent, fwd_op, other_fwd, node, bwd_op, node9, bwd_custom, orphan_node, orphan, opt, opt_op,
              loose, idle]
    got = {k: (round(ms, 6), n) for k, (ms, n) in train_profile.attribute(events, cuda=True).items()}
    mhc = "model/mhc.py:mix < model/mhc.py:forward"
    assert got == {("forward", mhc): (1.5, 2), ("forward", "model/moe.py:route"): (0.25, 1),
                   ("backward", mhc): (2.0, 1),
                   ("backward", "model/moe.py:route"): (0.04, 1),  # the node's forward source, not its own stack
                   ("backward", "kernels/ref/y.py:backward"): (0.008, 1),  # no forward: its own stack
                   ("optimizer", "Muon.step · optim/muon.py:newton_schulz"): (0.3, 1),
                   ("other", "(other)"): (0.01, 1)}


@pytest.mark.slow
def test_a_cpu_step_by_source_charges_every_ops_time(tmp_path):
    rc = train_profile.main(["--device", "cpu", "--preset", "tiny", "--batch", "1", "--seq", "32", "--warmup", "1",
                             "--by-source", "--out", str(tmp_path)])
    assert rc == 0
    report = json.loads(next(tmp_path.glob("train_profile-*.json")).read_text())
    rows = report["by_source"]
    phases = {r["phase"] for r in rows}
    assert {"forward", "backward", "optimizer"} <= phases
    sources = {(r["phase"], r["source"]) for r in rows}
    assert any(ph == "backward" and src.startswith("model/mhc.py:") for ph, src in sources)
    assert any(ph == "optimizer" and "newton_schulz" in src for ph, src in sources)
    unmatched = sum(r["ms"] for r in rows if r["source"] == "(backward, unmatched)")
    assert unmatched < 0.2 * sum(r["ms"] for r in rows if r["phase"] == "backward")
