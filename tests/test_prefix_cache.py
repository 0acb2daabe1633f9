"""Conversations that pick up where they left off: a start reuses the longest cached prefix of its prompt (the
decoder's own cache, or a finished session's from the prefix cache) and the answer is token-identical to the
same request sent cold, in every weight mode, greedy and seeded; the API reports the cached tokens, the cache
stays within its budget, and an evicted conversation is recomputed, never answered wrongly."""

from __future__ import annotations

import threading

import httpx
import pytest
import torch
from conftest import require_kernels
from openai import OpenAI
from servers import Running

from moaspec.decoding.engine import GenerationConfig
from moaspec.decoding.prefix_cache import PrefixCache, common_prefix
from moaspec.decoding.sampling import SamplingParams
from moaspec.models import quant
from moaspec.models.runtime import PREFILL_CHUNK
from moaspec.pipeline import SpecDecoder
from moaspec.serving.openai_api import ApiLimits, create_app

SMOL = "smollm2-135m"
KEY = "prefix-key"
SYSTEM = "You are a careful assistant who answers in a few sentences. " * 12
TURNS = ["Write a Python function that reverses a string.", "Now make it recursive.", "Add a docstring to it."]
MODES = ["gguf", "int8", "int4", "fp16"]


def _conversation(dec: SpecDecoder, cold: SpecDecoder, cfg: GenerationConfig, drafter_turns=TURNS):
    """Each turn warm on `dec` and cold on `cold` (its cache emptied first): (cached tokens, answers equal)."""
    conv = [{"role": "system", "content": SYSTEM}]
    out = []
    for q in drafter_turns:
        conv.append({"role": "user", "content": q})
        ids = dec.encode(conv)
        warm = dec.generate(ids, cfg)
        cold.release()
        cold.target.cache.reset()
        ref = cold.generate(ids, cfg)
        out.append((warm.metrics.cached_tokens, warm.token_ids == ref.token_ids, len(ids)))
        conv.append({"role": "assistant", "content": warm.text})
    return out


@pytest.mark.parametrize("weights", MODES)
@pytest.mark.parametrize("seed", [None, 5])
def test_a_warm_turn_equals_the_same_turn_cold(weights, seed):
    """3 turns with a 150-token system prompt, the suffix drafter: every warm answer equals the cold one; from
    turn 2 the conversation so far comes from the cache (row-invariant modes: all but the new turn's tokens;
    fp16: whole prefill chunks)."""
    if weights != "fp16":
        require_kernels()
    dec = SpecDecoder(SMOL, drafter="suffix", weights=weights, tree="adaptive:4", warmup=False)
    cold = SpecDecoder(SMOL, drafter="suffix", weights=weights, tree="adaptive:4", warmup=False)
    sampling = SamplingParams() if seed is None else SamplingParams(temperature=0.8, seed=seed)
    turns = _conversation(dec, cold, GenerationConfig(max_new_tokens=32, sampling=sampling))
    assert all(same for _, same, _ in turns), turns
    assert turns[0][0] == 0
    for cached, _, n in turns[1:]:
        if weights == "fp16":
            assert cached >= PREFILL_CHUNK and cached % PREFILL_CHUNK == 0, turns
        else:
            assert cached >= n - 40, turns  # the previous turns all but their ending's re-tokenised tail


@pytest.mark.needs_kernels
@pytest.mark.parametrize("drafter", ["none", "lookup", "recycling"])
def test_every_token_drafter_keeps_a_conversation_lossless(drafter):
    dec = SpecDecoder(SMOL, drafter=drafter, weights="gguf", tree="adaptive:4", warmup=False)
    cold = SpecDecoder(SMOL, drafter=drafter, weights="gguf", tree="adaptive:4", warmup=False)
    turns = _conversation(dec, cold, GenerationConfig(max_new_tokens=24))
    assert all(same for _, same, _ in turns) and all(c > 0 for c, _, _ in turns[1:]), turns


def _cache_of(model, ids: list[int]):
    c = model.new_cache(64)
    c.reserve(len(ids))
    c.length = len(ids)
    c.ids = list(ids)
    c.exact = len(ids)
    return c


def test_the_prefix_cache_keeps_the_longest_within_its_budget(smol_model):
    """The longest of one conversation's caches is kept, least recently used out first within the budget, and
    a cache is offered only to the model that computed it (another weight mode's K/V would be wrong)."""
    one = _cache_of(smol_model, list(range(10)))
    size = one.nbytes
    store = PrefixCache(budget=2 * size)
    store.put(smol_model, one)
    assert len(store) == 1
    store.put(smol_model, _cache_of(smol_model, list(range(20))))  # extends the first: the first goes
    assert len(store) == 1 and one.capacity == 0  # its memory given back
    store.put(smol_model, _cache_of(smol_model, [7] * 12))
    assert len(store) == 2
    into = smol_model.new_cache(64)
    other_mode = object()  # the same weights in another mode: a model of its own
    assert store.copy_best(other_mode, list(range(15)) + [99], into, lambda c, n: n) == 0 and into.length == 0
    got = store.copy_best(smol_model, list(range(15)) + [99], into, lambda c, n: n)
    assert got == 15 and into.ids == list(range(15)) and into.length == 15
    assert torch.equal(into.k[:, :, :15], store._entries[1][1].k[:, :, :15])
    store.put(smol_model, _cache_of(smol_model, [3] * 5))  # over budget: the least recently used goes
    assert len(store) == 2 and store.nbytes <= store.budget and store.evictions == 1
    assert store.copy_best(smol_model, [7] * 12, into, lambda c, n: n) == 0  # it was the evicted one
    empty = _cache_of(smol_model, [1, 2])
    empty.ids = []  # slots whose tokens nobody recorded: nothing reusable
    assert empty.capacity > 0
    store.put(smol_model, empty)  # not kept, its memory given back
    assert len(store) == 2 and empty.capacity == 0
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2 and common_prefix([], [1]) == 0


@pytest.fixture(scope="module")
def served():
    dec = SpecDecoder(SMOL, drafter="suffix", weights="int8" if quant.available() else "fp16", tree="adaptive:4")
    app = create_app(dec, SMOL, token=KEY, limits=ApiLimits(max_prompt_tokens=1024, max_tokens=64, parallel=4,
                                                             cache_ram_mb=64))
    run = Running(app, path="/v1")
    yield app.state.api, run
    run.stop()
    app.state.api.close()


def test_the_api_reports_cached_tokens_and_answers_as_cold(served):
    """A 3-turn chat over the API: `usage.prompt_tokens_details.cached_tokens` from turn 2 on, the same
    answers as a server without a prefix cache would give (the decoder cold), the hit rate on /metrics."""
    api, run = served
    client = OpenAI(base_url=run.url, api_key=KEY, max_retries=0, timeout=300)
    cold = SpecDecoder(SMOL, drafter="suffix", weights=api.gen.weights, tree="adaptive:4", warmup=False)
    conv = [{"role": "system", "content": SYSTEM}]
    for i, q in enumerate(TURNS):
        conv.append({"role": "user", "content": q})
        r = client.chat.completions.create(model=SMOL, messages=conv, max_tokens=24, temperature=0)
        cached = r.usage.prompt_tokens_details.cached_tokens
        assert (cached == 0) if i == 0 else (cached > r.usage.prompt_tokens // 2), (i, r.usage)
        cold.target.cache.reset()
        ref = cold.generate(cold.encode(conv), GenerationConfig(max_new_tokens=24))
        assert r.choices[0].message.content == ref.text
        conv.append({"role": "assistant", "content": r.choices[0].message.content})
    metrics = httpx.get(run.url.removesuffix("/v1") + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    assert "moaspec_prefix_cache_hit_rate" in metrics and "moaspec_prefix_cache_bytes" in metrics


def test_a_shared_system_prompt_is_reused_by_concurrent_sessions_within_the_budget(served):
    """8 clients at once, each its own question after the same long system prompt, twice: the second round
    finds the system prompt cached for every client, answers equal the first round's, and the kept caches
    never exceed the budget (evictions happen, nothing is answered wrongly)."""
    api, run = served
    client = OpenAI(base_url=run.url, api_key=KEY, max_retries=0, timeout=300)
    questions = [f"Give me fact number {i} about the number {i * 7}." for i in range(8)]

    def ask(i: int, out: list) -> None:
        r = client.chat.completions.create(model=SMOL, max_tokens=16, temperature=0, messages=[
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": questions[i]}])
        out[i] = (r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens)

    rounds = []
    for _ in range(2):
        out: list = [None] * 8
        threads = [threading.Thread(target=ask, args=(i, out)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        rounds.append(out)
        assert api.gen.prefix.nbytes <= api.gen.prefix.budget
    assert [a for a, _ in rounds[0]] == [a for a, _ in rounds[1]]
    assert all(c >= 100 for _, c in rounds[1]), rounds[1]


SUBJECTS = ["strings", "lists", "files", "dates", "numbers", "sets", "dicts", "classes", "errors", "tests",
            "loops", "regexes", "JSON"]


@pytest.mark.slow
@pytest.mark.needs_kernels
def test_208_conversations_warm_equal_cold_in_every_mode_and_drafter():
    """4 weight modes x 4 token drafters x 13 conversations of 3 turns (the issue's >= 200 conversation x
    drafter runs): every warm turn token-identical to the same turn cold."""
    runs = mismatches = 0
    for weights in MODES:
        for drafter in ("none", "lookup", "suffix", "recycling"):
            dec = SpecDecoder(SMOL, drafter=drafter, weights=weights, tree="adaptive:4", warmup=False)
            cold = SpecDecoder(SMOL, drafter=drafter, weights=weights, tree="adaptive:4", warmup=False)
            for subject in SUBJECTS:
                turns = [f"Write a short Python helper for {subject}.", "Make it shorter.", "Explain it in a line."]
                got = _conversation(dec, cold, GenerationConfig(max_new_tokens=20), turns)
                runs += 1
                mismatches += sum(not same for _, same, _ in got)
                assert all(c > 0 for c, _, n in got[1:] if n > PREFILL_CHUNK or weights != "fp16"), got
    assert runs == 208 and mismatches == 0


@pytest.mark.slow
def test_64_clients_keep_the_cache_within_its_budget_and_every_answer_right():
    """64 clients, 3-turn conversations on 16 shared system prompts, a 48 MB prefix cache (2-4 caches: evicting all the
    time): the kept caches never exceed the budget, and every answer equals the same request alone."""
    dec = SpecDecoder(SMOL, drafter="suffix", weights="int8" if quant.available() else "fp16", tree="adaptive:4")
    app = create_app(dec, SMOL, token=KEY, limits=ApiLimits(max_prompt_tokens=1024, max_tokens=16, parallel=8,
                                                             max_waiting=64, cache_ram_mb=48))
    api, run = app.state.api, Running(app, path="/v1")
    client = OpenAI(base_url=run.url, api_key=KEY, max_retries=2, timeout=600)
    lone = SpecDecoder(SMOL, drafter="none", weights=api.gen.weights, warmup=False)
    peak, stop, alone = [0], threading.Event(), threading.Lock()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], api.gen.prefix.nbytes)
            stop.wait(0.05)

    def converse(c: int, wrong: list) -> None:
        conv = [{"role": "system", "content": f"System {c % 16}: " + SYSTEM}]
        for q in TURNS:
            conv.append({"role": "user", "content": f"{q} (client {c})"})
            r = client.chat.completions.create(model=SMOL, messages=conv, max_tokens=16, temperature=0)
            text = r.choices[0].message.content
            with alone:  # one decoder, one request at a time
                lone.target.cache.reset()
                want = lone.generate(lone.encode(conv), GenerationConfig(max_new_tokens=16)).text
            if text != want:
                wrong.append((c, q))
            conv.append({"role": "assistant", "content": text})

    watcher = threading.Thread(target=watch)
    watcher.start()
    wrong: list = []
    lock = threading.Lock()

    def safe(c: int) -> None:
        mine: list = []
        converse(c, mine)
        with lock:
            wrong.extend(mine)

    try:
        threads = [threading.Thread(target=safe, args=(c,)) for c in range(64)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(1800)
    finally:
        stop.set()
        watcher.join()
        run.stop()
        api.close()
    assert not wrong, wrong
    assert 0 < peak[0] <= api.gen.prefix.budget and api.gen.prefix.evictions > 0 and api.gen.prefix.hits > 0
