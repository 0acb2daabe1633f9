"""Training prompts built from text that ships on every machine: the CPython standard library's
code and docstrings, plus synthesised instructions. Deterministic for a given seed.

Evaluation sets (MT-Bench, HumanEval) must never leak in: `contaminated` checks word 8-gram
overlap against them, and `build_prompts` drops any prompt that overlaps.
"""

from __future__ import annotations

import ast
import hashlib
import random
import re
import sysconfig
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

# Standard-library modules whose code reads well as teaching material (no tests, no generated code).
SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "site-packages", "ensurepip", "pydoc_data",
             "tkinter", "msilib", "distutils", "__pycache__", "encodings"}


@dataclass(frozen=True)
class Prompt:
    id: str
    source: str  # "stdlib-explain", "stdlib-write", "synth-math", ...
    text: str


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not (set(p.relative_to(root).parts[:-1]) & SKIP_DIRS)
             and not p.name.startswith(("test_", "_"))]
    return sorted(files)


def _first_sentence(doc: str) -> str:
    s = " ".join(doc.strip().split("\n\n")[0].split())
    m = re.match(r"(.+?[.!?])(\s|$)", s)
    return (m.group(1) if m else s)[:300]


def _functions(path: Path) -> Iterable[tuple[str, ast.FunctionDef, str, str]]:
    try:
        src = path.read_text(encoding="utf-8")
        tree = ast.parse(src)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return
    module = path.stem
    lines = src.splitlines()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            doc = ast.get_docstring(node) or ""
            body = "\n".join(lines[node.lineno - 1:node.end_lineno])
            yield module, node, doc, body


STDLIB_TEMPLATES = {
    "stdlib-explain": "Explain what the Python function `{module}.{name}` does and show a short usage example.",
    "stdlib-write": "Write a Python function `{name}({args})` that {task} Include a docstring.",
    "stdlib-review": "Explain the following Python code step by step:\n\n```python\n{body}\n```",
    "stdlib-tests": "Write pytest unit tests for this function:\n\n```python\n{body}\n```",
    "stdlib-improve": "Suggest improvements to this function and show the revised code:\n\n```python\n{body}\n```",
    "stdlib-summarise": "Summarise this documentation in two sentences:\n\n{doc}",
}


def stdlib_prompts(rng: random.Random, limit: int) -> list[Prompt]:
    funcs = [f for p in _stdlib_files() for f in _functions(p)]
    rng.shuffle(funcs)
    out = []
    for module, node, doc, body in funcs:
        if len(out) >= limit:
            break
        kinds = [k for k in STDLIB_TEMPLATES if (k not in ("stdlib-write", "stdlib-summarise") or len(doc) > 40)]
        if body.count("\n") > 40:
            kinds = [k for k in kinds if k in ("stdlib-explain", "stdlib-write", "stdlib-summarise")]
        kind = rng.choice(kinds)
        args = ", ".join(a.arg for a in node.args.args)
        task = _first_sentence(doc)
        task = task[:1].lower() + task[1:] if task else ""
        text = STDLIB_TEMPLATES[kind].format(module=module, name=node.name, args=args, task=task, body=body,
                                             doc=doc.strip()[:1200])
        out.append(Prompt(_pid(kind, text), kind, text))
    return out


TOPICS = ["a lighthouse keeper", "a robot learning to paint", "the first day at a new school", "a lost umbrella",
          "a city without cars", "a cat who can read", "an old map", "a rainy market", "a mountain village",
          "a time machine that only goes forward", "a chess tournament", "a friendly dragon", "a space station garden"]
SUBJECTS = ["photosynthesis", "compound interest", "how vaccines work", "the water cycle", "binary search",
            "recursion", "TCP handshakes", "supply and demand", "plate tectonics", "the immune system",
            "hash maps", "public-key cryptography", "how a bicycle stays upright", "inflation", "gradient descent",
            "the French Revolution", "black holes", "sorting algorithms", "git branches", "unit testing",
            "SQL joins", "memory leaks", "climate and weather", "the Pythagorean theorem", "probability"]
ACTIVITIES = ["learning a new language", "staying focused while studying", "running a first marathon",
              "saving money", "writing clean code", "giving a presentation", "cooking for a large group",
              "keeping houseplants alive", "planning a trip", "debugging a program", "sleeping better"]
TEMPLATES = {
    "synth-explain": ["Explain {subject} to a 12-year-old.", "What is {subject}? Answer in one paragraph.",
                      "Give a short, precise explanation of {subject} with one example."],
    "synth-story": ["Write a short story (about 150 words) about {topic}.", "Write a poem about {topic}."],
    "synth-list": ["List {n} practical tips for {activity}.", "Give {n} common mistakes people make when {activity}."],
    "synth-compare": ["Compare {subject} and {subject2}: how are they related?"],
    "synth-email": ["Write a polite email asking a colleague for help with {activity}."],
}


def _math_problem(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 60), rng.randint(2, 40), rng.randint(2, 12)
    forms = [
        f"A shop sells pencils at {c} cents each. Mia buys {a} pencils and pays with {a * c + b} cents. "
        "How much change does she get? Explain step by step.",
        f"A tank holds {a * 10} litres and drains {b} litres per minute. How long until it is empty? Show your work.",
        f"Sam reads {c} pages a day. His book has {a * c + b} pages. After how many days does he finish it?",
        f"A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
        f"Tom has {a} marbles, gives away {min(a, b)} and then buys {c} bags of {b % 9 + 2}. How many does he have?",
    ]
    return rng.choice(forms)


def synthetic_prompts(rng: random.Random, limit: int) -> list[Prompt]:
    out = []
    while len(out) < limit:
        kind = rng.choice([*TEMPLATES, "synth-math"])
        if kind == "synth-math":
            text = _math_problem(rng)
        else:
            s1, s2 = rng.sample(SUBJECTS, 2)
            text = rng.choice(TEMPLATES[kind]).format(subject=s1, subject2=s2, topic=rng.choice(TOPICS),
                                                      activity=rng.choice(ACTIVITIES), n=rng.randint(3, 7))
        out.append(Prompt(_pid(kind, text), kind, text))
    return out


def _pid(kind: str, text: str) -> str:
    return kind + "-" + hashlib.sha1(text.encode()).hexdigest()[:12]


# ---------------------------------------------------------------- contamination
def _ngrams(text: str, n: int = 8) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def eval_texts() -> list[str]:
    """Every prompt of the benchmark task sets (MT-Bench both turns, HumanEval, and the math,
    instruction, summarisation and QA sets `moaspec bench` builds)."""
    from moaspec.bench.tasks import humaneval_prompts, load_tasks, mtbench_turns

    return [*mtbench_turns(), *humaneval_prompts(), *(t for q in load_tasks() for t in q.turns)]


class Contamination:
    def __init__(self, texts: Iterable[str], n: int = 8):
        self.n = n
        self.grams: set[tuple[str, ...]] = set()
        self.exact: set[str] = set()
        for t in texts:
            self.grams |= _ngrams(t, n)
            self.exact.add(" ".join(t.lower().split()))

    def __call__(self, text: str) -> bool:
        return " ".join(text.lower().split()) in self.exact or bool(_ngrams(text, self.n) & self.grams)


def build_prompts(n: int, seed: int, stdlib_fraction: float = 0.6, contamination: Contamination | None = None
                  ) -> list[Prompt]:
    """n distinct prompts, reproducible from the seed, with no overlap with the evaluation sets."""
    rng = random.Random(seed)
    n_std = int(n * stdlib_fraction)
    pool = stdlib_prompts(rng, n_std * 2) + synthetic_prompts(rng, (n - n_std) * 3)
    check = contamination or Contamination(eval_texts())
    seen: set[str] = set()
    std, syn = [], []
    for p in pool:
        key = " ".join(p.text.lower().split())
        if key in seen or check(p.text):
            continue
        seen.add(key)
        (std if p.source.startswith("stdlib") else syn).append(p)
    out = std[:n_std] + syn[: n - min(n_std, len(std))]
    rng.shuffle(out)
    return out[:n]
