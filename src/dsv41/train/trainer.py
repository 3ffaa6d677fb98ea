"""The pre-training loop of SPEC §7: one `TrainConfig`, one `Trainer`, exact resume.

A step is `grad_accum` micro-batches of `model.losses(...).total / grad_accum` backward, then:
1. the aux-loss-free MoE bias update, once, from the loads summed over the micro-batches (a rule,
   not a gradient: `bias += speed · sign(mean load − load)`);
2. global-norm gradient clipping;
3. the learning rate from the token-based schedule (warm-up → constant → cosine → constant, the
   report's proportions scaled to this run's `total_tokens`), times each group's `lr_mult`;
4. the optimizer step (Muon / Sinkhorn-balanced / AdamW, `dsv41.optim.build_optimizer`).

`tokens` counts row positions (batch rows × seq_len, padding included), so the schedule, the QAT
switch and the checkpoints are pure functions of the step. Nothing in a step draws from a global
RNG: the replay simulation seeds its own generator from (seed, step, micro-batch). Together with
the data cursor, optimizer state and weights in the checkpoint (`state.py`), N steps + save +
resume + N steps equal 2N steps bit for bit on CPU (tests/train/test_trainer.py).

The sequence-length schedule (SPEC §7: rows of 64K tokens, 1M from 34T of 45T): with `long_seq_len`,
the steps that start at or after `long_from` × total_tokens pack rows of `long_seq_len` tokens, as many
fewer as keep the step's tokens (`TrainConfig.seq_len_at` / `batch_size_at`), from a packing of their own
(`Trainer.dataset`: a checkpoint saves the cursor of the one in use); the switch is logged ("seq_len").

Post-training switches:
- `qat_from_tokens`: from the first step that starts at or after this many tokens, every module
  with a `qat` attribute (the attention layers: FP4 entries / index keys, FP8 window) fake-quantizes
  its KV, and `model.config.qat` says so.
- `replay_sim`: bounded-replay simulation (SPEC §6). For a random `replay_fraction` of the rows a
  replay start s (uniform in 1..T−1) is drawn; queries at t ≥ s see window keys only in
  [max(s, t − W + 1), t] (`window_start`), as after the engine's encoder-only prefill, while the
  compressed entries stay visible. It is stricter than the engine, which truncates only the decoder
  layers' windows: here every layer's window is truncated.

Metrics go to out/metrics.jsonl, one JSON object per line with a "type": "start", "baseline"
(bigram validation loss), "train" (every `log_every` steps), "eval" (validation loss) and "seq_len" (the
sequence-length schedule's switch).

Regenerate the golden curve of the tests with `python -m dsv41.train.trainer --write-golden`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import sys
import time
import types
import typing
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from functools import partial
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from dsv41.config import ConfigError, ModelConfig, load_config
from dsv41.model.moe import moe_modules, update_moe_biases
from dsv41.model.transformer import Transformer
from dsv41.optim import LRSchedule, build_optimizer
from dsv41.optim.muon import ns_dtype_for
from dsv41.train import state as ckpt
from dsv41.train.data import PackedDataset, TokenizedCorpus, load_corpus, val_batches
from dsv41.train.graphs import StepGraph, tensor_lrs, tree_map
from dsv41.train.tokenizer import DATA_DIR, DEFAULT_TOKENIZER, build_compressed_token_map, load_tokenizer

GOLDEN_FILE = Path(__file__).resolve().parents[3] / "tests" / "train" / "golden_tiny_loss.json"


@dataclass
class TrainConfig:
    # --- model ---
    preset: str = "tiny"  # shipped model preset (tiny, small, v41-flash); ignored when `config` is set
    config: str | None = None  # model config file (flat preset JSON, HF config.json) or checkpoint folder
    model: dict[str, Any] = field(default_factory=dict)  # ModelConfig field overrides (`--model.n_layers=4`)
    # --- data ---
    data: str = str(DATA_DIR / "sample")  # corpus folder: train.jsonl/val.jsonl, or .jsonl/.txt split by hash
    tokenizer: str = str(DEFAULT_TOKENIZER)  # tokenizer.json
    cache_dir: str = ""  # token cache folder; "" = ~/.cache/dsv41/tokens
    engram_token_map: bool = True  # Engram hashes the tokenizer's compressed (normalized) vocabulary
    # --- run length and output ---
    out: str = "runs/train"  # run folder: metrics.jsonl, ckpt-*/, latest
    seq_len: int = 512  # tokens per row
    batch_size: int = 8  # rows per micro-batch
    # the report's sequence-length schedule (SPEC §7: 64K, raised to 1M at 34T of 45T): from long_from ×
    # total_tokens on, rows of long_seq_len tokens, fewer of them (tokens per step unchanged); 0 = off
    long_seq_len: int = 0
    long_from: float = 34 / 45
    grad_accum: int = 1  # micro-batches per optimizer step
    total_tokens: int = 0  # run length and schedule horizon in tokens (rows × seq_len, padding included)
    steps: int = 0  # > 0: run length in steps instead (total_tokens = steps × tokens per step)
    max_steps: int = 0  # > 0: stop after this step; the schedule still spans total_tokens
    # --- optimizer and schedule (SPEC §7) ---
    lr: float = 2.6e-4  # peak learning rate
    lr_final: float = 2.6e-5  # learning rate after the cosine decay
    warmup: float = 0.01  # linear warm-up, as a fraction of total_tokens
    warmup_steps: int = 0  # > 0: warm up over this many steps instead (the report: 2000)
    constant_until: float = 28 / 45  # fraction of total_tokens where the cosine starts (report 28T / 45T)
    decay_until: float = 40 / 45  # fraction where it ends at lr_final, constant afterwards (40T / 45T)
    grad_clip: float = 1.0  # global gradient-norm clip (<= 0: measure only)
    weight_decay: float = 0.1  # Muon and AdamW (norm weights) weight decay
    engram_lr_mult: float = 5.0  # learning-rate multiplier of every Engram parameter
    # --- numerics and device ---
    seed: int = 0  # weights, data order and replay starts
    dtype: str = "fp32"  # "fp32" or "bf16" (autocast; master weights and optimizer state stay fp32)
    device: str = "auto"  # "auto" (cuda if available), "cpu", "cuda", "cuda:1", ...
    # torch.compile every Block, applied from outside (apply_block_options); a cold compile of small takes
    # > 9 min on the H200 (11 block kinds, forward + backward), ~1 min from Inductor's cache (docs/training.md)
    compile: bool = False
    # one graph launch a step instead of thousands of kernels (train/graphs.py: 2 eager warm-up steps, a capture)
    cuda_graphs: bool = False  # replay each step (forward, backward, optimizer) from a CUDA graph; CUDA, no compile
    attention: str = "sparse"  # "sparse" (window band ∪ gathered top-k) or "dense" (the masked spec); same math
    checkpoint_activations: bool = False  # recompute each Block's activations in the backward pass
    threads: int = 0  # > 0: torch.set_num_threads (CPU determinism and sharing)
    # --- post-training switches ---
    qat_from_tokens: int = -1  # >= 0: fake-quantize the KV (QAT) from this many tokens on; < 0 never
    replay_sim: bool = False  # bounded-replay simulation: hide window keys before a random replay start
    replay_fraction: float = 0.25  # fraction of rows that get a replay start when replay_sim is on
    # --- bookkeeping ---
    eval_every: int = 100  # validation loss every this many steps; 0 = at the end only, < 0 = never
    eval_batches: int = 8  # validation batches (a fixed set: the first of the val split)
    save_every: int = 0  # checkpoint every this many steps; 0 = at the end only, < 0 = never
    keep_last: int = 0  # keep only the newest checkpoints (0 = keep all)
    log_every: int = 10  # a "train" metrics record every this many steps (means over them)
    progress: bool = True  # tqdm progress bar on stderr
    baseline: bool = True  # log a bigram model's validation loss at the start (model-card comparison)
    auto_resume: bool = True  # resume from out/latest when it exists and no checkpoint is given
    # --- distributed (torchrun) ---
    parallel: str = ""  # e.g. "dp=2,ep=2,pp=2,cp=1": train on torch.distributed (dsv41.parallel); "" = one device

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> None:
            raise ConfigError(f"train option '{name}': {why}")

        for name in ("seq_len", "batch_size", "grad_accum", "eval_batches", "log_every"):
            if getattr(self, name) <= 0:
                bad(name, f"must be positive, got {getattr(self, name)}")
        if self.dtype not in ("fp32", "bf16"):
            bad("dtype", f"must be 'fp32' or 'bf16', got {self.dtype!r}")
        if not 0 <= self.warmup <= self.constant_until <= self.decay_until <= 1:
            bad("warmup", "need 0 <= warmup <= constant_until <= decay_until <= 1 (fractions of total_tokens)")
        if not 0 <= self.replay_fraction <= 1:
            bad("replay_fraction", f"must lie in [0, 1], got {self.replay_fraction}")
        if self.lr < 0 or self.lr_final < 0:
            bad("lr", "learning rates must be >= 0")
        if self.attention not in ("dense", "sparse"):
            bad("attention", f"must be 'dense' or 'sparse', got {self.attention!r}")
        if self.cuda_graphs and self.compile:
            bad("cuda_graphs", "replays the eager step; use it without compile")
        if self.cuda_graphs and self.parallel:
            bad("cuda_graphs", "is for one device; the distributed trainer (parallel=...) runs eagerly")
        if self.long_seq_len < 0:
            bad("long_seq_len", f"must be >= 0 (0 = one sequence length), got {self.long_seq_len}")
        if self.long_seq_len:
            if not 0 < self.long_from <= 1:
                bad("long_from", f"must lie in (0, 1] (a fraction of total_tokens), got {self.long_from}")
            rows = self.batch_size * self.seq_len
            if self.long_seq_len <= self.seq_len or rows % self.long_seq_len:
                bad("long_seq_len", f"must be longer than seq_len = {self.seq_len} and divide a micro-batch's "
                                    f"{self.batch_size} x {self.seq_len} = {rows} tokens (the step keeps its "
                                    f"tokens), got {self.long_seq_len}")

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.grad_accum * self.seq_len

    def seq_len_at(self, tokens: int) -> int:
        """Row length of the step that starts after `tokens` tokens (the sequence-length schedule)."""
        if self.long_seq_len and tokens >= self.long_from * self.run_tokens:
            return self.long_seq_len
        return self.seq_len

    def batch_size_at(self, tokens: int) -> int:
        """Rows per micro-batch of that step: the micro-batch's tokens stay batch_size × seq_len."""
        return self.batch_size * self.seq_len // self.seq_len_at(tokens)

    @property
    def run_tokens(self) -> int:
        """Schedule horizon in tokens."""
        return self.steps * self.tokens_per_step if self.steps > 0 else self.total_tokens

    @property
    def total_steps(self) -> int:
        return math.ceil(self.run_tokens / self.tokens_per_step)

    def schedule(self) -> LRSchedule:
        total = self.run_tokens
        return LRSchedule(self.lr, self.lr_final, self.warmup * total, self.constant_until * total,
                          self.decay_until * total, warmup_steps=self.warmup_steps)

    def model_config(self) -> ModelConfig:
        base = load_config(self.config) if self.config else load_config(self.preset)
        return base.replace(**self.model) if self.model else base


# ---------------------------------------------------------------------- --key=value overrides
def _convert(name: str, raw: str | None, kind: Any) -> Any:
    """A command-line string as the dataclass field type; ConfigError naming `name` if it is not one."""
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        if raw is not None and raw.lower() in ("none", "null"):
            return None
        return _convert(name, raw, args[0])
    if kind is bool:
        if raw is None or raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"train option '{name}': expected a bool (true/false), got {raw!r}")
    if raw is None:
        raise ConfigError(f"train option '{name}': needs a value (--{name}=VALUE)")
    if kind is int:
        try:
            return int(raw)
        except ValueError:
            try:  # "1e9" tokens
                value = float(raw)
            except ValueError:
                value = math.nan
            if value.is_integer():
                return int(value)
            raise ConfigError(f"train option '{name}': expected an int, got {raw!r}") from None
    if kind is float:
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(f"train option '{name}': expected a float, got {raw!r}") from None
    if kind is str:
        return raw
    if typing.get_origin(kind) is dict:
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = None
        if not isinstance(value, dict):
            raise ConfigError(f"train option '{name}': expected a JSON object, got {raw!r}")
        return value
    raise ConfigError(f"train option '{name}': cannot parse type {kind}")


def split_overrides(argv: list[str]) -> dict[str, str | None]:
    """["--lr=1e-3", "--seq_len", "128", "--compile"] → {"lr": "1e-3", "seq_len": "128", "compile": None}."""
    out: dict[str, str | None] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"train: unexpected argument {arg!r} (options are --key=value)")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            value = None if nxt is None or nxt.startswith("--") else nxt
            i += value is not None
        out[key.replace("-", "_")] = value
        i += 1
    return out


def train_config_from_overrides(overrides: dict[str, str | None], base: TrainConfig | None = None) -> TrainConfig:
    """Apply string overrides to `base` (default TrainConfig()): typed by the field annotations;
    `model.KEY=JSON` sets a ModelConfig field. Unknown keys and bad values raise ConfigError."""
    hints = typing.get_type_hints(TrainConfig)
    values = asdict(base or TrainConfig())
    model = dict(values["model"])
    for key, raw in overrides.items():
        if key.startswith("model."):
            name = key[len("model."):]
            if name not in {f.name for f in dataclasses.fields(ModelConfig)}:
                raise ConfigError(f"train option '{key}': unknown ModelConfig field")
            try:
                model[name] = json.loads(raw) if raw is not None else True
            except json.JSONDecodeError:
                model[name] = raw
        elif key in hints:
            values[key] = _convert(key, raw, hints[key])
        else:
            raise ConfigError(f"train option '{key}': unknown key (see 'dsv41 train --help')")
    values["model"] = {**values["model"], **model}
    return TrainConfig(**values)


# ---------------------------------------------------------------------- helpers
def replay_window_start(batch: int, seq_len: int, fraction: float, rng: np.random.Generator) -> Tensor:
    """(B, T) long `window_start` of the bounded-replay simulation: a random `fraction` of the rows
    get a replay start s in 1..T−1; their queries at t ≥ s see window keys from s on; 0 elsewhere."""
    chosen = rng.random(batch) < fraction  # (B,)
    start = rng.integers(1, seq_len, size=batch) if seq_len > 1 else np.zeros(batch, np.int64)  # (B,)
    t = np.arange(seq_len)[None, :]  # (1, T)
    ws = np.where(chosen[:, None] & (t >= start[:, None]), start[:, None], 0)  # (B, T)
    return torch.from_numpy(ws.astype(np.int64))


def bigram_val_loss(train: TokenizedCorpus, batches: Iterable[dict[str, Tensor]], vocab_size: int,
                    k: float = 0.1) -> float:
    """Validation loss (nats per target token, same targets as the model's val loss) of an add-k
    smoothed bigram model counted over the training tokens: p(b | a) = (c(a,b) + k) / (c(a) + k·V).
    Pairs across a document boundary (EOS → next BOS) are not counted."""
    V = vocab_size
    toks = np.asarray(train.tokens, dtype=np.int64)
    keep = np.ones(max(len(toks) - 1, 0), dtype=bool)
    keep[train.offsets[1:-1] - 1] = False  # pair (last token of doc d, first token of doc d+1)
    prev, nxt = toks[:-1][keep], toks[1:][keep]
    pairs, counts = np.unique(prev * V + nxt, return_counts=True)  # sorted pair keys
    unigram = np.bincount(prev, minlength=V)  # c(a) as a context
    nll, n = 0.0, 0
    for b in batches:
        mask = b["loss_mask"].numpy()
        a, c = b["tokens"].numpy()[mask].astype(np.int64), b["targets"].numpy()[mask].astype(np.int64)
        key = a * V + c
        i = np.minimum(np.searchsorted(pairs, key), max(len(pairs) - 1, 0))
        hit = pairs[i] == key if len(pairs) else np.zeros(len(key), bool)
        c_ab = np.where(hit, counts[i] if len(pairs) else 0, 0)
        nll -= np.log((c_ab + k) / (unigram[a] + k * V)).sum()
        n += int(mask.sum())
    return nll / max(n, 1)


def _moe_load_stats(loads: dict[str, dict[str, Tensor]]) -> tuple[float, float]:
    """(worst layer, mean over layers) of max expert load / mean expert load (1 = balanced)."""
    ratios = []
    for load in loads.values():
        n = sum(v.float() for v in load.values())  # (E,) text + image
        if n.sum() > 0:
            ratios.append((n.max() / n.mean()).item())
    return (max(ratios), sum(ratios) / len(ratios)) if ratios else (float("nan"), float("nan"))


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def apply_block_options(model: Transformer, checkpoint: bool = False, compile: bool = False,
                        compile_options: dict | None = None) -> None:
    """Activation checkpointing and `torch.compile` per Block, applied from outside (torchtitan's
    `parallelize` pattern): each Block's forward is wrapped, the model code is untouched.
    compile_options: keyword arguments of `torch.compile` (tests pass fullgraph=True: a Block's training
    forward, dense or sparse, traces without a graph break — no host sync, no data-dependent shape).

    Checkpointing recomputes a Block in the backward pass. The recompute must see the per-forward
    CSA2 state (`ForwardContext.shared`) as the first run did — later blocks have overwritten it by
    then — so the wrapper snapshots the record before the block and restores it for the recompute.

    Every Block shares one code object (`Block.forward`), and Dynamo keeps one cache for it: each block kind
    (CSA2 mode, ratio, candidate source, first / last block) is a graph of its own: `tiny`'s 8 blocks are 8
    kinds, `small`'s 12 are 11. Past `torch._dynamo.config.recompile_limit` (8 by default) later blocks would
    silently run eager, so compiling raises that limit to two graphs per block (a second shape each: the
    long-row switch of the sequence-length schedule) if it is lower."""
    if compile:
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, 2 * len(model.layers) + 8)
    for block in model.layers:
        forward = torch.compile(block.forward, **(compile_options or {})) if compile else block.forward
        if checkpoint:
            forward = _checkpointed(forward)
        if compile or checkpoint:
            block.forward = forward


def _checkpointed(forward):
    from torch.utils.checkpoint import checkpoint

    def run(h: Tensor, pre_mix: Tensor, attention, **kwargs):
        ctx = attention.keywords["ctx"]  # the partial(attn, ctx=ctx) the model passes
        snapshot = dataclasses.replace(ctx.shared)
        calls = []

        def body(h: Tensor, pre_mix: Tensor):
            if calls:  # the recompute: the shared CSA2 state as it was before this block
                ctx.shared = dataclasses.replace(snapshot)
                n_losses = len(ctx.indexer_losses)
            calls.append(1)
            out = forward(h, pre_mix, attention, **kwargs)
            if len(calls) > 1:
                del ctx.indexer_losses[n_losses:]  # already counted in the first run
            return out

        return checkpoint(body, h, pre_mix, use_reentrant=False)

    return run


# the tensors of one micro-batch a step's device work reads (`Trainer._device_step`), window_start last (None
# without replay simulation)
MICRO_INPUTS = ("tokens", "targets", "doc_ids", "loss_mask", "window_start")


# ---------------------------------------------------------------------- trainer
class Trainer:
    """Builds model, optimizer, schedule and data from a TrainConfig; `run()` trains to the end.

    `resume`: a checkpoint folder, a run folder or a `latest` pointer. Without it, and with
    `auto_resume`, an existing out/latest is resumed.
    """

    def __init__(self, tc: TrainConfig, resume: str | Path | None = None):
        self.tc = tc
        if tc.run_tokens <= 0:
            raise ConfigError("train option 'total_tokens': set total_tokens or steps to a positive value")
        if tc.threads > 0:
            torch.set_num_threads(tc.threads)
        self.device = _resolve_device(tc.device)
        self.out = Path(tc.out)
        self.out.mkdir(parents=True, exist_ok=True)
        random.seed(tc.seed)
        np.random.seed(tc.seed)
        torch.manual_seed(tc.seed)

        # tokenizer and data
        self.tokenizer = load_tokenizer(tc.tokenizer)
        cache = Path(tc.cache_dir) if tc.cache_dir else Path.home() / ".cache" / "dsv41" / "tokens"
        self.train_corpus = load_corpus(tc.data, self.tokenizer, cache, split="train")
        self._datasets: dict[int, PackedDataset] = {}  # row length → its packing (`dataset`)
        val_corpus = load_corpus(tc.data, self.tokenizer, cache, split="val")
        self.val_set = list(islice(val_batches(val_corpus, tc.seq_len, tc.batch_size), tc.eval_batches)) \
            if len(val_corpus) else []

        # model
        config = tc.model_config()
        if self.tokenizer.vocab_size > config.vocab_size:
            raise ConfigError(f"config field 'vocab_size': {config.vocab_size} is smaller than the "
                              f"tokenizer's {self.tokenizer.vocab_size}")
        lookup = None
        if tc.engram_token_map and config.engram_layer_ids:
            # recorded in config.json: a loader rebuilds the same map from the tokenizer
            lookup, size = build_compressed_token_map(self.tokenizer)
            config = config.replace(engram_compressed_vocab_size=size)
        self.config = config
        self.model = Transformer(config).init_weights(seed=tc.seed)
        if lookup is not None:
            self.model.set_engram_token_map(lookup, config.engram_compressed_vocab_size)
        self.model.to(self.device).train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.model, tc.lr, weight_decay=tc.weight_decay,
                                         engram_lr_mult=tc.engram_lr_mult, ns_dtype=ns_dtype_for(self.device, tc.dtype))
        self.schedule = tc.schedule()
        apply_block_options(self.model, checkpoint=tc.checkpoint_activations, compile=tc.compile)
        self._losses = partial(self.model.losses, attention=tc.attention)
        if tc.cuda_graphs and self.device.type != "cuda":
            raise ConfigError(f"train option 'cuda_graphs': needs a CUDA device, got {self.device}")
        self._step_graph = StepGraph(self._device_step, enabled=tc.cuda_graphs,
                                     reset=lambda: self.optimizer.zero_grad(set_to_none=True))
        self.qat_modules = [m for m in self.model.modules() if hasattr(m, "qat")]

        # position in the run
        self.step, self.tokens, self.elapsed = 0, 0, 0.0
        self.last_loads: dict[str, dict[str, Tensor]] = {}
        self.resumed_from: Path | None = None
        if resume is None and tc.auto_resume:
            resume = ckpt.resolve_checkpoint(self.out)
        if resume is not None:
            self.load(resume)
        elif tc.cuda_graphs:
            tensor_lrs(self.optimizer, self.device)
        self._start_batches()
        (self.out / "train_config.json").write_text(json.dumps(asdict(tc), indent=1) + "\n")

    # ------------------------------------------------------------------ data
    @property
    def dataset(self) -> PackedDataset:
        """The packing of the row length the next step uses (`TrainConfig.seq_len_at`): checkpoints save and
        restore its cursor; after the switch to long rows the short packing is never read again."""
        n = self.tc.seq_len_at(self.tokens)
        if n not in self._datasets:
            self._datasets[n] = PackedDataset(self.train_corpus, n, seed=self.tc.seed)
        return self._datasets[n]

    def _start_batches(self) -> None:
        """Batches of the next step's row length from the dataset's cursor."""
        self._batches_len = self.tc.seq_len_at(self.tokens)
        self._batches = self.dataset.batches(self.tc.batch_size_at(self.tokens))

    def _follow_seq_len_schedule(self) -> None:
        """Before a step: where the sequence-length schedule switches, continue with the long rows."""
        n = self.tc.seq_len_at(self.tokens)
        if n != self._batches_len:
            self._start_batches()
            self.log({"type": "seq_len", "step": self.step, "tokens": self.tokens, "seq_len": n,
                      "batch_size": self.tc.batch_size_at(self.tokens)})

    # ------------------------------------------------------------------ one optimizer step
    def set_qat(self, on: bool) -> None:
        for m in self.qat_modules:
            m.qat = on
        self.model.config.qat = on

    def _autocast(self):
        if self.tc.dtype == "bf16":  # no cast cache under CUDA graphs (its casts would outlive the capture)
            return torch.autocast(self.device.type, dtype=torch.bfloat16, cache_enabled=not self.tc.cuda_graphs)
        return contextlib.nullcontext()

    def train_step(self) -> dict[str, Any]:
        """One optimizer step; returns detached 0-d tensors (lm, indexer, balance, total, grad_norm)
        plus lr, qat, target tokens and the summed MoE loads."""
        tc = self.tc
        qat = tc.qat_from_tokens >= 0 and self.tokens >= tc.qat_from_tokens
        self.set_qat(qat)
        lr = self.schedule.apply(self.optimizer, self.tokens + tc.tokens_per_step, self.step + 1)
        inputs: dict[str, Tensor | None] = {}
        for micro in range(tc.grad_accum):
            batch = next(self._batches)
            for name in MICRO_INPUTS[:-1]:
                inputs[f"{name}_{micro}"] = batch[name].to(self.device, non_blocking=True)
            window_start = None
            if tc.replay_sim:
                rng = np.random.default_rng([tc.seed, self.step, micro])
                window_start = replay_window_start(*batch["tokens"].shape, tc.replay_fraction, rng).to(self.device)
            inputs[f"window_start_{micro}"] = window_start
        out = self._step_graph(inputs, key=qat)
        if self._step_graph.enabled:  # the graph's outputs: the next replay writes over them
            out = tree_map(torch.clone, out)
        sums, grad_norm, n_targets, loads = out
        self.step += 1
        self.tokens += tc.tokens_per_step
        self.last_loads = loads
        lm, indexer, balance, total = (sums / tc.grad_accum).unbind()
        return dict(lm=lm, indexer=indexer, balance=balance, total=total, grad_norm=grad_norm,
                    lr=lr, qat=qat, targets=n_targets, loads=loads)

    def _device_step(self, **inputs: Tensor | None) -> tuple[Tensor, Tensor, Tensor, dict[str, dict[str, Tensor]]]:
        """The step's device work from its micro-batches' tensors (`{name}_{micro}` for the names of MICRO_INPUTS):
        forward and backward of each, the MoE bias update, the clip, the optimizer and zeroing — no host sync, shapes
        from the inputs' (a CUDA graph replays it: `train/graphs.py`). (loss sums (4,), grad norm, targets, loads)."""
        tc = self.tc
        sums = torch.zeros(4, device=self.device)  # lm, indexer, balance, total
        loads: dict[str, dict[str, Tensor]] = {}
        n_targets = torch.zeros((), dtype=torch.long, device=self.device)
        for micro in range(tc.grad_accum):
            tokens, targets, doc_ids, loss_mask, window_start = (inputs[f"{n}_{micro}"] for n in MICRO_INPUTS)
            with self._autocast():
                losses = self._losses(tokens, targets, doc_ids=doc_ids, loss_mask=loss_mask, window_start=window_start)
            (losses.total / tc.grad_accum).backward()
            sums += torch.stack([losses.lm, losses.indexer, losses.balance, losses.total]).detach().float()
            n_targets += losses.n_tokens
            for name, moe in moe_modules(self.model):
                if moe.last_load is not None:
                    acc = loads.setdefault(name, {k: torch.zeros_like(v) for k, v in moe.last_load.items()})
                    for k, v in moe.last_load.items():
                        acc[k] += v
        update_moe_biases(self.model, loads)  # once per step, from the summed loads
        clip = tc.grad_clip if tc.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return sums, grad_norm.detach(), n_targets, loads

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self) -> tuple[float, int]:
        """(mean next-token loss over the fixed validation targets, number of targets)."""
        if not self.val_set:
            return math.nan, 0
        self.model.eval()
        nll = torch.zeros((), device=self.device, dtype=torch.float64)
        n = 0
        try:
            for b in self.val_set:
                b = {k: v.to(self.device) for k, v in b.items()}
                with self._autocast():
                    logits = self.model(b["tokens"], doc_ids=b["doc_ids"], attention=self.tc.attention)  # (B, T, V)
                ce = F.cross_entropy(logits.float().flatten(0, 1), b["targets"].flatten(), reduction="none")
                nll += (ce * b["loss_mask"].flatten()).sum().double()
                n += int(b["loss_mask"].sum())
        finally:
            self.model.train()
        return (nll / max(n, 1)).item(), n

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> Path:
        name = f"ckpt-{self.step:06d}"
        state = {"step": self.step, "tokens": self.tokens, "elapsed": self.elapsed,
                 "data": self.dataset.state_dict(), "train_config": asdict(self.tc)}
        path = ckpt.save_training_state(self.out / name, model=self.model, optimizer=self.optimizer, state=state,
                                        extra_files={"tokenizer.json": Path(self.tc.tokenizer).read_bytes()})
        ckpt.set_latest(self.out, name)
        ckpt.prune_checkpoints(self.out, self.tc.keep_last)
        return path

    def load(self, path: str | Path) -> None:
        folder = ckpt.resolve_checkpoint(path)
        if folder is None:
            raise FileNotFoundError(2, "no training checkpoint", str(path))
        state = ckpt.load_training_state(folder, model=self.model, optimizer=self.optimizer)
        self.step, self.tokens, self.elapsed = int(state["step"]), int(state["tokens"]), float(state["elapsed"])
        self.dataset.load_state_dict(state["data"])  # the packing of the row length at the checkpoint's tokens
        self._start_batches()
        self.resumed_from = folder
        self._truncate_metrics()
        self._step_graph.drop()  # a captured step would read the optimizer state and lrs the load replaced
        if self.tc.cuda_graphs:  # the checkpoint's lrs are numbers
            tensor_lrs(self.optimizer, self.device)

    def _truncate_metrics(self) -> None:
        """Drop metrics a crashed run logged after the checkpoint being resumed."""
        path = self.out / "metrics.jsonl"
        if not path.exists():
            return
        lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
        kept = [ln for ln in lines if json.loads(ln).get("step", 0) <= self.step]
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(ln + "\n" for ln in kept))
        os.replace(tmp, path)

    # ------------------------------------------------------------------ the loop
    def log(self, record: dict[str, Any]) -> None:
        with (self.out / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")

    def run(self) -> None:
        tc = self.tc
        end = min(tc.total_steps, tc.max_steps) if tc.max_steps > 0 else tc.total_steps
        start_time = time.perf_counter() - self.elapsed
        if self.resumed_from is None:
            n_params = sum(p.numel() for p in self.model.parameters())
            self.log({"type": "start", "step": 0, "tokens": 0, "params": n_params,
                      "tokens_per_step": tc.tokens_per_step, "total_tokens": tc.run_tokens,
                      "total_steps": tc.total_steps, "device": str(self.device), "dtype": tc.dtype})
            if tc.baseline and self.val_set:
                loss = bigram_val_loss(self.train_corpus, self.val_set, self.config.vocab_size)
                self.log({"type": "baseline", "step": 0, "tokens": 0, "bigram_val_loss": loss, "k": 0.1})
        bar = _progress(tc.progress, total=end, initial=self.step)
        window: list[dict[str, Any]] = []
        window_time, saved_at, evaluated_at = 0.0, -1, -1
        while self.step < end:
            self._follow_seq_len_schedule()
            t0 = time.perf_counter()
            stats = self.train_step()
            window.append(stats)
            if self.device.type == "cuda" and (self.step % tc.log_every == 0 or self.step == end):
                torch.cuda.synchronize()
            window_time += time.perf_counter() - t0
            self.elapsed = time.perf_counter() - start_time
            if self.step % tc.log_every == 0 or self.step == end:
                record = self._train_record(window, window_time)
                self.log(record)
                if bar is not None:
                    bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}",
                                    tok_s=f"{record['tokens_per_s']:.0f}", refresh=False)
                window, window_time = [], 0.0
            if bar is not None:
                bar.update(1)
            if tc.eval_every > 0 and self.step % tc.eval_every == 0:
                self._eval_record()
                evaluated_at = self.step
            if tc.save_every > 0 and self.step % tc.save_every == 0:
                self.save()
                saved_at = self.step
        if bar is not None:
            bar.close()
        if tc.eval_every >= 0 and evaluated_at != self.step and self.step > 0:
            self._eval_record()
        if tc.save_every >= 0 and saved_at != self.step:
            self.save()

    def _train_record(self, window: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
        def mean(key: str) -> float:
            return torch.stack([s[key].float() for s in window]).mean().item()

        last = window[-1]
        worst, avg = _moe_load_stats(last["loads"])
        return {"type": "train", "step": self.step, "tokens": self.tokens, "lr": last["lr"],
                "loss": mean("lm"), "indexer_loss": mean("indexer"), "balance_loss": mean("balance"),
                "total_loss": mean("total"), "grad_norm": mean("grad_norm"),
                "tokens_per_s": len(window) * self.tc.tokens_per_step / max(seconds, 1e-9),
                "moe_max_load": worst, "moe_mean_max_load": avg, "qat": last["qat"],
                "target_tokens": int(sum(s["targets"] for s in window)), "elapsed": self.elapsed}

    def _eval_record(self) -> None:
        loss, n = self.evaluate()
        if n:
            self.log({"type": "eval", "step": self.step, "tokens": self.tokens, "val_loss": loss,
                      "val_tokens": n, "elapsed": self.elapsed})


def _progress(enabled: bool, total: int, initial: int):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stderr)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in Path(path).read_text().splitlines() if ln.strip()]


# ---------------------------------------------------------------------- golden curve of the tests
def golden_config(out: str | Path, cache_dir: str | Path) -> TrainConfig:
    """30 steps of `tiny` on the shipped sample: the run tests/train/golden_tiny_loss.json records."""
    return TrainConfig(preset="tiny", data=str(DATA_DIR / "sample"), tokenizer=str(DEFAULT_TOKENIZER),
                       cache_dir=str(cache_dir), out=str(out), seq_len=128, batch_size=2, steps=30,
                       lr=3e-3, lr_final=3e-4, warmup=0.1, seed=0, device="cpu", dtype="fp32", threads=2,
                       eval_every=-1, save_every=-1, log_every=1, progress=False, baseline=False,
                       auto_resume=False)


def run_golden(out: str | Path, cache_dir: str | Path) -> list[dict[str, Any]]:
    """Train the golden run; its "train" records, one per step."""
    Trainer(golden_config(out, cache_dir)).run()
    return [r for r in read_metrics(Path(out) / "metrics.jsonl") if r["type"] == "train"]


def write_golden(path: str | Path = GOLDEN_FILE) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        records = run_golden(Path(tmp) / "run", Path(tmp) / "cache")
    tc = golden_config("<tmp>", "<tmp>")
    data = {"command": "python -m dsv41.train.trainer --write-golden",
            "torch": torch.__version__, "threads": tc.threads,
            "config": {k: v for k, v in asdict(tc).items() if k not in ("data", "tokenizer", "cache_dir", "out")},
            "lm_loss": [r["loss"] for r in records], "total_loss": [r["total_loss"] for r in records]}
    Path(path).write_text(json.dumps(data, indent=1) + "\n")
    print(f"{len(records)} steps: loss {records[0]['loss']:.4f} -> {records[-1]['loss']:.4f}; wrote {path}")


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m dsv41.train.trainer",
                                description="maintenance entry point; train with 'dsv41 train'")
    p.add_argument("--write-golden", nargs="?", const=str(GOLDEN_FILE), metavar="PATH",
                   help=f"regenerate the tests' golden loss curve (default {GOLDEN_FILE})")
    args = p.parse_args(argv)
    if args.write_golden:
        write_golden(args.write_golden)
        return 0
    p.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
