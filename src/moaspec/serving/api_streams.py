"""The API's streamed answers as server-sent events: chat/completions chunks (one per verification round, with
moaspec's extension field beside OpenAI's) and the Responses API's typed events. While an answer may still turn
into tool calls, both hold its text back from where a call could begin (`HeldAnswer`)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request

from moaspec.decoding.engine import Metrics
from moaspec.serving import api_schema as S
from moaspec.serving import responses_api as R
from moaspec.serving.api_generation import Generations, Job, usage_body
from moaspec.serving.api_requests import ChatRequest, _Request, generation_error
from moaspec.serving.tool_calls import ToolCall, ToolFormat

if TYPE_CHECKING:
    from moaspec.pipeline import Delta

EXTENSION = "moaspec"  # the field of each streamed chunk with what speculation did in its round


class HeldAnswer:
    """An answer as it streams: with tools, text goes out only up to where a tool call could begin
    (`ToolFormat.held`), and the calls are parsed from the whole answer at its end."""

    def __init__(self, tools: ToolFormat | None):
        self.tools, self.text, self.shown = tools, "", 0

    def add(self, text: str) -> str:
        """The part of the answer that may be shown now, `text` having been added."""
        self.text += text
        upto = max(self.shown, self.tools.held(self.text)) if self.tools is not None else len(self.text)
        out, self.shown = self.text[self.shown:upto], upto
        return out

    def parse(self) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of the whole answer."""
        return self.tools.parse(self.text) if self.tools is not None else (self.text, [])


def response_usage(job: Job, completion: int, m: Metrics | None) -> dict[str, Any]:
    return R.usage_object(len(job.ids), completion, m.cached_tokens if m else 0)


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def chat_events(gen: Generations, model_name: str, request: Request, req: _Request, job: Job, rid: str,
                      created: int) -> AsyncIterator[str]:
    """A chat or text completion as server-sent events, one chunk per verification round, each carrying
    moaspec's extension field (`EXTENSION`, see docs/serving.md) beside OpenAI's fields."""
    chat = isinstance(req, ChatRequest)
    kind = "chat.completion.chunk" if chat else "text_completion"
    usage_field = {"usage": None} if req.include_usage else {}
    offset = 0  # characters of the answer so far (the legacy logprobs' text_offset)

    def chunk(text: str | None, finish: str | None, role: bool = False, unverified: bool = False,
              ext: dict[str, Any] | None = None, d: Delta | None = None,
              call: tuple[int, ToolCall] | None = None) -> str:
        lp = None
        if d is not None and d.logprobs is not None:
            lp = S.ChoiceLogprobs(content=gen.chat_logprobs(d.tokens, d.logprobs)).model_dump() if chat \
                else gen.completion_logprobs(d.tokens, d.logprobs, offset).model_dump()
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
        return _sse({"id": rid, "object": kind, "created": created, "model": model_name, "choices": [choice],
                     **usage_field, **({EXTENSION: ext} if ext is not None else {})})

    if chat:
        yield chunk("", None, role=True)
    completion, metrics, finished, live = 0, None, False, None
    answer = HeldAnswer(job.tools)
    try:
        async with contextlib.aclosing(gen.rounds(request, job)) as rounds:
            async for d, live, m in rounds:
                completion += len(d.tokens)
                text = answer.add(d.text)
                pieces = [list(p) for p in d.pieces] if job.tools is None else []  # a held answer's cuts differ
                if text or d.pending or d.retract or (d.tokens and d.logprobs is not None):
                    ext = {"round": d.round, "pieces": pieces, **live}
                    if d.pending or d.retract:
                        ext.update(pending=d.pending, retract=d.retract)
                    yield chunk(text, None, ext=ext, d=d)
                    offset += len(text)
                if d.finish is not None:
                    finish = d.finish
                    if job.tools is not None:
                        content, calls = answer.parse()
                        for i, call in enumerate(calls):
                            yield chunk(None, None, call=(i, call))
                        if not calls and (content or "")[answer.shown:]:
                            yield chunk(content[answer.shown:], None)
                        finish = "tool_calls" if calls else finish
                    yield chunk(None, finish, unverified=bool(m and m.unverified_in_output),
                                ext={"round": d.round, "pieces": [], **live})
                    metrics, finished = m, True
    except Exception as e:  # not CancelledError: a client that went away simply ends the stream
        gen.stats.errors += 1
        yield _sse(generation_error(e).body())
    if finished and req.include_usage:
        yield _sse({"id": rid, "object": kind, "created": created, "model": model_name, "choices": [],
                    "usage": usage_body(len(job.ids), completion, metrics, live).model_dump(exclude_none=True)})
    yield "data: [DONE]\n\n"


async def response_events(gen: Generations, model_name: str, request: Request, rreq: R.ResponsesRequest, job: Job,
                          rid: str, created: float) -> AsyncIterator[str]:
    """The Responses stream: typed events (response.created, output items and their text deltas, function
    calls, response.completed), each with its sequence number."""
    seq = 0

    def event(kind: str, **fields: Any) -> str:
        nonlocal seq
        seq += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq - 1, **fields})}\n\n"

    def response(status: str, output: list, usage=None, incomplete=None) -> dict[str, Any]:
        return R.response_object(rid, created, model_name, rreq, output, status, usage, incomplete)

    def text_delta(delta: str) -> str:
        return event("response.output_text.delta", item_id=msg_id, output_index=0, content_index=0, delta=delta,
                     logprobs=[])

    def open_message() -> list[str]:
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [event("response.output_item.added", output_index=0, item=R.message_item("", msg_id, "in_progress")
                      | {"content": []}),
                event("response.content_part.added", item_id=msg_id, output_index=0, content_index=0, part=part)]

    yield event("response.created", response=response("in_progress", []))
    yield event("response.in_progress", response=response("in_progress", []))
    answer, msg_id, output, opened = HeldAnswer(job.tools), R.new_id("msg"), [], False
    completion, metrics, finish = 0, None, "length"
    try:
        async with contextlib.aclosing(gen.rounds(request, job)) as rounds:
            async for d, _, m in rounds:
                completion += len(d.tokens)
                if text := answer.add(d.text):
                    if not opened:
                        opened = True
                        for e in open_message():
                            yield e
                    yield text_delta(text)
                if d.finish is not None:
                    finish, metrics = d.finish, m
    except Exception as e:
        gen.stats.errors += 1
        err = generation_error(e)
        yield event("error", code=err.code, message=err.message, param=err.param)
        yield event("response.failed", response=response("failed", output) | {"error": {
            "code": err.code or "server_error", "message": err.message}})
        return
    content, calls = answer.parse()
    shown = answer.shown
    if not calls and content and len(content) > shown and not opened:
        opened = True
        for e in open_message():
            yield e
    if opened:
        text = content or answer.text[:shown]
        if not calls and len(text) > shown:
            yield text_delta(text[shown:])
        text = text if not calls else answer.text[:shown]
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
    yield event("response.incomplete" if incomplete else "response.completed",
                response=response("incomplete" if incomplete else "completed", output,
                                  response_usage(job, completion, metrics), incomplete))
