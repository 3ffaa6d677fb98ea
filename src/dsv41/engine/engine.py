"""Engine: requests in, tokens out — prefill, batched decode and sampling over per-sequence caches.

The engine speaks token ids (tokenization happens at the edges). `generate` is the simple API;
`add_request` + `step` is what a scheduler or server drives: each step prefills the requests that
just arrived (one at a time, chunked) and then advances every running request by one token in a
single batched decode over sequences of different lengths.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from dsv41.engine.cache import CachePools, SequenceCache
from dsv41.engine.prefill import prefill
from dsv41.engine.prefix import PrefixCache
from dsv41.engine.runner import Runner
from dsv41.engine.sampling import SamplingParams, make_generator, sample
from dsv41.model.transformer import Transformer


@dataclass
class Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    exact_prefill: bool = False
    cache: SequenceCache | None = None
    output: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    next_token: int | None = None  # sampled, not yet run through the model
    prefill_ms: float = 0.0
    decode_s: float = 0.0
    cached_tokens: int = 0  # prompt tokens whose state came from the prefix cache
    replayed_tokens: int = 0  # cached tokens run through the encoder again (window rebuild)


@dataclass
class StepOutput:
    request: Request
    token: int | None  # the token emitted this step (None when a stop id ended the request)
    finished: bool


class Engine:
    def __init__(self, model: Transformer, *, prefill_chunk: int = 2048, max_batch: int = 64,
                 exact_prefill: bool = False, prefix_cache: PrefixCache | None = None):
        self.model = model.eval()
        self.config = model.config
        self.device = next(model.parameters()).device
        self.runner = Runner(model)
        self.prefill_chunk, self.max_batch, self.exact_prefill = prefill_chunk, max_batch, exact_prefill
        self.prefix_cache = prefix_cache
        self.pools = CachePools(self.config, self.device)  # every running sequence's pages and ring slot
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._ids = itertools.count()

    # ------------------------------------------------------------------ request API
    def add_request(self, prompt: list[int], params: SamplingParams | None = None,
                    exact_prefill: bool | None = None) -> Request:
        if not prompt:
            raise ValueError("prompt must hold at least one token")
        bad = [t for t in prompt if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} outside the vocabulary (0..{self.config.vocab_size - 1})")
        params = params or SamplingParams()
        req = Request(next(self._ids), list(prompt), params,
                      self.exact_prefill if exact_prefill is None else exact_prefill,
                      generator=make_generator(params.seed, self.device))
        self.waiting.append(req)
        return req

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @torch.no_grad()
    def step(self) -> list[StepOutput]:
        """Prefill every waiting request, then one batched decode step for the running ones."""
        outputs: list[StepOutput] = []
        decoding = [r for r in self.running if not r.finished]
        while self.waiting and len(self.running) < self.max_batch:
            req = self.waiting.pop(0)
            t0 = time.perf_counter()
            logits = self._prefill(req)
            req.prefill_ms = (time.perf_counter() - t0) * 1e3
            outputs.extend(self._emit([req], logits.unsqueeze(0)))
            if not req.finished:
                self.running.append(req)
        if decoding:
            t0 = time.perf_counter()
            logits = self.decode(decoding)
            dt = time.perf_counter() - t0
            for req in decoding:
                req.decode_s += dt / len(decoding)
            outputs.extend(self._emit(decoding, logits))
        self.running = [r for r in self.running if not r.finished]
        return outputs

    def _prefill(self, req: Request) -> Tensor:
        """Prefill one request, resuming from the prefix cache when its prompt extends a stored prefix."""
        req.cache = seq = SequenceCache(self.config, self.device, self.pools)
        use_cache = self.prefix_cache is not None and not req.exact_prefill
        resume = self.prefix_cache.resume(seq, req.prompt) if use_cache else None
        if resume is None:
            logits = prefill(self.runner, seq, req.prompt, chunk=self.prefill_chunk, exact=req.exact_prefill)
        else:
            req.cached_tokens, req.replayed_tokens = resume.cached_tokens, resume.encoder_replay
            logits = prefill(self.runner, seq, req.prompt[resume.cached_tokens:], chunk=self.prefill_chunk,
                             encoder_replay=resume.encoder_replay, decoder_windows_valid=resume.exact)
        if use_cache:
            self.prefix_cache.save(seq, ends=[len(req.prompt)])
        return logits

    def _finish(self, req: Request) -> None:
        """Output end: persist the conversation's units and its window snapshot."""
        if self.prefix_cache is not None and not req.exact_prefill and req.cache is not None:
            self.prefix_cache.save(req.cache, ends=[req.cache.n_tokens])
        if req.cache is not None:
            req.cache.release()

    def abort(self, req: Request) -> None:
        """Drop a request wherever it is (client gone): nothing is persisted, its cache is freed."""
        req.finished = True
        req.finish_reason = req.finish_reason or "cancelled"
        for queue in (self.running, self.waiting):
            if req in queue:
                queue.remove(req)
        if req.cache is not None:
            req.cache.release()

    def metrics(self) -> dict:
        return self.prefix_cache.metrics() if self.prefix_cache is not None else {}

    def decode(self, reqs: list[Request]) -> Tensor:
        """Run each request's pending token through all layers at once: logits (B, vocab)."""
        seqs = [r.cache for r in reqs]
        tokens = torch.tensor([[r.next_token] for r in reqs], device=self.device)
        start = torch.tensor([s.n_tokens for s in seqs], device=self.device)
        h, pre_mix = self.runner.forward(seqs, tokens, start, range(self.config.n_layers))
        for r in reqs:
            r.cache.tokens.append(r.next_token)
        return self.runner.logits(h, pre_mix)

    def _emit(self, reqs: list[Request], logits: Tensor) -> list[StepOutput]:
        """Sample one token per request from logits (B, vocab) — one call, each row with its own
        parameters and generator — and record it."""
        tokens = sample(logits, [r.params for r in reqs], [r.generator for r in reqs]).tolist()
        outputs = []
        for req, token in zip(reqs, tokens):
            if token in req.params.stop_token_ids:
                req.finished, req.finish_reason = True, "stop"
                self._finish(req)
                outputs.append(StepOutput(req, None, True))
                continue
            req.output.append(token)
            req.next_token = token
            if len(req.output) >= req.params.max_tokens:
                req.finished, req.finish_reason = True, "length"
                self._finish(req)
            outputs.append(StepOutput(req, token, req.finished))
        return outputs

    # ------------------------------------------------------------------ simple API
    def generate(self, prompts: list[list[int]], max_tokens: int, temperature: float = 0.0,
                 exact_prefill: bool = False, **sampling) -> list[list[int]]:
        """Generate for each prompt; returns the new token ids (stop ids excluded)."""
        reqs = [self.add_request(p, SamplingParams(temperature=temperature, max_tokens=max_tokens, **sampling),
                                 exact_prefill) for p in prompts]
        while any(not r.finished for r in reqs):
            self.step()
        return [r.output for r in reqs]
