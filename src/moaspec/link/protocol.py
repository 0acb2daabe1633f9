"""The target server's wire protocol: one WebSocket per session, one binary frame per message.

A frame is `u32 header length | JSON header | body`, the body being a drafter context as
safetensors bytes (`decoding.context.encode`) or empty. Token ids, tree parents and verdicts are
small and go in the header; tensors never do. Every message a client sends is checked here, before
it reaches the model, so a malformed one is an `ProtocolError` answered with an error frame.

Client -> server:
- {"type": "start", "prompt": [ids], "sampling": {temperature, top_p, top_k, seed, min_p},
   "encoder": null | {"kind": "moa", "id": "<hash of its weights>"}, "wire": "fp16" | "fp32" | "int8",
   "max_new_tokens": int (optional: sizes the session's memory; default the server's context),
   "resume": bool (optional: the prompt is a generation resumed after a cut, up to the whole context)}
- {"type": "verify", "tokens": [ids], "parents": [ints], "dists": {"<node>": [[ids], [probs]]}}
- {"type": "end"}: the generation is over, free its memory (no answer)
- {"type": "ping"}
Server -> client:
- {"type": "ready", "model", "fingerprint", "weights", "max_seq_len", "eos", "pass_costs", "encoders", "limits",
  "instance"} on connect (instance: host:pid of the process serving the session, a replica behind a proxy)
- {"type": "queued", "position"}: a start waits for memory (sent every few seconds until it runs)
- {"type": "step", "path", "accepted", "bonus", "length", "target_ms"} + context bytes
- {"type": "pong"}, {"type": "error", "message", "fatal", "busy", "retry_after"}: `busy` errors (the server
  is full: too many sessions or generations waiting) say when to try again
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import Any

from moaspec.decoding.sampling import SamplingParams
from moaspec.decoding.tree import DraftDist, Tree
from moaspec.errors import UserError
from moaspec.flags import flagged
from moaspec.models.runtime import PREFILL_CHUNK

ENDPOINT = "/v1/target"  # the WebSocket path of a target session
HEADER = struct.Struct("<I")
MAX_HEADER = 1 << 20  # a header over 1 MiB is not a message of this protocol


class ProtocolError(UserError):
    """A message that breaks the protocol or the server's limits (the server answers it, never crashes)."""


class Busy(UserError):
    """The server is full for now (sessions, or generations waiting for memory): retry after `retry_after` s."""

    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = retry_after


def pack(header: dict[str, Any], body: bytes = b"") -> bytes:
    raw = json.dumps(header, separators=(",", ":")).encode()
    return HEADER.pack(len(raw)) + raw + body


def unpack(frame: bytes | str) -> tuple[dict[str, Any], bytes]:
    """(header, body) of a frame; ProtocolError for anything else."""
    if not isinstance(frame, (bytes, bytearray)) or len(frame) < HEADER.size:
        raise ProtocolError("expected a binary frame: u32 header length, JSON header, body")
    (n,) = HEADER.unpack_from(frame)
    if n > MAX_HEADER or HEADER.size + n > len(frame):
        raise ProtocolError(f"bad header length {n} in a {len(frame)}-byte frame")
    try:
        header = json.loads(bytes(frame[HEADER.size:HEADER.size + n]))
    except (UnicodeDecodeError, ValueError) as e:
        raise ProtocolError(f"the header is not JSON: {e}") from None
    except RecursionError:
        raise ProtocolError("the header nests too deeply") from None
    if not isinstance(header, dict) or not isinstance(header.get("type"), str):
        raise ProtocolError("the header must be a JSON object with a string 'type'")
    return header, bytes(frame[HEADER.size + n:])


def _real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class Limits:
    """What clients may ask of a target server. Generations in progress are bounded by memory: each
    reserves the KV cache its prompt + max_new_tokens (+ a tree) can fill, out of `kv_memory_mb`; a
    start that does not fit waits (FIFO, at most `max_waiting`), beyond that it is told to retry."""

    max_prompt_tokens: int = flagged(3072, "--max-prompt-tokens", "longest prompt a session may send")
    max_seq_len: int = flagged(4096, "--max-context", "KV-cache size per session (prompt + generated tokens + a tree)")
    max_tree_tokens: int = flagged(128, "--max-tree-tokens", "nodes of one draft tree, the root included")
    max_sessions: int = flagged(64, "--max-sessions", "open sessions per token")
    max_connections: int = flagged(256, "--max-connections", "open sessions in all")
    kv_memory_mb: int = flagged(2048, "--kv-memory-mb", "KV-cache memory of the generations in progress: each "
                                "reserves what its prompt + max_new_tokens may fill; the rest wait")
    cache_ram_mb: int = flagged(1024, "--cache-ram", "memory for ended generations' KV caches, kept for a session's "
                                "next turn or its reconnection (least recently used out first); 0: none", "MB")
    max_waiting: int = flagged(64, "--max-waiting", "generations queued for memory; beyond, a start is told to retry")
    max_batch_rows: int = flagged(256, "--max-batch-rows", "rows of one batched pass (a prompt chunk or tree fits)")
    gather_ms: float = flagged(5.0, "--gather-ms", "how long a pass waits for the sessions the last one served")
    idle_timeout_s: float = flagged(300.0, "--idle-timeout", "seconds before an idle session is closed")
    max_message_bytes: int = 1 << 20
    token_kv_share: float | None = flagged(None, "--token-kv-share", "the part of --kv-memory-mb one token's "
                                           "generations may hold together (default: all with one token, half with "
                                           "more), so that one client cannot keep the others out", "FRACTION")

    def __post_init__(self) -> None:
        for name in ("max_prompt_tokens", "max_seq_len", "max_tree_tokens", "max_sessions", "max_connections",
                     "kv_memory_mb", "max_waiting", "max_batch_rows", "max_message_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UserError(f"server limit {name} must be a positive integer, got {getattr(self, name)!r}")
        if not isinstance(self.cache_ram_mb, int) or isinstance(self.cache_ram_mb, bool) or self.cache_ram_mb < 0:
            raise UserError(f"server limit cache_ram_mb must be an integer >= 0, got {self.cache_ram_mb!r}")
        if self.max_prompt_tokens >= self.max_seq_len:
            raise UserError(f"max_prompt_tokens ({self.max_prompt_tokens}) must be below max_seq_len "
                            f"({self.max_seq_len})")
        if self.max_batch_rows < max(self.max_tree_tokens, PREFILL_CHUNK):
            raise UserError(f"max_batch_rows ({self.max_batch_rows}) must hold a whole tree "
                            f"({self.max_tree_tokens}) and a prompt chunk ({PREFILL_CHUNK})")
        if not (_real(self.idle_timeout_s) and self.idle_timeout_s > 0):
            raise UserError(f"idle_timeout_s must be > 0, got {self.idle_timeout_s}")
        if not (_real(self.gather_ms) and self.gather_ms >= 0):
            raise UserError(f"gather_ms must be >= 0, got {self.gather_ms}")
        if self.token_kv_share is not None and not (_real(self.token_kv_share) and 0 < self.token_kv_share <= 1):
            raise UserError(f"token_kv_share must be in (0, 1], got {self.token_kv_share}")


def _ints(value: Any, name: str, lo: int, hi: int, max_len: int) -> list[int]:
    if not isinstance(value, list) or not value or len(value) > max_len:
        raise ProtocolError(f"'{name}' must be a list of 1..{max_len} integers")
    if not all(type(v) is int and lo <= v < hi for v in value):
        raise ProtocolError(f"'{name}' must hold integers in {lo}..{hi - 1}")
    return value


def check_prompt(header: dict[str, Any], vocab: int, limits: Limits) -> list[int]:
    """A start's prompt: at most `max_prompt_tokens`, or for a resumed generation ("resume": true, its prompt
    and verified output after a cut) what the context holds with room for a token."""
    prompt = header.get("prompt")
    resume = header.get("resume", False)
    if type(resume) is not bool:
        raise ProtocolError("'resume' must be true or false")
    bound = limits.max_seq_len - 1 if resume else limits.max_prompt_tokens
    if isinstance(prompt, list) and len(prompt) > bound:
        raise ProtocolError(f"the prompt has {len(prompt)} tokens; this server takes at most {bound}"
                            + (" (a resumed generation: its context)" if resume else ""))
    return _ints(prompt, "prompt", 0, vocab, bound)


def sampling_to_wire(p: SamplingParams) -> dict[str, Any]:
    return {"temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k, "seed": p.seed,
            **({"min_p": p.min_p} if p.min_p else {})}  # only when set: a server before min_p takes the rest


def sampling_from_wire(raw: Any) -> SamplingParams:
    if not isinstance(raw, dict) or set(raw) - {"temperature", "top_p", "top_k", "seed", "min_p"}:
        raise ProtocolError("'sampling' must be an object with temperature, top_p, top_k, seed, min_p")
    t, p, k, seed, m = (raw.get("temperature", 0.0), raw.get("top_p", 1.0), raw.get("top_k", 0), raw.get("seed"),
                        raw.get("min_p", 0.0))
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (t, p, m)) or type(k) is not int \
            or not (seed is None or type(seed) is int):
        raise ProtocolError("'sampling' holds values of the wrong type")
    try:
        return SamplingParams(float(t), float(p), k, seed, float(m))
    except UserError as e:
        raise ProtocolError(str(e)) from None


def tree_to_wire(tree: Tree) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "verify", "tokens": tree.tokens, "parents": tree.parents}
    if tree.dists:
        out["dists"] = {str(node): [list(q.ids), list(q.probs)] for node, q in tree.dists.items()}
    return out


def tree_from_wire(header: dict[str, Any], vocab: int, limits: Limits) -> Tree:
    n = limits.max_tree_tokens
    tokens = _ints(header.get("tokens"), "tokens", 0, vocab, n)
    parents = header.get("parents")
    if not isinstance(parents, list) or len(parents) != len(tokens) or parents[0] != -1 \
            or not all(type(p) is int for p in parents):
        raise ProtocolError("'parents' must list one integer per token, -1 for the root first")
    dists = {}
    raw = header.get("dists", {})
    if not isinstance(raw, dict) or len(raw) > len(tokens):
        raise ProtocolError("'dists' must map tree nodes to [ids, probs]")
    for node, value in raw.items():
        if not (isinstance(node, str) and node.isascii() and node.isdigit() and isinstance(value, list)
                and len(value) == 2):  # ascii: "²" is a digit to isdigit() and not to int()
            raise ProtocolError("'dists' must map tree nodes to [ids, probs]")
        ids = _ints(value[0], "dists ids", 0, vocab, vocab)
        probs = value[1]
        if not isinstance(probs, list) or len(probs) != len(ids) or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0
                for x in probs):
            raise ProtocolError("'dists' probabilities must be one finite number >= 0 per id")
        dists[int(node)] = DraftDist(tuple(ids), tuple(float(x) for x in probs))
    try:
        return Tree(tokens, parents, dists=dists)
    except ValueError as e:
        raise ProtocolError(f"bad draft tree: {e}") from None
