"""Prefill: encoder-only with Decoder SWA Bounded Replay (default), or exact (every layer).

Encoder-only prefill (SPEC §2, §6): every prompt token runs only the encoder layers, in chunks of
`chunk` tokens so long prompts fit; the decoder's global KV is the decoder kv-source layer's
compressor applied to the encoder output (its normalized attention input), for every token. Then
only the last n_win prompt tokens run through the decoder, starting from their encoder outputs,
with the window truncated at the replay start s (query i sees window keys in [max(s, i−W+1), i]).
That fills the decoder's window rings and yields the first logits. Decoder windows are never
cached; the state after a replay is approximate by design. Cost ≈ N·L/2 + n_win·L/2 layers.

Exact prefill runs all layers over all tokens (the reference's behaviour), for comparison.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dsv41.engine.cache import SequenceCache
from dsv41.engine.runner import Runner
from dsv41.plan import FULL


def encoder_only_supported(runner: Runner) -> bool:
    """True when the decoder's only kv source is its first layer (its input = the encoder output)."""
    c = runner.config
    decoder_sources = [p.layer_id for p in runner.plans if p.mode == FULL and p.half == "decoder"]
    return decoder_sources in ([], [c.encoder_layers])


def prefill(runner: Runner, seq: SequenceCache, tokens: list[int], *, chunk: int = 2048,
            exact: bool = False, encoder_replay: int = 0, decoder_windows_valid: bool = False) -> Tensor:
    """Process `tokens` (appended after what seq already holds); return the last position's
    logits (vocab,) fp32.

    encoder_replay = R > 0 is Encoder SWA Bounded Replay after a prefix hit without windows: the
    last R cached tokens run through the encoder again, producing only window KV (their global KV
    is cached and is neither recomputed nor overwritten), truncated at their first position.
    decoder_windows_valid: seq's decoder rings hold the exact state at its end (an exact resume),
    so a short suffix continues them instead of starting a fresh bounded replay."""
    c = runner.config
    device = seq.device
    start0 = seq.n_tokens
    n_total = start0 + len(tokens)
    if not tokens:
        raise ValueError("prefill needs at least one token")
    if exact or not encoder_only_supported(runner):
        if encoder_replay:
            raise ValueError("encoder replay needs encoder-only prefill")
        h = pre_mix = None
        for cs in range(0, len(tokens), chunk):
            ids = tokens[cs:cs + chunk]
            t = torch.tensor([ids], device=device)
            h, pre_mix = runner.forward([seq], t, torch.tensor([start0 + cs], device=device), range(c.n_layers))
            seq.tokens.extend(ids)
        return runner.logits(h, pre_mix)[0]

    enc, window = c.encoder_layers, c.window_size
    tail_h: Tensor | None = None
    tail_pre: Tensor | None = None

    def keep_tail(h: Tensor, pre_mix: Tensor) -> None:
        nonlocal tail_h, tail_pre
        tail_h = h if tail_h is None else torch.cat((tail_h, h), dim=1)[:, -window:]
        tail_pre = pre_mix if tail_pre is None else torch.cat((tail_pre, pre_mix), dim=1)[:, -window:]

    first = start0
    if encoder_replay:
        first = start0 - encoder_replay
        ids = seq.tokens[first:start0]
        start = torch.tensor([first], device=device)
        seq.clear_windows(range(c.n_layers))
        keep_tail(*runner.forward([seq], torch.tensor([ids], device=device), start, range(enc),
                                  replay_start=start, compress=False))
    for cs in range(0, len(tokens), chunk):
        ids = tokens[cs:cs + chunk]
        t = torch.tensor([ids], device=device)
        start = torch.tensor([start0 + cs], device=device)
        h, pre_mix = runner.forward([seq], t, start, range(enc), replay_start=None if not encoder_replay
                                    else torch.tensor([first], device=device))
        if enc < c.n_layers and c.compress_ratios[enc] and runner.plans[enc].mode == FULL:
            runner.produce(enc, [seq], h, pre_mix, start)
        seq.tokens.extend(ids)
        keep_tail(h, pre_mix)
    replay = max(first, n_total - window)
    n_replay = n_total - replay
    ids = seq.tokens[replay:n_total]
    start = torch.tensor([replay], device=device)
    continue_windows = decoder_windows_valid and replay == start0
    h, pre_mix = runner.forward([seq], torch.tensor([ids], device=device), start, range(enc, c.n_layers),
                                tail_h[:, -n_replay:], tail_pre[:, -n_replay:],
                                replay_start=None if continue_windows else start, compress=False)
    return runner.logits(h, pre_mix)[0]
