"""Asynchronous rollouts on the engine, time-sliced with training on one device (SPEC §8).

Key ideas (AReaL / prime-rl / verl's designs, on our own `Engine`):
- **Dispatch** (`Dispatcher`, policy only, no torch). A prompt is dispatched as one group of samples (M_b per
  effort level). Three rules: "sample" (the report's): when the samples finished since the last dispatch
  reach the next prompt's group size, dispatch that prompt — the engine stays full while long samples run
  on; "prompt": the next prompt when a whole earlier group has finished; "batch" (synchronous): the next
  `batch_prompts` prompts only when every sample of the batch finished. A cap on in-flight samples and
  per-dataset caps bound all three; "next prompt" is the first queued one whose dataset cap has room.
- **Token-level interruption** (`Rollouts.interrupt` / `resume`). A running sequence is taken out of the
  scheduler's running list between two engine steps — its slot, pages, caches and pending token stay — and
  put back after the weights changed. It resumes at the next token on the new weights: no prefill runs,
  the KV of earlier tokens is kept as the old weights wrote it (the report's stitching). No engine code
  changed: pause / resume touch only `Scheduler.running`.
- **Per-token tags.** Every generated token records the policy version that sampled it and its behaviour
  log-probability; `RoutingRecorder` records the MoE expert ids every token got in every layer (a gate hook,
  `Gate.route_hook`, plus a wrapper of the runner's layer stack that says which sequence and position each
  row is). `replay_routing` forces those ids in the training forward: the tokens of a sample that spans
  checkpoints keep the routing they were generated with, not a recomputed one.
- **Staleness.** `staleness_mask` zeroes the loss of tokens more than `max_staleness` versions old;
  `select_groups` takes finished groups freshest first so a batch's off-policy ratio (tokens sampled by an
  older version / all its tokens) never exceeds `max_offpolicy`; groups that can no longer help are
  collected (`Sample.release`, the engine already freed their caches at finish).
- **Length bias.** Per-dataset caps (above) and, optionally, dropping groups that finish within
  `min_group_steps` engine steps of their dispatch (short samples that return too early).

Routing capture works under the engine's CUDA graphs: in the static decode step the hook only copies ids into a
persistent device buffer (captured with the step), harvested after each step. Prompts longer than the window need
exact prefill (`exact_prefill=True`) for the training forward to see what the rollout saw (encoder-only prefill runs the
decoder on the last n_win prompt tokens only).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor

from dsv41.engine.engine import Engine
from dsv41.engine.sampling import SamplingParams
from dsv41.engine.sequence import Sequence

DISPATCH_MODES = ("sample", "prompt", "batch")


# ---------------------------------------------------------------------- dispatch (policy only)
@dataclass
class Group:
    """One prompt's samples: `size` = M_b × |B|; the payload (problem, efforts) is the caller's."""

    id: int
    dataset: str
    size: int
    payload: object = None


class Dispatcher:
    """Which prompt groups start, and when. `start()` fills the engine; `finished(group, n)` reports n samples
    of `group` done and returns the groups to dispatch now, in order."""

    def __init__(self, groups: list[Group], mode: str = "sample", max_in_flight: int = 64,
                 dataset_caps: dict[str, int] | None = None, batch_prompts: int = 8):
        if mode not in DISPATCH_MODES:
            raise ValueError(f"dispatch mode must be one of {DISPATCH_MODES}, got {mode!r}")
        if max_in_flight < 1 or batch_prompts < 1:
            raise ValueError("max_in_flight and batch_prompts must be >= 1")
        too_big = [g.id for g in groups if g.size > max_in_flight]
        if too_big:
            raise ValueError(f"group {too_big[0]} has more samples than max_in_flight={max_in_flight}")
        self.queue: deque[Group] = deque(groups)
        self.mode, self.max_in_flight, self.batch_prompts = mode, max_in_flight, batch_prompts
        self.dataset_caps = dict(dataset_caps or {})
        self.in_flight = 0
        self.per_dataset: Counter[str] = Counter()
        self.newly_finished = 0  # samples finished since the last dispatch (sample rule)
        self.groups_done = 0  # whole groups finished since the last dispatch (prompt rule)
        self.left: dict[int, int] = {}  # group id → samples not finished yet
        self.batch_left = 0  # samples of the current batch not finished (batch rule)
        self.log: list[int] = []  # dispatched group ids, in order

    def set_caps(self, max_in_flight: int | None = None, dataset_caps: dict[str, int] | None = None) -> None:
        """A mid-run config switch: applies to later dispatches; samples in flight are never touched."""
        if max_in_flight is not None:
            self.max_in_flight = max_in_flight
        if dataset_caps is not None:
            self.dataset_caps = dict(dataset_caps)

    def _admissible(self) -> Group | None:
        for g in self.queue:
            cap = self.dataset_caps.get(g.dataset)
            if cap is not None and self.per_dataset[g.dataset] + g.size > cap:
                continue
            return g if self.in_flight + g.size <= self.max_in_flight else None
        return None

    def _dispatch(self, g: Group) -> None:
        self.queue.remove(g)
        self.in_flight += g.size
        self.per_dataset[g.dataset] += g.size
        self.left[g.id] = g.size
        self.log.append(g.id)

    def start(self) -> list[Group]:
        out = []
        limit = self.batch_prompts if self.mode == "batch" else None
        while (g := self._admissible()) is not None and (limit is None or len(out) < limit):
            self._dispatch(g)
            out.append(g)
        self.batch_left = sum(g.size for g in out)
        return out

    def finished(self, group: Group, n: int = 1) -> list[Group]:
        self.in_flight -= n
        self.per_dataset[group.dataset] -= n
        self.left[group.id] -= n
        if self.left[group.id] == 0:
            del self.left[group.id]
            self.groups_done += 1
        self.newly_finished += n
        out: list[Group] = []
        if self.mode == "batch":
            self.batch_left -= n
            return self.start() if self.batch_left == 0 else out
        while (g := self._admissible()) is not None:
            if self.mode == "sample":
                if self.newly_finished < g.size:
                    break
                self.newly_finished -= g.size
            else:  # prompt
                if self.groups_done == 0:
                    break
                self.groups_done -= 1
            self._dispatch(g)
            out.append(g)
        return out


# ---------------------------------------------------------------------- samples
@dataclass(eq=False)
class Sample:
    uid: int
    group: Group
    effort: int
    prompt: list[int]
    max_tokens: int
    seed: int | None = None
    tokens: list[int] = field(default_factory=list)  # generated ids (a final stop id included)
    logprobs: list[float] = field(default_factory=list)  # behaviour log π(token), per generated token
    versions: list[int] = field(default_factory=list)  # policy version that sampled each token
    routing: dict[int, Tensor] | None = None  # layer → (positions, k) expert ids, −1 = not run there
    finish_reason: str | None = None
    seq: Sequence | None = None
    dispatch_step: int = 0
    finish_step: int = -1
    config_version: int = 0  # the run config (teachers, data mix, caps) in force at dispatch

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def release(self) -> None:
        """Per-sample GC: drop the engine handle and the routing record (the cache was freed at finish)."""
        self.seq = None
        self.routing = None


@dataclass
class _RoutedForward:
    """The expert ids of one recorded forward, already on the host: every MoE layer it ran, every row."""

    layers: tuple[int, ...]  # MoE layer indices, in the order of `ids`
    positions: Tensor  # (B, T) long, CPU
    ids: Tensor  # (L', B, T, k) long, CPU (pinned when copied from a GPU)
    ready: object | None  # a CUDA event after the device→host copies (None on the CPU)
    remaining: int  # rows not yet taken


class RoutingRecorder:
    """Records the expert ids each token of each sequence got in each MoE layer of an engine's model.

    Two paths, both O(MoE layers) per forward (never per row):
    - host-driven forwards (prefill pieces): the gate hook keeps one (B, T, k) clone per layer; when the forward
      ends they are stacked and copied to pinned host memory without a sync, indexed by sequence;
    - the static decode step: the hook copies each layer's ids into a persistent device buffer (L, rows, k) —
      plain tensor writes with no host work, so a CUDA graph captured with the hook replays them — and the
      buffer's real rows are harvested (one clone + one non-blocking host copy) after the step, before the next
      step overwrites it. The rollout engine can therefore keep its CUDA graphs while recording.
    `take` assembles one sequence's table from host tensors (it waits on the copies' event, long done by then)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.moes = engine.model.moe_layers()
        self.topk = self.moes[0].topk if self.moes else 0
        self._current = None  # the StepRecord of the host-driven / eager forward in progress
        self._pending: list[tuple[int, Tensor]] = []  # (layer, (B, T, k) ids) of that forward
        self._forwards: dict[int, _RoutedForward] = {}
        self._next = 0
        self._index: dict[int, list[tuple[int, int]]] = {}  # id(cache) → [(forward key, row)], in order
        self._decode: tuple[list, list[int]] | None = None  # (caches, positions) of a decode step not harvested
        rows = engine.io.max_batch
        # the decode buffer lives as long as the engine: graphs captured with the hook write into it
        self._buffer = torch.full((len(self.moes), rows, max(self.topk, 1)), -1, dtype=torch.long,
                                  device=engine.device)  # (L, rows, k)
        engine._routing_buffer = self._buffer
        if engine.graphs is not None:
            engine.graphs.graphs.clear()  # graphs captured without the hook would not write the buffer
        runner, io = engine.runner, engine.io
        self._orig_layers, self._orig_fill = runner._layers, io.fill_batch

        def layers(record, *args, **kwargs):
            self._current, self._pending = record, []
            try:
                return self._orig_layers(record, *args, **kwargs)
            finally:
                self._current = None
                self._close(record)

        def fill_batch(caches, tokens):
            self._harvest()  # the previous decode step's ids, before this step overwrites the buffer
            self._decode = (list(caches), [c.n_tokens for c in caches])
            return self._orig_fill(caches, tokens)

        runner._layers, io.fill_batch = layers, fill_batch
        for i, moe in enumerate(self.moes):
            moe.gate.route_hook = self._hook(i)

    def _hook(self, layer: int) -> Callable[[Tensor], Tensor]:
        def record(indices: Tensor) -> Tensor:
            rec = self._current
            if rec is None:
                return indices
            B, T = rec.positions.shape
            if rec.seqs is None:  # the static decode step (T = 1): into the buffer, capturable
                self._buffer[layer, :B].copy_(indices.detach().view(B, -1))
            else:
                self._pending.append((layer, indices.detach().view(B, T, -1).clone()))  # (B, T, k)
            return indices
        return record

    def _store(self, layers: tuple[int, ...], positions: Tensor, ids: Tensor, caches: list) -> None:
        """ids (L', B, T, k) and positions (B, T) of one forward → host (non-blocking), indexed by sequence."""
        event = None
        if ids.is_cuda:
            host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
            host.copy_(ids, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            ids = host
        key, self._next = self._next, self._next + 1
        self._forwards[key] = _RoutedForward(layers, positions.cpu(), ids, event, len(caches))
        for b, cache in enumerate(caches):
            self._index.setdefault(id(cache), []).append((key, b))

    def _close(self, record) -> None:
        """A host-driven forward ended: its ids to the host in one copy."""
        pending, self._pending = self._pending, []
        if not pending:  # the static decode step writes the buffer instead (harvested later)
            return
        ids = torch.stack([t for _, t in pending])  # (L', B, T, k)
        pos = record.positions.detach()
        pos = pos.to("cpu", non_blocking=True) if pos.is_cuda else pos.clone()
        self._store(tuple(layer for layer, _ in pending), pos, ids, list(record.seqs))

    def _harvest(self) -> None:
        """The decode step that ran last (eager or replayed): its real rows of the buffer to the host."""
        if self._decode is None:
            return
        caches, positions = self._decode
        self._decode = None
        B = len(caches)
        if B == 0 or not self.moes:
            return
        ids = self._buffer[:, :B].clone().unsqueeze(2)  # (L, B, 1, k)
        self._store(tuple(range(len(self.moes))), torch.tensor(positions).view(B, 1), ids, caches)

    def take(self, cache, n_positions: int) -> dict[int, Tensor]:
        """The table of one sequence, removed from the recorder: layer → (n_positions, k) long on the CPU,
        −1 where the layer never ran the position (e.g. decoder layers before an encoder-only replay)."""
        self._harvest()
        tables = {layer: torch.full((n_positions, self.topk), -1, dtype=torch.long) for layer in range(len(self.moes))}
        for key, b in self._index.pop(id(cache), []):
            f = self._forwards[key]
            if f.ready is not None:
                f.ready.synchronize()
                f.ready = None
            pos = f.positions[b]  # (T,)
            keep = pos < n_positions
            for li, layer in enumerate(f.layers):
                tables[layer][pos[keep]] = f.ids[li, b][keep]
            f.remaining -= 1
            if f.remaining == 0:
                del self._forwards[key]
        return tables

    def close(self) -> None:
        self._harvest()
        self.engine.runner._layers, self.engine.io.fill_batch = self._orig_layers, self._orig_fill
        for moe in self.moes:
            moe.gate.route_hook = None
        if self.engine.graphs is not None:
            self.engine.graphs.graphs.clear()  # their captured hook copies stay harmless, but drop them


@contextmanager
def replay_routing(model, routing: list[dict[int, Tensor]] | None, T: int) -> Iterator[None]:
    """Force recorded expert ids in every MoE layer of `model` for a (B, T) forward: routing[b][layer] is
    (≥ T, k) with −1 where the model's own choice stands. None: no replay."""
    if routing is None:
        yield
        return
    moes = model.moe_layers()
    tables = []
    for layer in range(len(moes)):
        rows = []
        for r in routing:
            t = r[layer][:T]
            if t.size(0) < T:  # padding positions: the model's own choice
                t = torch.cat([t, t.new_full((T - t.size(0), t.size(1)), -1)])
            rows.append(t)
        tables.append(torch.stack(rows))  # (B, T, k)

    def force(table: Tensor) -> Callable[[Tensor], Tensor]:
        def hook(indices: Tensor) -> Tensor:
            flat = table.to(indices.device).view(-1, table.size(-1))  # (B·T, k)
            if flat.shape != indices.shape:
                raise ValueError(f"routing replay: table {tuple(flat.shape)} for indices {tuple(indices.shape)}")
            return torch.where(flat[:, :1] >= 0, flat, indices)
        return hook

    saved = [moe.gate.route_hook for moe in moes]
    for moe, table in zip(moes, tables):
        moe.gate.route_hook = force(table)
    try:
        yield
    finally:
        for moe, hook in zip(moes, saved):
            moe.gate.route_hook = hook


# ---------------------------------------------------------------------- the rollout engine wrapper
class Rollouts:
    """Samples in, finished samples out, on one `Engine`; the policy version tags every token."""

    def __init__(self, engine: Engine, *, stop_ids: tuple[int, ...], temperature: float = 1.0,
                 record_routing: bool = True, exact_prefill: bool = True):
        self.engine = engine
        self.stop_ids, self.temperature, self.exact_prefill = list(stop_ids), temperature, exact_prefill
        self.version = 0
        self.steps = 0  # engine steps run
        self.recorder = RoutingRecorder(engine) if record_routing else None
        self.live: dict[int, Sample] = {}  # submitted, not finished
        self.paused: list[Sequence] = []
        self._by_seq: dict[int, Sample] = {}

    # -------------------------------------------------------------- samples
    def submit(self, sample: Sample) -> None:
        params = SamplingParams(temperature=self.temperature, max_tokens=sample.max_tokens,
                                stop_token_ids=self.stop_ids, seed=sample.seed, logprobs=0)
        sample.seq = self.engine.add_request(sample.prompt, params, exact_prefill=self.exact_prefill)
        sample.dispatch_step = self.steps
        self.live[sample.uid] = sample
        self._by_seq[sample.seq.id] = sample

    @property
    def in_flight(self) -> int:
        return len(self.live)

    def step(self) -> list[Sample]:
        """One engine step; returns the samples that finished in it."""
        if self.paused:
            raise RuntimeError("Rollouts.step while interrupted: call resume() first")
        done = []
        for out in self.engine.step():
            s = self._by_seq[out.request.id]
            if out.error is not None:
                s.finish_reason = "error"
            else:
                token = out.token if out.token is not None else self.stop_ids[0]  # a stop id ended it (not shown)
                s.tokens.append(token)
                s.logprobs.append(float(out.logprob))
                s.versions.append(self.version)
            if out.finished:
                s.finish_reason = s.finish_reason or out.request.finish_reason
                self._finish(s)
                done.append(s)
        self.steps += 1
        return done

    def _finish(self, s: Sample) -> None:
        s.finish_step = self.steps
        if self.recorder is not None:
            s.routing = self.recorder.take(s.seq.cache, len(s.prompt) + len(s.tokens))
        del self.live[s.uid]
        del self._by_seq[s.seq.id]
        s.seq = None

    # -------------------------------------------------------------- time slicing
    def interrupt(self) -> int:
        """Token-level interruption: every running sequence leaves the schedule, keeping its caches and
        pending token (prefilling ones keep their prefill job). Returns how many were paused."""
        running = self.engine.scheduler.running
        self.paused = list(running)
        running.clear()
        return len(self.paused)

    def resume(self) -> None:
        """Put the paused sequences back, in their order: they continue at the next token, no prefill."""
        self.engine.scheduler.running[:0] = self.paused
        self.paused = []

    @torch.no_grad()
    def load_weights(self, source: torch.nn.Module | dict[str, Tensor], version: int) -> None:
        """New policy weights into the engine's model, in place (same tensors: pools and graphs stay valid).
        `source`: the trainer's model (copied tensor by tensor, no state-dict round trip) or a state dict."""
        target = self.engine.model
        if isinstance(source, dict):
            target.load_state_dict(source, strict=True)
        else:
            mine = dict(target.named_parameters())
            mine.update(dict(target.named_buffers()))
            theirs = dict(source.named_parameters())
            theirs.update(dict(source.named_buffers()))
            if mine.keys() != theirs.keys():
                raise ValueError("load_weights: the trainer's model and the engine's differ in their tensors")
            for name, t in mine.items():
                t.copy_(theirs[name])
        self.version = version

    def close(self) -> None:
        if self.recorder is not None:
            self.recorder.close()


# ---------------------------------------------------------------------- staleness and batches
def staleness_mask(versions: Tensor, current: int, max_staleness: int) -> Tensor:
    """(…) bool: True where a token's policy version is at most `max_staleness` behind `current`."""
    return (current - versions) <= max_staleness


def offpolicy_ratio(samples: list[Sample], current: int) -> float:
    """Share of the samples' generated tokens that an older policy version sampled."""
    total = sum(len(s.versions) for s in samples)
    old = sum(sum(v < current for v in s.versions) for s in samples)
    return old / total if total else 0.0


def select_groups(ready: list[list[Sample]], n_groups: int, current: int, max_offpolicy: float,
                  max_staleness: int) -> tuple[list[list[Sample]], list[list[Sample]], list[list[Sample]]]:
    """Pick up to n_groups finished groups, freshest first, keeping the batch's off-policy ratio ≤ max_offpolicy.
    Returns (chosen, kept for later, dropped: every token too stale to train on)."""
    chosen: list[list[Sample]] = []
    kept: list[list[Sample]] = []
    dropped: list[list[Sample]] = []
    old = total = 0

    def age(g: list[Sample]) -> float:
        n = sum(len(s.versions) for s in g)
        return sum(current - v for s in g for v in s.versions) / max(n, 1)

    for g in sorted(ready, key=age):
        g_old = sum(sum(v < current for v in s.versions) for s in g)
        g_total = sum(len(s.versions) for s in g)
        if all(current - v > max_staleness for s in g for v in s.versions):
            dropped.append(g)
        elif len(chosen) < n_groups and (old + g_old) <= max_offpolicy * (total + g_total):
            chosen.append(g)
            old, total = old + g_old, total + g_total
        else:
            kept.append(g)
    return chosen, kept, dropped


@dataclass
class TrainBatch:
    tokens: Tensor  # (B, T) prompt + generated[:-1], padded
    targets: Tensor  # (B, T) next tokens
    mask: Tensor  # (B, T) bool: generated targets still fresh enough to train on
    logp_behaviour: Tensor  # (B, T) fp32 behaviour log-probabilities of the targets (0 elsewhere)
    versions: Tensor  # (B, T) long policy version of each target (−1 on prompt / padding)
    routing: list[dict[int, Tensor]] | None


def training_batch(samples: list[Sample], current: int, max_staleness: int, pad_id: int = 2) -> TrainBatch:
    """The training tensors of finished samples: targets are the generated tokens (stop id included)."""
    T = max(len(s.prompt) + len(s.tokens) - 1 for s in samples)
    B = len(samples)
    tokens = torch.full((B, T), pad_id, dtype=torch.long)
    targets = torch.full((B, T), pad_id, dtype=torch.long)
    logp = torch.zeros(B, T)
    versions = torch.full((B, T), -1, dtype=torch.long)
    for b, s in enumerate(samples):
        seq = s.prompt + s.tokens
        n, p = len(seq) - 1, len(s.prompt)
        tokens[b, :n] = torch.tensor(seq[:-1])
        targets[b, :n] = torch.tensor(seq[1:])
        logp[b, p - 1:n] = torch.tensor(s.logprobs)
        versions[b, p - 1:n] = torch.tensor(s.versions)
    mask = (versions >= 0) & staleness_mask(versions, current, max_staleness)
    routing = None if any(s.routing is None for s in samples) else [s.routing for s in samples]
    return TrainBatch(tokens, targets, mask, logp, versions, routing)

