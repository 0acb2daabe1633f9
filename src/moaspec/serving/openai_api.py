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

import asyncio
import contextlib
import hmac
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal
from urllib.parse import urlsplit

import anyio
import torch
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from moaspec.decoding.engine import GenerationConfig, Metrics
from moaspec.decoding.grammar import Grammar, Vocabulary
from moaspec.decoding.logit_rules import MAX_PENALTY, MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY, LogitRules
from moaspec.decoding.prefix_cache import PrefixCache
from moaspec.decoding.sampling import SamplingParams
from moaspec.decoding.scheduler import Scheduler
from moaspec.decoding.target import MAX_TOP_LOGPROBS
from moaspec.decoding.tree import MAX_TREE_TOKENS
from moaspec.drafters import ready_drafters
from moaspec.errors import ContextLengthError, UserError
from moaspec.flags import flagged
from moaspec.models.linear import QUANTISED, WEIGHT_MODES
from moaspec.models.runtime import PREFILL_CHUNK
from moaspec.serving import api_schema as S
from moaspec.serving import responses_api as R
from moaspec.serving.admission import Admission
from moaspec.serving.metrics import Rate, ServerCollector, exposition, prefix_gauges, registry
from moaspec.serving.protocol import Busy
from moaspec.serving.runner import ConnectionLimits, in_worker, is_loopback, warn_exposure
from moaspec.serving.runner import serve as run
from moaspec.serving.tool_calls import MAX_TOOLS, ToolCall, ToolFormat, check_tools, tool_format

if TYPE_CHECKING:
    from moaspec.pipeline import Delta, SpecDecoder

log = logging.getLogger("moaspec.api")

API_KEY_ENV = "MOASPEC_API_KEY"  # the API key when no --api-token-file is given
EXTENSION = "moaspec"  # the field of each streamed chunk with what speculation did in its round
MAX_STOP = 16  # stop strings per request
MAX_STOP_CHARS = 512
MAX_OTHER_CONNECTIONS = 256  # beyond the generations and their queue: streams ending, the page, /metrics; then 503
MAX_LOGIT_BIAS_TOKENS = 1024
MAX_CHOICES = 256


@dataclass(frozen=True)
class ApiLimits:
    """Bounds on one request, and on how many run at once. A prompt must also leave room for max_tokens in the
    target's context."""

    max_prompt_tokens: int = flagged(8192, "--max-prompt-tokens", "longest prompt a request may send")
    max_tokens: int = flagged(1024, "--max-tokens", "largest max_tokens a request may ask for, and the default for "
                              "one that gives none")
    max_body_bytes: int = 4 << 20
    parallel: int = flagged(8, "--parallel", "generations decoding together, their target passes batched (each "
                            "answer identical to a lone run; llama-server's -np)")
    max_waiting: int = flagged(32, "--max-waiting", "requests queued for a place; beyond, 503 with Retry-After")
    kv_memory_mb: int = flagged(2048, "--kv-memory-mb", "KV-cache memory of the generations in progress (each "
                                "reserves what its prompt + max_tokens may fill)")
    cache_ram_mb: int = flagged(1024, "--cache-ram", "memory for finished generations' KV caches, kept (least "
                                "recently used out first) so that a conversation's next turn or a shared system "
                                "prompt prefills only what is new; 0: none", "MB")
    max_batch_rows: int = 512  # rows of one batched pass
    gather_ms: float = flagged(5.0, "--gather-ms", "how long a batched pass waits for the generations the last "
                               "one served")
    # none unless the operator offers them: each loads a full copy of the target, kept for the server's life
    weight_modes: tuple[str, ...] = flagged((), "--weight-modes", "weight modes a request may ask for (its "
                                            "'weights' field) besides the served one, comma-separated (e.g. "
                                            "fp16,int8): each loads a full copy of the target on first use, kept, "
                                            "if the free memory holds it", "MODES", csv=True)

    def __post_init__(self) -> None:
        for name in ("max_prompt_tokens", "max_tokens", "max_body_bytes", "parallel", "max_waiting", "kv_memory_mb",
                     "max_batch_rows"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise UserError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.cache_ram_mb, int) or self.cache_ram_mb < 0:
            raise UserError(f"cache_ram_mb must be an integer >= 0, got {self.cache_ram_mb!r}")
        if self.max_batch_rows < max(MAX_TREE_TOKENS + 1, PREFILL_CHUNK):
            raise UserError(f"max_batch_rows must hold a whole draft tree ({MAX_TREE_TOKENS + 1}) and a prompt "
                            f"chunk ({PREFILL_CHUNK}), got {self.max_batch_rows}")
        if not (isinstance(self.gather_ms, (int, float)) and not isinstance(self.gather_ms, bool)
                and self.gather_ms >= 0):
            raise UserError(f"gather_ms must be >= 0, got {self.gather_ms}")
        bad = [m for m in self.weight_modes if m not in WEIGHT_MODES]
        if bad:
            raise UserError(f"weight modes {', '.join(bad)} do not exist; choose among {', '.join(WEIGHT_MODES)}")


# bytes per weight of each mode, for the memory check before loading another copy (int4 and gguf: with scales)
BYTES_PER_WEIGHT = {"fp32": 4.0, "fp16": 2.0, "int8": 1.07, "int4": 0.57, "int4-g64": 0.57, "int4-g128": 0.54,
                    "gguf": 1.07}
MEMORY_MARGIN = 1 << 30


def available_memory() -> int | None:
    """Bytes of memory the machine can still give (MemAvailable), or None where it does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class ClientGone(Exception):
    """The client went away while its request waited for a place."""


QUEUE_CHECK_S = 0.5  # how often a queued request looks whether its client is still there


# ------------------------------------------------------------------------------------ errors
class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}
        if self.retry_after is not None:
            headers["Retry-After"] = str(self.retry_after)
        return JSONResponse(self.body(), status_code=self.status, headers=headers or None)


def _busy(retry_after: int, why: str) -> ApiError:
    return ApiError(503, f"The server is busy ({why}); retry after {retry_after} s.", code="server_busy",
                    kind="server_error", retry_after=retry_after)


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

    if isinstance(e, Busy):
        return _busy(int(max(1, e.retry_after)), str(e))
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
def refuse_unsupported(extra: dict[str, Any] | None, table: dict[str, tuple], why: dict[str, str] | None = None
                       ) -> None:
    """A 400 naming the first field of `extra` that `table` ({field: values that mean "not used"}) lists with a
    value that would ask for a feature this server lacks (`why`: more to say about a field)."""
    for name, value in (extra or {}).items():
        if name in table and value not in table[name]:
            raise ApiError(400, f"'{name}' is not supported by this server{(why or {}).get(name, '')}.", param=name,
                           code="unsupported_parameter")


class _Body(BaseModel):
    """A part of a request body: unknown fields pass (OpenAI adds some), types are strict."""

    model_config = ConfigDict(extra="allow", strict=True)


class _Request(_Body):
    """Fields both endpoints take. Other fields are ignored, unless they ask for a feature this server
    lacks (see UNSUPPORTED)."""

    # optional fields take an explicit null as OpenAI does: the default
    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # moaspec's own (an OpenAI client never sends them): this answer's drafter and weight mode, among those
    # GET /v1/moaspec offers (default: the server's)
    drafter: str | None = None
    weights: str | None = None

    # sampling beyond OpenAI's, as vLLM and llama-server take them (top_k -1 or 0: off)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    presence_penalty: float | None = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float | None = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    # token id (as a string, OpenAI's JSON) -> a bias added to its logit
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS_TOKENS)
    response_format: ResponseFormat | None = None
    # other servers' grammar fields: llama-server's GBNF `grammar` and `json_schema`, vLLM's guided_*
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1, max_length=MAX_CHOICES)
    guided_grammar: str | None = None

    # field -> its values that mean "not used": any other value is a 400
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        "functions": (None, []), "echo": (None, False), "suffix": (None, ""), "best_of": (None, 1),
    }
    GRAMMARS: ClassVar[tuple[str, ...]] = ("response_format", "grammar", "json_schema", "guided_json",
                                           "guided_regex", "guided_choice", "guided_grammar")

    def check(self) -> None:
        refuse_unsupported(self.model_extra, self.UNSUPPORTED)
        if self.n not in (None, 1):
            raise ApiError(400, f"only n=1 is supported, got n={self.n}.", param="n", code="unsupported_value")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > MAX_STOP:
            raise ApiError(400, f"at most {MAX_STOP} stop strings, got {len(stops)}.", param="stop")
        if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise ApiError(400, f"a stop string must have 1 to {MAX_STOP_CHARS} characters.", param="stop")
        asked = [name for name in self.GRAMMARS if getattr(self, name) is not None
                 and not (name == "response_format" and self.response_format.type == "text")]
        if len(asked) > 1:
            raise ApiError(400, f"one output format at a time: this request gives {' and '.join(asked)}.",
                           param=asked[1], code="invalid_value")
        for token in self.logit_bias or {}:
            if not (token.isascii() and token.isdigit()):
                raise ApiError(400, f"logit_bias keys are token ids, got {token!r}.", param="logit_bias",
                               code="invalid_value")

    def output_grammar(self, vocab: Vocabulary) -> Grammar | None:
        """The grammar the answer must follow, from whichever field gave one (checked by `check`: at most one)."""
        f = self.response_format
        if f is not None and f.type == "json_object":
            return Grammar.json_object(vocab)
        if f is not None and f.type == "json_schema":
            if f.json_schema is None:
                raise ApiError(400, "response_format json_schema needs its json_schema.", param="response_format")
            return Grammar.json_schema(vocab, f.json_schema.schema_ or {})
        if self.json_schema is not None:
            return Grammar.json_schema(vocab, self.json_schema)
        if self.guided_json is not None:
            schema = self.guided_json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError:
                    raise ApiError(400, "guided_json is not JSON.", param="guided_json") from None
            return Grammar.json_schema(vocab, schema)
        if self.guided_regex is not None:
            return Grammar.regex(vocab, self.guided_regex)
        if self.guided_choice is not None:
            return Grammar.choice(vocab, self.guided_choice)
        text = self.grammar if self.grammar is not None else self.guided_grammar
        return Grammar.gbnf(vocab, text) if text is not None else None

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)
    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # always strict here: the grammar holds the answer to the schema


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(_Body):
    include_usage: bool = False


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str = Field(max_length=64)
    arguments: str  # JSON text


class MessageToolCall(_Body):
    id: str = Field("", max_length=128)
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None only beside an assistant's tool_calls
    tool_calls: list[MessageToolCall] | None = Field(None, max_length=MAX_TOOLS)
    tool_call_id: str | None = Field(None, max_length=128)  # a tool result's call

    @property
    def text(self) -> str:
        return (self.content if isinstance(self.content, str) else
                "\n".join(p.text for p in self.content or ()))

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                               "content": None if self.content is None else self.text}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class FunctionDef(_Body):
    name: str = Field(max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None  # always strict when calls are required: the grammar holds them to it


class ToolDef(_Body):
    type: Literal["function"]
    function: FunctionDef


class ChosenFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: ChosenFunction


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    tools: list[ToolDef] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None  # each answer token's log-probability under the target
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # with that many likeliest alternatives

    def logprobs_asked(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true.", param="top_logprobs", code="invalid_value")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int]
    logprobs: int | None = Field(None, ge=0, le=5)  # legacy: the token's and that many alternatives

    def logprobs_asked(self) -> int | None:
        return self.logprobs


JsonSchemaFormat.model_rebuild()
ResponseFormat.model_rebuild()
_Request.model_rebuild()
for _model in (FunctionCall, MessageToolCall, Message, FunctionDef, ToolDef, ChosenFunction, NamedToolChoice):
    _model.model_rebuild()
ChatRequest.model_rebuild()
CompletionRequest.model_rebuild()


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None  # vLLM's name
    content: str | None = None  # llama-server's
    messages: list[Message] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    with_pieces: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 16)


# ------------------------------------------------------------------------------------ the app
@dataclass(frozen=True)
class Job:
    """One checked request: its prompt's token ids, its settings, and the weight mode and drafter it runs on."""

    ids: list[int]
    cfg: GenerationConfig
    weights: str
    drafter: str | None  # None: the server's
    pieces: bool  # streamed: each chunk cuts its text per token (`Delta.pieces`)
    tools: ToolFormat | None = None  # the answer may call tools, in this syntax


@dataclass
class Collected:
    """A finished generation: its text, tokens, their log-probabilities, why it ended, its figures."""

    text: str = ""
    tokens: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish: str = "length"
    metrics: Metrics | None = None
    live: dict[str, Any] | None = None


@dataclass
class Stats:
    requests: int = 0
    errors: int = 0
    cancelled: int = 0  # generations stopped because the client went away
    completion_tokens: int = 0


STATIC = Path(__file__).resolve().parent / "static"  # the chat page at /
# the page runs only its own scripts (vendored), and talks only to this server
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; "
                                           "frame-ancestors 'none'; form-action 'self'; base-uri 'none'; "
                                           "object-src 'none'",
                "X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY", "Cache-Control": "no-cache"}


class OpenAIServer:
    """A SpecDecoder served under a model name, with its limits and optional bearer key."""

    def __init__(self, dec: SpecDecoder, model_name: str, token: str | None = None, limits: ApiLimits | None = None,
                 drafter: str | None = None, hosts: tuple[str, ...] = (), scheduler_thread: bool = True):
        """`hosts`: names this server is reached by besides loopback ones (checked when it has no key);
        `scheduler_thread`: as `TargetServer`'s."""
        self.dec, self.model_name, self.token = dec, model_name, token or None
        self.limits = lim = limits or ApiLimits()
        self.drafter = drafter
        self.stats = Stats()
        self.created = int(time.time())
        self.hosts = {"localhost", "127.0.0.1", "::1", *hosts}
        # a local target's passes, batched over the concurrent generations (a remote one batches on its server)
        self.scheduler = Scheduler(dec.target, lim.max_batch_rows, lim.gather_ms, own_thread=scheduler_thread) \
            if dec.remote is None else None
        self.admission = Admission(lim.kv_memory_mb << 20, lim.max_waiting, max_holders=lim.parallel)
        # finished generations' caches, for the next turn of a conversation or a shared system prompt
        self.prefix = PrefixCache(lim.cache_ram_mb << 20) if dec.remote is None and lim.cache_ram_mb else None
        dec.prefix = self.prefix
        # weight mode -> the decoder over that copy of the weights (loaded when a request first asks for it;
        # their passes share the one scheduler), and its idle forks, one per generation that ran at once
        self.weights = _weights(dec)
        self.variants: dict[str, SpecDecoder] = {self.weights: dec}
        self.idle: dict[str, list[SpecDecoder]] = {self.weights: []}
        self._loading = threading.Lock()
        self.drafters, self.weight_modes = self._offer()
        self.threads = anyio.CapacityLimiter(lim.parallel + 4)
        self.tokens = Rate()
        self.registry = registry(ServerCollector(self.scheduler, self.tokens, self._gauges)) \
            if self.scheduler is not None else None
        self._longest_token: int | None = None
        self._tasks: set[asyncio.Task] = set()  # generations running (a reference keeps each alive)
        self.app = self._build_app()

    def _gauges(self) -> dict[str, tuple[str, float]]:
        a = self.admission
        return {"moaspec_generations": ("generations in progress", a.holders),
                "moaspec_generations_waiting": ("requests waiting for a place", a.waiting),
                "moaspec_kv_reserved_bytes": ("KV-cache memory reserved by generations", a.used),
                "moaspec_kv_budget_bytes": ("KV-cache memory for generations", a.budget),
                "moaspec_sessions": ("decoders held (one per generation that ran at once)",
                                     sum(map(len, self.idle.values())) + a.holders),
                **prefix_gauges(self.prefix)}

    def _offer(self) -> tuple[list[str], list[str]]:
        """The drafters and weight modes a request may ask for (`drafter`, `weights`): the drafters ready for
        this target and the server's own; the served weight mode and those the operator offers (a remote
        target's mode only; int8/int4 only with the compiled kernels)."""
        own = self._own_drafter()
        drafters = ready_drafters(self.model_name)
        kernels = self.dec.remote is None and self.dec.target.kernels is not None
        extra = [] if self.dec.remote is not None else \
            [m for m in self.limits.weight_modes if m not in QUANTISED or kernels]
        return drafters + [own] * (own not in drafters), [self.weights, *(m for m in extra if m != self.weights)]

    def close(self) -> None:
        for forks in self.idle.values():
            for fork in forks:
                fork.close()
            forks.clear()
        if self.prefix is not None:
            self.prefix.clear()
        if self.scheduler is not None:
            self.scheduler.close()

    def _reservation(self, prompt_tokens: int, max_new: int) -> int:
        """KV bytes a generation may fill: its prompt, its tokens and one tree (a remote target's: none here)."""
        if self.dec.remote is not None:
            return 0
        slots = min(self._context(), prompt_tokens + max_new + self.dec.engine.tree.total_tokens + 1)
        return self.dec.target.new_cache(1).bytes_for(slots)

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
        body = await self._body(request)
        try:
            req = kind.model_validate_json(body)
        except ValidationError as e:
            raise _validation_error(e) from None
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

    def _context(self) -> int:
        return self.dec.engine.target.max_seq_len

    def _prepare(self, req: _Request) -> Job:
        """Token ids of the prompt and the generation settings, checked against the limits (runs in the
        worker thread, under the lock: the tokenizer is not shared across threads)."""
        param = "messages" if isinstance(req, ChatRequest) else "prompt"
        self._check_text_length(req, param)
        tools = None
        if isinstance(req, ChatRequest):
            ids, tools, tool_grammar = self._chat_prompt(req)
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
        for name in ("max_tokens", "max_completion_tokens"):  # both bounded, also the one that does not apply
            value = getattr(req, name)
            if value is not None and value > self.limits.max_tokens:
                raise ApiError(400, f"{name} is {value}; this server allows at most {self.limits.max_tokens}.",
                               param=name, code="invalid_value")
        asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        which = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        if asked is not None and len(ids) + asked > context:
            raise ApiError(400, f"the prompt ({len(ids)} tokens) + {which} ({asked}) exceeds the context of "
                           f"{context} tokens; lower {which} to {context - len(ids)} or shorten the prompt.",
                           param=which, code="context_length_exceeded")
        n = asked if asked is not None else min(self.limits.max_tokens, context - len(ids))
        seed = None if req.seed is None else req.seed % 2**63
        try:
            sampling = SamplingParams(temperature=1.0 if req.temperature is None else req.temperature,
                                      top_p=1.0 if req.top_p is None else req.top_p, seed=seed,
                                      top_k=max(0, req.top_k or 0), min_p=req.min_p or 0.0)
            rules = self._rules(req, tool_grammar if tools is not None else None)
        except UserError as e:
            raise ApiError(400, str(e), code="invalid_value") from None
        if req.drafter is not None and req.drafter not in self.drafters:
            raise ApiError(400, f"drafter {req.drafter!r} is not offered here; choose one of "
                           f"{', '.join(self.drafters)}.", param="drafter", code="invalid_value")
        if req.weights is not None and req.weights not in self.weight_modes:
            raise ApiError(400, f"weight mode {req.weights!r} is not offered here; choose one of "
                           f"{', '.join(self.weight_modes)}.", param="weights", code="invalid_value")
        logprobs = req.logprobs_asked()
        if logprobs is not None and self.dec.remote is not None:
            raise ApiError(400, "logprobs need the target's logits, which stay on its server.", param="logprobs",
                           code="unsupported_parameter")
        return Job(ids, GenerationConfig(max_new_tokens=n, sampling=sampling, stop=req.stops, logprobs=logprobs,
                                         rules=rules),
                   req.weights or self.weights, req.drafter, bool(req.stream), tools)

    def _vocab(self) -> Vocabulary:
        cfg = self.dec.target.cfg
        return Vocabulary.of(self.dec.tokenizer, cfg.vocab_size, cfg.eos_token_ids)

    def _chat_prompt(self, req: ChatRequest) -> tuple[list[int], ToolFormat | None, Grammar | None]:
        """The conversation's token ids, rendered with its tools in the model's own tool syntax; that syntax when
        the answer may call them, and the grammar that holds it to calls when they are required."""
        messages = [m.as_dict() for m in req.messages]
        for i, m in enumerate(messages):
            if m.get("tool_calls") and m["role"] != "assistant":
                raise ApiError(400, "only an assistant's message calls tools.", param=f"messages.{i}.tool_calls",
                               code="invalid_value")
            if m["content"] is None and not m.get("tool_calls"):
                raise ApiError(400, "a message without content must be an assistant's tool calls.",
                               param=f"messages.{i}.content", code="invalid_value")
        tools = [t.model_dump(exclude_none=True) for t in req.tools or ()]
        fmt = tool_format(self.dec.tokenizer.chat_template, tuple(t["function"]["name"] for t in tools))
        choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedToolChoice) else req.tool_choice
        if choice is not None and choice != "none" and not tools:
            raise ApiError(400, "tool_choice needs tools.", param="tool_choice", code="invalid_value")
        calling = bool(tools) and choice != "none"
        grammar = None
        try:
            if calling:
                required, callable_ = check_tools(tools, choice)
                grammar = fmt.grammar(self._vocab(), callable_, required, req.parallel_tool_calls is not False)
            shown = tools if calling else None
            if calling or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
                messages = fmt.messages(messages, shown)
            ids = self.dec.encode(messages, tools=shown if fmt.native else None)
        except UserError as e:
            raise ApiError(400, str(e), param="tools", code="invalid_value") from None
        return ids, fmt if calling else None, grammar

    def _rules(self, req: _Request, tool_grammar: Grammar | None = None) -> LogitRules | None:
        """What the request does to the target's logits: its bias, penalties and output grammar (one from its
        format fields, or the one that holds it to tool calls)."""
        cfg = self.dec.target.cfg
        grammar = req.output_grammar(self._vocab()) \
            if any(getattr(req, name) is not None for name in req.GRAMMARS) else None
        if grammar is not None and tool_grammar is not None:
            raise ApiError(400, "an output format and tool calls at once: give one.", param="response_format",
                           code="invalid_value")
        grammar = grammar or tool_grammar
        rules = LogitRules(logit_bias=tuple((int(k), v) for k, v in (req.logit_bias or {}).items()),
                           presence_penalty=req.presence_penalty or 0.0,
                           frequency_penalty=req.frequency_penalty or 0.0,
                           repetition_penalty=req.repetition_penalty or 1.0, grammar=grammar)
        if not rules.active:
            return None
        if self.dec.remote is not None:
            raise ApiError(400, "logit_bias, penalties and output formats act on the target's logits, which stay on "
                           "its server: ask its own API.", code="unsupported_parameter")
        rules.check_vocab(cfg.vocab_size)
        return rules

    def _check_text_length(self, req: _Request, param: str) -> None:
        """Refuse, before tokenising it, text that cannot fit: more characters than the longest token has,
        times the prompt bound (so a 4 MiB body costs no tokenizer time)."""
        bound = min(self.limits.max_prompt_tokens, self._context() - 1)
        if isinstance(req, ChatRequest):
            if len(req.messages) > bound:  # each message adds at least a token of its template's markers
                raise ApiError(400, f"the conversation has {len(req.messages)} messages, more than the {bound} tokens "
                               "this server takes can hold.", param=param, code="context_length_exceeded")
            chars = sum(len(m.text) + sum(len(c.function.arguments) for c in m.tool_calls or ())
                        for m in req.messages)
            chars += sum(len(json.dumps(t.function.parameters or {})) for t in req.tools or ())
        else:
            prompt = req.prompt
            chars = len(prompt) if isinstance(prompt, str) else sum(len(p) for p in prompt if isinstance(p, str))
        bound = min(self.limits.max_prompt_tokens, self._context() - 1)
        if chars > bound * self._longest():
            raise ApiError(400, f"the prompt has {chars} characters, more than {bound} tokens can hold; this server "
                           f"takes at most {bound} tokens.", param=param, code="context_length_exceeded")

    async def _prepared(self, req: _Request) -> Job:
        try:
            return await in_worker(self._prepare, req, limiter=self.threads)
        except ApiError:
            raise
        except Exception as e:
            raise _generation_error(e) from None

    # ------------------------------------------------------------ generation
    async def _rounds(self, request: Request, job: Job) -> AsyncIterator[tuple[Delta, dict[str, Any], Metrics | None]]:
        """(delta, live figures, metrics on the last round) per verification round. The generation runs in a
        task of its own (`_generate`), so that writing to a slow client never holds it and it always ends
        and gives its place back, whether this iterator is finished, closed or dropped."""
        queue: asyncio.Queue = asyncio.Queue()
        stop = asyncio.Event()
        task = asyncio.create_task(self._generate(request, job, queue, stop))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        try:
            while (item := await queue.get()) is not None:
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            stop.set()

    def _fork(self, job: Job) -> SpecDecoder:
        """An idle decoder for `job`'s weight mode (loading that mode's weights the first time), with its
        drafter."""
        with self._loading:
            if job.weights not in self.variants:
                self._check_memory(job.weights)
                log.info("loading %s in %s for a request", self.model_name, job.weights)
                self.variants[job.weights] = self.dec.with_weights(job.weights)
                self.idle[job.weights] = []
        try:
            fork = self.idle[job.weights].pop()
        except IndexError:
            fork = self.variants[job.weights].fork(self.scheduler)
        own = self.dec._drafter_args  # the server's drafter, with its parts (a hybrid's, a draft model, a path)
        args = own if job.drafter in (None, self._own_drafter()) else \
            {"drafter": job.drafter, "tree": own["tree"], "datastore": own["datastore"]}
        if fork._drafter_args != args:
            fork.set_drafter(**args)
        return fork

    def _check_memory(self, weights: str) -> None:
        """Refuse to load another copy of the weights that the machine's free memory cannot hold (with the
        generations' KV budget and a margin still free after it)."""
        need = self.dec.target.num_parameters() * BYTES_PER_WEIGHT.get(weights, 4.0)
        free = available_memory()
        keep = self.admission.budget + MEMORY_MARGIN
        if free is not None and need + keep > free:
            raise Busy(f"not enough free memory to load the {weights} weights (~{need / 2**30:.1f} GiB, with "
                       f"{keep / 2**30:.1f} GiB kept for generations; {free / 2**30:.1f} GiB free): ask for "
                       f"{self.weights}", retry_after=60)

    def _live(self, fork: SpecDecoder, job: Job, d: Delta) -> dict[str, Any]:
        """What the chat page shows while an answer streams: the figures so far, the link to the target."""
        m = fork.engine.metrics
        accepted = sum(m.accept_lengths) - m.target_calls
        return {"drafter": job.drafter or self._own_drafter(), "weights": _weights(fork),
                "tokens": m.new_tokens, "target_calls": m.target_calls, "tau": round(m.tau, 3),
                "acceptance": round(accepted / m.drafted_tokens, 3) if m.drafted_tokens else None,
                "tokens_per_s": round(m.tokens_per_s, 2), "link": _link(fork, away=bool(d.pending))}

    def _own_drafter(self) -> str:
        return self.drafter or (self.dec.drafter.name if self.dec.drafter is not None else "none")

    async def _generate(self, request: Request, job: Job, queue: asyncio.Queue, stop: asyncio.Event) -> None:
        """Run one generation on a decoder of its own, once the request has a place (waiting for one, FIFO),
        into `queue`; between rounds, stop if the client went away (or `stop` is set), and give the place,
        the decoder and its rows back at once."""
        done = object()

        def step(it):
            with torch.no_grad():
                return next(it, done)

        finished = False

        async def gone(_position: int) -> None:  # a client that leaves the queue gives its place up at once
            if stop.is_set() or await request.is_disconnected():
                raise ClientGone

        try:
            need = self._reservation(len(job.ids), job.cfg.max_new_tokens)
            granted = await self.admission.acquire(need, on_wait=gone, every_s=QUEUE_CHECK_S)
        except ClientGone:
            self.stats.cancelled += 1
            log.info("client went away while queued")
            queue.put_nowait(None)
            return
        except Exception as e:
            queue.put_nowait(e)
            return
        fork = None
        try:
            fork = await in_worker(self._fork, job, limiter=self.threads)
            it = fork.stream(job.ids, job.cfg, pieces=job.pieces)
            try:
                while not stop.is_set() and not await request.is_disconnected():
                    d = await in_worker(step, it, limiter=self.threads)
                    if d is done:
                        finished = True
                        break
                    self.stats.completion_tokens += len(d.tokens)
                    self.tokens.add(len(d.tokens))
                    finished = d.finish is not None
                    queue.put_nowait((d, self._live(fork, job, d), fork.engine.metrics if finished else None))
                    if finished:
                        break
            finally:
                it.close()  # the engine tells its target: the scheduler stops waiting for it
        except Exception as e:  # a failure, not a cancellation: the consumer reports it
            finished = True
            queue.put_nowait(e)
        finally:
            if fork is not None:
                fork.release()
                self.idle[job.weights].append(fork)
            self.admission.release(need, granted)
            queue.put_nowait(None)
            if not finished:
                self.stats.cancelled += 1
                log.info("client went away: generation stopped")

    def _usage(self, prompt_tokens: int, completion_tokens: int, m: Metrics | None,
               live: dict[str, Any] | None) -> S.Usage:
        usage = S.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                        total_tokens=prompt_tokens + completion_tokens,
                        prompt_tokens_details=S.PromptTokensDetails(cached_tokens=m.cached_tokens if m else 0))
        if m is not None and live is not None:
            usage.speculative = S.Speculative(
                drafter=live["drafter"], weights=live["weights"], tau=round(m.tau, 4), target_calls=m.target_calls,
                tokens_per_s=round(m.tokens_per_s, 3), prefill_s=round(m.prefill_s, 4), total_s=round(m.total_s, 4))
            usage.unverified_tokens = m.unverified_in_output or None
        return usage

    async def _complete(self, request: Request, kind: type[_Request]):
        self.stats.requests += 1
        try:
            self._authorise(request)
            req = await self._parse(request, kind)
            job = await self._prepared(req)
        except ApiError as e:
            self.stats.errors += 1
            return e.response()
        if self.admission.full():  # no place now and no room to wait for one
            self.stats.errors += 1
            return _busy(self.admission.retry_after(), f"{self.admission.waiting} requests are waiting").response()
        chat = isinstance(req, ChatRequest)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        if req.stream:
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return StreamingResponse(self._events(request, req, job, rid, created), media_type="text/event-stream",
                                     headers=headers)
        try:
            done = await self._collect(request, job)
        except ApiError as e:
            return e.response()
        text, tokens, logprobs, finish = done.text, done.tokens, done.logprobs, done.finish
        unverified = True if done.metrics is not None and done.metrics.unverified_in_output else None
        usage = self._usage(len(job.ids), len(tokens), done.metrics, done.live)
        asked = job.cfg.logprobs is not None
        if chat:
            lp = S.ChoiceLogprobs(content=self._chat_logprobs(tokens, logprobs)) if asked else None
            content, calls = job.tools.parse(text) if job.tools is not None else (text, [])
            message = S.AssistantMessage(content=content, tool_calls=[S.ToolCall(
                id=c.id, function=S.FunctionCall(name=c.name, arguments=c.arguments)) for c in calls] or None)
            body: BaseModel = S.ChatCompletion(id=rid, created=created, model=self.model_name, usage=usage, choices=[
                S.ChatChoice(message=message, logprobs=lp, finish_reason="tool_calls" if calls else finish,
                             unverified=unverified)])
        else:
            lp = self._completion_logprobs(tokens, logprobs, 0) if asked else None
            body = S.Completion(id=rid, created=created, model=self.model_name, usage=usage, choices=[
                S.CompletionChoice(text=text, logprobs=lp, finish_reason=finish, unverified=unverified)])
        return JSONResponse(S.dump(body))

    async def _collect(self, request: Request, job: Job) -> Collected:
        """A whole generation (the answer when not streamed)."""
        out = Collected()
        try:
            async with contextlib.aclosing(self._rounds(request, job)) as rounds:
                async for d, now, m in rounds:
                    out.live = now
                    out.text += d.text
                    out.tokens += d.tokens
                    out.logprobs += d.logprobs or []
                    out.finish, out.metrics = d.finish or out.finish, m or out.metrics
        except Exception as e:
            self.stats.errors += 1
            raise _generation_error(e) from None
        return out

    async def _events(self, request: Request, req: _Request, job: Job, rid: str, created: int) -> AsyncIterator[str]:
        """The answer as server-sent events, one chunk per verification round, each carrying moaspec's
        extension field (`EXTENSION`, see docs/serving.md) beside OpenAI's fields."""
        chat = isinstance(req, ChatRequest)
        usage_field = {"usage": None} if req.include_usage else {}

        def event(payload: dict[str, Any]) -> str:
            return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

        offset = 0  # characters of the answer so far (the legacy logprobs' text_offset)

        def chunk(text: str | None, finish: str | None, role: bool = False, unverified: bool = False,
                  ext: dict[str, Any] | None = None, d: Delta | None = None,
                  call: tuple[int, ToolCall] | None = None) -> str:
            lp = None
            if d is not None and d.logprobs is not None:
                lp = S.ChoiceLogprobs(content=self._chat_logprobs(d.tokens, d.logprobs)).model_dump() if chat \
                    else self._completion_logprobs(d.tokens, d.logprobs, offset).model_dump()
            if chat:
                delta: dict[str, Any] = {"role": "assistant"} if role else {}
                if text is not None:
                    delta["content"] = text
                if call is not None:
                    delta["tool_calls"] = [{"index": call[0], **call[1].as_openai()}]
                choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": lp, "finish_reason": finish}
            if unverified:
                choice["unverified"] = True
            return event({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                          "created": created, "model": self.model_name, "choices": [choice], **usage_field,
                          **({EXTENSION: ext} if ext is not None else {})})

        if chat:
            yield chunk("", None, role=True)
        completion, metrics, finished, live = 0, None, False, None
        # with tools: the answer so far and how much of it was sent as text (a call's text never is)
        tools, answer, shown = job.tools, "", 0
        try:
            async with contextlib.aclosing(self._rounds(request, job)) as rounds:
                async for d, live, m in rounds:
                    completion += len(d.tokens)
                    text, pieces = d.text, [list(p) for p in d.pieces]
                    if tools is not None:
                        answer += d.text
                        upto = max(shown, tools.held(answer))
                        text, shown, pieces = answer[shown:upto], upto, []
                    if text or d.pending or d.retract or (d.tokens and d.logprobs is not None):
                        ext = {"round": d.round, "pieces": pieces, **live}
                        if d.pending or d.retract:
                            ext.update(pending=d.pending, retract=d.retract)
                        yield chunk(text, None, ext=ext, d=d)
                        offset += len(text)
                    if d.finish is not None:
                        finish = d.finish
                        if tools is not None:
                            content, calls = tools.parse(answer)
                            for i, call in enumerate(calls):
                                yield chunk(None, None, call=(i, call))
                            if not calls and (content or "")[shown:]:
                                yield chunk(content[shown:], None)
                            finish = "tool_calls" if calls else finish
                        yield chunk(None, finish, unverified=bool(m and m.unverified_in_output),
                                    ext={"round": d.round, "pieces": [], **live})
                        metrics, finished = m, True
        except Exception as e:  # not CancelledError: a client that went away simply ends the stream
            self.stats.errors += 1
            yield event(_generation_error(e).body())
        if finished and req.include_usage:
            yield event({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                         "created": created, "model": self.model_name, "choices": [],
                         "usage": self._usage(len(job.ids), completion, metrics, live).model_dump(exclude_none=True)})
        yield "data: [DONE]\n\n"

    # ------------------------------------------------------------ the Responses API
    async def _respond(self, request: Request):
        """POST /v1/responses: the request runs as a chat request (`responses_api.chat_body`)."""
        self.stats.requests += 1
        try:
            self._authorise(request)
            body = await self._body(request)
            try:
                rreq = R.ResponsesRequest.model_validate_json(body)
            except ValidationError as e:
                raise _validation_error(e) from None
            self._check_model(rreq.model)
            stored = " (this server stores no responses: send the conversation's items)"
            refuse_unsupported(rreq.model_extra, rreq.UNSUPPORTED,
                               {"previous_response_id": stored, "conversation": stored})
            try:
                req = ChatRequest.model_validate(R.chat_body(rreq))
            except R.ItemError as e:
                raise ApiError(400, str(e), param=e.param, code="invalid_value") from None
            except ValidationError as e:
                raise _validation_error(e) from None
            req.check()
            job = await self._prepared(req)
        except ApiError as e:
            self.stats.errors += 1
            return e.response()
        if self.admission.full():
            self.stats.errors += 1
            return _busy(self.admission.retry_after(), f"{self.admission.waiting} requests are waiting").response()
        rid, created = R.new_id("resp"), time.time()
        if rreq.stream:
            return StreamingResponse(self._response_events(request, rreq, job, rid, created),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            done = await self._collect(request, job)
        except ApiError as e:
            return e.response()
        content, calls = job.tools.parse(done.text) if job.tools is not None else (done.text, [])
        output = ([R.message_item(content, R.new_id("msg"))] if content else []) + \
            [R.call_item(c, R.new_id("fc")) for c in calls]
        incomplete = "max_output_tokens" if done.finish == "length" else None
        return JSONResponse(R.response_object(
            rid, created, self.model_name, rreq, output, "incomplete" if incomplete else "completed",
            self._response_usage(job, len(done.tokens), done.metrics), incomplete))

    def _response_usage(self, job: Job, completion: int, m: Metrics | None) -> dict[str, Any]:
        return R.usage_object(len(job.ids), completion, m.cached_tokens if m else 0)

    async def _response_events(self, request: Request, rreq: R.ResponsesRequest, job: Job, rid: str,
                               created: float) -> AsyncIterator[str]:
        """The Responses stream: typed events (response.created, output items and their text deltas, function
        calls, response.completed), each with its sequence number."""
        seq = 0

        def event(kind: str, **fields: Any) -> str:
            nonlocal seq
            seq += 1
            return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq - 1, **fields})}\n\n"

        def response(status: str, output: list, usage=None, incomplete=None) -> dict[str, Any]:
            return R.response_object(rid, created, self.model_name, rreq, output, status, usage, incomplete)

        yield event("response.created", response=response("in_progress", []))
        yield event("response.in_progress", response=response("in_progress", []))
        tools, answer, shown, msg_id, output = job.tools, "", 0, R.new_id("msg"), []
        opened = False

        def open_message() -> list[str]:
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            return [event("response.output_item.added", output_index=0, item=R.message_item("", msg_id, "in_progress")
                          | {"content": []}),
                    event("response.content_part.added", item_id=msg_id, output_index=0, content_index=0, part=part)]

        completion, metrics, finish = 0, None, "length"
        try:
            async with contextlib.aclosing(self._rounds(request, job)) as rounds:
                async for d, _, m in rounds:
                    completion += len(d.tokens)
                    answer += d.text
                    upto = max(shown, tools.held(answer)) if tools is not None else len(answer)
                    if upto > shown:
                        if not opened:
                            opened = True
                            for e in open_message():
                                yield e
                        yield event("response.output_text.delta", item_id=msg_id, output_index=0, content_index=0,
                                    delta=answer[shown:upto], logprobs=[])
                        shown = upto
                    if d.finish is not None:
                        finish, metrics = d.finish, m
        except Exception as e:
            self.stats.errors += 1
            err = _generation_error(e)
            yield event("error", code=err.code, message=err.message, param=err.param)
            yield event("response.failed", response=response("failed", output) | {"error": {
                "code": err.code or "server_error", "message": err.message}})
            return
        content, calls = tools.parse(answer) if tools is not None else (answer, [])
        if not calls and content and len(content) > shown and not opened:
            opened = True
            for e in open_message():
                yield e
        if opened:
            text = content or answer[:shown]
            if not calls and len(text) > shown:
                yield event("response.output_text.delta", item_id=msg_id, output_index=0, content_index=0,
                            delta=text[shown:], logprobs=[])
            text = text if not calls else answer[:shown]
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            yield event("response.output_text.done", item_id=msg_id, output_index=0, content_index=0, text=text,
                        logprobs=[])
            yield event("response.content_part.done", item_id=msg_id, output_index=0, content_index=0, part=part)
            item = R.message_item(text, msg_id)
            yield event("response.output_item.done", output_index=0, item=item)
            output.append(item)
        for call in calls:
            index, item_id = len(output), R.new_id("fc")
            yield event("response.output_item.added", output_index=index,
                        item=R.call_item(call, item_id, "in_progress") | {"arguments": ""})
            yield event("response.function_call_arguments.delta", item_id=item_id, output_index=index,
                        delta=call.arguments)
            yield event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                        arguments=call.arguments)
            item = R.call_item(call, item_id)
            yield event("response.output_item.done", output_index=index, item=item)
            output.append(item)
        incomplete = "max_output_tokens" if finish == "length" else None
        usage = self._response_usage(job, completion, metrics)
        yield event("response.incomplete" if incomplete else "response.completed",
                    response=response("incomplete" if incomplete else "completed", output, usage, incomplete))

    # ------------------------------------------------------------ tokenizer
    async def _tokenize(self, request: Request) -> JSONResponse:
        """POST /tokenize (vLLM's and llama-server's): a prompt's or a conversation's token ids."""
        self._authorise(request)
        req = self._validated(TokenizeRequest, await self._body(request))
        if req.model is not None:
            self._check_model(req.model)
        text = req.prompt if req.prompt is not None else req.content
        if (text is None) == (req.messages is None):
            raise ApiError(400, "give one of prompt (or content) and messages.", param="prompt")
        bound = min(self.limits.max_prompt_tokens, self._context() - 1)
        if text is not None and len(text) > bound * self._longest():
            raise ApiError(400, f"the prompt is longer than {bound} tokens can hold.", param="prompt",
                           code="context_length_exceeded")

        def encode() -> list[int]:
            if req.messages is not None:
                return self._chat_prompt(ChatRequest(model=self.model_name, messages=req.messages))[0]
            with self.dec.tokenizer_lock:
                return self.dec.tokenizer.encode(text, add_special_tokens=req.add_special_tokens)

        try:
            ids = await in_worker(encode, limiter=self.threads)
        except UserError as e:
            raise ApiError(400, str(e), code="invalid_value") from None
        out: dict[str, Any] = {"tokens": ids, "count": len(ids), "max_model_len": self._context()}
        if req.with_pieces:
            out["tokens"] = [{"id": i, "piece": self._piece(i)} for i in ids]
        return JSONResponse(out)

    async def _detokenize(self, request: Request) -> JSONResponse:
        """POST /detokenize: the text of token ids (`prompt`, vLLM's name, and `content`, llama-server's)."""
        self._authorise(request)
        req = self._validated(DetokenizeRequest, await self._body(request))
        if req.model is not None:
            self._check_model(req.model)
        vocab = self.dec.target.cfg.vocab_size
        if any(not 0 <= t < vocab for t in req.tokens):
            raise ApiError(400, f"token ids must be in 0..{vocab - 1}.", param="tokens", code="invalid_value")
        text = self.dec.decode(req.tokens)
        return JSONResponse({"prompt": text, "content": text})

    def _validated(self, kind: type[BaseModel], body: bytes) -> Any:
        try:
            return kind.model_validate_json(body)
        except ValidationError as e:
            raise _validation_error(e) from None

    def _longest(self) -> int:
        if self._longest_token is None:
            self._longest_token = max(len(t) for t in self.dec.tokenizer.get_vocab())
        return self._longest_token

    def _piece(self, token: int) -> str:
        return self.dec.decode([token])

    def _chat_logprobs(self, tokens: list[int], logprobs: list) -> list[S.TokenLogprobEntry]:
        """OpenAI's chat `logprobs.content`: per token its text, bytes, log-probability and alternatives."""
        out = []
        for tok, lp in zip(tokens, logprobs, strict=False):
            if lp is None:  # written while a remote target was away: never scored
                continue
            piece = self._piece(tok)
            out.append(S.TokenLogprobEntry(
                token=piece, logprob=lp[0], bytes=list(piece.encode()),
                top_logprobs=[S.TopLogprob(token=(p := self._piece(i)), logprob=v, bytes=list(p.encode()))
                              for i, v in lp[1]]))
        return out

    def _completion_logprobs(self, tokens: list[int], logprobs: list, offset: int) -> S.CompletionLogprobs:
        """The legacy completions `logprobs` (tokens, token_logprobs, top_logprobs, text_offset)."""
        pieces, values, tops, offsets = [], [], [], []
        for tok, lp in zip(tokens, logprobs, strict=False):
            if lp is None:
                continue
            piece = self._piece(tok)
            pieces.append(piece)
            values.append(lp[0])
            tops.append({self._piece(i): v for i, v in lp[1]})
            offsets.append(offset)
            offset += len(piece)
        return S.CompletionLogprobs(tokens=pieces, token_logprobs=values, top_logprobs=tops, text_offset=offsets)

    # ------------------------------------------------------------ routes
    def _model_card(self) -> S.ModelCard:
        return S.ModelCard(id=self.model_name, created=self.created)

    def _build_app(self) -> FastAPI:
        from moaspec import __version__

        app = FastAPI(title="moaspec OpenAI-compatible API", version=__version__, docs_url=None, redoc_url=None,
                      openapi_url=None if self.token is not None else "/openapi.json")
        app.state.api = self
        app.state.scheduler = self.scheduler  # a replica's health check reads it
        S.install_openapi(app, {"/v1/chat/completions": ChatRequest, "/v1/completions": CompletionRequest,
                                "/v1/responses": R.ResponsesRequest, "/tokenize": TokenizeRequest,
                                "/detokenize": DetokenizeRequest},
                          self.model_name, self.limits.max_tokens,
                          {"drafter": self.drafters, "weights": self.weight_modes})

        app.add_middleware(SameSiteOnly, api=self)

        @app.get("/metrics", include_in_schema=False)
        async def metrics(request: Request) -> Response:
            self._authorise(request)
            if self.registry is None:
                raise ApiError(404, "this API's target is remote: its server has the metrics", code="not_found")
            body, kind = exposition(self.registry)
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
            return {"status": "ok", "model": self.model_name, "requests": self.stats.requests,
                    "cancelled": self.stats.cancelled}

        @app.get("/", include_in_schema=False)
        async def page() -> FileResponse:
            """The chat page (static; it talks to this API like any client)."""
            return FileResponse(STATIC / "index.html", headers=PAGE_HEADERS)

        app.mount("/static", StaticFiles(directory=STATIC), name="static")

        @app.get("/v1/moaspec", include_in_schema=False)
        async def offer(request: Request) -> dict[str, Any]:
            """What a request may choose here (moaspec's extension fields), for the chat page."""
            self._authorise(request)
            return {"model": self.model_name, "drafter": self._own_drafter(), "drafters": self.drafters,
                    "weights": self.weights, "weight_modes": self.weight_modes, "max_tokens": self.limits.max_tokens,
                    "target": "local" if self.dec.remote is None else "remote", "link": _link(self.dec)}

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


def _weights(dec: SpecDecoder) -> str:
    """The weight mode the target of `dec` runs in (a remote one: its server's)."""
    return dec.remote.info.get("weights", "?") if dec.remote is not None else dec.target.weights


def _link(dec: SpecDecoder, away: bool = False) -> str:
    """The state of `dec`'s link to its target: local, connected, or away (also when `away`: its drafter is
    writing alone)."""
    if dec.remote is None:
        return "local"
    return "connected" if dec.remote.ws is not None and not away else "away"


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
        run(app, app.state.api.scheduler, connections, host=host, port=port, log_level="warning",
            timeout_graceful_shutdown=5, limit_concurrency=lim.parallel + lim.max_waiting + MAX_OTHER_CONNECTIONS,
            **tls)
    finally:
        app.state.api.close()
