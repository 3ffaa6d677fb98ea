"""`EngineStats.host_s`: where a decode step's wall time goes (schedule, prepare, launch, sample, emit). Each
phase times the code it names — a forward made 20 ms slower shows up in `launch`, a slower sampler in `sample`
— and the phases never add up to more than the steps' wall time."""

from __future__ import annotations

import time

import torch
from tests.conftest import engine_test_model

import dsv41.engine.engine as engine_module
from dsv41.engine.engine import Engine
from dsv41.engine.sampling import SamplingParams

PHASES = {"schedule", "prepare", "launch", "sample", "emit"}


def _decoding_engine(seed: int) -> Engine:
    engine = Engine(engine_test_model(seed), max_batch=4)
    g = torch.Generator().manual_seed(seed)
    for n in (5, 40, 90):
        engine.add_request(torch.randint(3, 1000, (n,), generator=g).tolist(), SamplingParams(max_tokens=40))
    while any(s.prefilling or s.next_token is None for s in engine.running) or engine.waiting:
        engine.step()
    engine.stats.host_s.clear()
    return engine


def test_phases_cover_the_step_and_never_exceed_its_wall_time():
    engine = _decoding_engine(71)
    steps = 6
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = time.perf_counter() - t0
    host = engine.stats.host_s
    assert set(host) == PHASES and all(v >= 0 for v in host.values()), host
    assert sum(host.values()) <= wall
    assert sum(host.values()) > 0.5 * wall  # the phases are most of the step (the rest: loop glue)
    per_step = engine.phase_ms(steps)
    assert all(abs(per_step[k] - host[k] * 1e3 / steps) < 1e-9 for k in PHASES)


def test_a_slower_forward_shows_in_launch_and_a_slower_sampler_in_sample(monkeypatch):
    engine = _decoding_engine(72)
    decode, sample = engine.runner.decode, engine_module.sample

    def slow_decode(*args, **kwargs):
        time.sleep(0.02)
        return decode(*args, **kwargs)

    def slow_sample(*args, **kwargs):
        time.sleep(0.03)
        return sample(*args, **kwargs)

    engine.runner.decode = slow_decode
    monkeypatch.setattr(engine_module, "sample", slow_sample)
    steps = 3
    for _ in range(steps):
        engine.step()
    host = engine.stats.host_s
    assert host["launch"] >= 0.02 * steps and host["sample"] >= 0.03 * steps, host
    assert host["prepare"] < 0.02 * steps and host["emit"] < 0.03 * steps and host["schedule"] < 0.02 * steps, host
