"""Teacher-forced top-1 agreement of a training run's drafters on a benchmark run's plain answers.

Validation agreement (`training.curve`) is measured on held-out answers to the training prompts, and
the benchmark's acceptance on its six tasks runs lower. This scores the same drafters, teacher-forced
exactly as validation does, on the target's own answers to the benchmark's prompts: that splits the
gap into what the prompts change (this against validation) and what drafting in the engine changes
(the benchmark's accepted per drafted token against depth 1 here).

    python -m experiments.agreement --run runs/curve-qwen/points/1000000 --bench bench-out/curve1m-fp16
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from moaspec.bench.answers import answer_path, read_answers
from moaspec.errors import UserError
from moaspec.models.store import chat_ids, load_tokenizer, resolve
from moaspec.tasks import load_tasks
from moaspec.training.train import Example, TrainConfig, Trainer, run_config


def bench_examples(bench: Path, tokenizer) -> dict[str, list[Example]]:
    """Every turn of the benchmark run's plain answers at T=0 as an example, by task: the chat prompt
    the benchmark rendered (earlier turns with plain's own answers) followed by plain's answer tokens."""
    try:
        meta = json.loads((bench / "meta.json").read_text())["config"]
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"{bench} is not a `moaspec bench` output folder (no readable meta.json): {e}") from None
    path = answer_path(bench, "plain", 0.0)
    records = read_answers(path)
    if not records:
        raise UserError(f"{path} holds no answers: the benchmark run needs the plain method at T=0")
    questions = {q.id: q for q in load_tasks(list(meta["tasks"]) or None, meta["questions"], meta["seed"])}
    out: dict[str, list[Example]] = {}
    for qid, record in records.items():
        if qid not in questions:
            raise UserError(f"{path} answers question {qid}, which the run's task settings do not give")
        choice, messages = record["choices"][0], []
        for turn, text, ids in zip(questions[qid].turns, choice["turns"], choice["token_ids"], strict=False):
            messages.append({"role": "user", "content": turn})
            prompt = chat_ids(tokenizer, messages)  # as the benchmark rendered it (Decoder.encode)
            if ids:
                task = out.setdefault(questions[qid].task, [])
                task.append(Example([*prompt, *ids], len(prompt), len(task), answer_from_target=True))
            messages.append({"role": "assistant", "content": text})
    return out


def agreement(run: Path, bench: Path, every: int = 1, data: str | None = None) -> dict:
    """Per drafter of the run: top-1 agreement by draft depth on the benchmark's answers, pooled and
    per task (compare the run's validation in its curve.json or history), and the benchmark's accepted
    tokens per drafted token for the method of the same name. `every`: the verified context is
    refreshed every `every` rows (1: every row at depth 1, what the adaptive chain mostly drafts; 7:
    depths 1-6 as validation has them). `data`: a data folder of the run's target in place of the one
    the run names (which builds the trainer; the drafters bring their own vocabulary)."""
    saved = run_config(run)
    if data:
        saved = {**saved, "data": data}
    elif not Path(saved["data"]).is_dir():
        raise UserError(f"{run} was trained on {saved['data']}, which is not here: pass --data with a data "
                        f"folder of the same target")
    by_task = bench_examples(bench, load_tokenizer(resolve(saved["model"])))
    longest = max(len(e.ids) for exs in by_task.values() for e in exs)  # the target's cache holds the longest turn
    cfg = TrainConfig(**{**saved, "out": str(run), "feature_cache": False, "device": "cpu",
                         "max_len": max(saved["max_len"], longest)})
    tr = Trainer(cfg)
    tr.load_drafters(run)
    result: dict = {"run": str(run), "bench": str(bench), "bench_answer_tokens": 0, "by_task": {}}
    for task, examples in sorted(by_task.items()):
        tr.val = examples
        result["bench_answer_tokens"] += sum(len(e.ids) - e.prompt_len for e in examples)
        result["by_task"][task] = tr.validate(every=every)
    result["bench_teacher_forced"] = pooled(result["by_task"].values())
    result["bench_accepted_per_drafted"] = {}
    for label in result["bench_teacher_forced"]:
        records = read_answers(answer_path(bench, label, 0.0)).values()
        choices = [r["choices"][0] for r in records]
        drafted = sum(sum(c.get("drafted_tokens", [])) for c in choices)
        accepted = sum(a - 1 for c in choices for turn in c.get("accept_lengths", []) for a in turn)
        if drafted:
            result["bench_accepted_per_drafted"][label] = round(accepted / drafted, 4)
    return result


def pooled(parts) -> dict[str, dict]:
    """`Trainer.validate` results of disjoint example sets merged: agreed rows over rows, per depth."""
    out: dict[str, dict] = {}
    for part in parts:
        for label, r in part.items():
            acc = out.setdefault(label, {"agreed": {}, "rows": {}})
            for d, rows in r["rows_by_depth"].items():
                acc["agreed"][d] = acc["agreed"].get(d, 0) + r["agreed_by_depth"][d]
                acc["rows"][d] = acc["rows"].get(d, 0) + rows
    return {label: {"top1_by_depth": {d: round(a / acc["rows"][d], 4) for d, a in sorted(acc["agreed"].items())},
                    "rows_by_depth": dict(sorted(acc["rows"].items())),
                    "agreed_by_depth": dict(sorted(acc["agreed"].items()))} for label, acc in out.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True,
                   help="a training run folder, a learning curve's point (runs/X/points/<budget>), or exported "
                        "drafters (src/moaspec/checkpoints/<model>)")
    p.add_argument("--bench", required=True, help="a `moaspec bench` output folder with plain at T=0")
    p.add_argument("--every", type=int, default=1,
                   help="verified context every N rows: 1 scores every row at depth 1, 7 gives depths 1-6")
    p.add_argument("--out", default=None, help="write the result as JSON here")
    p.add_argument("--data", default=None,
                   help="a data folder of the same target, where the one the run names is gone")
    a = p.parse_args()
    if a.every < 1:
        p.error("--every must be at least 1")
    result = agreement(Path(a.run), Path(a.bench), a.every, a.data)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    print(table(result))
    return 0


def table(result: dict) -> str:
    """Depth-1 agreement per task and pooled, and the benchmark's accepted per drafted token, as markdown."""
    labels = list(result["bench_teacher_forced"])
    lines = ["| teacher-forced, depth 1 | rows | " + " | ".join(labels) + " |", "|---" * (len(labels) + 2) + "|"]
    for task, r in [*result["by_task"].items(), ("all", result["bench_teacher_forced"])]:
        rows = next(iter(r.values()))["rows_by_depth"].get(1, 0)
        cells = [f"{r[label]['top1_by_depth'].get(1, float('nan')):.3f}" for label in labels]
        lines.append(f"| {task} | {rows} | " + " | ".join(cells) + " |")
    accepted = result["bench_accepted_per_drafted"]
    lines.append("| accepted per drafted (bench) | | " + " | ".join(
        f"{accepted[label]:.3f}" if label in accepted else "-" for label in labels) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
