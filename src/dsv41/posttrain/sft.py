"""Supervised fine-tuning on generated tasks: the chat format with effort-levelled worked solutions (SPEC §7-8).

Key idea: each example is one problem at one effort level b drawn from the training set B; the reply
`<think>{reasoning at b's detail level}</think>{answer}<|end|>` is the only part with loss (the prompt and the
effort line are context). So the model learns the format, the answers, and that the effort line sets how much
it writes before answering — the starting point RL sharpens.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from dsv41.model.transformer import Transformer
from dsv41.posttrain.common import Metrics, autocast, optimizer_for, set_lr
from dsv41.posttrain.tasks import Problem, sft_example
from dsv41.train.tokenizer import PAD_ID, Tok


@dataclass
class SFTConfig:
    steps: int = 300
    batch_size: int = 32
    lr: float = 1e-4
    warmup: int = 20
    efforts: tuple[int, ...] = (25, 50, 75, 100)
    grad_clip: float = 1.0
    log_every: int = 10
    seed: int = 0
    max_seconds: float = 0.0  # stop after this many seconds of training (0 = no limit); whole steps only
    pad_multiple: int = 32  # lengths rounded up to a multiple: few shapes (Triton / Inductor compile per shape)
    dtype: str = "fp32"  # "bf16": the forward under bf16 autocast (weights and optimizer state stay fp32)


def sft_batch(tok: Tok, problems: list[Problem], efforts: list[int], pad_multiple: int = 1) -> dict[str, Tensor]:
    """tokens, targets (B, T) padded with <pad> at the end (T rounded up to a multiple of `pad_multiple`),
    loss_mask (B, T): True on the reply's targets only. The model is causal and the masks keep padding out of
    the loss and the MoE statistics, so the padding changes no loss."""
    if pad_multiple < 1:
        raise ValueError(f"pad_multiple must be >= 1, got {pad_multiple}")
    examples = [sft_example(tok, p, b) for p, b in zip(problems, efforts)]
    T = max(len(ids) for ids, _ in examples) - 1
    T = -(-T // pad_multiple) * pad_multiple
    B = len(examples)
    tokens = torch.full((B, T), PAD_ID, dtype=torch.long)
    targets = torch.full((B, T), PAD_ID, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b, (ids, n_prompt) in enumerate(examples):
        n = len(ids) - 1
        tokens[b, :n] = torch.tensor(ids[:-1])
        targets[b, :n] = torch.tensor(ids[1:])
        mask[b, n_prompt - 1:n] = True  # target j is ids[j + 1]: the reply starts at target n_prompt − 1
    return {"tokens": tokens, "targets": targets, "loss_mask": mask}


def train_sft(model: Transformer, tok: Tok, problems: list[Problem], cfg: SFTConfig, metrics: Metrics | None = None,
              start_step: int = 0) -> list[float]:
    """cfg.steps optimizer steps over batches drawn from `problems` at random efforts of cfg.efforts; returns the
    per-step reply loss. The token mask covers real tokens only (padding stays out of the MoE statistics)."""
    device = next(model.parameters()).device
    rng = random.Random(cfg.seed + start_step)
    optimizer = optimizer_for(model, cfg.lr, cfg.dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    model.train()
    losses = []
    t0 = time.perf_counter()
    for step in range(start_step + 1, start_step + cfg.steps + 1):
        if cfg.max_seconds and losses and time.perf_counter() - t0 >= cfg.max_seconds:
            if metrics is not None:
                metrics.log({"stage": "sft", "step": step - 1, "loss": losses[-1], "stopped": "max_seconds"})
            break
        lr = set_lr(optimizer, cfg.lr, step - start_step, cfg.warmup)
        chosen = [rng.choice(problems) for _ in range(cfg.batch_size)]
        efforts = [rng.choice(cfg.efforts) for _ in chosen]
        batch = {k: v.to(device) for k, v in sft_batch(tok, chosen, efforts, cfg.pad_multiple).items()}
        real = batch["tokens"] != PAD_ID
        with autocast(device, cfg.dtype):
            out = model.losses(batch["tokens"], batch["targets"], loss_mask=batch["loss_mask"], token_mask=real,
                               attention="sparse")
        out.total.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(out.lm.detach()))
        if metrics is not None and (step % cfg.log_every == 0 or step == start_step + cfg.steps):
            metrics.log({"stage": "sft", "step": step, "loss": losses[-1], "grad_norm": float(norm), "lr": lr})
    return losses
