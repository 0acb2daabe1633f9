"""The benchmark's answer files: FastChat-style JSON lines, one file per method and temperature, one
record per question. They are the record: `bench.suite` appends to them (and resumes from them),
`bench.report` reads them alone."""

from __future__ import annotations

import json
from pathlib import Path


def answer_path(out: Path, method: str, temperature: float) -> Path:
    return out / "answers" / f"T{temperature:g}" / f"{method}.jsonl"


def read_answers(path: Path) -> dict[str, dict]:
    """question id -> record; a torn last line (interrupted run) is dropped."""
    done = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
                done[r["question_id"]] = r
            except (ValueError, KeyError, TypeError):
                continue
    return done
