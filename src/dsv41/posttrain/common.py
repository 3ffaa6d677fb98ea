"""What every post-training stage shares: loading a policy, the optimizer and its LR, JSONL metrics, evaluation.

Key idea: each stage (SFT, RL, OPD) reads a checkpoint directory (or a preset with random weights for smoke
runs), trains the float model with the repo's optimizer (`optim.build_optimizer`: Muon / Sinkhorn / AdamW,
SPEC §7) at a constant LR after a short linear warm-up, and writes a float safetensors checkpoint with the
tokenizer beside it, so the next stage, `dsv41 generate` and `dsv41 serve` read it unchanged. Evaluation is
greedy generation on the engine over held-out problems, per effort level (accuracy, mean reasoning length).
Precision (`dtype`): "bf16" trains under bf16 autocast (master weights and optimizer state stay fp32, as the
pretraining Trainer's dtype=bf16) and samples / evaluates on a bf16 copy of the model (as the engine
benchmarks and `dsv41 serve` run); "fp32" keeps everything fp32; "auto" (the commands' default) is bf16 on
CUDA and fp32 elsewhere. The 2026-12-04 H200 run trained in fp32 with an fp32 rollout engine: SFT took 6 s per
256-row step.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from dsv41.config import ConfigError
from dsv41.model.transformer import Transformer
from dsv41.posttrain.tasks import END_TURN_ID, Problem, prompt_ids, reasoning_length, verify
from dsv41.train.tokenizer import Tok

DONE_FILE = "done.json"  # written last by a stage: a rerun with the same --out skips it (resumable scripts)


def resolve_device(name: str | None) -> torch.device:
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device '{name}' requested but CUDA is not available")
    return torch.device(name)


def autocast(device: torch.device, dtype: str):
    """The training forward's context: bf16 autocast for dtype "bf16", nothing for "fp32"."""
    if dtype == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def engine_copy(model: Transformer, dtype: str = "fp32") -> Transformer:
    """The copy an engine samples from: `clone_model`, cast to bf16 for dtype "bf16" but for the weights the
    engine multiplies in fp32 (`engine.fp32_weights`: head, routers, compressors, mHC coefficients, sinks),
    which keep their values."""
    from dsv41.engine.engine import cast_for_engine

    copy = clone_model(model)
    return cast_for_engine(copy, torch.bfloat16) if dtype == "bf16" else copy


def load_policy(checkpoint: str | Path | None, preset: str | Path | None, device: torch.device,
                seed: int = 0) -> tuple[Transformer, Tok]:
    """(float model in train mode on `device`, tokenizer) from a checkpoint directory, or random weights of a
    preset name / preset-style JSON file."""
    from dsv41.engine.cli import SHIPPED_MODEL, _tokenizer_for, load_checkpoint_and_tokenizer

    if checkpoint is None and preset is None:
        checkpoint = SHIPPED_MODEL
    if checkpoint is not None:
        path = Path(checkpoint)
        if not path.is_dir():
            raise ConfigError(f"checkpoint directory '{path}' not found")
        model, tok = load_checkpoint_and_tokenizer(path, str(device))
    else:
        from dsv41 import load_config
        from dsv41.config import preset_names

        if not isinstance(preset, Path) and preset not in preset_names():
            raise ConfigError(f"unknown preset '{preset}' (presets: {', '.join(preset_names())})")
        model = Transformer(load_config(preset)).init_weights(seed=seed).to(device)
        tok = _tokenizer_for(model, None)
    return model.train(), tok


def clone_model(model: Transformer) -> Transformer:
    """A deep copy (for an engine or a reference); the MoE's last training statistics, which hold autograd
    graph tensors, are dropped first."""
    import copy

    for moe in model.moe_layers():
        moe.last_load = moe.last_balance_loss = None
    return copy.deepcopy(model)


def save_policy(model: Transformer, tok: Tok, out: str | Path, metadata: dict[str, Any] | None = None) -> Path:
    from dsv41.checkpoint import save_checkpoint

    out = Path(out)
    save_checkpoint(model, out, fmt="float", dtype=torch.float32,
                    extra_files={"tokenizer.json": tok.tokenizer.to_str()}, metadata=metadata)
    return out


def optimizer_for(model: Transformer, lr: float, dtype: str = "fp32"):
    """The recipe's optimizer without weight decay; `dtype` the run's training precision (its Newton–Schulz
    dtype follows, `optim.muon.ns_dtype_for`)."""
    from dsv41.optim import build_optimizer
    from dsv41.optim.muon import ns_dtype_for

    device = next(model.parameters()).device
    return build_optimizer(model, lr, weight_decay=0.0, ns_dtype=ns_dtype_for(device, dtype))


def set_lr(optimizer, lr: float, step: int, warmup: int) -> float:
    """Constant lr after a linear warm-up over `warmup` steps (step counts from 1)."""
    value = lr * min(1.0, step / max(warmup, 1))
    for group in optimizer.param_groups:
        group["lr"] = value * group.get("lr_mult", 1.0)
    return value


class Metrics:
    """Append-only JSONL: one record per line, with the seconds since the run started."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.t0 = time.perf_counter()

    def log(self, record: dict[str, Any]) -> None:
        record = {"time_s": round(time.perf_counter() - self.t0, 3), **record}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    p = Path(path)
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.exists() else []


@torch.no_grad()
def greedy_replies(model: Transformer, tok: Tok, problems: list[Problem], efforts: Iterable[int], max_tokens: int,
                   max_batch: int = 256, dtype: str = "fp32") -> dict[int, list[list[int]]]:
    """effort → the greedy reply ids of every problem (a final `<|end|>` kept when the reply stopped on it).
    Every (problem, effort) request is queued at once, so the engine runs up to `max_batch` rows per step (a
    decode step costs about the same at 64 rows as at 256: one wave per effort level left it mostly idle);
    batching changes no greedy token (the engine's batch = alone). dtype "bf16": the engine runs a bf16 copy."""
    from dsv41.engine.engine import Engine
    from dsv41.engine.sampling import SamplingParams

    efforts = list(efforts)
    rows = max(1, min(max_batch, len(problems) * len(efforts)))
    # the engine takes its own copy: it switches the model to eval and may change its MoE dispatch
    engine = Engine(engine_copy(model, dtype), max_batch=rows, max_seq_len=min(model.config.max_seq_len, 1024))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=[END_TURN_ID])
    seqs = {b: [engine.add_request(prompt_ids(tok, p, b), params) for p in problems] for b in efforts}
    while engine.has_work():
        engine.step()
    return {b: [s.output + ([END_TURN_ID] if s.finish_reason == "stop" else []) for s in seqs[b]] for b in efforts}


def evaluate(model: Transformer, tok: Tok, problems: list[Problem], efforts: Iterable[int], max_tokens: int,
             max_batch: int = 256, dtype: str = "fp32") -> dict[int, dict[str, float]]:
    """Greedy replies on the engine for every (problem, effort): effort → {accuracy, mean reasoning length, n}."""
    out: dict[int, dict[str, float]] = {}
    for b, replies in greedy_replies(model, tok, problems, efforts, max_tokens, max_batch, dtype).items():
        correct = [verify(tok, p, r) for p, r in zip(problems, replies)]
        lengths = [reasoning_length(tok, r) for r in replies]
        out[b] = {"accuracy": sum(correct) / len(correct), "reasoning_tokens": sum(lengths) / len(lengths),
                  "n": len(problems)}
    return out
