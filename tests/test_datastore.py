"""The suffix drafter's datastore (drafters/datastore.py): suffix array and longest match against brute
force, drafts and their probabilities from counted continuations, files and their errors, the shipped
stores, and greedy losslessness end to end on SmolLM2 with the shipped store."""

from __future__ import annotations

import random

import numpy as np
import pytest
from conftest import assert_same_or_near_tie
from prompts import PROMPTS

from moaspec import cli
from moaspec.bench.suite import BenchConfig, resolve_methods
from moaspec.decoding.engine import Engine, GenerationConfig
from moaspec.decoding.target import LocalTarget
from moaspec.decoding.tree import AdaptiveChain, TreeConfig
from moaspec.drafters import build_drafter, shipped_checkpoint
from moaspec.drafters.datastore import SEP, Datastore, suffix_array
from moaspec.drafters.suffix import SuffixDrafter
from moaspec.errors import UserError
from moaspec.training.data import Sequence, answers, write_shard

CHAIN4 = TreeConfig(4, 1, 4)


def _seqs(seed: int, n: int = 30, vocab: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(1, 40))] for _ in range(n)]


def test_suffix_array_sorts_suffixes_by_their_first_tokens():
    store = Datastore.from_sequences(_seqs(0), "toy", max_match=6)
    toks = np.frombuffer(store.tokens, dtype=np.uint32)
    sa = list(store.sa)
    starts = [i for i in range(len(toks)) if toks[i] != SEP]
    assert sorted(sa) == starts  # every non-separator suffix once

    def key(i: int) -> list[int]:
        return [*toks[i:i + 6].tolist(), *[SEP] * 6][:6]

    assert [key(i) for i in sa] == sorted(key(i) for i in starts)
    assert suffix_array(np.array([3, SEP, 3, 1], dtype=np.uint32), 2).tolist() == [3, 2, 0]


def test_longest_match_and_ranges_match_brute_force():
    seqs = _seqs(1)
    store = Datastore.from_sequences(seqs, "toy", max_match=8)
    rng = random.Random(2)
    for _ in range(200):
        tail = [rng.randrange(6) for _ in range(rng.randrange(1, 12))]  # token 5 never occurs
        m, lo, hi = store.longest_match(tail)

        def occurrences(p: list[int]) -> int:
            return sum(q[i:i + len(p)] == p for q in seqs for i in range(len(q) - len(p) + 1))

        want = max((k for k in range(1, min(8, len(tail)) + 1) if occurrences(tail[-k:])), default=0)
        assert m == want, tail
        if m:
            assert hi - lo == occurrences(tail[-m:])


def test_drafts_the_counted_continuations():
    # after [7, 8, 9]: 10 11 three times, 12 once; a separator ends a continuation
    seqs = [[7, 8, 9, 10, 11]] * 3 + [[1, 7, 8, 9, 12, 13], [7, 8, 9]]
    store = Datastore.from_sequences(seqs, "toy")
    d = store.draft([5, 7, 8, 9], TreeConfig(3, 2, 4), spec_factor=1.0, min_prob=0.0)
    assert d.match_len == 3
    assert list(zip(d.tokens, d.parents, d.probs, strict=True)) == [
        (10, -1, 0.6), (11, 0, 0.6), (12, -1, 0.2), (13, 2, 0.2)]
    assert store.draft([5, 7, 8, 9], TreeConfig(3, 2, 4), 1.0, min_prob=0.3).tokens == [10, 11]
    assert store.draft([9], CHAIN4, spec_factor=1.0, min_prob=0.0).tokens == [10]  # one token of match: one level
    assert store.draft([4, 4], CHAIN4, 1.0, 0.0).tokens == []  # no match


def test_a_match_that_only_ends_answers_falls_back_to_a_shorter_one():
    store = Datastore.from_sequences([[1, 2, 3], [5, 2, 3, 4]], "toy")
    d = store.draft([1, 2, 3], CHAIN4, spec_factor=1.0, min_prob=0.0)
    assert (d.tokens, d.probs, d.match_len) == ([4], [0.5], 2)


def test_samples_spread_over_a_large_range():
    seqs = [[1, 2]] * 300 + [[1, 3]] * 100
    store = Datastore.from_sequences(seqs, "toy", samples=40)
    d = store.draft([1], TreeConfig(1, 2, 2), 1.0, 0.0)
    assert d.tokens == [2, 3] and d.probs == pytest.approx([0.75, 0.25], abs=0.03)


def test_suffix_drafter_takes_the_store_where_the_text_has_nothing():
    store = Datastore.from_sequences([[20, 21, 22, 23, 24, 25]] * 2, "toy")
    plain, with_store = SuffixDrafter(), SuffixDrafter(store=store)
    for d in (plain, with_store):
        d.begin([1, 2, 20])
    assert plain.propose(21, CHAIN4).tokens == [21]
    assert with_store.propose(21, CHAIN4).tokens == [21, 22, 23]  # match [20, 21]: two levels
    with_store.observe([21, 22])
    assert with_store.propose(23, CHAIN4).tokens == [23, 24, 25]
    # the current text wins where it scores as well: it repeats itself differently here
    with_store.begin([20, 21, 30, 31, 32, 20])
    assert with_store.propose(21, CHAIN4).tokens == [21, 30, 31]


def test_files_round_trip_and_bad_files_are_clear_errors(tmp_path):
    store = Datastore.from_sequences(_seqs(3), "toy", max_match=5, samples=9)
    back = Datastore.load(store.save(tmp_path / "s"), "toy")
    assert (back.tokens, back.sa, back.max_match, back.samples) == (store.tokens, store.sa, 5, 9)
    with pytest.raises(UserError, match="is for toy, not other"):
        Datastore.load(tmp_path / "s", "other")
    (tmp_path / "s" / "datastore.npz").write_bytes(b"not a zip")
    with pytest.raises(UserError, match="not a readable datastore"):
        Datastore.load(tmp_path / "s")
    with pytest.raises(UserError, match="not a readable datastore"):
        Datastore.load(tmp_path / "missing")
    good = (tmp_path / "s" / "config.json").read_text()
    store.save(tmp_path / "s")
    (tmp_path / "s" / "datastore.npz").write_bytes((tmp_path / "s" / "datastore.npz").read_bytes()[:200])
    with pytest.raises(UserError, match="not a readable datastore"):  # truncated
        Datastore.load(tmp_path / "s")
    Datastore.from_sequences([[1, 2]], "toy").save(tmp_path / "s")  # a store of another size ...
    (tmp_path / "s" / "config.json").write_text(good)  # ... under the first one's config
    with pytest.raises(UserError, match="holds 3"):
        Datastore.load(tmp_path / "s")
    with pytest.raises(UserError, match="max_match in"):
        Datastore.from_sequences([[1]], "toy", max_match=1)
    with pytest.raises(UserError, match="max_match in"):
        Datastore.from_sequences([[1]], "toy", max_match=65)
    with pytest.raises(UserError, match="one row of ids"):
        Datastore(np.array([-1, 5]), "toy")
    with pytest.raises(UserError, match="non-empty"):
        Datastore.from_sequences([[]], "toy")


@pytest.mark.parametrize("model", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_shipped_stores_load_for_their_target(model):
    store = Datastore.load(shipped_checkpoint("datastore", model), model)
    assert len(store) > 100_000 and store.model == model


def _data_folder(path, model: str):
    path.mkdir()
    (path / "config.json").write_text(f'{{"model": "{model}", "val_fraction": 0.0}}')
    write_shard(path / "gen-00000.npz", [Sequence("a", "chat", [1, 2, 3, 4, 5], 3, mode="greedy"),
                                         Sequence("b", "chat", [6, 7, 8], 1, mode="sampled")])
    return path


def test_cli_builds_a_store_from_a_data_folder_and_checks_its_flags(tmp_path, capsys):
    data = _data_folder(tmp_path / "data", "smollm2-135m")
    assert list(answers(data, "smollm2-135m")) == [[2, 3, 4, 5], [6, 7, 8]]  # two prompt tokens at the most
    assert cli.main(["datastore", "--model", "smollm2-135m", "--data", str(data), "--to", str(tmp_path / "st")]) == 0
    assert len(Datastore.load(tmp_path / "st", "smollm2-135m")) == 9
    for argv, message in [
        (["datastore", "--model", "qwen2.5-coder-0.5b", "--data", str(data), "--to", str(tmp_path / "x")],
         "holds data for smollm2-135m"),
        (["datastore", "--model", "smollm2-135m", "--data", str(data), "--sources", "gen,web"], "unknown data source"),
        (["datastore", "--model", "smollm2-135m", "--data", str(data), "--sources", "text", "--to", str(tmp_path)],
         "no text shards"),
        (["datastore", "--model", str(tmp_path), "--data", str(data)], "pass --to DIR"),
        (["generate", "--drafter", "lookup", "--datastore", "none", "--prompt", "x"], "only applies to --drafter"),
        (["generate", "--drafter", "suffix", "--datastore", str(tmp_path / "nope"), "--prompt", "x"], "no such folder"),
    ]:
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (argv, err)


def test_a_store_past_the_vocabulary_is_refused(dec_none, tmp_path):
    Datastore.from_sequences([[1, 10**6]], dec_none.model_name).save(tmp_path / "st")
    with pytest.raises(UserError, match="past smollm2-135m's vocabulary"):
        build_drafter("suffix", dec_none.model_name, dec_none.target, datastore=str(tmp_path / "st"))
    assert build_drafter("hybrid", dec_none.model_name, dec_none.target, datastore="none").free.store is None


def test_bench_runs_the_suffix_drafter_without_its_store():
    methods, _ = resolve_methods(BenchConfig(model="smollm2-135m", methods=("plain", "suffix", "suffix-nostore")))
    assert [(m.name, m.drafter, m.datastore) for m in methods] == [
        ("plain", "none", None), ("suffix", "suffix", None), ("suffix-nostore", "suffix", "none")]


@pytest.mark.parametrize("tree", [TreeConfig.parse("adaptive:6"), TreeConfig(4, 2, 6)])
def test_greedy_output_equals_plain_with_the_shipped_store(dec_none, plain_greedy, tree):
    drafter = build_drafter("suffix", dec_none.model_name, dec_none.target)
    assert drafter.store is not None and drafter.store.model == dec_none.model_name
    adapt = AdaptiveChain({1: 10.0, 2: 10.0, 4: 10.5, 8: 12.0}, 6) if tree.adaptive else None
    engine = Engine(LocalTarget(dec_none.target), drafter, tree, adapt)
    store_rounds = 0
    for prompt in (PROMPTS[3], PROMPTS[14]):
        prompt_ids, plain = plain_greedy(prompt, 48)
        got = []
        for chunk in engine.stream(prompt_ids, GenerationConfig(max_new_tokens=48)):
            got += chunk.tokens
            store_rounds += drafter.last.source == "store"
        assert_same_or_near_tie(dec_none.target, prompt_ids, plain, got, "suffix + store")
    assert store_rounds > 0
