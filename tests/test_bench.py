"""`moaspec bench` end to end on the real SmolLM2: answer files, the T=0 identity check, resume, report."""

from __future__ import annotations

import json

import pytest

from moaspec.bench import report
from moaspec.bench.answers import answer_path
from moaspec.bench.suite import Bench, BenchConfig, resolve_methods, run
from moaspec.decoding.tree import TreeConfig
from moaspec.errors import UserError
from moaspec.tasks import load_tasks

SMOL = "smollm2-135m"


def test_bench_runs_resumes_and_reports(tmp_path):
    out = tmp_path / "bench"
    cfg = BenchConfig(model=SMOL, methods=("plain", "hf", "lookup", "moa"), tasks=("mtbench", "math"), questions=1,
                      max_new_tokens=12, temperatures=(0.0, 1.0), tree="3,1,3", out=str(out))
    path = run(cfg)
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert {(r["temperature"], r["task"]) for r in rows} == {(t, k) for t in (0.0, 1.0)
                                                          for k in ("mtbench", "math", "all")}
    for r in rows:
        if r["temperature"] == 0 and r["method"] in ("lookup", "moa"):
            assert r["mismatched_turns"] == 0, r  # lossless verification
        assert r["new_tokens"] > 0 and r["tokens_per_s"] > 0
    plain = next(r for r in rows if r["method"] == "plain" and r["task"] == "all" and r["temperature"] == 0)
    assert plain["speedup"] == 1.0 and plain["tau"] == 1.0
    moa = next(r for r in rows if r["method"] == "moa" and r["task"] == "all" and r["temperature"] == 0)
    assert moa["tau"] >= 1.0 and 0 < moa["draft_share"] < 1 and moa["target_calls_per_token"] <= 1.0
    # the decode speedup leaves the prefill out: tokens over (wall - prefill) against plain's, from the answers
    assert plain["decode_speedup"] == 1.0 and 0 < plain["prefill_share"] < 1

    def decode_rate(method: str) -> float:
        cs = [c for line in answer_path(out, method, 0.0).read_text().splitlines()
              for c in json.loads(line)["choices"]]
        tokens = sum(sum(c["new_tokens"]) for c in cs)
        return tokens / sum(sum(c["wall_time"]) - sum(c["prefill_time"]) for c in cs)

    assert moa["decode_speedup"] == pytest.approx(decode_rate("moa") / decode_rate("plain"), abs=2e-3)
    hf = next(r for r in rows if r["method"] == "hf" and r["task"] == "all" and r["temperature"] == 0)
    assert hf["decode_speedup"] is None  # transformers reports no prefill time: no decode-only figure

    lines = answer_path(out, "moa", 0.0).read_text().splitlines()
    assert len(lines) == 2
    mt = next(json.loads(x) for x in lines if json.loads(x)["category"] == "mtbench")
    choice = mt["choices"][0]
    assert len(choice["turns"]) == 2 and len(choice["new_tokens"]) == 2 and len(choice["wall_time"]) == 2
    # the prefill gives the first token; each target call then emits its accepted tokens + 1
    assert all(1 + sum(a) >= n for a, n in zip(choice["accept_lengths"], choice["new_tokens"], strict=True))
    assert mt["model_id"] == f"{SMOL}:moa"
    assert mt["tree"] == {"depth": 3, "topk": 1, "total_tokens": 3, "adaptive": False, "min_prob": 0.0}
    text = path.read_text()
    assert "| moa |" in text and "## T = 1" in text

    before = {p: p.read_text() for p in (out / "answers").rglob("*.jsonl")}
    with answer_path(out, "lookup", 0.0).open("a") as f:
        f.write('{"question_id": "torn')  # an interrupted write is dropped on resume
    run(cfg)
    after = {p: p.read_text() for p in (out / "answers").rglob("*.jsonl")}
    assert all(after[p].startswith(before[p]) for p in before)
    assert len(report.load(out)[1][(0.0, "lookup")]) == 2


def test_bench_tree_sweep_picks_the_fastest_tree(tmp_path):
    cfg = BenchConfig(model=SMOL, methods=("plain", "lookup", "moa"), sweep_tokens=10, out=str(tmp_path))
    methods, _ = resolve_methods(cfg)
    bench = Bench(cfg, methods)
    trees = (TreeConfig(1, 1, 1), TreeConfig(3, 2, 4), TreeConfig.parse("adaptive:4x2"))
    sweep = bench.sweep(load_tasks(["math"], 2), trees)
    for method, n in (("lookup", 2), ("moa", 3)):  # prompt lookup has no siblings to fill a wide adaptive tree
        rows = [r for r in sweep["rows"] if r["method"] == method]
        assert len(rows) == n and sweep["best"][method] == max(rows, key=lambda r: r["tokens_per_s"])["tree"]


def test_bench_bad_method_and_missing_checkpoint(tmp_path):
    with pytest.raises(UserError, match="unknown method"):
        resolve_methods(BenchConfig(model=SMOL, methods=("plain", "medusa")))
    with pytest.raises(UserError, match="no checkpoint"):
        resolve_methods(BenchConfig(model=SMOL, methods=("moa-n3",), checkpoints=str(tmp_path)))
    methods, notes = resolve_methods(BenchConfig(model=SMOL, checkpoints=str(tmp_path)))
    assert [m.name for m in methods][0] == "plain" and any("moa" in n for n in notes)


def _one_turn_question():
    return next(q for q in load_tasks(["math", "humaneval", "qa"], 2) if len(q.turns) == 1)


def test_every_method_prefills_each_question_cold(tmp_path, monkeypatch):
    """A method answering after plain on the same question prefills the whole prompt, as plain did and as a peer's
    fresh process does: no method finds another's KV cache (the bench once shared the model's one cache)."""
    cfg = BenchConfig(model=SMOL, methods=("plain", "suffix", "lookup", "recycling"), tree="3,1,3", out=str(tmp_path))
    bench = Bench(cfg, resolve_methods(cfg)[0])
    prefilled: list[int] = []
    real = bench.dec.target.prefill
    monkeypatch.setattr(bench.dec.target, "prefill",
                        lambda tokens, **kw: prefilled.append(len(tokens)) or real(tokens, **kw))
    q = _one_turn_question()
    prompt = len(bench.dec.encode([{"role": "user", "content": q.turns[0]}]))
    for m in bench.methods:
        prefilled.clear()
        bench.answer(m, q, 0.0, 6)
        assert prefilled == [prompt], (m.name, prefilled)  # the whole prompt, in one prefill


def test_a_t1_answer_drafts_from_nothing_the_t0_answer_taught(tmp_path, monkeypatch):
    """Drafters that learn from earlier outputs (the suffix drafter's history, Token Recycling's table) start each
    (method, question, temperature) afresh: at T=1 they cannot draft from their own T=0 answer to the question."""
    from moaspec.drafters.recycling import RecyclingDrafter
    from moaspec.drafters.suffix import SuffixDrafter

    cfg = BenchConfig(model=SMOL, methods=("plain", "suffix", "recycling"), tree="3,1,3", out=str(tmp_path))
    bench = Bench(cfg, resolve_methods(cfg)[0])
    q = _one_turn_question()
    for m in bench.methods[1:]:
        bench.answer(m, q, 0.0, 24)
    seen: dict[str, int] = {}
    for cls, learnt in ((SuffixDrafter, lambda d: len(d.outputs) + len(d.context)),
                        (RecyclingDrafter, lambda d: len(d.table))):
        real = cls.begin

        def begin(self, prompt, context=None, real=real, learnt=learnt):
            seen.setdefault(self.name, learnt(self))  # before this answer adds anything
            return real(self, prompt, context)

        monkeypatch.setattr(cls, "begin", begin)
    for m in bench.methods[1:]:
        bench.answer(m, q, 1.0, 24)
    assert seen == {"suffix": 0, "recycling": 0}
