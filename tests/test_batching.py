"""Many sequences, one model: the batched pass, the scheduler, and the target server serving many
sessions together (real uvicorn on loopback, real WebSocket clients in threads).

The contract is batch invariance: a sequence's logits, hidden states and cache are the same bits in a
pass beside any others as in a pass alone, so every session's tokens equal its lone run's.
"""

from __future__ import annotations

import threading
import time
import urllib.request

import pytest
import torch
from servers import Running
from websockets.sync.client import connect

from moaspec.decoding.engine import Engine, GenerationConfig
from moaspec.decoding.sampling import SamplingParams
from moaspec.decoding.scheduler import Scheduler, pause
from moaspec.decoding.target import LocalTarget
from moaspec.decoding.tree import AdaptiveChain, Tree, TreeConfig
from moaspec.drafters import build_drafter
from moaspec.drafters.trained import encoder_id
from moaspec.errors import UserError
from moaspec.link.protocol import ENDPOINT, Limits, pack, unpack
from moaspec.link.remote import RemoteTarget
from moaspec.models.parts import PartialTarget
from moaspec.models.runtime import Rows, Transformer
from moaspec.models.store import weights_fingerprint
from moaspec.serving.target_server import TargetServer, load_encoders

SMOL = "smollm2-135m"
TOKEN = "batch-token"
COSTS = {1: 10.0, 2: 10.2, 4: 10.8, 8: 12.0}


@pytest.fixture(scope="module")
def int8_model(smol_folder):
    return Transformer(smol_folder, weights="int8", max_seq_len=1024)


def _prompts(tok) -> list[list[int]]:
    texts = ["The capital of France is", "def fibonacci(n):\n    ", "Write a haiku about the sea.",
             "List three prime numbers: 2, 3,", "Once upon a time, in a small village by the river, there lived",
             "import numpy as np\n\ndef softmax(x):", "Q: What is 12 times 12?\nA:", "The quick brown fox"]
    return [tok.encode(t) for t in texts]


# ----------------------------------------------------------------------------- the batched pass
@pytest.mark.parametrize("weights", ["fp16", "int8", "int4", "gguf", "fp32"])
def test_forward_batch_gives_each_sequence_its_lone_bits(smol_folder, weights):
    model = Transformer(smol_folder, weights=weights, max_seq_len=512)
    assert model.batch_invariant() == (weights != "fp32")  # fp32 runs its sequences one after another
    g = torch.Generator().manual_seed(0)
    V, L = model.cfg.vocab_size, model.cfg.num_layers
    prompts = [torch.randint(0, V, (n,), generator=g) for n in (5, 40, 150, 17, 70)]
    # one token, a tree with hidden states, a 12-row chain (fbgemm in fp16), a prompt chunk, a 3-row chain
    shapes = [1, 4, 12, 64, 3]

    def setup():
        caches = [model.new_cache(400) for _ in prompts]
        for c, p in zip(caches, prompts, strict=True):
            model.prefill(p, cache=c)
        items = []
        for c, n in zip(caches, shapes, strict=True):
            toks = torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(n))
            if n == 4:
                tree = Tree([int(t) for t in toks], [-1, 0, 0, 1])
                items.append(Rows(toks, c, tree.positions(c.length), tree.mask(), hidden_layers=(2, L)))
            elif n == 64:
                items.append(Rows(toks, c, logits_rows=slice(-1, None), hidden_layers=(0,)))
            else:
                items.append(Rows(toks, c))
        return caches, items

    caches_a, alone = setup()
    want = [model.forward_batch([it])[0] for it in alone]
    caches_b, together = setup()
    got = model.forward_batch(together)
    for w, o, ca, cb, n in zip(want, got, caches_a, caches_b, shapes, strict=True):
        assert torch.equal(w.logits, o.logits), f"{weights}: a {n}-row sequence's logits changed in the batch"
        assert sorted(w.hidden) == sorted(o.hidden) and all(torch.equal(w.hidden[k], o.hidden[k]) for k in w.hidden)
        end = ca.length + n
        assert torch.equal(ca.k[:, :, :end], cb.k[:, :, :end]) and torch.equal(ca.v[:, :, :end], cb.v[:, :, :end])


def test_cache_grows_in_blocks_and_releases(int8_model):
    cache = int8_model.new_cache(1000)
    assert cache.capacity == 0 and cache.nbytes == 0
    int8_model.prefill(list(range(100, 400)), cache=cache)
    assert cache.capacity == 512 and cache.length == 300  # two blocks of 256 (grown 256 -> 512)
    before = int8_model.forward(torch.tensor([7]), cache=cache).logits
    cache.release()
    assert cache.capacity == 0 and cache.length == 0
    int8_model.prefill(list(range(100, 400)), cache=cache)
    assert torch.equal(int8_model.forward(torch.tensor([7]), cache=cache).logits, before)


# ----------------------------------------------------------------------------- the scheduler
def test_scheduler_batches_sessions_and_keeps_them_exact(int8_model, smol_tokenizer):
    prompts = _prompts(smol_tokenizer)
    cfg = GenerationConfig(max_new_tokens=24)
    lone = [Engine(LocalTarget(int8_model, cache=int8_model.new_cache(256))).stream(p, cfg) for p in prompts]
    want = [[t for c in it for t in c.tokens] for it in lone]
    sched = Scheduler(int8_model, max_rows=128, gather_ms=20)

    def run(i: int) -> list[int]:  # a slot of the scheduler's loop
        engine = Engine(LocalTarget(int8_model, cache=int8_model.new_cache(256), scheduler=sched))
        return [t for c in engine.stream(prompts[i], cfg) for t in c.tokens]

    futures = [sched.call(run, i) for i in range(len(prompts))]
    got = [f.result(timeout=300) for f in futures]
    sched.close()
    assert got == want
    s = sched.stats
    assert s.sequences > s.passes * 2, f"passes were not shared: {s.passes} passes for {s.sequences} sequences"
    assert max(s.seqs_per_pass) > 1 and s.max_wait_passes <= len(prompts)  # FIFO: bounded waits


def test_scheduler_bounds_rows_per_pass(int8_model):
    sched = Scheduler(int8_model, max_rows=64, gather_ms=0)
    caches = [int8_model.new_cache(256) for _ in range(3)]
    futures = [sched.call(sched.run, Rows(torch.arange(100, 150), c), c) for c in caches]  # 3 slots x 50 rows
    outs = [f.result(timeout=60) for f in futures]
    sched.close()
    assert all(o.logits.shape[0] == 50 for o in outs)
    assert sum(c for b, c in sched.stats.rows_per_pass.items() if b > 64) == 0  # never two of them at once
    with pytest.raises(Exception, match="at most 64"):
        Scheduler(int8_model, max_rows=64).run(Rows(torch.arange(100, 200), caches[0]), caches[0])


def test_closing_the_loop_unwinds_its_parked_slots(int8_model):
    """A slot parked on its pass when the loop stops gets the reason where it waits and unwinds (its `finally`
    runs: a generation gives its place back), instead of waiting forever; rows from outside a slot are refused."""
    sched = Scheduler(int8_model, gather_ms=0, own_thread=False)
    cache = int8_model.new_cache(64)
    with pytest.raises(RuntimeError, match="Scheduler.call"):
        sched.run(Rows(torch.tensor([1]), cache), 1)
    unwound = []

    def generation() -> None:
        try:
            sched.run(Rows(torch.tensor([1, 2]), cache), 1)
            sched.run(Rows(torch.tensor([3]), cache), 1)  # parked here when the loop stops
        finally:
            unwound.append(True)

    done = sched.call(generation)
    sched.step(timeout_s=5)  # starts the slot, runs its first pass; it parks on the second
    assert not done.done() and sched.queued == 1 and sched.stats.passes == 1
    sched.close()
    with pytest.raises(UserError, match="shut down"):
        done.result(0)
    assert unwound == [True]
    assert torch.is_grad_enabled()  # the slot's unwinding left this thread's grad mode as it found it


def test_a_slot_that_pauses_lets_the_others_pass_first(int8_model):
    """Long work between two passes (a drafter taking in a prompt) pauses between pieces: each pause lets the
    loop run one pass for the other slots, as a thread of its own would not have stalled them."""
    sched = Scheduler(int8_model, gather_ms=0, own_thread=False)
    cache = int8_model.new_cache(64)
    order = []

    def long_work() -> None:
        for piece in range(3):
            order.append(f"work {piece}")
            pause()

    def generation() -> None:
        for i in range(3):
            sched.run(Rows(torch.tensor([1]), cache), 2)
            order.append(f"pass {i}")

    jobs = [sched.call(long_work), sched.call(generation)]
    while not all(j.done() for j in jobs):
        sched.step(timeout_s=5)
    sched.close()
    assert order == ["work 0", "pass 0", "work 1", "pass 1", "work 2", "pass 2"]


# ----------------------------------------------------------------------------- the target server
def _server(model, smol_folder, **limits) -> tuple[TargetServer, Running]:
    fp = weights_fingerprint(smol_folder)
    lim = Limits(**{"max_prompt_tokens": 256, "max_seq_len": 512, "max_tree_tokens": 32, **limits})
    server = TargetServer(model, SMOL, fp, TOKEN, load_encoders(model, SMOL, fp), lim, pass_costs=COSTS)
    return server, Running(server.app, scheme="ws", ws_max_size=server.limits.max_message_bytes)


@pytest.fixture(scope="module")
def parts(smol_folder):
    return PartialTarget(smol_folder)


CLIENTS = [  # (drafter, tree): different drafters and tree shapes side by side
    ("none", None), ("lookup", "chain4"), ("suffix", "adaptive:4"), ("moa", "adaptive:4"),
    ("eagle", "tree"), ("moa", "tree"), ("suffix", "tree"), ("eagle", "adaptive:3"),
]


def _client(url: str, parts, drafter: str, tree: str | None) -> Engine:
    d = build_drafter(drafter, SMOL, parts)
    remote = RemoteTarget(url, TOKEN, encoder=encoder_id(d.encoder) if d is not None and d.encoder else None,
                          busy_timeout_s=120)
    adapt = None
    shape = {"chain4": TreeConfig(4, 1, 4), "tree": TreeConfig(3, 2, 6)}.get(tree)
    if tree and tree.startswith("adaptive"):
        shape = TreeConfig.parse(tree)
        adapt = AdaptiveChain(COSTS, shape.depth, width=shape.topk)
    return Engine(remote, d, shape, adapt)


def _run_all(engines: list[Engine], prompts: list[list[int]], cfgs: list[GenerationConfig]) -> list[list[int]]:
    out: list = [None] * len(engines)

    def run(i: int) -> None:
        try:
            out[i] = [t for c in engines[i].stream(prompts[i], cfgs[i]) for t in c.tokens]
        except Exception as e:  # reported below, with the client
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(engines))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    return out


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_eight_sessions_together_equal_their_lone_runs(int8_model, smol_folder, smol_tokenizer, parts, temperature):
    server, run = _server(int8_model, smol_folder, gather_ms=10)
    try:
        prompts = _prompts(smol_tokenizer)
        prompts[4] = prompts[4] * 12  # one long prompt (prefilled in chunks beside the others' rounds)
        cfgs = [GenerationConfig(max_new_tokens=32, sampling=SamplingParams(temperature, seed=None if
                                                                            temperature == 0 else 100 + i))
                for i in range(len(CLIENTS))]
        engines = [_client(run.url, parts, d, t) for d, t in CLIENTS]
        lone = [[t for c in e.stream(p, cfg) for t in c.tokens] for e, p, cfg in zip(engines, prompts, cfgs,
                                                                                    strict=True)]
        passes = server.scheduler.stats.passes
        together = _run_all(engines, prompts, cfgs)
        for (drafter, tree), want, got in zip(CLIENTS, lone, together, strict=True):
            assert got == want, f"{drafter} ({tree}) differs beside the others: {got} vs {want}"
        s = server.scheduler.stats
        assert max(s.seqs_per_pass) >= 4, f"sessions did not share passes: {dict(s.seqs_per_pass)}"
        assert s.passes - passes < sum(len(x) for x in lone)  # fewer passes than tokens written together
        for e in engines:
            e.target.shutdown()
    finally:
        run.stop()
        server.close()


def test_sixteen_clients_against_a_server_sized_for_four(int8_model, smol_folder, smol_tokenizer):
    prompt = smol_tokenizer.encode("Count from one to twenty in words: one, two,")
    cfg = GenerationConfig(max_new_tokens=24)
    # each generation reserves prompt + 24 + one tree (32) tokens of KV cache: four fit in the budget
    per = int8_model.new_cache(1).bytes_for(len(prompt) + 24 + 32)
    server, run = _server(int8_model, smol_folder, kv_memory_mb=1)
    server.admission.budget = 4 * per
    try:
        engines = [Engine(RemoteTarget(run.url, TOKEN, busy_timeout_s=120)) for _ in range(16)]
        want = [t for c in Engine(LocalTarget(int8_model, cache=int8_model.new_cache(256))).stream(prompt, cfg)
                for t in c.tokens]
        got = _run_all(engines, [prompt] * 16, [cfg] * 16)
        assert all(g == want for g in got), [g if isinstance(g, Exception) else len(g) for g in got]
        assert sum(e.target.queued for e in engines) > 0  # some waited in the queue, told so
        _until(lambda: server.admission.holders == 0)  # "end" needs no answer: the server frees it soon after
        assert server.admission.used == 0  # every reservation returned
        with urllib.request.urlopen(urllib.request.Request(
                f"http://127.0.0.1:{run.port}/metrics", headers={"Authorization": f"Bearer {TOKEN}"})) as r:
            text = r.read().decode()
        for name in ("moaspec_batch_rows_bucket", "moaspec_pass_queue", "moaspec_sessions", "moaspec_tokens_total",
                     "moaspec_tokens_per_second", "moaspec_generations_waiting", "moaspec_kv_budget_bytes"):
            assert name in text, name
        for e in engines:
            e.target.shutdown()
    finally:
        run.stop()
        server.close()


def _until(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.05)


def _raw(run):
    ws = connect(f"ws://127.0.0.1:{run.port}{ENDPOINT}",
                 additional_headers={"Authorization": f"Bearer {TOKEN}"}).__enter__()
    assert unpack(ws.recv(timeout=10))[0]["type"] == "ready"
    return ws


def test_full_queue_says_busy_and_when_to_retry(int8_model, smol_folder):
    server, run = _server(int8_model, smol_folder, kv_memory_mb=64, max_waiting=1)
    try:
        holder, waiter, third = _raw(run), _raw(run), _raw(run)
        start = pack({"type": "start", "prompt": [1, 2, 3], "max_new_tokens": 8})
        holder.send(start)
        assert unpack(holder.recv(timeout=30))[0]["type"] == "step"
        server.admission.budget = server.admission.used  # now full: the next start waits
        waiter.send(start)
        assert unpack(waiter.recv(timeout=30))[0] == {"type": "queued", "position": 1}
        third.send(start)  # the queue holds one: told to retry, not dropped
        reply = unpack(third.recv(timeout=30))[0]
        assert reply["type"] == "error" and reply["busy"] and not reply["fatal"] and reply["retry_after"] >= 1
        holder.send(pack({"type": "end"}))  # frees the memory at once: the waiter runs
        while (header := unpack(waiter.recv(timeout=30))[0])["type"] == "queued":
            pass
        assert header["type"] == "step"
        third.send(pack({"type": "ping"}))
        assert unpack(third.recv(timeout=10))[0]["type"] == "pong"  # the refused session lives on
        for ws in (holder, waiter, third):
            ws.close()
        _until(lambda: server.admission.holders == 0)
        assert server.admission.used == 0
    finally:
        run.stop()
        server.close()


def test_metrics_and_openapi_are_not_open(int8_model, smol_folder):
    server, run = _server(int8_model, smol_folder)
    try:
        base = f"http://127.0.0.1:{run.port}"
        for path in ("/metrics", "/openapi.json"):
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(base + path)
            assert e.value.code in (401, 404)
        with urllib.request.urlopen(base + "/health") as r:
            assert r.read() == b'{"status":"ok"}'
    finally:
        run.stop()
        server.close()


def test_generate_many_equals_lone_generations(smol_folder):
    from moaspec.pipeline import SpecDecoder, generate_many

    dec = SpecDecoder(SMOL, drafter="suffix", weights="int8", tree="adaptive:3", warmup=False)
    prompts = ["Name a fruit.", "What is 2 + 2?", "Write a haiku about snow.", "", "Say hi."]
    cfg = GenerationConfig(max_new_tokens=16)
    lone = {i: dec.generate(p, cfg).token_ids for i, p in enumerate(prompts) if p}
    got = dict(generate_many(dec, prompts, cfg, parallel=3))
    assert sorted(got) == list(range(5))
    assert isinstance(got[3], Exception) and "empty" in str(got[3])  # one bad prompt fails alone
    assert {i: g.token_ids for i, g in got.items() if i != 3} == lone


def test_cli_generates_a_jsonl_file_of_prompts(tmp_path, capsys):
    import json

    from moaspec.cli import main

    f = tmp_path / "prompts.jsonl"
    f.write_text('"Name a color."\n{"prompt": "Count to three."}\n\n"Name a fruit."\n')
    assert main(["generate", "--prompt-file", str(f), "--weights", "int8", "--max-new-tokens", "6",
                 "--drafter", "lookup", "--parallel", "2"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["index"] for x in lines] == [0, 1, 2] and all(1 <= x["new_tokens"] <= 6 and x["text"] for x in lines)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": 3}\n')
    assert main(["generate", "--prompt-file", str(bad)]) == 2
    assert "line 1" in capsys.readouterr().err


# ----------------------------------------------------------------------------- admission
def test_admission_is_fifo_bounded_and_gives_back_what_leaves():
    import asyncio

    from moaspec.link.protocol import Busy, ProtocolError
    from moaspec.serving.admission import Admission

    async def scenario():
        a = Admission(budget=100, max_waiting=2, max_holders=3)
        first = await a.acquire(60)
        order: list[str] = []

        async def wait(name: str, n: int) -> float:
            granted = await a.acquire(n, every_s=0.01)
            order.append(name)
            return granted

        big = asyncio.create_task(wait("big", 70))  # does not fit beside the first: waits
        await asyncio.sleep(0.01)
        small = asyncio.create_task(wait("small", 10))  # fits, but the queue is first come first served
        await asyncio.sleep(0.01)
        assert a.waiting == 2 and a.full() and order == []
        try:
            await a.acquire(1)
            raise AssertionError("a full queue must refuse")
        except Busy as e:
            assert e.retry_after >= 1
        try:
            await a.acquire(101)
            raise AssertionError("more than the budget can never be granted")
        except ProtocolError:
            pass
        a.release(60, first)
        g_big, g_small = await big, await small
        assert order == ["big", "small"] and a.used == 80 and a.holders == 2
        gone = asyncio.create_task(wait("gone", 50))  # waits, then its client goes away
        await asyncio.sleep(0.01)
        gone.cancel()
        await asyncio.sleep(0.01)
        assert a.waiting == 0
        a.release(70, g_big)
        a.release(10, g_small)
        assert a.used == 0 and a.holders == 0

    asyncio.run(scenario())


def test_data_engine_writes_the_answers_of_the_mode_it_serves(smol_tokenizer):
    from moaspec.decoding.sampling import SamplingParams
    from moaspec.pipeline import SpecDecoder
    from moaspec.training.generators import Request, RuntimeGenerator

    eos = smol_tokenizer.convert_tokens_to_ids("<|im_end|>")
    gen = RuntimeGenerator(SMOL, "int8", eos, parallel=3, max_len=512)
    prompts = _prompts(smol_tokenizer)[:4]
    reqs = [Request(f"q{i}", p, 0.0 if i % 2 else 0.7, 10 + i) for i, p in enumerate(prompts)]
    answers = {a.key: a for a in gen.generate(reqs, 20)}
    assert sorted(answers) == ["q0", "q1", "q2", "q3"]
    lone = SpecDecoder(SMOL, weights="int8", warmup=False)
    for r in reqs:
        want = lone.generate(r.prompt, GenerationConfig(max_new_tokens=20, sampling=SamplingParams(r.temperature,
                                                                                                 seed=r.seed)))
        a = answers[r.key]
        assert a.tokens[:len(want.token_ids)] == want.token_ids and a.finished == (want.finish_reason == "stop")
        assert a.tokens[len(want.token_ids):] == ([eos] if a.finished else [])


def test_data_engine_stores_the_features_of_its_answers_from_the_same_passes(smol_tokenizer, tmp_path):
    """One pass per token: the features recorded while the answers were written are the target's own (a
    whole-sequence pass in the same mode gives the same K/V and hidden states up to fp16 storage), cover
    every position, and the feature cache reads them instead of computing."""
    import numpy as np

    from moaspec.models.runtime import Transformer
    from moaspec.models.store import resolve
    from moaspec.training.features import AnswerFeatures, FeatureCache, compute
    from moaspec.training.generators import Request, RuntimeGenerator

    eos = smol_tokenizer.convert_tokens_to_ids("<|im_end|>")
    gen = RuntimeGenerator(SMOL, "fp16", eos, parallel=3, max_len=256, features=True)
    L = gen.dec.target.cfg.num_layers
    assert gen.features == (L - 3, L - 1, L)
    prompts = _prompts(smol_tokenizer)[:3]
    reqs = [Request(f"q{i}", p, 0.0 if i % 2 else 0.7, 10 + i) for i, p in enumerate(prompts)]
    answers = {a.key: a for a in gen.generate(reqs, 12)}
    store = AnswerFeatures("fp", "fp16", root=tmp_path)
    target = Transformer(resolve(SMOL), weights="fp16", max_seq_len=256)
    seqs = []
    for r in reqs:
        a = answers[r.key]
        ids = r.prompt + a.tokens
        kv, hidden = a.features
        assert kv.shape[0] == len(ids) and kv.dtype == np.float16
        want = compute(target, ids, gen.features, greedy=False)
        got_k = torch.from_numpy(kv[:, 0].astype(np.float32)).permute(1, 2, 0, 3)
        assert torch.allclose(got_k, want.K, atol=2e-2, rtol=1e-2)
        for layer in gen.features:
            assert torch.allclose(torch.from_numpy(hidden[layer].astype(np.float32)), want.hidden[layer],
                                  atol=5e-2, rtol=1e-2)
        store.write(r.key, ids, kv, hidden)
        seqs.append(ids)
    assert store.read("q0", seqs[0] + [1], (L,)) is None  # other tokens: not these features
    assert store.read("q0", seqs[0], (L - 2,)) is None  # a layer it does not keep
    cache = FeatureCache(target, "fp|fp16", [s[:-2] for s in seqs], (L - 1, L), greedy=False, root=tmp_path,
                         stored=store, names=[r.key for r in reqs])
    f = cache.get(1)
    assert cache.read_tokens == len(seqs[1]) - 2 and cache.computed_tokens == 0
    np.testing.assert_array_equal(f.hidden[L].numpy(), answers["q1"].features[1][L][:-2].astype(np.float32))


def test_a_scheduler_whose_loop_dies_fails_its_requests_and_its_health_check(smol_folder):
    """Found in review: a dead scheduler thread left a Ray replica's requests waiting forever and the replica
    healthy. Now the waiting and later requests fail at once with the reason, and `check_health` (what a replica's
    Ray health check calls) raises, so Ray Serve replaces it."""
    from moaspec.serving.cluster import Replica

    model = Transformer(smol_folder, weights="int8", max_seq_len=256)
    sched = Scheduler(model, gather_ms=0)
    sched.check_health()
    cache = model.new_cache(64)
    assert sched.call(sched.run, Rows(torch.tensor([1, 2, 3]), cache), 1).result(60).logits.shape[0] == 3

    def broken(batch):
        raise MemoryError("pretend the pass ran out of memory in the loop")

    sched._pass = broken
    with pytest.raises(UserError, match="MemoryError"):
        sched.call(sched.run, Rows(torch.tensor([4]), cache), 1).result(60)
    with pytest.raises(UserError, match="scheduler stopped"):
        sched.call(sched.run, Rows(torch.tensor([5]), cache), 1)  # at once, not after a pass that never comes
    with pytest.raises(RuntimeError, match="MemoryError"):
        sched.check_health()
    replica = Replica()
    replica._asgi_app = type("App", (), {"state": type("S", (), {"scheduler": sched})()})()
    with pytest.raises(RuntimeError):
        replica.check_health()


def test_one_token_cannot_hold_the_whole_kv_budget(int8_model, smol_folder):
    """Found in review: one bearer token's sessions could reserve the whole KV budget and keep every other client
    waiting. With two tokens each may hold half (`token_kv_share`): past it a start is told to retry, while the
    other token's start goes through; what a token gives back is its own again."""
    fp = weights_fingerprint(smol_folder)
    lim = Limits(max_prompt_tokens=256, max_seq_len=512, max_tree_tokens=32, kv_memory_mb=64)
    server = TargetServer(int8_model, SMOL, fp, [TOKEN, "other-token"], {}, lim, pass_costs=COSTS)
    per = int8_model.new_cache(1).bytes_for(3 + 8 + 32)
    server.admission.budget = 4 * per  # two generations per token
    run = Running(server.app, scheme="ws", ws_max_size=server.limits.max_message_bytes)

    def session(token):
        ws = connect(f"ws://127.0.0.1:{run.port}{ENDPOINT}", additional_headers={"Authorization": f"Bearer {token}"})
        ws = ws.__enter__()
        assert unpack(ws.recv(timeout=10))[0]["type"] == "ready"
        return ws

    start = pack({"type": "start", "prompt": [1, 2, 3], "max_new_tokens": 8})
    try:
        mine = [session(TOKEN) for _ in range(3)]
        for ws in mine[:2]:
            ws.send(start)
            assert unpack(ws.recv(timeout=30))[0]["type"] == "step"
        mine[2].send(start)
        refused = unpack(mine[2].recv(timeout=30))[0]
        assert refused.get("busy") and not refused["fatal"] and "share" in refused["message"]
        theirs = session("other-token")
        theirs.send(start)
        assert unpack(theirs.recv(timeout=30))[0]["type"] == "step"  # the other client is not kept out
        mine[0].send(pack({"type": "end"}))
        _until(lambda: server.held_by_token[TOKEN] == per)
        mine[2].send(start)
        assert unpack(mine[2].recv(timeout=30))[0]["type"] == "step"
        for ws in (*mine, theirs):
            ws.close()
        _until(lambda: server.admission.used == 0)
        assert server.admission.used == 0 and not +server.held_by_token
    finally:
        run.stop()
        server.close()
