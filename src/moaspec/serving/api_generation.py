"""The generations the API runs: each on a decoder of its own (a fork over the shared weights, one per generation
running at once, per weight mode), in the order places free up (`Admission`), its target passes batched with the
others' (`Scheduler`), finished caches kept for prompts that start alike (`PrefixCache`). A request is prepared
(tokenised, checked against the limits) into a `Job`, then runs as an async iterator of verification rounds."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import torch
from fastapi import Request

from moaspec.decoding.engine import GenerationConfig, Metrics
from moaspec.decoding.grammar import Grammar, Vocabulary
from moaspec.decoding.logit_rules import LogitRules
from moaspec.decoding.prefix_cache import PrefixCache
from moaspec.decoding.sampling import SamplingParams
from moaspec.decoding.scheduler import Scheduler
from moaspec.drafters import ready_drafters
from moaspec.errors import UserError
from moaspec.link.protocol import Busy
from moaspec.models.linear import QUANTISED
from moaspec.serving import api_schema as S
from moaspec.serving.admission import Admission
from moaspec.serving.api_requests import (
    ApiError,
    ApiLimits,
    ChatRequest,
    NamedToolChoice,
    _Request,
    generation_error,
)
from moaspec.serving.metrics import Rate, ServerCollector, Speculation, prefix_gauges, registry
from moaspec.serving.runner import in_worker
from moaspec.serving.tool_calls import ToolFormat, check_tools, tool_format

if TYPE_CHECKING:
    from moaspec.pipeline import Delta, SpecDecoder

log = logging.getLogger("moaspec.api")

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
DISCONNECT_CHECK_S = 0.05  # how often a running generation's request does


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


class Generations:
    """A `SpecDecoder` serving many generations at once, under `limits`."""

    def __init__(self, dec: SpecDecoder, model_name: str, limits: ApiLimits, drafter: str | None = None,
                 scheduler_thread: bool = True):
        """`drafter`: the server's drafter's name in answers (default: the drafter's own); `scheduler_thread`: as
        `TargetServer`'s."""
        self.dec, self.model_name, self.drafter = dec, model_name, drafter
        self.limits = lim = limits
        self.stats = Stats()
        # a local target's passes, batched over the concurrent generations (a remote one batches on its server)
        self.scheduler = Scheduler(dec.target, lim.max_batch_rows, lim.gather_ms, own_thread=scheduler_thread) \
            if dec.remote is None else None
        self.admission = Admission(lim.kv_memory_mb << 20, lim.max_waiting, max_holders=lim.parallel)
        # finished generations' caches, for the next turn of a conversation or a shared system prompt
        self.prefix = PrefixCache(lim.cache_ram_mb << 20) if dec.remote is None and lim.cache_ram_mb else None
        dec.prefix = self.prefix
        # weight mode -> the decoder over that copy of the weights (loaded when a request first asks for it;
        # their passes share the one scheduler), and its idle forks, one per generation that ran at once
        self.weights = weights_of(dec)
        self.variants: dict[str, SpecDecoder] = {self.weights: dec}
        self.idle: dict[str, list[SpecDecoder]] = {self.weights: []}
        self._loading = threading.Lock()
        self.drafters, self.weight_modes = self._offer()
        self.threads = anyio.CapacityLimiter(lim.parallel + 4)
        self.tokens = Rate()
        self.speculation = Speculation()
        self.registry = registry(ServerCollector(self.scheduler, self.tokens, self._gauges)) \
            if self.scheduler is not None else None
        self._longest_token: int | None = None
        self._tasks: set[asyncio.Task] = set()  # generations running (a reference keeps each alive)

    def _gauges(self) -> dict[str, tuple[str, float]]:
        a = self.admission
        return {"moaspec_generations": ("generations in progress", a.holders),
                "moaspec_generations_waiting": ("requests waiting for a place", a.waiting),
                "moaspec_kv_reserved_bytes": ("KV-cache memory reserved by generations", a.used),
                "moaspec_kv_budget_bytes": ("KV-cache memory for generations", a.budget),
                "moaspec_sessions": ("decoders held (one per generation that ran at once)",
                                     sum(map(len, self.idle.values())) + a.holders),
                **self.speculation.gauges(), **prefix_gauges(self.prefix)}

    def _offer(self) -> tuple[list[str], list[str]]:
        """The drafters and weight modes a request may ask for (`drafter`, `weights`): the drafters ready for
        this target and the server's own; the served weight mode and those the operator offers (a remote
        target's mode only; int8/int4 only with the compiled kernels)."""
        own = self.own_drafter()
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
        slots = min(self.context(), prompt_tokens + max_new + self.dec.engine.tree.total_tokens + 1)
        return self.dec.target.new_cache(1).bytes_for(slots)

    def context(self) -> int:
        return self.dec.engine.target.max_seq_len

    def prompt_bound(self) -> int:
        """The most prompt tokens a request may send: the limit, and room for one token in the context."""
        return min(self.limits.max_prompt_tokens, self.context() - 1)

    def prepare(self, req: _Request) -> Job:
        """Token ids of the prompt and the generation settings, checked against the limits (runs in the
        worker thread, under the lock: the tokenizer is not shared across threads)."""
        param = "messages" if isinstance(req, ChatRequest) else "prompt"
        self._check_text_length(req, param)
        tools = None
        if isinstance(req, ChatRequest):
            ids, tools, tool_grammar = self.chat_prompt(req)
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
        context, bound = self.context(), self.prompt_bound()
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

    def vocab(self) -> Vocabulary:
        cfg = self.dec.target.cfg
        return Vocabulary.of(self.dec.tokenizer, cfg.vocab_size, cfg.eos_token_ids)

    def chat_prompt(self, req: ChatRequest) -> tuple[list[int], ToolFormat | None, Grammar | None]:
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
                grammar = fmt.grammar(self.vocab(), callable_, required, req.parallel_tool_calls is not False)
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
        grammar = req.output_grammar(self.vocab()) \
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
        bound = self.prompt_bound()
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
        if chars > bound * self.longest():
            raise ApiError(400, f"the prompt has {chars} characters, more than {bound} tokens can hold; this server "
                           f"takes at most {bound} tokens.", param=param, code="context_length_exceeded")

    async def prepared(self, req: _Request) -> Job:
        try:
            return await in_worker(self.prepare, req, limiter=self.threads)
        except ApiError:
            raise
        except Exception as e:
            raise generation_error(e) from None

    async def rounds(self, request: Request, job: Job) -> AsyncIterator[tuple[Delta, dict[str, Any], Metrics | None]]:
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

    def fork(self, job: Job) -> SpecDecoder:
        """An idle decoder for `job`'s weight mode (loading that mode's weights the first time), with its
        drafter."""
        with self._loading:  # also forks: two at once raced in importlib's caches (a drafter's package lookup)
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
        args = own if job.drafter in (None, self.own_drafter()) else \
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
        return {"drafter": job.drafter or self.own_drafter(), "weights": weights_of(fork),
                "tokens": m.new_tokens, "target_calls": m.target_calls, "tau": round(m.tau, 3),
                "acceptance": round(accepted / m.drafted_tokens, 3) if m.drafted_tokens else None,
                "tokens_per_s": round(m.tokens_per_s, 2), "link": link(fork, away=bool(d.pending))}

    def own_drafter(self) -> str:
        return self.drafter or (self.dec.drafter.name if self.dec.drafter is not None else "none")

    async def _generate(self, request: Request, job: Job, queue: asyncio.Queue, stop: asyncio.Event) -> None:
        """Run one generation on a decoder of its own, once the request has a place (waiting for one, FIFO),
        into `queue`: a slot of the scheduler's loop (a remote target's: a worker thread), which stops between
        rounds once the client went away (or `stop` is set); the place, the decoder and its rows go back at
        once."""
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
        loop = asyncio.get_running_loop()
        cancel = threading.Event()
        fork = None

        def generation() -> bool:
            """The rounds, each sent to `queue` as it is verified; whether the generation ran to its end."""
            it = fork.stream(job.ids, job.cfg, pieces=job.pieces)
            before = fork.engine.metrics  # the last generation's, until this one starts
            try:
                with torch.no_grad():
                    for d in it:
                        self.stats.completion_tokens += len(d.tokens)
                        self.tokens.add(len(d.tokens))
                        last = d.finish is not None
                        loop.call_soon_threadsafe(queue.put_nowait, (d, self._live(fork, job, d),
                                                                     fork.engine.metrics if last else None))
                        if last or cancel.is_set():
                            return last
                return True
            finally:
                it.close()  # the engine tells its target: the scheduler stops waiting for it
                if fork.engine.metrics is not before:
                    self.speculation.add(fork.engine.metrics)

        try:
            fork = await in_worker(self.fork, job, limiter=self.threads)
            running = asyncio.wrap_future(self.scheduler.call(generation)) if self.scheduler is not None \
                else asyncio.ensure_future(in_worker(generation, limiter=self.threads))
            while not running.done() and not cancel.is_set():
                if stop.is_set() or await request.is_disconnected():
                    cancel.set()
                else:
                    await asyncio.wait({running}, timeout=DISCONNECT_CHECK_S)
            finished = await running
        except Exception as e:  # a failure, not a cancellation: the consumer reports it
            finished = True
            queue.put_nowait(e)
        finally:
            cancel.set()
            if fork is not None:
                fork.release()
                self.idle[job.weights].append(fork)
            self.admission.release(need, granted)
            queue.put_nowait(None)
            if not finished:
                self.stats.cancelled += 1
                log.info("client went away: generation stopped")

    async def collect(self, request: Request, job: Job) -> Collected:
        """A whole generation (the answer when not streamed)."""
        out = Collected()
        try:
            async with contextlib.aclosing(self.rounds(request, job)) as rounds:
                async for d, now, m in rounds:
                    out.live = now
                    out.text += d.text
                    out.tokens += d.tokens
                    out.logprobs += d.logprobs or []
                    out.finish, out.metrics = d.finish or out.finish, m or out.metrics
        except Exception as e:
            self.stats.errors += 1
            raise generation_error(e) from None
        return out

    def longest(self) -> int:
        if self._longest_token is None:
            self._longest_token = max(len(t) for t in self.dec.tokenizer.get_vocab())
        return self._longest_token

    def piece(self, token: int) -> str:
        return self.dec.decode([token])

    def chat_logprobs(self, tokens: list[int], logprobs: list) -> list[S.TokenLogprobEntry]:
        """OpenAI's chat `logprobs.content`: per token its text, bytes, log-probability and alternatives."""
        out = []
        for tok, lp in zip(tokens, logprobs, strict=False):
            if lp is None:  # written while a remote target was away: never scored
                continue
            piece = self.piece(tok)
            out.append(S.TokenLogprobEntry(
                token=piece, logprob=lp[0], bytes=list(piece.encode()),
                top_logprobs=[S.TopLogprob(token=(p := self.piece(i)), logprob=v, bytes=list(p.encode()))
                              for i, v in lp[1]]))
        return out

    def completion_logprobs(self, tokens: list[int], logprobs: list, offset: int) -> S.CompletionLogprobs:
        """The legacy completions `logprobs` (tokens, token_logprobs, top_logprobs, text_offset)."""
        pieces, values, tops, offsets = [], [], [], []
        for tok, lp in zip(tokens, logprobs, strict=False):
            if lp is None:
                continue
            piece = self.piece(tok)
            pieces.append(piece)
            values.append(lp[0])
            tops.append({self.piece(i): v for i, v in lp[1]})
            offsets.append(offset)
            offset += len(piece)
        return S.CompletionLogprobs(tokens=pieces, token_logprobs=values, top_logprobs=tops, text_offset=offsets)


def weights_of(dec: SpecDecoder) -> str:
    """The weight mode the target of `dec` runs in (a remote one: its server's)."""
    return dec.remote.info.get("weights", "?") if dec.remote is not None else dec.target.weights


def link(dec: SpecDecoder, away: bool = False) -> str:
    """The state of `dec`'s link to its target: local, connected, or away (also when `away`: its drafter is
    writing alone)."""
    if dec.remote is None:
        return "local"
    return "connected" if dec.remote.ws is not None and not away else "away"


def usage_body(prompt_tokens: int, completion_tokens: int, m: Metrics | None, live: dict[str, Any] | None) -> S.Usage:
    """OpenAI's `usage`, with what speculation did (`speculative`) and the tokens no target verified."""
    usage = S.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                    total_tokens=prompt_tokens + completion_tokens,
                    prompt_tokens_details=S.PromptTokensDetails(cached_tokens=m.cached_tokens if m else 0))
    if m is not None and live is not None:
        usage.speculative = S.Speculative(
            drafter=live["drafter"], weights=live["weights"], tau=round(m.tau, 4), target_calls=m.target_calls,
            tokens_per_s=round(m.tokens_per_s, 3), prefill_s=round(m.prefill_s, 4), total_s=round(m.total_s, 4))
        usage.unverified_tokens = m.unverified_in_output or None
    return usage
