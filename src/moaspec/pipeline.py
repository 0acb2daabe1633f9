"""The user-facing API: load a target (+ drafter) by name, generate text with metrics.

    from moaspec.pipeline import SpecDecoder
    dec = SpecDecoder("smollm2-135m", drafter="lookup")
    print(dec.generate("Write a haiku about CPUs.").text)
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from itertools import pairwise
from typing import TYPE_CHECKING, Protocol

import torch

from moaspec.decoding.engine import TARGET, Engine, GenerationConfig, Metrics
from moaspec.decoding.prefix_cache import PrefixCache
from moaspec.decoding.target import ContextEncoder, LocalTarget, TargetSide, TokenLogprob
from moaspec.decoding.tree import AdaptiveChain, Tree, TreeConfig, split_min_prob, tree_for_costs
from moaspec.drafters import DEFAULT_DRAFT_MODEL, build_drafter, resolve_auto
from moaspec.drafters.trained import encoder_id
from moaspec.errors import UserError
from moaspec.models import quant
from moaspec.models.linear import WeightMode
from moaspec.models.parts import PartialTarget
from moaspec.models.runtime import KVCache, Transformer
from moaspec.models.store import (
    chat_ids,
    load_tokenizer,
    read_measurements,
    resolve,
    save_measurements,
    weights_fingerprint,
)
from moaspec.threads import set_threads

UNVERIFIED = "unverified"  # a `Delta.pieces` origin: written by the drafter alone, never verified

if TYPE_CHECKING:
    from moaspec.decoding.scheduler import Scheduler
    from moaspec.link.remote import RemoteTarget


def plausible_costs(costs: dict[int, float], clamp: bool = False) -> dict[int, float]:
    """Pass costs as measured, if they can be real: a pass over more rows streams the same weights,
    so its cost grows at most about linearly with the rows, and it never costs clearly less than a
    pass over fewer. Costs that break either were measured under other load (two threads on a shared
    core wait on each other; a 1-row pass once measured 80 ms against 60 for 2 rows): ValueError, or
    with `clamp` each cost lowered to the cheapest larger pass and capped at linear growth from the
    row count before it."""
    ks = sorted(costs)
    if any(costs[a] > 1.25 * costs[b] for a, b in pairwise(ks)):
        if not clamp:
            raise ValueError(f"implausible pass costs (disturbed measurement): {costs}")
        costs = {k: min(costs[j] for j in ks if j >= k) for k in ks}
    out, prev = {}, None
    for k in ks:
        cap = None if prev is None else out[prev] * 1.25 * k / prev
        if cap is not None and costs[k] > cap:
            if not clamp:
                raise ValueError(f"implausible pass costs (disturbed measurement): {costs}")
            out[k] = cap
        else:
            out[k] = costs[k]
        prev = k
    return out


@dataclass
class Delta:
    """What one verification round adds to an answer: the verified `text` and its `tokens`, that text cut
    per token with who wrote it (`pieces`: (text, origin), origin a drafter's name, TARGET, or UNVERIFIED
    for tokens the target never verified), and the target calls so far (`round`). While a remote target
    is away, `pending` carries text the drafter wrote alone (not in `text`); the next verified delta
    withdraws the `retract` pending pieces shown before it, since its own text re-states them as verified,
    corrected or kept."""

    text: str
    tokens: list[int]
    finish: str | None
    pieces: list[tuple[str, str]]  # empty unless `SpecDecoder.stream` was asked for them
    round: int
    pending: list[str] = field(default_factory=list)
    retract: int = 0
    logprobs: list[TokenLogprob] | None = None  # per token of `tokens`, with `GenerationConfig.logprobs`


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    finish_reason: str
    metrics: Metrics = field(default_factory=Metrics)

    def as_dict(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            **self.metrics.as_dict(),
        }


class SpecDecoder:
    """A target model, its tokenizer and chat template, and an optional drafter, ready to generate."""

    def __init__(
        self,
        model: str = "smollm2-135m",
        drafter: str = "none",
        draft_model: str | None = None,
        drafter_path: str | None = None,
        weights: WeightMode = "fp32",
        tree: TreeConfig | str | None = None,
        max_seq_len: int = 4096,
        device: str = "cpu",
        warmup: bool = True,
        hybrid_model: str = "moa",
        hybrid_policy: str = "switch",
        target_url: str | None = None,
        token: str | None = None,
        wire: str = "fp16",
        target_timeout_s: float = 30.0,
        threads: int | str | None = None,
        datastore: str | None = None,
        ca_file: str | None = None,
    ):
        """`threads`: the kernels' thread count for this process (an int, "auto" = the cores idle now, None =
        leave it as it is). `target_url` (with the server's bearer `token`): verify on a `moaspec
        serve-target` server and keep only the drafter and the target parts it shares (embedding, LM head)
        here; `wire` is the dtype of the drafter context sent back (fp16, fp32, int8); a call unanswered
        for `target_timeout_s` counts as a disconnection; `ca_file`: the CA a wss:// server's certificate is
        checked against (default: the system's)."""
        t = time.perf_counter()
        if threads is not None:
            set_threads(None if threads == "auto" else threads)
        self.model_name = model
        self.folder = resolve(model)
        self.tokenizer = load_tokenizer(self.folder)
        # one tokenizer serves every fork; a fast tokenizer's Rust state is not shared across threads
        self.tokenizer_lock = threading.Lock()
        self.remote: RemoteTarget | None = None
        self.cache: KVCache | None = None  # None: the model's own (forks have their own)
        self.scheduler: Scheduler | None = None  # a fork's passes join its siblings' (`fork`)
        # where a finished generation's cache goes, and a start looks for its prompt's prefix (a server's);
        # without one, a decoder's own cache keeps its last conversation for the next turn
        self.prefix: PrefixCache | None = None
        self._remote_args = dict(url=target_url, token=token, wire=wire, timeout_s=target_timeout_s, ca_file=ca_file)
        if target_url is None:
            self.target: Transformer | PartialTarget = Transformer(self.folder, weights=weights, device=device,
                                                                   max_seq_len=max_seq_len)
        else:
            from moaspec.link.remote import read_token

            self.target = PartialTarget(self.folder, weights=weights, device=device, max_seq_len=max_seq_len)
            self._remote_args["token"] = token = token or read_token()
            self.remote = self._connect()
            if self.remote.model != model or self.remote.fingerprint != weights_fingerprint(self.folder):
                raise UserError(f"the server at {target_url} serves {self.remote.model!r} (weights "
                                f"{self.remote.fingerprint}), not this client's {model!r}: draft for the same target")
        self.set_drafter(drafter, draft_model=draft_model, drafter_path=drafter_path, tree=tree,
                         hybrid_model=hybrid_model, hybrid_policy=hybrid_policy, datastore=datastore)
        if warmup and self.remote is None:
            self.target.warmup()
        self.load_s = time.perf_counter() - t

    def _connect(self) -> RemoteTarget:
        from moaspec.link.remote import RemoteTarget, client_tls

        a = self._remote_args
        return RemoteTarget(a["url"], a["token"], wire=a["wire"], timeout_s=a["timeout_s"],
                            fingerprint=weights_fingerprint(self.folder), ssl_context=client_tls(a["ca_file"]))

    def fork(self, scheduler: Scheduler | None = None) -> SpecDecoder:
        """Another decoder over the same weights and tokenizer for one more concurrent generation: its own
        drafter (state), KV cache or remote session, and engine. With `scheduler` (over this decoder's
        model) its target passes are batched with those of the other forks."""
        other = copy.copy(self)
        if self.remote is not None:
            other.remote = self._connect()
        else:
            other.cache = self.target.new_cache()
        other.scheduler = scheduler
        other.set_drafter(**self._drafter_args)
        return other

    def with_weights(self, weights: str) -> SpecDecoder:
        """This decoder's model in another weight mode (a copy of the weights of its own), with the same
        drafter: one server answering in several modes. Its forks may share this decoder's scheduler."""
        if self.remote is not None:
            raise UserError("a remote target runs in its server's weight mode")
        other = copy.copy(self)
        other.target = Transformer(self.folder, weights=weights, device=self.target.device,
                                   max_seq_len=self.target.max_seq_len)
        other.cache, other.scheduler = None, None
        other.set_drafter(**self._drafter_args)
        other.target.warmup()
        return other

    def release(self) -> None:
        """A fork's generation ended: its KV cache goes to the prefix cache (the fork gets an empty one) or, with
        none, gives its memory back."""
        if self.cache is None:
            return
        if self.prefix is None:
            self.cache.release()
            return
        self.prefix.put(self.target, self.cache)
        self.cache = self.target.new_cache(self.cache.size)
        if isinstance(self.engine.target, LocalTarget):
            self.engine.target.cache = self.cache

    def close(self) -> None:
        """End a fork: its memory and its remote session (with any reconnection attempts)."""
        self.release()
        if self.remote is not None:
            self.remote.shutdown()

    def set_drafter(self, drafter: str = "none", draft_model: str | None = None, drafter_path: str | None = None,
                    tree: TreeConfig | str | None = None, hybrid_model: str = "moa",
                    hybrid_policy: str = "switch", datastore: str | None = None) -> None:
        """Swap the drafter (and tree shape: "auto" = calibrated for this machine, "adaptive[:depth]" = a
        chain whose length follows live acceptance, either with "@P" for `TreeConfig.min_prob`) on the
        loaded target: benchmarks compare drafters on one copy of the target's weights.
        `hybrid_model`/`hybrid_policy`: the parts of `hybrid`; `datastore`: the suffix drafter's (None: the
        one shipped for the target, "none": none, else a folder of `moaspec datastore`)."""
        self._drafter_args = dict(drafter=drafter, draft_model=draft_model, drafter_path=drafter_path, tree=tree,
                                  hybrid_model=hybrid_model, hybrid_policy=hybrid_policy, datastore=datastore)
        min_prob = None
        if isinstance(tree, str):
            shape, min_prob = split_min_prob(tree)
            if shape == "auto":
                tree = "auto"
            else:
                tree = TreeConfig.parse(tree)
                if not tree.adaptive:
                    raise UserError(f"tree must be 'auto', 'adaptive[:depth]' (either with @P) or a TreeConfig, "
                                    f"got {tree!r}")
        self.drafter = build_drafter(drafter, self.model_name, self.target, draft_model=draft_model,
                                     drafter_path=drafter_path, hybrid_model=hybrid_model, hybrid_policy=hybrid_policy,
                                     datastore=datastore)
        costs = None
        if tree == "auto":
            costs = self.pass_costs() if self.drafter is not None else None
            tree = tree_for_costs(costs, branching=self.drafter.branching) if costs is not None else None
            if tree is not None and min_prob is not None:
                tree = replace(tree, min_prob=min_prob)
        adapt = None
        if tree is not None and tree.adaptive:
            adapt = AdaptiveChain(costs if costs is not None else self.pass_costs(), tree.depth, width=tree.topk)
        if hasattr(self.drafter, "set_row_costs"):  # a drafter that prices its drafts' verify rows
            self.drafter.set_row_costs(costs if costs is not None else self.pass_costs())
        encoder = self.drafter.encoder if self.drafter else None
        if self.remote is not None:
            self.remote.encoder = encoder_id(encoder) if encoder is not None else None
            self.remote.check_encoder()
            target: TargetSide = self.remote
        else:
            target = LocalTarget(self.target, encoder, cache=self.cache, scheduler=self.scheduler,
                                 prefix=self.prefix,
                                 defer_context=getattr(self.drafter, "defers_context", False),
                                 candidates=getattr(self.drafter, "candidates", 0))
        self.engine = Engine(target, self.drafter, tree, adapt)

    @property
    def drafter_name(self) -> str:
        """The drafter that runs: `auto` resolved to what it picked for this target."""
        name = self._drafter_args["drafter"]
        return resolve_auto(self.model_name) if name == "auto" else name

    def describe(self) -> str:
        """The target and what drafts for it, as a user names them ("qwen + hybrid:switch (suffix + moa)")."""
        a, name = self._drafter_args, self.drafter_name
        if name == "model":
            return f"{self.model_name} + model:{a['draft_model'] or DEFAULT_DRAFT_MODEL.get(self.model_name, '?')}"
        if name == "hybrid":
            return f"{self.model_name} + hybrid:{a['hybrid_policy']} (suffix + {a['hybrid_model']})"
        return f"{self.model_name} + {name}"

    def auto_tree(self) -> TreeConfig:
        """The tree this machine affords the loaded drafter (`tree_for_costs` over measured pass costs)."""
        return tree_for_costs(self.pass_costs(), branching=self.drafter is not None and self.drafter.branching)

    def pass_costs(self) -> dict[int, float]:
        """ms of one target pass per row count, measured once per model, weight mode, device and
        thread count, and cached (a remote target's: as its server measured them)."""
        if self.remote is not None:
            return self.remote.pass_costs()
        key = f"{self.folder.name}|{self.target.weights}|{self.target.device}|{torch.get_num_threads()}"
        if self.target.kernels is not None:  # the compiled kernels run: new kernels, new costs
            key += f"|{quant.source_tag()}"
            if self.target.weights == "fp16":  # the layer kernel this model was given on this machine
                key += "|few-row" if any(lin.few_rows for lin in self.target.linears()) else "|fbgemm"
        known = read_measurements("calibration.json")
        try:
            return plausible_costs({int(k): float(v) for k, v in known[key].items()})
        except (KeyError, AttributeError, TypeError, ValueError):
            pass
        for _ in range(2):
            costs = self.target.pass_costs()
            try:
                known[key] = plausible_costs(costs)
            except ValueError:  # disturbed by other load: measure again, and never cache it
                continue
            save_measurements("calibration.json", known)
            return costs
        return plausible_costs(costs, clamp=True)

    # ---------------------------------------------------------------- prompts
    def encode(self, prompt: str | list[dict], chat: bool = True, system: str | None = None,
               tools: list[dict] | None = None) -> list[int]:
        """Token ids for a prompt: plain text, or chat messages rendered with the model's template (and `tools`,
        OpenAI's function definitions, where the template lists them)."""
        if isinstance(prompt, str):
            if not prompt.strip():
                raise UserError("the prompt is empty")
            if not chat or not self.tokenizer.chat_template:
                with self.tokenizer_lock:
                    return self.tokenizer.encode(prompt)
            prompt = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": prompt}
            ]
        if not prompt:
            raise UserError("the conversation is empty")
        for msg in prompt:
            if not isinstance(msg, dict) or "role" not in msg or not (
                    isinstance(msg.get("content"), str) or (msg.get("content") is None and msg.get("tool_calls"))):
                raise UserError(f"malformed chat message {msg!r}: need {{'role': ..., 'content': str}}")
        with self.tokenizer_lock:
            return chat_ids(self.tokenizer, prompt, tools=tools)

    # ---------------------------------------------------------------- generation
    def stream(self, prompt: str | list[dict] | list[int], cfg: GenerationConfig | None = None,
               chat: bool = True, pieces: bool = False) -> Iterator[Delta]:
        """Yield what each verification round adds to the answer (`Delta`); its `pieces` only when asked
        (they cost a decode per token: a client that shows them asks, `generate` does not).

        Only text the target verified goes into `Delta.text`: while a remote target is away, the tokens the
        drafter writes alone wait here, shown as `Delta.pending`, until the target confirms or corrects
        them, or keeps them (`resync="keep"`), or the generation ends without it."""
        cfg = cfg or GenerationConfig()
        ids = list(prompt) if _is_ids(prompt) else self.encode(prompt, chat=chat)
        tokens: list[int] = []
        origins: list[str] = []  # who wrote each of `tokens`
        lps: list[TokenLogprob | None] = []  # their log-probabilities, with cfg.logprobs (unverified: None)
        unverified: list[int] = []
        sent = 0  # tokens yielded so far
        shown = ""
        pending = ""  # text of the unverified tokens shown so far
        pieces_shown = 0
        for chunk in self.engine.stream(ids, cfg):
            if chunk.rollback:
                del unverified[len(unverified) - chunk.rollback:]
            if not chunk.verified:
                unverified += chunk.tokens
                if chunk.finish_reason is None:
                    text = self.decode(tokens + unverified)[len(shown):].rstrip("\ufffd")
                    if text.startswith(pending) and len(text) > len(pending):
                        pieces_shown += 1
                        yield Delta("", [], None, [], self.engine.metrics.target_calls,
                                    pending=[text[len(pending):]])
                        pending = text
                    continue
            if not chunk.verified:  # the end came before the target did: the text ends unverified
                self.engine.metrics.unverified_in_output = len(unverified)
            origins += [UNVERIFIED] * len(unverified) + (chunk.origins if chunk.verified else [])
            lps += [None] * len(unverified) + (list(chunk.logprobs or [None] * len(chunk.tokens))
                                               if chunk.verified else [])
            tokens += unverified + (chunk.tokens if chunk.verified else [])
            unverified = []
            text = self.decode(tokens)
            finish = chunk.finish_reason
            hits = [h for s in cfg.stop if (h := text.find(s, max(0, len(shown) - len(s) + 1))) >= 0]
            if hits:
                text, finish = text[: min(hits)], "stop"
            hold = 0
            if finish is None:
                # hold back an incomplete UTF-8 character, or a tail that may begin a stop string
                hold = max((k for s in cfg.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
                if text.endswith("\ufffd"):
                    hold = max(hold, 1)
            visible = text[: len(text) - hold]
            # Token ids follow the text: held-back text holds back its tokens, and a stop string drops
            # the tokens after the text it cuts. The ids kept are the fewest whose decoded text reaches
            # the cut; a token that the cut falls inside (a stop string starting mid-token) is kept, so
            # the ids decode to the text plus at most the rest of that one token.
            keep = self._reaching(tokens, visible, sent) if hits or hold else len(tokens)
            if finish is not None:
                self.engine.metrics.new_tokens = keep
            cut = self._pieces(tokens, origins, sent, keep, shown, visible) if pieces else []
            yield Delta(visible[len(shown):], tokens[sent:keep], finish, cut, self.engine.metrics.target_calls,
                        retract=pieces_shown, logprobs=lps[sent:keep] if cfg.logprobs is not None else None)
            sent, shown, pending, pieces_shown = keep, visible, "", 0
            if finish is not None:
                return

    def _pieces(self, tokens: list[int], origins: list[str], lo: int, hi: int, shown: str,
                visible: str) -> list[tuple[str, str]]:
        """visible[len(shown):] cut per token of tokens[lo:hi], each with its origin: a token's piece ends
        where the text of the tokens up to it ends (less an incomplete character, which goes to the next)."""
        start, end = len(shown), len(visible)
        if hi <= lo:
            return [(visible[start:], origins[lo - 1] if lo else TARGET)] if end > start else []
        cuts = [start]
        for k in range(lo + 1, hi):
            cuts.append(min(end, max(cuts[-1], len(self.decode(tokens[:k]).rstrip("\ufffd")))))
        cuts.append(end)
        return [(visible[a:b], origins[k]) for k, a, b in zip(range(lo, hi), cuts[:-1], cuts[1:], strict=True)]

    def decode(self, tokens: list[int]) -> str:
        with self.tokenizer_lock:
            return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def _reaching(self, tokens: list[int], text: str, lo: int) -> int:
        """The fewest tokens (at least `lo`) whose decoded text starts with `text`."""
        k = len(tokens)
        while k > lo and self.decode(tokens[: k - 1]).startswith(text):
            k -= 1
        return k

    def generate(
        self,
        prompt: str | list[dict] | list[int],
        cfg: GenerationConfig | None = None,
        chat: bool = True,
        on_text: Callable[[str], None] | None = None,
    ) -> Generation:
        """Generate to the end; `on_text` receives each text delta as soon as it is verified."""
        ids = list(prompt) if _is_ids(prompt) else self.encode(prompt, chat=chat)
        parts: list[str] = []
        tokens: list[int] = []
        finish = "length"
        for d in self.stream(ids, cfg):
            if on_text is not None and d.text:
                on_text(d.text)
            parts.append(d.text)
            tokens += d.tokens
            finish = d.finish or finish
        return Generation("".join(parts), tokens, ids, finish, self.engine.metrics)

    def record(self, prompt: str | list[dict] | list[int], cfg: GenerationConfig | None,
               recorder: Recorder, chat: bool = True) -> Generation:
        """`generate` (local target, no drafter) with `recorder` as the target's encoder, then one pass over
        the text's final token, so that the recorder has seen every position of prompt + answer."""
        target = self.engine.target
        if not isinstance(target, LocalTarget) or self.drafter is not None:
            raise UserError("recording the target's features needs a local target and no drafter")
        target.encoder = recorder
        try:
            gen = self.generate(prompt, cfg, chat=chat)
            target.verify(Tree.chain(recorder.final_token(gen)))
            return gen
        finally:
            target.encoder = None
            target.release()


class Recorder(ContextEncoder, Protocol):
    """A target-side encoder that keeps the target's state of each committed position (the data job
    stores it as training features) rather than encoding it for a drafter."""

    def final_token(self, generation: Generation) -> int:
        """The token that ends the recorded text (the answer's stop token, or its last token when cut):
        the one position plain decoding never passes through the target."""
        ...


def generate_many(dec: SpecDecoder, prompts: list[str | list[dict] | list[int]],
                  cfg: GenerationConfig | list[GenerationConfig] | None = None, chat: bool = True,
                  parallel: int = 8, recorders: Callable[[int], Recorder] | None = None,
                  ) -> Iterator[tuple[int, Generation | Exception]]:
    """Generate for many prompts together: up to `parallel` at once, each on its own fork of `dec`, their
    target passes batched by one scheduler whose loop runs on this thread (the one that loaded the model, see
    `decoding.scheduler`), each generation a slot of it; each answer is identical to a lone run's. A remote
    target's generations run in threads of their own. `cfg`: one for all, or one per prompt. `recorders(i)`:
    a `Recorder` that sees the target's state for every position of prompt i and its answer, from the passes
    that wrote the answer (a local target with no drafter). Yields (index, generation, or the error of that
    prompt alone) as each finishes."""
    cfgs = cfg if isinstance(cfg, list) else [cfg] * len(prompts)
    if len(cfgs) != len(prompts):
        raise UserError(f"{len(cfgs)} generation configs for {len(prompts)} prompts")
    from concurrent.futures import ThreadPoolExecutor, as_completed

    from moaspec.decoding.scheduler import Scheduler
    from moaspec.threads import one_thread

    if not isinstance(parallel, int) or parallel < 1:
        raise UserError(f"parallel must be a positive integer, got {parallel!r}")
    if recorders is not None and (dec.remote is not None or dec.drafter is not None):
        raise UserError("recording the target's features needs a local target and no drafter")
    scheduler = Scheduler(dec.target, own_thread=False) if dec.remote is None else None
    idle = [dec.fork(scheduler) for _ in range(min(parallel, len(prompts)))]
    forks = list(idle)

    def run(i: int) -> tuple[int, Generation | Exception]:
        fork = idle.pop()
        try:
            if recorders is None:
                return i, fork.generate(prompts[i], cfgs[i], chat=chat)
            return i, fork.record(prompts[i], cfgs[i], recorders(i), chat=chat)
        except UserError as e:  # this prompt's fault (too long, empty): the others go on
            return i, e
        finally:
            fork.release()
            idle.append(fork)

    def in_thread(i: int) -> tuple[int, Generation | Exception]:
        one_thread()
        return run(i)

    pool = None
    try:
        if scheduler is not None:  # a slot starts only with a fork free for it
            finished = scheduler.completed(run, range(len(prompts)), len(forks))
        else:
            pool = ThreadPoolExecutor(len(forks), thread_name_prefix="moaspec-gen")
            finished = as_completed([pool.submit(in_thread, i) for i in range(len(prompts))])
        for f in finished:
            yield f.result()
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
        if scheduler is not None:
            scheduler.close()  # slots still parked unwind (their forks back to `idle`) before the forks close
        for fork in forks:
            fork.close()


def _is_ids(prompt: object) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(t, int) for t in prompt)
