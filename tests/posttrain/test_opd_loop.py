"""OPD in the time-sliced loop: a teacher switch mid-run keeps every in-flight sample and changes the target."""

from __future__ import annotations

import torch

from dsv41 import load_config
from dsv41.model.transformer import Transformer
from dsv41.posttrain.loop import AsyncLoop, LoopConfig, opd_step
from dsv41.posttrain.opd import Teachers
from dsv41.posttrain.tasks import generate
from dsv41.train.tokenizer import load_tokenizer


def test_teacher_switch_mid_run_keeps_in_flight_samples():
    torch.manual_seed(0)
    config = load_config("tiny")
    student = Transformer(config).init_weights(seed=0)
    models = {f"t{i}": Transformer(config).init_weights(seed=1 + i) for i in range(2)}
    teachers = Teachers(models, {"*": ["t0"]})
    tok = load_tokenizer()
    cfg = LoopConfig(steps=2, prompts_per_step=1, samples_per_effort=1, efforts=(25, 100), max_tokens=4,
                     max_in_flight=6, max_staleness=8, max_offpolicy=1.0, lr=1e-5)
    loop = AsyncLoop(student, tok, generate(["add", "copy"], 8, 2, seed=3), cfg)
    step = opd_step(student, tok, cfg, teachers)
    targets = []
    in_flight_at_switch = []

    def train(samples, version):
        out = step(samples, version)
        targets.append((teachers.active["*"][0], out["teacher_config"], out["dispatched_under"]))
        return out

    def on_step(n):
        if n == 1:
            in_flight_at_switch.extend(loop.rollouts.live)
            loop.config_version = teachers.switch({"*": ["t1"]})

    loop.run(train, on_step)
    loop.close()
    assert [t[0] for t in targets] == ["t0", "t1"]
    assert in_flight_at_switch  # samples were mid-generation when the teachers changed ...
    assert loop.counters.get("dropped_stale", 0) == 0 and loop.counters.get("dropped_early", 0) == 0
    assert 0 in targets[1][2]  # ... and the next step trained samples dispatched before the switch, against t1
