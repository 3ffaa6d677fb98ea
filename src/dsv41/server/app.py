"""The OpenAI-compatible HTTP app: middleware (host check, body limits and timeout, counting), error bodies and
wiring. Routes live in `routes.py`, the work between parsing and answering in `serving.py`, detokenization in
`detokenize.py`.

Every client mistake is a 4xx with an OpenAI error body; only a real server fault is a 500, and the server stays
up either way. Input hygiene (issue 17): a `Host` allow-list (DNS rebinding), `Content-Type: application/json`
required on POST (no cross-site form posts), a body read timeout (a body shorter than its Content-Length cannot
hold a connection), lone surrogates and invalid UTF-8 refused with a 400, and opt-in CORS.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from dsv41.server import protocol as P
from dsv41.server import routes
from dsv41.server.detokenize import TextStream
from dsv41.server.metrics import ServerMetrics
from dsv41.server.scheduler import Scheduler
from dsv41.server.serving import ClientGone, Serving

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 8 * 2**20
DEFAULT_BODY_TIMEOUT_S = 30.0
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
LARGE_BODY_BYTES = 256 * 1024  # bodies above this are parsed on a worker thread

__all__ = ["DEFAULT_MAX_BODY_BYTES", "TextStream", "create_app"]


class BodyTooLarge(Exception):
    pass


class BodyTimeout(Exception):
    pass


# ---------------------------------------------------------------------- middleware (pure ASGI)
def _json_error(status: int, message: str, type: str = "invalid_request_error", code: str | None = None,
                param: str | None = None) -> JSONResponse:
    return JSONResponse(P.error_body(message, type, param, code), status_code=status)


class BodyLimit:
    """413 for a body over `max_bytes` (at once when Content-Length says so, else while it is read) and 408 for a
    body that does not arrive within `timeout_s` of waiting (each wait for the next piece is bounded)."""

    def __init__(self, app, max_bytes: int, timeout_s: float = DEFAULT_BODY_TIMEOUT_S):
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

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
        received, body_done = 0, False

        async def limited_receive():
            nonlocal received, body_done
            if body_done:  # afterwards receive() only waits for a disconnect: no timeout
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.timeout_s)
            except TimeoutError:
                raise BodyTimeout() from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if received > self.max_bytes:
                    raise BodyTooLarge()
            else:
                body_done = True
            return message

        await self.app(scope, limited_receive, send)

    async def _too_large(self, scope, receive, send):
        # drain what the client is sending (up to a bound and a time limit) so it reads the 413, not a reset
        drained, more = 0, True
        try:
            while more and drained <= 16 * self.max_bytes:
                message = await asyncio.wait_for(receive(), self.timeout_s)
                drained += len(message.get("body", b""))
                more = message.get("more_body", False) and message["type"] == "http.request"
        except TimeoutError:
            pass
        response = _json_error(413, f"request body larger than {self.max_bytes} bytes", code="body_too_large")
        response.headers["connection"] = "close"
        await response(scope, receive, send)


class HostCheck:
    """400 for a `Host` header outside the allow-list (DNS rebinding): hostnames compared without the port;
    '*' allows any."""

    def __init__(self, app, allowed: list[str] | tuple[str, ...]):
        self.app = app
        self.any = "*" in allowed
        self.allowed = {h.lower().strip("[]") for h in allowed}

    @staticmethod
    def hostname(value: str) -> str:
        value = value.strip().lower()
        if value.startswith("["):  # [::1]:8000
            return value[1:value.find("]")] if "]" in value else value
        return value.rsplit(":", 1)[0] if value.count(":") == 1 else value

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self.any:
            return await self.app(scope, receive, send)
        host = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), None)
        if host is None or self.hostname(host) not in self.allowed:
            response = _json_error(400, f"Host header {host!r} is not allowed on this server (see --allowed-hosts)",
                                   code="invalid_host")
            return await response(scope, receive, send)
        await self.app(scope, receive, send)


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
def _check_text(value: Any, path: str = "") -> None:
    """400 for a string that is not valid Unicode text (a lone surrogate such as "\\ud800")."""
    stack = [(value, path)]
    while stack:
        v, where = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise P.APIError(400, f"{where or 'the body'} contains a lone surrogate (not valid Unicode text)",
                                 param=where or None, code="invalid_unicode") from None
        elif isinstance(v, dict):
            stack.extend((k, f"{where}.<key>" if where else "<key>") for k in v)
            stack.extend((x, f"{where}.{k}" if where else str(k)) for k, x in v.items())
        elif isinstance(v, list):
            stack.extend((x, f"{where}.[{i}]") for i, x in enumerate(v))


def parse_json(raw: bytes) -> Any:
    """Body bytes → JSON value: valid UTF-8, no NaN / Infinity, no lone surrogates (APIError otherwise)."""
    def no_constants(name: str):
        raise ValueError(f"{name} is not valid JSON")

    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=no_constants)
    except UnicodeDecodeError as e:
        raise P.APIError(400, f"the body is not valid UTF-8: {e}", code="invalid_utf8") from None
    except (ValueError, RecursionError) as e:
        raise P.APIError(400, f"malformed JSON body: {e}", code="invalid_json") from None
    if b"\\u" in raw:  # a lone surrogate only comes from a \uD8xx escape (raw surrogate bytes fail the decode)
        _check_text(body)
    return body


async def read_json(request: Request, run=None) -> Any:
    """The JSON body: Content-Type must be JSON, then `parse_json` (on `run`'s worker thread for large bodies, so
    the event loop is free between the parser's C calls)."""
    ctype = request.headers.get("content-type")
    mime = (ctype or "").split(";")[0].strip().lower()
    if mime != "application/json" and not mime.endswith("+json"):
        raise P.APIError(415, f"Content-Type must be application/json, got {ctype!r}", code="unsupported_media_type")
    raw = await request.body()
    if not raw.strip():
        raise P.APIError(400, "the request body is empty; send a JSON object", code="invalid_json")
    if run is not None and len(raw) > LARGE_BODY_BYTES:
        return await run(parse_json, raw)
    return parse_json(raw)


def create_app(scheduler: Scheduler, tok, *, model_name: str, max_model_len: int,
               api_key: str | list[str] | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               metrics: ServerMetrics | None = None, allowed_hosts: list[str] | tuple[str, ...] = LOCAL_HOSTS,
               cors_origins: list[str] | None = None, body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
               tokenize_workers: int = 2, max_concurrent_tokenize: int = 4, image_limits=None,
               max_images: int = 8) -> FastAPI:
    metrics = metrics or scheduler.metrics or ServerMetrics()
    metrics.bind(scheduler)
    keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    serving = Serving(scheduler, tok, model_name=model_name, max_model_len=max_model_len,
                      tokenize_workers=tokenize_workers, max_concurrent_tokenize=max_concurrent_tokenize,
                      image_limits=image_limits, max_images=max_images)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        yield
        scheduler.stop()
        serving.close()

    async def require_key(request: Request) -> None:
        if not keys:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        token = token.strip()
        if scheme.lower() == "bearer":
            for key in keys:
                if hmac.compare_digest(token.encode(), key.encode()):
                    request.state.api_key = key  # the tenant: its own prefix-cache namespace
                    return
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

    @app.exception_handler(BodyTimeout)
    async def _body_timeout(request: Request, e: BodyTimeout):
        response = _json_error(408, f"the request body did not arrive within {body_timeout_s:g} s",
                               code="body_timeout")
        response.headers["connection"] = "close"
        return response

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

    async def read_body(request: Request) -> Any:
        loop = asyncio.get_running_loop()
        return await read_json(request, lambda fn, *a: loop.run_in_executor(serving.executor, fn, *a))

    routes.register(app, serving, metrics, require_key, read_body)
    _install_openapi(app)
    paths = {r.path for r in app.routes if hasattr(r, "path")}
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, timeout_s=body_timeout_s)
    if cors_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "content-type"])
    app.add_middleware(HostCheck, allowed=tuple(allowed_hosts))
    app.add_middleware(CountRequests, metrics=metrics, paths=paths)
    app.state.scheduler, app.state.metrics, app.state.serving = scheduler, metrics, serving
    return app


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
