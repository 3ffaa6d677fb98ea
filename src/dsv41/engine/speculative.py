"""Speculative decoding: a drafter proposes, the main model verifies k + 1 positions in one forward.

The loop (SPEC §5 DSpark; issue 19), one engine step for a batch of decoding sequences:
  1. the `Drafter` proposes k tokens per sequence after its pending token, with a confidence per
     position (its estimate of the conditional acceptance probability);
  2. `choose_lengths` picks each sequence's verification length L ≤ k to maximise expected tokens
     per second: expected accepted drafts = Σ_l Π_{j≤l} c_j (prefix survival), step time = the
     engine's `StepTimeCurve` (profiled once at start-up) of the tokens the forward computes;
  3. the main model runs [pending, d_1 … d_L] through every layer and every cache in one forward
     (`Runner.forward` over T = max L + 1 positions; shorter rows are padded with their own later
     drafts, which are never accepted) — window rings, partial compressor groups, packed FP4
     entries and index keys, Engram history all advance;
  4. `verify` keeps the accepted prefix: greedy = exact match with the main model's argmax;
     sampled = the standard rejection rule (accept x with min(1, p(x)/q(x)), else draw from
     norm(max(0, p − q)); all accepted → a bonus token from p), p being exactly the distribution
     plain sampling draws from (`sampling.sampling_probs`: temperature, top-k, top-p), so the
     output distribution equals plain sampling;
  5. `VerifyRollback` undoes everything the rejected positions wrote: the small per-slot state is
     snapshotted before the forward and restored (the ring slots the block overwrote, their
     positions, the partial groups — rebuilt from the kept tokens' projections), and the
     append-only entries are truncated (`SequenceCache.truncate`: write-then-truncate). After it,
     every byte a later step can read equals a run that never saw the rejected tokens
     (tests/engine/test_speculative.py byte-compares them).

Drafters: `OracleDrafter` (a copy of the main model decoding greedily through its own caches — the
main model's own continuation, so greedy verification accepts everything) and `NoisyDrafter`
(random tokens, or another drafter's proposals corrupted at random positions, with confidences and
optionally a proposal distribution) cover full, partial and no acceptance without training. The
trained DSpark drafter (`model/dspark.py`, its own helper) plugs in through the same protocol.
"""

from __future__ import annotations

import bisect
import copy
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from dsv41.engine.block_manager import BlockManager, to_device
from dsv41.engine.cache import SequenceCache
from dsv41.engine.prefill import PrefillJob
from dsv41.engine.rollback import RollbackState
from dsv41.engine.runner import Runner
from dsv41.engine.sampling import SamplingParams, host_uniforms, sampling_probs
from dsv41.model.transformer import Transformer


class SpeculativeError(ValueError):
    """A speculative set-up that cannot run (no drafter checkpoint, a drafter that breaks the protocol)."""


# ---------------------------------------------------------------------------------------------- protocol
@dataclass
class Proposal:
    tokens: Tensor  # (B, k) long: drafted tokens after each sequence's pending token
    confidence: Tensor  # (B, k) float in [0, 1]: estimated acceptance of position l given l − 1 accepted
    probs: Tensor | None = None  # (B, k, V) the distribution each draft was drawn from; None = deterministic


class Drafter(Protocol):
    """What the engine needs of a drafter (agreed with the DSpark helper).

    `observe` receives the committed tokens (n,) and, per wanted layer, the main model's hidden state at
    those positions (m, dim) — the mean over mHC streams of the block's output (or input, when the
    drafter has `features_at = "input"`). m = n after a verification; after a prefill m ≤ n covers the
    last m tokens (encoder-only prefill runs the decoder over the last n_win prompt tokens only).
    Optional: `pure_propose` (True when `propose` draws nothing at random and changes no state: the engine then
    launches a proposal before it knows it will use it), `observe_many`, `observe_many_skips` (True: `observe_many`
    takes `skip`, positions that fell out of the window before a row's block — the engine's catch-up of rows a
    window or more behind then goes in the same call), `warm_up`, `features_at`."""

    k: int  # tokens proposed per step (dspark_block_size − 1)

    def features_wanted(self) -> list[int]: ...

    def start(self, seq_id: int) -> None: ...

    def observe(self, seq_id: int, tokens: Tensor, features: dict[int, Tensor]) -> None: ...

    def propose(self, seq_ids: list[int], last_tokens: Tensor) -> Proposal: ...

    def finish(self, seq_id: int) -> None: ...


# ---------------------------------------------------------------------------------------------- step time
@dataclass
class StepTimeCurve:
    """Seconds of one verification forward as a function of the tokens it computes (rows × positions):
    piecewise linear through the profiled points, flat below the first (and everywhere with one point),
    extrapolated from the last two above the last. Profiled once at engine start-up (`profile_step_time`),
    kept on the engine."""

    points: list[tuple[int, float]]  # (tokens, seconds), increasing tokens

    def __post_init__(self) -> None:
        merged: dict[int, list[float]] = {}
        for n, t in self.points:
            merged.setdefault(int(n), []).append(float(t))
        self.points = sorted((n, sum(ts) / len(ts)) for n, ts in merged.items())
        if not self.points or any(n < 1 or not t > 0 for n, t in self.points):
            raise ValueError(f"StepTimeCurve needs points (tokens >= 1, seconds > 0), got {self.points}")

    def __call__(self, n_tokens: int) -> float:
        xs = [n for n, _ in self.points]
        if n_tokens <= xs[0] or len(xs) == 1:  # one point: flat
            return self.points[0][1]
        i = min(max(bisect.bisect_left(xs, n_tokens), 1), len(xs) - 1)
        (x0, y0), (x1, y1) = self.points[i - 1], self.points[i]
        return max(y0 + (y1 - y0) * (n_tokens - x0) / (x1 - x0), 1e-9)

    def to_dict(self) -> dict:
        return {"tokens": [n for n, _ in self.points], "seconds": [t for _, t in self.points]}


class CostModel:
    """`speculate="auto"`: per batch bucket, whether a speculative step emits more tokens per second than a
    plain one — both measured on whole steps (wall time per row). A bucket's first step of each kind is not
    counted (it captures graphs); the time of a kind is the median of its last `window` counted steps (robust
    to a step that captured another graph, or caught the drafter up); tokens per row of speculative steps are a
    moving average over every bucket (acceptance depends on the text, not the batch), or the mean of the
    batch's rows' own averages where they have one. It drafts until a bucket has `warmup` counted speculative
    steps; until a plain step is counted there, `plain_estimate` stands for it (another bucket's measured plain
    steps scaled by the profiled step-time curve, or the curve); after `probe_every` plain steps in a row it drafts
    once again (acceptance changes). A probe that does not turn the decision doubles the wait before the next one in
    its bucket (up to `probe_max`: a probe costs about two plain steps at batch 64 — 9.05 vs 5.09 ms on 2026-12-03 —,
    so one every 33 steps added 2.4 % to a batch that stays plain), or makes it longer still where the probe lost
    more than `probe_budget` of the plain steps' time until the next one would (its time less its tokens' time at the
    plain rate: on the H100 on 2026-12-07 a probe of 64 rows after a long plain run took 13–14.5 ms for ~180
    tokens, ~9 ms more than plain steps, and the lean steps before it stored the features of a window again —
    doubling alone put three such probes into a closed batch of 1,024 tokens, ~2 % of its time); a decision to
    draft on the measurements brings it back to `probe_every`."""

    def __init__(self, step_time: Callable[[int], float], *, warmup: int = 2, window: int = 5,
                 probe_every: int = 32, probe_max: int = 1024, smoothing: float = 0.1,
                 probe_budget: float | None = 0.01):
        self.step_time, self.warmup, self.window = step_time, warmup, window
        self.probe_every, self.probe_max, self.smoothing = probe_every, max(probe_max, probe_every), smoothing
        if probe_budget is not None and not probe_budget > 0:
            raise ValueError(f"probe_budget must be > 0 or None, got {probe_budget!r}")
        self.probe_budget = probe_budget
        self.reset()

    def reset(self) -> None:
        self.times: dict[tuple[str, int], list[float]] = {}  # (kind, bucket) → last counted s per row
        self.steps: dict[tuple[str, int], int] = {}  # (kind, bucket) → steps seen, the uncounted first included
        self.tokens: float | None = None  # tokens per row of a speculative step, moving average
        self.plain_run: dict[int, int] = {}  # bucket → plain steps since its last speculative one
        self.probe_gap: dict[int, int] = {}  # bucket → plain steps in a row before its next probe
        # (kind, bucket, rows, s, tokens) of the last steps, for benchmarks; bounded for a long-running server
        self.timeline: deque[tuple[str, int, int, float, int]] = deque(maxlen=4096)

    def record(self, kind: str, bucket: int, rows: int, seconds: float, tokens: int, *, mixed: bool = False) -> None:
        """One step of `kind` at `bucket`. mixed: the step ran while the device still worked on prefill pieces queued
        before it (its wall time holds theirs): it counts as a step (probes, the timeline) and its time is kept only
        while its kind and bucket have fewer than `warmup` times (measuring must end under steady prefill) — on the
        H100 on 2026-12-07 such steps of 64 rows took 2.4 ms plain and 8.7 ms speculative against 1.5 and ~5.5
        beside no prefill, which made drafting look better than it was (the mean rule divides each by its tokens)."""
        if kind not in ("spec", "plain"):
            raise ValueError(f"kind must be 'spec' or 'plain', got {kind!r}")
        key = (kind, bucket)
        self.timeline.append((kind, bucket, rows, seconds, tokens))
        self.steps[key] = self.steps.get(key, 0) + 1
        gap = self.probe_gap.get(bucket, self.probe_every)
        if kind == "spec" and self.plain_run.get(bucket, 0) >= gap:  # a probe: the next one waits twice as long
            self.probe_gap[bucket] = min(self._next_gap(gap, bucket, rows, seconds, tokens), self.probe_max)
            # (a decision to draft resets it)
        self.plain_run[bucket] = self.plain_run.get(bucket, 0) + 1 if kind == "plain" else 0
        if self.steps[key] == 1:
            return  # the first step of a kind captures graphs
        if mixed and len(self.times.get(key, [])) >= self.warmup:
            return
        self.times[key] = (self.times.get(key, []) + [seconds / rows])[-self.window:]
        if kind == "spec":
            n = tokens / rows
            self.tokens = n if self.tokens is None else (1 - self.smoothing) * self.tokens + self.smoothing * n

    def _next_gap(self, gap: int, bucket: int, rows: int, seconds: float, tokens: int) -> int:
        """The wait after a probe of `rows` rows that took `seconds` for `tokens`: twice `gap`, or the plain steps
        whose time the probe's loss is `probe_budget` of (loss: its time less its tokens' at the plain rate)."""
        per_token = self.plain_estimate(bucket)  # a plain step emits a token per row
        if self.probe_budget is None or not per_token > 0:
            return 2 * gap
        loss = seconds - tokens * per_token
        return max(2 * gap, math.ceil(loss / (self.probe_budget * rows * per_token)))

    @staticmethod
    def row_average(previous: float | None, tokens: int) -> float:
        """A sequence's tokens per verification (`Sequence.spec_tokens`) after one more verification."""
        return float(tokens) if previous is None else 0.7 * previous + 0.3 * tokens

    def median(self, kind: str, bucket: int) -> float | None:
        ts = sorted(self.times.get((kind, bucket), []))
        if not ts:
            return None
        mid = len(ts) // 2
        return ts[mid] if len(ts) % 2 else 0.5 * (ts[mid - 1] + ts[mid])

    def worth_drafting(self, bucket: int, rows: Sequence[float | None] | None = None,
                       remaining: Sequence[int] | None = None) -> bool:
        """rows: each row's own tokens per verification so far (None: none yet — the average stands for it);
        the batch's mean is what a speculative step is expected to emit (the rows left at the end of a run
        are often the ones whose drafts fail).

        remaining (with rows; the engine passes it when no request waits: the batch drains): each row's tokens
        still to generate. Then what counts is when the batch's last row finishes, not its tokens per second:
        drafting goes on only while the slowest row to finish would finish sooner with it — the most steps any
        row still needs, remaining / tokens per verification, at the speculative step's time, against the most
        remaining tokens at the plain step's (the steps' sizes as now; as rows finish the steps only get
        cheaper). A row whose drafts keep failing then stops the batch drafting, where the mean would keep it
        drafting at about twice the plain step's cost per token for that row (issue 19's closed batch of 64).
        A draining batch does not measure a bucket it shrinks into: there a speculative step's time is a measured
        bucket's scaled by the step-time curve (`spec_estimate`) — the tail of a closed batch is too short for
        measurements to pay (2026-12-07, H100: three measuring steps per new bucket at ~2× a plain step's time,
        each emitting fewer tokens per row than it cost). It probes only while its slowest row has at least
        twice the probe's wait left: a lone stream that started with poorly drafted text (2026-12-07, H100,
        batch 1: 1.8 tokens per verification over its first 7 steps) otherwise stayed plain to its end — 245
        plain steps, 0.95× — as every request does whenever nothing else waits."""
        draining = rows is not None and remaining is not None
        t_spec = self.median("spec", bucket) if len(self.times.get(("spec", bucket), [])) >= self.warmup else None
        if draining and t_spec is None and self.tokens is not None:
            t_spec = self.spec_estimate(bucket)
        if t_spec is None or self.tokens is None:
            return True  # measure it
        gap = self.probe_gap.get(bucket, self.probe_every)
        if self.plain_run.get(bucket, 0) >= gap and (not draining or max(remaining) >= 2 * gap):
            return True  # probe (draining: only while the slowest row has tokens left for a winning one to pay)
        t_plain = self.plain_estimate(bucket)
        if rows and remaining is not None:
            if len(remaining) != len(rows):
                raise ValueError(f"remaining has {len(remaining)} rows, rows has {len(rows)}")
            # (comprehensions without per-row calls: this runs before every overlapped plain step of a draining batch)
            average = max(self.tokens, 1.0)
            verifications = [r / (average if n is None else n if n > 1.0 else 1.0) for r, n in zip(remaining, rows)]
            draft = max(verifications) * t_spec < max(remaining) * t_plain
        else:
            draft = self._mean_rate(rows) / t_spec > 1 / t_plain
        if draft:
            self.probe_gap.pop(bucket, None)
        return draft

    def _mean_rate(self, rows: Sequence[float | None] | None) -> float:
        """Tokens per row of a speculative step of these rows: their own averages (None: the moving average)."""
        if not rows:
            return self.tokens
        return sum(self.tokens if n is None else n for n in rows) / len(rows)

    def drafts_at(self, bucket: int, rows: Sequence[float | None] | None = None) -> bool | None:
        """Whether a batch of `bucket` rows drafting these rows' tokens would emit more tokens per second than plain
        steps, on the measurements alone (no probing, no measuring): the batch the engine's rows grow into while
        prompts prefill or wait for a slot (`Engine._worth_drafting`). None where the bucket's speculative steps
        are not measured (fewer than `warmup` counted)."""
        if self.tokens is None or len(self.times.get(("spec", bucket), [])) < self.warmup:
            return None
        return self._mean_rate(rows) / self.median("spec", bucket) > 1 / self.plain_estimate(bucket)

    def plain_ahead(self, bucket: int, slowest: int | None = None) -> float:
        """Plain steps `bucket` takes before it next drafts, as far as its measurements tell: the probe's wait less
        the plain steps since its last speculative step — 0 where its speculative steps are not measured yet (it
        would draft to measure them) or its last step drafted; infinite for a draining batch whose slowest row
        (`slowest`: the most tokens a row has left) has less than twice the wait left, which never probes again
        (`worth_drafting`). A decision to draft may still come sooner (a batch that drains, measurements that
        change): the engine's lean plain steps are ready for that (`Engine._lean`)."""
        run = self.plain_run.get(bucket, 0)
        if not run or len(self.times.get(("spec", bucket), [])) < self.warmup:
            return 0
        gap = self.probe_gap.get(bucket, self.probe_every)
        if slowest is not None and slowest < 2 * gap:
            return float("inf")
        return gap - run

    def plain_estimate(self, bucket: int) -> float:
        """Seconds per row of a plain step at `bucket`: its measured median; else the nearest measured bucket's
        scaled by the step-time curve (as `spec_estimate`); else the curve itself — profiled on synchronized
        steps, it runs slower than the engine's overlapped plain steps (H100, 64 rows: 2.9 against 1.5 ms)."""
        t = self.median("plain", bucket)
        if t is None:
            t = self._scaled("plain", bucket, 1)
        return self.step_time(bucket) / bucket if t is None else t

    def spec_estimate(self, bucket: int) -> float | None:
        """Seconds per row of a speculative step at `bucket` where none is counted: the nearest measured
        bucket's (its warm-up done), times the step-time curve's plain seconds per row at `bucket` over those at
        that bucket (speculative and plain steps grow alike with the batch). None when no bucket is measured."""
        return self._scaled("spec", bucket, self.warmup)

    def _scaled(self, kind: str, bucket: int, counted: int) -> float | None:
        """The median seconds per row of `kind` at the bucket nearest `bucket` with at least `counted` times,
        scaled by the step-time curve's plain seconds per row from there to `bucket`; None where none has."""
        measured = [b for (k, b), ts in self.times.items() if k == kind and len(ts) >= counted]
        if not measured:
            return None
        near = min(measured, key=lambda b: (abs(b - bucket), b))
        per_row = lambda b: self.step_time(b) / b  # noqa: E731
        return self.median(kind, near) * per_row(bucket) / per_row(near)

    def summary(self) -> dict:
        """Per (kind, bucket): the median s per row and the steps seen; the speculative tokens per row."""
        out: dict = {f"{kind} @ batch {b}": {"s_per_row": self.median(kind, b), "steps": n}
                     for (kind, b), n in sorted(self.steps.items())}
        out["spec tokens_per_row"] = self.tokens
        return out


def expected_accepted(confidence: Sequence[float], length: int) -> float:
    """Expected accepted drafts of a verification of `length`: Σ_{l ≤ length} Π_{j ≤ l} c_j."""
    total, survive = 0.0, 1.0
    for c in confidence[:length]:
        survive *= min(max(float(c), 0.0), 1.0)
        total += survive
    return total


def choose_lengths(confidences: Sequence[Sequence[float]], caps: Sequence[int],
                   step_time: Callable[[int], float], *, padded: bool = True) -> list[int]:
    """Verification length per sequence maximising expected tokens per second of the step:
    (Σ_b 1 + E_b(L_b)) / step_time(tokens computed). Each row emits its accepted drafts plus one token.

    padded=True (the engine's runner): the forward computes B × (max L + 1) tokens, so a row verifies
    min(T, cap) and only the batch's T is chosen. padded=False (a ragged forward): Σ (L_b + 1) tokens;
    the increments Π_{j≤l} c_j are non-increasing within a row, so for each total the best lengths take
    the largest increments (prefixes of every row) — scanned over every total. Ties go to less work."""
    B = len(caps)
    if B == 0:
        return []
    caps = [max(0, int(c)) for c in caps]
    gains = [[expected_accepted(conf, length) for length in range(cap + 1)] for conf, cap in zip(confidences, caps)]
    if padded:
        best, best_T = -1.0, 0
        for T in range(max(caps) + 1):
            tokens = B + sum(g[min(T, len(g) - 1)] for g in gains)
            rate = tokens / step_time(B * (T + 1))
            if rate > best * (1 + 1e-12):
                best, best_T = rate, T
        return [min(best_T, cap) for cap in caps]
    increments = sorted(((g[lv] - g[lv - 1], lv, b) for b, g in enumerate(gains) for lv in range(1, len(g))),
                        key=lambda x: (-x[0], x[1], x[2]))
    best, best_n, tokens = B / step_time(B), 0, float(B)
    for n, (inc, _, _) in enumerate(increments, start=1):
        tokens += inc
        rate = tokens / step_time(B + n)
        if rate > best * (1 + 1e-12):
            best, best_n = rate, n
    lengths = [0] * B
    for _, _, b in increments[:best_n]:
        lengths[b] += 1
    return lengths


# ---------------------------------------------------------------------------------------------- rollback
class VerifyRollback:
    """Snapshot of the per-slot state a verification block of T positions overwrites, for B rows (the
    host-driven verification; the static one snapshots inside its step, `DecodeIO(rollback=True)`).

    Taken before the forward: the T ring slots of every layer (FP8 rows and positions) and the partial
    groups of every ratio-m source (`rollback.RollbackState`). `restore(keep)` then makes each row look as
    if only its first keep[b] block tokens had run: ring slots of the dropped positions get their old rows
    back, the partial group is rebuilt for the new token count (older members from the snapshot, kept
    members from the forward's projections), and the cache is truncated (entries, index keys, tokens, pages)."""

    def __init__(self, pools: BlockManager, caches: list[SequenceCache], starts: list[int], T: int):
        self.pools, self.caches, self.T, self.starts = pools, caches, T, list(starts)
        self.state = RollbackState(pools, max(len(caches), 1), T)
        device = pools.device
        self.slots = torch.tensor([c.slot for c in caches], device=device)
        self.starts_t = torch.tensor(starts, device=device)
        self.state.snapshot(self.slots, self.starts_t)

    def restore(self, keep: list[int], projections: dict[int, tuple[Tensor, Tensor]]) -> None:
        """Keep the first keep[b] ∈ [0, T] block tokens of row b. `projections`: source → (kv, score)
        (B, T, D) of the block (`Capture.kv_projections`), needed when a kept token joins a partial group."""
        for s, p in self.pools.sources.items():
            if p.pending_kv is None or s in projections:
                continue
            m = p.ratio
            if any((start + n) % m and n for start, n in zip(self.starts, keep)):  # a live member ran in the block
                raise ValueError(f"restore: source {s} needs the block's projections to rebuild its partial group")
        projections = dict(projections)
        for s, (kv, _) in self.state.pending.items():  # sources no kept token joined: the snapshot is whole
            projections.setdefault(s, (kv.new_zeros(len(self.caches), self.T, kv.size(-1)),) * 2)
        self.state.restore(self.slots, self.starts_t, torch.tensor(keep, device=self.pools.device), projections)
        for cache, start, n in zip(self.caches, self.starts, keep):
            cache.truncate(start + n)


# ---------------------------------------------------------------------------------------------- verification
@dataclass
class Verdict:
    accepted: int  # drafts accepted (0..L)
    tokens: list[int]  # the accepted drafts, then the correction / bonus token (accepted + 1 tokens)


def _draw(probs: Tensor, u: Tensor) -> Tensor:
    """One token per row from probability rows (R, V) by inverting their CDFs at uniforms u (R,), never
    past a row's last nonzero entry (rounding guard)."""
    cdf = probs.double().cumsum(dim=-1)  # (R, V)
    index = torch.searchsorted(cdf, (u.double() * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)  # (R,)
    V = probs.size(-1)
    last = V - 1 - (probs > 0).flip(-1).int().argmax(dim=-1)  # (R,) last token with mass
    return torch.minimum(index, last)


def rejection_residual(p: Tensor, q: Tensor | None, x: int) -> Tensor:
    """What a rejected draft x is replaced by: norm(max(0, p − q)) (q None: the draft was deterministic,
    q = δ_x). When p ≤ q everywhere a rejection has probability 0; p is returned then."""
    residual = p.clone() if q is None else (p - q.to(p)).clamp(min=0)
    if q is None:
        residual[x] = 0.0
    total = residual.sum()
    return residual / total if float(total) > 0 else p / p.sum()


def verify(logits: Tensor, drafts: list[list[int]], lengths: list[int], params: list[SamplingParams],
           generators: list[torch.Generator | None], draft_probs: Tensor | None = None, *,
           greedy_ids: list[list[int]] | None = None) -> list[Verdict]:
    """Acceptance for each row: logits (B, T, V) of the verified positions (position l predicts the token
    after draft l), drafts[b][:lengths[b]] the drafted tokens, draft_probs (B, k, V) their distributions
    (None: deterministic drafts, q = one-hot). Greedy rows: exact match with the argmax (no random draw).
    Sampled rows: the rejection rule against p = `sampling_probs` (what plain sampling draws from): draft l
    is accepted iff u_l · q(x) < p(x), i.e. with probability min(1, p(x)/q(x)); the first rejected one is
    replaced by a draw from `rejection_residual`, or after L acceptances a bonus token is drawn from p_L.
    A sampled row takes L + 1 uniforms from its generator per verification (the last one for that draw).
    greedy_ids: logits.argmax(-1) as (B, T) lists when the caller has fetched it already (one transfer fewer)."""
    B, T, V = logits.shape
    out: list[Verdict | None] = [None] * B
    if greedy_ids is None:
        greedy_ids = logits.argmax(dim=-1).tolist()  # (B, T): ties to the lowest id, as `sample`
    sampled = []
    for b, (prm, L) in enumerate(zip(params, lengths)):
        d = drafts[b][:L]
        if not prm.greedy:
            sampled.append(b)
            continue
        a = 0
        while a < L and d[a] == greedy_ids[b][a]:
            a += 1
        out[b] = Verdict(a, d[:a] + [greedy_ids[b][a]])
    if not sampled:
        return out  # type: ignore[return-value]
    device = logits.device
    rows = torch.tensor(sampled, device=device)
    S = len(sampled)
    p = sampling_probs(logits[rows].reshape(S * T, V), [params[b] for b in sampled for _ in range(T)])
    p = p.view(S, T, V)  # (S, T, V)
    x = torch.tensor([(drafts[b] + [0] * T)[:T - 1] for b in sampled], device=device).view(S, T - 1)  # (S, T − 1)
    px = p[:, :T - 1].gather(2, x.unsqueeze(-1)).squeeze(-1)  # (S, T − 1)
    q = None
    if draft_probs is not None:
        q = draft_probs[rows, :T - 1].to(p)  # (S, T − 1, V)
        qx = q.gather(2, x.unsqueeze(-1)).squeeze(-1)
    else:
        qx = torch.ones_like(px)
    # L + 1 host draws per row (zero-padded to T), one copy for the batch
    u = to_device([(host_uniforms(generators[b], lengths[b] + 1, torch.float64) + [0.0] * T)[:T] for b in sampled],
                  device, torch.float64)  # (S, T)
    ok = (u[:, :T - 1] * qx.double() < px.double()).tolist()  # (S, T − 1)
    u_l = u.tolist()
    accepted, final_rows, final_u = [], [], []
    for i, b in enumerate(sampled):
        L = lengths[b]
        a = 0
        while a < L and ok[i][a]:
            a += 1
        accepted.append(a)
        if a < L:  # rejected: norm(max(0, p − q)) at position a
            r = rejection_residual(p[i, a], None if q is None else q[i, a], int(x[i, a]))
        else:
            r = p[i, L]  # every draft accepted: the bonus token from p
        final_rows.append(r)
        final_u.append(u_l[i][L])
    finals = _draw(torch.stack(final_rows), torch.tensor(final_u, device=device)).tolist()
    for i, b in enumerate(sampled):
        a = accepted[i]
        out[b] = Verdict(a, drafts[b][:a] + [finals[i]])
    return out  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------- drafters
class OracleDrafter:
    """The main model's own greedy continuation: a copy of the model decodes k tokens through its own
    pools (same runner, same encoder-only prefill), then rolls its caches back. Greedy verification
    accepts everything (up to float ties); it costs a second model, so it tests the mechanism, not speed."""

    features_at = "output"

    def __init__(self, model: Transformer, k: int = 4, *, max_sequences: int = 64, max_seq_len: int | None = None,
                 clone: bool = True, confidence: float = 1.0):
        if k < 1:
            raise ValueError(f"OracleDrafter: k must be >= 1, got {k}")
        self.model = copy.deepcopy(model) if clone else model
        self.k, self.confidence = k, confidence
        c = self.model.config
        device = next(self.model.parameters()).device
        n = int(max_seq_len or c.max_seq_len)
        self.pools = BlockManager(c, device, max_slots=max_sequences, max_tokens=n * max_sequences, max_seq_len=n)
        self.runner = Runner(self.model)
        self.caches: dict[int, SequenceCache] = {}

    def features_wanted(self) -> list[int]:
        return []

    def start(self, seq_id: int) -> None:
        self.caches[seq_id] = SequenceCache(self.model.config, pools=self.pools)

    @torch.no_grad()
    def observe(self, seq_id: int, tokens: Tensor, features: dict[int, Tensor]) -> None:
        cache = self.caches[seq_id]
        ids = [int(t) for t in tokens.tolist()]
        if cache.n_tokens == 0:  # the prompt: the engine's own prefill path
            job = PrefillJob(self.runner, cache, ids, chunk=max(len(ids), 1))
            while job.step() is None:
                pass
            return
        self.runner.forward([cache], torch.tensor([ids], device=self.pools.device), [cache.n_tokens],
                            range(self.model.config.n_layers))
        cache.tokens.extend(ids)

    @torch.no_grad()
    def propose(self, seq_ids: list[int], last_tokens: Tensor) -> Proposal:
        caches = [self.caches[i] for i in seq_ids]
        starts = [c.n_tokens for c in caches]
        rollback = VerifyRollback(self.pools, caches, starts, self.k)
        token = last_tokens.to(self.pools.device).view(-1, 1)  # (B, 1)
        drafted = []
        for _ in range(self.k):
            h, pre_mix = self.runner.forward(caches, token, [c.n_tokens for c in caches],
                                             range(self.model.config.n_layers))
            for c, t in zip(caches, token[:, 0].tolist()):
                c.tokens.append(t)
            token = self.runner.logits(h, pre_mix).argmax(dim=-1, keepdim=True)  # (B, 1)
            drafted.append(token)
        rollback.restore([0] * len(caches), {})
        tokens = torch.cat(drafted, dim=1)  # (B, k)
        return Proposal(tokens, torch.full(tokens.shape, self.confidence, device=tokens.device))

    def finish(self, seq_id: int) -> None:
        cache = self.caches.pop(seq_id, None)
        if cache is not None and not cache.released:
            cache.release()


class NoisyDrafter:
    """Random drafts, or another drafter's drafts replaced at random positions with probability `noise`.

    confidence = 1 − noise where the base is kept (the base's confidence times it), `floor` elsewhere —
    or, with `distribution=True`, every draft is *sampled* from a random proposal distribution q
    (a softmax of random logits, with the base's token boosted by `boost`) that is returned as
    `probs`, so the sampled rejection rule sees a genuine q. Reproducible from `seed`."""

    def __init__(self, vocab_size: int, k: int = 4, *, base: Drafter | None = None, noise: float = 1.0,
                 seed: int = 0, distribution: bool = False, boost: float = 3.0, floor: float = 0.05):
        if base is not None and base.k != k:
            raise ValueError(f"NoisyDrafter: k = {k} but the base drafter proposes {base.k}")
        self.vocab_size, self.k, self.base, self.noise = vocab_size, k, base, noise
        self.distribution, self.boost, self.floor = distribution, boost, floor
        self.generator = torch.Generator().manual_seed(seed)
        self.features_at = getattr(base, "features_at", "output")

    def features_wanted(self) -> list[int]:
        return self.base.features_wanted() if self.base is not None else []

    def start(self, seq_id: int) -> None:
        if self.base is not None:
            self.base.start(seq_id)

    def observe(self, seq_id: int, tokens: Tensor, features: dict[int, Tensor]) -> None:
        if self.base is not None:
            self.base.observe(seq_id, tokens, features)

    def finish(self, seq_id: int) -> None:
        if self.base is not None:
            self.base.finish(seq_id)

    def propose(self, seq_ids: list[int], last_tokens: Tensor) -> Proposal:
        B, k, V, g = len(seq_ids), self.k, self.vocab_size, self.generator
        device = last_tokens.device
        if self.base is not None:
            base = self.base.propose(seq_ids, last_tokens)
            tokens, conf = base.tokens.cpu().clone(), base.confidence.float().cpu().clone()
        else:
            tokens, conf = torch.randint(0, V, (B, k), generator=g), torch.ones(B, k)
        replace = torch.rand(B, k, generator=g) < self.noise
        if not self.distribution:
            tokens = torch.where(replace, torch.randint(0, V, (B, k), generator=g), tokens)
            conf = torch.where(replace, torch.full_like(conf, self.floor), conf * (1 - self.noise))
            return Proposal(tokens.to(device), conf.to(device))
        logits = torch.randn(B, k, V, generator=g)  # (B, k, V)
        logits.scatter_add_(2, tokens.unsqueeze(-1), torch.where(replace, 0.0, self.boost).unsqueeze(-1))
        probs = logits.softmax(dim=-1)
        drawn = torch.multinomial(probs.view(-1, V), 1, generator=g).view(B, k)
        conf = probs.gather(2, drawn.unsqueeze(-1)).squeeze(-1).clamp(self.floor, 1.0)
        return Proposal(drawn.to(device), conf.to(device), probs.to(device))


# ---------------------------------------------------------------------------------------------- start-up
@dataclass
class SpeculativeStats:
    """Per-engine speculation counters (`Engine.stats.speculative`): a histogram of accepted drafts per
    verification (index a = a drafts accepted), verified and accepted drafts, emitted tokens."""

    k: int = 0
    verifications: int = 0  # sequence-steps verified
    forwards: int = 0  # verification forwards
    drafted: int = 0  # drafts verified (Σ L)
    accepted: int = 0  # drafts accepted (Σ a)
    emitted: int = 0  # tokens emitted by verifications (Σ a + 1, truncated at a finish)
    plain_steps: int = 0  # steps decoded plainly instead (the cost model, `Engine(speculate="auto")`, or no draft)
    plain_tokens: int = 0  # tokens those steps emitted
    prelaunched: int = 0  # verifications whose proposal (only) was launched at the end of the step before (`_chain`)
    chained: int = 0  # verifications launched at the end of the step before (`Engine._chain`)
    chain_cancelled: int = 0  # of those, undone before use (a row aborted or taken out of the schedule)
    histogram: list[int] = field(default_factory=list)  # histogram[a] = verifications with a accepted
    length_histogram: list[int] = field(default_factory=list)  # histogram of the chosen verification lengths

    def record(self, length: int, accepted: int, emitted: int) -> None:
        for hist, v in ((self.histogram, accepted), (self.length_histogram, length)):
            while len(hist) <= max(v, self.k):
                hist.append(0)
            hist[v] += 1
        self.verifications += 1
        self.drafted += length
        self.accepted += accepted
        self.emitted += emitted

    @property
    def mean_accepted(self) -> float:
        """Mean accepted drafts per verification."""
        return self.accepted / self.verifications if self.verifications else 0.0

    @property
    def mean_tokens_per_verification(self) -> float:
        """Mean acceptance length as the DSpark paper counts it: accepted drafts + the one token every
        verification emits."""
        return (self.accepted + self.verifications) / self.verifications if self.verifications else 0.0

    def summary(self) -> str:
        rate = self.accepted / self.drafted if self.drafted else 0.0
        return (f"speculative: {self.verifications} verifications, {self.mean_tokens_per_verification:.2f} "
                f"tokens/verification, {self.accepted}/{self.drafted} drafts accepted ({rate:.0%}), "
                f"{self.plain_steps} plain steps, "
                f"accepted histogram {self.histogram}")


@torch.no_grad()
def profile_step_time(run: Callable[[list[SequenceCache], list[list[int]]], dict], pools: BlockManager, config, *,
                      k: int, batch_sizes: list[int], context: int = 16, repeats: int = 2) -> StepTimeCurve:
    """Time the engine's static steps of B rows × T positions (T ∈ {1, k + 1}, B in `batch_sizes`, capped by
    the free slots) on throw-away sequences of `context` tokens, each rolled back after timing; the median
    of `repeats` per shape. `run(caches, block)` is one step (the engine's `_timed_static_step`: graph
    replay on GPUs) that syncs and returns the step's compressor projections. Run it at start-up."""
    B_max = min(max(batch_sizes), pools.free_slots)
    sizes = sorted({min(b, B_max) for b in batch_sizes})
    g = torch.Generator().manual_seed(0)
    caches = [SequenceCache(config, pools=pools) for _ in range(B_max)]
    try:
        prompt = torch.randint(3, config.vocab_size, (B_max, context), generator=g).tolist()
        for t in range(context):  # the context, one plain step at a time (the pools' own decode path)
            run(caches, [[row[t]] for row in prompt])
        points = []
        for B in sizes:
            for T in sorted({1, min(k + 1, config.window_size)}):
                rows = caches[:B]
                block = torch.randint(3, config.vocab_size, (B, T), generator=g).tolist()
                times = []
                for _ in range(repeats + 1):  # the first run warms up (and captures a graph)
                    rollback = VerifyRollback(pools, rows, [context] * B, T)
                    if pools.device.type == "cuda":
                        torch.cuda.synchronize(pools.device)
                    t0 = time.perf_counter()
                    projections = run(rows, block)
                    times.append(time.perf_counter() - t0)
                    rollback.restore([0] * B, projections)
                times = sorted(times[1:])
                points.append((B * T, times[len(times) // 2]))
        return StepTimeCurve(points)
    finally:
        for cache in caches:
            cache.release()


def build_drafter(kind: str, model: Transformer, *, checkpoint=None, k: int = 4, max_sequences: int = 64,
                  max_seq_len: int | None = None) -> Drafter:
    """The drafter for `--speculative KIND`: "oracle" (a copy of the model; tests the mechanism) or
    "dspark" (the trained DSpark drafter of the checkpoint; SpeculativeError when there is none)."""
    if kind == "oracle":
        return OracleDrafter(model, k, max_sequences=max_sequences, max_seq_len=max_seq_len)
    if kind != "dspark":
        raise SpeculativeError(f"unknown drafter {kind!r} (choose 'dspark' or 'oracle')")
    from pathlib import Path

    from dsv41.checkpoint import CheckpointError, load_drafter
    from dsv41.checkpoint.load import read_config
    from dsv41.config import ConfigError
    from dsv41.engine.dspark_drafter import DSparkDrafter

    # the drafter `dsv41 train-dspark` saves next to a model (MODEL/dspark/), or a checkpoint that holds both
    where = f"checkpoint '{checkpoint}'" if checkpoint is not None else "this model (no checkpoint)"
    for directory in ([Path(checkpoint) / "dspark", Path(checkpoint)] if checkpoint is not None else []):
        if not (directory / "config.json").is_file():
            continue
        try:
            if not read_config(directory).dspark_block_size:
                continue
            drafter = load_drafter(directory, model)
        except (CheckpointError, ConfigError) as err:
            raise SpeculativeError(f"--speculative dspark: {err}") from err
        return DSparkDrafter(drafter, max_sequences=max_sequences)
    raise SpeculativeError(f"--speculative dspark: {where} has no DSpark drafter (no dspark/ folder with a "
                           "drafter config beside the weights); train one with `dsv41 train-dspark` or use "
                           "--speculative oracle")
