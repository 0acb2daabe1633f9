"""Fuzzing every network input surface, against real servers on loopback.

- the OpenAI API with schemathesis, from the server's own /openapi.json: schema-valid and invalid
  requests, no 5xx, every answer in its documented status codes, content types and shapes;
- the target server's messages with hypothesis: arbitrary bytes and arbitrary JSON headers of every
  message type never get an internal error and never end the session; a well-formed session still
  gives the target's greedy tokens afterwards;
- a stateful test of connect / start / verify / disconnect / reconnect / re-verify whose invariant is
  that the committed text is the target's own greedy text.

Examples per test: MOASPEC_FUZZ_EXAMPLES (default small, for the suite); `make fuzz` runs them long
and writes the counts to bench-out/fuzz.json (docs/reliability.md).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from servers import Running
from websockets.sync.client import connect

from moaspec.decoding.engine import GenerationConfig
from moaspec.link.protocol import ENDPOINT, Limits, ProtocolError, pack, unpack
from moaspec.models.runtime import Transformer
from moaspec.models.store import weights_fingerprint
from moaspec.serving.openai_api import ApiLimits, create_app
from moaspec.serving.target_server import TargetServer, load_encoders

SMOL = "smollm2-135m"
TOKEN = "fuzz-token"
EXAMPLES = int(os.environ.get("MOASPEC_FUZZ_EXAMPLES", "25"))
COUNTS_FILE = os.environ.get("MOASPEC_FUZZ_COUNTS")  # where `make fuzz` collects the counts
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))


def _record(name: str, counts: dict) -> None:
    if COUNTS_FILE:
        path = Path(COUNTS_FILE)
        old = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps({**old, name: counts}, indent=1))


# ------------------------------------------------------------------------------------------ OpenAI API
def test_openai_api_holds_to_its_schema():
    """Every operation of /openapi.json, valid and invalid inputs. `positive_data_acceptance` is left out:
    a schema-valid prompt may still exceed the server's prompt-token bound, which no JSON schema can say
    (the answer is then a documented 400)."""
    import schemathesis
    from schemathesis import GenerationMode
    from schemathesis.checks import positive_data_acceptance

    from moaspec.pipeline import SpecDecoder

    dec = SpecDecoder(SMOL, drafter="suffix", weights="fp16", warmup=False)
    app = create_app(dec, SMOL, limits=ApiLimits(max_tokens=6, max_prompt_tokens=192, max_body_bytes=1 << 16))
    run = Running(app)
    try:
        schema = schemathesis.openapi.from_url(run.url + "/openapi.json")
        counts: dict[str, dict[str, int]] = {}
        operations = [r.ok() for r in schema.get_all_operations()]
        assert {op.label for op in operations} >= {"POST /v1/chat/completions", "POST /v1/completions",
                                                   "GET /v1/models"}
        for op in operations:
            for mode in GenerationMode:
                seen = counts.setdefault(f"{op.label} ({mode.value})", {})
                _fuzz_operation(op, mode, seen, positive_data_acceptance)
        assert sum(n for c in counts.values() for n in c.values()) >= len(counts)
        assert not any(code.startswith("5") for c in counts.values() for code in c)
        _record("openai_api", counts)
        assert app.state.api.gen.admission.holders == 0 and app.state.api.gen.admission.used == 0  # nothing held
    finally:
        run.stop()
        app.state.api.close()


def _fuzz_operation(op, mode, seen: dict[str, int], excluded) -> None:
    from schemathesis.checks import negative_data_rejection

    @given(case=op.as_strategy(generation_mode=mode))
    @FUZZ
    def check(case):
        # an invalid body may also be too large: 413 is a rejection too (schemathesis' own check expects 400s)
        r = case.call_and_validate(excluded_checks=[excluded, negative_data_rejection])
        if mode.value == "negative":
            assert 400 <= r.status_code < 500, f"invalid data accepted: {r.status_code}"
        seen[str(r.status_code)] = seen.get(str(r.status_code), 0) + 1

    try:
        check()
    except Unsatisfiable:  # no invalid input exists (GET /v1/models takes none)
        assert mode.value == "negative" and not seen


# ------------------------------------------------------------------------------------------ target server
@pytest.fixture(scope="module")
def target(smol_folder):
    model = Transformer(smol_folder)
    fp = weights_fingerprint(smol_folder)
    server = TargetServer(model, SMOL, fp, TOKEN, load_encoders(model, SMOL, fp),
                          Limits(max_prompt_tokens=128, max_seq_len=256, max_tree_tokens=16, max_sessions=4,
                                 max_message_bytes=1 << 16), pass_costs={1: 10.0, 2: 10.5})
    run = Running(server.app, scheme="ws", ws_max_size=server.limits.max_message_bytes)
    yield server, run
    run.stop()


def _open(run):
    ws = connect(run.url + ENDPOINT, additional_headers={"Authorization": f"Bearer {TOKEN}"}).__enter__()
    header, _ = unpack(ws.recv(timeout=10))
    assert header["type"] == "ready"
    return ws


def _ask(ws, frame: bytes) -> dict:
    ws.send(frame)
    while True:
        header = unpack(ws.recv(timeout=60))[0]
        if header["type"] != "queued":
            return header


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=6),
    max_leaves=24)
FIELDS = ("prompt", "sampling", "encoder", "wire", "max_new_tokens", "resume", "tokens", "parents", "dists")
headers = st.fixed_dictionaries(
    {"type": st.sampled_from(["start", "verify", "end", "ping", "fly", ""])},
    optional={f: json_values | st.lists(st.integers(-5, 70000), max_size=40) for f in FIELDS})
# near-valid messages, so that the fuzz also reaches prefill, verification and their checks
sampling = st.fixed_dictionaries({}, optional={"temperature": st.floats(-1, 3) | json_values,
                                               "top_p": st.floats(-0.5, 1.5) | json_values,
                                               "top_k": st.integers(-3, 100), "seed": st.integers(-5, 2**65)})
starts = st.fixed_dictionaries(
    {"type": st.just("start"), "prompt": st.lists(st.integers(0, 49151), min_size=1, max_size=48)},
    optional={"sampling": sampling, "max_new_tokens": st.integers(-3, 600) | json_values,
              "resume": st.booleans() | json_values, "wire": st.sampled_from(["fp16", "fp32", "int8", "int4"])})
verifies = st.integers(1, 20).flatmap(lambda n: st.fixed_dictionaries(
    {"type": st.just("verify"), "tokens": st.lists(st.integers(-1, 49152), min_size=n, max_size=n),
     "parents": st.lists(st.integers(-2, n), min_size=n, max_size=n)},
    optional={"dists": st.dictionaries(st.text("0123456789", min_size=1, max_size=2),
                                       st.tuples(st.lists(st.integers(0, 49151), max_size=4),
                                                 st.lists(st.floats(-1, 2), max_size=4)), max_size=3)}))
frames = st.one_of(
    st.binary(max_size=64),
    headers.map(pack),
    starts.map(pack),
    verifies.map(pack),
    verifies.map(pack),
    st.tuples(headers, st.binary(max_size=64)).map(lambda hb: pack(hb[0], hb[1])),
    st.tuples(st.integers(0, 2**32 - 1), st.binary(max_size=32)).map(lambda t: t[0].to_bytes(4, "little") + t[1]),
)


def test_target_server_messages_fuzzed(target, smol_tokenizer, dec_none):
    """Arbitrary frames on one session: each gets an answer that is a step, a pong, nothing (end) or a
    non-fatal error, and the session lives on; afterwards a clean session still decodes greedily."""
    server, run = target
    ws = _open(run)
    seen: dict[str, int] = {}
    errors_before = server.stats.errors

    @given(frame=frames)
    @FUZZ
    def fuzz(frame):
        try:
            kind = unpack(frame)[0].get("type")
        except ProtocolError:  # not a well-formed frame: the server must answer it with a non-fatal error
            kind = None
        ws.send(frame)
        if kind == "end":
            seen["end"] = seen.get("end", 0) + 1
            return
        reply = unpack(ws.recv(timeout=60))[0]
        while reply["type"] == "queued":
            reply = unpack(ws.recv(timeout=60))[0]
        assert reply["type"] in ("step", "pong", "error"), reply
        if reply["type"] == "error":
            assert not reply["fatal"] and "internal" not in reply["message"], reply
        seen[reply["type"]] = seen.get(reply["type"], 0) + 1

    fuzz()
    assert _ask(ws, pack({"type": "ping"}))["type"] == "pong"  # the fuzzed session is still alive
    ws.close()
    assert sum(seen.values()) >= EXAMPLES and server.stats.errors > errors_before
    _record("target_messages", seen)
    _check_greedy(run, smol_tokenizer, dec_none)


def _check_greedy(run, tokenizer, dec_none, n: int = 12) -> None:
    prompt = tokenizer.encode("def add(a, b):")
    want = dec_none.generate(prompt, GenerationConfig(max_new_tokens=n)).token_ids
    ws = _open(run)
    step = _ask(ws, pack({"type": "start", "prompt": prompt}))
    got = [step["bonus"]]
    while len(got) < len(want):
        step = _ask(ws, pack({"type": "verify", "tokens": [got[-1]], "parents": [-1]}))
        got += step["accepted"] + [step["bonus"]]
    ws.close()
    assert got[:len(want)] == want


# ------------------------------------------------------------------------------------------ stateful
class SessionMachine(RuleBasedStateMachine):
    """A device's session under arbitrary orders of start, verify (drafts right, wrong, or half right),
    disconnect and reconnect-with-resume: the tokens committed are always the target's greedy tokens."""

    run = reference = prompt = None  # set by the test

    @initialize()
    def begin(self):
        self.ws = None
        self.committed: list[int] = []  # generated and verified so far (the last one not yet in the cache)
        self.started = False

    @rule()
    def connect(self):
        if self.ws is None:
            self.ws = _open(self.run)
            self.started = False

    @precondition(lambda self: self.ws is not None)
    @rule()
    def start(self):
        """Start, or resume with everything verified so far (the server's cache is rebuilt)."""
        if len(self.committed) >= len(self.reference) - 1:
            return
        resume = bool(self.committed)
        step = _ask(self.ws, pack({"type": "start", "prompt": self.prompt + self.committed, "resume": resume}))
        assert step["type"] == "step", step
        self.committed.append(step["bonus"])
        self.started = True

    @precondition(lambda self: self.ws is not None and self.started)
    @rule(right=st.integers(0, 4), wrong=st.lists(st.integers(0, 49151), max_size=3))
    def verify(self, right, wrong):
        at = len(self.committed)
        if at + right + len(wrong) + 1 >= len(self.reference):
            return
        draft = self.reference[at:at + right] + wrong
        tokens = [self.committed[-1], *draft]
        step = _ask(self.ws, pack({"type": "verify", "tokens": tokens, "parents": list(range(-1, len(draft)))}))
        assert step["type"] == "step", step
        self.committed += step["accepted"] + [step["bonus"]]

    @precondition(lambda self: self.ws is not None)
    @rule()
    def disconnect(self):
        self.ws.close()
        self.ws = None
        self.started = False

    @invariant()
    def committed_is_the_targets_greedy_text(self):
        assert self.committed == self.reference[:len(self.committed)]

    def teardown(self):
        if self.ws is not None:
            self.ws.close()


def test_session_state_machine_commits_only_the_targets_text(target, smol_tokenizer, dec_none):
    server, run = target
    prompt = smol_tokenizer.encode("The three primary colours are")
    SessionMachine.run, SessionMachine.prompt = run, prompt
    SessionMachine.reference = dec_none.generate(prompt, GenerationConfig(max_new_tokens=60)).token_ids
    assert len(SessionMachine.reference) >= 30
    SessionMachine.TestCase.settings = settings(max_examples=max(5, EXAMPLES // 3), stateful_step_count=20,
                                                deadline=None, database=None,
                                                suppress_health_check=list(HealthCheck))
    SessionMachine.TestCase().runTest()
    _record("session_machine", {"runs": max(5, EXAMPLES // 3), "steps_per_run": 20})
