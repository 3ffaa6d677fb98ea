"""Sampling: per-request parameters over a batch of next-token logits, reproducible per request.

Each row of a (B, V) logits batch follows its own `SamplingParams`, so greedy and sampled requests
share a step. A sampled row goes: logits / temperature → top-k (the k largest; ties keep the lower
ids) → top-p (nucleus of the renormalized top-k distribution: the smallest prefix, in descending
probability, whose mass reaches top_p — never empty) → one uniform draw from the row's own
`torch.Generator` (a host one: `make_generator`), inverted through the kept tokens' cumulative
distribution. Every step consumes exactly one number from a sampled row's generator and the math never
mixes rows, so a seeded request's tokens do not depend on what else is in the batch or where its row sits. Greedy
(temperature 0) is argmax, ties to the lowest id, and draws nothing.

Finishing (`finish_reason`, `StopChecker`): "stop" when the sampled token is one of the request's
`stop_token_ids` — that token is not shown to the user but is counted as generated (it cost a
decode step; it counts toward `max_tokens` and usage) — and "length" when `max_tokens` tokens
have been generated. A stop id reached on the last allowed step reports "stop".

Validation (`SamplingParams.__post_init__`, and `check_vocab` once the vocabulary is known) range-checks
every field, so a request the sampler could not run (a top_k past any int64, a top_p that rounds to 0 in
fp32, ...) is refused when it is made instead of failing a whole batch mid-step.

Log-probabilities (`token_logprobs`) are those of the model's *unmodified* next-token distribution,
log_softmax(logits) — before temperature, top-k or top-p — which is what OpenAI's `logprobs` report.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from dsv41.engine.block_manager import to_device

FinishReason = Literal["stop", "length"]

TOP_P_MIN = 1e-8  # smaller masses are refused: fp32 rounds them towards 0 and the nucleus would be empty
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit
MAX_INT = 2**31 - 1  # top_k / max_tokens / stop ids beyond this cannot be meant (and overflow int32 kernels)


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy (argmax); > 0 divides the logits
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 = off
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    max_tokens: int = 16  # generated tokens (a final stop token included) before "length"
    stop_token_ids: list[int] = field(default_factory=list)  # any of these ends the request ("stop")
    seed: int | None = None  # seeds the request's own generator; None = nondeterministic
    logprobs: int | None = None  # None: no log-probabilities; k in 0..20: the sampled token's and the top k

    def __post_init__(self) -> None:
        def number(name: str) -> float:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
            return float(value)

        def integer(name: str, low: int, high: int = MAX_INT) -> int:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r}")
            return value

        if number("temperature") < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not TOP_P_MIN <= number("top_p") <= 1:
            raise ValueError(f"top_p must be in [{TOP_P_MIN:g}, 1], got {self.top_p!r}")
        integer("top_k", 0)
        integer("max_tokens", 1)
        if self.logprobs is not None:
            integer("logprobs", 0, MAX_LOGPROBS)
        if not isinstance(self.stop_token_ids, (list, tuple)) or any(
                isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= MAX_INT for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of token ids in [0, {MAX_INT}], "
                             f"got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids)
        if self.seed is not None and not (isinstance(self.seed, int) and not isinstance(self.seed, bool)
                                          and 0 <= self.seed < 2**64):
            raise ValueError(f"seed must be None or an integer in [0, 2**64), got {self.seed!r}")

    def check_vocab(self, vocab_size: int) -> None:
        """The checks that need the model: top_k and stop ids within the vocabulary (ValueError otherwise)."""
        if self.top_k > vocab_size:
            raise ValueError(f"top_k must be <= the vocabulary size {vocab_size} (0 = off), got {self.top_k}")
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise ValueError(f"stop token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def make_generator(seed: int | None) -> torch.Generator:
    """A request's own generator, on the host: seeded from `seed`, or from fresh entropy when None. Its
    draws are host numbers that reach the device in one copy per step for the whole batch (a device
    generator costs one kernel launch per row and step), and a seed draws the same numbers on any device."""
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def host_uniforms(generator: torch.Generator | None, n: int, dtype: torch.dtype = torch.float32) -> list[float]:
    """n U[0, 1) draws of `dtype` from the row's generator (the global host RNG when None), as host
    numbers. A generator on another device still works (its draws are copied back: a sync)."""
    if generator is not None and generator.device.type != "cpu":
        return torch.rand(n, generator=generator, dtype=dtype, device=generator.device).tolist()
    return torch.rand(n, generator=generator, dtype=dtype).tolist()


def sample(logits: Tensor, params_list: list[SamplingParams], generators: list[torch.Generator | None]) -> Tensor:
    """Next token per row: logits (B, V) → LongTensor (B,), row i by params_list[i] / generators[i]."""
    if logits.dim() != 2:
        raise ValueError(f"sample: logits must be (B, V), got shape {tuple(logits.shape)}")
    B, V = logits.shape
    if len(params_list) != B or len(generators) != B:
        raise ValueError(f"sample: {B} rows but {len(params_list)} params and {len(generators)} generators")
    logits = logits.float()
    tokens = logits.argmax(dim=-1)  # greedy rows keep this (the first maximum = lowest id)
    rows = [i for i, p in enumerate(params_list) if not p.greedy]
    if not rows:
        return tokens
    device = logits.device
    index = to_device(rows, device)  # every host list reaches the device through to_device: no stream sync
    sorted_ids, probs, keep = _filtered_sorted(logits.index_select(0, index), [params_list[i] for i in rows])
    cdf = probs.cumsum(dim=-1)  # (S, V), flat after the last kept token

    # one host draw per sampled row, one copy for the batch (no device op per row; pinned and non-blocking:
    # the overlapped step samples before it reads anything back, `Engine._launch_sample`)
    u = to_device([host_uniforms(generators[i], 1)[0] for i in rows], device, torch.float32)  # (S,)
    target = (u * cdf[:, -1]).unsqueeze(-1)
    position = torch.searchsorted(cdf, target, right=True).squeeze(-1)  # first index with cdf > target
    position = torch.minimum(position, keep.sum(dim=-1) - 1)  # rounding guard: stay inside the kept set
    return tokens.index_copy(0, index, sorted_ids.gather(1, position.unsqueeze(-1)).squeeze(-1))


def _filtered_sorted(logits: Tensor, params_list: list[SamplingParams]) -> tuple[Tensor, Tensor, Tensor]:
    """The distribution a sampled row draws from, in descending-logit order: (sorted ids (S, V), probs (S, V)
    zero outside the kept set and not renormalized after top-p, kept mask (S, V)). fp32 logits (S, V)."""
    S, V = logits.shape
    device = logits.device
    # fp32 temperatures; one below fp32's range would round to 0 and turn 0 / 0 into NaN
    temperature = to_device([p.temperature for p in params_list], device, torch.float32).clamp(min=torch.finfo().tiny)
    top_k = to_device([min(p.top_k or V, V) for p in params_list], device)  # clamped in Python: no overflow
    top_p = to_device([p.top_p for p in params_list], device, torch.float32)

    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True, stable=True)  # (S, V), ties: lower id
    # shift by the max before dividing: a tiny temperature then gives -inf, never inf - inf
    scaled = (sorted_logits - sorted_logits[:, :1]) / temperature[:, None]
    rank = torch.arange(V, device=device)
    keep = rank[None, :] < top_k[:, None]  # (S, V) top-k
    probs = scaled.masked_fill(~keep, float("-inf")).softmax(dim=-1)  # renormalized over top-k
    mass_before = probs.cumsum(dim=-1) - probs  # exclusive prefix mass
    keep &= (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)  # nucleus
    keep[:, 0] = True  # the most likely token always stays (even if top_p rounded to 0)
    return sorted_ids, probs * keep, keep


def sampling_probs(logits: Tensor, params_list: list[SamplingParams]) -> Tensor:
    """The exact next-token distribution `sample` draws from, per row, over token ids: (B, V) fp32 summing
    to 1 (temperature, top-k, top-p applied; a greedy row is one-hot at its argmax). What speculative
    verification's rejection rule takes as the target p (`engine/speculative.py`)."""
    if logits.dim() != 2 or len(params_list) != logits.size(0):
        raise ValueError(f"sampling_probs: logits (B, V) with B params, got {tuple(logits.shape)}, {len(params_list)}")
    logits = logits.float()
    out = torch.zeros_like(logits)
    greedy = [i for i, p in enumerate(params_list) if p.greedy]
    if greedy:
        index = torch.tensor(greedy, device=logits.device)
        out[index, logits[index].argmax(dim=-1)] = 1.0
    rows = [i for i, p in enumerate(params_list) if not p.greedy]
    if rows:
        sorted_ids, probs, _ = _filtered_sorted(logits[rows], [params_list[i] for i in rows])
        probs = probs / probs.sum(dim=-1, keepdim=True)
        out[torch.tensor(rows, device=logits.device)] = torch.zeros_like(probs).scatter(1, sorted_ids, probs)
    return out


def token_logprobs(logits: Tensor, tokens: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """Log-probabilities as OpenAI reports them: of the *unmodified* logits (no temperature, top-k, top-p).

    logits (B, V), tokens (B,) → logprob (B,) of each row's token, top_ids (B, k) and top_logprobs (B, k),
    the k most likely tokens in descending order (ties: the lower id first). fp32 log_softmax."""
    if logits.dim() != 2 or tokens.shape != logits.shape[:1]:
        raise ValueError(f"token_logprobs: logits (B, V) and tokens (B,), got {tuple(logits.shape)} and "
                         f"{tuple(tokens.shape)}")
    if not 0 <= k <= min(MAX_LOGPROBS, logits.size(1)):
        raise ValueError(f"token_logprobs: k must be in [0, {min(MAX_LOGPROBS, logits.size(1))}], got {k}")
    logp = logits.float().log_softmax(dim=-1)  # (B, V)
    chosen = logp.gather(1, tokens.long().unsqueeze(1)).squeeze(1)  # (B,)
    if k == 0:
        empty = logp.new_empty(logp.size(0), 0)
        return chosen, empty.long(), empty
    top_lp, top_ids = logp.sort(dim=-1, descending=True, stable=True)  # (B, V): ties keep the lower id first
    return chosen, top_ids[:, :k], top_lp[:, :k]


def finish_reason(token_id: int, num_generated: int, params: SamplingParams) -> FinishReason | None:
    """Why a request ends after sampling `token_id` as its `num_generated`-th token (None: it goes on)."""
    if token_id in params.stop_token_ids:
        return "stop"
    if num_generated >= params.max_tokens:
        return "length"
    return None


class StopChecker:
    """Per-request finish bookkeeping: feed each sampled token to `update`.

    `output_token_ids` are the tokens shown to the user (a final stop token excluded);
    `num_generated` counts every sampled token (a final stop token included)."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.num_generated = 0
        self.output_token_ids: list[int] = []
        self.finish_reason: FinishReason | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, token_id: int) -> FinishReason | None:
        """Record one sampled token; returns the finish reason once the request is over."""
        if self.finished:
            raise RuntimeError(f"StopChecker.update: the request already finished ({self.finish_reason})")
        self.num_generated += 1
        self.finish_reason = finish_reason(token_id, self.num_generated, self.params)
        if self.finish_reason != "stop":
            self.output_token_ids.append(token_id)
        return self.finish_reason
