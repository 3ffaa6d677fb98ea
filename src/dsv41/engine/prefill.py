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

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

from dsv41.engine.cache import SequenceCache
from dsv41.engine.runner import Capture, Runner
from dsv41.plan import FULL


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


class PrefillJob:
    """One sequence's prefill of `tokens` (appended after what seq already holds), in pieces.

    encoder_replay = R > 0 is Encoder SWA Bounded Replay after a prefix hit without windows: the
    last R cached tokens run through the encoder again, producing only window KV (their global KV
    is cached and is neither recomputed nor overwritten), truncated at their first position.
    decoder_windows_valid: seq's decoder rings hold the exact state at its end (an exact resume),
    so a short suffix continues them instead of starting a fresh bounded replay.

    Pieces: encoder (or, exact, all-layer) chunks of at most `chunk` tokens — any size the caller
    allows — then one decoder replay of at most n_win tokens. `plan(budget)` lists the next pieces
    that fit a token budget; `step(n)` runs one and returns the last position's logits (vocab,)
    fp32 after the final piece, None before.

    capture_layers: block ids whose hidden states a speculative drafter wants (`engine/speculative.py`);
    after the final piece `features` holds, per layer, the mean over streams at the prompt's last m
    positions (m, dim), m ≤ n_win — the decoder runs over the last n_win tokens only."""

    def __init__(self, runner: Runner, seq: SequenceCache, tokens: list[int], *, chunk: int = 2048,
                 exact: bool = False, encoder_replay: int = 0, decoder_windows_valid: bool = False,
                 images: PromptImages | None = None, capture_layers: tuple[int, ...] = (),
                 capture_at: str = "output"):
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
        self.images = images  # embeddings at absolute positions of the whole prompt (cached part included)
        self.start0 = seq.n_tokens
        self.n_total = self.start0 + len(tokens)
        self.first = self.start0 - encoder_replay  # first position run (replayed tokens come first)
        self.cursor = self.first  # next position to run through the encoder (or every layer)
        self.replay_start = torch.tensor([self.first], device=seq.device) if encoder_replay else None
        self.continue_windows = decoder_windows_valid
        self.layers = range(c.n_layers) if self.exact else range(c.encoder_layers)
        self.done = False
        self.tail_h: Tensor | None = None
        self.tail_pre: Tensor | None = None
        self.capture_layers, self.capture_at = tuple(capture_layers), capture_at
        self.features: dict[int, Tensor] = {}  # layer → (m, dim), the last positions run
        if encoder_replay:
            seq.clear_windows(range(c.n_layers))

    # ------------------------------------------------------------------ scheduling view
    @property
    def decoder_pending(self) -> bool:
        return not self.exact and self.cursor >= self.n_total and not self.done

    def remaining(self) -> int:
        """Tokens still to run (encoder tokens + the decoder replay)."""
        if self.done:
            return 0
        left = self.n_total - self.cursor
        return left + (0 if self.exact else self._n_replay())

    def plan(self, budget: int, alone: bool = True) -> list[int]:
        """Token counts of the next pieces that fit in `budget` (in order; what `step` runs). A
        piece never straddles the replayed / new-token boundary; the decoder replay is one piece,
        taken over budget only when `alone` (nothing else runs in the step) and it is next."""
        pieces: list[int] = []
        cur = self.cursor
        while not self.done and budget > 0:
            if not self.exact and cur >= self.n_total:  # the decoder replay
                n = self._n_replay()
                if n <= budget or (alone and not pieces):
                    pieces.append(n)
                break
            n = min(self.n_total - cur, self.chunk, budget)
            if cur < self.start0:
                n = min(n, self.start0 - cur)
            pieces.append(n)
            cur += n
            budget -= n
            if self.exact and cur >= self.n_total:
                break
        return pieces

    def _n_replay(self) -> int:
        return self.n_total - max(self.first, self.n_total - self.runner.config.window_size)

    # ------------------------------------------------------------------ running
    @torch.no_grad()
    def step(self, n: int | None = None) -> Tensor | None:
        """Run the next piece: n encoder (exact: all-layer) tokens (default: as `plan` would with
        one chunk of budget), or the decoder replay when the encoder pass is done."""
        if self.done:
            raise RuntimeError("PrefillJob.step: the prefill has finished")
        if self.decoder_pending:
            return self._decoder()
        n = n or self.plan(self.chunk)[0]
        lo = self.cursor
        hi = min(lo + n, self.start0 if lo < self.start0 else self.n_total)
        seq, runner = self.seq, self.runner
        replayed = hi <= self.start0  # cached tokens run again: window KV only
        ids = seq.tokens[lo:hi] if replayed else self.tokens[lo - self.start0:hi - self.start0]
        mask, embeds = self.images.piece(lo, hi) if self.images is not None else (None, None)
        capture = self._capture(self.layers)
        h, pre_mix = runner.forward([seq], torch.tensor([ids], device=seq.device), [lo], self.layers,
                                    replay_start=self.replay_start, compress=not replayed, image_mask=mask,
                                    image_embeds=embeds, capture=capture)
        self._keep_features(capture)
        c = runner.config
        enc = c.encoder_layers
        if not self.exact and not replayed and enc < c.n_layers and c.compress_ratios[enc] \
                and runner.plans[enc].mode == FULL:
            runner.produce(enc, [seq], h, pre_mix, [lo])
        if not replayed:
            seq.tokens.extend(ids)
        self.cursor = hi
        if self.exact:
            if hi >= self.n_total:
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
        W = self.runner.config.window_size
        self.tail_h = h[:, -W:] if self.tail_h is None else torch.cat((self.tail_h, h), dim=1)[:, -W:]
        self.tail_pre = pre_mix[:, -W:] if self.tail_pre is None else torch.cat((self.tail_pre, pre_mix), dim=1)[:, -W:]

    def _decoder(self) -> Tensor:
        """The last n_win tokens through the decoder from their encoder outputs (bounded replay)."""
        runner, seq, c = self.runner, self.seq, self.runner.config
        n_replay = self._n_replay()
        replay = self.n_total - n_replay
        ids = seq.tokens[replay:self.n_total]
        start = torch.tensor([replay], device=seq.device)
        continue_windows = self.continue_windows and replay == self.start0
        mask = self.images.piece(replay, self.n_total)[0] if self.images is not None else None
        capture = self._capture(range(c.encoder_layers, c.n_layers))
        forward = partial(runner.forward, capture=capture)  # hidden states for a speculative drafter
        h, pre_mix = forward([seq], torch.tensor([ids], device=seq.device), [replay],
                                    range(c.encoder_layers, c.n_layers), self.tail_h[:, -n_replay:],
                                    self.tail_pre[:, -n_replay:], replay_start=None if continue_windows else start,
                                    compress=False, image_mask=mask)
        self._keep_features(capture)
        self._trim_features()
        self.done = True
        self.tail_h = self.tail_pre = None
        return runner.logits(h, pre_mix)[0]


def prefill(runner: Runner, seq: SequenceCache, tokens: list[int], *, chunk: int = 2048,
            exact: bool = False, encoder_replay: int = 0, decoder_windows_valid: bool = False,
            images: PromptImages | None = None) -> Tensor:
    """Process `tokens` (appended after what seq already holds); return the last position's
    logits (vocab,) fp32. See `PrefillJob`."""
    job = PrefillJob(runner, seq, tokens, chunk=chunk, exact=exact, encoder_replay=encoder_replay,
                     decoder_windows_valid=decoder_windows_valid, images=images)
    while True:
        logits = job.step()
        if logits is not None:
            return logits
