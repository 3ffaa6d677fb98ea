"""The OpenAI-compatible HTTP app: routes, auth, body limit, error bodies, SSE streaming.

    GET  /v1/models             the one served model
    POST /v1/completions        text in, text out (prompt: a string or a list of token ids)
    POST /v1/chat/completions   messages through the tokenizer's chat template (+ reasoning effort)
    GET  /health                liveness + batch counts (503 once the engine thread is gone)
    GET  /metrics               Prometheus text

Handlers tokenize at the edge and hand token ids to the `Scheduler` (one engine thread, continuous
batching); events come back through an asyncio queue. Every client mistake is a 4xx with an OpenAI
error body; only a real server fault is a 500, and the server stays up either way.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dsv41.engine.sampling import SamplingParams
from dsv41.server import protocol as P
from dsv41.server.metrics import ServerMetrics
from dsv41.server.scheduler import Failure, Finish, QueueFull, Scheduler, Ticket, Token, TooLarge
from dsv41.train.tokenizer import END_THINK, THINK

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 8 * 2**20
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context
DISCONNECT_POLL_S = 0.5


class BodyTooLarge(Exception):
    pass


class ClientGone(Exception):
    pass


# ---------------------------------------------------------------------- incremental detokenization
class TextStream:
    """Sampled token ids → text deltas on two channels ("reasoning" inside <think>…</think>, "content").

    Ids are decoded in runs that end on a complete character (a run whose text ends in U+FFFD waits
    for the next token), so the deltas concatenate to the text of the whole output. Stop strings
    apply to the content channel: the last `len(longest stop) - 1` characters are held back until
    they cannot start a match, and the text is cut before the first match.
    """

    def __init__(self, tok, stop: list[str], split_reasoning: bool):
        self.tok, self.stop = tok, stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.think_ids = (tok.special_ids[THINK], tok.special_ids[END_THINK]) if split_reasoning else (-1, -1)
        self.channel = "content"
        self.pending: dict[str, list[int]] = {"reasoning": [], "content": []}
        self.text = {"reasoning": "", "content": ""}
        self.sent = {"reasoning": 0, "content": 0}
        self.saw_reasoning = False
        self.stopped = False  # a stop string matched
        self.n_tokens = 0

    def feed(self, token: int) -> dict[str, str]:
        if self.stopped:
            return {}
        self.n_tokens += 1
        if token == self.think_ids[0]:
            self._decode(self.channel, final=True)
            self.channel, self.saw_reasoning = "reasoning", True
        elif token == self.think_ids[1]:
            self._decode(self.channel, final=True)
            self.channel = "content"
        else:
            self.pending[self.channel].append(token)
            self._decode(self.channel, final=False)
        return self._deltas(final=False)

    def finish(self) -> dict[str, str]:
        if self.stopped:
            return {}
        for ch in self.pending:
            self._decode(ch, final=True)
        return self._deltas(final=True)

    def _decode(self, ch: str, final: bool) -> None:
        ids = self.pending[ch]
        if ids:
            piece = self.tok.decode(ids, skip_special=True)
            if final or not piece.endswith("\ufffd"):
                self.text[ch] += piece
                ids.clear()

    def _deltas(self, final: bool) -> dict[str, str]:
        out = {}
        for ch in ("reasoning", "content"):
            text, limit = self.text[ch], len(self.text[ch])
            if ch == "content" and self.stop and not self.stopped:
                start = max(0, self.sent[ch] - self.hold)
                hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
                if hits:
                    self.text[ch] = text = text[:min(hits)]
                    self.stopped, limit = True, len(text)
                elif not final:
                    limit = max(self.sent[ch], len(text) - self.hold)
            if limit > self.sent[ch]:
                out[ch] = text[self.sent[ch]:limit]
                self.sent[ch] = limit
        return out


# ---------------------------------------------------------------------- middleware (pure ASGI)
def _json_error(status: int, message: str, type: str = "invalid_request_error", code: str | None = None,
                param: str | None = None) -> JSONResponse:
    return JSONResponse(P.error_body(message, type, param, code), status_code=status)


class BodyLimit:
    """413 for a body over `max_bytes`: at once when Content-Length says so, else while it is read."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for key, value in scope["headers"]:
            if key == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    return await _json_error(400, "invalid Content-Length header", code="invalid_header")(
                        scope, receive, send)
                if declared > self.max_bytes:
                    return await self._too_large(scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge()
            return message

        await self.app(scope, limited_receive, send)

    async def _too_large(self, scope, receive, send):
        # drain what the client is sending (up to a bound) so it reads the 413 instead of a reset
        drained, more = 0, True
        while more and drained <= 16 * self.max_bytes:
            message = await receive()
            drained += len(message.get("body", b""))
            more = message.get("more_body", False) and message["type"] == "http.request"
        response = _json_error(413, f"request body larger than {self.max_bytes} bytes", code="body_too_large")
        response.headers["connection"] = "close"
        await response(scope, receive, send)


class CountRequests:
    """dsv41_http_requests_total{route, status} for every response (errors from inner layers included)."""

    def __init__(self, app, metrics: ServerMetrics, paths: set[str]):
        self.app, self.metrics, self.paths = app, metrics, paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def send_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or (scope["path"] if scope["path"] in self.paths else "other")
            self.metrics.requests.inc(route=path, status=str(status))


# ---------------------------------------------------------------------- the app
def create_app(scheduler: Scheduler, tok, *, model_name: str, max_model_len: int, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, metrics: ServerMetrics | None = None) -> FastAPI:
    metrics = metrics or scheduler.metrics or ServerMetrics()
    metrics.bind(scheduler)
    vocab_size = scheduler.engine.config.vocab_size
    created = P.now()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        yield
        scheduler.stop()

    async def require_key(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise P.APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                             code="invalid_api_key")

    app = FastAPI(title="dsv41", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible server for DeepSeek-V4.1-Flash (dsv41).")
    app.router.redirect_slashes = False  # "/v1/completions/" is an unknown route (404), as on OpenAI

    # ------------------------------------------------------------------ errors
    @app.exception_handler(P.APIError)
    async def _api_error(request: Request, e: P.APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, e: ClientGone):
        return Response(status_code=499)  # nobody reads it; counted as 499 (client closed request)

    @app.exception_handler(BodyTooLarge)
    async def _too_large(request: Request, e: BodyTooLarge):
        return _json_error(413, f"request body larger than {max_body_bytes} bytes", code="body_too_large")

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        errors = e.errors()
        loc = tuple(errors[0].get("loc", ()))[1:] if errors else ()
        return _json_error(400, str(errors[0].get("msg", "invalid request")) if errors else "invalid request",
                           param=P._param(loc), code="invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        known = {404: (f"unknown route {request.method} {request.url.path}", "not_found"),
                 405: (f"method {request.method} not allowed on {request.url.path}", "method_not_allowed")}
        message, code = known.get(e.status_code, (str(e.detail), None))
        return _json_error(e.status_code, message, code=code)

    @app.exception_handler(Exception)
    async def _fault(request: Request, e: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return _json_error(500, "internal server error", type="server_error", code="internal_error")

    # ------------------------------------------------------------------ helpers
    async def read_json(request: Request) -> Any:
        ctype = request.headers.get("content-type")
        if ctype is not None:
            mime = ctype.split(";")[0].strip().lower()
            if mime != "application/json" and not mime.endswith("+json"):
                raise P.APIError(415, f"Content-Type must be application/json, got {ctype!r}",
                                 code="unsupported_media_type")
        raw = await request.body()
        if not raw.strip():
            raise P.APIError(400, "the request body is empty; send a JSON object", code="invalid_json")

        def no_constants(name: str):
            raise ValueError(f"{name} is not valid JSON")

        try:
            return json.loads(raw, parse_constant=no_constants)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise P.APIError(400, f"malformed JSON body: {e}", code="invalid_json") from None

    def check_model(name: str) -> None:
        if name != model_name:
            raise P.APIError(400, f"the model '{name}' does not exist; this server serves '{model_name}'",
                             param="model", code="model_not_found")

    def sampling(req: P._Request, prompt: list[int], max_tokens: int | None, stop_ids: list[int],
                 prompt_param: str) -> SamplingParams:
        if len(prompt) >= max_model_len:
            raise P.APIError(400, f"the prompt has {len(prompt)} tokens; this model's context is {max_model_len} "
                                  "tokens and at least one must be left to generate",
                             param=prompt_param, code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = max_model_len - len(prompt)
        if len(prompt) + max_tokens > max_model_len:
            raise P.APIError(400, f"this model's context is {max_model_len} tokens, but {len(prompt)} prompt + "
                                  f"{max_tokens} max_tokens were requested", param="max_tokens",
                             code="context_length_exceeded")
        return SamplingParams(temperature=1.0 if req.temperature is None else req.temperature,
                              top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0,
                              max_tokens=max_tokens, stop_token_ids=stop_ids,
                              seed=None if req.seed is None else req.seed % 2**64)

    def submit(prompt: list[int], params: SamplingParams) -> tuple[Ticket, asyncio.Queue]:
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()

        def deliver(event) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, event)
            except RuntimeError:  # the loop is closed (shutdown)
                pass

        if not scheduler.alive:
            raise P.APIError(503, "the engine is not running", type="server_error", code="engine_stopped")
        try:
            ticket = scheduler.submit(prompt, params, deliver)
        except QueueFull as e:
            raise P.APIError(429, str(e), type="rate_limit_error", code="queue_full") from None
        except TooLarge as e:
            raise P.APIError(400, str(e), param="max_tokens", code="kv_budget_exceeded") from None
        return ticket, queue

    async def next_event(queue: asyncio.Queue, request: Request, ticket: Ticket):
        """The next engine event; cancels the ticket once the client has disconnected (checked every
        DISCONNECT_POLL_S, whether or not tokens are flowing)."""
        state = request.state
        while True:
            now = time.monotonic()
            if now >= getattr(state, "next_disconnect_check", 0.0):
                state.next_disconnect_check = now + DISCONNECT_POLL_S
                if await request.is_disconnected():
                    scheduler.cancel(ticket)
                    raise ClientGone()
            if not queue.empty():
                return queue.get_nowait()
            try:
                return await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                continue

    def usage_of(ticket: Ticket, finish: Finish | None, stream: TextStream) -> dict:
        if finish is not None:
            return P.usage(finish.prompt_tokens, finish.completion_tokens, finish.cached_tokens)
        cached = ticket.request.cached_tokens if ticket.request is not None else 0
        return P.usage(len(ticket.prompt), stream.n_tokens, cached)

    async def drive(request: Request, ticket: Ticket, queue: asyncio.Queue, stream: TextStream, first=None,
                    poll: bool = True) -> AsyncIterator[tuple[dict[str, str], str | None, dict | None]]:
        """Engine events → (text deltas, finish_reason, usage) batches; drains whatever is queued at once."""
        event = first
        try:
            while True:
                if event is None:
                    event = await (next_event(queue, request, ticket) if poll else queue.get())
                deltas: dict[str, str] = {}
                while isinstance(event, Token):
                    for ch, d in stream.feed(event.token).items():
                        deltas[ch] = deltas.get(ch, "") + d
                    if stream.stopped:
                        scheduler.cancel(ticket)
                        yield deltas, "stop", usage_of(ticket, None, stream)
                        return
                    event = queue.get_nowait() if not queue.empty() else None
                if isinstance(event, Finish):
                    for ch, d in stream.finish().items():
                        deltas[ch] = deltas.get(ch, "") + d
                    reason = "stop" if stream.stopped else event.reason
                    yield deltas, reason, usage_of(ticket, event, stream)
                    return
                if isinstance(event, Failure):
                    if deltas:
                        yield deltas, None, None
                    raise P.APIError(event.status, event.message, type=event.type, code=event.code)
                yield deltas, None, None
        finally:
            if not ticket.done:
                scheduler.cancel(ticket)

    async def first_event(request: Request, ticket: Ticket, queue: asyncio.Queue):
        """Wait for the first event before answering, so a queue timeout or failure is still an HTTP error."""
        try:
            event = await next_event(queue, request, ticket)
        except BaseException:
            scheduler.cancel(ticket)
            raise
        if isinstance(event, Failure):
            raise P.APIError(event.status, event.message, type=event.type, code=event.code)
        return event

    def sse(body: dict) -> str:
        return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def sse_error(e: P.APIError) -> str:
        return sse(e.body())

    def render_chat(req: P.ChatCompletionRequest) -> list[int]:
        """The tokenizer's chat template; message text is encoded literally (Tok.encode_chat)."""
        messages = []
        for m in req.messages:
            item = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            if m.reasoning_content is not None:
                item["reasoning_content"] = m.reasoning_content
            if m.reasoning_effort is not None:
                item["reasoning_effort"] = P.effort_level(m.reasoning_effort)
            messages.append(item)
        return tok.encode_chat(messages, add_generation_prompt=True, reasoning_effort=req.effort)

    # ------------------------------------------------------------------ routes
    v1 = [Depends(require_key)]

    @app.get("/health")
    async def health():
        counts = scheduler.counts()
        if not scheduler.alive:
            return JSONResponse({"status": "down", "reason": scheduler.fatal or "engine thread not running",
                                 **counts}, status_code=503)
        return {"status": "ok", "model": model_name, **counts}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type=ServerMetrics.CONTENT_TYPE)

    @app.get("/v1/models", dependencies=v1)
    async def list_models():
        return {"object": "list", "data": [P.model_card(model_name, created, max_model_len)]}

    @app.get("/v1/models/{model_id:path}", dependencies=v1)
    async def get_model(model_id: str):
        check_model(model_id)
        return P.model_card(model_name, created, max_model_len)

    @app.post("/v1/completions", dependencies=v1, openapi_extra=_body_schema("CompletionRequest"))
    async def completions(request: Request) -> Response:
        req = P.parse_request(P.CompletionRequest, await read_json(request))
        check_model(req.model)
        prompt = req.single_prompt
        if isinstance(prompt, str):
            ids = await asyncio.to_thread(tok.encode, prompt, True) if len(prompt) > 4096 else tok.encode(prompt, True)
        else:
            ids = list(prompt)
            if max(ids) >= vocab_size:
                raise P.APIError(400, f"token id {max(ids)} is outside the vocabulary (0..{vocab_size - 1})",
                                 param="prompt", code="invalid_value")
        max_tokens = COMPLETION_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        params = sampling(req, ids, max_tokens, [tok.eos_id], "prompt")
        ticket, queue = submit(ids, params)
        stream = TextStream(tok, req.stop_strings, split_reasoning=False)
        rid, t = P.new_id("cmpl"), P.now()
        first = await first_event(request, ticket, queue)
        if not req.stream:
            text, result = "", None
            async for deltas, reason, use in drive(request, ticket, queue, stream, first):
                text += deltas.get("content", "")
                if reason is not None:
                    result = P.completion_body(rid, t, model_name, text, reason, use)
            return JSONResponse(result)

        include_usage = req.include_usage

        async def events() -> AsyncIterator[str]:
            try:
                async for deltas, reason, use in drive(request, ticket, queue, stream, first, poll=False):
                    text = deltas.get("content", "")
                    if text or reason is not None:
                        yield sse(P.completion_body(rid, t, model_name, text, reason, None, include_usage))
                    if reason is not None and include_usage:
                        yield sse(P.completion_body(rid, t, model_name, None, None, use, True))
            except P.APIError as e:
                yield sse_error(e)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers={"cache-control": "no-cache"})

    @app.post("/v1/chat/completions", dependencies=v1, openapi_extra=_body_schema("ChatCompletionRequest"))
    async def chat_completions(request: Request) -> Response:
        req = P.parse_request(P.ChatCompletionRequest, await read_json(request))
        check_model(req.model)
        ids = await asyncio.to_thread(render_chat, req)
        params = sampling(req, ids, req.requested_max_tokens, [tok.eos_id, tok.end_turn_id], "messages")
        ticket, queue = submit(ids, params)
        stream = TextStream(tok, req.stop_strings, split_reasoning=True)
        rid, t = P.new_id("chatcmpl"), P.now()
        first = await first_event(request, ticket, queue)
        if not req.stream:
            result = None
            async for _, reason, use in drive(request, ticket, queue, stream, first):
                if reason is not None:
                    reasoning = stream.text["reasoning"] if stream.saw_reasoning else None
                    result = P.chat_body(rid, t, model_name, stream.text["content"], reasoning, reason, use)
            return JSONResponse(result)

        include_usage = req.include_usage

        def chunk(delta: dict | None, reason: str | None = None, use: dict | None = None) -> str:
            return sse(P.chat_chunk(rid, t, model_name, delta, reason, use, include_usage))

        async def events() -> AsyncIterator[str]:
            yield chunk({"role": "assistant", "content": ""})
            try:
                async for deltas, reason, use in drive(request, ticket, queue, stream, first, poll=False):
                    delta = {("reasoning_content" if ch == "reasoning" else "content"): d for ch, d in deltas.items()}
                    if delta:
                        yield chunk(delta)
                    if reason is not None:
                        yield chunk({}, reason)
                        if include_usage:
                            yield chunk(None, None, use)
            except P.APIError as e:
                yield sse_error(e)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers={"cache-control": "no-cache"})

    _install_openapi(app)
    paths = {r.path for r in app.routes if hasattr(r, "path")}
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.add_middleware(CountRequests, metrics=metrics, paths=paths)
    app.state.scheduler, app.state.metrics = scheduler, metrics
    return app


def _body_schema(name: str) -> dict:
    ref = {"$ref": f"#/components/schemas/{name}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def _install_openapi(app: FastAPI) -> None:
    """The routes read their bodies themselves (strict parsing); publish the request schemas anyway."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = build()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for name, model in P.REQUEST_SCHEMAS.items():
                s = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(s.pop("$defs", {}))
                components[name] = s
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
