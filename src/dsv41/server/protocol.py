"""OpenAI wire format: request schemas for /v1/completions and /v1/chat/completions, response bodies, errors.

Requests are validated strictly, like OpenAI's API: no string → number coercion, no NaN / Infinity,
unknown fields rejected, so every client mistake becomes a 400 whose `param` names the field.
Supported beyond the basics: `n`, `logprobs` / `top_logprobs`, `tools` (function tools; `tool_choice`
"auto" or "none"), `tool` role messages and assistant `tool_calls`. Fields OpenAI defines but this
server does not implement (penalties, logit_bias, echo, suffix, best_of > n, ...) are accepted only at
their neutral value and otherwise refused with a 400 saying so.

Extensions: `top_k` (both endpoints); `cache_salt` (vLLM's name: requests with different salts never
share prefix-cache entries); `reasoning_effort` also takes an integer 1–100 (SPEC §8: "low" = 50,
"high" = 75, "max" = 100); an assistant message may carry `reasoning_content` and the
`reasoning_effort` it was generated with, so a replayed history renders byte-exactly (prefix cache).
Also the bodies of vLLM's `/tokenize` and `/detokenize`.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

EFFORT_TIERS = {"low": 50, "high": 75, "max": 100}
MAX_N = 16  # choices per request (each one is a sequence in the batch)
FUNCTION_NAME = r"^[A-Za-z0-9_.-]{1,64}$"

STRICT = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class APIError(Exception):
    """An error the client sees as `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


_UNION_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}


def _param(loc: tuple) -> str | None:
    """A pydantic error location as OpenAI's `param` ("messages.[0].content"), union tags dropped."""
    parts: list[str] = []
    for x in loc:
        if isinstance(x, int):
            parts.append(f"[{x}]")
        elif isinstance(x, str) and x.isidentifier() and x not in _UNION_TAGS and not x[0].isupper():
            parts.append(x)
    return ".".join(parts) or None


def validation_error(e: ValidationError) -> APIError:
    errors = e.errors(include_url=False)
    param = _param(tuple(errors[0].get("loc", ())))
    # a union reports one error per member: show them together ("should be a string; or a list ...")
    messages = list(dict.fromkeys(x.get("msg", "invalid value") for x in errors
                                  if _param(tuple(x.get("loc", ()))) == param))[:3]
    where = f"'{param}': " if param else ""
    return APIError(400, where + "; or ".join(messages), param=param, code="invalid_value")


# ---------------------------------------------------------------------- requests
Effort = Literal["low", "high", "max"] | Annotated[int, Field(ge=1, le=100)]
Stop = Annotated[str, Field(min_length=1)] | Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=4)]


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool | None = None


class _Request(BaseModel):
    """Fields shared by both endpoints (OpenAI names and ranges)."""

    model_config = STRICT
    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None  # extension: 0 = off
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: Stop | None = None
    seed: Annotated[int, Field(ge=-(2**63), lt=2**64)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None  # extension (vLLM)

    def check_supported(self) -> None:
        """400 for fields this server understands but does not implement."""
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported (only 0)", param=name, code="unsupported_value")
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias", code="unsupported_value")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(_Request):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    echo: bool | None = None
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1, le=20)] | None = None
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise APIError(400, "best_of is only supported equal to n", param="best_of", code="unsupported_value")
        if isinstance(self.prompt, list) and not self.prompt:
            raise APIError(400, "prompt must not be an empty list", param="prompt", code="invalid_value")
        if isinstance(self.prompt, list) and not isinstance(self.prompt[0], int):
            if len(self.prompt) != 1:
                raise APIError(400, "batched prompts are not supported; send one request per prompt",
                               param="prompt", code="unsupported_value")
        for name, neutral in (("echo", False), ("suffix", None)):
            value = getattr(self, name)
            if value is not None and value != neutral:
                raise APIError(400, f"{name} is not supported", param=name, code="unsupported_value")

    @property
    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        return p[0] if isinstance(p, list) and p and not isinstance(p[0], int) else p


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    model_config = STRICT
    url: str  # data:image/<format>;base64,... only: the server never fetches a remote URL
    detail: Literal["auto", "low", "high"] | None = None  # accepted; every image uses the release's policy


class ImagePart(BaseModel):
    model_config = STRICT
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class FunctionCall(BaseModel):
    model_config = STRICT
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    arguments: str


class ToolCallIn(BaseModel):
    model_config = STRICT
    id: Annotated[str, Field(min_length=1, max_length=256)]
    type: Literal["function"]
    function: FunctionCall


class FunctionDef(BaseModel):
    model_config = STRICT
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: FunctionDef


class Message(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    reasoning_content: str | None = None  # assistant history: what it thought (DeepSeek API field)
    reasoning_effort: Effort | None = None  # extension, assistant history: the effort it was generated with
    tool_calls: Annotated[list[ToolCallIn], Field(max_length=128)] | None = None  # assistant history
    tool_call_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None  # tool results

    def text(self, image_marker: str = "") -> str:
        """The message text; each image part becomes `image_marker` (dropped by default)."""
        if isinstance(self.content, list):
            return "".join(p.text if isinstance(p, TextPart) else image_marker for p in self.content)
        return self.content or ""

    def image_urls(self) -> list[str]:
        return [p.image_url.url for p in self.content if isinstance(p, ImagePart)] if isinstance(self.content, list) \
            else []


class ResponseFormat(BaseModel):
    model_config = STRICT
    type: Literal["text"]


class ChatCompletionRequest(_Request):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    reasoning_effort: Effort | None = None
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        if isinstance(self.tool_choice, dict):
            raise APIError(400, "tool_choice naming a function is not supported (use 'auto' or 'none')",
                           param="tool_choice", code="unsupported_value")
        for i, m in enumerate(self.messages):
            if m.tool_calls is not None and m.role != "assistant":
                raise APIError(400, "tool_calls are only allowed on assistant messages",
                               param=f"messages.[{i}].tool_calls")
            if (m.role == "tool") != (m.tool_call_id is not None):
                raise APIError(400, "a tool message needs tool_call_id (and only tool messages have one)",
                               param=f"messages.[{i}].tool_call_id")
            if m.reasoning_effort is not None and m.role != "assistant":
                raise APIError(400, "reasoning_effort is only recorded on assistant messages",
                               param=f"messages.[{i}].reasoning_effort")
            if m.reasoning_content is not None and m.role != "assistant":
                raise APIError(400, "reasoning_content is only allowed on assistant messages",
                               param=f"messages.[{i}].reasoning_content")
            if m.image_urls() and m.role != "user":
                raise APIError(400, "image parts are only allowed in user messages", param=f"messages.[{i}].content")

    @property
    def effort(self) -> int | None:
        return effort_level(self.reasoning_effort)

    @property
    def logprob_count(self) -> int | None:
        """SamplingParams.logprobs: None (off) or how many top alternatives."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def offered_tools(self) -> list[dict] | None:
        """The tools the template renders (none with tool_choice 'none')."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def effort_level(effort: str | int | None) -> int | None:
    """API effort → the integer b in 1..100 the chat template renders (SPEC §8)."""
    return EFFORT_TIERS[effort] if isinstance(effort, str) else effort


def parse_request(cls: type[_Request], body: Any) -> _Request:
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}",
                       code="invalid_body")
    try:
        req = cls.model_validate(body)
    except ValidationError as e:
        raise validation_error(e) from None
    req.check_supported()
    return req


# ---------------------------------------------------------------------- responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_body(id: str, created: int, model: str, choices: list[dict], usage_: dict | None = None,
                    with_usage_field: bool = True) -> dict:
    """A completion, or a stream chunk of one (no choices: the final usage-only chunk)."""
    body = {"id": id, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "system_fingerprint": None}
    if with_usage_field:
        body["usage"] = usage_
    return body


def chat_message(content: str | None, reasoning: str | None, tool_calls: list[dict] | None) -> dict:
    return {"role": "assistant", "content": content, "reasoning_content": reasoning, "tool_calls": tool_calls or None}


def chat_choice(index: int, message: dict, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_body(id: str, created: int, model: str, choices: list[dict], usage_: dict) -> dict:
    return {"id": id, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": usage_, "system_fingerprint": None}


def chat_chunk(id: str, created: int, model: str, choices: list[dict], usage_: dict | None = None,
               with_usage_field: bool = False) -> dict:
    body = {"id": id, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices,
            "system_fingerprint": None}
    if with_usage_field:
        body["usage"] = usage_
    return body


def chunk_choice(index: int, delta: dict, finish_reason: str | None = None, logprobs: dict | None = None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_logprobs(entries: list[dict]) -> dict:
    """OpenAI's chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}], "refusal": null}."""
    def clean(e: dict) -> dict:
        return {"token": e["token"], "logprob": e["logprob"], "bytes": e["bytes"]}

    return {"content": [{**clean(e), "top_logprobs": [clean(t) for t in e["top_logprobs"]]} for e in entries],
            "refusal": None}


def completion_logprobs(entries: list[dict], offset: int = 0) -> dict:
    """OpenAI's legacy completion `logprobs`: parallel lists, top alternatives as {token: logprob}."""
    offsets, at = [], offset
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [_first_per_token(e["top_logprobs"]) for e in entries],
            "text_offset": offsets}


def _first_per_token(top: list[dict]) -> dict[str, float]:
    """{token text: logprob}; two ids with the same text keep the more likely one (the list is descending)."""
    out: dict[str, float] = {}
    for t in top:
        out.setdefault(t["token"], t["logprob"])
    return out


def tool_call_body(call_id: str, index: int, name: str, arguments: str, with_index: bool = False) -> dict:
    body = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    return {"index": index, **body} if with_index else body


def model_card(model_id: str, created: int, max_model_len: int) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "dsv41", "max_model_len": max_model_len}


class TokenizeCompletionRequest(BaseModel):
    model_config = STRICT
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # <bos> first, as /v1/completions encodes a string prompt


class TokenizeChatRequest(BaseModel):
    model_config = STRICT
    model: str | None = None
    messages: Annotated[list[Message], Field(min_length=1)]
    add_generation_prompt: bool = True
    reasoning_effort: Effort | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None


class DetokenizeRequest(BaseModel):
    model_config = STRICT
    model: str | None = None
    tokens: Annotated[list[Annotated[int, Field(ge=0, lt=2**31)]], Field(max_length=1 << 20)]


def parse_body(cls: type[BaseModel], body: Any) -> BaseModel:
    """Strict parse of a non-generation body (tokenize / detokenize)."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}",
                       code="invalid_body")
    try:
        return cls.model_validate(body)
    except ValidationError as e:
        raise validation_error(e) from None


REQUEST_SCHEMAS = {"CompletionRequest": CompletionRequest, "ChatCompletionRequest": ChatCompletionRequest,
                   "TokenizeCompletionRequest": TokenizeCompletionRequest, "TokenizeChatRequest": TokenizeChatRequest,
                   "DetokenizeRequest": DetokenizeRequest}
