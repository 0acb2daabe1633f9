"""Client-server mode on loopback: a real uvicorn server in this process (its own thread and event
loop), real WebSocket clients, the shaping proxy between them.

Lossless over the network (greedy output equal to plain single-device decoding, for token-only and
context drafters), the wire encodings, the partial target, and the server's guards: bearer token,
malformed and oversized messages, limits, session isolation.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
import torch
from servers import Running
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from experiments.shaping import ShapingProxy
from moaspec.decoding.context import decode, encode
from moaspec.decoding.engine import GenerationConfig
from moaspec.decoding.sampling import SamplingParams
from moaspec.decoding.target import LocalTarget
from moaspec.decoding.tree import TreeConfig
from moaspec.drafters.moa import MoAContext
from moaspec.errors import UserError
from moaspec.link.protocol import ENDPOINT, Busy, Limits, pack, unpack
from moaspec.link.remote import RemoteTarget, TargetUnavailable
from moaspec.models.parts import PartialTarget
from moaspec.models.runtime import Transformer
from moaspec.models.store import weights_fingerprint
from moaspec.pipeline import SpecDecoder
from moaspec.serving.target_server import TargetServer, load_encoders

SMOL = "smollm2-135m"
TOKEN = "test-token-123"
PROMPT = "Write a Python function that returns the squares of a list of numbers."
COSTS = {1: 10.0, 2: 10.2, 4: 10.8, 8: 12.0}


@pytest.fixture(scope="module")
def served(smol_folder):
    model = Transformer(smol_folder)
    fp = weights_fingerprint(smol_folder)
    server = TargetServer(model, SMOL, fp, TOKEN, load_encoders(model, SMOL, fp),
                          Limits(max_prompt_tokens=512, max_seq_len=1024, max_tree_tokens=32, max_sessions=3,
                                 max_message_bytes=1 << 16), pass_costs=COSTS)
    run = Running(server.app, scheme="ws", ws_max_size=server.limits.max_message_bytes)
    yield server, run
    run.stop()


def _cfg(n: int = 48) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=n)


def test_partial_target_loads_only_what_a_drafter_shares(smol_folder, smol_model):
    parts = PartialTarget(smol_folder)
    assert torch.equal(parts.embed, smol_model.embed) and torch.equal(parts.norm, smol_model.norm)
    assert parts.tail == 0 and parts.num_parameters() < smol_model.num_parameters() / 3
    layer = parts.tail_layers(2)[0]  # read on demand
    assert parts.tail == 2 and torch.equal(layer.ln1, smol_model.tail_layers(2)[0].ln1)
    with pytest.raises(UserError, match="layers"):
        parts.tail_layers(smol_model.cfg.num_layers + 1)


@pytest.mark.parametrize("wire,tol", [("fp32", 0.0), ("fp16", 1e-3), ("int8", 2e-2)])
def test_context_wire_encodings(wire, tol):
    g = torch.Generator().manual_seed(0)
    ctx = MoAContext(torch.randn(5, 64, generator=g), (torch.randn(1, 2, 5, 8, generator=g),
                                                        torch.randn(1, 2, 5, 8, generator=g)),
                     torch.randn(1, 64, generator=g))  # the last token's final state (query_state)
    data = encode(ctx, wire)
    back = decode(data)
    assert isinstance(back, MoAContext) and len(back) == 5
    for a, b in zip(ctx.tensors().values(), back.tensors().values(), strict=True):
        assert (a - b).abs().max() <= tol * a.abs().max() + 1e-12
    sizes = {w: len(encode(ctx, w)) for w in ("fp32", "fp16", "int8")}
    assert sizes["int8"] < sizes["fp16"] < sizes["fp32"]
    with pytest.raises(UserError, match="malformed"):
        decode(b"not safetensors")
    with pytest.raises(UserError, match="final state"):
        MoAContext.from_tensors({"vectors": torch.zeros(5, 64), "state": torch.zeros(2, 64)})


@pytest.mark.parametrize("drafter", ["lookup", "moa", "eagle"])
def test_remote_generation_equals_plain(served, dec_none, drafter):
    server, run = served
    want = dec_none.generate(PROMPT, _cfg()).token_ids
    client = SpecDecoder(SMOL, drafter=drafter, target_url=run.url, token=TOKEN, tree="adaptive:4")
    got = client.generate(PROMPT, _cfg())
    assert got.token_ids == want
    remote = client.remote
    assert remote.calls == got.metrics.target_calls + 1  # + the prefill
    assert remote.bytes_out > 0 and remote.bytes_in > 0
    if drafter != "lookup":  # context for every verified token came back
        assert remote.bytes_in > 2 * len(want) * client.target.cfg.hidden_size
    remote.close()


def test_remote_through_a_shaped_link_equals_plain(served, dec_none):
    server, run = served
    want = dec_none.generate(PROMPT, _cfg(24)).token_ids
    with ShapingProxy(("127.0.0.1", run.port), profile="wifi") as proxy:
        client = SpecDecoder(SMOL, drafter="moa", target_url=f"ws://127.0.0.1:{proxy.port}", token=TOKEN,
                             tree="adaptive:4", wire="int8")
        got = client.generate(PROMPT, _cfg(24))
        assert got.token_ids == want
        assert client.remote.ping() >= 2 * proxy.profile.delay_ms * 0.9
        traffic = proxy.traffic()
        assert traffic.to_server >= client.remote.bytes_out and traffic.to_client >= client.remote.bytes_in
        client.remote.close()


def test_bad_token_and_no_token_are_refused(served):
    _, run = served
    with pytest.raises(UserError, match="refused the bearer token"):
        RemoteTarget(run.url, "wrong-token")
    with pytest.raises(Exception):  # noqa: B017 - the handshake itself is rejected (HTTP 403)
        connect(run.url + ENDPOINT).__enter__().close()


def test_unreachable_server_is_target_unavailable():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    with pytest.raises(TargetUnavailable):
        RemoteTarget(f"ws://127.0.0.1:{port}", TOKEN, connect_timeout_s=2)


def _raw(run):
    ws = connect(run.url + ENDPOINT, additional_headers={"Authorization": f"Bearer {TOKEN}"}).__enter__()
    header, _ = unpack(ws.recv(timeout=10))
    assert header["type"] == "ready"
    return ws


def _ask(ws, frame) -> dict:
    ws.send(frame)
    return unpack(ws.recv(timeout=30))[0]


def test_malformed_messages_get_errors_and_the_session_survives(served, smol_tokenizer):
    server, run = served
    ws = _raw(run)
    prompt = smol_tokenizer.encode("Hello there")
    bad = [
        b"\x00",  # too short to be a frame
        b"\xff\xff\xff\x00garbage",  # header length past the frame
        (5).to_bytes(4, "little") + b"nope!",  # not JSON
        pack({"type": "fly"}),
        pack({"type": "verify", "tokens": [1], "parents": [-1]}),  # before start
        pack({"type": "start", "prompt": []}),
        pack({"type": "start", "prompt": ["a"]}),
        pack({"type": "start", "prompt": [10**9]}),
        pack({"type": "start", "prompt": list(range(600))}),  # over max_prompt_tokens
        pack({"type": "start", "prompt": prompt, "sampling": {"temperature": -1}}),
        pack({"type": "start", "prompt": prompt, "sampling": {"temperature": "hot"}}),
        pack({"type": "start", "prompt": prompt, "encoder": "someone-else"}),
        pack({"type": "start", "prompt": prompt, "wire": "int3"}),
    ]
    for frame in bad:
        reply = _ask(ws, frame)
        assert reply["type"] == "error" and not reply["fatal"], (frame[:40], reply)
    step = _ask(ws, pack({"type": "start", "prompt": prompt}))
    assert step["type"] == "step" and step["length"] == len(prompt)
    for frame in (pack({"type": "verify", "tokens": [step["bonus"]] * 40, "parents": [-1, *range(39)]}),  # > 32
                  pack({"type": "verify", "tokens": [1, 2], "parents": [-1, 5]}),
                  pack({"type": "verify", "tokens": [1, 2], "parents": [-1, 0], "dists": {"0": [[3], [1.0]]}}),
                  pack({"type": "verify", "tokens": [1, 2], "parents": [-1, 0], "dists": {"\u00b2": [[3], [1.0]]}})):
        reply = _ask(ws, frame)
        assert reply["type"] == "error" and not reply["fatal"]
    step2 = _ask(ws, pack({"type": "verify", "tokens": [step["bonus"]], "parents": [-1]}))
    assert step2["type"] == "step" and step2["length"] == len(prompt) + 1
    ws.close()


def test_oversized_message_closes_only_that_session(served):
    server, run = served
    ws = _raw(run)
    ws.send(pack({"type": "start", "prompt": [1] * 40000}))  # > max_message_bytes (64 KiB)
    with pytest.raises(Exception):  # noqa: B017 - the server closes the connection (1009)
        ws.recv(timeout=10)
    other = _raw(run)  # the server is still up
    assert _ask(other, pack({"type": "ping"}))["type"] == "pong"
    other.close()


def test_sessions_per_token_are_bounded_and_isolated(served, smol_tokenizer, dec_none):
    server, run = served
    time.sleep(0.3)  # let earlier tests' sessions close
    a, b = _raw(run), _raw(run)
    c = _raw(run)
    t0 = time.monotonic()
    with pytest.raises(Busy, match="this token has 3 sessions open") as refused:  # the fourth: told to retry
        RemoteTarget(run.url, TOKEN, busy_timeout_s=2.0)
    assert refused.value.retry_after > 0 and time.monotonic() - t0 < 2.0  # not worth waiting for: said at once
    # two sessions on one set of weights, interleaved, each sees only its own cache
    pa, pb = smol_tokenizer.encode("The capital of France is"), smol_tokenizer.encode("def fibonacci(n):")
    sa, sb = _ask(a, pack({"type": "start", "prompt": pa})), _ask(b, pack({"type": "start", "prompt": pb}))
    ra = _ask(a, pack({"type": "verify", "tokens": [sa["bonus"]], "parents": [-1]}))
    rb = _ask(b, pack({"type": "verify", "tokens": [sb["bonus"]], "parents": [-1]}))
    assert ra["length"] == len(pa) + 1 and rb["length"] == len(pb) + 1
    local = LocalTarget(dec_none.target)
    for prompt, s, r in ((pa, sa, ra), (pb, sb, rb)):
        assert r["bonus"] == local.start(prompt + [s["bonus"]], SamplingParams()).verdict.bonus
    for ws in (a, b, c):
        ws.close()


# ----------------------------------------------------------------------------- disconnection
def replay(chunks) -> tuple[list[int], list[bool], list]:
    """What a client shows: tokens with their verified flags, corrections applied; and the chunks."""
    toks: list[int] = []
    flags: list[bool] = []
    seen = []
    for c in chunks:
        seen.append(c)
        if c.rollback:
            assert not any(flags[-c.rollback:]), "only unverified tokens are ever rolled back"
            del toks[-c.rollback:], flags[-c.rollback:]
        toks += c.tokens
        flags += [c.verified] * len(c.tokens)
    return toks, flags, seen


def _cut_after(chunks, n_verified: int, action):
    """Pass chunks through; call `action` once `n_verified` verified tokens went by."""
    count, fired = 0, False
    for c in chunks:
        if c.verified:
            count += len(c.tokens)
        yield c
        if not fired and count >= n_verified:
            fired = True
            action()


@pytest.mark.parametrize("drafter", ["moa", "eagle"])
def test_link_down_the_drafter_writes_alone_then_the_target_corrects(served, dec_none, drafter):
    """Greedy: after the outage the corrected text equals plain decoding exactly."""
    server, run = served
    cfg = GenerationConfig(max_new_tokens=64, reconnect_timeout_s=30)
    want = dec_none.generate(PROMPT, cfg).token_ids
    with ShapingProxy(("127.0.0.1", run.port)) as proxy:
        client = SpecDecoder(SMOL, drafter=drafter, target_url=f"ws://127.0.0.1:{proxy.port}", token=TOKEN,
                             tree="adaptive:4", target_timeout_s=2)
        ids = client.encode(PROMPT)
        timer = threading.Timer(1.5, proxy.up)

        def outage():
            proxy.down("refuse")  # resets the live session and refuses new ones
            timer.start()

        toks, flags, chunks = replay(_cut_after(client.engine.stream(ids, cfg), 12, outage))
        timer.join()
        m = client.engine.metrics
        assert any(not c.verified for c in chunks), "no token was written while the link was down"
        assert any(c.rollback for c in chunks) and m.reconnects == 1
        assert toks == want and all(flags)
        assert m.unverified_tokens > 0 and m.new_tokens == len(want)
        client.remote.shutdown()


def test_server_gone_for_good_ends_with_unverified_tokens(served):
    server, run = served
    cfg = GenerationConfig(max_new_tokens=40, reconnect_timeout_s=0.5)
    with ShapingProxy(("127.0.0.1", run.port)) as proxy:
        client = SpecDecoder(SMOL, drafter="moa", target_url=f"ws://127.0.0.1:{proxy.port}", token=TOKEN,
                             tree="adaptive:4", target_timeout_s=2)
        toks, flags, chunks = replay(_cut_after(client.engine.stream(client.encode(PROMPT), cfg), 8,
                                                lambda: proxy.down("blackhole")))
        assert chunks[-1].finish_reason in ("length", "stop") and not chunks[-1].verified
        assert flags[0] and not flags[-1] and len(toks) <= 40
        n_unverified = flags.count(False)
        assert n_unverified == client.engine.metrics.unverified_tokens > 0
        client.remote.shutdown()


def test_keep_policy_keeps_the_drafted_text(served):
    server, run = served
    cfg = GenerationConfig(max_new_tokens=48, resync="keep")
    with ShapingProxy(("127.0.0.1", run.port)) as proxy:
        client = SpecDecoder(SMOL, drafter="moa", target_url=f"ws://127.0.0.1:{proxy.port}", token=TOKEN,
                             tree="adaptive:4", target_timeout_s=2)
        timer = threading.Timer(0.5, proxy.up)

        def outage():
            proxy.down("refuse")
            timer.start()

        toks, flags, chunks = replay(_cut_after(client.engine.stream(client.encode(PROMPT), cfg), 8, outage))
        timer.join()
        m = client.engine.metrics
        assert not any(c.rollback for c in chunks) and m.reconnects == 1
        # the kept tokens stay marked, in one run; what follows (if the drafter left room) is the target's
        first = flags.index(False)
        n = flags.count(False)
        assert flags[first:first + n] == [False] * n and all(flags[first + n:])
        assert m.new_tokens == len(toks) == 48 or chunks[-1].finish_reason == "stop"
        client.remote.shutdown()


def _free_port() -> int:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


def _serve_process(port: int, token_file) -> subprocess.Popen:
    """`moaspec serve-target` as its own process; returns once it answers /health."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "moaspec", "serve-target", "--model", SMOL, "--port", str(port),
                             "--weights", "fp32", "--token-file", str(token_file)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"serve-target exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if json.loads(r.read())["status"] == "ok":
                    return proc
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise AssertionError("serve-target did not come up in 120 s")


@pytest.mark.slow  # a real serve-target killed and restarted (~27 s): make test-slow
def test_server_killed_mid_generation_then_restarted(tmp_path, dec_none):
    """Real processes, through the shaping proxy (wifi): the server is killed (SIGKILL) mid-generation;
    the client goes on alone with MoA, marks those tokens unverified, reconnects when a new server
    process is up on the same port, re-verifies and corrects: the final text equals plain greedy."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    port = _free_port()
    cfg = GenerationConfig(max_new_tokens=64, reconnect_timeout_s=180)
    want = dec_none.generate(PROMPT, cfg).token_ids
    procs = [_serve_process(port, token_file)]
    proxy = ShapingProxy(("127.0.0.1", port), profile="wifi").start()
    try:
        client = SpecDecoder(SMOL, drafter="moa", target_url=f"ws://127.0.0.1:{proxy.port}", token=TOKEN,
                             tree="adaptive:4", target_timeout_s=5)
        restart = threading.Thread(target=lambda: procs.append(_serve_process(port, token_file)))

        def kill():
            procs[0].send_signal(signal.SIGKILL)
            procs[0].wait()
            restart.start()

        toks, flags, chunks = replay(_cut_after(client.engine.stream(client.encode(PROMPT), cfg), 10, kill))
        restart.join()
        m = client.engine.metrics
        assert m.unverified_tokens > 0 and m.reconnects == 1 and any(c.rollback for c in chunks)
        assert toks == want and all(flags)
        assert proxy.traffic().to_server >= client.remote.bytes_out
        client.remote.shutdown()
    finally:
        proxy.close()
        for p in procs:
            p.kill()
            p.wait()


def test_streamed_text_stays_verified_across_an_outage(served, dec_none):
    """`SpecDecoder.stream` puts only verified text in `Delta.text`: the outage is invisible in the result.
    What the drafter wrote alone meanwhile comes as `pending` pieces, withdrawn (`retract`) by the first
    verified delta after it, which re-states that text as the target verified or corrected it."""
    server, run = served
    cfg = GenerationConfig(max_new_tokens=48)
    want = dec_none.generate(PROMPT, cfg)
    with ShapingProxy(("127.0.0.1", run.port)) as proxy:
        client = SpecDecoder(SMOL, drafter="moa", target_url=f"ws://127.0.0.1:{proxy.port}", token=TOKEN,
                             tree="adaptive:4", target_timeout_s=2)
        timer = threading.Timer(1.0, proxy.up)
        deltas, shown = [], 0
        for d in client.stream(PROMPT, cfg, pieces=True):
            if d.pending:  # shown until the next verified delta, which withdraws every one of them
                assert not d.text and not d.tokens and d.retract == 0
                shown += len(d.pending)
            else:
                assert d.retract == shown
                shown = 0
            deltas.append(d)
            if len([x for x in deltas if x.text]) == 3 and not timer.is_alive() and not timer.finished.is_set():
                proxy.down("refuse")
                timer.start()
        timer.join()
        assert "".join(d.text for d in deltas) == want.text and [t for d in deltas for t in d.tokens] == want.token_ids
        assert "".join(t for d in deltas for t, _ in d.pieces) == want.text
        assert any(d.pending for d in deltas) and any(d.retract for d in deltas)
        assert {o for d in deltas for _, o in d.pieces} <= {"moa", "target"}  # corrected: nothing unverified
        m = client.engine.metrics
        assert m.reconnects == 1 and m.unverified_tokens > 0
        client.remote.shutdown()


# ----------------------------------------------------------------------------- one engine, two target sides
@pytest.mark.parametrize("drafter,temperature", [
    *((d, t) for d in ("none", "lookup", "suffix", "model", "moa", "eagle", "independent") for t in (0.0, 1.0)),
    ("hybrid", 0.0),  # it picks its source per round by live timings, which the network changes: at T > 0
])                    # its drafts, and so the seeded sample (exact in law either way), differ
def test_remote_target_runs_the_engine_exactly_as_local(served, drafter, temperature):
    """The same engine over `LocalTarget` and over `RemoteTarget` (fp32 wire, fixed tree): the same
    tokens, greedy or seeded sampling (the target's draws are seeded on the server as in-process)."""
    server, run = served
    tree = None if drafter == "none" else TreeConfig(3, 2, 4)
    cfg = GenerationConfig(max_new_tokens=24, sampling=SamplingParams(temperature=temperature, seed=7))
    local = SpecDecoder(SMOL, drafter=drafter, tree=tree, warmup=False)
    remote = SpecDecoder(SMOL, drafter=drafter, tree=tree, target_url=run.url, token=TOKEN, wire="fp32")
    want, got = local.generate(PROMPT, cfg), remote.generate(PROMPT, cfg)
    assert got.token_ids == want.token_ids
    if drafter != "hybrid":
        assert got.metrics.accept_lengths == want.metrics.accept_lengths
    remote.remote.shutdown()


def test_token_file_reading(tmp_path, monkeypatch):
    from moaspec.link.remote import read_token

    f = tmp_path / "token"
    f.write_text("  s3cret  \nignored\n")
    assert read_token(str(f)) == "s3cret"
    f.write_text("   \n\n")  # whitespace only: an error, not a traceback
    with pytest.raises(UserError, match="is empty"):
        read_token(str(f))
    with pytest.raises(UserError, match="cannot read"):
        read_token(str(tmp_path / "missing"))
    monkeypatch.setenv("MOASPEC_TOKEN", " from-env ")
    assert read_token(None) == "from-env"
    monkeypatch.delenv("MOASPEC_TOKEN")
    with pytest.raises(UserError, match="no bearer token"):
        read_token(None)


# ----------------------------------------------------------------------------- review fixes
def test_deep_json_is_a_protocol_error(served):
    _, run = served
    ws = _raw(run)
    frame = b'{"type": "start", "prompt": ' + b"[" * 20_000 + b"]" * 20_000 + b"}"
    ws.send(len(frame).to_bytes(4, "little") + frame)
    header, _ = unpack(ws.recv(timeout=10))
    assert header["type"] == "error" and not header["fatal"] and "nests too deeply" in header["message"]
    assert _ask(ws, pack({"type": "ping"}))["type"] == "pong"  # the session lives on
    ws.close()


def test_pings_do_not_keep_an_idle_session_open(smol_folder):
    model = Transformer(smol_folder, weights="int8", max_seq_len=256)
    fp = weights_fingerprint(smol_folder)
    server = TargetServer(model, SMOL, fp, TOKEN, {}, Limits(max_prompt_tokens=64, max_seq_len=256,
                                                             idle_timeout_s=1.0))
    run = Running(server.app, scheme="ws")
    try:
        ws = _raw(run)
        t0 = time.monotonic()
        with pytest.raises(ConnectionClosed):  # closed although it pinged every 0.2 s
            while time.monotonic() - t0 < 5:
                ws.send(pack({"type": "ping"}))
                ws.recv(timeout=2)
                time.sleep(0.2)
        assert 0.9 < time.monotonic() - t0 < 3
    finally:
        run.stop()
        server.close()


def test_a_resumed_generation_may_be_as_long_as_the_context(served, smol_tokenizer):
    server, run = served
    long = (smol_tokenizer.encode("one two three four five six seven eight nine ten ") * 80)[:700]
    assert server.limits.max_prompt_tokens < len(long) < server.limits.max_seq_len
    ws = _raw(run)
    refused = _ask(ws, pack({"type": "start", "prompt": long}))
    assert refused["type"] == "error" and "at most 512" in refused["message"]
    resumed = _ask(ws, pack({"type": "start", "prompt": long, "resume": True, "max_new_tokens": 8}))
    assert resumed["type"] == "step" and resumed["length"] == len(long)
    ws.close()


def test_reconnecting_stops_on_a_permanent_refusal(served):
    server, run = served
    remote = RemoteTarget(run.url, TOKEN)
    saved = server.tokens_allowed
    try:
        server.tokens_allowed = ["another-token"]  # this client's token is revoked
        remote.reconnect_in_background()
        with pytest.raises(UserError, match="refused the bearer token"):
            for _ in range(100):
                remote.available()
                time.sleep(0.05)
        assert not remote._retry.is_alive()  # it stopped trying
    finally:
        server.tokens_allowed = saved
        remote.shutdown()
    assert not remote._retry.is_alive()


def test_a_client_refuses_a_server_with_other_weights(served):
    _, run = served
    with pytest.raises(UserError, match="not the 0000"):  # checked on every (re)connection
        RemoteTarget(run.url, TOKEN, fingerprint="0" * 16)
    remote = RemoteTarget(run.url, TOKEN)  # a server that came back with the same weights in another mode
    assert remote.info["weights"] == "fp32"
    remote.start([1, 2, 3], SamplingParams())
    with pytest.raises(UserError, match="now runs its target in int8 weights, not fp32"):  # mid-generation
        remote._ready({**remote.info, "weights": "int8"})
    remote.release()
    remote._ready({**remote.info, "weights": "int8"})  # between generations it is another server, and fine
    with pytest.raises(UserError, match="not the"):  # or other weights altogether, with no fingerprint given
        remote._ready({**remote.info, "fingerprint": "f" * 16})
    remote.shutdown()


def test_text_the_target_never_verified_is_counted_and_marked(served):
    from moaspec.serving.api_generation import usage_body

    _, run = served
    cfg = GenerationConfig(max_new_tokens=40, reconnect_timeout_s=0.5)
    with ShapingProxy(("127.0.0.1", run.port)) as proxy:
        client = SpecDecoder(SMOL, drafter="moa", target_url=f"ws://127.0.0.1:{proxy.port}", token=TOKEN,
                             tree="adaptive:4", target_timeout_s=2)
        ids = client.encode(PROMPT)
        steps = client.stream(ids, cfg, pieces=True)
        tokens = list(next(steps).tokens)
        proxy.down("blackhole")
        last = None
        for last in steps:
            tokens += last.tokens
        m = client.engine.metrics
        assert 0 < m.unverified_in_output <= m.unverified_tokens and len(tokens) <= 40
        # the text the target never verified is labelled so, and no pending piece is left shown
        assert last.retract > 0 and [o for _, o in last.pieces].count("unverified") == m.unverified_in_output
        usage = usage_body(len(ids), len(tokens), m, {"drafter": "moa", "weights": "fp32"})
        assert usage.unverified_tokens == m.unverified_in_output  # the API writes it into `usage`
        client.remote.shutdown()


def test_a_sessions_next_turn_and_a_reconnection_reuse_its_kv_on_the_server(served, dec_none):
    """The server keeps an ended generation's cache (within --cache-ram): the session's next turn, and a new
    session after a reconnect, prefill only what is new; the answers equal plain local decoding (fp32 here:
    whole prefill chunks are kept)."""
    server, run = served
    system = "You are a careful assistant who answers in a few sentences. " * 12
    conv = [{"role": "system", "content": system}, {"role": "user", "content": "Name a prime number."}]
    client = SpecDecoder(SMOL, drafter="lookup", target_url=run.url, token=TOKEN, tree="adaptive:4")
    first = client.generate(client.encode(conv), _cfg(16))
    conv += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And another one?"}]
    ids = client.encode(conv)
    second = client.generate(ids, _cfg(16))
    assert second.metrics.cached_tokens >= 128 and second.metrics.cached_tokens % 64 == 0
    assert second.token_ids == dec_none.generate(ids, _cfg(16)).token_ids
    client.remote.close()
    again = SpecDecoder(SMOL, drafter="lookup", target_url=run.url, token=TOKEN, tree="adaptive:4")
    third = again.generate(ids, _cfg(16))  # a new session: the cache comes from the kept ones
    assert third.metrics.cached_tokens == second.metrics.cached_tokens and third.token_ids == second.token_ids
    again.remote.close()
