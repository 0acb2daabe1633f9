"""The API's request bodies (pydantic, strict, unknown fields passing as OpenAI adds some), the bounds on them
(`ApiLimits`), and errors in OpenAI's shape (`ApiError`): everything a request is checked against before it
reaches a decoder."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from moaspec.decoding.grammar import Grammar, Vocabulary
from moaspec.decoding.logit_rules import MAX_PENALTY, MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY
from moaspec.decoding.target import MAX_TOP_LOGPROBS
from moaspec.decoding.tree import MAX_TREE_TOKENS
from moaspec.errors import ContextLengthError, UserError
from moaspec.flags import flagged
from moaspec.link.protocol import Busy
from moaspec.models.linear import WEIGHT_MODES
from moaspec.models.runtime import PREFILL_CHUNK
from moaspec.serving.tool_calls import MAX_TOOLS

log = logging.getLogger("moaspec.api")

MAX_STOP = 16  # stop strings per request
MAX_STOP_CHARS = 512
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


def busy(retry_after: int, why: str) -> ApiError:
    return ApiError(503, f"The server is busy ({why}); retry after {retry_after} s.", code="server_busy",
                    kind="server_error", retry_after=retry_after)


def validation_error(e: ValidationError) -> ApiError:
    err = e.errors()[0]
    if err["type"] == "json_invalid":
        return ApiError(400, f"We could not parse the JSON body of your request ({err['msg']}).",
                        code="invalid_json")
    param = ".".join(str(p) for p in err["loc"]) or None
    where = f"'{param}'" if param else "the request body"
    return ApiError(400, f"Invalid value for {where}: {err['msg']}.", param=param, code="invalid_value")


def generation_error(e: Exception) -> ApiError:
    """An error raised while preparing or running a generation."""
    from moaspec.link.remote import TargetUnavailable

    if isinstance(e, Busy):
        return busy(int(max(1, e.retry_after)), str(e))
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
