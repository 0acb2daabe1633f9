"""Shared fixtures: the real SmolLM2 model (ours and transformers' reference), one SpecDecoder per drafter.

Everything heavy is session-scoped and built lazily, so a test module pays only for what it uses.
Torch runs single-threaded by default (MOASPEC_TEST_THREADS overrides): the test machine has two cores
that are shared with benchmark runs, and two oversubscribed intra-op pools are far slower than one.
"""

from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path

import pytest
import torch

from moaspec.decoding.engine import GenerationConfig
from moaspec.decoding.tree import Tree
from moaspec.models.runtime import Transformer
from moaspec.models.store import resolve

torch.set_num_threads(int(os.environ.get("MOASPEC_TEST_THREADS", "1")))
# the CLI's --threads default (auto) would otherwise retune this process and every server it starts
os.environ.setdefault("MOASPEC_THREADS", os.environ.get("MOASPEC_TEST_THREADS", "1"))

SMOL = "smollm2-135m"
NEAR_TIE = 1e-4  # a top-2 logit margin below this may legitimately flip under float round-off
DATA_DIRS = sorted(p.parent for p in (Path(__file__).resolve().parents[1] / "data").glob("*/manifest.json"))


ALLOW_NO_KERNELS = "MOASPEC_ALLOW_NO_KERNELS"


def pytest_configure(config):
    config.addinivalue_line("markers", "needs_kernels: needs the compiled int8/int4/GGUF-block kernels; fails where "
                            f"they cannot be built (skips with {ALLOW_NO_KERNELS}=1)")


@functools.cache
def kernels_missing() -> str | None:
    """Why the compiled kernels (those of the default weights, `--weights auto`) cannot be built here, or None."""
    from moaspec.models import quant

    return quant.unavailable_reason()


def require_kernels() -> None:
    """Fail the calling test where the compiled kernels cannot be built, saying why: `make setup` and `make demo`
    fall back to fp16 without a compiler, the tests do not. With MOASPEC_ALLOW_NO_KERNELS=1 it is skipped."""
    if (why := kernels_missing()) is None:
        return
    if os.environ.get(ALLOW_NO_KERNELS) == "1":
        pytest.skip(f"the compiled kernels cannot be built here ({ALLOW_NO_KERNELS}=1): {why}")
    pytest.fail(f"the compiled kernels cannot be built here: {why}\n(set {ALLOW_NO_KERNELS}=1 to skip the tests "
                "that need them)", pytrace=False)


def pytest_collection_modifyitems(config, items):
    """With MOASPEC_ALLOW_NO_KERNELS=1 where the kernels cannot be built, each `needs_kernels` test is marked
    skipped (the summary then names each one, at its own line)."""
    marked = [item for item in items if item.get_closest_marker("needs_kernels")]
    if marked and os.environ.get(ALLOW_NO_KERNELS) == "1" and (why := kernels_missing()):
        for item in marked:
            item.add_marker(pytest.mark.skip(reason=f"the compiled kernels cannot be built here "
                                                    f"({ALLOW_NO_KERNELS}=1): {why}"))


def pytest_runtest_setup(item):
    """`@pytest.mark.needs_kernels` tests fail where the kernels cannot be built, before any fixture is built."""
    if item.get_closest_marker("needs_kernels"):
        require_kernels()


def data_dir_params() -> list:
    """The committed data folders as test parameters. Reading one's text needs its target's tokenizer:
    a folder of a target other than SmolLM2 (the one `make setup` installs) runs with the slow tests,
    whose `make test-slow` installs Qwen."""
    return [pytest.param(f, id=f.name, marks=() if f.name.startswith(SMOL) else (pytest.mark.slow,))
            for f in DATA_DIRS]


@pytest.fixture(scope="session")
def smol_folder():
    return resolve(SMOL)


@pytest.fixture(scope="session")
def hf_smol(smol_folder):
    """transformers' own implementation of SmolLM2: the oracle for our runtime."""
    from moaspec.models.store import reference_model

    return reference_model(smol_folder)


@pytest.fixture(scope="session")
def smol_tokenizer(smol_folder):
    from moaspec.models.store import load_tokenizer

    return load_tokenizer(smol_folder)


def chat_ids(tokenizer, text: str) -> list[int]:
    """A user message rendered with the model's chat template (generation prompt included)."""
    from moaspec.models.store import chat_ids as render

    return render(tokenizer, [{"role": "user", "content": text}])


@pytest.fixture(scope="session")
def smol_model(smol_folder):
    """A bare runtime instance for tests that drive the cache by hand."""
    return Transformer(smol_folder)


def _decoder(drafter: str, **kw):
    from moaspec.pipeline import SpecDecoder

    return SpecDecoder(SMOL, drafter=drafter, **kw)


@pytest.fixture(scope="session")
def dec_none():
    return _decoder("none")


@pytest.fixture(scope="session")
def dec_lookup():
    return _decoder("lookup")


@pytest.fixture(scope="session")
def dec_model():
    """SmolLM2 drafting for itself (DEFAULT_DRAFT_MODEL): at T=0 every draft should be accepted."""
    return _decoder("model")


@pytest.fixture(scope="session")
def decoders(request):
    """drafter name -> SpecDecoder, built on first use."""

    class Lazy(dict):
        def __missing__(self, name):
            self[name] = request.getfixturevalue(f"dec_{name}")
            return self[name]

    return Lazy()


@pytest.fixture(scope="session")
def plain_greedy(dec_none):
    """prompt text -> (prompt ids, plain greedy token ids), memoised across the session."""
    cache: dict[tuple[str, int], tuple[list[int], list[int]]] = {}

    def get(prompt: str, max_new_tokens: int = 64) -> tuple[list[int], list[int]]:
        key = (prompt, max_new_tokens)
        if key not in cache:
            g = dec_none.generate(prompt, GenerationConfig(max_new_tokens=max_new_tokens))
            cache[key] = (g.prompt_ids, g.token_ids)
        return cache[key]

    return get


def top2_margin(model: Transformer, ids: list[int]) -> tuple[float, int]:
    """Margin between the two largest next-token logits after `ids` (fresh prefill), and the argmax."""
    model.reset()
    logits = model.prefill(ids).logits[-1]
    top = logits.topk(2)
    model.reset()
    return float(top.values[0] - top.values[1]), int(top.indices[0])


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or the shorter length if one is a prefix of the other)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def assert_same_or_near_tie(model: Transformer, prompt_ids: list[int], plain: list[int], other: list[int],
                            label: str) -> None:
    """`other` must equal the plain greedy `plain`, unless they part at a documented near-tie of the
    plain run's own logits (top-2 margin < NEAR_TIE), which is reported as a warning."""
    k = first_divergence(plain, other)
    if k is None:
        return
    margin, _ = top2_margin(model, prompt_ids + plain[:k])
    msg = (f"{label}: diverges from plain greedy at new token {k} (plain {plain[k:k + 3]}, "
           f"other {other[k:k + 3]}); plain top-2 logit margin there = {margin:.3e}")
    assert margin < NEAR_TIE, msg
    warnings.warn(f"near-tie accepted: {msg}", stacklevel=2)


def record_grow_tree(monkeypatch, module):
    """Capture the root log-probs and every expand() result of the next propose()."""
    seen: dict = {"expand": []}
    real = module.grow_tree

    def spy(root, root_logprobs, expand, cfg, vocab=None):
        seen["root"] = root_logprobs.clone()

        def recording_expand(tree, frontier):
            lp = expand(tree, frontier)
            seen["expand"].append((Tree(list(tree.tokens), list(tree.parents)), list(frontier), lp.clone()))
            return lp

        tree = real(root, root_logprobs, recording_expand, cfg, vocab)
        seen["tree"] = tree
        return tree

    monkeypatch.setattr(module, "grow_tree", spy)
    return seen
