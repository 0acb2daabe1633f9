"""Training prompts of the kinds the target serves: code (explain, write, complete, review, test,
improve) over the standard library's and the installed packages' functions, summaries of and
questions over documentation passages, instructions with format rules, explanations, stories, lists
and math word problems. Deterministic for a given seed, and drawn in a random order.

Evaluation sets (MT-Bench, HumanEval, the benchmark's synthesised sets) must never leak in:
`Contamination` checks word 8-gram overlap against them, and `build_prompts` drops any prompt that
overlaps. The templates here are worded apart from the benchmark's own.
"""

from __future__ import annotations

import ast
import hashlib
import random
import re
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass

from moaspec.contamination import Contamination
from moaspec.training import corpus

__all__ = ["Contamination", "Prompt", "build_prompts", "eval_texts"]


@dataclass(frozen=True)
class Prompt:
    id: str
    source: str  # "stdlib-explain", "stdlib-write", "doc-qa", "synth-math", ...
    text: str


def _first_sentence(doc: str) -> str:
    s = " ".join(doc.strip().split("\n\n")[0].split())
    m = re.match(r"(.+?[.!?])(\s|$)", s)
    return (m.group(1) if m else s)[:300]


def _functions(src: corpus.Source) -> Iterator[tuple[str, ast.FunctionDef, str, str]]:
    """Public functions and methods of one file: (dotted name, node, docstring, source)."""
    text = corpus.read(src)
    if text is None:
        return
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return
    module = src.name.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
    lines = text.splitlines()
    scopes: list[tuple[str, ast.AST]] = [(module, tree)]
    for scope, parent in scopes:
        for node in getattr(parent, "body", []):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_") and scope == module:
                scopes.append((f"{module}.{node.name}", node))
            elif isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                body = textwrap.dedent("\n".join(lines[node.lineno - 1:node.end_lineno]))
                yield f"{scope}.{node.name}", node, ast.get_docstring(node) or "", body


CODE_TEMPLATES = {
    "code-explain": "Explain what the Python function `{qualname}` does and show a short usage example.",
    "code-write": "Write a Python function `{name}({args})` that {task} Include a docstring.",
    "code-complete": "Implement the body of this function:\n\n```python\n{stub}\n```",
    "code-review": "Explain the following Python code step by step:\n\n```python\n{body}\n```",
    "code-tests": "Write pytest unit tests for this function:\n\n```python\n{body}\n```",
    "code-improve": "Suggest improvements to this function and show the revised code:\n\n```python\n{body}\n```",
    "code-document": "Add type hints and a docstring to this function:\n\n```python\n{body}\n```",
    "code-summarise": "Summarise this documentation in two sentences:\n\n{doc}",
}


def _stub(node: ast.FunctionDef, doc: str) -> str:
    """The function's signature and docstring only, as in a programming exercise."""
    stub = ast.FunctionDef(name=node.name, args=node.args, body=[ast.Expr(ast.Constant(doc))], decorator_list=[],
                           returns=node.returns)
    return ast.unparse(ast.fix_missing_locations(stub))


def code_prompts(rng: random.Random, limit: int) -> list[Prompt]:
    """Prompts over functions drawn at random from the standard library and the installed packages."""
    files = list(corpus.code_files())
    rng.shuffle(files)
    out: list[Prompt] = []
    for src in files:
        if len(out) >= limit:
            break
        funcs = list(_functions(src))
        for qualname, node, doc, body in rng.sample(funcs, min(2, len(funcs))):
            lines = body.count("\n") + 1
            if lines < 3:
                continue
            kinds = ["code-explain"]
            if len(doc) > 40:
                kinds += ["code-write", "code-complete", "code-summarise"]
            if lines <= 40:
                kinds += ["code-review", "code-tests", "code-improve"]
                if not doc:
                    kinds.append("code-document")
            kind = rng.choice(kinds)
            task = _first_sentence(doc)
            task = task[:1].lower() + task[1:] if task else ""
            text = CODE_TEMPLATES[kind].format(
                qualname=qualname, name=node.name, args=", ".join(a.arg for a in node.args.args), task=task,
                body=body, stub=_stub(node, doc) if doc else "", doc=doc.strip()[:1200])
            out.append(Prompt(_pid(kind, text), kind, text))
    return out[:limit]


DOC_TEMPLATES = {
    "doc-summarise": ["Summarise this passage in {n} sentences:\n\n{text}",
                      "What is the main point of the following text? Answer briefly.\n\n{text}",
                      "Write a one-paragraph summary of this text for a busy reader:\n\n{text}",
                      "Turn this passage into {n} short bullet points:\n\n{text}"],
    "doc-qa": ["Read the text and answer the question.\n\nText: {text}\n\nQuestion: What does the text say "
               "about {term}?",
               "{text}\n\nBased only on the text above, explain what {term} refers to.",
               "Here is a passage:\n\n{text}\n\nWhy does the passage mention {term}? Quote the relevant part."],
}


def _term(rng: random.Random, text: str) -> str | None:
    """A term the passage quotes or names, for a question about it."""
    quoted = re.findall(r"[`'\"]{1,2}([^`'\"]{3,40})[`'\"]{1,2}", text)
    named = re.findall(r"(?<=[a-z,;] )([A-Z][A-Za-z0-9_]{3,}(?: [A-Z][A-Za-z0-9_]+)*)", text)
    pool = quoted or named
    return rng.choice(pool) if pool else None


def doc_prompts(rng: random.Random, limit: int) -> list[Prompt]:
    """Summaries of and questions over prose paragraphs from documentation files."""
    files = list(corpus.doc_files())
    rng.shuffle(files)
    out: list[Prompt] = []
    for src in files:
        if len(out) >= limit:
            break
        paras = list(corpus.prose_paragraphs(corpus.read(src) or ""))
        for para in rng.sample(paras, min(3, len(paras))):
            kind = rng.choice(list(DOC_TEMPLATES))
            term = _term(rng, para)
            if kind == "doc-qa" and term is None:
                kind = "doc-summarise"
            text = rng.choice(DOC_TEMPLATES[kind]).format(text=para, term=term, n=rng.randint(2, 4))
            out.append(Prompt(_pid(kind, text), kind, text))
    return out[:limit]


TOPICS = ["a lighthouse keeper", "a robot learning to paint", "the first day at a new school", "a lost umbrella",
          "a city without cars", "a cat who can read", "an old map", "a rainy market", "a mountain village",
          "a time machine that only goes forward", "a chess tournament", "a friendly dragon", "a space station garden",
          "a night train", "a bakery at dawn", "two rival gardeners", "a forgotten password", "a museum after closing",
          "a snowed-in cabin", "a detective who hates coffee", "a message in a bottle"]
SUBJECTS = ["photosynthesis", "compound interest", "how vaccines work", "the water cycle", "binary search",
            "recursion", "TCP handshakes", "supply and demand", "plate tectonics", "the immune system",
            "hash maps", "public-key cryptography", "how a bicycle stays upright", "inflation", "gradient descent",
            "the French Revolution", "black holes", "sorting algorithms", "git branches", "unit testing",
            "SQL joins", "memory leaks", "climate and weather", "the Pythagorean theorem", "probability",
            "regular expressions", "virtual memory", "REST APIs", "the Doppler effect", "DNA replication",
            "opportunity cost", "Big-O notation", "garbage collection", "neural networks", "the greenhouse effect",
            "database indexes", "version control", "caching", "floating-point numbers", "the stock market"]
ACTIVITIES = ["learning a new language", "staying focused while studying", "running a first marathon",
              "saving money", "writing clean code", "giving a presentation", "cooking for a large group",
              "keeping houseplants alive", "planning a trip", "debugging a program", "sleeping better",
              "reviewing a pull request", "learning to draw", "starting a vegetable garden", "moving to a new city",
              "preparing for a job interview", "writing documentation"]
TEMPLATES = {
    "synth-explain": ["Explain {subject} to a 12-year-old.", "What is {subject}? Answer in one paragraph.",
                      "Give a short, precise explanation of {subject} with one example."],
    "synth-story": ["Write a short story (about 150 words) about {topic}.", "Write a poem about {topic}."],
    "synth-list": ["List {n} practical tips for {activity}.", "Give {n} common mistakes people make when {activity}."],
    "synth-compare": ["Compare {subject} and {subject2}: how are they related?"],
    "synth-email": ["Write a polite email asking a colleague for help with {activity}."],
    "synth-howto": ["How do I get better at {activity}? Give a plan for the first month.",
                    "I keep failing at {activity}. What am I probably doing wrong?"],
    "synth-code": ["Show how {subject} works with a small Python example.",
                   "Write a Python script that demonstrates {subject}, with comments."],
}
FORMAT_TASKS = ["Describe {subject}.", "Give advice on {activity}.", "Tell a short story about {topic}.",
                "Explain why {subject} matters in everyday life.", "Argue for and against {activity}."]
FORMAT_RULES = ["Present the answer as a numbered list of {n} items.", "Use a markdown table with two columns.",
                "Answer in at most {n} sentences.", "Put a short bold heading above each part.",
                "Give the answer as JSON with the fields title and points.",
                "Finish with a one-line takeaway that starts with 'In short:'.",
                "Avoid jargon: a ten-year-old should follow it.",
                "Write it as a dialogue between a teacher and a student.",
                "Number each paragraph and keep each under {n}0 words."]


def _math_problem(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 60), rng.randint(2, 40), rng.randint(2, 12)
    forms = [
        f"A shop sells pencils at {c} cents each. Mia buys {a} pencils and pays with {a * c + b} cents. "
        "How much change does she get? Explain step by step.",
        f"A tank holds {a * 10} litres and drains {b} litres per minute. How long until it is empty? Show your work.",
        f"Sam reads {c} pages a day. His book has {a * c + b} pages. After how many days does he finish it?",
        f"A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
        f"Tom has {a} marbles, gives away {min(a, b)} and then buys {c} bags of {b % 9 + 2}. How many does he have?",
        f"A recipe for {c} people needs {b * 10} grams of flour. How much flour is needed for {a} people?",
        f"A bus leaves every {c + 3} minutes, starting at 7:00. How many buses leave before {7 + a % 5}:30?",
        f"Anna saves {b} dollars a week and already has {a} dollars. How many weeks until she has {a + b * c} "
        "dollars?",
    ]
    return rng.choice(forms)


def synthetic_prompts(rng: random.Random, limit: int) -> list[Prompt]:
    """Chat prompts from templates: explanations, stories, lists, how-tos, math, format rules."""
    out = []
    while len(out) < limit:
        kind = rng.choice([*TEMPLATES, "synth-math", "synth-format"])
        if kind == "synth-math":
            text = _math_problem(rng)
        elif kind == "synth-format":
            task = rng.choice(FORMAT_TASKS).format(subject=rng.choice(SUBJECTS), topic=rng.choice(TOPICS),
                                                   activity=rng.choice(ACTIVITIES))
            text = f"{task} {rng.choice(FORMAT_RULES).format(n=rng.randint(2, 6))}"
        else:
            s1, s2 = rng.sample(SUBJECTS, 2)
            text = rng.choice(TEMPLATES[kind]).format(subject=s1, subject2=s2, topic=rng.choice(TOPICS),
                                                      activity=rng.choice(ACTIVITIES), n=rng.randint(3, 7))
        out.append(Prompt(_pid(kind, text), kind, text))
    return out


# Self-chat (Magpie-style): the target writes the user's request itself after one of these openings,
# so the requests range as widely as what the target has seen users ask, not as a template list does.
OPENERS = ["Write", "Compose", "Draft", "Imagine you are", "Explain", "Describe", "Summarise", "Give me", "How do I",
           "What is", "Why", "Can you", "Create", "Help me", "Suggest", "Compare", "I need", "Plan", "List",
           "Pretend", "Act as", "Tell me", "Design", "Outline", "Rewrite", "Analyse", "Solve", "Read", "Edit",
           "Evaluate", "Generate", "Brainstorm", "Please", "I am", "My", "Is it", "Which", "In"]
FOLLOW_UPS = ["Now", "Rewrite", "Make it", "Can you", "Shorten", "Expand", "Turn", "Critique", "What if", "Add",
              "Explain", "Please", "Great", "Thanks", "Could you", "Use", "Change", "Why", "Give", "Summarise"]


def _pid(kind: str, text: str) -> str:
    return kind + "-" + hashlib.sha1(text.encode()).hexdigest()[:12]


# ---------------------------------------------------------------- the mix
def eval_texts() -> list[str]:
    """Every prompt of the benchmark task sets (MT-Bench both turns, HumanEval, and the math,
    instruction, summarisation and QA sets `moaspec bench` builds)."""
    from moaspec.tasks import humaneval_prompts, load_tasks, mtbench_turns

    return [*mtbench_turns(), *humaneval_prompts(), *(t for q in load_tasks() for t in q.turns)]


# Shares of the prompt kinds: a code model serves code first, then explanations and text work.
MIX = {"code": 0.45, "doc": 0.2, "synth": 0.35}


def build_prompts(n: int, seed: int, mix: dict[str, float] | None = None,
                  contamination: Contamination | None = None) -> list[Prompt]:
    """n distinct prompts in a random order, reproducible from the seed, none overlapping the
    evaluation sets. The code and doc pools are as large as the installed files allow; a short pool
    hands its share to the synthesised prompts."""
    mix = mix or MIX
    rng = random.Random(seed)
    check = contamination or Contamination(eval_texts())
    makers = {"code": code_prompts, "doc": doc_prompts, "synth": synthetic_prompts}
    seen: set[str] = set()
    out: list[Prompt] = []
    for group in ("code", "doc", "synth"):
        want = int(round(n * mix.get(group, 0.0))) if group != "synth" else n - len(out)
        taken = 0
        for p in makers[group](random.Random(rng.random()), int(want * 1.3) + 8):
            key = " ".join(p.text.lower().split())
            if taken < want and key not in seen and not check(p.text):
                seen.add(key)
                out.append(p)
                taken += 1
    rng.shuffle(out)
    return out[:n]
