"""Post-training precision (`dtype`): "bf16" trains under bf16 autocast with fp32 master weights and samples
from a bf16 copy; "fp32" (the CPU default) keeps every forward fp32.

The 2026-12-04 H200 run trained SFT, RL and OPD in fp32 with fp32 rollout engines (no autocast anywhere):
6 s per 256-row SFT step. Claims checked on the CPU (autocast works there too):
  * each training forward (SFT, GRPO, OPD student and teacher) runs its matmuls in bf16 exactly when
    dtype is "bf16" (a hook on every Linear records the dtype it computed in);
  * the master weights and their gradients stay fp32, and the step moves them;
  * the rollout engine and the evaluation engine sample from a bf16 copy, and a weight update reaches the
    engine as the trainer's fp32 weights rounded to bf16, bit for bit (exact for the few the engine keeps in
    fp32: head, routers, compressors);
  * "auto" is bf16 on CUDA only; a bf16 SFT step's loss is the fp32 step's within bf16 rounding.
"""

from __future__ import annotations

import pytest
import torch

from dsv41 import load_config
from dsv41.config import ConfigError, resolve_dtype
from dsv41.model.transformer import Transformer
from dsv41.posttrain import common
from dsv41.posttrain.common import engine_copy
from dsv41.posttrain.grpo import EffortReward
from dsv41.posttrain.loop import AsyncLoop, LoopConfig, grpo_step, opd_step
from dsv41.posttrain.opd import Teachers
from dsv41.posttrain.sft import SFTConfig, train_sft
from dsv41.posttrain.tasks import generate
from dsv41.train.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(load_config("tiny")).init_weights(seed=seed)


class LinearDtypes:
    """The output dtypes of every Linear of `modules` while active (forward hooks)."""

    def __init__(self, *modules: torch.nn.Module):
        self.modules, self.seen, self.handles = modules, set(), []

    def __enter__(self):
        for m in self.modules:
            for sub in m.modules():
                if isinstance(sub, torch.nn.Linear):
                    self.handles.append(sub.register_forward_hook(lambda _m, _i, out: self.seen.add(out.dtype)))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def test_auto_is_bf16_on_cuda_only():
    assert resolve_dtype("auto", torch.device("cpu")) == "fp32"
    assert resolve_dtype("auto", torch.device("cuda")) == "bf16"
    assert resolve_dtype("bf16", torch.device("cpu")) == "bf16"
    assert resolve_dtype("fp32", torch.device("cuda")) == "fp32"
    with pytest.raises(ConfigError, match="unknown dtype"):
        resolve_dtype("fp16", torch.device("cpu"))


@pytest.mark.parametrize("dtype,want", [("bf16", {torch.bfloat16}), ("fp32", {torch.float32})])
def test_sft_forward_runs_in_the_requested_dtype_with_fp32_master_weights(tok, dtype, want):
    m = model()
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    cfg = SFTConfig(steps=1, batch_size=4, lr=1e-3, warmup=1, dtype=dtype)
    with LinearDtypes(m) as spy:
        losses = train_sft(m, tok, generate(["add"], 8, 2, seed=0), cfg)
    assert spy.seen == want and len(losses) == 1
    assert all(p.dtype == torch.float32 for p in m.parameters())
    assert any(not torch.equal(p, before[n]) for n, p in m.named_parameters())


def test_a_bf16_sft_loss_is_the_fp32_loss_within_bf16_rounding(tok):
    losses = {}
    for dtype in ("fp32", "bf16"):
        m = model(3)
        losses[dtype] = train_sft(m, tok, generate(["add", "copy"], 8, 2, seed=1),
                                  SFTConfig(steps=1, batch_size=8, lr=1e-9, warmup=1, dtype=dtype))[0]
    assert losses["bf16"] == pytest.approx(losses["fp32"], rel=1e-3)  # measured: 5e-5
    assert losses["bf16"] != losses["fp32"]  # the bf16 forward really ran


def loop_and_engine_weights(tok, dtype: str, step_kind: str):
    student = model(1)
    cfg = LoopConfig(steps=1, prompts_per_step=1, samples_per_effort=1, efforts=(25, 100), max_tokens=4,
                     max_in_flight=4, max_staleness=8, max_offpolicy=1.0, lr=1e-3, dtype=dtype,
                     reward=EffortReward(levels=(25, 100)))
    loop = AsyncLoop(student, tok, generate(["add"], 4, 2, seed=3), cfg)
    teacher = model(2)
    if step_kind == "grpo":
        step = grpo_step(student, tok, cfg)
    else:
        step = opd_step(student, tok, cfg, Teachers({"t0": teacher}, {"*": ["t0"]}))
    trained = []

    def train(samples, version):
        with LinearDtypes(student, teacher) as spy:
            out = step(samples, version)
        trained.append(spy.seen)
        return out

    loop.run(train)
    loop.close()
    return student, loop.engine.model, trained


@pytest.mark.parametrize("step_kind", ["grpo", "opd"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_rl_and_opd_train_in_the_dtype_and_the_engine_gets_the_weights_rounded(tok, dtype, step_kind):
    student, engine_model, trained = loop_and_engine_weights(tok, dtype, step_kind)
    want = torch.bfloat16 if dtype == "bf16" else torch.float32
    assert trained == [{want}]  # student (and teacher) forwards of the one update
    assert all(p.dtype == torch.float32 for p in student.parameters())
    mine = dict(engine_model.named_parameters())
    kept_fp32 = 0
    for name, p in student.named_parameters():
        e = mine[name]
        if e.dtype == torch.float32:  # fp32, or the few weights the engine multiplies in fp32 (head, routers, …)
            kept_fp32 += 1
            assert torch.equal(e, p.detach()), name
        else:
            assert dtype == "bf16" and e.dtype == torch.bfloat16, name
            assert torch.equal(e, p.detach().to(torch.bfloat16)), name  # the update, rounded, bit for bit
    assert dtype == "fp32" or kept_fp32 < len(mine) // 2


def test_evaluation_samples_from_a_bf16_copy(tok, monkeypatch):
    m = model(4)
    made = []
    real = common.engine_copy

    def spy(model, dtype="fp32"):
        copy = real(model, dtype)
        made.append(sum(p.numel() for p in copy.parameters() if p.dtype == torch.bfloat16)
                    / sum(p.numel() for p in copy.parameters()))
        return copy

    monkeypatch.setattr(common, "engine_copy", spy)
    out = common.evaluate(m, tok, generate(["add"], 2, 2, seed=5), (25,), max_tokens=3, dtype="bf16")
    assert len(made) == 1 and made[0] > 0.5 and out[25]["n"] == 2  # bf16 but the head, routers, compressors
    assert all(p.dtype == torch.float32 for p in m.parameters())  # the trainer's model is untouched
    assert {p.dtype for p in engine_copy(m).parameters()} == {torch.float32}
