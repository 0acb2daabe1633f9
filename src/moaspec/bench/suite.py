"""`moaspec bench`: the paper's table (arXiv 2410.03804, section 7) on this machine, next to the peers a user
would otherwise pick.

Every method answers every question in turn (interleaved per question, so machine drift hits all
alike) on one loaded copy of the target. Each answer starts cold, as a peer's fresh process does: every
turn prefills its whole prompt (no KV cache kept from another method, question or turn) and every
(method, question, temperature) gets a drafter built afresh (no suffix history, Token Recycling table or
adaptive tree state learnt from other answers). Answers go to FastChat-style JSON lines, one file per
method and temperature (`bench.answers`), which are the record: the report (`bench.report`) is
computed from them alone, and an interrupted run resumes from them.

Methods:
- `plain`: this runtime, no drafter (the speedup reference); `hf`: transformers `generate`;
  `hf-assisted`: transformers assisted generation with the target's default draft model;
  `llama.cpp`, `llama.cpp-spec` and `llama.cpp-lookup`: llama.cpp on the shipped GGUF, plain, with its
  prompt-lookup decoding (`llama-lookup`), and with the default draft
  model (`moaspec.llamacpp`; optional, built by `make llama-cpp`);
- engine drafters `lookup`, `suffix`, `model` (a same-tokenizer draft LM), and the trained `independent`,
  `eagle`, `moa`, `moa-n1`, `moa-n3` loaded from checkpoint folders named so;
- `hybrid` and `hybrid-merge`: the suffix drafter with the `moa` checkpoint, policies switch and merge;
- `recycling` (Token Recycling: the target's own top-k, training-free) and `hybrid-recycling` (the suffix
  drafter with it, policy switch).
"""

from __future__ import annotations

import copy
import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from moaspec import llamacpp
from moaspec.bench import report
from moaspec.bench.answers import answer_path, read_answers
from moaspec.decoding.engine import Engine, GenerationConfig
from moaspec.decoding.sampling import SamplingParams
from moaspec.decoding.tree import PAPER_GPU_TREE, TreeConfig, split_min_prob
from moaspec.drafters import DEFAULT_DRAFT_MODEL, drafter_kind, resolve_auto, shipped_checkpoint
from moaspec.errors import UserError
from moaspec.models.store import MODELS, gguf_file
from moaspec.pipeline import SpecDecoder
from moaspec.tasks import Question, load_tasks

PEERS = ("hf", "hf-assisted", "llama.cpp", "llama.cpp-spec", "llama.cpp-lookup")
TRAINED_METHODS = ("independent", "eagle", "moa", "moa-n1", "moa-n3")
HYBRID_METHODS = {"hybrid": "switch", "hybrid-merge": "merge"}  # suffix + the moa checkpoint, by policy
METHODS = ("plain", *PEERS, "lookup", "suffix", "suffix-nostore", "recycling", "hybrid-recycling", "model",
           *TRAINED_METHODS, *HYBRID_METHODS)
# Candidate trees of the sweep: chains, small CPU trees, and the paper's GPU default for contrast.
SWEEP_TREES = (TreeConfig(1, 1, 1), TreeConfig(2, 1, 2), TreeConfig(3, 1, 3), TreeConfig(4, 1, 4),
               TreeConfig(5, 1, 5), TreeConfig(3, 2, 4), TreeConfig(4, 2, 6), TreeConfig(4, 4, 6),
               TreeConfig(5, 4, 8), TreeConfig(6, 4, 12), PAPER_GPU_TREE, TreeConfig.parse("adaptive"),
               TreeConfig.parse("adaptive:8x2"))


@dataclass
class BenchConfig:
    model: str = "qwen2.5-coder-0.5b"
    methods: tuple[str, ...] = ()  # empty: plain, hf, lookup and every trained drafter that exists
    tasks: tuple[str, ...] = ()  # empty: all task sets
    questions: int | None = None  # per task; None: the whole set
    max_new_tokens: int = 256
    temperatures: tuple[float, ...] = (0.0, 1.0)
    tree: str = "auto"  # "auto" (calibrated), "sweep" (best measured per method) or "depth,topk,total";
    # "auto", "adaptive[:depth]" and "depth,topk,total" take "@P" for TreeConfig.min_prob
    checkpoints: str | None = None  # folder of <method>/ checkpoints; default: those shipped for the model
    weights: str = "auto"  # the CLI's default: the fastest mode at the model's own quality
    out: str = "bench-out"
    seed: int = 0
    sweep_questions: int = 4
    sweep_tokens: int = 64
    sampled_drafts: bool = True  # at T > 0: drafts drawn from the drafter's q (False: its top-k)

    @classmethod
    def quick(cls, **kw) -> BenchConfig:
        """A pass over every task and method in minutes: 1 question per task, 64 tokens, T=0."""
        return cls(**{"questions": 1, "max_new_tokens": 64, "temperatures": (0.0,), **kw})


@dataclass(frozen=True)
class Method:
    name: str
    drafter: str = "none"  # engine drafter name, or a peer name
    path: str | None = None
    draft_model: str | None = None
    policy: str = "switch"  # of a hybrid drafter
    hybrid_model: str = "moa"  # the model drafter of a hybrid
    datastore: str | None = None  # of a suffix or hybrid drafter: None = the shipped one, "none" = none


def checkpoint_dir(cfg: BenchConfig, method: str) -> Path:
    if cfg.checkpoints:
        return Path(cfg.checkpoints) / method
    return shipped_checkpoint(method, cfg.model)


def resolve_methods(cfg: BenchConfig) -> tuple[list[Method], list[str]]:
    """The methods to run (plain first: it is the reference) and notes on the ones left out."""
    notes: list[str] = []
    # by default: the drafter `--drafter auto` runs for this target (the user's default) among the others
    names = list(cfg.methods) or ["plain", "hf", "lookup", resolve_auto(cfg.model), *TRAINED_METHODS]
    pair = cfg.model in DEFAULT_DRAFT_MODEL and DEFAULT_DRAFT_MODEL[cfg.model] != cfg.model
    if pair and not cfg.methods:
        names[2:2] = ["hf-assisted", "model"]
    if not cfg.methods and cfg.model in MODELS:  # llama.cpp joins by default where it is built
        if why := llamacpp.missing():
            notes.append(f"llama.cpp peers left out: {why}")
        else:
            names[2:2] = ["llama.cpp", *(["llama.cpp-spec"] if pair else []),
                          *(["llama.cpp-lookup"] if llamacpp.missing((llamacpp.LOOKUP,)) is None else [])]
    bad = [n for n in names if n not in METHODS]
    if bad:
        raise UserError(f"unknown method(s) {', '.join(bad)}; choose among {', '.join(METHODS)}")
    names = ["plain"] + [n for n in dict.fromkeys(names) if n != "plain"]
    out = []
    for n in names:
        if n in HYBRID_METHODS:
            folder = checkpoint_dir(cfg, "moa")
            if not (folder / "config.json").exists():
                raise UserError(f"method {n} needs a moa checkpoint at {folder}; train one with `moaspec train "
                                f"--model {cfg.model} --kind moa ...` or pass --checkpoints DIR")
            out.append(Method(n, "hybrid", str(folder), policy=HYBRID_METHODS[n]))
            continue
        if n in TRAINED_METHODS:
            folder = checkpoint_dir(cfg, n)
            if not (folder / "config.json").exists():
                if cfg.methods:
                    raise UserError(f"method {n}: no checkpoint at {folder}; train it with `moaspec train --model "
                                    f"{cfg.model} --kind {drafter_kind(n)} ...` or pass --checkpoints DIR")
                notes.append(f"{n}: no checkpoint at {folder}")
                continue
            out.append(Method(n, drafter_kind(n), str(folder)))
            continue
        if n.startswith("llama.cpp"):
            why = llamacpp.missing((llamacpp.LOOKUP,) if n == "llama.cpp-lookup" else (llamacpp.PLAIN, llamacpp.SPEC))
            if why is None and cfg.model not in MODELS:
                why = f"it reads the shipped GGUF of a known model, not {cfg.model}"
            if why:
                raise UserError(f"method {n}: {why}")
        if n in ("model", "hf-assisted", "llama.cpp-spec"):
            draft = DEFAULT_DRAFT_MODEL.get(cfg.model)
            if draft is None or draft == cfg.model:
                raise UserError(f"{n} needs a draft model for {cfg.model!r}; known pairs: {DEFAULT_DRAFT_MODEL}")
            out.append(Method(n, "model" if n == "model" else n, draft_model=draft))
        elif n == "suffix-nostore":
            out.append(Method(n, "suffix", datastore="none"))
        elif n == "hybrid-recycling":
            out.append(Method(n, "hybrid", hybrid_model="recycling"))
        else:
            out.append(Method(n, "none" if n == "plain" else n))
    return out, notes


@dataclass
class TurnResult:
    text: str
    token_ids: list[int] | None  # None: a peer that reports counts only (llama.cpp)
    wall_time: float
    accept_lengths: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0
    prefill_s: float = 0.0
    cached_tokens: int = 0  # prompt tokens found in a KV cache instead of prefilled (0: a cold start)
    prompt_tokens: int = 0  # the prompt's length as this method read it (a peer's own count)
    new_tokens: int = 0
    target_calls: int = 0  # forward passes of the target after prefill (0: not reported)
    drafted_tokens: int = 0  # draft nodes sent to verification

    def __post_init__(self):
        if self.token_ids is not None:
            self.new_tokens = len(self.token_ids)
        if self.accept_lengths:
            self.target_calls = len(self.accept_lengths)


class Bench:
    """One loaded target, its engines per method, and the peers, answering questions."""

    def __init__(self, cfg: BenchConfig, methods: list[Method], trees: dict[str, TreeConfig] | None = None):
        self.cfg = cfg
        self.methods = methods
        self.dec = SpecDecoder(cfg.model, drafter="none", weights=cfg.weights)
        self.trees: dict[str, TreeConfig | None] = {}
        for m in methods:
            if m.name not in PEERS:  # the tree `auto` resolves to, once: every fresh drafter then takes it
                self.trees[m.name] = self.fresh_engine(m, (trees or {}).get(m.name) or self._tree()).tree
        self._hf = None
        self._assistant = None
        self._ggufs: dict[str, Path] = {}

    def fresh_engine(self, method: Method, tree: TreeConfig | str | None = None) -> Engine:
        """An engine with a drafter built afresh for `method` (nothing learnt from earlier answers), over
        the one loaded target; `tree` defaults to the method's resolved tree."""
        tree = self.trees.get(method.name) if tree is None else tree
        self.dec.set_drafter(method.drafter, draft_model=method.draft_model, drafter_path=method.path, tree=tree,
                             hybrid_model=method.hybrid_model, hybrid_policy=method.policy, datastore=method.datastore)
        return self.dec.engine

    def _tree(self) -> TreeConfig | str:
        if self.cfg.tree == "sweep":
            return "auto"
        return self.cfg.tree if split_min_prob(self.cfg.tree)[0] == "auto" else TreeConfig.parse(self.cfg.tree)

    # ---------------------------------------------------------------- one answer
    def answer(self, method: Method, q: Question, temperature: float, max_new_tokens: int | None = None,
               turns: int | None = None, tree: TreeConfig | None = None) -> list[TurnResult]:
        """All turns of a question; a later turn sees this method's own earlier answers in its prompt, but
        prefills it cold. `tree` overrides the method's own (the sweep's trees)."""
        engine = None if method.name in PEERS else self.fresh_engine(method, tree)
        messages: list[dict] = []
        out = []
        for i, turn in enumerate(q.turns[:turns]):
            messages.append({"role": "user", "content": turn})
            seed = int(hashlib.sha1(f"{q.id}|{i}|{self.cfg.seed}".encode()).hexdigest()[:8], 16)
            gen = GenerationConfig(max_new_tokens=max_new_tokens or self.cfg.max_new_tokens,
                                   sampling=SamplingParams(temperature=temperature, seed=seed),
                                   sampled_drafts=self.cfg.sampled_drafts)
            ids = self.dec.encode(messages)
            if method.name.startswith("llama.cpp"):
                r = self._llama_cpp(method, ids, gen)
            elif method.name in PEERS:
                r = self._peer(method, ids, gen)
            else:
                r = self._engine(engine, ids, gen)
            out.append(r)
            messages.append({"role": "assistant", "content": r.text})
        return out

    def _engine(self, engine: Engine, ids: list[int], gen: GenerationConfig) -> TurnResult:
        self.dec.engine = engine
        self.dec.target.reset()  # a cold start: the whole prompt is prefilled, as by a peer's new process
        g = self.dec.generate(ids, gen)
        m = g.metrics
        return TurnResult(g.text, g.token_ids, m.total_s, list(m.accept_lengths), m.draft_s, m.verify_s, m.prefill_s,
                          cached_tokens=m.cached_tokens, prompt_tokens=len(ids), drafted_tokens=m.drafted_tokens)

    def _llama_cpp(self, method: Method, ids: list[int], gen: GenerationConfig) -> TurnResult:
        """llama.cpp on the same rendered prompt (special tokens kept as text, which it parses back)."""
        gguf = self._gguf(self.cfg.model)
        bos = self.dec.tokenizer.bos_token_id
        text_ids = ids[1:] if ids and ids[0] == bos and llamacpp.adds_bos(gguf) else ids  # it adds its own
        prompt = self.dec.tokenizer.decode(text_ids, skip_special_tokens=False)
        draft = self._gguf(method.draft_model) if method.draft_model else None
        lookup = method.name == "llama.cpp-lookup"
        a = llamacpp.generate(prompt, gguf, gen.max_new_tokens, gen.sampling.temperature, gen.sampling.seed or 0,
                              draft_gguf=draft, threads=torch.get_num_threads(), lookup=lookup, prompt_tokens=len(ids))
        calls = a.new_tokens - a.accepted if draft or lookup else a.new_tokens
        return TurnResult(a.text, None, a.prompt_s + a.decode_s, prefill_s=a.prompt_s, new_tokens=a.new_tokens,
                          target_calls=calls, prompt_tokens=a.prompt_tokens)

    def _gguf(self, model: str) -> Path:
        """The checked GGUF of a model, looked up once per run (the lookup reads package metadata)."""
        if model not in self._ggufs:
            self._ggufs[model] = gguf_file(model)
        return self._ggufs[model]

    def _peer(self, method: Method, ids: list[int], gen: GenerationConfig) -> TurnResult:
        from moaspec.models.store import reference_model, resolve

        if self._hf is None:
            self._hf = reference_model(self.dec.folder)
        kw = {}
        if method.name == "hf-assisted":
            if self._assistant is None:
                self._assistant = reference_model(resolve(method.draft_model))
                self._assistant_config = copy.deepcopy(self._assistant.generation_config)
            # its heuristic schedule tunes the draft length in the assistant's config across calls: each
            # answer starts from the default, as every engine drafter starts afresh
            self._assistant.generation_config = copy.deepcopy(self._assistant_config)
            kw["assistant_model"] = self._assistant
        t = gen.sampling.temperature
        if t > 0:
            torch.manual_seed(gen.sampling.seed or 0)
            kw.update(do_sample=True, temperature=t, top_k=0, top_p=1.0)
        else:
            kw.update(do_sample=False, temperature=None, top_k=None, top_p=None)
        eos = list(self.dec.target.cfg.eos_token_ids)
        x = torch.tensor([ids])
        start = time.perf_counter()
        with torch.inference_mode():
            y = self._hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=gen.max_new_tokens,
                                  eos_token_id=eos, pad_token_id=eos[0], **kw)
        wall = time.perf_counter() - start
        new = y[0, len(ids):].tolist()
        cut = next((i for i, tok in enumerate(new) if tok in eos), len(new))
        new = new[:cut]
        return TurnResult(self.dec.tokenizer.decode(new, skip_special_tokens=True), new, wall, prompt_tokens=len(ids))

    # ---------------------------------------------------------------- the tree sweep
    def sweep(self, questions: list[Question], trees: tuple[TreeConfig, ...] = SWEEP_TREES) -> dict:
        """tokens/s of every (method, tree) over a few first turns at T=0, interleaved per question
        against plain decoding; the best tree per method. Adaptive trees wider than a chain only for
        drafters whose siblings come from one draft step (`Drafter.branching`)."""
        cands = {m.name: m for m in self.methods if m.name not in PEERS and m.name != "plain"}
        keys = []
        for name, m in cands.items():
            for tree in trees:
                if not tree.adaptive or tree.topk == 1 or self.fresh_engine(m, tree).drafter.branching:
                    keys.append((name, tree))
        plain = Method("plain")
        tok = {k: 0 for k in keys} | {("plain", None): 0}
        secs = dict.fromkeys(tok, 0.0)
        taus: dict = {k: [] for k in keys}
        for q in tqdm(questions, desc="tree sweep", unit="question"):
            r = self.answer(plain, q, 0.0, self.cfg.sweep_tokens, turns=1)[0]
            tok[("plain", None)] += r.new_tokens
            secs[("plain", None)] += r.wall_time
            for key in keys:
                r = self.answer(cands[key[0]], q, 0.0, self.cfg.sweep_tokens, turns=1, tree=key[1])[0]
                tok[key] += r.new_tokens
                secs[key] += r.wall_time
                taus[key] += r.accept_lengths
        base = tok[("plain", None)] / secs[("plain", None)]
        rows = [{"method": name, "tree": asdict(tree), "tokens_per_s": round(tok[(name, tree)] / secs[(name, tree)], 3),
                 "speedup": round(tok[(name, tree)] / secs[(name, tree)] / base, 3),
                 "tau": round(sum(taus[(name, tree)]) / max(1, len(taus[(name, tree)])), 3)}
                for name, tree in keys]
        best = {name: max((r for r in rows if r["method"] == name), key=lambda r: r["tokens_per_s"])["tree"]
                for name in cands}
        return {"plain_tokens_per_s": round(base, 3), "rows": rows, "best": best}


# -------------------------------------------------------------------- answer files
def answer_record(model: str, method: str, q: Question, turns: list[TurnResult], tree: TreeConfig | None) -> dict:
    """One FastChat-style answer line (plus the token ids, which the T=0 identity check reads)."""
    return {
        "question_id": q.id, "category": q.task, "model_id": f"{model}:{method}",
        "answer_id": hashlib.sha1(f"{model}|{method}|{q.id}".encode()).hexdigest()[:16],
        "tree": asdict(tree) if tree else None,
        "choices": [{
            "index": 0,
            "turns": [t.text for t in turns],
            "token_ids": [t.token_ids for t in turns],
            "new_tokens": [t.new_tokens for t in turns],
            "target_calls": [t.target_calls for t in turns],
            "drafted_tokens": [t.drafted_tokens for t in turns],
            "wall_time": [round(t.wall_time, 4) for t in turns],
            "prefill_time": [round(t.prefill_s, 4) for t in turns],
            "cached_tokens": [t.cached_tokens for t in turns],
            "prompt_tokens": [t.prompt_tokens for t in turns],
            "draft_time": [round(t.draft_s, 4) for t in turns],
            "verify_time": [round(t.verify_s, 4) for t in turns],
            "accept_lengths": [t.accept_lengths for t in turns],
        }],
        "tstamp": time.time(),
    }


def run(cfg: BenchConfig) -> Path:
    """Answer every question with every method (resuming from existing answer files), then write the
    report. Returns the report path."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    methods, notes = resolve_methods(cfg)
    questions = load_tasks(list(cfg.tasks) or None, cfg.questions, cfg.seed)
    meta = {"config": asdict(cfg), "notes": notes, "threads": torch.get_num_threads(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    bench = Bench(cfg, methods)
    if cfg.tree == "sweep":
        old = json.loads((out / "meta.json").read_text()) if (out / "meta.json").exists() else {}
        meta["sweep"] = old.get("sweep") or bench.sweep(_spread(questions, cfg.sweep_questions))
        bench = Bench(cfg, methods, {k: TreeConfig(**v) for k, v in meta["sweep"]["best"].items()})
    meta["trees"] = {k: asdict(v) if v else None for k, v in bench.trees.items()}
    meta["methods"] = [m.name for m in methods]
    meta["config"]["weights"] = bench.dec.target.weights  # what `auto` resolved to
    (out / "meta.json").write_text(json.dumps(meta, indent=1))

    done = {(m.name, t): read_answers(answer_path(out, m.name, t)) for m in methods for t in cfg.temperatures}
    todo = [(q, t) for t in cfg.temperatures for q in questions
            if any(q.id not in done[(m.name, t)] for m in methods)]
    bar = tqdm(total=len(todo) * len(methods), desc=f"bench {cfg.model}", unit="answer")
    for q, t in todo:
        for m in methods:  # interleaved per question
            bar.set_postfix_str(f"{q.task} T={t:g} {m.name}")
            if q.id not in done[(m.name, t)]:
                rec = answer_record(cfg.model, m.name, q, bench.answer(m, q, t), bench.trees.get(m.name))
                path = answer_path(out, m.name, t)
                path.parent.mkdir(parents=True, exist_ok=True)
                with path.open("a") as f:
                    f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            bar.update(1)
    bar.close()
    return report.write(out)


def _spread(questions: list[Question], n: int) -> list[Question]:
    """n questions taken round-robin over the tasks, so a short sweep sees every kind of text."""
    by_task: dict[str, list[Question]] = {}
    for q in questions:
        by_task.setdefault(q.task, []).append(q)
    picked, i = [], 0
    while len(picked) < n and any(i < len(v) for v in by_task.values()):
        picked += [v[i] for v in by_task.values() if i < len(v)][: n - len(picked)]
        i += 1
    return picked
