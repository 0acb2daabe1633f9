"""The llama.cpp peer: finding the programs and reading their output. Stand-in programs print what
llama.cpp's print (the formats of the pinned version); the real programs run in `moaspec bench`."""

from __future__ import annotations

import pytest

from moaspec import llamacpp
from moaspec.bench.suite import BenchConfig, resolve_methods
from moaspec.errors import UserError

PLAIN_ERR = """0.01.577.410 I common_perf_print:    sampling time =       8.01 ms
0.01.577.476 I common_perf_print:    samplers time =       2.65 ms /    50 tokens
0.01.577.495 I common_perf_print:        load time =     128.17 ms
0.01.577.496 I common_perf_print: prompt eval time =     120.50 ms /    30 tokens (    8.52 ms per token)
0.01.577.497 I common_perf_print:        eval time =     530.00 ms /    20 runs   (   23.49 ms per token)
0.01.577.498 I common_perf_print:       total time =     660.50 ms /    50 tokens
"""
SPEC_ERR = """encoded   30 tokens in    0.130 seconds, speed:  230.000 t/s
decoded   24 tokens in    0.900 seconds, speed:   26.667 t/s

n_draft   = 3
n_predict = 24
n_drafted = 27
n_accept  = 15
accept    = 55.556%
"""


def _program(folder, name, stdout, stderr, rc=0):
    (folder / f"{name}.out").write_text(stdout)
    (folder / f"{name}.err").write_text(stderr)
    p = folder / name
    p.write_text(f'#!/bin/sh\necho "$@" > "{folder}/{name}.args"\ncat "{folder}/{name}.out"\n'
                 f'cat "{folder}/{name}.err" >&2\nexit {rc}\n')
    p.chmod(0o755)


@pytest.fixture
def programs(tmp_path, monkeypatch):
    monkeypatch.setenv("MOASPEC_LLAMA_CPP", str(tmp_path))
    return tmp_path


def test_missing_programs_say_how_to_build(programs):
    assert "make llama-cpp" in llamacpp.missing()
    with pytest.raises(UserError, match="make llama-cpp"):
        llamacpp.generate("hi", programs / "m.gguf", 8)
    with pytest.raises(UserError, match="make llama-cpp"):
        resolve_methods(BenchConfig(model="smollm2-135m", methods=("plain", "llama.cpp")))


def test_plain_and_speculative_outputs_are_read(programs):
    _program(programs, llamacpp.PLAIN, " def f(x):\n    return x\n", PLAIN_ERR)
    _program(programs, llamacpp.SPEC, "\n\n<|im_start|>user hi<|im_end|> Hello there\n\n", SPEC_ERR)
    _program(programs, llamacpp.LOOKUP, "\n\n<|im_start|>user hi<|im_end|> Hello again\n\n", SPEC_ERR)
    assert llamacpp.missing() is None
    a = llamacpp.generate("<|im_start|>user hi<|im_end|>", programs / "m.gguf", 20, temperature=1.0, seed=7)
    # the generation time is llama.cpp's eval timer (530 ms), not its total less the prompt (540 ms)
    assert (a.text, a.new_tokens, a.prompt_s, a.decode_s) == ("def f(x):\n    return x", 20, 0.1205, 0.53)
    assert a.prompt_tokens == 30
    args = (programs / f"{llamacpp.PLAIN}.args").read_text().split()
    assert args[args.index("--temp") + 1] == "1" and args[args.index("--top-k") + 1] == "0"
    assert args[args.index("--seed") + 1] == "7" and "-no-cnv" in args
    assert "--no-warmup" not in args  # it warms up, as our decoders do
    with pytest.raises(UserError, match="as 30 tokens where ours has 31"):
        llamacpp.generate("<|im_start|>user hi<|im_end|>", programs / "m.gguf", 20, prompt_tokens=31)

    s = llamacpp.generate("<|im_start|>user hi<|im_end|>", programs / "m.gguf", 24, draft_gguf=programs / "d.gguf")
    assert (s.text, s.new_tokens, s.drafted, s.accepted) == ("Hello there", 24, 27, 15)
    assert (s.prompt_s, s.decode_s) == (0.13, 0.9)
    args = (programs / f"{llamacpp.SPEC}.args").read_text().split()
    assert args[args.index("-md") + 1] == str(programs / "d.gguf") and args[args.index("--temp") + 1] == "0"

    lk = llamacpp.generate("<|im_start|>user hi<|im_end|>", programs / "m.gguf", 24, lookup=True)
    assert (lk.text, lk.new_tokens, lk.drafted, lk.accepted) == ("Hello again", 24, 27, 15)
    assert "-md" not in (programs / f"{llamacpp.LOOKUP}.args").read_text().split()
    raw = llamacpp.generate("def f(x):\n", programs / "m.gguf", 20, raw=True)
    assert raw.text == " def f(x):\n    return x\n"  # a completion keeps its indentation


def test_failures_are_clear(programs):
    _program(programs, llamacpp.PLAIN, "", "error: failed to load model\n", rc=1)
    _program(programs, llamacpp.SPEC, "text", "no timings here\n")
    with pytest.raises(UserError, match="exited with code 1: error: failed to load model"):
        llamacpp.generate("p", programs / "m.gguf", 8)
    with pytest.raises(UserError, match="could not read the prompt time"):
        llamacpp.generate("p", programs / "m.gguf", 8, draft_gguf=programs / "d.gguf")


def test_llama_cpp_needs_a_known_model(programs, tmp_path):
    _program(programs, llamacpp.PLAIN, "", PLAIN_ERR)
    _program(programs, llamacpp.SPEC, "", SPEC_ERR)
    with pytest.raises(UserError, match="shipped GGUF of a known model"):
        resolve_methods(BenchConfig(model=str(tmp_path), methods=("plain", "llama.cpp")))
    with pytest.raises(UserError, match="needs a draft model"):
        resolve_methods(BenchConfig(model="qwen2.5-coder-0.5b", methods=("plain", "llama.cpp-spec")))


def test_llama_cpp_joins_the_default_methods_where_built(programs):
    cfg = BenchConfig(model="smollm2-135m")
    assert "llama.cpp" not in [m.name for m in resolve_methods(cfg)[0]]
    assert any("make llama-cpp" in n for n in resolve_methods(cfg)[1])
    _program(programs, llamacpp.PLAIN, "", PLAIN_ERR)
    _program(programs, llamacpp.SPEC, "", SPEC_ERR)
    _program(programs, llamacpp.LOOKUP, "", SPEC_ERR)
    names = [m.name for m in resolve_methods(cfg)[0]]
    assert names[:3] == ["plain", "hf", "llama.cpp"] and "llama.cpp-spec" not in names  # SmolLM2 has no pair
    assert "llama.cpp-lookup" in names


def test_report_reads_count_only_answers():
    """llama.cpp reports counts, not token ids: tau comes from its target calls, and the T=0 identity
    check leaves it out instead of counting it equal."""
    from moaspec.bench.report import aggregate

    def choice(ids, n, wall, lengths, calls):
        return {"choices": [{"token_ids": [ids], "new_tokens": [n], "wall_time": [wall], "accept_lengths": [lengths],
                             "target_calls": [calls]}], "category": "math"}

    meta = {"methods": ["plain", "lookup", "llama.cpp-spec"], "config": {"temperatures": [0.0]}}
    answers = {(0.0, "plain"): {"q": choice([1, 2, 3, 4], 4, 2.0, [1, 1, 1], 3)},
               (0.0, "lookup"): {"q": choice([1, 2, 3, 4], 4, 1.0, [2, 1], 2)},
               (0.0, "llama.cpp-spec"): {"q": choice(None, 24, 1.0, [], 9)}}
    rows = {r["method"]: r for r in aggregate(meta, answers) if r["task"] == "all"}
    assert rows["lookup"]["mismatched_turns"] == 0 and rows["lookup"]["speedup"] == 2.0
    assert rows["llama.cpp-spec"]["mismatched_turns"] is None
    assert rows["llama.cpp-spec"]["tau"] == round(24 / 9, 3) and rows["llama.cpp-spec"]["tokens_per_s"] == 24.0
