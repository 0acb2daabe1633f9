"""Training data as compact token ids, versioned and resumable: the target's own answers to diverse
prompts, and existing text that ships on the machine.

Two sources, one format:
- "gen": prompts of the kinds the target serves (prompts.py, drawn in a random order), answered by
  the fastest engine available (generators.py: llama.cpp's batched server, else transformers), up to
  `max_new_tokens` so that answers end on their own; half greedy, half sampled.
- "text": source code and documentation of the installed packages (corpus.py) as the assistant's
  turn of a chat, so that the drafter sees the target's chat format; no generation at all.
Labels never come from here: the fp32 target's own pass over each sequence gives them at training
time (teacher forcing), so an approximate generator costs nothing in correctness.

A data folder holds `config.json`, `manifest.json` (counts, tokens, seconds, throughput) and shards
`<source>-NNNNN.npz` (token ids as uint32, offsets, prompt lengths, ids, kinds, whether the answer
ended on its own). A shard is written once and never changed, so a stopped job resumes by skipping
the ids it already holds, and git keeps the history. Train and validation split by a hash of the id.
Every sequence is checked for word 8-gram overlap with the six benchmark sets before it is kept.
"""

from __future__ import annotations

import hashlib
import json
import random
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
from tqdm import tqdm

from moaspec.contamination import Contamination
from moaspec.errors import UserError
from moaspec.files import atomic_write, atomic_write_text
from moaspec.models.store import chat_ids, resolve, weights_fingerprint
from moaspec.training import corpus
from moaspec.training.features import AnswerFeatures
from moaspec.training.prompts import FOLLOW_UPS, OPENERS, Prompt, build_prompts, eval_texts
from moaspec.training.stop import StopRequest

DATA_VERSION = 2
ENGINES = ("auto", "llama.cpp", "transformers", "moaspec")
SOURCES = ("gen", "text", "self")
SELF_USER_TOKENS = 160  # longest request the target may write for itself in self-chat
SELF_USER_TEMPERATURE = 0.8  # at 1.0 a 0.5B target drifts into mixed languages within a request
SELF_FOLLOW_UP = 0.5  # share of self-chat conversations that get a second request


@dataclass
class DataConfig:
    model: str = "smollm2-135m"
    tokens: int = 1_000_000  # distinct tokens to reach (prompts and answers, both sources)
    text_fraction: float = 0.5  # share of `tokens` from existing text
    self_fraction: float = 0.0  # share of the generated tokens from self-chat (requests the target writes)
    prompts: int = 30_000  # the pool of prompts drawn from; generation stops at the token goal
    seed: int = 0
    max_new_tokens: int = 1024
    max_prompt_tokens: int = 768
    text_chunk_chars: int = 2400  # ~600-800 tokens of code or prose per text sequence
    sampled_fraction: float = 0.5  # the rest is greedy
    temperature: float = 0.7
    val_fraction: float = 0.02
    engine: str = "auto"  # "llama.cpp", "transformers", "moaspec" or "auto" (llama.cpp where built)
    weights: str = "fp16"  # the "moaspec" engine's weight mode (the one the drafter will serve)
    features: bool = False  # the "moaspec" engine also stores the target's features of its answers
    parallel: int = 8  # requests decoded together
    threads: int = 1
    shard_tokens: int = 100_000

    def __post_init__(self) -> None:
        if (self.tokens < 1 or not 0.0 <= self.text_fraction <= 1.0 or not 0.0 <= self.self_fraction <= 1.0
                or self.max_new_tokens < 1):
            raise UserError(f"bad data config: tokens {self.tokens} >= 1, text_fraction {self.text_fraction} "
                            f"and self_fraction {self.self_fraction} in [0, 1], max_new_tokens "
                            f"{self.max_new_tokens} >= 1")
        if self.engine not in ENGINES:
            raise UserError(f"unknown engine {self.engine!r}; choose {', '.join(ENGINES)}")
        if self.features and self.engine != "moaspec":
            raise UserError("--features stores the features from the passes that write the answers: "
                            "it needs --engine moaspec")

    def folder_name(self) -> str:
        return f"{self.model}-v{DATA_VERSION}-seed{self.seed}"


@dataclass
class Sequence:
    id: str
    kind: str  # prompt kind ("code-explain", "synth-math", ...) or "text-code" / "text-doc"
    ids: list[int]
    prompt_len: int
    finished: bool = True  # the answer ended on its own (always true for text)
    mode: str = "text"  # "greedy", "sampled" or "text"


def is_val(sid: str, fraction: float) -> bool:
    return int(hashlib.sha1(sid.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF < fraction


# ---------------------------------------------------------------- shards
def write_shard(path: Path, rows: list[Sequence]) -> None:
    lengths = np.array([len(r.ids) for r in rows], dtype=np.int64)

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            np.savez_compressed(
                f, tokens=np.fromiter((t for r in rows for t in r.ids), dtype=np.uint32, count=int(lengths.sum())),
                offsets=np.concatenate([[0], np.cumsum(lengths)]),
                prompt_len=np.array([r.prompt_len for r in rows], np.int32), ids=np.array([r.id for r in rows]),
                kinds=np.array([r.kind for r in rows]), modes=np.array([r.mode for r in rows]),
                finished=np.array([r.finished for r in rows]))

    atomic_write(path, write)


def read_shard(path: Path) -> Iterator[Sequence]:
    try:
        with np.load(path) as z:
            tokens, off = z["tokens"], z["offsets"]
            for i, (sid, kind, mode) in enumerate(zip(z["ids"], z["kinds"], z["modes"], strict=True)):
                yield Sequence(str(sid), str(kind), tokens[off[i]:off[i + 1]].tolist(), int(z["prompt_len"][i]),
                               bool(z["finished"][i]), str(mode))
    except (OSError, KeyError, ValueError) as e:
        raise UserError(f"{path} is not a readable data shard ({e}): delete it and rerun `moaspec data`") from None


def shards(folder: Path, source: str | None = None) -> list[Path]:
    return sorted(p for p in Path(folder).glob(f"{source or '*'}-*.npz") if not p.name.endswith(".tmp.npz"))  # old tmp


def load(folder: str | Path, split: str | None = None, val_fraction: float | None = None) -> list[Sequence]:
    """Every sequence of a data folder, or those of one split ("train" or "val")."""
    folder = Path(folder)
    if not shards(folder):
        raise UserError(f"no training data in {folder}: run `moaspec data --model MODEL --out {folder.parent}` first")
    if val_fraction is None:
        val_fraction = json.loads((folder / "config.json").read_text())["val_fraction"]
    rows = [r for p in shards(folder) for r in read_shard(p)]
    if split is None:
        return rows
    if split not in ("train", "val"):
        raise ValueError(f"split is train or val, not {split!r}")
    return [r for r in rows if is_val(r.id, val_fraction) == (split == "val")]


class ShardWriter:
    """Buffers sequences of one source, writes a new shard every `shard_tokens` tokens, and shows the
    tokens the source holds against its goal (and the answer tokens a second written since it began)."""

    def __init__(self, folder: Path, source: str, shard_tokens: int, have: int, goal: int, desc: str,
                 features: AnswerFeatures | None = None):
        self.folder, self.source, self.shard_tokens, self.features = folder, source, shard_tokens, features
        self.rows: list[Sequence] = []
        self.have, self.answer_tokens, self.t0 = have, 0, time.time()
        self.bar = tqdm(total=goal, initial=have, desc=desc, unit="tok", unit_scale=True)

    def add(self, row: Sequence, features: tuple | None = None) -> None:
        """`features`: the target's (kv, hidden) of the row, stored beside it (before the shard that lists
        it, so a listed row's features are never missing for a stop between the two)."""
        if self.features is not None and features is not None:
            self.features.write(row.id, row.ids, *features)
        self.rows.append(row)
        self.have += len(row.ids)
        self.answer_tokens += len(row.ids) - row.prompt_len
        self.bar.update(len(row.ids))
        if sum(len(r.ids) for r in self.rows) >= self.shard_tokens:
            self.flush()

    def show_rate(self) -> None:
        self.bar.set_postfix(answer_tok_s=f"{self.answer_tokens / (time.time() - self.t0):.1f}")

    def close(self) -> None:
        self.flush()
        self.bar.close()

    def flush(self) -> None:
        if self.rows:
            n = len(shards(self.folder, self.source))
            write_shard(self.folder / f"{self.source}-{n:05d}.npz", self.rows)
            self.rows = []


@dataclass
class _Chat:
    """One self-chat conversation being built."""

    id: str
    rng: random.Random
    turns: int
    sampled: bool  # answers sampled at the config's temperature, else greedy
    messages: list[dict] = field(default_factory=list)
    sequence: Sequence | None = None  # the conversation so far, ending with the target's last answer
    features: tuple | None = None  # the target's features of `sequence` (an engine that records them)


# ---------------------------------------------------------------- building
class Builder:
    def __init__(self, cfg: DataConfig, out_root: Path):
        from moaspec.models.store import load_tokenizer

        self.cfg = cfg
        self.stop = StopRequest(listen=False)  # `run` listens for SIGTERM/SIGINT
        self.out = Path(out_root) / cfg.folder_name()
        self.out.mkdir(parents=True, exist_ok=True)
        saved = self.out / "config.json"
        if saved.exists():
            old = json.loads(saved.read_text())
            fixed = ("model", "seed", "val_fraction", "prompts")
            if any(old.get(k) != getattr(cfg, k) for k in fixed):
                raise UserError(f"{self.out} was built with {', '.join(f'{k}={old.get(k)}' for k in fixed)}: "
                                "resume it with those settings or pick another --out")
        atomic_write_text(saved, json.dumps(asdict(cfg), indent=1))
        self.folder = resolve(cfg.model)
        self.tok = load_tokenizer(self.folder)
        eos = self.tok.convert_tokens_to_ids("<|im_end|>")
        self.eos = eos if isinstance(eos, int) and eos >= 0 and eos != self.tok.unk_token_id else \
            self.tok.eos_token_id
        self.check = Contamination(eval_texts())
        self.lock = threading.Lock()
        self.done: set[str] = set()
        self.have = dict.fromkeys(SOURCES, 0)  # tokens each source holds, read once
        for source in SOURCES:
            for r in (r for p in shards(self.out, source) for r in read_shard(p)):
                self.done.add(r.id)
                self.have[source] += len(r.ids)

    def chat(self, user: str, assistant: str | None = None) -> list[int]:
        msgs = [{"role": "user", "content": user}]
        if assistant is None:
            return chat_ids(self.tok, msgs)
        return chat_ids(self.tok, [*msgs, {"role": "assistant", "content": assistant}], generation_prompt=False)

    # -------------------------------------------------------------- text
    def text_sequences(self, rng: random.Random) -> Iterator[Sequence]:
        """Chunks of code and documentation files, at most 3 per file, taking the packages in turn
        (so that transformers' 3000 files do not crowd out the rest) in a seeded random order."""
        groups: dict[str, list[corpus.Source]] = {}
        for src in [*corpus.code_files(), *corpus.doc_files()]:
            groups.setdefault(f"{src.kind}:{src.name.split('/')[0]}", []).append(src)
        for g in groups.values():
            rng.shuffle(g)
        order = sorted(groups)
        rng.shuffle(order)
        files = [g[i] for i in range(max(map(len, groups.values()))) for g in (groups[k] for k in order)
                 if i < len(g)]
        asks = {"code": ["Show the source of `{name}`{part}.", "Print the Python file `{name}`{part}.",
                         "What does `{name}` contain{part}? Show the code."],
                "doc": ["Show the documentation page `{name}`{part}.", "Print the text of `{name}`{part}."]}
        used: set[str] = set()
        for src in files:
            if src.name in used:
                continue
            used.add(src.name)
            text = corpus.read(src)
            if not text:
                continue
            parts = corpus.chunks(text, self.cfg.text_chunk_chars)
            for i in sorted(rng.sample(range(len(parts)), min(3, len(parts)))):
                body = parts[i]
                sid = f"text-{src.kind}-" + hashlib.sha1(f"{src.name}#{i}".encode()).hexdigest()[:12]
                if sid in self.done or self.check(body):
                    continue
                part = f" (part {i + 1} of {len(parts)})" if len(parts) > 1 else ""
                user = rng.choice(asks[src.kind]).format(name=src.name, part=part)
                answer = f"```python\n{body}\n```" if src.kind == "code" else body
                prompt = self.chat(user)
                ids = self.chat(user, answer)
                if ids[:len(prompt)] != prompt:  # a template that rewrites history: keep the prompt rows apart
                    continue
                yield Sequence(sid, f"text-{src.kind}", ids, len(prompt))

    def build_text(self, goal: int) -> None:
        have = self.have["text"]
        if have >= goal:
            return
        writer = ShardWriter(self.out, "text", self.cfg.shard_tokens, have, goal, "text")
        for seq in self.text_sequences(random.Random(f"text-{self.cfg.seed}")):
            writer.add(seq)
            if writer.have >= goal:
                break
        writer.close()

    # -------------------------------------------------------------- generation
    def engine(self):
        from moaspec.training.generators import LlamaServer, RuntimeGenerator, TransformersGenerator

        cfg = self.cfg
        if cfg.engine == "moaspec":
            return RuntimeGenerator(cfg.model, cfg.weights, self.eos, cfg.parallel,
                                    cfg.max_prompt_tokens + cfg.max_new_tokens + 8, features=cfg.features)
        server = _llama_server()
        if cfg.engine == "llama.cpp" and server is None:
            raise UserError("llama-server is not built: run `make llama-cpp`, or pass --engine transformers")
        if server is not None and cfg.engine != "transformers":
            from moaspec.models.store import gguf_file

            return LlamaServer(server, gguf_file(cfg.model), self.eos, cfg.parallel, cfg.threads,
                               cfg.max_prompt_tokens + cfg.max_new_tokens + 8)
        return TransformersGenerator(self.folder, self.tok, self.eos, cfg.parallel)

    def answer_features(self) -> AnswerFeatures | None:
        """Where the features the engine records are stored (`--features`)."""
        if not self.cfg.features:
            return None
        return AnswerFeatures(weights_fingerprint(self.folder), self.cfg.weights)

    def requests(self, prompts: Iterable[Prompt]):
        from moaspec.training.generators import Request

        cfg = self.cfg
        for p in prompts:
            if p.id in self.done:
                continue
            ids = self.chat(p.text)
            if len(ids) > cfg.max_prompt_tokens:
                continue
            h = int(hashlib.sha1(f"{cfg.seed}-{p.id}".encode()).hexdigest()[:8], 16)
            sampled = h / 0xFFFFFFFF < cfg.sampled_fraction
            yield Request(p.id, ids, cfg.temperature if sampled else 0.0, h % 2**31)

    def build_gen(self, goal: int, time_budget_s: float | None) -> float:
        """Answers until `goal` tokens or the time budget; returns the seconds spent generating."""
        have = self.have["gen"]
        if have >= goal:
            return 0.0
        prompts = {p.id: p for p in build_prompts(self.cfg.prompts, self.cfg.seed, contamination=self.check)}
        todo = list(self.requests(prompts.values()))
        gen = self.engine()
        writer = ShardWriter(self.out, "gen", self.cfg.shard_tokens, have, goal, f"gen ({gen.name})",
                             self.answer_features())
        t0 = time.time()
        try:
            step = self.cfg.parallel * 8  # a round of requests; the budget is checked between rounds
            for i in range(0, len(todo), step):
                if writer.have >= goal or self.stop.requested or \
                        (time_budget_s is not None and time.time() - t0 > time_budget_s):
                    break
                batch = {r.key: r for r in todo[i:i + step]}
                for a in gen.generate(list(batch.values()), self.cfg.max_new_tokens):
                    r, p = batch[a.key], prompts[a.key]
                    text = self.tok.decode(a.tokens, skip_special_tokens=True)
                    if not text.strip() or self.check(text):
                        continue
                    writer.add(Sequence(p.id, p.source, r.prompt + a.tokens, len(r.prompt), a.finished,
                                        "sampled" if r.temperature > 0 else "greedy"), a.features)
                    writer.show_rate()
                writer.flush()
        finally:
            gen.close()
            writer.close()
        return time.time() - t0

    # -------------------------------------------------------------- self-chat
    def user_prefix(self, messages: list[dict], opening: str) -> list[int]:
        """The chat so far and the opening words of the next request: the target writes the rest."""
        mark = "\x1f"
        text = self.tok.apply_chat_template([*messages, {"role": "user", "content": mark}], tokenize=False)
        return self.tok(text[:text.index(mark)] + opening, add_special_tokens=False)["input_ids"]

    def build_self(self, goal: int, time_budget_s: float | None) -> float:
        """Self-chat (Magpie-style) until `goal` tokens: the target writes a request after an opening
        (prompts.OPENERS) and answers it; for half of the conversations it writes a follow-up
        (prompts.FOLLOW_UPS) and answers that too, as the second turn of a chat. One sequence per
        conversation, its prompt everything before the last answer. `parallel` conversations run at
        once, each its own chain of requests, so that no engine slot waits for a stage of the others.
        Returns the seconds spent."""
        from concurrent.futures import ThreadPoolExecutor

        have = self.have["self"]
        if have >= goal:
            return 0.0
        gen = self.engine()
        writer = ShardWriter(self.out, "self", self.cfg.shard_tokens, have, goal, f"self-chat ({gen.name})",
                             self.answer_features())
        t0, index = time.time(), 0
        try:
            with ThreadPoolExecutor(self.cfg.parallel) as pool:
                while writer.have < goal and not self.stop.requested and \
                        (time_budget_s is None or time.time() - t0 < time_budget_s):
                    chats: list[_Chat] = []
                    while len(chats) < self.cfg.parallel * 4:  # a round; the budget is checked between rounds
                        sid = f"self-{self.cfg.seed}-{index:07d}"
                        index += 1
                        if sid not in self.done:
                            rng = random.Random(sid)
                            chats.append(_Chat(sid, rng, 2 if rng.random() < SELF_FOLLOW_UP else 1,
                                               rng.random() < self.cfg.sampled_fraction))
                    for c in pool.map(lambda c: self.converse(gen, c), chats):
                        if c.sequence is not None:
                            writer.add(c.sequence, c.features)
                    writer.show_rate()
                    writer.flush()
        finally:
            gen.close()
            writer.close()
        return time.time() - t0

    def converse(self, gen, c: _Chat) -> _Chat:
        """Up to `c.turns` turns of one chat: a request the target writes, then its answer; stops at the
        first request or answer that is cut, too short or overlaps a benchmark."""
        from moaspec.training.generators import Request

        cfg = self.cfg
        for turn in range(1, c.turns + 1):
            opening = c.rng.choice(OPENERS if turn == 1 else FOLLOW_UPS)
            with self.lock:  # a fast tokenizer is not safe to share between threads
                ask = Request(c.id, self.user_prefix(c.messages, opening), SELF_USER_TEMPERATURE,
                              c.rng.randrange(2**31))
            (a,) = gen.generate([ask], SELF_USER_TOKENS)
            with self.lock:
                request = (opening + self.tok.decode(a.tokens, skip_special_tokens=True)).strip()
                prompt = chat_ids(self.tok, [*c.messages, {"role": "user", "content": request}])
            if not a.finished or len(request.split()) < 4 or self.check(request) or len(prompt) > cfg.max_prompt_tokens:
                break
            (a,) = gen.generate([Request(c.id, prompt, cfg.temperature if c.sampled else 0.0,
                                         c.rng.randrange(2**31))], cfg.max_new_tokens)
            with self.lock:
                text = self.tok.decode(a.tokens, skip_special_tokens=True)
            if not text.strip() or self.check(text):
                break
            c.messages += [{"role": "user", "content": request}, {"role": "assistant", "content": text}]
            c.sequence = Sequence(c.id, f"self-chat{turn}", prompt + a.tokens, len(prompt), a.finished,
                                  "sampled" if c.sampled else "greedy")
            c.features = a.features
            if not a.finished:  # a cut answer gets no follow-up
                break
        return c

    def run(self, time_budget_s: float | None = None) -> dict:
        """Build to the goal. SIGTERM/SIGINT stop it after the current round of answers, written: the same
        command resumes (`stopped` in the returned manifest)."""
        cfg = self.cfg
        t0 = time.time()
        self.stop = StopRequest()
        try:
            self.build_text(int(cfg.tokens * cfg.text_fraction))
            text_s = time.time() - t0
            left = None if time_budget_s is None else max(0.0, time_budget_s - text_s)
            generated = cfg.tokens - int(cfg.tokens * cfg.text_fraction)
            own = int(generated * cfg.self_fraction)
            gen_s = self.build_gen(generated - own, left)
            left = None if left is None else max(0.0, left - gen_s)
            gen_s += self.build_self(own, left)
        finally:
            self.stop.restore()
        with (self.out / "build_log.jsonl").open("a") as f:
            f.write(json.dumps({"text_seconds": round(text_s, 1), "gen_seconds": round(gen_s, 1),
                                "engine": cfg.engine, "threads": cfg.threads, "parallel": cfg.parallel,
                                "stopped": self.stop.requested}) + "\n")
        return {**finalise(self.out), "stopped": self.stop.requested}


def texts(folder: str | Path) -> Iterator[str]:
    """Every sequence of a data folder as text (prompt and answer), decoded with its target's tokenizer."""
    from moaspec.models.store import load_tokenizer

    folder = Path(folder)
    if not shards(folder) or not (folder / "config.json").is_file():
        raise UserError(f"{folder} holds no data shards: is it a `moaspec data` folder?")
    tok = load_tokenizer(resolve(json.loads((folder / "config.json").read_text())["model"]))
    for path in shards(folder):
        rows = list(read_shard(path))
        yield from tok.batch_decode([r.ids for r in rows], skip_special_tokens=True)


def answers(folder: str | Path, model: str, sources: Iterable[str] = ("gen",), context: int = 2) -> Iterator[list[int]]:
    """The answers of a data folder for `model`, each with the last `context` prompt tokens (the chat
    template's opening of the answer), so that a datastore can draft an answer's first tokens too."""
    folder = Path(folder)
    try:
        have = json.loads((folder / "config.json").read_text())["model"]
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(f"{folder} is not a `moaspec data` folder (no readable config.json)") from None
    if have != model:
        raise UserError(f"{folder} holds data for {have}, not {model}")
    sources = list(dict.fromkeys(sources))
    bad = [s for s in sources if s not in SOURCES]
    if bad or not sources:
        raise UserError(f"unknown data source(s) {', '.join(bad) or '(none given)'}; choose among {', '.join(SOURCES)}")
    empty = [s for s in sources if not shards(folder, s)]
    if empty:
        raise UserError(f"{folder} holds no {', '.join(empty)} shards; choose among the sources it has")
    for source in sources:
        for path in shards(folder, source):
            for r in read_shard(path):
                yield r.ids[max(0, r.prompt_len - context):]


def _llama_server() -> Path | None:
    from moaspec.llamacpp import bin_dir

    path = bin_dir() / "llama-server"
    return path if path.is_file() else None


def finalise(out: Path) -> dict:
    """Count what the folder holds and write the manifest."""
    cfg = DataConfig(**{k: v for k, v in json.loads((out / "config.json").read_text()).items()
                        if k in {f.name for f in fields(DataConfig)}})
    rows = load(out)
    logs = [json.loads(x) for x in (out / "build_log.jsonl").read_text().splitlines()] \
        if (out / "build_log.jsonl").exists() else []
    per: dict[str, dict] = {}
    for r in rows:
        split = "val" if is_val(r.id, cfg.val_fraction) else "train"
        d = per.setdefault(r.kind.split("-")[0] if r.kind.startswith(("text", "self")) else "gen", {})
        for k, v in ((f"{split}_sequences", 1), (f"{split}_tokens", len(r.ids)),
                     (f"{split}_answer_tokens", len(r.ids) - r.prompt_len), ("finished", int(r.finished))):
            d[k] = d.get(k, 0) + v
    total = sum(len(r.ids) for r in rows)
    gen_s = sum(x["gen_seconds"] for x in logs)
    manifest = {
        "version": DATA_VERSION, "model": cfg.model, "target_fingerprint": weights_fingerprint(resolve(cfg.model)),
        "seed": cfg.seed, "tokens": total, "goal": cfg.tokens, "complete": total >= cfg.tokens, "sources": per,
        "kinds": dict(sorted(Counter(r.kind for r in rows).items())),
        "generation_seconds": round(gen_s, 1),
        "answer_tokens_per_s": round(sum(v for src in ("gen", "self") for k, v in per.get(src, {}).items()
                                         if k.endswith("answer_tokens")) / gen_s, 1) if gen_s else None,
    }
    atomic_write_text(out / "manifest.json", json.dumps(manifest, indent=1))
    return manifest
