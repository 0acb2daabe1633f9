"""OpenAI's Responses API (`POST /v1/responses`) over the chat pipeline: a request becomes a chat request (input
items -> messages, function tools -> tools, text.format -> response_format), runs like one, and its answer is
written back as response output items (a message, function calls) or as the Responses stream's typed events.

The server keeps no responses: `store` is accepted and nothing is stored, so `previous_response_id` (which needs
a stored response) is refused; a client sends the conversation's items again, as with chat completions.
"""

from __future__ import annotations

import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from moaspec.serving.tool_calls import MAX_TOOLS, ToolCall

MAX_ITEMS = 4096


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=64)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    """The fields this server takes; OpenAI's others that only describe storage or reasoning are accepted when
    unset (`UNSUPPORTED` lists those that would change the answer)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    input: str | list[dict[str, Any]] = Field(max_length=MAX_ITEMS)
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    stream: bool | None = None
    store: bool | None = None  # nothing is stored either way
    metadata: dict[str, str] | None = Field(None, max_length=16)  # echoed
    user: str | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # moaspec's: reproducible sampling

    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        "previous_response_id": (None,), "conversation": (None,), "background": (None, False),
        "prompt": (None,), "top_logprobs": (None, 0), "reasoning": (None, {}), "max_tool_calls": (None,),
    }


class ItemError(ValueError):
    """An input item this server cannot take (its message says which and why)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ItemError("content must be text or a list of text parts", where)
    out = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ItemError(f"content part of type {kind!r} is not supported here (text only)", f"{where}.{i}")
        out.append(part["text"])
    return "\n".join(out)


def chat_body(req: ResponsesRequest) -> dict[str, Any]:
    """The chat completions request that answers `req`."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    for i, item in enumerate(items):
        where = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ItemError(f"a message's role must be user, system, developer or assistant, got {role!r}", where)
            messages.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {"id": str(item.get("call_id", "")), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                             "content": output if isinstance(output, str) else _text(output, f"{where}.output")})
        else:
            raise ItemError(f"input items of type {kind!r} are not supported here", where)
    body: dict[str, Any] = {"model": req.model, "messages": messages, "stream": bool(req.stream)}
    for src, dst in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                     ("parallel_tool_calls", "parallel_tool_calls"), ("seed", "seed")):
        if getattr(req, src) is not None:
            body[dst] = getattr(req, src)
    if req.tools:
        tools = []
        for i, t in enumerate(req.tools):
            if t.get("type") != "function":
                raise ItemError(f"tools of type {t.get('type')!r} are not supported here (functions only)",
                                f"tools.{i}")
            tools.append({"type": "function", "function": {k: v for k, v in t.items() if k != "type"}})
        body["tools"] = tools
    choice = req.tool_choice
    if isinstance(choice, dict):
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        body["tool_choice"] = choice
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name or "answer", "schema": fmt.schema_ or {}, "strict": fmt.strict}}
    elif fmt is not None:
        body["response_format"] = {"type": fmt.type}
    return body


def new_id(kind: str) -> str:
    return f"{kind}_{uuid.uuid4().hex}"


def message_item(text: str, item_id: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(call: ToolCall, item_id: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": status}


def response_object(rid: str, created: float, model: str, req: ResponsesRequest, output: list[dict[str, Any]],
                    status: str, usage: dict[str, Any] | None, incomplete: str | None = None) -> dict[str, Any]:
    """A response as OpenAI writes it (the request's settings echoed)."""
    fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format \
        else {"type": "text"}
    return {
        "id": rid, "object": "response", "created_at": int(created), "status": status, "model": model,
        "output": output, "usage": usage, "error": None,
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p, "tools": req.tools or [],
        "tool_choice": req.tool_choice or "auto", "parallel_tool_calls": req.parallel_tool_calls is not False,
        "text": {"format": fmt}, "metadata": req.metadata or {}, "previous_response_id": None,
        "reasoning": None, "store": False, "truncation": "disabled", "user": req.user,
    }


def usage_object(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + completion_tokens}

