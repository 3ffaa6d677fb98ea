"""The HTTP routes: parse a body, hand the work to `Serving`, shape OpenAI bodies and SSE chunks.

    GET  /v1/models, /v1/models/{id}   the one served model
    POST /v1/completions               text or token ids in, text out (n, logprobs, stop, stream)
    POST /v1/chat/completions          messages through the chat template (effort, tools, n, logprobs, stream)
    POST /tokenize, /detokenize        vLLM's token-id helpers (same key as /v1)
    GET  /health, /metrics             liveness and Prometheus text (no key)
"""

from __future__ import annotations

import json
import math
import secrets
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from dsv41.image_processor import expand_placeholders
from dsv41.server import protocol as P
from dsv41.server.detokenize import TextStream, ToolCall
from dsv41.server.metrics import ServerMetrics
from dsv41.server.serving import Choice, Serving, namespace_for

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context


def sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"


DONE = "data: [DONE]\n\n"


def _finite(x: float | None) -> float | None:
    """JSON has no -Infinity: a logprob of a token with probability 0 is reported as the lowest float."""
    if x is None or math.isfinite(x):
        return x
    return -3.4e38 if x < 0 else 3.4e38


def _clean_entries(entries: list[dict]) -> list[dict]:
    return [{**e, "logprob": _finite(e["logprob"]),
             "top_logprobs": [{**t, "logprob": _finite(t["logprob"])} for t in e["top_logprobs"]]} for e in entries]


def chat_messages(req: P.ChatCompletionRequest, image_marker: str = "") -> list[dict]:
    """Request messages as the chat template's dicts (developer = system; efforts as integers); each image
    part becomes `image_marker` in its message's text (dropped by default)."""
    out = []
    for m in req.messages:
        item: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                                "content": m.text(image_marker)}
        if m.reasoning_content is not None:
            item["reasoning_content"] = m.reasoning_content
        if m.reasoning_effort is not None:
            item["reasoning_effort"] = P.effort_level(m.reasoning_effort)
        if m.tool_calls:
            item["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        out.append(item)
    return out


def register(app: FastAPI, serving: Serving, metrics: ServerMetrics, require_key, read_json) -> None:
    scheduler, tok = serving.scheduler, serving.tok
    model_name, max_model_len = serving.model_name, serving.max_model_len
    created = P.now()
    v1 = [Depends(require_key)]

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise P.APIError(404, f"the model '{name}' does not exist; this server serves '{model_name}'",
                             param="model", code="model_not_found")

    def namespace(request: Request, req) -> str | None:
        return namespace_for(getattr(request.state, "api_key", None), getattr(req, "cache_salt", None))

    # ------------------------------------------------------------------ plain routes
    @app.get("/health")
    async def health():
        counts = scheduler.counts()
        if not scheduler.alive:
            return JSONResponse({"status": "down", "reason": scheduler.fatal or "engine thread not running",
                                 **counts}, status_code=503)
        return {"status": "draining" if scheduler.draining else "ok", "model": model_name, **counts}

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

    @app.post("/tokenize", dependencies=v1, openapi_extra=_body_schema("TokenizeCompletionRequest",
                                                                        "TokenizeChatRequest"))
    async def tokenize(request: Request):
        body = await read_json(request)
        if isinstance(body, dict) and "messages" in body:
            req = P.parse_body(P.TokenizeChatRequest, body)
            check_model(req.model)
            messages = chat_messages(req)  # the same template as /v1/chat/completions
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            ids = await serving.off_loop(lambda: tok.encode_chat(messages, req.add_generation_prompt,
                                                                 P.effort_level(req.reasoning_effort), tools))
        else:
            req = P.parse_body(P.TokenizeCompletionRequest, body)
            check_model(req.model)
            ids = (await serving.off_loop(tok.encode_batch, [req.prompt], req.add_special_tokens))[0]
        return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}

    @app.post("/detokenize", dependencies=v1, openapi_extra=_body_schema("DetokenizeRequest"))
    async def detokenize(request: Request):
        req = P.parse_body(P.DetokenizeRequest, await read_json(request))
        check_model(req.model)
        serving.check_ids(req.tokens, "tokens")
        return {"prompt": await serving.decode(req.tokens, False)}

    # ------------------------------------------------------------------ completions
    @app.post("/v1/completions", dependencies=v1, openapi_extra=_body_schema("CompletionRequest"))
    async def completions(request: Request) -> Response:
        req = P.parse_request(P.CompletionRequest, await read_json(request))
        check_model(req.model)
        prompt = req.single_prompt
        if isinstance(prompt, str):
            ids = await serving.encode_prompt(prompt)
        else:
            ids = list(prompt)
            serving.check_ids(ids, "prompt")
        max_tokens = COMPLETION_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        params = serving.params(req, ids, max_tokens, [tok.eos_id], "prompt", req.logprobs)
        streams = [TextStream(tok, req.stop_strings, split_reasoning=False) for _ in params]
        choices, queue = serving.submit(ids, params, namespace(request, req), streams)
        rid, t = P.new_id("cmpl"), P.now()
        first = await serving.first_event(request, choices, queue)
        want_lp = req.logprobs is not None

        if not req.stream:
            texts, entries = [""] * len(choices), [[] for _ in choices]
            async for u in serving.drive(request, choices, queue, first):
                texts[u.index] += u.delta.text.get("content", "")
                entries[u.index] += u.logprobs
            body = [P.completion_choice(c.index, texts[c.index], c.reason,
                                        P.completion_logprobs(_clean_entries(entries[c.index])) if want_lp else None)
                    for c in choices]
            return JSONResponse(P.completion_body(rid, t, model_name, body, serving.usage(ids, choices)))

        include_usage = req.include_usage
        offsets = [0] * len(choices)

        async def events() -> AsyncIterator[str]:
            try:
                async for u in serving.drive(request, choices, queue, first, poll=False):
                    text = u.delta.text.get("content", "")
                    if text or u.reason is not None or u.logprobs:
                        lp = P.completion_logprobs(_clean_entries(u.logprobs), offsets[u.index]) if want_lp else None
                        offsets[u.index] += len(text)
                        yield sse(P.completion_body(rid, t, model_name, [P.completion_choice(u.index, text, u.reason,
                                                                                             lp)],
                                                    None, include_usage))
                if include_usage:
                    yield sse(P.completion_body(rid, t, model_name, [], serving.usage(ids, choices), True))
            except P.APIError as e:
                yield sse(e.body())
            yield DONE

        return StreamingResponse(events(), media_type="text/event-stream", headers={"cache-control": "no-cache"})

    # ------------------------------------------------------------------ chat
    @app.post("/v1/chat/completions", dependencies=v1, openapi_extra=_body_schema("ChatCompletionRequest"))
    async def chat_completions(request: Request) -> Response:
        req = P.parse_request(P.ChatCompletionRequest, await read_json(request))
        check_model(req.model)
        tools = req.offered_tools
        images = await serving.decode_images([u for m in req.messages for u in m.image_urls()])
        marker = f"\x00image-{secrets.token_hex(8)}\x00" if images else None  # no user text can contain it
        ids = await serving.encode_chat(chat_messages(req, marker or ""), req.effort, tools, marker)
        if images:
            ids = expand_placeholders(ids, images, serving.scheduler.engine.config.image_token_id)
        params = serving.params(req, ids, req.requested_max_tokens, [tok.eos_id, tok.end_turn_id], "messages",
                                req.logprob_count)
        streams = [TextStream(tok, req.stop_strings, split_reasoning=True, parse_tools=bool(tools)) for _ in params]
        choices, queue = serving.submit(ids, params, namespace(request, req), streams, images)
        rid, t = P.new_id("chatcmpl"), P.now()
        first = await serving.first_event(request, choices, queue)
        want_lp = req.logprobs is True

        def call_id(c: Choice, call: ToolCall) -> str:
            return f"call_{rid.removeprefix('chatcmpl-')[:20]}_{c.index}_{call.index}"

        if not req.stream:
            entries = [[] for _ in choices]
            async for u in serving.drive(request, choices, queue, first):
                entries[u.index] += u.logprobs
            body = []
            for c in choices:
                s = c.stream
                calls = [P.tool_call_body(call_id(c, k), k.index, k.name, k.arguments) for k in s.tool_calls]
                message = P.chat_message(s.text["content"], s.text["reasoning"] if s.saw_reasoning else None, calls)
                body.append(P.chat_choice(c.index, message, c.reason,
                                          P.chat_logprobs(_clean_entries(entries[c.index])) if want_lp else None))
            return JSONResponse(P.chat_body(rid, t, model_name, body, serving.usage(ids, choices)))

        include_usage = req.include_usage

        def chunk(choices_: list[dict], use: dict | None = None) -> str:
            return sse(P.chat_chunk(rid, t, model_name, choices_, use, include_usage))

        async def events() -> AsyncIterator[str]:
            for c in choices:
                yield chunk([P.chunk_choice(c.index, {"role": "assistant", "content": ""})])
            try:
                async for u in serving.drive(request, choices, queue, first, poll=False):
                    c = choices[u.index]
                    delta = {("reasoning_content" if ch == "reasoning" else "content"): d
                             for ch, d in u.delta.text.items()}
                    if u.delta.tool_calls:
                        delta["tool_calls"] = [P.tool_call_body(call_id(c, k), k.index, k.name, k.arguments, True)
                                               for k in u.delta.tool_calls]
                    lp = P.chat_logprobs(_clean_entries(u.logprobs)) if want_lp and u.logprobs else None
                    if delta or lp:
                        yield chunk([P.chunk_choice(u.index, delta, None, lp)])
                    if u.reason is not None:
                        yield chunk([P.chunk_choice(u.index, {}, u.reason)])
                if include_usage:
                    yield chunk([], serving.usage(ids, choices))
            except P.APIError as e:
                yield sse(e.body())
            yield DONE

        return StreamingResponse(events(), media_type="text/event-stream", headers={"cache-control": "no-cache"})


def _body_schema(*names: str) -> dict:
    refs = [{"$ref": f"#/components/schemas/{n}"} for n in names]
    schema = refs[0] if len(refs) == 1 else {"oneOf": refs}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}
