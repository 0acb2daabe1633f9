"""Training data and the training loop, on the real SmolLM2 target."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from moaspec.drafters import moa
from moaspec.errors import UserError
from moaspec.training import prompts as P
from moaspec.training.train import TrainConfig, Trainer, export, lr_at, student_specs, top_vocab

DATA = Path(__file__).resolve().parent.parent / "data"


def test_prompts_never_contain_eval_prompts():
    check = P.Contamination(P.eval_texts())
    built = P.build_prompts(300, seed=1, contamination=check)
    assert len(built) == 300 and len({p.text for p in built}) == 300
    assert not any(check(p.text) for p in built)
    # the check has power: every evaluation prompt, and a slice of one inside other text, is caught
    evals = P.eval_texts()
    assert all(check(t) for t in random.Random(0).sample(evals, 40))
    words = evals[3].split()
    assert check("Please answer this: " + " ".join(words[:12]) + " thanks")


def test_prompts_reproducible_from_seed():
    a = [p.text for p in P.build_prompts(50, seed=7)]
    b = [p.text for p in P.build_prompts(50, seed=7)]
    c = [p.text for p in P.build_prompts(50, seed=8)]
    assert a == b and a != c


def test_shipped_training_data_is_clean():
    """The committed self-distillation data: manifest counts match, no eval prompt leaked in."""
    sets = sorted(DATA.glob("*/manifest.json"))
    if not sets:
        pytest.skip("no committed data set")
    check = P.Contamination(P.eval_texts())
    for manifest in sets:
        m = json.loads(manifest.read_text())
        rows = {s: [json.loads(x) for x in (manifest.parent / f"{s}.jsonl").read_text().splitlines()]
                for s in ("train", "val")}
        assert len(rows["train"]) == m["train"] and len(rows["val"]) == m["val"]
        ids = [r["id"] for s in rows.values() for r in s]
        assert len(ids) == len(set(ids)), "train/val overlap or duplicates"
        assert not any(check(r["prompt"]) for s in rows.values() for r in s)


def test_lr_schedule_warms_up_then_decays():
    cfg = TrainConfig(steps=100, warmup=10, lr=1e-3, lr_min=1e-5)
    lrs = [lr_at(s, cfg) for s in range(100)]
    assert lrs[0] < lrs[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:], strict=False)) and lrs[-1] < 2e-5


def _slice(tmp_path: Path, n_train: int, n_val: int) -> Path:
    sets = sorted(DATA.glob("smollm2-135m-*/train.jsonl"))
    if not sets:
        pytest.skip("no committed SmolLM2 data set")
    lines = sets[0].read_text().splitlines()
    (tmp_path / "train.jsonl").write_text("\n".join(lines[:n_train]) + "\n")
    (tmp_path / "val.jsonl").write_text("\n".join(lines[n_train:n_train + n_val]) + "\n")
    return tmp_path


def test_training_lowers_validation_loss(tmp_path):
    """A few hundred sequences of training on a small slice lower the held-out loss of every drafter,
    trained side by side on one target pass per sequence (MoA with N = 0 and 1, EAGLE-2, independent)."""
    data = _slice(tmp_path, 24, 6)
    cfg = TrainConfig(kind="moa,eagle,independent", tli_layers="0,1", data=str(data), out=str(tmp_path / "run"),
                      steps=60, batch_size=2, max_len=96, vocab_ids=2048, warmup=5, val_every=1000,
                      save_every=1000, val_sequences=6, seed=0)
    tr = Trainer(cfg)
    assert [s.label for s in tr.students] == ["moa", "moa-n1", "eagle", "independent"]
    before = tr.validate()
    result = tr.run(resume=False)
    after = tr.validate()
    for label in before:
        assert after[label]["loss"] < 0.8 * before[label]["loss"], (label, before[label], after[label])
        meta = json.loads((tmp_path / "run" / label / "training.json").read_text())
        assert meta["steps"] == 60 and meta["trained_with"] == list(before)
    assert set(result["drafters"]) == set(before)

    shipped = export(tmp_path / "run", tmp_path / "ship")  # fp16 copies that load into the same target
    assert [p.name for p in shipped] == list(before)
    for p in shipped:
        assert json.loads((p / "config.json").read_text())["dtype"] == "fp16" and (p / "training.json").exists()
    fresh = moa.load(tmp_path / "ship" / "moa-n1", tr.target, cfg.model, tr.drafter.cfg.target_fingerprint)
    assert fresh.cfg.tli_layers == 1


def test_student_specs():
    assert student_specs("moa", 0) == [("moa", "moa", 0)]
    assert student_specs("moa,eagle", "0,3") == [("moa", "moa", 0), ("moa-n3", "moa", 3), ("eagle", "eagle", 0)]
    with pytest.raises(UserError, match="unknown drafter kind"):
        student_specs("moa,medusa", 0)
    with pytest.raises(UserError):
        student_specs("moa,moa", 0)


def test_training_resumes_and_is_deterministic(tmp_path):
    data = _slice(tmp_path, 8, 2)

    def run(out: str, steps: int, resume: bool = True) -> dict:
        cfg = TrainConfig(data=str(data), out=str(tmp_path / out), steps=steps, batch_size=1, max_len=64,
                          vocab_ids=1024, warmup=1, val_every=1000, save_every=2, val_sequences=2, seed=3)
        tr = Trainer(cfg)
        tr.run(resume=resume)
        return {k: v.clone() for k, v in tr.drafter.trainable_state_dict().items()}

    straight = run("a", 4)
    run("b", 2)
    resumed = run("b", 4)
    assert all((straight[k] - resumed[k]).abs().max() < 1e-5 for k in straight)


def test_top_vocab_keeps_most_frequent():
    from moaspec.training.train import Example

    ex = [Example([5, 5, 5, 7, 7, 9], 1)]
    ids = top_vocab(ex, 3, 20).tolist()
    assert ids == [5, 7, 9]
    assert top_vocab(ex, 5, 20).tolist() == [0, 1, 5, 7, 9]
