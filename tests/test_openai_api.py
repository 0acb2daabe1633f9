"""The OpenAI-compatible API (`moaspec serve`) on loopback: a real uvicorn server in this process (its own
thread and event loop) over SmolLM2 with the lookup drafter, driven by the `openai` package and httpx.

Greedy answers (plain and streamed, chat and completions) must equal the SpecDecoder's own output, text
and token counts; errors have OpenAI's shape and status; a client that drops mid-stream stops its
generation and leaves the server working.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from openai import OpenAI
from servers import Running

from moaspec.decoding.engine import GenerationConfig
from moaspec.errors import UserError
from moaspec.serving.api_generation import Job
from moaspec.serving.openai_api import ApiLimits, check_host, create_app

SMOL = "smollm2-135m"
KEY = "api-key-123"
MESSAGES = [{"role": "system", "content": "You are concise."},
            {"role": "user", "content": "Name three primary colors and say why they are called primary."}]
PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
N = 24
LIMITS = ApiLimits(max_prompt_tokens=256, max_tokens=64, max_body_bytes=1 << 16, weight_modes=("fp16",))


@pytest.fixture(scope="module")
def served(dec_lookup):
    app = create_app(dec_lookup, SMOL, token=KEY, limits=LIMITS)
    run = Running(app, path="/v1")
    yield app.state.api, run
    run.stop()


@pytest.fixture(scope="module")
def client(served):
    return OpenAI(base_url=served[1].url, api_key=KEY, max_retries=0, timeout=60)


def _post(served, path: str, body, key: str | None = KEY, **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if isinstance(body, (bytes, str)):
        return httpx.post(served[1].url + path, content=body, headers=headers, **{"timeout": 60, **kw})
    return httpx.post(served[1].url + path, json=body, headers=headers, **{"timeout": 60, **kw})


def _greedy(dec, prompt, n: int = N, stop: tuple[str, ...] = (), chat: bool = True):
    return dec.generate(prompt, GenerationConfig(max_new_tokens=n, stop=stop), chat=chat)


def _speculative(usage) -> dict:
    return usage.model_extra["speculative"]


# ------------------------------------------------------------------------------------ answers
def test_models_list(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [SMOL]
    assert client.models.retrieve(SMOL).id == SMOL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_chat_equals_the_decoders_greedy_output(client, dec_lookup):
    g = _greedy(dec_lookup, MESSAGES)
    r = client.chat.completions.create(model=SMOL, messages=MESSAGES, max_tokens=N, temperature=0)
    assert r.object == "chat.completion" and r.model == SMOL and len(r.choices) == 1
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == g.text
    assert r.choices[0].finish_reason == g.finish_reason
    u = r.usage
    assert (u.prompt_tokens, u.completion_tokens) == (len(g.prompt_ids), len(g.token_ids))
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    spec = _speculative(u)
    assert spec["drafter"] == "lookup"
    assert spec["target_calls"] == g.metrics.target_calls and spec["tau"] == round(g.metrics.tau, 4)
    assert spec["tokens_per_s"] > 0
    # max_completion_tokens is max_tokens' newer name
    r2 = client.chat.completions.create(model=SMOL, messages=MESSAGES, max_completion_tokens=N, temperature=0)
    assert r2.choices[0].message.content == g.text


def test_chat_stream_equals_the_decoders_greedy_output(client, dec_lookup):
    g = _greedy(dec_lookup, MESSAGES)
    chunks = list(client.chat.completions.create(model=SMOL, messages=MESSAGES, max_tokens=N, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == g.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == g.finish_reason and all(f is None for f in finishes[:-1])
    assert len(chunks) > 4  # one event per round, not one at the end
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(g.prompt_ids), len(g.token_ids))
    assert _speculative(usage)["target_calls"] == g.metrics.target_calls
    # without include_usage: no usage chunk; the raw stream ends with [DONE]
    with httpx.stream("POST", str(client.base_url.join("chat/completions")), timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": SMOL, "messages": MESSAGES, "max_tokens": 4, "temperature": 0,
                            "stream": True}) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = [line for line in resp.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    bodies = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert all(b["choices"] and "usage" not in b for b in bodies)


def test_each_chunk_says_who_wrote_its_tokens_and_a_request_picks_drafter_and_weights(served, client):
    """The `moaspec` field of each streamed chunk cuts its text per token with its origin and the round, and
    carries the live figures; `drafter` and `weights` (offered by GET /v1/moaspec) pick what answers, and
    the answer is that decoder's own (fp16 weights loaded on first use)."""
    offer = httpx.get(served[1].url + "/moaspec", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert offer["drafter"] == "lookup" and {"none", "lookup", "suffix"} <= set(offer["drafters"])
    assert offer["weights"] == "fp32" and "fp16" in offer["weight_modes"] and offer["link"] == "local"
    from moaspec.pipeline import SpecDecoder

    want = _greedy(SpecDecoder(SMOL, drafter="none", weights="fp16"), MESSAGES)
    chunks = list(client.chat.completions.create(model=SMOL, messages=MESSAGES, max_tokens=N, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"drafter": "suffix", "weights": "fp16"}))
    ext = [c.model_extra["moaspec"] for c in chunks if c.choices and "moaspec" in c.model_extra]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    assert "".join(t for e in ext for t, _ in e["pieces"]) == text
    assert {o for e in ext for _, o in e["pieces"]} <= {"suffix", "target"}
    assert [e["round"] for e in ext] == sorted(e["round"] for e in ext)
    last = ext[-1]
    assert (last["drafter"], last["weights"], last["link"]) == ("suffix", "fp16", "local")
    assert last["tokens"] == len(want.token_ids) and last["target_calls"] >= 1 and last["tau"] >= 1
    spec = _speculative(chunks[-1].usage)
    assert (spec["drafter"], spec["weights"]) == ("suffix", "fp16")
    # naming the server's own drafter keeps it as the server built it, with its parts
    api = create_app(SpecDecoder(SMOL, drafter="hybrid", hybrid_model="recycling"), SMOL).state.api
    fork = api.gen.fork(Job(want.prompt_ids, GenerationConfig(), api.gen.weights, "hybrid", pieces=True))
    assert fork._drafter_args["hybrid_model"] == "recycling" and fork.drafter.model.name == "recycling"
    fork.close()
    api.close()
    # what is not offered is refused, saying what is
    _error(_post(served, "/chat/completions", {"model": SMOL, "messages": MESSAGES, "drafter": "nope"}), 400,
           param="drafter")
    _error(_post(served, "/chat/completions", {"model": SMOL, "messages": MESSAGES, "weights": "int3"}), 400,
           param="weights")


def test_completions_equal_the_decoders_greedy_output(client, dec_lookup):
    g = _greedy(dec_lookup, PROMPT, chat=False)
    r = client.completions.create(model=SMOL, prompt=PROMPT, max_tokens=N, temperature=0)
    assert r.object == "text_completion"
    assert r.choices[0].text == g.text and r.choices[0].finish_reason == g.finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(g.prompt_ids), len(g.token_ids))
    by_ids = client.completions.create(model=SMOL, prompt=g.prompt_ids, max_tokens=N, temperature=0)
    assert by_ids.choices[0].text == g.text
    chunks = list(client.completions.create(model=SMOL, prompt=[PROMPT], max_tokens=N, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == g.text
    assert chunks[-1].usage.completion_tokens == len(g.token_ids)


def test_stop_strings_cut_text_and_tokens(client, dec_lookup):
    full = _greedy(dec_lookup, PROMPT, chat=False)
    words = full.text.split()
    stop = next(w for w in words[len(words) // 2:] if len(w) >= 3)
    g = _greedy(dec_lookup, PROMPT, stop=(stop,), chat=False)
    assert g.finish_reason == "stop" and len(g.token_ids) < len(full.token_ids)
    for given in (stop, ["<never>", stop]):
        r = client.completions.create(model=SMOL, prompt=PROMPT, max_tokens=N, temperature=0, stop=given)
        assert r.choices[0].text == g.text and r.choices[0].finish_reason == "stop"
        assert r.usage.completion_tokens == len(g.token_ids) == g.metrics.new_tokens
    chunks = list(client.completions.create(model=SMOL, prompt=PROMPT, max_tokens=N, temperature=0, stop=stop,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == g.text
    assert chunks[-1].usage.completion_tokens == len(g.token_ids)


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model=SMOL, prompt=PROMPT, max_tokens=12, temperature=0.9, top_p=0.95)
    a = client.completions.create(seed=7, **kw).choices[0].text
    assert client.completions.create(seed=7, **kw).choices[0].text == a


def test_requests_run_one_at_a_time(served, client, dec_lookup):
    g = _greedy(dec_lookup, MESSAGES, n=12)
    out: list[str | None] = [None, None]

    def ask(i: int) -> None:
        out[i] = client.chat.completions.create(model=SMOL, messages=MESSAGES, max_tokens=12,
                                                temperature=0).choices[0].message.content

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert out == [g.text, g.text]


# ------------------------------------------------------------------------------------ errors
def _error(resp: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def test_bad_or_missing_key_is_401(served):
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=served[1].url, api_key="wrong", max_retries=0).models.list()
    body = {"model": SMOL, "messages": MESSAGES, "max_tokens": 2}
    _error(_post(served, "/chat/completions", body, key=None), 401, code="invalid_api_key")
    _error(_post(served, "/chat/completions", body, key="wrong"), 401, code="invalid_api_key")
    assert httpx.get(served[1].url + "/models").status_code == 401


def test_request_errors_are_openai_shaped_400s(served, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=SMOL, messages=MESSAGES, max_tokens=4, n=2)
    assert e.value.param == "n"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=4)
    assert e.value.code == "model_not_found"
    base = {"model": SMOL, "messages": MESSAGES}
    err = _error(_post(served, "/chat/completions", b'{"model": "smollm2-135m", "messages": ['), 400,
                 code="invalid_json")
    assert err["type"] == "invalid_request_error"
    _error(_post(served, "/chat/completions", b"[1, 2]"), 400)
    _error(_post(served, "/chat/completions", b""), 400)
    _error(_post(served, "/chat/completions", {**base, "max_tokens": -5}), 400, param="max_tokens")
    _error(_post(served, "/chat/completions", {**base, "max_tokens": "5"}), 400, param="max_tokens")
    _error(_post(served, "/chat/completions", {**base, "max_tokens": LIMITS.max_tokens + 1}), 400,
           param="max_tokens")
    # found by schemathesis: an out-of-range max_tokens beside a valid max_completion_tokens was ignored
    both = {**base, "max_completion_tokens": 1, "max_tokens": LIMITS.max_tokens + 1}
    _error(_post(served, "/chat/completions", both), 400, param="max_tokens")
    _error(_post(served, "/chat/completions", {**base, "temperature": 3}), 400, param="temperature")
    _error(_post(served, "/chat/completions", {**base, "stop": ["ok", ""]}), 400, param="stop")
    _error(_post(served, "/chat/completions", {**base, "top_logprobs": 3}), 400, param="top_logprobs")
    _error(_post(served, "/chat/completions", {**base, "logprobs": True, "top_logprobs": 21}), 400)
    for name, value in (("logit_bias", {"x5": 1}), ("logit_bias", {"5": 101}), ("logit_bias", {"99999999": 1}),
                        ("min_p", 1.5), ("top_k", -2), ("repetition_penalty", 0), ("presence_penalty", 2.5),
                        ("repetition_penalty", 5e-324),  # found by schemathesis: logits / 5e-324 overflowed, a 500
                        ("guided_choice", []), ("functions", [{"name": "f"}])):
        _error(_post(served, "/chat/completions", {**base, name: value}), 400)
    for name, value in (("grammar", "root ::= ("), ("json_schema", {"type": "objectx"}), ("guided_regex", "(a"),
                        ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                            "type": "nope"}}}),
                        ("response_format", {"type": "xml"}), ("guided_json", "{not json")):
        _error(_post(served, "/chat/completions", {**base, name: value}), 400)
    two = {**base, "response_format": {"type": "json_object"}, "guided_regex": "a+"}
    _error(_post(served, "/chat/completions", two), 400, param="guided_regex")  # one output format at a time
    _error(_post(served, "/chat/completions", {"model": SMOL, "messages": []}), 400, param="messages")
    _error(_post(served, "/chat/completions", {"model": SMOL, "messages": [{"role": "wizard", "content": "hi"}]}),
           400)
    _error(_post(served, "/chat/completions", {"model": SMOL}), 400, param="messages")
    _error(_post(served, "/completions", {"model": SMOL, "prompt": "  "}), 400)
    _error(_post(served, "/completions", {"model": SMOL, "prompt": [10**9]}), 400, param="prompt")
    _error(_post(served, "/completions", {"model": SMOL, "prompt": ["a", "b"]}), 400, param="prompt")
    _error(httpx.get(served[1].url + "/nothing-here", headers={"Authorization": f"Bearer {KEY}"}), 404)
    assert served[0].gen.stats.requests > 0


def test_prompt_and_body_bounds(served):
    long = {"model": SMOL, "messages": [{"role": "user", "content": "word " * 400}], "max_tokens": 4}
    _error(_post(served, "/chat/completions", long), 400, param="messages", code="context_length_exceeded")
    _error(_post(served, "/completions", {"model": SMOL, "prompt": "word " * 400}), 400, param="prompt",
           code="context_length_exceeded")
    huge = {"model": SMOL, "messages": [{"role": "user", "content": "x" * (LIMITS.max_body_bytes + 1)}]}
    _error(_post(served, "/chat/completions", huge), 413)


def test_client_dropping_mid_stream_stops_the_generation(served, client, dec_lookup):
    api = served[0]
    before, tokens_before = api.gen.stats.cancelled, api.gen.stats.completion_tokens
    body = {"model": SMOL, "messages": MESSAGES, "max_tokens": LIMITS.max_tokens, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", served[1].url + "/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as resp:
        lines = resp.iter_lines()
        got = [line for line, _ in zip(lines, range(6), strict=False) if line]
        assert got and got[0].startswith("data: ")
    for _ in range(100):  # the server notices between two rounds
        if api.gen.stats.cancelled > before:
            break
        time.sleep(0.05)
    assert api.gen.stats.cancelled == before + 1
    assert api.gen.stats.completion_tokens - tokens_before < LIMITS.max_tokens
    # a client that gives up on a plain (not streamed) answer stops it too
    with pytest.raises(httpx.ReadTimeout):
        _post(served, "/chat/completions", {**body, "stream": False}, timeout=0.5)
    for _ in range(100):
        if api.gen.stats.cancelled > before + 1:
            break
        time.sleep(0.05)
    assert api.gen.stats.cancelled == before + 2
    # and the server (model, lock, drafter state) is fine afterwards
    g = _greedy(dec_lookup, MESSAGES, n=12)
    r = client.chat.completions.create(model=SMOL, messages=MESSAGES, max_tokens=12, temperature=0)
    assert r.choices[0].message.content == g.text


# ------------------------------------------------------------------------------------ open API and CLI
def test_open_api_listens_on_loopback_only(dec_lookup):
    for host in ("127.0.0.1", "localhost", "::1", "[::1]"):
        check_host(host, None)
    for host in ("0.0.0.0", "192.168.1.5", "example.com", "::"):
        with pytest.raises(UserError, match="without a key"):
            check_host(host, None)
        check_host(host, "a-key")
    run = Running(create_app(dec_lookup, SMOL), path="/v1")  # no key: requests need none
    try:
        assert [m.id for m in OpenAI(base_url=run.url, api_key="anything", max_retries=0).models.list().data] == [SMOL]
    finally:
        run.stop()


def test_cli_serve_refuses_an_open_public_bind(capsys, monkeypatch, tmp_path):
    from moaspec.cli import main

    monkeypatch.delenv("MOASPEC_API_KEY", raising=False)
    monkeypatch.setenv("MOASPEC_TOKEN", "the-target-servers-token")  # never the API's key
    assert main(["serve", "--model", SMOL, "--drafter", "lookup", "--host", "0.0.0.0"]) == 2
    assert "without a key" in capsys.readouterr().err
    assert main(["serve", "--model", SMOL, "--api-token-file", str(tmp_path / "missing")]) == 2
    assert "token file" in capsys.readouterr().err
    assert main(["serve", "--model", SMOL, "--port", "0"]) == 2
    assert "--port" in capsys.readouterr().err
    assert main(["serve", "--help"]) == 0
    assert "--api-token-file" in capsys.readouterr().out


# ------------------------------------------------------------------------------------ many requests at once
@pytest.fixture(scope="module")
def batched():
    """An int8 SmolLM2 with the suffix drafter (batch-invariant kernels: passes really stack requests)."""
    from moaspec.pipeline import SpecDecoder

    dec = SpecDecoder(SMOL, drafter="suffix", weights="int8", tree="adaptive:4")
    app = create_app(dec, SMOL, token=KEY, limits=ApiLimits(max_prompt_tokens=256, max_tokens=64, parallel=8,
                                                             max_waiting=4, gather_ms=10))
    run = Running(app, path="/v1")
    yield app.state.api, run
    run.stop()
    app.state.api.close()


QUESTIONS = ["Name three primary colors.", "Write a haiku about rain.", "What is 7 times 8?", "Define entropy.",
             "List the planets of the solar system.", "Say hello in French.", "What is a prime number?",
             "Write a Python function that reverses a list."]


def test_concurrent_requests_decode_together_and_equal_lone_answers(batched):
    api, run = batched
    client = OpenAI(base_url=run.url, api_key=KEY, max_retries=0, timeout=300)

    def ask(i: int, seed: int | None) -> str:
        kw = dict(temperature=0) if seed is None else dict(temperature=1.0, seed=seed)
        return client.chat.completions.create(model=SMOL, messages=[{"role": "user", "content": QUESTIONS[i]}],
                                              max_tokens=24, **kw).choices[0].message.content

    for seed in (None, 11):
        lone = [ask(i, seed) for i in range(8)]
        passes, seqs = api.gen.scheduler.stats.passes, api.gen.scheduler.stats.sequences
        out: list = [None] * 8
        threads = [threading.Thread(target=lambda i=i, o=out, s=seed: o.__setitem__(i, ask(i, s))) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert out == lone, f"seed {seed}: answers changed when decoded together"
        s = api.gen.scheduler.stats
        assert s.sequences - seqs > 1.5 * (s.passes - passes), "requests did not share passes"
    assert api.gen.admission.holders == 0 and sum(map(len, api.gen.idle.values())) <= 8
    metrics = httpx.get(run.url.removesuffix("/v1") + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    assert "moaspec_batch_sequences_bucket" in metrics and "moaspec_generations_waiting" in metrics
    # what speculation did, over every generation above: the trees' size and tau, consistent with the counts
    got = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
           if line.startswith(("moaspec_target_calls", "moaspec_draft_", "moaspec_tau"))}
    calls, drafted, accepted = got["moaspec_target_calls"], got["moaspec_draft_tokens"], \
        got["moaspec_draft_tokens_accepted"]
    assert calls > 0 and 0 <= accepted <= drafted
    assert got["moaspec_tau"] == pytest.approx(1 + accepted / calls)
    assert got["moaspec_draft_rows_per_call"] == pytest.approx(drafted / calls)


def test_full_queue_is_503_with_retry_after(batched):
    api, run = batched
    admission = api.gen.admission
    held = admission.holders, admission.max_holders
    admission.max_holders = 0  # no place for anyone now: requests wait, up to max_waiting (4)
    body = {"model": SMOL, "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    try:
        waiting = [threading.Thread(target=_post, args=(batched, "/chat/completions", body), kwargs={"timeout": 120})
                   for _ in range(4)]
        for t in waiting:
            t.start()
        for _ in range(200):
            if admission.waiting == 4:
                break
            time.sleep(0.05)
        assert admission.waiting == 4
        resp = _post(batched, "/chat/completions", body)
        err = _error(resp, 503, code="server_busy")
        assert err["type"] == "server_error" and int(resp.headers["retry-after"]) >= 1
    finally:
        admission.max_holders = held[1]
        admission._wake()
    for t in waiting:
        t.join(120)
    assert admission.waiting == 0 and admission.holders == held[0]


def test_explicit_nulls_are_defaults(served, client, dec_lookup):
    g = _greedy(dec_lookup, MESSAGES, n=8)
    body = {"model": SMOL, "messages": MESSAGES, "max_tokens": 8, "temperature": 0, "top_p": None, "n": None,
            "stop": None, "seed": None, "stream": None, "stream_options": None, "max_completion_tokens": None}
    resp = _post(served, "/chat/completions", body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] == g.text


def test_long_text_is_refused_before_tokenising(served):
    api = served[0]
    body = {"model": SMOL, "messages": [{"role": "user", "content": "x" * 60000}], "max_tokens": 4}
    _error(_post(served, "/chat/completions", body), 400, param="messages", code="context_length_exceeded")
    assert api.gen._longest_token is not None and 60000 > LIMITS.max_prompt_tokens * api.gen._longest_token


def test_open_api_refuses_other_hosts_and_cross_site_posts(dec_lookup):
    run = Running(create_app(dec_lookup, SMOL), path="/v1")
    try:
        body = {"model": SMOL, "messages": MESSAGES, "max_tokens": 2}
        ok = httpx.post(run.url + "/chat/completions", json=body, timeout=60)
        assert ok.status_code == 200
        rebound = httpx.post(run.url + "/chat/completions", json=body, headers={"Host": "evil.example:8000"})
        _error(rebound, 403, code="forbidden_host")
        cross = httpx.post(run.url + "/chat/completions", json=body, headers={"Origin": "https://evil.example"})
        _error(cross, 403, code="forbidden_origin")
        same = httpx.post(run.url + "/chat/completions", json=body, timeout=60,
                          headers={"Origin": f"http://127.0.0.1:{run.port}"})
        assert same.status_code == 200
        for host in ("[::1", "[zz"):  # no URL parser takes them: a 400, never a 500
            odd = httpx.post(run.url + "/chat/completions", json=body, headers={"Host": host})
            assert odd.status_code in (400, 403), (host, odd.status_code, odd.text)
        odd_origin = httpx.post(run.url + "/chat/completions", json=body, headers={"Origin": "http://[::1"})
        assert odd_origin.status_code == 403
        page = httpx.get(run.url.removesuffix("/v1") + "/")
        csp = page.headers["content-security-policy"]
        assert "frame-ancestors 'none'" in csp and "base-uri 'none'" in csp and "form-action 'self'" in csp
        assert "unsafe-inline" not in csp
    finally:
        run.stop()


def test_with_a_key_the_description_and_figures_need_it_and_bounds_hold(served):
    """/openapi.json answers only with the key; /health says "ok" to anyone and its figures only with the key;
    a conversation of more messages than the prompt bound has tokens is refused before its template runs."""
    base = served[1].url.removesuffix("/v1")
    assert httpx.get(base + "/openapi.json").status_code == 401
    assert "paths" in httpx.get(base + "/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert httpx.get(base + "/health").json() == {"status": "ok"}
    assert "requests" in httpx.get(base + "/health", headers={"Authorization": f"Bearer {KEY}"}).json()
    many = {"model": SMOL, "max_tokens": 2, "messages": [{"role": "user", "content": ""}] * 300}
    _error(_post(served, "/chat/completions", many), 400, code="context_length_exceeded")


def test_a_public_plaintext_listener_or_a_short_key_is_warned_of():
    from moaspec.serving.runner import exposure_warnings

    assert exposure_warnings("127.0.0.1", "a" * 32, tls=False) == []
    assert any("plaintext" in w for w in exposure_warnings("0.0.0.0", "a" * 32, tls=False))
    assert exposure_warnings("0.0.0.0", "a" * 32, tls=True) == []
    assert any("characters" in w for w in exposure_warnings("127.0.0.1", "short", tls=False))


def test_logprobs_from_the_verification_pass_match_plain_decoding(served, client, dec_none):
    """`logprobs` / `top_logprobs` (chat, streamed or not) and the legacy completions `logprobs`: one entry per
    answer token, its text, its log-probability under the target as the verification pass scored it (the same
    as plain decoding's, the drafter's accepted tokens included), the greedy token its row's likeliest."""
    import math

    from moaspec.decoding.engine import GenerationConfig as Cfg

    r = client.chat.completions.create(model=SMOL, messages=MESSAGES, max_tokens=N, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens and "".join(c.token for c in content) == \
        r.choices[0].message.content
    plain = [lp for d in dec_none.stream(MESSAGES, Cfg(max_new_tokens=N, logprobs=3)) for lp in d.logprobs]
    assert len(plain) == len(content)
    for c, (value, top) in zip(content, plain, strict=True):
        assert abs(c.logprob - value) < 1e-4 and len(c.top_logprobs) == len(top) == 3
        assert all(abs(t.logprob - v) < 1e-4 for t, (_, v) in zip(c.top_logprobs, top, strict=True))
        assert c.top_logprobs[0].logprob == c.logprob and c.logprob <= 0 and math.isfinite(c.logprob)
        assert [t.logprob for t in c.top_logprobs] == sorted((t.logprob for t in c.top_logprobs), reverse=True)
    streamed = [e for ch in client.chat.completions.create(model=SMOL, messages=MESSAGES, max_tokens=N, temperature=0,
                                                           logprobs=True, stream=True)
                if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [e.logprob for e in streamed] == [c.logprob for c in content]
    done = client.completions.create(model=SMOL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2)
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == done.usage.completion_tokens
    assert "".join(lp.tokens) == done.choices[0].text and lp.text_offset[0] == 0


# ------------------------------------------------------------------------------------ structured outputs
def test_structured_outputs_parse_and_equal_plain_decoding_under_the_same_grammar(served, client, dec_none):
    """`chat.completions.parse` with a pydantic model (strict json_schema), json_object, llama-server's `grammar`
    (GBNF) and vLLM's guided_choice / guided_regex: each answer follows its format, and with the server's lookup
    drafter it is token for token the plain decoder's under the same grammar."""
    import re
    from typing import Literal

    from pydantic import BaseModel

    from moaspec.decoding.grammar import Grammar, Vocabulary
    from moaspec.decoding.logit_rules import LogitRules

    class Pet(BaseModel):
        kind: Literal["cat", "dog", "fish"]
        legs: int

    ask = [{"role": "user", "content": "Name a pet and its number of legs, as JSON."}]
    r = client.chat.completions.parse(model=SMOL, messages=ask, response_format=Pet, max_tokens=40, temperature=0)
    pet = r.choices[0].message.parsed
    assert isinstance(pet, Pet) and r.choices[0].finish_reason == "stop"
    cfg = dec_none.target.cfg
    vocab = Vocabulary.of(dec_none.tokenizer, cfg.vocab_size, cfg.eos_token_ids)
    schema = {**Pet.model_json_schema(), "additionalProperties": False}
    plain = dec_none.generate(ask, GenerationConfig(max_new_tokens=40, rules=LogitRules(
        grammar=Grammar.json_schema(vocab, schema))))
    assert r.choices[0].message.content == plain.text and r.usage.completion_tokens == len(plain.token_ids)

    copy = [{"role": "user", "content": 'Repeat this JSON exactly: {"ok": true, "n": 3}'}]
    obj = client.chat.completions.create(model=SMOL, messages=copy, max_tokens=64, temperature=0,
                                         response_format={"type": "json_object"})
    assert obj.choices[0].finish_reason == "stop", obj.choices[0].message.content
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    for extra, pattern in (({"guided_choice": ["yes", "no"]}, "yes|no"), ({"guided_regex": "[0-9]{3}-[a-z]{2}"},
                           "[0-9]{3}-[a-z]{2}"), ({"grammar": 'root ::= "x" [0-9] [0-9]?'}, "x[0-9][0-9]?")):
        text = client.chat.completions.create(model=SMOL, messages=MESSAGES, max_tokens=12, temperature=0.7, seed=3,
                                              extra_body=extra).choices[0].message.content
        assert re.fullmatch(pattern, text), (extra, text)
    # streamed: the same text in chunks
    chunks = client.chat.completions.create(model=SMOL, messages=copy, max_tokens=64, temperature=0, stream=True,
                                            response_format={"type": "json_object"})
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == obj.choices[0].message.content


def test_sampling_fields_are_honoured_and_lossless(served, client, dec_none):
    """logit_bias, the penalties, top_k and min_p change the answer, and the lookup drafter's answer is the plain
    decoder's under the same rules (greedy; seeded sampling with top_k 1 is greedy)."""
    from moaspec.decoding.logit_rules import LogitRules
    from moaspec.decoding.sampling import SamplingParams

    base = dict(model=SMOL, messages=MESSAGES, max_tokens=N, temperature=0)
    greedy = client.chat.completions.create(**base)
    first = dec_none.generate(MESSAGES, GenerationConfig(max_new_tokens=1)).token_ids[0]
    banned = client.chat.completions.create(**base, logit_bias={str(first): -100})
    rules = LogitRules(logit_bias=((first, -100.0),))
    plain = dec_none.generate(MESSAGES, GenerationConfig(max_new_tokens=N, rules=rules))
    assert banned.choices[0].message.content == plain.text != greedy.choices[0].message.content
    assert first not in plain.token_ids
    penalised = client.chat.completions.create(**base, frequency_penalty=1.0, presence_penalty=0.5,
                                               extra_body={"repetition_penalty": 1.3})
    rules = LogitRules(frequency_penalty=1.0, presence_penalty=0.5, repetition_penalty=1.3)
    plain = dec_none.generate(MESSAGES, GenerationConfig(max_new_tokens=N, rules=rules))
    assert penalised.choices[0].message.content == plain.text != greedy.choices[0].message.content
    top1 = client.chat.completions.create(**{**base, "temperature": 1.0}, seed=9, extra_body={"top_k": 1})
    assert top1.choices[0].message.content == greedy.choices[0].message.content
    cfg = GenerationConfig(max_new_tokens=N, sampling=SamplingParams(temperature=1.0, seed=9, min_p=0.2))
    min_p = client.chat.completions.create(**{**base, "temperature": 1.0}, seed=9, extra_body={"min_p": 0.2})
    assert min_p.choices[0].message.content == dec_none.generate(MESSAGES, cfg).text


# ------------------------------------------------------------------------------------ tools
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {
        "type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"],
        "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"], "additionalProperties": False}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_tool_calls_round_trip_in_the_json_format_and_equal_a_drafterless_answer(served, client):
    """SmolLM2's template has no tools: they go into a system message and the answer is held to the JSON call
    format. A required call parses against the tool's parameters, a named choice calls that tool, the streamed
    call deltas add up to the same call, the tool's result goes back and the next answer follows; and every
    answer is the same with the server's lookup drafter as with none (the drafts never change a call)."""
    base = dict(model=SMOL, messages=ASK_WEATHER, tools=[WEATHER, TIME], max_tokens=64, temperature=0)
    r = client.chat.completions.create(**base, tool_choice="required")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in ("get_weather", "get_time")
    args = json.loads(call.function.arguments)
    assert set(args) == ({"city", "unit"} if call.function.name == "get_weather" else {"zone"})
    plain = client.chat.completions.create(**base, tool_choice="required", extra_body={"drafter": "none"})
    assert [(c.function.name, c.function.arguments) for c in plain.choices[0].message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]

    named_kw = dict(**base, tool_choice={"type": "function", "function": {"name": "get_time"}},
                    parallel_tool_calls=False)
    named = client.chat.completions.create(**named_kw)
    calls = named.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_time"] and "zone" in json.loads(calls[0].function.arguments)
    plain = client.chat.completions.create(**named_kw, extra_body={"drafter": "none"})
    assert [(c.function.name, c.function.arguments) for c in plain.choices[0].message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in calls]

    streamed: dict[int, dict] = {}
    for ch in client.chat.completions.create(**base, tool_choice="required", stream=True):
        for d in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
            got = streamed.setdefault(d.index, {"name": "", "arguments": ""})
            got["name"] += d.function.name or ""
            got["arguments"] += d.function.arguments or ""
        if ch.choices and ch.choices[0].finish_reason:
            assert ch.choices[0].finish_reason == "tool_calls"
    assert [(v["name"], v["arguments"]) for _, v in sorted(streamed.items())] == \
        [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]

    follow = [*ASK_WEATHER, choice.message.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "clear"})}]
    after = {**base, "messages": follow, "tools": [WEATHER], "tool_choice": "auto"}
    again = client.chat.completions.create(**after).choices[0]
    assert again.finish_reason in ("stop", "tool_calls", "length")
    assert again.message.content or again.message.tool_calls  # the result turn gets an answer
    plain = client.chat.completions.create(**after, extra_body={"drafter": "none"}).choices[0]
    assert (again.finish_reason, again.message.content) == (plain.finish_reason, plain.message.content)
    assert [(c.function.name, c.function.arguments) for c in again.message.tool_calls or []] == \
        [(c.function.name, c.function.arguments) for c in plain.message.tool_calls or []]
    none = client.chat.completions.create(**base, tool_choice="none")
    assert none.choices[0].message.tool_calls is None
    assert none.choices[0].message.content == client.chat.completions.create(
        model=SMOL, messages=ASK_WEATHER, max_tokens=64, temperature=0).choices[0].message.content


def test_tool_requests_are_checked(served):
    base = {"model": SMOL, "messages": ASK_WEATHER}
    for extra in ({"tool_choice": "required"},  # no tools
                  {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                  {"tools": [WEATHER, WEATHER]},
                  {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
                  {"tools": [{"type": "retrieval"}]},
                  {"tools": [WEATHER] * 65},
                  {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
                  {"messages": [{"role": "assistant"}]}):
        _error(_post(served, "/chat/completions", {**base, **extra}), 400)


def test_each_tool_syntax_parses_its_calls_and_holds_back_a_call_being_written():
    from moaspec.serving.tool_calls import Hermes, JsonCalls, Llama3, tool_format

    h = Hermes(("get_weather", "get_time"))
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
    content, calls = h.parse(text)
    assert content == "Let me check." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]
    assert len({c.id for c in calls}) == 2
    assert h.parse('{"name": "get_time", "arguments": {"zone": "UTC"}}')[1][0].name == "get_time"  # tags left out
    assert h.parse('{"name": "rm_rf", "arguments": {}}') == ('{"name": "rm_rf", "arguments": {}}', [])  # not a tool
    assert h.parse("<tool_call>\n{broken") == ("<tool_call>\n{broken", [])  # cut short: the text as it is
    assert h.held("Sure <tool_c") == len("Sure ") and h.held("a < b") == len("a < b") and h.held("x<tool_call>") == 1
    l3 = Llama3(("f",))
    assert [(c.name, c.arguments) for c in l3.parse('<|python_tag|>{"name": "f", "parameters": {"a": 1}}')[1]] == \
        [("f", '{"a": 1}')]
    assert l3.parse("Hello there")[1] == [] and l3.held('{"na') == 0
    j = JsonCalls(("f",))
    assert j.parse('{"response": "hi"}') == ("hi", []) and j.parse('{"tool_calls": [{"name": "f", "arguments": '
                                                                   '{}}]}')[1][0].name == "f"
    assert isinstance(tool_format("{{ tools }} <tool_call>"), Hermes) and isinstance(tool_format(None), JsonCalls)
    msgs = j.messages([{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"}, {"role": "tool", "tool_call_id": "c2", "content": "2"}],
        [{"type": "function", "function": {"name": "f"}}])
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]  # results merged: roles alternate
    assert json.loads(msgs[2]["content"]) == {"tool_calls": [{"name": "f", "arguments": {"a": 1}}]}


@pytest.mark.slow
def test_qwen_calls_tools_in_its_own_syntax_and_reads_their_results():
    """Qwen2.5's template (hermes <tool_call> syntax) on the GGUF weights with the lookup drafter: auto, required
    and named calls, streamed deltas, the result turn, each answer the same as with no drafter."""
    from moaspec.pipeline import SpecDecoder

    name = "qwen2.5-coder-0.5b"
    app = create_app(SpecDecoder(name, drafter="lookup", weights="gguf", warmup=False), name,
                     limits=ApiLimits(max_tokens=128))
    run = Running(app, path="/v1")
    try:
        c = OpenAI(base_url=run.url, api_key="x", max_retries=0, timeout=120)
        base = dict(model=name, messages=ASK_WEATHER, tools=[WEATHER, TIME], max_tokens=128, temperature=0,
                    parallel_tool_calls=False)  # a 0.5B model, free to, calls again and again
        for choice in ("auto", "required", {"type": "function", "function": {"name": "get_time"}}):
            r = c.chat.completions.create(**base, tool_choice=choice)
            plain = c.chat.completions.create(**base, tool_choice=choice, extra_body={"drafter": "none"})
            calls = r.choices[0].message.tool_calls
            assert r.choices[0].finish_reason == "tool_calls" and calls, choice
            assert [(x.function.name, x.function.arguments) for x in calls] == \
                [(x.function.name, x.function.arguments) for x in plain.choices[0].message.tool_calls]
            assert calls[0].function.name == ("get_time" if isinstance(choice, dict) else "get_weather")
        call = c.chat.completions.create(**base, tool_choice="required").choices[0].message
        follow = [*ASK_WEATHER, call.model_dump(exclude_none=True), {
            "role": "tool", "tool_call_id": call.tool_calls[0].id, "content": '{"temperature": 18, "sky": "clear"}'}]
        answer = c.chat.completions.create(**{**base, "messages": follow}, tool_choice="none")
        assert answer.choices[0].finish_reason == "stop" and "18" in answer.choices[0].message.content
        plain = c.chat.completions.create(**{**base, "messages": follow}, tool_choice="none",
                                          extra_body={"drafter": "none"})  # the same answer as with no drafter
        assert answer.choices[0].message.content == plain.choices[0].message.content
        assert answer.choices[0].message.tool_calls is None and plain.choices[0].message.tool_calls is None
        deltas = [d for ch in c.chat.completions.create(**base, tool_choice="required", stream=True)
                  if ch.choices for d in ch.choices[0].delta.tool_calls or []]
        assert [(d.function.name, d.function.arguments) for d in deltas] == \
            [(x.function.name, x.function.arguments) for x in call.tool_calls]
    finally:
        run.stop()


# ------------------------------------------------------------------------------------ Responses, tokenizer
def test_responses_api_answers_as_chat_does_and_streams_typed_events(served, client):
    """/v1/responses with the openai client: instructions + input give the chat answer (text and token counts);
    the stream's events are numbered, its text deltas add up to the final text; a required function call comes
    back as a function_call item, and its output item goes back in; text.format json_schema holds the answer."""
    chat = client.chat.completions.create(model=SMOL, messages=MESSAGES, max_tokens=N, temperature=0)
    r = client.responses.create(model=SMOL, instructions=MESSAGES[0]["content"], input=MESSAGES[1]["content"],
                                max_output_tokens=N, temperature=0)
    assert r.object == "response" and r.output_text == chat.choices[0].message.content
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    events = list(client.responses.create(model=SMOL, instructions=MESSAGES[0]["content"],
                                          input=MESSAGES[1]["content"], max_output_tokens=N, temperature=0,
                                          stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[-1].response.output_text == r.output_text

    tool = {"type": "function", "name": "get_weather", "description": "The weather now in a city.",
            "parameters": WEATHER["function"]["parameters"]}
    called = client.responses.create(model=SMOL, input=ASK_WEATHER[0]["content"], tools=[tool],
                                     tool_choice="required", max_output_tokens=64, temperature=0)
    call = called.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and "city" in json.loads(call.arguments)
    items = [{"role": "user", "content": ASK_WEATHER[0]["content"]},
             {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
             {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees, clear"}]
    after = client.responses.create(model=SMOL, input=items, tools=[tool], max_output_tokens=64, temperature=0)
    assert after.status in ("completed", "incomplete") and after.output
    # the result turn's answer is the drafterless chat answer to the same conversation
    asked = {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    plain = client.chat.completions.create(
        model=SMOL, tools=[WEATHER], max_tokens=64, temperature=0, extra_body={"drafter": "none"}, messages=[
            ASK_WEATHER[0], {"role": "assistant", "content": None, "tool_calls": [asked]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "18 degrees, clear"}]).choices[0]
    assert after.output_text == (plain.message.content or "")
    assert [(c.name, c.arguments) for c in after.output if c.type == "function_call"] == \
        [(c.function.name, c.function.arguments) for c in plain.message.tool_calls or []]
    streamed = list(client.responses.create(model=SMOL, input=ASK_WEATHER[0]["content"], tools=[tool],
                                            tool_choice="required", max_output_tokens=64, temperature=0, stream=True))
    done = [e.arguments for e in streamed if e.type == "response.function_call_arguments.done"]
    assert done == [call.arguments]
    shaped = client.responses.create(model=SMOL, input='Repeat this JSON exactly: {"ok": true}', temperature=0,
                                     max_output_tokens=64, text={"format": {
                                         "type": "json_schema", "name": "ok", "strict": True, "schema": {
                                             "type": "object", "properties": {"ok": {"type": "boolean"}},
                                             "required": ["ok"], "additionalProperties": False}}})
    assert json.loads(shaped.output_text) in ({"ok": True}, {"ok": False})
    base = {"model": SMOL, "input": "hi"}
    for extra in ({"previous_response_id": "resp_1"}, {"input": [{"type": "input_image", "image_url": "x"}]},
                  {"tools": [{"type": "web_search"}]}, {"input": [{"role": "wizard", "content": "hi"}]},
                  {"max_output_tokens": LIMITS.max_tokens + 1}, {"model": "gpt-4o"}):
        assert _post(served, "/responses", {**base, **extra}).status_code in (400, 404)


def test_tokenize_and_detokenize(served, dec_lookup):
    root = served[1].url.removesuffix("/v1")
    post = lambda path, body, **kw: _post(served, path, body, **kw).json()  # noqa: E731
    served[1].url, url = root, served[1].url
    try:
        assert post("/tokenize", {"prompt": PROMPT})["tokens"] == dec_lookup.tokenizer.encode(PROMPT)
        got = post("/tokenize", {"model": SMOL, "messages": MESSAGES})
        assert got["tokens"] == dec_lookup.encode(MESSAGES) and got["count"] == len(got["tokens"])
        pieces = post("/tokenize", {"content": "hello world", "with_pieces": True})["tokens"]
        assert "".join(p["piece"] for p in pieces) == "hello world"
        assert post("/detokenize", {"tokens": dec_lookup.tokenizer.encode(PROMPT)})["prompt"] == PROMPT
        _error(_post(served, "/detokenize", {"tokens": [10**9]}), 400, param="tokens")
        _error(_post(served, "/tokenize", {"prompt": "x", "messages": MESSAGES}), 400)
        _error(_post(served, "/tokenize", {"prompt": "x" * (1 << 15)}), 400)  # beyond the prompt bound
        _error(_post(served, "/tokenize", {"prompt": "x"}, key=None), 401)
    finally:
        served[1].url = url


@pytest.mark.slow
def test_an_agent_framework_runs_tools_through_the_responses_api():
    """openai-agents (its Responses model, streamed and not) on Qwen2.5 GGUF with the lookup drafter: the agent
    calls the Python tool through /v1/responses and answers from its result."""
    import asyncio

    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    from moaspec.pipeline import SpecDecoder

    set_tracing_disabled(True)
    name = "qwen2.5-coder-0.5b"
    run = Running(create_app(SpecDecoder(name, drafter="lookup", weights="gguf", warmup=False), name,
                             limits=ApiLimits(max_tokens=128)), path="/v1")
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather now in a city."""
        calls.append(city)
        return f"18 degrees and clear in {city}"

    def agent() -> Agent:  # a client per event loop
        return Agent(name="helper", instructions="Answer briefly. Use tools when useful.", tools=[get_weather],
                     model=OpenAIResponsesModel(model=name, openai_client=AsyncOpenAI(base_url=run.url, api_key="x")),
                     model_settings=ModelSettings(temperature=0, max_tokens=96))

    async def streamed():
        r = Runner.run_streamed(agent(), "What is the weather in Paris?", max_turns=4)
        async for _ in r.stream_events():
            pass
        return r

    try:
        for run_one in (lambda: Runner.run_sync(agent(), "What is the weather in Paris?", max_turns=4),
                        lambda: asyncio.run(streamed())):
            result = run_one()
            assert calls and calls[-1] == "Paris" and "18" in str(result.final_output)
            calls.clear()
    finally:
        run.stop()


def test_found_by_schemathesis_tool_calls_on_a_system_message_are_a_400_not_a_500(served):
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    for path in ("/chat/completions",):
        _error(_post(served, path, {"model": SMOL, "messages": [{"role": "system", "content": None, "tool_calls": [
            call]}, {"role": "user", "content": "hi"}]}), 400, param="messages.0.tool_calls")


def test_other_weight_modes_only_when_offered_and_only_if_memory_holds_them(dec_lookup, monkeypatch):
    """Found in review: any client could make the server load a full copy of the target per weight mode, never
    freed and not counted by admission. Now only the served mode unless the operator offers more, and a copy the
    free memory cannot hold is a 503."""
    from moaspec.serving import api_generation

    api = create_app(dec_lookup, SMOL).state.api
    assert api.gen.weight_modes == ["fp32"]
    run = Running(api.app, path="/v1")
    try:
        body = {"model": SMOL, "messages": MESSAGES, "max_tokens": 2, "weights": "fp16"}
        _error(httpx.post(run.url + "/chat/completions", json=body, timeout=30), 400, param="weights")
    finally:
        run.stop()
        api.close()
    api = create_app(dec_lookup, SMOL, limits=ApiLimits(weight_modes=("fp16", "int8"))).state.api
    assert api.gen.weight_modes[0] == "fp32" and "fp16" in api.gen.weight_modes
    monkeypatch.setattr(api_generation, "available_memory", lambda: 300 << 20)
    run = Running(api.app, path="/v1")
    try:
        body = {"model": SMOL, "messages": MESSAGES, "max_tokens": 2, "weights": "fp16"}
        r = httpx.post(run.url + "/chat/completions", json=body, timeout=30)
        err = _error(r, 503)
        assert "not enough free memory" in err["message"] and r.headers["retry-after"]
        assert "fp16" not in api.gen.variants
    finally:
        run.stop()
        api.close()
    with pytest.raises(UserError, match="do not exist"):
        ApiLimits(weight_modes=("fp8",))


def test_a_client_gone_while_queued_gives_its_place_up(batched):
    """Found in review: a request whose client left while it waited for a place kept that place in the queue
    until its turn came."""
    import socket

    api, run = batched
    admission = api.gen.admission
    held = admission.max_holders
    admission.max_holders = 0  # nobody runs: every request waits
    body = json.dumps({"model": SMOL, "messages": MESSAGES, "max_tokens": 4}).encode()
    try:
        s = socket.create_connection(("127.0.0.1", run.port), timeout=5)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + KEY.encode() +
                  b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" +
                  body)
        for _ in range(100):
            if admission.waiting == 1:
                break
            time.sleep(0.05)
        assert admission.waiting == 1
        s.close()  # the client goes away while queued
        for _ in range(60):
            if admission.waiting == 0:
                break
            time.sleep(0.05)
        assert admission.waiting == 0, "the queue kept the departed client's place"
    finally:
        admission.max_holders = held
        admission._wake()


def test_a_conversation_without_tools_is_rendered_as_it_is(served, dec_lookup):
    """Found by the prefix-cache test: the JSON tool format rewrote every earlier assistant turn as
    {"response": ...} even when no tool was in play, so multi-turn answers changed."""
    conv = [*MESSAGES, {"role": "assistant", "content": "Red, green and blue."}, {"role": "user", "content": "Why?"}]
    from moaspec.serving.api_requests import ChatRequest

    ids = served[0].gen.chat_prompt(ChatRequest(model=SMOL, messages=conv))[0]
    assert ids == dec_lookup.encode(conv)


def test_found_by_schemathesis_a_grammar_the_engine_cannot_follow_is_a_400(served):
    """A regex of two characters beyond U+FFFF: llguidance's mask allows a byte its matcher then refuses. The
    answer is a 400 saying so, not a 500 (with drafts the refused token's node had been pruned: a KeyError)."""
    body = {"model": SMOL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16,
            "guided_regex": json.loads('"\\ud885\\udce3\\uda52\\ude94"')}
    for temperature in (0, 1):
        err = _error(_post(served, "/chat/completions", {**body, "temperature": temperature}), 400)
        assert "cannot follow its own grammar" in err["message"]
