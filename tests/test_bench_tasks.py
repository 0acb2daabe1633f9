"""Benchmark task sets: sizes, unique ids, reproducibility, and no overlap with the committed training data."""

from __future__ import annotations

import random

import pytest
from conftest import DATA_DIRS, SMOL, data_dir_params

from moaspec import tasks as bench
from moaspec.errors import UserError
from moaspec.tasks import TASKS, Question, check_clean, load_tasks
from moaspec.training import prompts as training
from moaspec.training.data import texts


@pytest.fixture(scope="module")
def questions() -> list[Question]:
    return load_tasks(None, None, seed=0)


def by_task(questions: list[Question], task: str) -> list[Question]:
    return [q for q in questions if q.task == task]


def test_every_task_is_large_enough_with_unique_ids_and_texts(questions):
    assert {q.task for q in questions} == set(TASKS)
    for task in TASKS:
        qs = by_task(questions, task)
        assert len(qs) >= 40, task
        assert len({q.turns[0] for q in qs}) == len(qs), task
        assert all(q.id.startswith(f"{task}-") and q.source and all(t.strip() for t in q.turns) for q in qs)
    assert len({q.id for q in questions}) == len(questions)
    mtbench = by_task(questions, "mtbench")
    assert len(mtbench) == 80 and all(len(q.turns) == 2 for q in mtbench) and mtbench[0].id == "mtbench-81"
    assert len(by_task(questions, "humaneval")) == 164
    assert all(len(q.turns) == 1 for q in questions if q.task != "mtbench")
    assert all(q.answer for q in by_task(questions, "math") + by_task(questions, "qa"))


def test_deterministic_for_a_seed_and_n_takes_a_prefix(questions):
    assert load_tasks(None, None, seed=0) == questions
    for task in TASKS:
        assert load_tasks([task], 5, seed=0) == by_task(questions, task)[:5]
    for task in ("math", "instruction", "summarisation", "qa"):
        assert [q.turns for q in load_tasks([task], None, seed=1)] != [q.turns for q in by_task(questions, task)]


def test_summarisation_and_qa_use_disjoint_topics_and_passages_of_150_to_400_words():
    summary_topics, qa_topics = bench.doc_topic_split()
    assert summary_topics and qa_topics and not set(summary_topics) & set(qa_topics)
    words = [len(text.split()) for passages in bench.doc_passages().values() for _, text in passages]
    assert min(words) >= 150 and max(words) <= 400
    summaries = [q.turns[0] for q in load_tasks(["summarisation"], 1000)]
    qa = [q.turns[0].split("\n\nQuestion: ")[0] for q in load_tasks(["qa"], 1000)]
    assert not check_clean([Question(f"qa-{i}", "qa", [t], "") for i, t in enumerate(qa)], summaries)


def test_synthesised_sets_avoid_the_training_templates(questions):
    used = training.SUBJECTS + training.TOPICS + training.ACTIVITIES
    assert not [s for s in used for q in by_task(questions, "instruction") if s.lower() in q.turns[0].lower()]
    synthetic = [p.text for p in training.synthetic_prompts(random.Random(0), 3000)]
    assert not check_clean(by_task(questions, "math") + by_task(questions, "instruction"), synthetic)


def test_every_target_has_committed_data():
    assert {f.name.split("-v")[0] for f in DATA_DIRS} >= {SMOL, "qwen2.5-coder-0.5b"}


@pytest.mark.parametrize("folder", data_dir_params())
def test_no_question_overlaps_the_committed_training_data(questions, folder):
    sample = list(texts(folder))
    assert len(sample) > 200
    assert check_clean(questions, sample) == []
    # the check can fail: a question that quotes eight words of a training text, or repeats one, is flagged
    eight = " ".join(sample[0].split()[:8])
    leaky = [Question("leak-0", "qa", [f"Please answer this: {eight} and more."], "test"),
             Question("leak-1", "mtbench", ["Hello there.", sample[-1].upper()], "test"), questions[0]]
    assert check_clean(leaky, sample) == ["leak-0", "leak-1"]


def test_unknown_task_and_bad_folders_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="unknown task nope"):
        load_tasks(["math", "nope"], None)
    with pytest.raises(UserError):
        load_tasks(["math"], 0)
    with pytest.raises(UserError, match="moaspec data"):
        list(texts(tmp_path))
