"""The time-sliced RL / OPD loop on one device: rollouts on the engine, training pre-empting them (SPEC §8).

Key idea: one process owns the device. It steps the rollout engine (`rollout.Rollouts`) and, as soon as enough
finished prompt groups satisfy the off-policy cap (`rollout.select_groups`), interrupts every running sample at
its current token, takes one optimizer step on the chosen groups, copies the new weights into the engine's
model in place and resumes the samples where they stopped (no prefill). The dispatcher (`rollout.Dispatcher`)
decides when new prompts start; "batch" dispatch with the same loop is the synchronous baseline (every group
of a step sampled by one policy version, the engine idle while the last long sample finishes).
The loss is pluggable: `grpo_step` (the effort-length reward, sub-group advantages) or `opd_step` (reverse KL).
Metrics (JSONL, one record per optimizer step): reward, accuracy and reasoning length per effort level,
off-policy ratio, masked stale tokens, rollout concurrency, samples/s.
"""

from __future__ import annotations

import itertools
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from dsv41.engine.engine import Engine
from dsv41.model.transformer import Transformer
from dsv41.posttrain.common import Metrics, autocast, engine_copy, optimizer_for, set_lr
from dsv41.posttrain.grpo import ClipConfig, EffortReward, grpo_loss, subgroup_advantages, token_logprobs
from dsv41.posttrain.opd import Teachers
from dsv41.posttrain.rollout import (
    Dispatcher,
    Group,
    Rollouts,
    Sample,
    offpolicy_ratio,
    replay_routing,
    select_groups,
    training_batch,
)
from dsv41.posttrain.tasks import END_TURN_ID, Problem, prompt_ids, reasoning_length, verify
from dsv41.train.tokenizer import Tok


@dataclass
class LoopConfig:
    steps: int = 40  # optimizer steps
    prompts_per_step: int = 8  # prompt groups per optimizer step
    samples_per_effort: int = 2  # M_b
    efforts: tuple[int, ...] = (25, 50, 75, 100)  # B
    max_tokens: int = 96
    temperature: float = 1.0
    lr: float = 2e-5
    warmup: int = 3
    grad_clip: float = 1.0
    dispatch: str = "sample"  # "sample" | "prompt" | "batch" (synchronous)
    max_in_flight: int = 128
    dataset_caps: dict[str, int] = field(default_factory=dict)
    max_staleness: int = 2  # tokens more versions old than this get no loss
    max_offpolicy: float = 0.5  # cap on the share of a batch's tokens sampled by an older version
    min_group_steps: int = 0  # drop groups finished within this many engine steps of dispatch (0 = off)
    routing_replay: bool = True
    clip: ClipConfig = field(default_factory=ClipConfig)
    reward: EffortReward = field(default_factory=EffortReward)
    seed: int = 0
    max_seconds: float = 0.0  # stop after this many seconds (0 = no limit); an update in progress finishes
    dtype: str = "fp32"  # "bf16": bf16 rollout engine, training forward under bf16 autocast (fp32 master weights)


StepFn = Callable[[list[Sample], int], dict[str, Any]]


class AsyncLoop:
    """Rollouts of `problems` (cycled) by a copy of `policy` on an engine; `train(samples, version)` is called
    whenever a batch of groups is ready and must update `policy` in place."""

    def __init__(self, policy: Transformer, tok: Tok, problems: list[Problem], cfg: LoopConfig,
                 metrics: Metrics | None = None, engine_kwargs: dict | None = None,
                 max_tokens_fn: Callable[[int], int] | None = None, stop_ids: tuple[int, ...] = (END_TURN_ID,)):
        """max_tokens_fn(uid) → a sample's token limit (default cfg.max_tokens); stop_ids=() with it gives
        scripted lengths (benchmarks/rollouts.py's long-tailed workload)."""
        self.policy, self.tok, self.cfg, self.metrics = policy, tok, cfg, metrics
        self.problems = problems
        size = len(cfg.efforts) * cfg.samples_per_effort
        # spare groups: stale ones are dropped (the 2026-12-02 H200 run ran dry with 2x)
        n_groups = cfg.steps * cfg.prompts_per_step * 8 + cfg.max_in_flight // size + 1
        groups = [Group(i, problems[i % len(problems)].family, size, problems[i % len(problems)])
                  for i in range(n_groups)]
        cap = max(cfg.max_in_flight, size)
        self.dispatcher = Dispatcher(groups, cfg.dispatch, cap, cfg.dataset_caps, cfg.prompts_per_step)
        # CUDA graphs stay on (the default on CUDA): routing recording is capturable
        kwargs = dict(max_batch=cap, max_seq_len=min(policy.config.max_seq_len, 1024))
        kwargs.update(engine_kwargs or {})
        self.engine = Engine(engine_copy(policy, cfg.dtype), **kwargs)
        self.max_tokens_fn = max_tokens_fn
        self.rollouts = Rollouts(self.engine, stop_ids=stop_ids, temperature=cfg.temperature,
                                 record_routing=cfg.routing_replay)
        self.version = 0
        self.config_version = 0  # bumped by mid-run config switches (teachers, caps)
        self._uid = itertools.count()
        self.pending: dict[int, list[Sample]] = defaultdict(list)  # group id → finished samples
        self.ready: list[list[Sample]] = []
        self.counters = defaultdict(int)
        self.concurrency: list[tuple[float, int]] = []  # (seconds, samples in flight) per engine step

    def _submit(self, group: Group) -> None:
        p: Problem = group.payload
        for b in self.cfg.efforts:
            prompt = prompt_ids(self.tok, p, b)
            for _ in range(self.cfg.samples_per_effort):
                uid = next(self._uid)
                limit = self.max_tokens_fn(uid) if self.max_tokens_fn is not None else self.cfg.max_tokens
                s = Sample(uid, group, b, prompt, limit, seed=self.cfg.seed * 1_000_003 + uid,
                           config_version=self.config_version)
                self.rollouts.submit(s)

    def run(self, train: StepFn, on_step: Callable[[int], None] | None = None) -> list[dict[str, Any]]:
        cfg = self.cfg
        for g in self.dispatcher.start():
            self._submit(g)
        records: list[dict[str, Any]] = []
        t0 = time.perf_counter()
        rollout_s = train_s = 0.0
        while self.version < cfg.steps:
            if cfg.max_seconds and time.perf_counter() - t0 >= cfg.max_seconds:
                self.counters["stopped_at_max_seconds"] = 1
                break
            if self.rollouts.in_flight == 0 and not self.ready:
                break  # nothing left to sample
            if self.rollouts.in_flight:
                t = time.perf_counter()
                done = self.rollouts.step()
                rollout_s += time.perf_counter() - t
                self.concurrency.append((time.perf_counter() - t0, self.rollouts.in_flight + len(done)))
                for s in done:
                    self._finished(s)
            if len(self.ready) < cfg.prompts_per_step:
                if not self.rollouts.in_flight:
                    break  # the queue ran dry before a full batch
                continue
            chosen, self.ready, dropped = select_groups(self.ready, cfg.prompts_per_step, self.version,
                                                        cfg.max_offpolicy, cfg.max_staleness)
            for g in dropped:
                self._collect(g, "dropped_stale")
            if len(chosen) < cfg.prompts_per_step:
                self.ready = chosen + self.ready  # wait for fresher groups
                if not self.rollouts.in_flight:
                    break  # none will come
                continue
            samples = [s for g in chosen for s in g]
            paused = self.rollouts.interrupt()  # training pre-empts the rollouts at their current token
            t = time.perf_counter()
            stats = train(samples, self.version)
            self.version += 1
            self.rollouts.load_weights(self.policy, self.version)
            train_s += time.perf_counter() - t
            self.rollouts.resume()
            self.counters["trained_samples"] += len(samples)
            record = {"step": self.version, "offpolicy_ratio": offpolicy_ratio(samples, self.version - 1),
                      "paused_at_update": paused, "in_flight": self.rollouts.in_flight,
                      "live_samples": self.rollouts.in_flight + sum(len(g) for g in self.ready)
                      + sum(len(v) for v in self.pending.values()),
                      "rollout_s": round(rollout_s, 3), "train_s": round(train_s, 3),
                      "samples_per_s": self.counters["trained_samples"] / max(time.perf_counter() - t0, 1e-9),
                      **{k: v for k, v in self.counters.items()}, **stats}
            records.append(record)
            if self.metrics is not None:
                self.metrics.log(record)
            for g in chosen:
                self._collect(g, "collected")
            if on_step is not None:
                on_step(self.version)
        return records

    def _finished(self, s: Sample) -> None:
        group = s.group
        self.pending[group.id].append(s)
        for g in self.dispatcher.finished(group, 1):
            self._submit(g)
        if len(self.pending[group.id]) == group.size:
            members = self.pending.pop(group.id)
            age = max(x.finish_step for x in members) - min(x.dispatch_step for x in members)
            if self.cfg.min_group_steps and age < self.cfg.min_group_steps:
                self._collect(members, "dropped_early")
            else:
                self.ready.append(members)

    def _collect(self, group: list[Sample], why: str) -> None:
        """Per-sample garbage collection once a group is trained on or dropped."""
        self.counters[why] += len(group)
        for s in group:
            s.release()

    def close(self) -> None:
        self.rollouts.close()


# ---------------------------------------------------------------------- the two losses
def _update(loss: torch.Tensor, params: list, optimizer, grad_clip: float, signal: bool) -> float:
    """Backward + clipped step; skipped (weights unchanged, version still advances) when the batch carries no
    signal (every advantage 0, every token masked) or the gradient is not finite: Muon / Sinkhorn normalize
    the update, so an all-zero gradient must not reach them."""
    if not signal:
        return 0.0
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    if torch.isfinite(norm):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm)


def _stats_by_effort(tok: Tok, samples: list[Sample]) -> tuple[list[bool], list[int], dict[str, float]]:
    correct = [verify(tok, s.group.payload, s.tokens) for s in samples]
    lengths = [reasoning_length(tok, s.tokens) for s in samples]
    out: dict[str, float] = {"accuracy": sum(correct) / len(samples)}
    for b in sorted({s.effort for s in samples}):
        idx = [i for i, s in enumerate(samples) if s.effort == b]
        out[f"accuracy_b{b}"] = sum(correct[i] for i in idx) / len(idx)
        out[f"length_b{b}"] = sum(lengths[i] for i in idx) / len(idx)
    return correct, lengths, out


def grpo_step(policy: Transformer, tok: Tok, cfg: LoopConfig) -> StepFn:
    optimizer = optimizer_for(policy, cfg.lr, cfg.dtype)
    params = [p for p in policy.parameters() if p.requires_grad]
    device = next(policy.parameters()).device

    def step(samples: list[Sample], version: int) -> dict[str, Any]:
        lr = set_lr(optimizer, cfg.lr, version + 1, cfg.warmup)
        correct, lengths, stats = _stats_by_effort(tok, samples)
        rewards = [cfg.reward(c, s.effort, n) for c, s, n in zip(correct, samples, lengths)]
        adv = subgroup_advantages(rewards, [s.group.id for s in samples], [s.effort for s in samples]).to(device)
        batch = training_batch(samples, version, cfg.max_staleness)
        tokens, targets = batch.tokens.to(device), batch.targets.to(device)
        mask, behaviour = batch.mask.to(device), batch.logp_behaviour.to(device)
        policy.train()
        with replay_routing(policy, batch.routing if cfg.routing_replay else None, tokens.size(1)), \
                autocast(device, cfg.dtype):
            logp = token_logprobs(policy(tokens, attention="sparse"), targets)
        loss, clip_stats = grpo_loss(logp, behaviour, adv, mask, cfg.clip)
        norm = _update(loss, params, optimizer, cfg.grad_clip, signal=bool((adv != 0).any() and mask.any()))
        gen = batch.versions >= 0
        return {"loss": float(loss.detach()), "reward": sum(rewards) / len(rewards), "grad_norm": float(norm), "lr": lr,
                "stale_tokens_masked": int((gen & ~batch.mask).sum()), **clip_stats, **stats}
    return step


def opd_step(student: Transformer, tok: Tok, cfg: LoopConfig, teachers: Teachers) -> StepFn:
    optimizer = optimizer_for(student, cfg.lr, cfg.dtype)
    params = [p for p in student.parameters() if p.requires_grad]
    device = next(student.parameters()).device

    def step(samples: list[Sample], version: int) -> dict[str, Any]:
        lr = set_lr(optimizer, cfg.lr, version + 1, cfg.warmup)
        _, _, stats = _stats_by_effort(tok, samples)
        batch = training_batch(samples, version, cfg.max_staleness)
        tokens, mask = batch.tokens.to(device), batch.mask.to(device)
        student.train()
        with replay_routing(student, batch.routing if cfg.routing_replay else None, tokens.size(1)), \
                autocast(device, cfg.dtype):
            logits = student(tokens, attention="sparse")
            loss = teachers.loss(logits, tokens, mask, [s.group.dataset for s in samples])
        norm = _update(loss, params, optimizer, cfg.grad_clip, signal=bool(mask.any()))
        return {"loss": float(loss.detach()), "reverse_kl": float(loss.detach()), "grad_norm": float(norm), "lr": lr,
                "teacher_config": teachers.version,
                "dispatched_under": sorted({s.config_version for s in samples}), **stats}
    return step
