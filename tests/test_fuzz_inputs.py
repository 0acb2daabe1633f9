"""Fuzzing the inputs that are not network messages: the settings every command builds (the CLI's
arguments end in these checked configs), prompts, and the folders a user hands over (drafter
checkpoints, suffix datastores). Each generated input either works or is a UserError with a message:
never another exception, never a hang, and the loaded state of the process is unchanged.

Examples per test: MOASPEC_FUZZ_EXAMPLES (as tests/test_fuzz.py); `make fuzz` runs them long too.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moaspec.cli import _UsageError, build_parser
from moaspec.decoding.engine import GenerationConfig
from moaspec.decoding.sampling import SamplingParams
from moaspec.decoding.tree import TreeConfig
from moaspec.errors import UserError
from moaspec.link.protocol import Limits
from moaspec.serving.openai_api import ApiLimits

SMOL = "smollm2-135m"
EXAMPLES = int(os.environ.get("MOASPEC_FUZZ_EXAMPLES", "25"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
COUNTS_FILE = os.environ.get("MOASPEC_FUZZ_COUNTS")

values = st.one_of(st.none(), st.booleans(), st.integers(-2**65, 2**65), st.floats(allow_nan=True),
                   st.text(max_size=12), st.lists(st.integers(-3, 3), max_size=3))


def _record(name: str, n: int) -> None:
    if COUNTS_FILE:
        path = Path(COUNTS_FILE)
        old = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps({**old, name: {"inputs": n}}, indent=1))


def _works_or_says_why(make) -> bool:
    try:
        make()
        return True
    except UserError as e:
        assert str(e).strip(), "an error without a message"
        return False


def test_settings_take_any_value():
    """Every checked config with arbitrary values: built, or a UserError that says why."""
    seen = [0]

    @given(kind=st.sampled_from(["sampling", "generation", "tree", "tree-text", "api", "target"]),
           a=values, b=values, c=values, d=values)
    @FUZZ
    def fuzz(kind, a, b, c, d):
        seen[0] += 1
        make = {
            "sampling": lambda: SamplingParams(a, b, c, d),
            "generation": lambda: GenerationConfig(max_new_tokens=a, reconnect_timeout_s=b, resync=c),
            "tree": lambda: TreeConfig(a, b, c, min_prob=d),
            "tree-text": lambda: TreeConfig.parse(str(a)),
            "api": lambda: ApiLimits(max_prompt_tokens=a, max_tokens=b, parallel=c, gather_ms=d),
            "target": lambda: Limits(max_prompt_tokens=a, max_seq_len=b, max_tree_tokens=c, gather_ms=d),
        }[kind]
        _works_or_says_why(make)

    fuzz()
    _record("settings", seen[0])


def test_cli_arguments_are_parsed_or_refused(capsys):
    """Arbitrary values for every option of every command: argparse takes them or exits 2 with a usage
    message; it never raises."""
    parser = build_parser()
    commands = {name: sub for action in parser._subparsers._group_actions for name, sub in action.choices.items()}
    seen = [0]

    @given(cmd=st.sampled_from(sorted(commands)), data=st.data())
    @FUZZ
    def fuzz(cmd, data):
        seen[0] += 1
        sub = commands[cmd]
        options = [a for a in sub._actions if a.option_strings and a.dest != "help"]
        picked = data.draw(st.lists(st.sampled_from(options), max_size=4, unique=True)) if options else []
        argv = [cmd]
        for opt in picked:
            argv.append(opt.option_strings[-1])
            if opt.nargs != 0:
                argv.append(data.draw(st.text(max_size=10).filter(lambda s: not s.startswith("-"))))
        try:
            parser.parse_args(argv)
        except _UsageError as e:  # what `moaspec` prints as a usage error, exit status 2
            assert str(e).strip()
        except SystemExit as e:  # --help, --version
            assert e.code in (0, 2)
        capsys.readouterr()

    fuzz()
    _record("cli_arguments", seen[0])


def test_prompts_of_any_text_or_bytes(dec_none):
    """Any text, including lone surrogates and control characters, or bytes that are not UTF-8: one token
    generated, or a UserError; the decoder is unchanged for the next prompt."""
    seen = [0]
    want = dec_none.generate("Hello", GenerationConfig(max_new_tokens=3)).token_ids

    @given(prompt=st.one_of(st.text(max_size=40), st.text(st.characters(codec="utf-16", exclude_categories=()),
                                                          max_size=20), st.binary(max_size=40)))
    @FUZZ
    def fuzz(prompt):
        seen[0] += 1
        _works_or_says_why(lambda: dec_none.generate(prompt, GenerationConfig(max_new_tokens=1)))

    fuzz()
    assert dec_none.generate("Hello", GenerationConfig(max_new_tokens=3)).token_ids == want
    _record("prompts", seen[0])


def test_grammars_of_any_text_or_schema(dec_none):
    """Any JSON schema (nested objects of schema keywords and arbitrary values), regex, GBNF/Lark text or choice
    list: a grammar whose matcher gives a mask with something allowed, or a UserError; never a crash or a hang
    (llguidance's own limits bound a compile)."""
    import time

    from moaspec.decoding.grammar import Grammar, Vocabulary

    cfg = dec_none.target.cfg
    vocab = Vocabulary.of(dec_none.tokenizer, cfg.vocab_size, cfg.eos_token_ids)
    keyword = st.sampled_from(["type", "properties", "items", "required", "enum", "const", "anyOf", "allOf",
                               "oneOf", "pattern", "minLength", "maxLength", "minimum", "maximum", "$ref", "format",
                               "additionalProperties", "minItems", "maxItems", "not", "$defs", "x"])
    kinds = st.sampled_from(["object", "array", "string", "integer", "number", "boolean", "null", "nope"])
    schema = st.recursive(st.one_of(values, kinds),
                          lambda inner: st.one_of(st.dictionaries(keyword, inner, max_size=4),
                                                  st.lists(inner, max_size=3)), max_leaves=12)
    seen, slowest = [0], [0.0]

    @given(kind=st.sampled_from(["schema", "regex", "gbnf", "choice"]), schema=schema,
           text=st.text(max_size=40), options=st.lists(st.text(max_size=8), max_size=4))
    @FUZZ
    def fuzz(kind, schema, text, options):
        seen[0] += 1
        t = time.perf_counter()

        def build():
            g = {"schema": lambda: Grammar.json_schema(vocab, schema if isinstance(schema, dict) else {"x": schema}),
                 "regex": lambda: Grammar.regex(vocab, text), "gbnf": lambda: Grammar.gbnf(vocab, text),
                 "choice": lambda: Grammar.choice(vocab, options)}[kind]()
            assert g.matcher().allowed().any()

        _works_or_says_why(build)
        slowest[0] = max(slowest[0], time.perf_counter() - t)

    fuzz()
    assert slowest[0] < 10, f"a grammar took {slowest[0]:.1f} s"
    _record("grammars", seen[0])


# ------------------------------------------------------------------------------------------ folders
def _mutations():
    """(file, how, where): how a folder's file is damaged."""
    return st.tuples(st.sampled_from(["config.json", "weights"]),
                     st.sampled_from(["truncate", "flip", "empty", "delete", "json-key", "json-value"]),
                     st.floats(0, 1), values, st.sampled_from(["__any__", "kind", "dtype", "format_version",
                                                               "target_fingerprint", "hidden_size", "vocab_ids",
                                                               "tokens", "target", "max_match"]))


def _damage(folder: Path, weights_name: str, mutation) -> None:
    which, how, where, value, key = mutation
    path = folder / ("config.json" if which == "config.json" else weights_name)
    raw = path.read_bytes()
    if how == "truncate":
        path.write_bytes(raw[:int(len(raw) * where)])
    elif how == "flip":
        i = int((len(raw) - 1) * where)
        path.write_bytes(raw[:i] + bytes([raw[i] ^ 0xFF]) + raw[i + 1:])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "delete":
        path.unlink()
    elif which == "config.json":
        cfg = json.loads(raw)
        name = key if key in cfg else sorted(cfg)[int((len(cfg) - 1) * where)]
        if how == "json-key":
            del cfg[name]
        else:
            cfg[name] = value
        path.write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def parts(smol_folder):
    from moaspec.models.parts import PartialTarget

    return PartialTarget(smol_folder)


def _fuzz_folder(source: Path, weights_name: str, load, scratch: Path) -> int:
    """Damage a copy of `source` each example and `load` it: works or a UserError; some are refused."""
    seen, refused = [0], [0]

    @given(mutation=_mutations())
    @FUZZ
    def fuzz(mutation):
        seen[0] += 1
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.copytree(source, scratch)
        _damage(scratch, weights_name, mutation)
        refused[0] += not _works_or_says_why(lambda: load(scratch))

    fuzz()
    assert refused[0] > 0
    return seen[0]


def test_drafter_checkpoints_damaged_any_way(parts, tmp_path):
    """A shipped MoA checkpoint, damaged: loads (a harmless flip in the weights) or a UserError."""
    from moaspec.drafters import build_drafter, shipped_checkpoint
    from moaspec.drafters.trained import WEIGHTS_FILE

    n = _fuzz_folder(shipped_checkpoint("moa", SMOL), WEIGHTS_FILE,
                     lambda folder: build_drafter("moa", SMOL, parts, drafter_path=str(folder)), tmp_path / "ckpt")
    _record("drafter_checkpoints", n)


def test_datastores_damaged_any_way(tmp_path):
    from moaspec.drafters import shipped_checkpoint
    from moaspec.drafters.datastore import STORE_FILE, Datastore

    n = _fuzz_folder(shipped_checkpoint("datastore", SMOL), STORE_FILE, lambda folder: Datastore.load(folder, SMOL),
                     tmp_path / "store")
    _record("datastores", n)
