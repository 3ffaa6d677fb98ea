"""`dsv41 train-dspark`: train a DSpark drafter on a frozen model (SPEC §5 "DSpark"; DeepSpec's recipe).

The backbone is loaded once, put in eval mode and never receives a gradient; every step runs it on the
batch under `no_grad`, capturing the target layers' features (`capture_features`) and its final hidden
state. Per sequence, `n_anchors` anchor positions are drawn without replacement among those whose next
token is in the same document; each anchor starts a draft block (anchor + noise tokens) whose position
k is supervised by the token at anchor + k + 1 while the chain stays inside the row and the document
(a cumulative mask, as DeepSpec's `build_eval_mask`).

Loss (DeepSpec `compute_dspark_loss`, alphas from its configs): with p the drafter's distribution
(base logits + the Markov bias of the true previous token, teacher-forced), q the backbone's
distribution at the same position and w_k = exp(−k/γ) (γ = 4) on supervised positions,
    total = 0.1 · CE(p, text token) + 0.9 · ‖p − q‖₁ + 1.0 · BCE(σ(confidence), 1 − TV(p, q)),
each term a w-weighted mean; ‖p − q‖₁ = 2·TV is what DeepSpec calls `l1_loss`, and 1 − TV is the
probability that a token drawn from p is accepted by the standard rejection rule (the target of the
confidence head, detached). The drafter's MoE keeps the backbone's aux-loss-free bias updates and
balance loss (weight `balance_loss_weight`).

Logged per step: the terms, `accept@k` (mean 1 − TV at position k), `greedy@k` (draft argmax = backbone
argmax), `tau` (DeepSpec's `tau_probabilistic`: 1 + Σ_k Π_{j≤k} (1 − TV_j)); evaluation runs the real
greedy speculative loop offline (`acceptance_lengths`). Files: OUT/metrics.jsonl, OUT/acceptance.png,
and the drafter checkpoint in OUT (default `<model>/dspark/`, docs/dspark.md).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from dsv41.config import ConfigError, ModelConfig, with_dspark
from dsv41.model.dspark import DSpark, capture_features, stack_features
from dsv41.model.moe import moe_modules, update_moe_biases
from dsv41.model.state import ForwardContext
from dsv41.model.transformer import Transformer
from dsv41.train.cli import as_overrides_parser, dataclass_field_help
from dsv41.train.plot import save_figure


# ---------------------------------------------------------------------- sampling anchors and targets
def sample_anchors(loss_mask: Tensor, n_anchors: int, generator: torch.Generator | None = None
                   ) -> tuple[Tensor, Tensor]:
    """Per row, up to `n_anchors` distinct anchor rows a with loss_mask[a] (the token after a is in the
    same document), uniformly without replacement, in increasing order. loss_mask (B, T) →
    (anchors (B, A) long, keep (B, A) bool); rows with fewer candidates pad with anchor 0, keep False."""
    B, T = loss_mask.shape
    valid = loss_mask.bool()
    noise = torch.rand(B, T, generator=generator, device="cpu").to(loss_mask.device)
    noise = torch.where(valid, noise, torch.full_like(noise, 2.0))  # invalid rows sort last
    order = noise.argsort(dim=1)[:, :n_anchors]  # (B, min(A, T))
    keep = valid.gather(1, order)
    anchors = torch.where(keep, order, torch.full_like(order, T)).sort(dim=1).values
    keep = anchors < T
    anchors = torch.where(keep, anchors, torch.zeros_like(anchors))
    if anchors.size(1) < n_anchors:  # fewer rows than anchors asked for
        pad = n_anchors - anchors.size(1)
        anchors = F.pad(anchors, (0, pad))
        keep = F.pad(keep, (0, pad), value=False)
    return anchors, keep


def block_targets(targets: Tensor, loss_mask: Tensor, anchors: Tensor, keep: Tensor, block_size: int
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """(labels (B, A, K), supervised (B, A, K) bool, rows (B, A, K)): block position k of the anchor at
    row a predicts targets[a + k] (the token at a + k + 1), supervised while every link a..a+k stays
    inside the row and its document (cumulative); rows = a + k clamped into the row."""
    T = targets.size(1)
    rows = anchors.unsqueeze(-1) + torch.arange(block_size, device=anchors.device)  # (B, A, K)
    safe = rows.clamp(max=T - 1)
    ok = (rows < T) & loss_mask.bool().gather(1, safe.flatten(1)).view_as(rows) & keep.unsqueeze(-1)
    supervised = ok.long().cumprod(dim=-1).bool()
    labels = targets.gather(1, safe.flatten(1)).view_as(rows)
    return labels, supervised, safe


def position_weights(block_size: int, gamma: float, device: torch.device | str | None = None) -> Tensor:
    """exp(−k/γ) for k = 0 .. K−1 (γ ≤ 0: all ones)."""
    k = torch.arange(block_size, dtype=torch.float32, device=device)
    return torch.exp(-k / gamma) if gamma > 0 else torch.ones_like(k)


@dataclass
class LossWeights:
    ce: float = 0.1  # cross-entropy towards the text token (DeepSpec ce_loss_alpha)
    l1: float = 0.9  # ‖p − q‖₁ = 2·TV towards the backbone's distribution (DeepSpec l1_loss_alpha)
    confidence: float = 1.0  # BCE of the confidence head towards 1 − TV (DeepSpec confidence_head_alpha)
    gamma: float = 4.0  # position decay exp(−k/γ) (DeepSpec loss_decay_gamma)


def dspark_loss_terms(draft_logits: Tensor, target_logits: Tensor, labels: Tensor, confidence_logits: Tensor,
                      supervised: Tensor, weights: LossWeights) -> dict[str, Tensor]:
    """The loss and its metrics from (B, A, K, V) draft / backbone logits, (B, A, K) labels, confidence
    logits and the supervised mask. Terms are means weighted by w = supervised · exp(−k/γ)."""
    K = draft_logits.size(-2)
    w = supervised.float() * position_weights(K, weights.gamma, draft_logits.device)  # (B, A, K)
    den = w.sum().clamp_min(1e-6)
    p = torch.softmax(draft_logits.float(), dim=-1)
    q = torch.softmax(target_logits.float(), dim=-1)
    l1 = (p - q).abs().sum(-1)  # (B, A, K) = 2·TV
    accept = (1.0 - 0.5 * l1).clamp(0.0, 1.0)  # probability a draw from p survives rejection against q
    ce = F.cross_entropy(draft_logits.float().flatten(0, -2), labels.flatten(), reduction="none").view_as(w)
    bce = F.binary_cross_entropy_with_logits(confidence_logits.float(), accept.detach(), reduction="none")
    terms = {"ce": (ce * w).sum() / den, "l1": (l1 * w).sum() / den, "confidence": (bce * w).sum() / den}
    terms["total"] = weights.ce * terms["ce"] + weights.l1 * terms["l1"] + weights.confidence * terms["confidence"]
    with torch.no_grad():
        s = supervised.float()
        per_pos = s.sum(dim=(0, 1)).clamp_min(1)
        terms["accept"] = (accept * s).sum(dim=(0, 1)) / per_pos  # (K,)
        greedy = (draft_logits.argmax(-1) == target_logits.argmax(-1)).float()
        terms["greedy"] = (greedy * s).sum(dim=(0, 1)) / per_pos  # (K,)
        blocks = supervised[..., 0]
        tau = 1.0 + (accept * s).cumprod(-1).sum(-1)  # (B, A)
        terms["tau"] = (tau * blocks).sum() / blocks.sum().clamp_min(1)
        conf = torch.sigmoid(confidence_logits.float())
        terms["confidence_abs_error"] = ((conf - accept).abs() * s).sum() / s.sum().clamp_min(1)
    return terms


# ---------------------------------------------------------------------- one forward
@torch.no_grad()
def backbone_pass(main: Transformer, tokens: Tensor, doc_ids: Tensor, layer_ids: list[int],
                  attention: str = "sparse") -> tuple[Tensor, Tensor, Tensor]:
    """The frozen backbone on a batch: (features (B, T, n_targets·dim), final hidden (B, T, dim),
    document positions (B, T))."""
    ctx = ForwardContext.build(tokens, doc_ids, attention=attention)
    with capture_features(main, layer_ids) as found:
        hidden = main.hidden(tokens, ctx)
    return stack_features(found, layer_ids), hidden, ctx.positions


def drafter_losses(drafter: DSpark, batch: dict[str, Tensor], n_anchors: int, weights: LossWeights,
                   generator: torch.Generator | None = None, attention: str = "sparse") -> dict[str, Tensor]:
    """One training forward of the drafter on a packed batch (tokens, targets, doc_ids, loss_mask)."""
    main = drafter.main
    tokens, doc_ids = batch["tokens"], batch["doc_ids"]
    features, hidden, positions = backbone_pass(main, tokens, doc_ids, drafter.target_layer_ids, attention)
    anchors, keep = sample_anchors(batch["loss_mask"], n_anchors, generator)
    labels, supervised, rows = block_targets(batch["targets"], batch["loss_mask"], anchors, keep, drafter.block_size)
    with torch.no_grad():  # the backbone's distribution at every supervised position
        B, A, K = rows.shape
        target_hidden = hidden.gather(1, rows.flatten(1).unsqueeze(-1).expand(-1, -1, hidden.size(-1)))
        target_logits = main.head_logits(target_hidden).view(B, A, K, -1)
    out = drafter(features.detach(), tokens, positions, doc_ids, anchors, token_mask=keep)  # (B, A, K, dim)
    prev = torch.cat([tokens.gather(1, anchors).unsqueeze(-1), labels[..., :-1]], dim=-1)  # teacher forcing
    draft_logits, confidence = drafter.head_outputs(out, prev)
    terms = dspark_loss_terms(draft_logits, target_logits, labels, confidence, supervised, weights)
    bal = [m.last_balance_loss for m in drafter.moe_layers() if m.last_balance_loss is not None]
    terms["balance"] = torch.stack(bal).mean() if bal else terms["total"].new_zeros(())
    terms["total"] = terms["total"] + drafter.config.balance_loss_weight * terms["balance"]
    terms["supervised"] = supervised.sum()
    return terms


# ---------------------------------------------------------------------- offline speculative evaluation
@torch.no_grad()
def greedy_continuation(main: Transformer, prompts: Tensor, n_new: int) -> Tensor:
    """prompts (B, P) → (B, P + n_new): the backbone's greedy continuation (full forwards, dense)."""
    seq = prompts
    for _ in range(n_new):
        logits = main.head_logits(main.hidden(seq, ForwardContext.build(seq, None))[:, -1:])  # (B, 1, V)
        seq = torch.cat([seq, logits.argmax(-1)], dim=1)
    return seq


@torch.no_grad()
def acceptance_lengths(drafter: DSpark, sequences: Tensor, prompt_len: int) -> dict[str, Any]:
    """Greedy speculative decoding replayed offline on the backbone's own greedy continuations.

    sequences (B, L): prompt (first `prompt_len` tokens) + the backbone's greedy continuation. For
    every anchor a ≥ prompt_len with a full block ahead, the drafter sees what the engine would give it
    — the features of positions < a and the token at a — drafts K tokens greedily (Markov head on its
    own drafts), and m = the matching prefix with sequences[a+1 : a+1+K] is how many a verification
    would accept. Mean acceptance length per verification with the first k drafts: τ(k) = 1 + E[min(m, k)]
    for k = 1 .. K. Also the per-position conditional acceptance and mean confidence."""
    main, K = drafter.main, drafter.block_size
    B, L = sequences.shape
    doc_ids = torch.ones_like(sequences)
    features, _, positions = backbone_pass(main, sequences, doc_ids, drafter.target_layer_ids, attention="dense")
    anchors = torch.arange(prompt_len, L - K, device=sequences.device).expand(B, -1)  # (B, A)
    out = drafter(features, sequences, positions, doc_ids, anchors)
    drafts, _, conf = drafter.sample(out, sequences.gather(1, anchors), temperature=0.0)  # (B, A, K)
    truth = sequences.gather(1, (anchors.unsqueeze(-1) + 1 + torch.arange(K, device=anchors.device)).flatten(1))
    match = (drafts == truth.view_as(drafts)).long().cumprod(-1)  # (B, A, K): prefix still accepted
    accepted = match.sum(-1).float()  # (B, A)
    tau = {k: 1.0 + accepted.clamp(max=k).mean().item() for k in range(1, K + 1)}
    reached = torch.cat([torch.ones_like(match[..., :1]), match[..., :-1]], dim=-1).float()  # position k tried
    cond = (match.float().sum((0, 1)) / reached.sum((0, 1)).clamp_min(1)).tolist()
    return {"tau": tau, "conditional_acceptance": cond, "mean_confidence": torch.sigmoid(conf).mean((0, 1)).tolist(),
            "anchors": int(accepted.numel())}


# ---------------------------------------------------------------------- the run
@dataclass
class DSparkTrainConfig:
    model: str = ""  # checkpoint directory of the frozen backbone (required)
    out: str = ""  # where the drafter, metrics.jsonl and acceptance.png go (default: MODEL/dspark)
    data: str = ""  # corpus folder (default: the shipped data/sample)
    tokenizer: str = ""  # tokenizer.json (default: MODEL/tokenizer.json, else data/tokenizer.json)
    cache_dir: str = ""  # token cache (default: ~/.cache/dsv41/tokens)
    block_size: int = 5  # draft block: anchor + block−1 noise tokens; proposes block tokens
    n_stages: int = 3  # draft stages (mtp.0 ..)
    target_layers: str = ""  # comma-separated backbone layers feeding stage 0 (default: the last three)
    markov_rank: int = 0  # Markov head rank (0: min(256, dim))
    n_routed_experts: int = 0  # routed experts per stage (0: the backbone's)
    n_activated_experts: int = 0  # experts per token (0: the backbone's)
    steps: int = 200  # optimizer steps
    batch_size: int = 8  # sequences per step
    seq_len: int = 512  # tokens per sequence
    n_anchors: int = 32  # draft blocks per sequence
    lr: float = 6e-4  # AdamW peak learning rate (DeepSpec)
    lr_final: float = 6e-5  # end of the cosine decay
    warmup: float = 0.04  # warm-up fraction of the steps (DeepSpec warmup_ratio)
    weight_decay: float = 0.0  # AdamW weight decay (DeepSpec: 0)
    grad_clip: float = 1.0  # max gradient norm (DeepSpec max_grad_norm)
    gamma: float = 4.0  # position weight exp(−k/γ)
    ce_alpha: float = 0.1  # weight of the CE term
    l1_alpha: float = 0.9  # weight of the ‖p − q‖₁ (= 2·TV) term
    confidence_alpha: float = 1.0  # weight of the confidence BCE
    attention: str = "sparse"  # backbone attention path: sparse | dense (same math)
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "fp32"  # fp32 | bf16 (autocast)
    seed: int = 0  # anchors, initialization, data order
    threads: int = 0  # torch CPU threads (0: leave)
    log_every: int = 10  # steps per metrics line
    eval_every: int = 0  # steps between offline acceptance evaluations (0: only at the end)
    eval_prompts: int = 16  # held-out sequences in an evaluation
    eval_prompt_len: int = 64  # their prompt tokens
    eval_new_tokens: int = 64  # greedy tokens generated after each prompt
    save_format: str = "official-fp8"  # drafter checkpoint: official-fp8 (release table) | float
    budget_s: float = 0.0  # > 0: from the time of steps 4-8, cut `steps` so training fits this many seconds
    plot: bool = True  # write OUT/acceptance.png
    progress: bool = True  # tqdm progress bar

    def __post_init__(self) -> None:
        checks = [("attention", self.attention in ("sparse", "dense")), ("dtype", self.dtype in ("fp32", "bf16")),
                  ("save_format", self.save_format in ("official-fp8", "float")),
                  ("block_size", self.block_size >= 1), ("n_stages", self.n_stages >= 1),
                  ("steps", self.steps >= 0), ("batch_size", self.batch_size >= 1), ("seq_len", self.seq_len >= 2),
                  ("n_anchors", self.n_anchors >= 1),
                  ("eval_prompt_len", self.eval_prompt_len >= 1),
                  ("eval_new_tokens", self.eval_new_tokens > self.block_size)]
        for name, ok in checks:
            if not ok:
                raise ConfigError(f"train-dspark option '{name}': invalid value {getattr(self, name)!r}")

    def drafter_config(self, backbone: ModelConfig) -> ModelConfig:
        targets = [int(t) for t in self.target_layers.split(",") if t.strip()] if self.target_layers else None
        return with_dspark(backbone, block_size=self.block_size, n_stages=self.n_stages, target_layer_ids=targets,
                           markov_rank=self.markov_rank or None, n_routed_experts=self.n_routed_experts,
                           n_activated_experts=self.n_activated_experts)


def _lr_at(tc: DSparkTrainConfig, step: int, total: int) -> float:
    """Linear warm-up, then cosine from lr to lr_final over `total` steps."""
    warm = max(1, int(tc.warmup * total))
    if step < warm:
        return tc.lr * (step + 1) / warm
    t = (step - warm) / max(1, total - warm)
    return tc.lr_final + 0.5 * (tc.lr - tc.lr_final) * (1 + math.cos(math.pi * min(t, 1.0)))


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"train-dspark option 'device': {name} requested but CUDA is not available")
    return torch.device(name)


class DSparkTrainer:
    """Frozen backbone + a fresh drafter + AdamW; `run()` trains, evaluates, plots and saves.

    `batches` (an iterator of packed batches) and `eval_sequences` ((B, L) prompt + greedy continuation)
    may be given directly (tests); otherwise they come from the corpus and the backbone."""

    def __init__(self, tc: DSparkTrainConfig, main: Transformer | None = None, batches=None,
                 eval_sequences: Tensor | None = None, tokenizer=None):
        self.tc = tc
        if tc.threads > 0:
            torch.set_num_threads(tc.threads)
        torch.manual_seed(tc.seed)
        self.device = _device(tc.device)
        if main is None:
            main, tokenizer = _load_backbone(tc, self.device)
        self.main = main.to(self.device).eval().requires_grad_(False)
        self.config = tc.drafter_config(main.config)
        self.drafter = DSpark(self.config).init_weights(seed=tc.seed).to(self.device).bind(self.main)
        self.drafter.train()
        self.params = [p for p in self.drafter.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=tc.lr, betas=(0.9, 0.95), weight_decay=tc.weight_decay)
        self.weights = LossWeights(tc.ce_alpha, tc.l1_alpha, tc.confidence_alpha, tc.gamma)
        self.generator = torch.Generator().manual_seed(tc.seed)
        self.out = Path(tc.out) if tc.out else Path(tc.model) / "dspark"
        self.batches, self.eval_sequences = batches, eval_sequences
        if self.batches is None or self.eval_sequences is None:
            train_batches, eval_sequences = _corpus_data(tc, tokenizer, self.main, self.device)
            self.batches = self.batches if self.batches is not None else train_batches
            if self.eval_sequences is None:
                self.eval_sequences = eval_sequences
        self.tokenizer = tokenizer
        self.step, self.total_steps = 0, tc.steps
        self.history: list[dict[str, Any]] = []

    def _autocast(self):
        enabled = self.tc.dtype == "bf16"
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=enabled)

    def train_step(self) -> dict[str, Any]:
        lr = _lr_at(self.tc, self.step, self.total_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        batch = {k: v.to(self.device) for k, v in next(self.batches).items()}
        with self._autocast():
            terms = drafter_losses(self.drafter, batch, self.tc.n_anchors, self.weights, self.generator,
                                   self.tc.attention)
        terms["total"].backward()
        loads = {name: moe.last_load for name, moe in moe_modules(self.drafter) if moe.last_load is not None}
        update_moe_biases(self.drafter, loads)
        clip = self.tc.grad_clip if self.tc.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        record = {"type": "train", "step": self.step, "lr": lr, "grad_norm": float(grad_norm)}
        for key in ("total", "ce", "l1", "confidence", "balance", "tau", "confidence_abs_error"):
            record[key] = float(terms[key].detach())
        record["accept"] = [float(v) for v in terms["accept"]]
        record["greedy"] = [float(v) for v in terms["greedy"]]
        record["supervised"] = int(terms["supervised"])
        return record

    def evaluate(self) -> dict[str, Any]:
        self.drafter.eval()
        try:
            with self._autocast():
                result = acceptance_lengths(self.drafter, self.eval_sequences.to(self.device), self.tc.eval_prompt_len)
        finally:
            self.drafter.train()
        return {"type": "eval", "step": self.step, **result}

    def log(self, record: dict[str, Any]) -> None:
        self.history.append(record)
        with (self.out / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")

    def run(self) -> dict[str, Any]:
        tc = self.tc
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "metrics.jsonl").unlink(missing_ok=True)
        self.log({"type": "start", "step": 0, "drafter_params": self.drafter.num_parameters(),
                  "train_config": asdict(tc), "device": str(self.device)})
        bar = _progress(tc.progress, tc.steps)
        start, window = time.perf_counter(), []
        while self.step < self.total_steps:
            record = self.train_step()
            if tc.budget_s > 0 and self.step == 3:
                timed_from = time.perf_counter()  # steps 1-3 warm up (allocator, kernel choices)
            if tc.budget_s > 0 and self.step == 8:  # size the run to the budget from steps 4-8
                per_step = (time.perf_counter() - timed_from) / 5
                spent = time.perf_counter() - start
                self.total_steps = max(8, min(tc.steps, 8 + int((tc.budget_s - spent) / per_step)))
                if bar is not None:
                    bar.total = self.total_steps
                self.log({"type": "budget", "step": self.step, "seconds_per_step": per_step,
                          "total_steps": self.total_steps})
            window.append(record)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{record['total']:.3f}", tau=f"{record['tau']:.2f}")
            if self.step % max(1, tc.log_every) == 0 or self.step == self.total_steps:
                self.log(_mean_record(window, time.perf_counter() - start))
                window = []
            if tc.eval_every > 0 and self.step % tc.eval_every == 0 and self.step < self.total_steps:
                self.log(self.evaluate())
        if bar is not None:
            bar.close()
        final = self.evaluate()
        final["train_seconds"] = time.perf_counter() - start
        self.log(final)
        self.save()
        if tc.save_format != "float":  # what ships: the drafter read back from its release-format files
            from dsv41.checkpoint import load_drafter

            float_drafter = self.drafter
            self.drafter = load_drafter(self.out, self.main).train()
            try:
                final = {**self.evaluate(), "type": "eval_saved", "format": tc.save_format,
                         "train_seconds": final["train_seconds"]}
            finally:
                self.drafter = float_drafter
            self.log(final)
        if tc.plot:
            plot_acceptance(self.out / "metrics.jsonl", self.out / "acceptance.png")
        return final

    def save(self) -> Path:
        from dsv41.checkpoint import save_checkpoint

        meta = {"dsv41.dspark.backbone": str(self.tc.model), "dsv41.dspark.steps": str(self.step)}
        return save_checkpoint(self.drafter, self.out, fmt=self.tc.save_format, metadata=meta,
                               max_shard_bytes=15 * 2**20)


def _mean_record(window: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    out = dict(window[-1])
    for key in ("total", "ce", "l1", "confidence", "balance", "tau", "confidence_abs_error", "grad_norm"):
        out[key] = sum(r[key] for r in window) / len(window)
    for key in ("accept", "greedy"):
        out[key] = [sum(r[key][k] for r in window) / len(window) for k in range(len(window[-1][key]))]
    out["seconds"] = seconds
    return out


def _progress(enabled: bool, total: int):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="step", dynamic_ncols=True, file=sys.stderr)


def _load_backbone(tc: DSparkTrainConfig, device: torch.device):
    from dsv41.checkpoint import CheckpointError, load_checkpoint
    from dsv41.engine.cli import install_engram_map
    from dsv41.train.tokenizer import DEFAULT_TOKENIZER, load_tokenizer

    if not tc.model:
        raise ConfigError("train-dspark option 'model': give the backbone's checkpoint directory")
    try:
        main = load_checkpoint(tc.model, device=device, drafter=False)
    except CheckpointError as e:
        raise ConfigError(str(e)) from None
    path = Path(tc.tokenizer) if tc.tokenizer else Path(tc.model) / "tokenizer.json"
    if not path.exists():
        if tc.tokenizer:
            raise ConfigError(f"train-dspark option 'tokenizer': '{path}' not found")
        path = DEFAULT_TOKENIZER
    tok = load_tokenizer(path)
    install_engram_map(main, tok)
    return main, tok


def _corpus_data(tc: DSparkTrainConfig, tok, main: Transformer, device: torch.device):
    """(endless packed training batches, eval sequences: held-out prompts + the backbone's greedy tokens)."""
    from dsv41.train.data import PackedDataset, load_corpus
    from dsv41.train.tokenizer import DATA_DIR, DEFAULT_TOKENIZER, load_tokenizer

    tok = tok or load_tokenizer(DEFAULT_TOKENIZER)
    data = Path(tc.data) if tc.data else DATA_DIR / "sample"
    if not data.exists():
        raise ConfigError(f"train-dspark option 'data': '{data}' not found")
    cache = Path(tc.cache_dir) if tc.cache_dir else Path.home() / ".cache" / "dsv41" / "tokens"
    train = load_corpus(data, tok, cache, split="train")
    val = load_corpus(data, tok, cache, split="val")
    if not len(train) or not len(val):
        raise ConfigError(f"train-dspark option 'data': '{data}' has no train or no validation documents")

    def endless():
        ds = PackedDataset(train, tc.seq_len, seed=tc.seed)
        while True:
            yield from ds.batches(tc.batch_size)

    need = tc.eval_prompt_len
    prompts = []  # prompts from windows spaced along each held-out document
    for i in range(len(val)):
        doc = val.doc(i)
        prompts += [doc[s: s + need] for s in range(0, len(doc) - need + 1, 8 * need)]
    prompts = prompts[: tc.eval_prompts]
    if not prompts:
        raise ConfigError(f"train-dspark: no validation document has {need} tokens (eval_prompt_len)")
    prompts_t = torch.tensor([p.tolist() for p in prompts], dtype=torch.long, device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=tc.dtype == "bf16"):
        sequences = greedy_continuation(main, prompts_t, tc.eval_new_tokens)
    return endless(), sequences


# ---------------------------------------------------------------------- the plot
def plot_acceptance(metrics_jsonl: str | Path, out_png: str | Path) -> Path:
    """Acceptance per draft position: 1 − TV (`accept@k`) over training steps, and the final offline
    evaluation's conditional greedy acceptance and mean confidence per position."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(ln) for ln in Path(metrics_jsonl).read_text().splitlines() if ln.strip()]
    train = [r for r in records if r.get("type") == "train"]
    evals = [r for r in records if r.get("type") in ("eval", "eval_saved")]
    fig, (ax_t, ax_e) = plt.subplots(1, 2, figsize=(11, 4))
    if train:
        steps = [r["step"] for r in train]
        for k in range(len(train[-1]["accept"])):
            ax_t.plot(steps, [r["accept"][k] for r in train], lw=1, label=f"position {k}")
    ax_t.set(xlabel="step", ylabel="1 − TV (sampled acceptance)", title="acceptance per draft position", ylim=(0, 1))
    ax_t.legend(fontsize=8)
    if evals:
        last = evals[-1]
        ks = list(range(len(last["conditional_acceptance"])))
        ax_e.bar([k - 0.2 for k in ks], last["conditional_acceptance"], width=0.4, label="greedy acceptance (held out)")
        ax_e.bar([k + 0.2 for k in ks], last["mean_confidence"], width=0.4, label="mean confidence")
        taus = ", ".join(f"τ({k})={v:.2f}" for k, v in last["tau"].items())
        ax_e.set(xlabel="draft position", ylabel="P(accept | earlier accepted)", ylim=(0, 1),
                 title=f"step {last['step']}: {taus}")
        ax_e.title.set_fontsize(8)
        ax_e.legend(fontsize=8)
    for ax in (ax_t, ax_e):
        ax.grid(alpha=0.3)
    return save_figure(fig, out_png)


# ---------------------------------------------------------------------- CLI
EXAMPLES = """examples:
  dsv41 train-dspark --model models/dsv41-small --steps 2000 --device cuda --dtype bf16
  dsv41 train-dspark --model models/dsv41-small --device cpu --steps 2 --batch_size 1 --seq_len 128
  dsv41 train-dspark --model runs/small/export --out runs/small-dspark --block_size 7 --n_anchors 64
"""


def _convert(f, raw: str) -> Any:
    """A command-line string as the field's type (ValueError when it is not one)."""
    name = f.type if isinstance(f.type, str) else f.type.__name__
    kind = {"int": int, "float": float, "str": str, "bool": bool}[name]
    if kind is bool:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(raw)
    if kind is int:
        try:
            return int(raw)
        except ValueError:
            value = float(raw)  # "2e3"
            if not value.is_integer():
                raise
            return int(value)
    return kind(raw)


def config_from_args(argv: list[str]) -> DSparkTrainConfig:
    """`--key value` / `--key=value` pairs → DSparkTrainConfig (ConfigError names a bad key or value)."""
    by_name = {f.name: f for f in fields(DSparkTrainConfig)}
    values: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"train-dspark: unexpected argument {arg!r}")
        key, eq, raw = arg[2:].partition("=")
        key = key.replace("-", "_")
        if key not in by_name:
            raise ConfigError(f"train-dspark option '{key}': unknown (see dsv41 train-dspark --help)")
        if not eq:
            if i + 1 >= len(argv):
                raise ConfigError(f"train-dspark option '{key}': needs a value")
            i += 1
            raw = argv[i]
        try:
            values[key] = _convert(by_name[key], raw)
        except ValueError:
            raise ConfigError(f"train-dspark option '{key}': {raw!r} is not a {by_name[key].type}") from None
        i += 1
    return DSparkTrainConfig(**values)


def _field_help() -> str:
    return dataclass_field_help(DSparkTrainConfig, "options (--key=value or --key value):")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "train-dspark", help="train a DSpark drafter on a frozen model (metrics.jsonl, plot, safetensors)",
        description="Train the release's DSpark drafter (docs/dspark.md) on a frozen backbone checkpoint:\n"
                    "0.1·CE + 0.9·‖p−q‖₁ + 1.0·confidence BCE, position weights exp(−k/γ). Writes the drafter\n"
                    "(official mtp.* names), OUT/metrics.jsonl and OUT/acceptance.png (OUT = MODEL/dspark).",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    return as_overrides_parser(p, _field_help, EXAMPLES)


def run(args: argparse.Namespace) -> int:
    tc = config_from_args(args.overrides)
    trainer = DSparkTrainer(tc)
    final = trainer.run()
    taus = "  ".join(f"τ({k})={v:.3f}" for k, v in final["tau"].items())
    print(f"drafter: {trainer.drafter.num_parameters():,} params, {trainer.step} steps "
          f"({final['train_seconds']:.0f} s) -> {trainer.out}")
    print(f"held-out greedy acceptance length per verification length: {taus} ({final['anchors']} anchors)")
    return 0


__all__ = ["DSparkTrainConfig", "DSparkTrainer", "LossWeights", "acceptance_lengths", "block_targets",
           "drafter_losses", "dspark_loss_terms", "greedy_continuation", "plot_acceptance", "position_weights",
           "sample_anchors"]
