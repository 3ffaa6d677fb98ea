"""Serving: what a route does between parsing a request and writing its response (issue 17).

  * tokenization off the event loop: a small thread pool per app (the Rust tokenizer's batch calls release the
    GIL) behind a semaphore that bounds concurrent tokenizations; the pool's threads run at a lower CPU priority
    so a huge prompt does not take cores from the engine thread;
  * request → `SamplingParams` (context and vocabulary checks, n choices with their own seeds);
  * `submit` of the n choices to the scheduler (one event queue, events tagged with the choice index), with the
    request's prefix-cache namespace and its images;
  * images (chat content parts): data URLs only — a remote URL is refused (400, the server never fetches),
    a malformed one is 400, one over the limits (`ImageLimits`: bytes, pixels; `max_images` per request) is
    413; decoded on the worker pool; each image part of a user message becomes one `image_token_id` in the
    template, widened to the image's span (`image_processor.expand_placeholders`);
  * `drive`: engine events → per-choice text deltas, tool calls, logprob entries, finish reasons and usage.

The routes (`routes.py`) only shape these into OpenAI bodies and SSE chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from dsv41.engine.sampling import SamplingParams
from dsv41.image_processor import (
    ImageError,
    ImageLimits,
    ImageTooLarge,
    chat_ids_with_images,
    data_url_bytes,
    decode_image,
)
from dsv41.server import protocol as P
from dsv41.server.detokenize import Delta, TextStream, TokenText, ToolCall
from dsv41.server.scheduler import Failure, Finish, QueueFull, Scheduler, ShuttingDown, Ticket, Token, TooLarge
from dsv41.train.tokenizer import chat_segments

log = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.5
DETOKENIZE_INLINE = 16  # more tokens than this at once are detokenized on the worker pool
WORKER_NICE = 5  # CPU priority step of the tokenizer threads (Linux: per thread)


class ClientGone(Exception):
    pass


@dataclass
class Choice:
    """One of the n outputs of a request."""

    index: int
    ticket: Ticket
    stream: TextStream
    finish: Finish | None = None
    reason: str | None = None
    logprobs: list[dict] = field(default_factory=list)  # entries not yet sent (streaming) / all (non-streaming)
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class Update:
    index: int
    delta: Delta
    reason: str | None = None
    logprobs: list[dict] = field(default_factory=list)


class Serving:
    def __init__(self, scheduler: Scheduler, tok, *, model_name: str, max_model_len: int, tokenize_workers: int = 2,
                 max_concurrent_tokenize: int = 4, image_limits: ImageLimits | None = None, max_images: int = 8):
        self.scheduler, self.tok = scheduler, tok
        self.image_limits, self.max_images = image_limits or ImageLimits(), max_images
        self.model_name, self.max_model_len = model_name, max_model_len
        self.vocab_size = scheduler.engine.config.vocab_size
        self.token_text = TokenText(tok)
        # every token covers at most this many bytes of text: a prompt of more than max_model_len times as many
        # bytes cannot fit, and is refused without being tokenized (seconds of CPU for a multi-megabyte prompt)
        self.max_token_bytes = max(len(self.token_text.token_bytes(i)) for i in range(tok.vocab_size))
        self.executor = ThreadPoolExecutor(max_workers=max(1, tokenize_workers), thread_name_prefix="dsv41-tok",
                                           initializer=_lower_priority)
        self.tokenize_slots = asyncio.Semaphore(max(1, max_concurrent_tokenize))

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ tokenization (worker threads)
    async def off_loop(self, fn: Callable, *args) -> Any:
        """Run fn(*args) on the tokenizer pool, at most `max_concurrent_tokenize` at once."""
        async with self.tokenize_slots:
            return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def check_text_length(self, n_bytes: int, param: str) -> None:
        """400 context_length_exceeded for text that needs more tokens than the context, before tokenizing it."""
        at_least = -(-n_bytes // self.max_token_bytes)
        if at_least >= self.max_model_len:
            raise P.APIError(400, f"the prompt has {n_bytes} bytes of text, so at least {at_least} tokens; this "
                                  f"model's context is {self.max_model_len} tokens", param=param,
                             code="context_length_exceeded")

    async def encode_prompt(self, text: str) -> list[int]:
        self.check_text_length(len(text.encode("utf-8")), "prompt")
        return (await self.off_loop(self.tok.encode_batch, [text], True))[0]

    async def encode_chat(self, messages: list[dict], effort: int | None, tools: list[dict] | None,
                          image_marker: str | None = None) -> list[int]:
        """Template ids; with `image_marker`, each occurrence of it in a message is one `image_token_id`."""
        segments = chat_segments(messages, True, effort, tools)
        literal = sum(len(t.encode("utf-8")) for t, control in segments if not control)
        self.check_text_length(literal, "messages")
        if image_marker is None:
            return await self.off_loop(lambda: self.tok.encode_chat(messages, True, effort, tools))
        image_id = self.scheduler.engine.config.image_token_id
        return await self.off_loop(chat_ids_with_images, self.tok, segments, image_id, image_marker)

    # ------------------------------------------------------------------ images
    async def decode_images(self, urls: list[str]) -> list:
        """Data URLs → `ImageInput`s (the processor's policy) on the worker pool; every bad one is a 4xx."""
        config = self.scheduler.engine.config
        if not urls:
            return []
        if not config.vision_enabled:
            raise P.APIError(400, f"the model {self.model_name} has no vision encoder and does not accept images",
                             param="messages", code="images_not_supported")
        if len(urls) > self.max_images:
            raise P.APIError(413, f"{len(urls)} images in one request; at most {self.max_images} are accepted",
                             param="messages", code="too_many_images")
        limit = 4 * (self.image_limits.max_bytes + 2) // 3 + 64  # base64 of max_bytes plus a header
        out = []
        for i, url in enumerate(urls):
            try:
                if isinstance(url, str) and len(url) > limit:
                    raise ImageTooLarge(f"the image data URL has {len(url)} characters, more than an image of "
                                        f"{self.image_limits.max_bytes} bytes needs")
                data = data_url_bytes(url)
                out.append(await self.off_loop(decode_image, data, config, self.image_limits))
            except ImageTooLarge as e:
                raise P.APIError(413, f"image {i}: {e}", param="messages", code="image_too_large") from None
            except ImageError as e:
                code = "remote_image_url" if "remote" in str(e) else "invalid_image"
                raise P.APIError(400, f"image {i}: {e}", param="messages", code=code) from None
        return out

    async def decode(self, ids: list[int], skip_special: bool) -> str:
        return await self.off_loop(self.tok.decode, ids, skip_special)

    # ------------------------------------------------------------------ parameters
    def check_ids(self, ids: list[int], param: str) -> None:
        if ids and max(ids) >= self.vocab_size:
            raise P.APIError(400, f"token id {max(ids)} is outside the vocabulary (0..{self.vocab_size - 1})",
                             param=param, code="invalid_value")

    def params(self, req: P._Request, prompt: list[int], max_tokens: int | None, stop_ids: list[int],
               prompt_param: str, logprobs: int | None) -> list[SamplingParams]:
        """One SamplingParams per choice (choice i > 0 of a seeded request gets seed + i)."""
        if len(prompt) >= self.max_model_len:
            raise P.APIError(400, f"the prompt has {len(prompt)} tokens; this model's context is "
                                  f"{self.max_model_len} tokens and at least one must be left to generate",
                             param=prompt_param, code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = self.max_model_len - len(prompt)
        if len(prompt) + max_tokens > self.max_model_len:
            raise P.APIError(400, f"this model's context is {self.max_model_len} tokens, but {len(prompt)} prompt + "
                                  f"{max_tokens} max_tokens were requested", param="max_tokens",
                             code="context_length_exceeded")
        if req.top_k is not None and req.top_k > self.vocab_size:
            raise P.APIError(400, f"top_k must be at most the vocabulary size {self.vocab_size} (0 = off)",
                             param="top_k", code="invalid_value")
        out = []
        for i in range(req.n or 1):
            seed = None if req.seed is None else (req.seed + i) % 2**64
            try:
                p = SamplingParams(temperature=1.0 if req.temperature is None else req.temperature,
                                   top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0,
                                   max_tokens=max_tokens, stop_token_ids=stop_ids, seed=seed, logprobs=logprobs)
                p.check_vocab(self.vocab_size)
            except ValueError as e:  # ranges the schema cannot express (kept in one place: SamplingParams)
                field_name = next((f for f in ("top_p", "top_k", "temperature", "logprobs", "max_tokens")
                                   if f in str(e)), None)
                raise P.APIError(400, str(e), param=field_name, code="invalid_value") from None
            out.append(p)
        return out

    # ------------------------------------------------------------------ submission
    def submit(self, prompt: list[int], params: list[SamplingParams], namespace: str | None,
               streams: list[TextStream], images: list | None = None) -> tuple[list[Choice], asyncio.Queue]:
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        if not self.scheduler.alive:
            raise P.APIError(503, "the engine is not running", type="server_error", code="engine_stopped")
        choices: list[Choice] = []

        def deliver_for(i: int):
            def deliver(event) -> None:
                try:
                    loop.call_soon_threadsafe(queue.put_nowait, (i, event))
                except RuntimeError:  # the loop is closed (shutdown)
                    pass
            return deliver

        try:
            for i, (p, stream) in enumerate(zip(params, streams)):
                ticket = self.scheduler.submit(prompt, p, deliver_for(i), namespace=namespace, images=images or None)
                choices.append(Choice(i, ticket, stream))
        except (QueueFull, TooLarge, ShuttingDown) as e:
            for c in choices:
                self.scheduler.cancel(c.ticket)
            if isinstance(e, QueueFull):
                raise P.APIError(429, str(e), type="rate_limit_error", code="queue_full") from None
            if isinstance(e, ShuttingDown):
                raise P.APIError(503, str(e), type="server_error", code="shutting_down") from None
            raise P.APIError(400, str(e), param="messages", code="context_length_exceeded") from None
        return choices, queue

    def cancel_all(self, choices: list[Choice]) -> None:
        for c in choices:
            if not c.ticket.done:
                self.scheduler.cancel(c.ticket)

    async def next_event(self, queue: asyncio.Queue, request: Request, choices: list[Choice]):
        """The next (index, event); cancels everything once the client has disconnected (checked every
        DISCONNECT_POLL_S, whether or not tokens are flowing)."""
        state = request.state
        while True:
            now = time.monotonic()
            if now >= getattr(state, "next_disconnect_check", 0.0):
                state.next_disconnect_check = now + DISCONNECT_POLL_S
                if await request.is_disconnected():
                    self.cancel_all(choices)
                    raise ClientGone()
            if not queue.empty():
                return queue.get_nowait()
            try:
                return await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                continue

    async def first_event(self, request: Request, choices: list[Choice], queue: asyncio.Queue):
        """Wait for the first event before answering, so a queue timeout or failure is still an HTTP error."""
        try:
            item = await self.next_event(queue, request, choices)
        except BaseException:
            self.cancel_all(choices)
            raise
        if isinstance(item[1], Failure):
            self.cancel_all(choices)
            f = item[1]
            raise P.APIError(f.status, f.message, type=f.type, code=f.code)
        return item

    # ------------------------------------------------------------------ events → updates
    def _logprob_entry(self, event: Token, k: int) -> dict:
        top = [{"token": self.token_text.token_str(t), "logprob": lp, "bytes": list(self.token_text.token_bytes(t)),
                "id": t} for t, lp in (event.top_logprobs or [])[:k]]
        return {"token": self.token_text.token_str(event.token), "logprob": event.logprob,
                "bytes": list(self.token_text.token_bytes(event.token)), "id": event.token, "top_logprobs": top}

    def _feed(self, choice: Choice, tokens: list[Token]) -> tuple[Delta, list[dict]]:
        """Detokenize a run of tokens for one choice (runs on the worker pool when the run is long)."""
        merged, entries = Delta(), []
        want = choice.ticket.params.logprobs
        for event in tokens:
            d = choice.stream.feed(event.token)
            for ch, text in d.text.items():
                merged.text[ch] = merged.text.get(ch, "") + text
            merged.tool_calls += d.tool_calls
            if want is not None and choice.stream.last_channel == "content" and event.logprob is not None:
                entries.append(self._logprob_entry(event, want))
            if choice.stream.stopped:
                break
        return merged, entries

    async def drive(self, request: Request, choices: list[Choice], queue: asyncio.Queue, first=None,
                    poll: bool = True) -> AsyncIterator[Update]:
        """Engine events → Updates (text, tool calls, logprobs, finish) until every choice has finished."""
        item = first
        open_choices = {c.index for c in choices}
        try:
            while open_choices:
                if item is None:
                    item = await (self.next_event(queue, request, choices) if poll else queue.get())
                batch: dict[int, list[Token]] = {}
                ends: list[tuple[int, Any]] = []
                while item is not None:  # drain what is queued right now
                    i, event = item
                    if isinstance(event, Token):
                        batch.setdefault(i, []).append(event)
                    else:
                        ends.append((i, event))
                    item = queue.get_nowait() if not queue.empty() else None
                for i, tokens in batch.items():
                    c = choices[i]
                    if i not in open_choices:
                        continue
                    if len(tokens) > DETOKENIZE_INLINE:
                        delta, entries = await self.off_loop(self._feed, c, tokens)
                    else:
                        delta, entries = self._feed(c, tokens)
                    if c.stream.stopped:  # a stop string matched: this choice is done
                        self.scheduler.cancel(c.ticket)
                        open_choices.discard(i)
                        c.reason = "stop"
                        yield Update(i, delta, "stop", entries)
                    elif delta.text or delta.tool_calls or entries:
                        yield Update(i, delta, None, entries)
                for i, event in ends:
                    c = choices[i]
                    if i not in open_choices:
                        continue
                    open_choices.discard(i)
                    if isinstance(event, Failure):
                        raise P.APIError(event.status, event.message, type=event.type, code=event.code)
                    c.finish = event
                    rest = c.stream.finish()
                    c.reason = "stop" if c.stream.stopped else event.reason
                    if c.stream.tool_calls and c.reason == "stop":
                        c.reason = "tool_calls"
                    yield Update(i, rest, c.reason)
        finally:
            self.cancel_all(choices)

    def usage(self, prompt: list[int], choices: list[Choice]) -> dict:
        completion = 0
        for c in choices:
            completion += c.finish.completion_tokens if c.finish is not None else c.stream.n_tokens
        first = choices[0]
        if first.finish is not None:
            cached = first.finish.cached_tokens
        else:
            cached = first.ticket.request.cached_tokens if first.ticket.request is not None else 0
        return P.usage(len(prompt), completion, cached)


def namespace_for(api_key: str | None, cache_salt: str | None) -> str | None:
    """The prefix-cache namespace of a request: its API key's (hashed) and its cache_salt, when given."""
    parts = []
    if api_key:
        parts.append("key:" + hashlib.sha256(api_key.encode()).hexdigest())
    if cache_salt:
        parts.append("salt:" + cache_salt)
    return "\x00".join(parts) or None


def _lower_priority() -> None:
    """Tokenizer threads yield the CPU to the engine thread (Linux nice is per thread)."""
    with contextlib.suppress(AttributeError, OSError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + WORKER_NICE))
