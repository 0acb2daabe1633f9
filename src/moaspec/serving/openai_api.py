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

Concurrent requests decode together: each runs on its own fork of the decoder (its own drafter state and
KV cache over the shared weights, `SpecDecoder.fork`), its rounds in worker threads, and every fork's
target passes go through one `Scheduler`, which stacks them into batched forward passes (bit-identical
per request to a pass alone: batching changes no token). Nothing holds the model while an answer is
written to a slow client. A request reserves the KV memory its prompt and max_tokens may fill
(`Admission`, at most `parallel` at once); one that does not fit waits in a bounded queue, and when that
is full the answer is 503 with Retry-After. A client that goes away stops its generation between rounds
and frees its rows at once. Every request is checked (pydantic, bounded body, prompt and max_tokens) and
every error has OpenAI's shape `{"error": {"message", "type", "param", "code"}}`; a bad request is a 4xx,
never a crash. With a bearer key the API checks `Authorization: Bearer <key>`; without one it is open,
so `serve` only binds a loopback address, and it then answers only requests addressed to a loopback name
(Host) and not sent by another site's page (Origin): no DNS rebinding, no cross-site POSTs.

A generation whose remote target went away for longer than it may wait ends with text the drafter wrote
alone: the policy is to mark it, not to fail: `usage.unverified_tokens` counts those tokens and the
choice carries `"unverified": true`.
"""

from __future__ import annotations

import hmac
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from moaspec.errors import UserError
from moaspec.serving import api_schema as S
from moaspec.serving import responses_api as R
from moaspec.serving.api_generation import Generations, link, usage_body
from moaspec.serving.api_requests import (
    ApiError,
    ApiLimits,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    _Request,
    busy,
    refuse_unsupported,
    validation_error,
)
from moaspec.serving.api_streams import chat_events, response_events, response_usage
from moaspec.serving.metrics import exposition
from moaspec.serving.runner import ConnectionLimits, in_worker, is_loopback, warn_exposure
from moaspec.serving.runner import serve as run

if TYPE_CHECKING:
    from moaspec.pipeline import SpecDecoder

__all__ = ["API_KEY_ENV", "ApiLimits", "OpenAIServer", "build_app", "check_host", "create_app", "serve"]

API_KEY_ENV = "MOASPEC_API_KEY"  # the API key when no --api-token-file is given
MAX_OTHER_CONNECTIONS = 256  # beyond the generations and their queue: streams ending, the page, /metrics; then 503
STATIC = Path(__file__).resolve().parent / "static"  # the chat page at /
# the page runs only its own scripts (vendored), and talks only to this server
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; "
                                           "frame-ancestors 'none'; form-action 'self'; base-uri 'none'; "
                                           "object-src 'none'",
                "X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY", "Cache-Control": "no-cache"}


class OpenAIServer:
    """The API's routes over `Generations`: authorisation, bounded bodies, checked requests, the answers."""

    def __init__(self, dec: SpecDecoder, model_name: str, token: str | None = None, limits: ApiLimits | None = None,
                 drafter: str | None = None, hosts: tuple[str, ...] = (), scheduler_thread: bool = True):
        """`hosts`: names this server is reached by besides loopback ones (checked when it has no key);
        `drafter`, `scheduler_thread`: as `Generations`'."""
        self.model_name, self.token = model_name, token or None
        self.limits = limits or ApiLimits()
        self.gen = Generations(dec, model_name, self.limits, drafter, scheduler_thread)
        self.created = int(time.time())
        self.hosts = {"localhost", "127.0.0.1", "::1", *hosts}
        self.app = self._build_app()

    def close(self) -> None:
        self.gen.close()

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
        body = await self._body(request)
        try:
            req = kind.model_validate_json(body)
        except ValidationError as e:
            raise validation_error(e) from None
        self._check_model(req.model)
        req.check()
        return req

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise ApiError(404, f"The model '{model}' does not exist; this server serves '{self.model_name}'.",
                           param="model", code="model_not_found")

    async def _body(self, request: Request) -> bytes:
        """The request body, refused past the size bound (before all of it is read)."""
        size = request.headers.get("content-length", "")
        limit = self.limits.max_body_bytes
        too_big = ApiError(413, f"the request body exceeds {limit} bytes.", code="request_too_large")
        if size.isascii() and size.isdigit() and int(size) > limit:
            raise too_big
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > limit:
                raise too_big
        return bytes(body)

    def _full(self) -> JSONResponse | None:
        """A 503 when no place is free and the queue for one is full."""
        if not self.gen.admission.full():
            return None
        self.gen.stats.errors += 1
        return busy(self.gen.admission.retry_after(), f"{self.gen.admission.waiting} requests are waiting").response()

    async def _complete(self, request: Request, kind: type[_Request]):
        self.gen.stats.requests += 1
        try:
            self._authorise(request)
            req = await self._parse(request, kind)
            job = await self.gen.prepared(req)
        except ApiError as e:
            self.gen.stats.errors += 1
            return e.response()
        if (full := self._full()) is not None:
            return full
        chat = isinstance(req, ChatRequest)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        if req.stream:
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return StreamingResponse(chat_events(self.gen, self.model_name, request, req, job, rid, created),
                                     media_type="text/event-stream", headers=headers)
        try:
            done = await self.gen.collect(request, job)
        except ApiError as e:
            return e.response()
        text, tokens, logprobs, finish = done.text, done.tokens, done.logprobs, done.finish
        unverified = True if done.metrics is not None and done.metrics.unverified_in_output else None
        usage = usage_body(len(job.ids), len(tokens), done.metrics, done.live)
        asked = job.cfg.logprobs is not None
        if chat:
            lp = S.ChoiceLogprobs(content=self.gen.chat_logprobs(tokens, logprobs)) if asked else None
            content, calls = job.tools.parse(text) if job.tools is not None else (text, [])
            message = S.AssistantMessage(content=content, tool_calls=[S.ToolCall(
                id=c.id, function=S.FunctionCall(name=c.name, arguments=c.arguments)) for c in calls] or None)
            body: BaseModel = S.ChatCompletion(id=rid, created=created, model=self.model_name, usage=usage, choices=[
                S.ChatChoice(message=message, logprobs=lp, finish_reason="tool_calls" if calls else finish,
                             unverified=unverified)])
        else:
            lp = self.gen.completion_logprobs(tokens, logprobs, 0) if asked else None
            body = S.Completion(id=rid, created=created, model=self.model_name, usage=usage, choices=[
                S.CompletionChoice(text=text, logprobs=lp, finish_reason=finish, unverified=unverified)])
        return JSONResponse(S.dump(body))

    async def _respond(self, request: Request):
        """POST /v1/responses: the request runs as a chat request (`responses_api.chat_body`)."""
        self.gen.stats.requests += 1
        try:
            self._authorise(request)
            body = await self._body(request)
            try:
                rreq = R.ResponsesRequest.model_validate_json(body)
            except ValidationError as e:
                raise validation_error(e) from None
            self._check_model(rreq.model)
            stored = " (this server stores no responses: send the conversation's items)"
            refuse_unsupported(rreq.model_extra, rreq.UNSUPPORTED,
                               {"previous_response_id": stored, "conversation": stored})
            try:
                req = ChatRequest.model_validate(R.chat_body(rreq))
            except R.ItemError as e:
                raise ApiError(400, str(e), param=e.param, code="invalid_value") from None
            except ValidationError as e:
                raise validation_error(e) from None
            req.check()
            job = await self.gen.prepared(req)
        except ApiError as e:
            self.gen.stats.errors += 1
            return e.response()
        if (full := self._full()) is not None:
            return full
        rid, created = R.new_id("resp"), time.time()
        if rreq.stream:
            return StreamingResponse(response_events(self.gen, self.model_name, request, rreq, job, rid, created),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            done = await self.gen.collect(request, job)
        except ApiError as e:
            return e.response()
        content, calls = job.tools.parse(done.text) if job.tools is not None else (done.text, [])
        output = ([R.message_item(content, R.new_id("msg"))] if content else []) + \
            [R.call_item(c, R.new_id("fc")) for c in calls]
        incomplete = "max_output_tokens" if done.finish == "length" else None
        return JSONResponse(R.response_object(
            rid, created, self.model_name, rreq, output, "incomplete" if incomplete else "completed",
            response_usage(job, len(done.tokens), done.metrics), incomplete))

    async def _tokenize(self, request: Request) -> JSONResponse:
        """POST /tokenize (vLLM's and llama-server's): a prompt's or a conversation's token ids."""
        self._authorise(request)
        req = self._validated(TokenizeRequest, await self._body(request))
        if req.model is not None:
            self._check_model(req.model)
        text = req.prompt if req.prompt is not None else req.content
        if (text is None) == (req.messages is None):
            raise ApiError(400, "give one of prompt (or content) and messages.", param="prompt")
        bound = self.gen.prompt_bound()
        if text is not None and len(text) > bound * self.gen.longest():
            raise ApiError(400, f"the prompt is longer than {bound} tokens can hold.", param="prompt",
                           code="context_length_exceeded")

        def encode() -> list[int]:
            if req.messages is not None:
                return self.gen.chat_prompt(ChatRequest(model=self.model_name, messages=req.messages))[0]
            with self.gen.dec.tokenizer_lock:
                return self.gen.dec.tokenizer.encode(text, add_special_tokens=req.add_special_tokens)

        try:
            ids = await in_worker(encode, limiter=self.gen.threads)
        except UserError as e:
            raise ApiError(400, str(e), code="invalid_value") from None
        out: dict[str, Any] = {"tokens": ids, "count": len(ids), "max_model_len": self.gen.context()}
        if req.with_pieces:
            out["tokens"] = [{"id": i, "piece": self.gen.piece(i)} for i in ids]
        return JSONResponse(out)

    async def _detokenize(self, request: Request) -> JSONResponse:
        """POST /detokenize: the text of token ids (`prompt`, vLLM's name, and `content`, llama-server's)."""
        self._authorise(request)
        req = self._validated(DetokenizeRequest, await self._body(request))
        if req.model is not None:
            self._check_model(req.model)
        vocab = self.gen.dec.target.cfg.vocab_size
        if any(not 0 <= t < vocab for t in req.tokens):
            raise ApiError(400, f"token ids must be in 0..{vocab - 1}.", param="tokens", code="invalid_value")
        text = self.gen.dec.decode(req.tokens)
        return JSONResponse({"prompt": text, "content": text})

    def _validated(self, kind: type[BaseModel], body: bytes) -> Any:
        try:
            return kind.model_validate_json(body)
        except ValidationError as e:
            raise validation_error(e) from None

    def _model_card(self) -> S.ModelCard:
        return S.ModelCard(id=self.model_name, created=self.created)

    def _build_app(self) -> FastAPI:
        from moaspec import __version__

        app = FastAPI(title="moaspec OpenAI-compatible API", version=__version__, docs_url=None, redoc_url=None,
                      openapi_url=None if self.token is not None else "/openapi.json")
        app.state.api = self
        app.state.scheduler = self.gen.scheduler  # a replica's health check reads it
        S.install_openapi(app, {"/v1/chat/completions": ChatRequest, "/v1/completions": CompletionRequest,
                                "/v1/responses": R.ResponsesRequest, "/tokenize": TokenizeRequest,
                                "/detokenize": DetokenizeRequest},
                          self.model_name, self.limits.max_tokens,
                          {"drafter": self.gen.drafters, "weights": self.gen.weight_modes})

        app.add_middleware(SameSiteOnly, api=self)

        @app.get("/metrics", include_in_schema=False)
        async def metrics(request: Request) -> Response:
            self._authorise(request)
            if self.gen.registry is None:
                raise ApiError(404, "this API's target is remote: its server has the metrics", code="not_found")
            body, kind = exposition(self.gen.registry)
            return Response(body, media_type=kind)

        @app.exception_handler(ApiError)
        async def api_error(request: Request, e: ApiError) -> JSONResponse:
            return e.response()

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
            code = "not_found" if e.status_code == 404 else None
            return ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", code=code).response()

        if self.token is not None:  # the API's description only to those with the key
            @app.get("/openapi.json", include_in_schema=False)
            async def openapi_doc(request: Request) -> JSONResponse:
                self._authorise(request)
                return JSONResponse(app.openapi())

        @app.get("/health", include_in_schema=False)
        async def health(request: Request) -> dict[str, Any]:
            """Up or not for anyone (a load balancer's probe); the figures only with the key."""
            try:
                self._authorise(request)
            except ApiError:
                return {"status": "ok"}
            return {"status": "ok", "model": self.model_name, "requests": self.gen.stats.requests,
                    "cancelled": self.gen.stats.cancelled}

        @app.get("/", include_in_schema=False)
        async def page() -> FileResponse:
            """The chat page (static; it talks to this API like any client)."""
            return FileResponse(STATIC / "index.html", headers=PAGE_HEADERS)

        app.mount("/static", StaticFiles(directory=STATIC), name="static")

        @app.get("/v1/moaspec", include_in_schema=False)
        async def offer(request: Request) -> dict[str, Any]:
            """What a request may choose here (moaspec's extension fields), for the chat page."""
            self._authorise(request)
            g = self.gen
            return {"model": self.model_name, "drafter": g.own_drafter(), "drafters": g.drafters, "weights": g.weights,
                    "weight_modes": g.weight_modes, "max_tokens": self.limits.max_tokens,
                    "target": "local" if g.dec.remote is None else "remote", "link": link(g.dec)}

        @app.get("/v1/models", responses=S.responses(S.ModelList))
        async def models(request: Request) -> JSONResponse:
            self._authorise(request)
            return JSONResponse(S.dump(S.ModelList(data=[self._model_card()])))

        @app.get("/v1/models/{model:path}", responses=S.responses(S.ModelCard))
        async def model(request: Request, model: str) -> JSONResponse:
            self._authorise(request)
            if model != self.model_name:
                raise ApiError(404, f"The model '{model}' does not exist.", param="model", code="model_not_found")
            return JSONResponse(S.dump(self._model_card()))

        @app.post("/v1/chat/completions", responses=S.responses(S.ChatCompletion, stream=True))
        async def chat_completions(request: Request):
            """A chat answer (messages rendered with the model's chat template)."""
            return await self._complete(request, ChatRequest)

        @app.post("/v1/completions", responses=S.responses(S.Completion, stream=True))
        async def completions(request: Request):
            """A completion of a raw prompt (text, or token ids)."""
            return await self._complete(request, CompletionRequest)

        @app.post("/v1/responses", responses=S.responses(None, stream=True))
        async def responses(request: Request):
            """OpenAI's Responses API: input items, function tools, text formats; streamed as typed events."""
            return await self._respond(request)

        @app.post("/tokenize", responses=S.responses(None))
        async def tokenize(request: Request) -> JSONResponse:
            """Token ids of a prompt, or of chat messages rendered with the model's template."""
            return await self._tokenize(request)

        @app.post("/detokenize", responses=S.responses(None))
        async def detokenize(request: Request) -> JSONResponse:
            """The text of token ids."""
            return await self._detokenize(request)

        return app


class SameSiteOnly:
    """An open API (no key) answers this machine's own clients only: requests addressed to a loopback name
    (Host: no DNS rebinding) and not sent by another site's page (Origin: no cross-site POSTs). Plain ASGI,
    not Starlette's BaseHTTPMiddleware, which would hide a client's disconnection from the handlers."""

    def __init__(self, app, api: OpenAIServer):
        self.app, self.api = app, api

    def refusal(self, scope) -> ApiError | None:
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", [])}
        try:
            host = urlsplit(f"//{headers.get('host', '')}").hostname or ""
        except ValueError:  # "[::1" and other hosts no URL parser takes
            return ApiError(400, f"the Host header {headers.get('host', '')!r} is not a host name", code="bad_host")
        if host not in self.api.hosts:
            return ApiError(403, f"this open API answers requests to {', '.join(sorted(self.api.hosts))} only, not "
                            f"to {host!r}", code="forbidden_host")
        origin = headers.get("origin")
        try:
            origin_host = urlsplit(origin).hostname or "" if origin is not None else None
        except ValueError:
            origin_host = ""
        if origin is not None and origin_host not in self.api.hosts:
            return ApiError(403, f"cross-site requests are refused (Origin {origin})", code="forbidden_origin")
        return None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self.api.token is None and (refused := self.refusal(scope)) is not None:
            await refused.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)



def create_app(dec: SpecDecoder, model_name: str, token: str | None = None, limits: ApiLimits | None = None,
               drafter: str | None = None, hosts: tuple[str, ...] = (), scheduler_thread: bool = True) -> FastAPI:
    """The API over `dec`, serving it as `model_name`; `token`: the bearer key clients must send (None:
    open); `drafter`: its name in `usage.speculative` (default: the drafter's own); `hosts`: names it is
    reached by besides loopback ones; `scheduler_thread`: False when `serve` runs the passes on its thread."""
    return OpenAIServer(dec, model_name, token, limits, drafter, hosts, scheduler_thread).app


def build_app(decoder: dict[str, Any], token: str | None, limits: ApiLimits, scheduler_thread: bool = True
              ) -> FastAPI:
    """The API `moaspec serve` runs: a `SpecDecoder(**decoder)` (its model, drafter, tree, weights or remote
    target) behind `token` and `limits`; with `scheduler_thread` (a Ray Serve replica's) its passes run on a
    thread of their own."""
    from moaspec.pipeline import SpecDecoder

    dec = SpecDecoder(**decoder)
    return create_app(dec, decoder["model"], token=token, limits=limits, drafter=dec.drafter_name,
                      scheduler_thread=scheduler_thread)


def check_host(host: str, token: str | None) -> None:
    """An API without a key may only listen on loopback."""
    if token is None and not is_loopback(host):
        raise UserError(f"--host {host} would open the API to the network without a key: give it one "
                        "(--api-token-file, --token-file or $MOASPEC_TOKEN) or listen on 127.0.0.1")


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, connections: ConnectionLimits | None = None,
          **tls: str) -> None:
    """Run the API until interrupted (the batched passes on this thread unless the scheduler has its own)."""
    check_host(host, app.state.api.token)
    warn_exposure(host, [app.state.api.token], bool(tls.get("ssl_certfile")))
    lim = app.state.api.limits
    try:
        run(app, app.state.api.gen.scheduler, connections, host=host, port=port, log_level="warning",
            timeout_graceful_shutdown=5, limit_concurrency=lim.parallel + lim.max_waiting + MAX_OTHER_CONNECTIONS,
            **tls)
    finally:
        app.state.api.close()
