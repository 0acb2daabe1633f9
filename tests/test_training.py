"""Training data and the training loop, on the real SmolLM2 target."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from conftest import DATA_DIRS, data_dir_params

from moaspec.drafters import SPECS, moa
from moaspec.errors import UserError
from moaspec.training import data as D
from moaspec.training import prompts as P
from moaspec.training.train import TrainConfig, Trainer, export, lr_at, run_config, student_specs, top_vocab

DATA = Path(__file__).resolve().parent.parent / "data"


@pytest.mark.slow  # an end-to-end scan of every prompt source: make test-slow
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


def test_shipped_training_data_is_well_formed():
    """The committed data folders: the manifest counts what the shards hold, ids are unique."""
    assert DATA_DIRS, "no committed data set"
    for folder in DATA_DIRS:
        m = json.loads((folder / "manifest.json").read_text())
        rows = D.load(folder)
        assert m["version"] == D.DATA_VERSION and sum(len(r.ids) for r in rows) == m["tokens"]
        assert len({r.id for r in rows}) == len(rows), "duplicate sequence ids"
        assert all(0 < r.prompt_len < len(r.ids) for r in rows)


@pytest.mark.parametrize("folder", data_dir_params())
def test_shipped_training_data_is_clean(folder):
    """No sequence (prompt or answer) of a committed data folder shares an 8-gram with a benchmark prompt."""
    check = P.Contamination(P.eval_texts())
    assert not [t for t in D.texts(folder) if check(t)]


def test_shards_round_trip_and_corrupt_shards_are_refused(tmp_path):
    rows = [D.Sequence("a", "text-code", [1, 2, 3, 70000], 2),
            D.Sequence("b", "synth-math", [5, 6], 1, False, "greedy")]
    D.write_shard(tmp_path / "gen-00000.npz", rows)
    assert list(D.read_shard(tmp_path / "gen-00000.npz")) == rows
    (tmp_path / "gen-00001.npz").write_bytes(b"not a shard")
    with pytest.raises(UserError, match="delete it"):
        list(D.read_shard(tmp_path / "gen-00001.npz"))


@pytest.mark.slow  # a data job run, stopped and resumed (~35 s): make test-slow
def test_data_builder_resumes_without_duplicates(tmp_path):
    """Text and generated answers (transformers, tiny answers), then a larger goal: the first shards
    stay as they were and nothing is written twice."""
    cfg = D.DataConfig(model="smollm2-135m", tokens=3000, text_fraction=0.5, prompts=40, max_new_tokens=12,
                       engine="transformers", parallel=4, shard_tokens=800)
    first = D.Builder(cfg, tmp_path).run()
    folder = tmp_path / cfg.folder_name()
    before = {p.name: p.read_bytes() for p in D.shards(folder)}
    assert first["sources"]["gen"]["train_sequences"] + first["sources"]["gen"].get("val_sequences", 0) > 0
    assert first["tokens"] >= 3000 and first["complete"]
    cfg.tokens = 5000
    second = D.Builder(cfg, tmp_path).run()
    assert all((folder / name).read_bytes() == data for name, data in before.items())
    ids = [r.id for r in D.load(folder)]
    assert len(ids) == len(set(ids)) and second["tokens"] >= 5000
    rows = D.load(folder)
    assert {r.mode for r in rows} >= {"text"} and any(r.mode in ("greedy", "sampled") for r in rows)
    cfg.seed = 1
    with pytest.raises(UserError, match="pick another --out"):
        D.Builder(D.DataConfig(model="smollm2-135m", prompts=41), tmp_path)


@pytest.mark.slow  # a minute; the fault matrix (make test-slow) stops the data job the same way at random moments
def test_data_builder_stops_on_sigterm_after_the_round_written(tmp_path, monkeypatch):
    """SIGTERM (a session's end) during a round of answers: the round is finished and written, the
    handler put back, and the same command resumes to the goal without writing anything twice."""
    import os
    import signal

    cfg = D.DataConfig(model="smollm2-135m", tokens=20_000, text_fraction=0.0, prompts=40, max_new_tokens=12,
                       engine="transformers", parallel=2, shard_tokens=100_000)
    builder = D.Builder(cfg, tmp_path)
    engine = builder.engine

    def engine_then_term():
        gen = engine()
        generate = gen.generate

        def first_answers_then_term(requests, max_new_tokens):
            for i, a in enumerate(generate(requests, max_new_tokens)):
                if i == 0:
                    os.kill(os.getpid(), signal.SIGTERM)
                yield a
        gen.generate = first_answers_then_term
        return gen

    monkeypatch.setattr(builder, "engine", engine_then_term)
    before = signal.getsignal(signal.SIGTERM)
    first = builder.run()
    assert first["stopped"] and signal.getsignal(signal.SIGTERM) is before
    folder = tmp_path / cfg.folder_name()
    rows = D.load(folder)
    assert 0 < len(rows) <= cfg.parallel * 8  # the whole first round, and nothing after it
    second = D.Builder(cfg, tmp_path).run()
    ids = [r.id for r in D.load(folder)]
    assert not second["stopped"] and second["tokens"] > first["tokens"] and len(ids) == len(set(ids)) > len(rows)


@pytest.mark.slow  # a self-chat data job (~50 s): make test-slow
def test_self_chat_writes_requests_and_follow_ups(tmp_path):
    """Self-chat: the target writes each request after an opening word, answers it, and for some
    conversations writes a follow-up that sees the first answer; prompts are chat-rendered up to the
    last answer; a rerun writes nothing twice."""
    cfg = D.DataConfig(model="smollm2-135m", tokens=1200, text_fraction=0.0, self_fraction=1.0, max_new_tokens=24,
                       engine="transformers", parallel=4, shard_tokens=600, seed=3)
    manifest = D.Builder(cfg, tmp_path).run()
    folder = tmp_path / cfg.folder_name()
    rows = D.load(folder)
    assert rows and manifest["tokens"] >= 1200 and set(manifest["sources"]) == {"self"}
    assert {r.kind for r in rows} <= {"self-chat1", "self-chat2"} and {r.mode for r in rows} <= {"greedy", "sampled"}
    tok = D.Builder(cfg, tmp_path).tok
    openers = tuple(P.OPENERS)
    for r in rows:
        prompt = tok.decode(r.ids[:r.prompt_len])
        users = [t.split("<|im_end|>")[0].strip() for t in prompt.split("<|im_start|>user\n")[1:]]
        assert len(users) == int(r.kind[-1]) and users[0].startswith(openers)
        assert prompt.endswith("<|im_start|>assistant\n")  # the generation prompt, as decoding renders it
        if r.kind == "self-chat2":
            assert users[1].startswith(tuple(P.FOLLOW_UPS)) and prompt.count("<|im_start|>assistant") == 2
    cfg.tokens = manifest["tokens"]
    D.Builder(cfg, tmp_path).run()  # the goal is reached: nothing new
    assert [r.id for r in D.load(folder)] == [r.id for r in rows]


def test_lr_schedule_warms_up_then_decays():
    cfg = TrainConfig(steps=100, warmup=10, lr=1e-3, lr_min=1e-5)
    lrs = [lr_at(s, cfg) for s in range(100)]
    assert lrs[0] < lrs[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:], strict=False)) and lrs[-1] < 2e-5


def _slice(tmp_path: Path, n_train: int, n_val: int) -> Path:
    """A small data folder cut from the committed SmolLM2 data: n_train training and n_val validation
    sequences, generated answers first. Cut from the first two shards of each source only, so that
    data added to the folder later does not move the tests' slice."""
    sets = sorted(DATA.glob("smollm2-135m-*/manifest.json"))
    if not sets:
        pytest.skip("no committed SmolLM2 data set")
    src = sets[0].parent
    first = [path for source in ("gen", "text") for path in D.shards(src, source)[:2]]
    rows = sorted((r for path in first for r in D.read_shard(path)), key=lambda r: (r.mode == "text", r.id))
    cfg = json.loads((src / "config.json").read_text())
    train = [r for r in rows if not D.is_val(r.id, cfg["val_fraction"])][:n_train]
    val = [r for r in rows if D.is_val(r.id, cfg["val_fraction"])][:n_val]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    D.write_shard(tmp_path / "gen-00000.npz", train + val)
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
    ablated = tr.validate(context_mean=True)  # MoA's context vectors replaced by their mean: MoA only
    assert list(ablated) == ["moa", "moa-n1"]
    assert all(ablated[k]["loss"] != after[k]["loss"] for k in ablated)

    shipped = export(tmp_path / "run", tmp_path / "ship")  # fp16 copies that load into the same target
    assert [p.name for p in shipped] == list(before)
    for p in shipped:
        assert json.loads((p / "config.json").read_text())["dtype"] == "fp16" and (p / "training.json").exists()
    fresh = SPECS["moa"].load(tmp_path / "ship" / "moa-n1", tr.target, cfg.model, tr.drafter.cfg.target_fingerprint)
    assert fresh.cfg.tli_layers == 1

    # exported drafters are a run too: their config for experiments.agreement, and the start of a fine-tune
    saved = run_config(tmp_path / "ship")
    assert (saved["model"], saved["kind"], saved["tli_layers"]) == (cfg.model, "moa,eagle,independent", "0,1")
    tuned = Trainer(TrainConfig(**{**saved, "data": str(data), "out": str(tmp_path / "ft"), "max_len": 96,
                                   "val_sequences": 6, "init": str(tmp_path / "ship"), "steps": 1}))
    for st, old in zip(tuned.students, tr.students, strict=True):
        assert torch.equal(st.drafter.vocab_ids, old.drafter.vocab_ids)
        for (name, a), b in zip(st.drafter.state_dict().items(), old.drafter.state_dict().values(), strict=True):
            assert torch.allclose(a.float(), b.float(), atol=2e-3, rtol=2e-3), (st.label, name)  # fp16 copies
    with pytest.raises(UserError, match="neither a training run"):
        run_config(tmp_path / "ft")
    tuned.run()  # a fine-tuned drafter says where it started and how that was trained
    info = json.loads((tmp_path / "ft" / "moa-n1" / "training.json").read_text())
    assert info["init"] == str(tmp_path / "ship") and info["steps"] == 1
    assert info["init_training"] == json.loads((tmp_path / "ship" / "moa-n1" / "training.json").read_text())


def test_student_specs():
    assert student_specs("moa", 0) == [("moa", "moa", 0)]
    assert student_specs("moa,eagle", "0,3") == [("moa", "moa", 0), ("moa-n3", "moa", 3), ("eagle", "eagle", 0)]
    with pytest.raises(UserError, match="unknown drafter kind"):
        student_specs("moa,medusa", 0)
    with pytest.raises(UserError):
        student_specs("moa,moa", 0)


def test_training_resumes_and_is_deterministic(tmp_path):
    data = _slice(tmp_path, 8, 2)

    def run(out: str, until: int | None = None) -> dict:
        cfg = TrainConfig(data=str(data), out=str(tmp_path / out), steps=5, batch_size=1, max_len=64,
                          vocab_ids=1024, warmup=1, val_every=1000, save_every=1000, val_sequences=2, seed=3)
        tr = Trainer(cfg)
        tr.run(until=until)
        return {k: v.clone() for k, v in tr.drafter.trainable_state_dict().items()}

    straight = run("a")
    run("b", until=2)
    resumed = run("b")
    assert all((straight[k] - resumed[k]).abs().max() < 1e-5 for k in straight)


def test_answers_only_trains_on_the_targets_answers(tmp_path):
    data = _slice(tmp_path, 8, 2)
    src = sorted(DATA.glob("smollm2-135m-*/manifest.json"))[0].parent
    fraction = json.loads((src / "config.json").read_text())["val_fraction"]
    text = [r for r in D.read_shard(D.shards(src, "text")[0]) if not D.is_val(r.id, fraction)][:4]
    D.write_shard(data / "text-00000.npz", text)
    cfg = dict(data=str(data), steps=1, batch_size=1, max_len=64, vocab_ids=1024, val_sequences=2)
    every = Trainer(TrainConfig(out=str(tmp_path / "a"), **cfg)).train
    answers = Trainer(TrainConfig(out=str(tmp_path / "b"), answers_only=True, **cfg)).train
    assert answers and all(e.answer_from_target for e in answers)
    assert len(answers) < len(every) and {e.index for e in answers} < {e.index for e in every}


def test_sigterm_stops_after_the_step_saved_and_resumes(tmp_path, monkeypatch):
    """A job ended by SIGTERM (a session's stop) saves after the current step and loses nothing."""
    import os
    import signal

    data = _slice(tmp_path, 8, 2)
    cfg = dict(data=str(data), steps=5, batch_size=1, max_len=64, vocab_ids=1024, warmup=1, val_every=1000,
               save_every=1000, val_sequences=2, seed=3)
    straight = Trainer(TrainConfig(out=str(tmp_path / "a"), **cfg))
    straight.run()
    tr = Trainer(TrainConfig(out=str(tmp_path / "b"), **cfg))
    batch = tr.batch

    def batch_then_term(step: int):
        if step == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return batch(step)

    monkeypatch.setattr(tr, "batch", batch_then_term)
    before = signal.getsignal(signal.SIGTERM)
    result = tr.run()
    assert result["stopped"] and result["steps"] == 2
    assert torch.load(tmp_path / "b" / "trainer.pt", weights_only=False)["step"] == 2
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is put back
    resumed = Trainer(TrainConfig(out=str(tmp_path / "b"), **cfg))

    def broken(step: int):
        raise RuntimeError("a failure mid-training")

    monkeypatch.setattr(resumed, "batch", broken)
    with pytest.raises(RuntimeError, match="mid-training"):
        resumed.run()
    assert signal.getsignal(signal.SIGTERM) is before  # put back on the way out of an exception too
    monkeypatch.setattr(resumed, "batch", Trainer.batch.__get__(resumed))
    assert not resumed.run()["stopped"]
    a, b = straight.drafter.trainable_state_dict(), resumed.drafter.trainable_state_dict()
    assert all((a[k] - b[k]).abs().max() < 1e-5 for k in a)


def test_top_vocab_keeps_most_frequent():
    from moaspec.training.train import Example

    ex = [Example([5, 5, 5, 7, 7, 9], 1, answer_from_target=True)]
    ids = top_vocab(ex, 3, 20).tolist()
    assert ids == [5, 7, 9]
    assert top_vocab(ex, 5, 20).tolist() == [0, 1, 5, 7, 9]
    # the target's own answers rank first: 11 fills the text, but 9 and 7 are what the target writes
    ex.append(Example([11] * 9 + [12], 1))
    assert top_vocab(ex, 3, 20).tolist() == [5, 7, 9]


def test_feature_cache_computes_once_and_matches_the_target(tmp_path):
    from moaspec.models.runtime import Transformer
    from moaspec.models.store import resolve
    from moaspec.training.features import FeatureCache, compute

    target = Transformer(resolve("smollm2-135m"), max_seq_len=64)
    seqs = [[1, 2, 3, 4, 5, 6], [9, 8, 7]]
    L = target.cfg.num_layers
    cache = FeatureCache(target, "fp", seqs, (L - 1, L), greedy=True, root=tmp_path)
    got = cache.get(1)
    want = compute(target, seqs[1], (L - 1, L), greedy=True)
    assert cache.computed_tokens == 3 and cache.done.tolist() == [False, True]
    assert (got.K - want.K).abs().max() < 1e-2 * want.K.abs().max() and torch.equal(got.argmax, want.argmax)
    assert (got.hidden[L] - want.hidden[L]).abs().max() < 1e-2 * want.hidden[L].abs().max()
    cache.flush()
    again = FeatureCache(target, "fp", seqs, (L - 1, L), greedy=True, root=tmp_path)  # a later run
    assert again.done.tolist() == [False, True]
    assert torch.equal(again.get(1).K, got.K) and again.computed_tokens == 0
    other = FeatureCache(target, "fp", [[1, 2, 3]], (L,), greedy=False, root=tmp_path)
    assert other.folder != cache.folder
    # a run that needs fewer layers (MoA N=0 alone) reads the cache written beside N=1, and what it
    # computes there is every layer the folder keeps, so the wider run finds it complete
    narrow = FeatureCache(target, "fp", seqs, (L,), greedy=True, root=tmp_path)
    assert narrow.folder == cache.folder and narrow.done.tolist() == [False, True]
    assert torch.equal(narrow.get(1).hidden[L], got.hidden[L]) and narrow.computed_tokens == 0
    narrow.get(0)
    narrow.flush()
    wide = FeatureCache(target, "fp", seqs, (L - 1, L), greedy=True, root=tmp_path)
    first = wide.get(0)
    assert wide.computed_tokens == 0 and set(first.hidden) == {L - 1, L}
    want = compute(target, seqs[0], (L - 1, L), greedy=True)
    assert (first.hidden[L - 1] - want.hidden[L - 1]).abs().max() < 1e-2 * want.hidden[L - 1].abs().max()
    assert FeatureCache(target, "fp", seqs, (L - 2,), greedy=True, root=tmp_path).folder != cache.folder


@pytest.mark.slow  # two training processes (~30 s): make test-slow
def test_data_parallel_training_matches_one_process(tmp_path):
    """torchrun with two CPU processes (gloo), each taking half of every batch, ends with the same
    drafter as one process on the same data."""
    import os
    import socket
    import subprocess
    import sys

    from safetensors.torch import load_file

    (tmp_path / "data").mkdir()
    data = _slice(tmp_path / "data", 6, 2)
    args = ["train", "--model", "smollm2-135m", "--data", str(data), "--kind", "moa,eagle", "--steps", "1",
            "--batch-size", "2", "--max-len", "64", "--vocab", "1024", "--val-every", "1000", "--seed", "5"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "moaspec", *args, "--out", str(tmp_path / "one")], check=True, env=env,
                   capture_output=True)
    with socket.socket() as s:  # a free port for the process group's rendezvous
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", port,
                    "-m", "moaspec", *args, "--out", str(tmp_path / "two")], check=True, env=env,
                   capture_output=True)
    subprocess.run([sys.executable, "-m", "moaspec", *args, "--lr", "0", "--out", str(tmp_path / "init")], check=True,
                   env=env, capture_output=True)
    for label in ("moa", "eagle"):
        one, two, init = (load_file(str(tmp_path / run / label / "model.safetensors"))
                          for run in ("one", "two", "init"))
        assert one.keys() == two.keys()
        # Adam's first step moves every weight by the learning rate times the sign of its gradient. Summing
        # the two halves in another order changes round-off only, which flips the sign of a few gradients
        # that are round-off anyway (2.5% of EAGLE's, none of MoA's here); half a batch lost or counted
        # twice flips a large share.
        moved = sum(int(((one[k].float() - init[k].float()).abs() > 1e-6).sum()) for k in one)
        apart = sum(int(((one[k].float() - two[k].float()).abs() > 1e-6).sum()) for k in one)
        assert moved > 1000 and apart < 0.05 * moved, (label, apart, moved)


def test_eagle_is_sized_to_moa_parameter_count():
    from moaspec.drafters import eagle
    from moaspec.models.runtime import ModelConfig
    from moaspec.models.store import resolve
    from moaspec.training.train import matched_eagle_config

    c = ModelConfig.from_folder(resolve("smollm2-135m"))
    common = dict(vocab_ids=16384, target_name="smollm2-135m", target_fingerprint="x")
    want = moa.MoADrafter(moa.MoAConfig.for_target(c, **common)).num_trainable_parameters()
    got = eagle.EagleDrafter(matched_eagle_config(c, common)).num_trainable_parameters()
    default = eagle.EagleDrafter(eagle.EagleConfig.for_target(c, **common)).num_trainable_parameters()
    assert abs(got - want) < 0.02 * want and abs(default - want) > 0.2 * want


def test_fine_tune_from_a_drafter_of_another_size(tmp_path):
    """An EAGLE-2 trained at the target's shape (before `match_params`) starts a default fine-tune (which
    would build the matched size) at its own size and weights, with an optimiser over those, and trains;
    a resume of that run finds the same size again."""
    data = _slice(tmp_path, 8, 2)
    cfg = dict(kind="eagle", data=str(data), batch_size=1, max_len=64, vocab_ids=1024, warmup=1, val_every=1000,
               save_every=1000, val_sequences=2, seed=0)
    old = Trainer(TrainConfig(out=str(tmp_path / "old"), steps=2, match_params=False, **cfg))
    old.run()
    tuned = Trainer(TrainConfig(out=str(tmp_path / "ft"), steps=3, init=str(tmp_path / "old"), **cfg))
    st = tuned.students[0]
    assert st.drafter.cfg == old.students[0].drafter.cfg and st.drafter.training
    assert all(torch.equal(a, b) for a, b in zip(st.drafter.state_dict().values(),
                                                 old.students[0].drafter.state_dict().values(), strict=True))
    assert {id(p) for g in st.opt.param_groups for p in g["params"]} == \
        {id(p) for p in st.drafter.parameters() if p.requires_grad}
    before = {k: v.clone() for k, v in st.drafter.state_dict().items()}
    tuned.run(until=2)
    assert any(not torch.equal(before[k], v) for k, v in st.drafter.state_dict().items())
    resumed = Trainer(TrainConfig(out=str(tmp_path / "ft"), steps=3, init=str(tmp_path / "old"), **cfg))
    resumed.run()
    assert resumed.step == 3 and resumed.students[0].drafter.cfg == old.students[0].drafter.cfg


def test_fine_tune_adds_the_query_state(tmp_path):
    """`--query-state` from a paper MoA (`--init`): the same weights, the state projection at zero (so it
    starts as the paper's drafter: same validation loss), and that projection trains; an exported run
    says so, for `experiments.agreement` and further fine-tunes."""
    data = _slice(tmp_path, 8, 2)
    cfg = dict(kind="moa", data=str(data), batch_size=1, max_len=64, vocab_ids=1024, warmup=1, val_every=1000,
               save_every=1000, val_sequences=2, seed=0)
    old = Trainer(TrainConfig(out=str(tmp_path / "old"), steps=2, **cfg))
    old.run()
    tuned = Trainer(TrainConfig(out=str(tmp_path / "ft"), steps=2, init=str(tmp_path / "old"), query_state=True,
                                **cfg))
    st = tuned.students[0]
    assert st.drafter.cfg.query_state and not old.students[0].drafter.cfg.query_state
    weights = st.drafter.state_dict()
    assert all(torch.equal(weights[k], v) for k, v in old.students[0].drafter.state_dict().items())
    assert not weights["state_proj.weight"].any()
    assert tuned.validate()["moa"]["loss"] == pytest.approx(old.validate()["moa"]["loss"], abs=1e-5)
    tuned.run()
    assert st.drafter.state_proj.weight.abs().sum() > 0
    export(tmp_path / "ft", tmp_path / "ship")
    assert run_config(tmp_path / "ship")["query_state"] is True and run_config(tmp_path / "old")["query_state"] is False


def test_agreement_on_bench_answers(tmp_path):
    """`experiments.agreement`: a training run's drafters scored teacher-forced on a benchmark run's plain
    answers (every turn, rebuilt with the benchmark's own chat prompts), beside the benchmark's
    accepted-per-drafted rate of the same method; a folder that is not a benchmark run is refused."""
    from experiments.agreement import agreement, bench_examples, table
    from moaspec.bench.answers import answer_path, read_answers
    from moaspec.bench.suite import BenchConfig, run

    (tmp_path / "data").mkdir()
    data = _slice(tmp_path / "data", 8, 2)
    cfg = TrainConfig(data=str(data), out=str(tmp_path / "run"), steps=5, batch_size=1, max_len=64,
                      vocab_ids=1024, warmup=1, val_every=1000, save_every=1000, val_sequences=2, seed=3)
    Trainer(cfg).run()
    bench = tmp_path / "bench"
    run(BenchConfig(model=cfg.model, methods=("plain", "moa"), tasks=("mtbench",), questions=1, max_new_tokens=8,
                    temperatures=(0.0,), tree="2,1,2", checkpoints=str(tmp_path / "run"), out=str(bench)))
    tr = Trainer(cfg)
    by_task = bench_examples(bench, tr.tokenizer)
    assert list(by_task) == ["mtbench"]
    examples = by_task["mtbench"]
    record = next(iter(read_answers(answer_path(bench, "plain", 0.0)).values()))["choices"][0]
    assert len(examples) == 2  # both MT-Bench turns; the second prompt holds the first answer
    for ex, ids in zip(examples, record["token_ids"], strict=True):
        assert ex.ids[ex.prompt_len:] == ids and ex.answer_from_target
    assert record["turns"][0] in tr.tokenizer.decode(examples[1].ids[:examples[1].prompt_len])

    result = agreement(tmp_path / "run", bench)
    assert result["bench_answer_tokens"] == sum(record["new_tokens"])
    assert 0.0 <= result["bench_teacher_forced"]["moa"]["top1_by_depth"][1] <= 1.0
    assert result["bench_teacher_forced"]["moa"] == {k: result["by_task"]["mtbench"]["moa"][k]
                                                     for k in ("top1_by_depth", "rows_by_depth", "agreed_by_depth")}
    assert sum(result["bench_teacher_forced"]["moa"]["rows_by_depth"].values()) > 0
    assert "| mtbench |" in table(result) and "| all |" in table(result)
    assert 0.0 <= result["bench_accepted_per_drafted"]["moa"] <= 1.0
    with pytest.raises(UserError, match="not a `moaspec bench` output"):
        bench_examples(tmp_path / "run", tr.tokenizer)
    moved = data.rename(tmp_path / "moved")  # the run's data folder is gone: another of its target stands in
    with pytest.raises(UserError, match="pass --data"):
        agreement(tmp_path / "run", bench)
    assert agreement(tmp_path / "run", bench, data=str(moved))["by_task"] == result["by_task"]


def test_agreement_pools_tasks_by_rows():
    """Per-task agreements pool weighted by their rows at each depth, not averaged per task."""
    from experiments.agreement import pooled

    a = {"moa": {"top1_by_depth": {1: 0.5, 2: 0.25}, "rows_by_depth": {1: 10, 2: 4}, "agreed_by_depth": {1: 5, 2: 1}}}
    b = {"moa": {"top1_by_depth": {1: 0.2}, "rows_by_depth": {1: 30}, "agreed_by_depth": {1: 6}}}
    assert pooled([a, b]) == {"moa": {"top1_by_depth": {1: 0.275, 2: 0.25}, "rows_by_depth": {1: 40, 2: 4},
                                      "agreed_by_depth": {1: 11, 2: 1}}}


@pytest.mark.slow  # a learning curve run (~15 s): make test-slow
def test_learning_curve_points_nest_are_saved_and_resume(tmp_path):
    """`training.curve`: one run validated at each budget; each point's drafters are saved as a folder
    that `export` takes and that equals a run stopped at the same step; a finished curve reruns to the
    same points without training again."""
    from moaspec.training import curve

    data = _slice(tmp_path, 10, 2)

    def config(out: str) -> TrainConfig:
        return TrainConfig(kind="moa,eagle", data=str(data), out=str(tmp_path / out), batch_size=1, max_len=64,
                           vocab_ids=1024, warmup=1, val_sequences=2, seed=3)

    result = curve.run(config("curve"), [300, 120])
    points = result["points"]
    assert [p["budget"] for p in points] == [120, 300]
    assert points[0]["tokens"] >= 120 and points[1]["tokens"] >= 300 and points[0]["step"] < points[1]["step"]
    assert set(points[0]["val"]) == {"moa", "eagle"} and set(points[0]["val_context_mean"]) == {"moa"}
    assert (tmp_path / "curve" / "curve.png").exists()

    first = tmp_path / "curve" / "points" / "120"
    stopped = Trainer(config("stopped"))
    cfg = stopped.cfg
    cfg.data_tokens, cfg.epochs, cfg.lr_min = 300, 1.0, cfg.lr  # as the curve runs it
    stopped = Trainer(cfg)
    stopped.run(until=points[0]["step"])

    def same_as_stopped(folder: Path) -> bool:
        at_point = Trainer(cfg)
        at_point.load_drafters(folder)
        states = [(a.drafter.trainable_state_dict(), b.drafter.trainable_state_dict())
                  for a, b in zip(stopped.students, at_point.students, strict=True)]
        return all(torch.equal(sa[k], sb[k]) for sa, sb in states for k in sa)

    assert same_as_stopped(first) and not same_as_stopped(first.with_name("120-annealed"))
    assert json.loads((first / "moa" / "training.json").read_text())["steps"] == points[0]["step"]
    # the decay branch after the first point left the constant-rate run as it was
    stopped.run(until=points[1]["step"])
    assert same_as_stopped(first.with_name("300"))
    assert all(p["decay_steps"] == max(1, round(0.1 * p["step"])) and set(p["val_annealed"]) == {"moa", "eagle"}
               for p in points)
    assert [p.name for p in export(first, tmp_path / "ship")] == ["moa", "eagle"]

    before = (tmp_path / "curve" / "curve.json").read_text()
    again = curve.run(config("curve"), [120, 300])["points"]  # nothing left to train
    assert again == json.loads(before)["points"] and [p["step"] for p in again] == [p["step"] for p in points]
    assert (tmp_path / "curve" / "curve.json").read_text() == before


@pytest.mark.slow  # a data job then training (~25 s): make test-slow
def test_features_stored_by_the_data_job_are_what_training_reads(tmp_path, monkeypatch):
    """`moaspec data --engine moaspec --features` then `moaspec train --target-weights fp16`: the
    training run reads the answers' features the data job stored (no second pass over them), computes
    the rest (package text, validation's argmax) in the same mode, and trains."""
    from moaspec.training import features as F

    monkeypatch.setattr(F, "cache_dir", lambda: tmp_path / "cache")
    with pytest.raises(UserError, match="--engine moaspec"):
        D.DataConfig(engine="transformers", features=True)
    cfg = D.DataConfig(model="smollm2-135m", tokens=2400, text_fraction=0.25, prompts=40, max_new_tokens=24,
                       engine="moaspec", weights="fp16", features=True, parallel=4, shard_tokens=800,
                       val_fraction=0.25)
    D.Builder(cfg, tmp_path / "data").run()
    folder = tmp_path / "data" / cfg.folder_name()
    rows = D.load(folder)
    gen = [r for r in rows if r.mode != "text"]
    stored = list((tmp_path / "cache" / "features").glob("answers-*-fp16/*.npz"))
    assert gen and len(stored) == len(gen)
    tr = Trainer(TrainConfig(data=str(folder), out=str(tmp_path / "run"), steps=2, batch_size=2, max_len=96,
                             vocab_ids=2048, warmup=1, val_every=1000, save_every=1000, val_sequences=2,
                             target_weights="fp16", epochs=0))
    assert tr.features_target.weights == "fp16" and tr.target.weights == "fp32"
    tr.run(resume=False)
    cache = tr.caches["train"]
    answered = sum(len(e.ids) for e in tr.train if e.answer_from_target and cache.done[e.index])
    assert cache.read_tokens == answered > 0
