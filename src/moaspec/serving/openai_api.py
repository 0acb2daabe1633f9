"""`moaspec serve`: an OpenAI-compatible HTTP API in front of a `SpecDecoder` (local target, or a remote
one behind `moaspec serve-target`).

    GET  /v1/models                 the one model served
    POST /v1/chat/completions       messages rendered with the model's chat template
    POST /v1/completions            a raw prompt (text, or token ids)

`stream: true` answers with server-sent events (`data: {chunk}` ... `data: [DONE]`), one event per
verification round; `stream_options.include_usage` adds a last chunk with the usage. `usage` counts
prompt and completion tokens exactly (a stop string cuts the tokens too) and carries the speculative
metrics in `usage.speculative` (drafter, tau, target calls, tokens/s), which OpenAI clients keep as an
extra field.

Like the target server: the model runs one request at a time (an asyncio lock; two generations on a
few CPU cores only slow each other down), each verification round in a worker thread so the event
loop keeps answering, and a client that goes away stops its generation between rounds. Every request
is checked (pydantic, bounded body, prompt and max_tokens) and every error has OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`; a bad request is a 4xx, never a crash. With a
bearer key the API checks `Authorization: Bearer <key>`; without one it is open, so `serve` only binds
a loopback address.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import anyio
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from moaspec.decoding.engine import GenerationConfig, Metrics
from moaspec.decoding.sampling import SamplingParams
from moaspec.errors import ContextLengthError, UserError

if TYPE_CHECKING:
    from moaspec.pipeline import SpecDecoder

log = logging.getLogger("moaspec.api")

MAX_STOP = 16  # stop strings per request
MAX_STOP_CHARS = 512


@dataclass(frozen=True)
class ApiLimits:
    """Bounds on one request. A prompt must also leave room for max_tokens in the target's context."""

    max_prompt_tokens: int = 8192
    max_tokens: int = 1024  # the largest max_tokens a request may ask for, and the default when it gives none
    max_body_bytes: int = 4 << 20

    def __post_init__(self) -> None:
        for name in ("max_prompt_tokens", "max_tokens", "max_body_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise UserError(f"{name} must be a positive integer, got {value!r}")


# ------------------------------------------------------------------------------------ errors
class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def _validation_error(e: ValidationError) -> ApiError:
    err = e.errors()[0]
    if err["type"] == "json_invalid":
        return ApiError(400, f"We could not parse the JSON body of your request ({err['msg']}).",
                        code="invalid_json")
    param = ".".join(str(p) for p in err["loc"]) or None
    where = f"'{param}'" if param else "the request body"
    return ApiError(400, f"Invalid value for {where}: {err['msg']}.", param=param, code="invalid_value")


def _generation_error(e: Exception) -> ApiError:
    """An error raised while preparing or running a generation."""
    from moaspec.serving.remote import TargetUnavailable

    if isinstance(e, TargetUnavailable):
        return ApiError(503, f"the target server is unavailable: {e}", code="target_unavailable", kind="server_error")
    if isinstance(e, ContextLengthError):
        return ApiError(400, str(e), param="messages", code="context_length_exceeded")
    if isinstance(e, UserError):
        return ApiError(400, str(e), code="invalid_value")
    if type(e).__module__.startswith("jinja2"):  # the chat template refused the messages (e.g. role order)
        return ApiError(400, f"the model's chat template rejects these messages: {e}", param="messages",
                        code="invalid_value")
    log.error("generation failed", exc_info=e)
    return ApiError(500, f"internal error ({type(e).__name__})", kind="server_error")


# ------------------------------------------------------------------------------------ requests
class _Request(BaseModel):
    """Fields both endpoints take. Other fields are ignored, unless they ask for a feature this server
    lacks (see UNSUPPORTED)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None

    # field -> its values that mean "not used": any other value is a 400
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        "logprobs": (None, False), "top_logprobs": (None, 0), "logit_bias": (None, {}),
        "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
        "tools": (None, []), "functions": (None, []), "response_format": (None, {"type": "text"}),
        "echo": (None, False), "suffix": (None, ""), "best_of": (None, 1),
    }

    def check(self) -> None:
        for name, value in (self.model_extra or {}).items():
            if name in self.UNSUPPORTED and value not in self.UNSUPPORTED[name]:
                raise ApiError(400, f"'{name}' is not supported by this server.", param=name,
                               code="unsupported_parameter")
        if self.n != 1:
            raise ApiError(400, f"only n=1 is supported, got n={self.n}.", param="n", code="unsupported_value")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > MAX_STOP:
            raise ApiError(400, f"at most {MAX_STOP} stop strings, got {len(stops)}.", param="stop")
        if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise ApiError(400, f"a stop string must have 1 to {MAX_STOP_CHARS} characters.", param="stop")

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def as_dict(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1)


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int]


_Request.model_rebuild()
ChatRequest.model_rebuild()
CompletionRequest.model_rebuild()


# ------------------------------------------------------------------------------------ the app
@dataclass
class Stats:
    requests: int = 0
    errors: int = 0
    cancelled: int = 0  # generations stopped because the client went away
    completion_tokens: int = 0


class OpenAIServer:
    """A SpecDecoder served under a model name, with its limits and optional bearer key."""

    def __init__(self, dec: SpecDecoder, model_name: str, token: str | None = None, limits: ApiLimits | None = None,
                 drafter: str | None = None):
        self.dec, self.model_name, self.token = dec, model_name, token or None
        self.limits = limits or ApiLimits()
        self.drafter = drafter
        self.stats = Stats()
        self.created = int(time.time())
        self.lock = asyncio.Lock()
        self.app = self._build_app()

    # ------------------------------------------------------------ checks
    def _authorise(self, request: Request) -> None:
        if self.token is None:
            return
        header = request.headers.get("authorization", "")
        if not header.startswith("Bearer "):
            raise ApiError(401, "You didn't provide an API key: send it as 'Authorization: Bearer <key>'.",
                           code="invalid_api_key")
        if not hmac.compare_digest(header[len("Bearer "):].strip().encode(), self.token.encode()):
            raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")

    async def _parse(self, request: Request, kind: type[_Request]) -> _Request:
        size = request.headers.get("content-length", "")
        limit = self.limits.max_body_bytes
        too_big = ApiError(413, f"the request body exceeds {limit} bytes.", code="request_too_large")
        if size.isdigit() and int(size) > limit:
            raise too_big
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > limit:
                raise too_big
        try:
            req = kind.model_validate_json(bytes(body))
        except ValidationError as e:
            raise _validation_error(e) from None
        if req.model != self.model_name:
            raise ApiError(404, f"The model '{req.model}' does not exist; this server serves '{self.model_name}'.",
                           param="model", code="model_not_found")
        req.check()
        return req

    def _context(self) -> int:
        return self.dec.engine.target.max_seq_len

    def _prepare(self, req: _Request) -> tuple[list[int], GenerationConfig]:
        """Token ids of the prompt and the generation settings, checked against the limits (runs in the
        worker thread, under the lock: the tokenizer is not shared across threads)."""
        param = "messages" if isinstance(req, ChatRequest) else "prompt"
        if isinstance(req, ChatRequest):
            ids = self.dec.encode([m.as_dict() for m in req.messages])
        else:
            prompt = req.prompt
            if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
                if len(prompt) != 1:
                    raise ApiError(400, "only one prompt per request is supported.", param="prompt",
                                   code="unsupported_value")
                prompt = prompt[0]
            if isinstance(prompt, str):
                ids = self.dec.encode(prompt, chat=False)
            else:
                vocab = self.dec.target.cfg.vocab_size
                if not prompt:
                    raise ApiError(400, "the prompt is empty.", param="prompt")
                if any(not 0 <= t < vocab for t in prompt):
                    raise ApiError(400, f"prompt token ids must be in 0..{vocab - 1}.", param="prompt")
                ids = list(prompt)
        context = self._context()
        bound = min(self.limits.max_prompt_tokens, context - 1)
        if len(ids) > bound:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; this server takes at most {bound}.",
                           param=param, code="context_length_exceeded")
        asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        which = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        if asked is not None and asked > self.limits.max_tokens:
            raise ApiError(400, f"{which} is {asked}; this server allows at most {self.limits.max_tokens}.",
                           param=which, code="invalid_value")
        if asked is not None and len(ids) + asked > context:
            raise ApiError(400, f"the prompt ({len(ids)} tokens) + {which} ({asked}) exceeds the context of "
                           f"{context} tokens; lower {which} to {context - len(ids)} or shorten the prompt.",
                           param=which, code="context_length_exceeded")
        n = asked if asked is not None else min(self.limits.max_tokens, context - len(ids))
        seed = None if req.seed is None else req.seed % 2**63
        try:
            sampling = SamplingParams(temperature=req.temperature, top_p=req.top_p, seed=seed)
        except UserError as e:
            raise ApiError(400, str(e), code="invalid_value") from None
        return ids, GenerationConfig(max_new_tokens=n, sampling=sampling, stop=req.stops)

    async def _prepared(self, req: _Request) -> tuple[list[int], GenerationConfig]:
        try:
            async with self.lock:
                return await anyio.to_thread.run_sync(self._prepare, req)
        except ApiError:
            raise
        except Exception as e:
            raise _generation_error(e) from None

    # ------------------------------------------------------------ generation
    async def _rounds(self, request: Request, ids: list[int], cfg: GenerationConfig
                      ) -> AsyncIterator[tuple[str, list[int], str | None, Metrics | None]]:
        """(text delta, token ids, finish reason, metrics on the last round) per verification round, on
        the model alone; stops early, between rounds, if the client went away."""
        done = object()

        def step(it):
            with torch.no_grad():
                return next(it, done)

        async with self.lock:
            it = self.dec.stream(ids, cfg)
            finished = False
            try:
                # A client that went away is seen here, or cancels this task at an await (Starlette
                # listens for the disconnect while it streams); either way between two rounds.
                while not await request.is_disconnected():
                    # not abandoned on cancellation: the round finishes before the lock is released
                    item = await anyio.to_thread.run_sync(step, it)
                    if item is done:
                        finished = True
                        return
                    delta, new, finish = item
                    self.stats.completion_tokens += len(new)
                    finished = finish is not None
                    yield delta, new, finish, self.dec.engine.metrics if finished else None
                    if finished:
                        return
            except Exception:
                finished = True  # a failure, not a cancellation: the caller reports it
                raise
            finally:
                it.close()
                if not finished:
                    self.stats.cancelled += 1
                    log.info("client went away: generation stopped")

    def _usage(self, prompt_tokens: int, completion_tokens: int, m: Metrics | None) -> dict[str, Any]:
        usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                 "total_tokens": prompt_tokens + completion_tokens}
        if m is not None:
            drafter = self.drafter or (self.dec.drafter.name if self.dec.drafter is not None else "none")
            usage["speculative"] = {"drafter": drafter, "tau": round(m.tau, 4), "target_calls": m.target_calls,
                                    "tokens_per_s": round(m.tokens_per_s, 3), "prefill_s": round(m.prefill_s, 4),
                                    "total_s": round(m.total_s, 4)}
        return usage

    async def _complete(self, request: Request, kind: type[_Request]):
        self.stats.requests += 1
        try:
            self._authorise(request)
            req = await self._parse(request, kind)
            ids, cfg = await self._prepared(req)
        except ApiError as e:
            self.stats.errors += 1
            return e.response()
        chat = isinstance(req, ChatRequest)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        if req.stream:
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return StreamingResponse(self._events(request, req, ids, cfg, rid, created), media_type="text/event-stream",
                                     headers=headers)
        parts: list[str] = []
        completion, finish, metrics = 0, "length", None
        try:
            async with contextlib.aclosing(self._rounds(request, ids, cfg)) as rounds:
                async for delta, new, reason, m in rounds:
                    parts.append(delta)
                    completion += len(new)
                    finish, metrics = reason or finish, m or metrics
        except Exception as e:
            self.stats.errors += 1
            return _generation_error(e).response()
        text = "".join(parts)
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                             "model": self.model_name, "choices": [choice],
                             "usage": self._usage(len(ids), completion, metrics)})

    async def _events(self, request: Request, req: _Request, ids: list[int], cfg: GenerationConfig, rid: str,
                      created: int) -> AsyncIterator[str]:
        chat = isinstance(req, ChatRequest)
        usage_field = {"usage": None} if req.include_usage else {}

        def event(payload: dict[str, Any]) -> str:
            return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

        def chunk(text: str | None, finish: str | None, role: bool = False) -> str:
            if chat:
                delta: dict[str, Any] = {"role": "assistant"} if role else {}
                if text is not None:
                    delta["content"] = text
                choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            return event({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                          "created": created, "model": self.model_name, "choices": [choice], **usage_field})

        if chat:
            yield chunk("", None, role=True)
        completion, metrics, finished = 0, None, False
        try:
            async with contextlib.aclosing(self._rounds(request, ids, cfg)) as rounds:
                async for delta, new, finish, m in rounds:
                    completion += len(new)
                    if delta:
                        yield chunk(delta, None)
                    if finish is not None:
                        yield chunk(None, finish)
                        metrics, finished = m, True
        except Exception as e:  # not CancelledError: a client that went away simply ends the stream
            self.stats.errors += 1
            yield event(_generation_error(e).body())
        if finished and req.include_usage:
            yield event({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                         "created": created, "model": self.model_name, "choices": [],
                         "usage": self._usage(len(ids), completion, metrics)})
        yield "data: [DONE]\n\n"

    # ------------------------------------------------------------ routes
    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "moaspec"}

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="moaspec OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None)
        app.state.api = self

        @app.exception_handler(ApiError)
        async def api_error(request: Request, e: ApiError) -> JSONResponse:
            return e.response()

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
            code = "not_found" if e.status_code == 404 else None
            return ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", code=code).response()

        @app.get("/health")
        async def health() -> dict[str, Any]:
            return {"status": "ok", "model": self.model_name, "requests": self.stats.requests}

        @app.get("/v1/models")
        async def models(request: Request) -> JSONResponse:
            self._authorise(request)
            return JSONResponse({"object": "list", "data": [self._model_card()]})

        @app.get("/v1/models/{model:path}")
        async def model(request: Request, model: str) -> JSONResponse:
            self._authorise(request)
            if model != self.model_name:
                raise ApiError(404, f"The model '{model}' does not exist.", param="model", code="model_not_found")
            return JSONResponse(self._model_card())

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            return await self._complete(request, ChatRequest)

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self._complete(request, CompletionRequest)

        return app


def create_app(dec: SpecDecoder, model_name: str, token: str | None = None, limits: ApiLimits | None = None,
               drafter: str | None = None) -> FastAPI:
    """The API over `dec`, serving it as `model_name`; `token`: the bearer key clients must send (None:
    open); `drafter`: its name in `usage.speculative` (default: the drafter's own)."""
    return OpenAIServer(dec, model_name, token, limits, drafter).app


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_host(host: str, token: str | None) -> None:
    """An API without a key may only listen on loopback."""
    if token is None and not is_loopback(host):
        raise UserError(f"--host {host} would open the API to the network without a key: give it one "
                        "(--api-token-file, --token-file or $MOASPEC_TOKEN) or listen on 127.0.0.1")


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Run the API until interrupted."""
    import uvicorn

    check_host(host, app.state.api.token)
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)
