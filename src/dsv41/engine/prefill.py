"""Prefill: encoder-only with Decoder SWA Bounded Replay (default), or exact (every layer).

Encoder-only prefill (SPEC §2, §6): every prompt token runs only the encoder layers, in chunks so
long prompts fit and so a scheduler can interleave them with other requests' decode steps; the
decoder's global KV is the decoder kv-source layer's compressor applied to the encoder output (its
normalized attention input), for every token. Then only the last n_win prompt tokens run through
the decoder, starting from their encoder outputs, with the window truncated at the replay start s
(query i sees window keys in [max(s, i−W+1), i]). That fills the decoder's window rings and yields
the first logits. Decoder windows are never cached; the state after a replay is approximate by
design. Cost ≈ N·L/2 + n_win·L/2 layers.

Exact prefill runs all layers over all tokens (the reference's behaviour), for comparison.

Images (SPEC §5) enter only here, never in the decode step: `encode_prompt_images` is the vision
stage (ViT + aligner + span embeddings for a prompt's images — its own function, so it can run on
other workers: the EPD split); its `PromptImages` (embeddings at absolute prompt positions) ride
with the job, and every piece that starts at layer 0 — encoder chunks, the encoder replay after a
prefix hit, exact chunks — takes the rows of its own positions. The decoder replay starts from
encoder outputs and needs only the image mask (`bias_vl` routing).

`PrefillJob` is the per-request state machine (what the engine's scheduler advances a piece per
step); `prefill` runs one to completion.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from dsv41.engine.block_manager import to_device
from dsv41.engine.cache import SequenceCache
from dsv41.engine.runner import Capture, Carry, Runner
from dsv41.plan import FULL

if TYPE_CHECKING:  # static_prefill imports this module
    from dsv41.engine.static_prefill import StaticPrefill


@dataclass
class PromptImages:
    """A prompt's image embeddings at their absolute positions (the vision stage's output)."""

    positions: Tensor  # (M,) int64, increasing: every position of every image span
    embeds: Tensor  # (M, dim) span embeddings, row m at positions[m]
    hashes: tuple[str, ...]  # content hash per image (the prefix-cache key part)

    def piece(self, lo: int, hi: int) -> tuple[Tensor | None, Tensor | None]:
        """(image_mask (1, hi − lo), embeds (m, dim)) of positions [lo, hi); (None, None) when none
        of them is an image position (the piece runs exactly as text)."""
        inside = (self.positions >= lo) & (self.positions < hi)  # (M,)
        if not bool(inside.any()):
            return None, None
        mask = torch.zeros(1, hi - lo, dtype=torch.bool, device=self.positions.device)
        mask[0, self.positions[inside] - lo] = True
        return mask, self.embeds[inside]


@torch.no_grad()
def encode_prompt_images(model, prompt: list[int], images: Sequence) -> PromptImages:
    """The vision-encoding stage: `images` (`image_processor.ImageInput`, in prompt order) → their span
    embeddings at the positions of their spans in `prompt` (each a run of `image_token_id` of the
    image's length; raises `ImageError` when they do not fit). Needs only the weights."""
    from dsv41.image_processor import image_positions
    from dsv41.model.vision import encode_images

    c = model.config
    if not c.vision_enabled:
        raise ValueError("this model has no vision encoder (vision_n_layers = 0): images are not accepted")
    starts = image_positions(prompt, list(images), c.image_token_id)
    device = next(model.parameters()).device
    spans = encode_images(model, [im.patches.to(device) for im in images], [im.grid for im in images])
    positions = torch.cat([torch.arange(s, s + im.n_positions, device=device) for s, im in zip(starts, images)])
    return PromptImages(positions, torch.cat(spans), tuple(im.sha256 for im in images))


def encoder_only_supported(runner: Runner) -> bool:
    """True when the decoder's only kv source is its first layer (its input = the encoder output)."""
    c = runner.config
    decoder_sources = [p.layer_id for p in runner.plans if p.mode == FULL and p.half == "decoder"]
    return decoder_sources in ([], [c.encoder_layers])


def static_capture_fits(config, layers: Sequence[int], exact: bool) -> bool:
    """Whether static prefill can hand a drafter these layers' features: decoder layers of an encoder-only
    prefill (its decoder replay runs them, `StaticPrefill.replay(capture=)`); no layers: nothing to capture."""
    return not layers or (not exact and all(config.encoder_layers <= i < config.n_layers for i in layers))


@dataclass(frozen=True)
class Piece:
    """One step's share of a prefill: `layers` consecutive layers of one run — an encoder (exact: all-layer)
    chunk of `tokens` tokens, or the decoder replay over its `tokens` last prompt tokens. `new`: the piece
    starts its run, so its tokens count against the step's token budget (the run's later pieces cost
    layers only). `kind`: "encoder", "replayed" (cached tokens again, window KV only), "exact", "decoder"."""

    tokens: int
    layers: int
    new: bool
    kind: str
    first: int = 0  # the first layer it runs

    @property
    def key(self) -> tuple[str, int, int, int]:
        """Pieces of different sequences with one key can run as one batched forward (`PrefillJob.step_batch`):
        the same kind, tokens, first layer and number of layers."""
        return self.kind, self.tokens, self.first, self.layers

    @property
    def grows(self) -> int:
        """Tokens the piece's run adds to the cache (what its pages must hold)."""
        return self.tokens if self.kind in ("encoder", "exact") else 0


@dataclass
class _Run:
    """A chunk (or the decoder replay) part-way through its layers: what the next piece continues."""

    kind: str  # Piece.kind
    lo: int  # first position
    hi: int  # end position
    ids: list[int]
    ids_t: Tensor  # (1, T) the same on the device
    layers: range  # every layer the run goes through
    next_layer: int  # the first layer not run yet
    carry: Carry  # streams, fused hand-over and top-k between its pieces
    mask: Tensor | None = None  # (1, T) image positions of [lo, hi)
    embeds: Tensor | None = None  # (m, dim) their embeddings (layer 0 only)

    @property
    def layers_left(self) -> int:
        return self.layers.stop - self.next_layer


# the indexer-score bound of a chunk longer than the job's own (`PrefillJob.plan`): 4 GiB of fp32 scores (and
# twice that of the top-k's int64 keys) for one index layer at a time
IDLE_SCORE_BYTES = 4 << 30


class PrefillJob:
    """One sequence's prefill of `tokens` (appended after what seq already holds), in pieces.

    encoder_replay = R > 0 is Encoder SWA Bounded Replay after a prefix hit without windows: the
    last R cached tokens run through the encoder again, producing only window KV (their global KV
    is cached and is neither recomputed nor overwritten), truncated at their first position.
    decoder_windows_valid: seq's decoder rings hold the exact state at its end (an exact resume),
    so a short suffix continues them instead of starting a fresh bounded replay.

    Runs: encoder (or, exact, all-layer) chunks of at most `chunk` tokens — any size the caller
    allows — then one decoder replay of at most n_win tokens. A piece is a run through some of its
    layers (`Piece`): the streams between two pieces of a run stay on the job (`runner.Carry`), so a
    run cut anywhere between layers computes exactly what it computes whole. `plan(budget, layers=)`
    lists the next pieces that fit a token budget and a layer budget; `step(n, layers)` runs one and
    returns the last position's logits (vocab,) fp32 after the final piece, None before.

    capture_layers: block ids whose hidden states a speculative drafter wants (`engine/speculative.py`);
    after the final piece `features` holds, per layer, the mean over streams at the prompt's last m
    positions (m, dim), m ≤ n_win — the decoder runs over the last n_win tokens only.

    static: a `StaticPrefill` (the engine's, on its pools) that runs every *whole* run of a plain prompt — an
    encoder or exact chunk, or the decoder replay, through all its layers in one piece — from static steps
    (CUDA graphs on CUDA) instead of the host-driven forward; the same function (tests/engine/test_static_prefill.py).
    Runs cut between layers (a layer budget), batched pieces, images, encoder replay, continued decoder windows
    and features captured from encoder layers or in an exact prefill stay on the host path (a drafter's decoder
    layers of an encoder-only prefill: the static replay captures them)."""

    def __init__(self, runner: Runner, seq: SequenceCache, tokens: list[int], *, chunk: int = 2048,
                 exact: bool = False, encoder_replay: int = 0, decoder_windows_valid: bool = False,
                 images: PromptImages | None = None, capture_layers: tuple[int, ...] = (),
                 capture_at: str = "output", static: StaticPrefill | None = None):
        if not tokens:
            raise ValueError("prefill needs at least one token")
        if chunk < 1:
            raise ValueError(f"prefill chunk must be >= 1, got {chunk}")
        c = runner.config
        self.runner, self.seq, self.chunk = runner, seq, chunk
        self.exact = exact or not encoder_only_supported(runner)
        if self.exact and encoder_replay:
            raise ValueError("encoder replay needs encoder-only prefill")
        self.tokens = list(tokens)
        self.images = images  # embeddings at absolute prompt positions of the whole prompt (cached part included)
        self.start0 = seq.n_tokens
        self.n_total = self.start0 + len(tokens)
        self.first = self.start0 - encoder_replay  # first position run (replayed tokens come first)
        self.cursor = self.first  # first position no run has started on yet
        self.replay_start = to_device([self.first], seq.device) if encoder_replay else None
        self.continue_windows = decoder_windows_valid
        self.layers = range(c.n_layers) if self.exact else range(c.encoder_layers)
        self.done = False
        self.run: _Run | None = None  # the run part-way through its layers
        self.tail_h: Tensor | None = None
        self.tail_pre: Tensor | None = None
        self.capture_layers, self.capture_at = tuple(capture_layers), capture_at
        self.features: dict[int, Tensor] = {}  # layer → (m, dim), the last positions run
        self.static = static
        self.static_runs = 0  # runs it made
        if encoder_replay:
            seq.clear_windows(range(c.n_layers))

    # ------------------------------------------------------------------ scheduling view
    @property
    def decoder_pending(self) -> bool:
        """The encoder pass is done and the decoder replay has not finished."""
        return not self.exact and self.cursor >= self.n_total and not self.done

    @property
    def in_progress(self) -> bool:
        """A run has started and has layers left (its next piece costs no new tokens)."""
        return self.run is not None

    def remaining(self) -> int:
        """Tokens still to start (encoder tokens + the decoder replay, unless it has started)."""
        if self.done:
            return 0
        left = self.n_total - self.cursor
        started = self.run is not None and self.run.kind == "decoder"
        return left + (0 if self.exact or started else self._n_replay())

    def plan(self, budget: int, alone: bool = True, layers: int | None = None, chunk: int | None = None
             ) -> list[Piece]:
        """The next pieces (in order; what `step` runs) within `budget` new tokens and `layers` layer
        passes (None: no layer bound). The pieces of the run in progress cost no tokens; a new run
        never straddles the replayed / new-token boundary; the decoder replay starts only when its
        n_win tokens fit the budget, or over budget when `alone` (nothing else runs in the step)
        and it is the first piece. chunk: the longest new run (default: the job's `chunk`)."""
        pieces: list[Piece] = []
        layer_left = float("inf") if layers is None else layers
        cur, run = self.cursor, self.run
        kind, T, left = (run.kind, run.hi - run.lo, run.layers_left) if run is not None else ("", 0, 0)
        at = run.next_layer if run is not None else 0  # the next piece's first layer
        new = False
        while not self.done and layer_left > 0:
            if left == 0:  # start the next run
                if kind == "decoder" or (self.exact and cur >= self.n_total):
                    break  # the last run is planned
                if not self.exact and cur >= self.n_total:
                    T = self._n_replay()
                    if not (T <= budget or (alone and not pieces)):
                        break
                    kind, left = "decoder", self.runner.config.n_layers - self.runner.config.encoder_layers
                    at = self.runner.config.encoder_layers
                else:
                    T = min(self.n_total - cur, chunk or self.chunk, budget)
                    if chunk is not None and T > self.chunk:  # a big chunk: its indexer scores stay bounded
                        T = max(self.chunk, min(T, self._score_bound(cur)))
                    if cur < self.start0:
                        T = min(T, self.start0 - cur)
                    if T <= 0:
                        break
                    kind = "exact" if self.exact else "replayed" if cur < self.start0 else "encoder"
                    left, cur, at = len(self.layers), cur + T, self.layers.start
                budget -= T
                new = True
            k = int(min(left, layer_left))
            pieces.append(Piece(T, k, new, kind, at))
            at += k
            left -= k
            layer_left -= k
            new = False
        return pieces

    def _score_bound(self, cur: int) -> int:
        """The longest chunk from position `cur` whose indexer scores — T queries × the entries visible at its
        end, fp32, one index layer at a time — stay within IDLE_SCORE_BYTES: T·(cur + T)/r·4 ≤ B, r the smallest
        ratio of an index source (32,768 tokens from the start at r = 1, 8,192 at 128K, 1,024 at 1M)."""
        c = self.runner.config
        ratios = [c.compress_ratios[i] for i in c.index_source_layers if c.compress_ratios[i] > 0]
        if not ratios:
            return self.n_total
        return int((-cur + math.sqrt(cur * cur + IDLE_SCORE_BYTES * min(ratios))) / 2)

    def _n_replay(self) -> int:
        return self.n_total - max(self.first, self.n_total - self.runner.config.window_size)

    # ------------------------------------------------------------------ running
    @torch.no_grad()
    def step(self, n: int | None = None, layers: int | None = None) -> Tensor | None:
        """Run the next piece: `layers` more layers (default: all it has left) of the run in progress,
        or of a new one — n encoder (exact: all-layer) tokens (default: as `plan` would with one chunk
        of budget), or the decoder replay once the encoder pass is done."""
        if self.done:
            raise RuntimeError("PrefillJob.step: the prefill has finished")
        run = self.run
        if run is None and self._static_run_fits(layers):
            return self._static_step(n)
        if run is None:
            run = self.run = self._start(n)
        elif n is not None and n != run.hi - run.lo:
            raise ValueError(f"PrefillJob.step: a run of {run.hi - run.lo} tokens is in progress, not {n}")
        k = run.layers_left if layers is None else min(int(layers), run.layers_left)
        if k < 1:
            raise ValueError(f"PrefillJob.step: layers must be >= 1, got {layers}")
        piece = range(run.next_layer, run.next_layer + k)
        seq, runner = self.seq, self.runner
        capture = self._capture(piece)
        ids = run.ids_t
        if run.kind == "decoder":
            # from the encoder outputs (bounded replay); the decoder's global KV is cached: not recomputed
            n_replay = run.hi - run.lo
            first = run.carry.h is None
            continue_windows = self.continue_windows and run.lo == self.start0
            runner.forward([seq], ids, [run.lo], piece, self.tail_h[:, -n_replay:] if first else None,
                           self.tail_pre[:, -n_replay:] if first else None,
                           replay_start=None if continue_windows else to_device([run.lo], seq.device),
                           compress=False, image_mask=run.mask, capture=capture, carry=run.carry)
        else:
            runner.forward([seq], ids, [run.lo], piece, replay_start=self.replay_start,
                           compress=run.kind != "replayed", image_mask=run.mask,
                           image_embeds=run.embeds if piece.start == 0 else None, capture=capture, carry=run.carry)
        self._keep_features(capture)
        run.next_layer += k
        if run.layers_left:
            return None
        self.run = None
        return self._finish(run)

    def _static_run_fits(self, layers: int | None) -> bool:
        """The next run goes to `static`: it runs whole (`layers` covers it) and is of a kind `StaticPrefill` runs —
        a text prompt, no encoder replay, a decoder replay that starts its windows afresh, features captured only
        from decoder layers of an encoder-only prefill (the replay's)."""
        if self.static is None or self.images is not None or self.replay_start is not None:
            return False
        c = self.runner.config
        if not static_capture_fits(c, self.capture_layers, self.exact):
            return False
        if self.decoder_pending:
            lo = self.n_total - self._n_replay()
            n_layers = c.n_layers - c.encoder_layers
            if self.continue_windows and lo == self.start0:
                return False
        else:
            n_layers = len(self.layers)
        return layers is None or layers >= n_layers

    def _static_step(self, n: int | None) -> Tensor | None:
        """The next run, whole, through `static`; as `step` (the run's logits after the last, None before)."""
        self.static_runs += 1
        if self.decoder_pending:
            T = self._n_replay()
            capture = Capture(layers=self.capture_layers, at=self.capture_at) if self.capture_layers else None
            logits = self.static.replay(self.seq, T, self.tail_h[:, -T:], self.tail_pre[:, -T:], capture=capture)
            if capture is not None:  # the window's features, as the host path's decoder run keeps them
                self.features = {i: f[0] for i, f in capture.features.items()}
            self.done = True
            self.tail_h = self.tail_pre = None
            return logits
        lo = self.cursor
        hi = min(lo + (n or min(self.n_total - lo, self.chunk)), self.n_total)
        h, pre = self.static.encode(self.seq, self.tokens[lo - self.start0:hi - self.start0], exact=self.exact)
        self.cursor = hi
        if self.exact:
            if hi < self.n_total:
                return None
            self.done = True
            return self.runner.logits(h, pre)[0]
        self._keep_tail(h, pre)
        return None

    @property
    def batchable(self) -> bool:
        """The next piece may share a forward with other sequences' (`step_batch`): a text prompt (no images),
        no captured features, an encoder / exact chunk without encoder replay, or a decoder replay that starts
        its windows afresh."""
        if self.done or self.images is not None or self.capture_layers:
            return False
        if self.run is not None:
            kind, lo = self.run.kind, self.run.lo
        elif self.decoder_pending:
            kind, lo = "decoder", self.n_total - self._n_replay()
        else:
            kind, lo = ("exact" if self.exact else "encoder"), self.cursor
            if self.replay_start is not None or lo < self.start0:
                return False  # encoder replay after a prefix hit: window KV only, its own truncation
        return kind != "decoder" or not (self.continue_windows and lo == self.start0)

    @staticmethod
    @torch.no_grad()
    def step_batch(jobs: list[PrefillJob], n: int, layers: int) -> list[Tensor | None]:
        """`job.step(n, layers)` of every job, as one forward over their sequences (row b = jobs[b]): what
        each gets (its logits after its final piece, None before) and leaves behind equals `step` alone.
        Every job must be `batchable` with one next piece `key` (same kind, tokens, first layer, layers)."""
        if not jobs:
            return []
        keys = set()
        for job in jobs:
            if not job.batchable:
                raise ValueError("PrefillJob.step_batch: a job's next piece cannot be batched (see `batchable`)")
            planned = job.plan(n, alone=True, layers=layers)
            keys.add(planned[0].key if planned else None)
        if len(keys) != 1 or None in keys:
            raise ValueError(f"PrefillJob.step_batch: the jobs' next pieces differ: {sorted(map(str, keys))}")
        runner = jobs[0].runner
        runs = []
        for job in jobs:
            if job.run is None:
                job.run = job._start(n)
            runs.append(job.run)
        first_run = runs[0]
        k = min(int(layers), first_run.layers_left)
        piece = range(first_run.next_layer, first_run.next_layer + k)
        seqs = [job.seq for job in jobs]
        ids = torch.cat([r.ids_t for r in runs])  # (B, T)
        starts = [r.lo for r in runs]
        carry = _stack_carries([r.carry for r in runs])
        if first_run.kind == "decoder":
            h = pre = None
            if carry.h is None:  # the replay's first piece starts from the encoder outputs
                T = first_run.hi - first_run.lo
                h = torch.cat([job.tail_h[:, -T:] for job in jobs])
                pre = torch.cat([job.tail_pre[:, -T:] for job in jobs])
            runner.forward(seqs, ids, starts, piece, h, pre, replay_start=to_device(starts, seqs[0].device),
                           compress=False, carry=carry)
        else:
            runner.forward(seqs, ids, starts, piece, compress=True, carry=carry)
        out: list[Tensor | None] = []
        for b, (job, run) in enumerate(zip(jobs, runs)):
            run.carry = _carry_row(carry, b)
            run.next_layer += k
            if run.layers_left:
                out.append(None)
            else:
                job.run = None
                out.append(job._finish(run))
        return out

    def _start(self, n: int | None) -> _Run:
        """The next run: the decoder replay once the encoder pass is done, else a chunk of n tokens."""
        c = self.runner.config
        if self.decoder_pending:
            lo = self.n_total - self._n_replay()
            mask = self.images.piece(lo, self.n_total)[0] if self.images is not None else None
            ids = self.seq.tokens[lo:self.n_total]
            return _Run("decoder", lo, self.n_total, ids, self._device_ids(ids), range(c.encoder_layers, c.n_layers),
                        c.encoder_layers, Carry(c.n_layers), mask)
        lo = self.cursor
        n = n or min(self.n_total - lo, self.chunk)
        hi = min(lo + n, self.start0 if lo < self.start0 else self.n_total)
        replayed = hi <= self.start0  # cached tokens run again: window KV only
        ids = self.seq.tokens[lo:hi] if replayed else self.tokens[lo - self.start0:hi - self.start0]
        mask, embeds = self.images.piece(lo, hi) if self.images is not None else (None, None)
        kind = "exact" if self.exact else "replayed" if replayed else "encoder"
        self.cursor = hi
        return _Run(kind, lo, hi, ids, self._device_ids(ids), self.layers, self.layers.start, Carry(self.layers.stop),
                    mask, embeds)

    def _device_ids(self, ids: list[int]) -> Tensor:
        return to_device([ids], self.seq.device)  # (1, T)

    def _finish(self, run: _Run) -> Tensor | None:
        """A run went through all its layers: publish what the next runs read; logits after the last."""
        runner, seq, c = self.runner, self.seq, self.runner.config
        h, pre_mix = run.carry.h, run.carry.pre_mix
        run.carry = Carry(run.layers.stop)  # drop the streams
        if run.kind == "decoder":
            self._trim_features()
            self.done = True
            self.tail_h = self.tail_pre = None
            return runner.logits(h, pre_mix)[0]
        enc = c.encoder_layers
        if run.kind == "encoder" and enc < c.n_layers and c.compress_ratios[enc] and runner.plans[enc].mode == FULL:
            # the decoder's global KV: its kv source's compressor over this chunk's encoder output
            runner.produce(enc, [seq], h, pre_mix, [run.lo])
        if run.kind != "replayed":
            seq.tokens.extend(run.ids)
        if run.kind == "exact":
            if run.hi >= self.n_total:
                self.done = True
                self._trim_features()
                return runner.logits(h, pre_mix)[0]
            return None
        self._keep_tail(h, pre_mix)
        return None
    def _capture(self, layers: range) -> Capture | None:
        wanted = tuple(i for i in self.capture_layers if i in layers)
        return Capture(layers=wanted, at=self.capture_at) if wanted else None

    def _keep_features(self, capture: Capture | None) -> None:
        """Append a piece's captured hidden states (1, T, dim) to the per-layer tails (last n_win rows)."""
        if capture is None:
            return
        W = self.runner.config.window_size
        for i, f in capture.features.items():
            rows = f[0] if i not in self.features else torch.cat((self.features[i], f[0]))
            self.features[i] = rows[-W:]

    def _trim_features(self) -> None:
        """Every layer's features cover the same last positions (the shortest tail)."""
        if self.features:
            m = min(f.size(0) for f in self.features.values())
            self.features = {i: f[-m:] for i, f in self.features.items()}

    def _keep_tail(self, h: Tensor, pre_mix: Tensor) -> None:
        """The encoder output of the last n_win positions run: the decoder replay's input."""
        W = self.runner.config.window_size
        self.tail_h = h[:, -W:] if self.tail_h is None else torch.cat((self.tail_h, h), dim=1)[:, -W:]
        self.tail_pre = pre_mix[:, -W:] if self.tail_pre is None else torch.cat((self.tail_pre, pre_mix), dim=1)[:, -W:]


def _stack_carries(carries: list[Carry]) -> Carry:
    """One Carry for a batch of runs at the same layer (every field concatenated along the batch)."""
    def cat(values):
        return None if values[0] is None else torch.cat(values)

    entry = None
    if carries[0].entry is not None:
        coefs = None  # (pre, post, comb) of the next block's attention, each concatenated
        if carries[0].entry[1] is not None:
            coefs = tuple(cat([c.entry[1][k] for c in carries]) for k in range(3))
        entry = (cat([c.entry[0] for c in carries]), coefs)
    return Carry(carries[0].stop, cat([c.h for c in carries]), cat([c.pre_mix for c in carries]), entry,
                 cat([c.topk for c in carries]), cat([c.blocks for c in carries]))


def _carry_row(carry: Carry, b: int) -> Carry:
    """Row b of a batched Carry, as the Carry of a run of its own."""
    def row(t):
        return None if t is None else t[b:b + 1]

    entry = None
    if carry.entry is not None:
        x, coefs = carry.entry
        entry = (row(x), None if coefs is None else tuple(row(t) for t in coefs))
    return Carry(carry.stop, row(carry.h), row(carry.pre_mix), entry, row(carry.topk), row(carry.blocks))


def prefill(runner: Runner, seq: SequenceCache, tokens: list[int], *, chunk: int = 2048,
            exact: bool = False, encoder_replay: int = 0, decoder_windows_valid: bool = False,
            images: PromptImages | None = None, static: StaticPrefill | None = None) -> Tensor:
    """Process `tokens` (appended after what seq already holds); return the last position's
    logits (vocab,) fp32. See `PrefillJob`."""
    job = PrefillJob(runner, seq, tokens, chunk=chunk, exact=exact, encoder_replay=encoder_replay,
                     decoder_windows_valid=decoder_windows_valid, images=images, static=static)
    while True:
        logits = job.step()
        if logits is not None:
            return logits
