"""The OpenAI-compatible API's response bodies as typed models, and its OpenAPI document.

The handlers build their JSON answers from these models, and `/openapi.json` is generated from them and
from the request models (`api_requests.ChatRequest`, `CompletionRequest`), narrowed to what this server
takes (its one model name, its max_tokens bound): the schema is what the handlers accept and answer, so a
schema-driven fuzzer (schemathesis) can hold the server to it.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error, in OpenAI's shape."""

    error: ErrorDetail


class Speculative(BaseModel):
    """What speculation did for this answer (an extension OpenAI clients keep as an extra field)."""

    drafter: str
    weights: str
    tau: float
    target_calls: int
    tokens_per_s: float
    prefill_s: float
    total_s: float


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # of the prompt, found in a kept KV cache (not prefilled again)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    unverified_tokens: int | None = None  # tokens the drafter wrote while the remote target was away
    speculative: Speculative | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprobEntry] | None = None
    refusal: list[TokenLogprobEntry] | None = None


class CompletionLogprobs(BaseModel):
    """The legacy completions endpoint's shape."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int]


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"]
    unverified: bool | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"]
    unverified: bool | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "moaspec"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def dump(model: BaseModel) -> dict[str, Any]:
    """A response body: optional extension fields that are unset are left out, as OpenAI does."""
    body = model.model_dump(exclude_none=True)
    for choice in body.get("choices", []):
        choice.setdefault("logprobs", None)  # OpenAI writes it out, as null when not asked for
        if "message" in choice:
            choice["message"].setdefault("content", None)  # null beside tool calls
    return body


ERRORS = {400: "invalid request", 401: "missing or wrong API key", 403: "refused host or origin (open API)",
          404: "unknown model", 413: "body too large", 503: "busy (Retry-After) or the target is unavailable"}


def responses(ok: type[BaseModel] | None, stream: bool = False) -> dict[int | str, dict[str, Any]]:
    """FastAPI's `responses=` for a route: its 200 body and every error it may answer."""
    out: dict[int | str, dict[str, Any]] = {code: {"model": ErrorResponse, "description": why}
                                            for code, why in ERRORS.items()}
    out[200] = {"model": ok, "description": "the answer"} if ok is not None else \
        {"description": "the answer", "content": {"application/json": {"schema": {"type": "object"}}}}
    if stream:
        event = {"type": "object", "required": ["data"], "properties": {"data": {
            "type": "string", "description": "a chunk of the answer as JSON, and last `[DONE]`"}}}
        out[200].setdefault("content", {})["text/event-stream"] = {"schema": event}
        out[200]["description"] = "the answer; with stream: true, server-sent events of chunks"
    return out


def install_openapi(app: FastAPI, bodies: dict[str, type[BaseModel]], model_name: str, max_tokens: int,
                    offers: dict[str, list[str]] | None = None) -> None:
    """Generate `app`'s OpenAPI document once, with `bodies` ({path: request model}) as the request bodies
    of those POST routes (the handlers parse the body themselves, to bound its size and answer errors in
    OpenAI's shape), "model" narrowed to the served name, max_tokens to this server's bound, and each field
    of `offers` ({field: values}) to the values this server takes."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for path, model in bodies.items():
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            props = schema["properties"]
            props["model"] = {"type": "string", "enum": [model_name]}
            for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
                if name in props:
                    props[name] = {"anyOf": [{"type": "integer", "minimum": 1, "maximum": max_tokens},
                                             {"type": "null"}]}
            for name, values in (offers or {}).items():
                if name in props:
                    props[name] = {"anyOf": [{"type": "string", "enum": values}, {"type": "null"}]}
            schemas[model.__name__] = schema
            doc["paths"][path]["post"]["requestBody"] = {
                "required": True, "content": {"application/json": {"schema": {
                    "$ref": f"#/components/schemas/{model.__name__}"}}}}
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
