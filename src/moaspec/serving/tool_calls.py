"""Tool calling through each model's own chat template and call syntax (OpenAI's `tools` / `tool_choice`).

Which syntax a model writes is read from its chat template:

- `hermes` (Qwen2.5, Qwen3, Hermes): the template lists the tools; a call is
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, several one after another;
- `llama3` (Llama 3.1+): the template lists the tools; a call is `{"name": ..., "parameters": {...}}`;
- `json` (a template without tools: SmolLM2, Gemma 3): the tools are described in a system message, and the
  answer is one JSON object, `{"tool_calls": [{"name": ..., "arguments": {...}}]}` or `{"response": "..."}`,
  held to that schema by a grammar (the way llama.cpp's generic format does it), so even a small model's
  calls parse. Earlier calls and tool results are written back into the conversation in the same JSON.

`tool_choice` "required" or a named function holds the answer to calls (of that function) with a grammar in
every format; "auto" lets a native-format model choose, and its calls are parsed from the text; "none" renders
no tools. The grammar composes with speculation like any other (`decoding.logit_rules`).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from moaspec.decoding.grammar import Grammar, Vocabulary
from moaspec.errors import UserError

MAX_TOOLS = 64
NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _arguments(value: Any) -> dict[str, Any] | Any:
    """A call's arguments as the template renders them: OpenAI sends a JSON string, templates expect the object."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _call_schema(tools: list[dict], key: str) -> dict[str, Any]:
    """One call of any of `tools`: {"name": <its name>, key: <its parameters>}."""
    return {"anyOf": [{"type": "object", "properties": {
        "name": {"const": t["function"]["name"]},
        key: t["function"].get("parameters") or {"type": "object"}},
        "required": ["name", key], "additionalProperties": False} for t in tools]}


class ToolFormat:
    """How one model family's chat template takes tools and how its answers call them."""

    name = ""
    native = True  # the template renders the tools itself

    def __init__(self, names: tuple[str, ...] = ()):
        self.names = frozenset(names)  # the tools this answer may call

    def messages(self, messages: list[dict], tools: list[dict] | None) -> list[dict]:
        """The conversation as the template takes it (earlier calls' arguments as objects)."""
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _arguments(
                    c["function"]["arguments"])}} for c in m["tool_calls"]]
            out.append(m)
        return out

    def grammar(self, vocab: Vocabulary, tools: list[dict], required: bool, parallel: bool) -> Grammar | None:
        """What the answer is held to: calls only when `required`, else nothing (the model chooses)."""
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(the answer's text besides its calls, or None; its calls)."""
        raise NotImplementedError

    def held(self, text: str) -> int:
        """How much of a streamed answer so far may be shown as text: up to where a call (may) begin."""
        return len(text)


class Hermes(ToolFormat):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def grammar(self, vocab: Vocabulary, tools: list[dict], required: bool, parallel: bool) -> Grammar | None:
        if not required:
            return None
        tok = vocab.token_id
        open_, close = (f"<[{tok(t)}]>" if tok(t) is not None else json.dumps(t) for t in (self.OPEN, self.CLOSE))
        more = ' ("\\n" call)*' if parallel else ""
        lark = (f"start: call{more}\ncall: {open_} \"\\n\" body \"\\n\" {close}\n"
                f"body: %json {json.dumps(_call_schema(tools, 'arguments'))}")
        return Grammar.gbnf(vocab, lark)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start = text.find(self.OPEN)
        if start < 0:  # a small model may leave out the tags: a bare call of one of the tools counts
            try:
                obj = json.loads(text)
            except ValueError:
                return text, []
            if isinstance(obj, dict) and obj.get("name") in self.names and isinstance(obj.get("arguments"), dict):
                return None, [ToolCall(obj["name"], json.dumps(obj["arguments"], ensure_ascii=False), new_call_id())]
            return text, []
        calls = []
        for body in self.CALL.findall(text[start:]):
            try:
                obj = json.loads(body)
                calls.append(ToolCall(str(obj["name"]), json.dumps(obj.get("arguments", {}), ensure_ascii=False),
                                      new_call_id()))
            except (ValueError, KeyError, TypeError):
                return text, []  # not a well-formed call: the text as it is
        content = text[:start].strip()
        return content or None, calls

    def held(self, text: str) -> int:
        at = text.find(self.OPEN)
        if at >= 0:
            return at
        if text.lstrip().startswith("{"):  # may be a call without its tags
            return 0
        for k in range(min(len(self.OPEN) - 1, len(text)), 0, -1):  # a call's tag may be arriving
            if self.OPEN.startswith(text[-k:]):
                return len(text) - k
        return len(text)


class Llama3(ToolFormat):
    name = "llama3"
    TAG = "<|python_tag|>"

    def grammar(self, vocab: Vocabulary, tools: list[dict], required: bool, parallel: bool) -> Grammar | None:
        if not required:
            return None
        return Grammar.json_schema(vocab, _call_schema(tools, "parameters"))

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix(self.TAG).strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        for part in body.split(";"):
            try:
                obj = json.loads(part)
                args = obj.get("parameters", obj.get("arguments", {}))
                calls.append(ToolCall(str(obj["name"]), json.dumps(args, ensure_ascii=False), new_call_id()))
            except (ValueError, KeyError, TypeError, AttributeError):
                return text, []
        return None, calls

    def held(self, text: str) -> int:
        stripped = text.lstrip()
        return 0 if not stripped or stripped[0] in "{<" else len(text)


class JsonCalls(ToolFormat):
    name = "json"
    native = False

    def messages(self, messages: list[dict], tools: list[dict] | None) -> list[dict]:
        out: list[dict] = []
        for m in messages:
            if m["role"] == "assistant" and m.get("tool_calls"):
                calls = [{"name": c["function"]["name"], "arguments": _arguments(c["function"]["arguments"])}
                         for c in m["tool_calls"]]
                out.append({"role": "assistant", "content": json.dumps({"tool_calls": calls}, ensure_ascii=False)})
            elif m["role"] == "tool":
                result = json.dumps({"tool_response": {"tool_call_id": m.get("tool_call_id"),
                                                       "content": m.get("content")}}, ensure_ascii=False)
                if out and out[-1]["role"] == "user" and out[-1].get("tool_results"):
                    out[-1]["content"] += "\n" + result
                else:
                    out.append({"role": "user", "content": result, "tool_results": True})
            elif m["role"] == "assistant" and m.get("content") is not None and tools:  # answers in the call format
                out.append({"role": "assistant", "content": json.dumps({"response": m["content"]}, ensure_ascii=False)})
            else:
                out.append(dict(m))
        out = [{k: v for k, v in m.items() if k != "tool_results"} for m in out]
        if tools:
            listing = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
            note = ("Tools you can call:\n" + listing + '\nReply with one JSON object: {"tool_calls": [{"name": ..., '
                    '"arguments": {...}}]} to call tools, or {"response": "..."} to answer.')
            if out and out[0]["role"] == "system":
                out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + note}
            else:
                out.insert(0, {"role": "system", "content": note})
        return out

    def grammar(self, vocab: Vocabulary, tools: list[dict], required: bool, parallel: bool) -> Grammar | None:
        calls: dict[str, Any] = {"type": "array", "items": _call_schema(tools, "arguments"), "minItems": 1}
        if not parallel:
            calls["maxItems"] = 1
        call_branch = {"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"],
                       "additionalProperties": False}
        answer = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                  "additionalProperties": False}
        return Grammar.json_schema(vocab, call_branch if required else {"anyOf": [call_branch, answer]})

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        try:
            obj = json.loads(text)
        except ValueError:
            return text, []  # cut short (max_tokens): the text as it is
        if isinstance(obj, dict) and isinstance(obj.get("tool_calls"), list):
            return None, [ToolCall(str(c["name"]), json.dumps(c.get("arguments", {}), ensure_ascii=False),
                                   new_call_id()) for c in obj["tool_calls"]]
        if isinstance(obj, dict) and isinstance(obj.get("response"), str):
            return obj["response"], []
        return text, []

    def held(self, text: str) -> int:
        return 0  # one JSON object: shown once it is whole


def tool_format(template: str | None, names: tuple[str, ...] = ()) -> ToolFormat:
    """The call syntax a chat template speaks, for an answer that may call the tools `names`."""
    if template and "<tool_call>" in template and "tools" in template:
        return Hermes(names)
    if template and "<|python_tag|>" in template and "tools" in template:
        return Llama3(names)
    return JsonCalls(names)


def check_tools(tools: list[dict], choice: str | dict | None) -> tuple[bool, list[dict]]:
    """(whether calls are required, the tools the answer may call) for OpenAI's `tools` and `tool_choice`."""
    names = [t["function"]["name"] for t in tools]
    for name in names:
        if not NAME.match(name):
            raise UserError(f"tool names take 1 to 64 letters, digits, '_', '-' or '.', got {name!r}")
    if len(set(names)) != len(names):
        raise UserError("two tools have the same name")
    if isinstance(choice, dict):
        name = choice.get("function", {}).get("name")
        chosen = [t for t in tools if t["function"]["name"] == name]
        if not chosen:
            raise UserError(f"tool_choice names {name!r}, which is not among the tools")
        return True, chosen
    if choice == "required" and not tools:
        raise UserError("tool_choice 'required' needs tools")
    return choice == "required", tools
