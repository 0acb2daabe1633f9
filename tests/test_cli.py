"""The command line: in-process through `main([...])`, and as a real `python -m moaspec` process.

Uses smollm2-135m (described once in the moaspec cache by `make setup`) and few new tokens.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest

from moaspec import cli
from moaspec.cli import options
from moaspec.decoding.tree import TreeConfig
from moaspec.drafters import resolve_auto

MODEL = "smollm2-135m"
JSON_KEYS = {
    "text", "token_ids", "finish_reason", "tau", "tokens_per_s", "target_calls", "new_tokens",
    "prompt_tokens", "draft_s", "verify_s", "prefill_s", "total_s", "model", "drafter",
}
_DECODERS: dict = {}


@pytest.fixture(autouse=True)
def cached_decoders(monkeypatch):
    """Load each (model, drafter, ...) once for the in-process tests: the CLI's flow is unchanged."""
    real = options.load_decoder

    def load(args, tree):
        key = (args.model, args.drafter, args.draft_model, args.weights, tree, args.max_context)
        if key not in _DECODERS:
            _DECODERS[key] = real(args, tree)
        return _DECODERS[key]

    monkeypatch.setattr(options, "load_decoder", load)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def gen_json(capsys, *argv: str) -> dict:
    code, out, err = run(capsys, "generate", "--model", MODEL, *argv, "--json")
    assert code == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 1, out
    return json.loads(lines[0])


def subprocess_env() -> dict:
    return {**os.environ, "PYTHONIOENCODING": "utf-8"}


# ------------------------------------------------------------------------------------------ generate
def test_generate_json(capsys):
    rec = gen_json(capsys, "--prompt", "Name three colours.", "--max-new-tokens", "12")
    assert JSON_KEYS <= rec.keys()
    # the default drafter is `auto`: the shipped MoA drafter where it is marked the default, else suffix
    assert rec["model"] == MODEL and rec["drafter"] == resolve_auto(MODEL)
    assert 1 <= rec["new_tokens"] <= 12 and len(rec["token_ids"]) == rec["new_tokens"]
    assert rec["text"].strip()
    assert rec["finish_reason"] in ("stop", "length")
    assert rec["target_calls"] >= 1 and rec["tau"] >= 1.0
    assert rec["prompt_tokens"] > 0 and rec["total_s"] > 0


def test_generate_text_then_summary_on_stderr(capsys):
    rec = gen_json(capsys, "--prompt", "Say hello.", "--max-new-tokens", "8")
    for mode in ((), ("--stream",)):
        code, out, err = run(capsys, "generate", "--model", MODEL, "--prompt", "Say hello.",
                             "--max-new-tokens", "8", *mode)
        assert code == 0, err
        assert out.rstrip("\n") == rec["text"].rstrip("\n")
        assert "tok/s" in err and "tau" in err and "target calls" in err and "verify" in err


def test_every_drafter_runs(capsys):
    # Losslessness itself (same greedy tokens, near-ties aside) is the engine tests' job.
    prompt = ("--prompt", "def add(a, b):\n    return a + b\n\nRewrite add with type hints.", "--max-new-tokens", "12")
    plain = gen_json(capsys, *prompt, "--drafter", "none")
    lookup = gen_json(capsys, *prompt, "--drafter", "lookup")
    model = gen_json(capsys, *prompt, "--drafter", "model", "--draft-model", MODEL)
    assert plain["tau"] == 1.0 and plain["drafter"] == "none" and plain["target_calls"] >= plain["new_tokens"] - 1
    assert lookup["drafter"] == "lookup" and lookup["new_tokens"] >= 1
    assert model["tau"] > 1.0  # the model drafts for itself: every draft is accepted at T=0
    assert model["drafter"] == "model"


def test_prompt_file_stdin_no_chat_stop(capsys, tmp_path, monkeypatch):
    f = tmp_path / "p.txt"
    f.write_text("The capital of France is", encoding="utf-8")
    from_file = gen_json(capsys, "--prompt-file", str(f), "--no-chat", "--max-new-tokens", "8")
    assert from_file["new_tokens"] >= 1
    monkeypatch.setattr(sys, "stdin", io.StringIO(f.read_text(encoding="utf-8")))
    from_stdin = gen_json(capsys, "--prompt", "-", "--no-chat", "--max-new-tokens", "8")
    assert from_stdin["token_ids"] == from_file["token_ids"]
    chat = gen_json(capsys, "--prompt-file", str(f), "--max-new-tokens", "8")
    assert chat["prompt_tokens"] > from_file["prompt_tokens"]  # the chat template adds tokens
    word = from_file["text"].split()[0]
    stopped = gen_json(capsys, "--prompt-file", str(f), "--no-chat", "--max-new-tokens", "8", "--stop", word)
    assert stopped["finish_reason"] == "stop" and word not in stopped["text"]


def test_sampling_with_seed_is_reproducible(capsys):
    args = ("--prompt", "Tell me a story.", "--max-new-tokens", "8", "--temperature", "0.8", "--top-p", "0.9",
            "--top-k", "40", "--seed", "7")
    assert gen_json(capsys, *args)["token_ids"] == gen_json(capsys, *args)["token_ids"]


# ---------------------------------------------------------------------------------------- bad input
BAD_INPUT = {
    "empty prompt": ["generate", "--prompt", ""],
    "blank prompt": ["generate", "--prompt", "  \n "],
    "zero new tokens": ["generate", "--prompt", "hi", "--max-new-tokens", "0"],
    "negative new tokens": ["generate", "--prompt", "hi", "--max-new-tokens", "-3"],
    "new tokens past context": ["generate", "--prompt", "hi", "--max-new-tokens", "5000"],
    "new tokens past small context": ["generate", "--prompt", "hi", "--max-context", "16", "--max-new-tokens", "16"],
    "negative temperature": ["generate", "--prompt", "hi", "--temperature", "-0.5"],
    "nan temperature": ["generate", "--prompt", "hi", "--temperature", "nan"],
    "top-p zero": ["generate", "--prompt", "hi", "--top-p", "0"],
    "top-p above one": ["generate", "--prompt", "hi", "--top-p", "1.5"],
    "negative top-k": ["generate", "--prompt", "hi", "--top-k", "-1"],
    "unknown model": ["generate", "--prompt", "hi", "--model", "no-such-model"],
    "unknown drafter": ["generate", "--prompt", "hi", "--drafter", "medusa"],
    "unknown draft model": ["generate", "--prompt", "hi", "--drafter", "model", "--draft-model", "nope"],
    "draft model without model drafter": ["generate", "--prompt", "hi", "--draft-model", MODEL],
    "missing prompt file": ["generate", "--prompt-file", "/no/such/prompt.txt"],
    "no prompt": ["generate"],
    "not a number": ["generate", "--prompt", "hi", "--max-new-tokens", "many"],
    "bad weights": ["generate", "--prompt", "hi", "--weights", "int3"],
    "bad tree": ["generate", "--prompt", "hi", "--topk", "0"],
    "tree depth 0": ["generate", "--prompt", "hi", "--depth", "0"],
    "huge tree": ["generate", "--prompt", "hi", "--depth", "50", "--topk", "1000", "--total-tokens", "100000"],
    "tree deeper than its tokens": ["generate", "--prompt", "hi", "--depth", "8", "--total-tokens", "4"],
    "adaptive depth 0": ["generate", "--prompt", "hi", "--adaptive", "--depth", "0"],
    "chat huge tree": ["chat", "--total-tokens", "100000"],
    "adaptive tree with total tokens": ["generate", "--prompt", "hi", "--adaptive", "--total-tokens", "4"],
    "adaptive tree of width 0": ["generate", "--prompt", "hi", "--adaptive", "--topk", "0"],
    "chat bad sampling": ["chat", "--top-p", "2"],
    "min prob 1": ["generate", "--prompt", "hi", "--min-prob", "1"],
    "min prob nan": ["chat", "--min-prob", "nan"],
    # bytes that are not UTF-8 reach argv as surrogate escapes (b"\xff" -> "\udcff")
    "prompt not UTF-8": ["generate", "--prompt", "\udcff\udcfe"],
    "system not UTF-8": ["generate", "--prompt", "hi", "--system", "caf\udce9"],
    "stop not UTF-8": ["generate", "--prompt", "hi", "--stop", "\udcc3("],
    "chat system not UTF-8": ["chat", "--system", "\udcff"],
    "no command": [],
    "unknown command": ["train"],
    "train spacing backwards": ["train", "--data", "nowhere", "--out", "nowhere", "--every", "4-1"],
    "train spacing not numbers": ["train", "--data", "nowhere", "--out", "nowhere", "--every", "1-x"],
    "install unknown model": ["models", "install", "gpt-5"],
}


@pytest.mark.parametrize("argv", BAD_INPUT.values(), ids=BAD_INPUT.keys())
def test_bad_input_exits_2_with_a_message(capsys, monkeypatch, argv):
    def no_load(*a, **k):
        raise AssertionError("bad input must be caught before loading a model")

    monkeypatch.setattr(options, "load_decoder", no_load)
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert err.startswith("error: ") and len(err.strip()) > len("error: ")
    assert "Traceback" not in err and out == ""


def test_prompt_not_utf8_names_the_byte(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(options, "load_decoder", lambda *a: pytest.fail("bad input must fail before loading"))
    code, out, err = run(capsys, "generate", "--prompt", "ab\udcff\udcfe")
    assert (code, out) == (2, "")
    assert err == "error: --prompt is not valid UTF-8 (byte 0xff at byte offset 2); give it as UTF-8 text\n"
    bad = tmp_path / "bad.txt"
    bad.write_bytes("é ".encode() + b"\xc3(")
    code, out, err = run(capsys, "generate", "--prompt-file", str(bad))
    assert code == 2 and err.startswith(f"error: prompt file {bad} is not valid UTF-8 (byte 0xc3 at byte offset 3)")


def test_adaptive_tree_flag():
    args = cli.build_parser().parse_args(["generate", "--prompt", "hi", "--adaptive", "--depth", "5"])
    assert cli.tree_config(args) == TreeConfig(5, 1, 5, adaptive=True)
    args = cli.build_parser().parse_args(["generate", "--prompt", "hi", "--adaptive", "--depth", "4", "--topk", "2"])
    assert cli.tree_config(args) == TreeConfig(4, 2, 8, adaptive=True)
    args = cli.build_parser().parse_args(["generate", "--prompt", "hi"])
    assert cli.tree_config(args) == "auto"
    args = cli.build_parser().parse_args(["generate", "--prompt", "hi", "--min-prob", "0.2"])
    assert cli.tree_config(args) == "auto@0.2"
    args = cli.build_parser().parse_args(["generate", "--prompt", "hi", "--adaptive", "--min-prob", "0.2"])
    assert cli.tree_config(args) == TreeConfig(8, 1, 8, adaptive=True, min_prob=0.2)
    args = cli.build_parser().parse_args(["generate", "--prompt", "hi", "--depth", "3", "--topk", "1",
                                          "--min-prob", "0.1"])
    assert cli.tree_config(args) == TreeConfig(3, 1, 6, min_prob=0.1)


def test_prompt_longer_than_context(capsys):
    code, out, err = run(capsys, "generate", "--model", MODEL, "--prompt", "word " * 200, "--max-context", "64",
                         "--max-new-tokens", "8")
    assert code == 2 and err.startswith("error: ") and "context" in err and "Traceback" not in err


def test_keyboard_interrupt_exits_130_quietly(capsys, monkeypatch):
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(options, "load_decoder", interrupted)
    code, out, err = run(capsys, "generate", "--prompt", "hi")
    assert code == 130 and err == ""


def test_help_exits_0(capsys):
    code, out, err = run(capsys, "generate", "--help")
    assert code == 0 and "--max-new-tokens" in out and "--drafter" in out


# -------------------------------------------------------------------------------------------- models
def test_models_list(capsys):
    code, out, err = run(capsys, "models", "list", "--json")
    assert code == 0, err
    rows = {r["name"]: r for r in json.loads(out)}
    assert rows[MODEL]["packages_installed"] and rows[MODEL]["ready"] and rows[MODEL]["default"]
    code, out, err = run(capsys, "models", "list")
    assert code == 0 and MODEL in out and "READY" in out


def test_models_install_is_a_no_op_when_ready(capsys, monkeypatch):
    from moaspec.models import store

    monkeypatch.setattr(store, "install_packages", lambda name: pytest.fail("nothing to install"))
    code, out, err = run(capsys, "models", "install", MODEL)
    assert code == 0, err
    assert f"{MODEL}: ready at" in out


# ---------------------------------------------------------------------------------------- subprocess
def test_subprocess_generate_json():
    proc = subprocess.run(
        [sys.executable, "-m", "moaspec", "generate", "--model", MODEL, "--prompt", "Write a haiku about CPUs.",
         "--max-new-tokens", "12", "--json"],
        capture_output=True, text=True, timeout=300, env=subprocess_env(),
    )
    assert proc.returncode == 0, proc.stderr
    rec = json.loads(proc.stdout)
    assert JSON_KEYS <= rec.keys() and rec["text"].strip() and rec["new_tokens"] <= 12
    assert "Traceback" not in proc.stderr


def test_subprocess_chat_two_turns_then_eof():
    proc = subprocess.run(
        [sys.executable, "-m", "moaspec", "chat", "--model", MODEL, "--max-new-tokens", "10"],
        input="What is the capital of France?\nAnd of Italy?\n",
        capture_output=True, text=True, timeout=300, env=subprocess_env(),
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    summaries = [line for line in proc.stderr.splitlines() if "tok/s" in line]
    assert len(summaries) == 2, proc.stderr
    assert "Traceback" not in proc.stderr


def test_subprocess_prompt_not_utf8():
    """Invalid UTF-8 in argv, on stdin (read strictly, as in a UTF-8 locale) and in chat lines."""
    env = {**os.environ, "PYTHONIOENCODING": "utf-8:strict"}
    for argv, stdin in (([b"--prompt", b"\xff\xfe"], b""), ([b"--prompt", b"-"], b"hi \xff\n"),
                        ([b"--prompt-file", b"-"], b"\xfe")):
        proc = subprocess.run([sys.executable, "-m", "moaspec", "generate", *argv], input=stdin,
                              capture_output=True, timeout=120, env=env)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith(b"error: ") and b"not valid UTF-8" in proc.stderr
        assert b"Traceback" not in proc.stderr and proc.stdout == b""
    proc = subprocess.run([sys.executable, "-m", "moaspec", "chat", "--model", MODEL, "--max-new-tokens", "4"],
                          input=b"\xff\xfe\nSay hi.\n", capture_output=True, timeout=300, env=env)
    err = proc.stderr.decode()
    assert proc.returncode == 2 and "Traceback" not in err  # exit 2: a turn failed; the chat went on
    assert "error: that line is not valid UTF-8 (byte 0xff at byte offset 0)" in err
    assert len([line for line in err.splitlines() if "tok/s" in line]) == 1, err


def test_subprocess_bad_input():
    proc = subprocess.run(
        [sys.executable, "-m", "moaspec", "generate", "--prompt", "hi", "--temperature", "-1"],
        capture_output=True, text=True, timeout=120, env=subprocess_env(),
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and "temperature" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_generate_into_a_closed_pipe_ends_quietly():
    """`moaspec generate ... | head -c 1`: the reader goes away; no traceback (BrokenPipeError is an OSError and
    was caught as one, re-raised)."""
    import subprocess
    import sys

    cmd = f"{sys.executable} -m moaspec generate --prompt 'Count to fifty.' --max-new-tokens 64 --stream | head -c 1"
    out = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=300)
    assert "Traceback" not in out.stderr and "BrokenPipe" not in out.stderr, out.stderr[-1500:]
