"""Grammar engines on one vocabulary: the time to build each engine's vocabulary, to compile a JSON schema and to
compute a token mask, and their dependencies (docs/serving.md: why llguidance).

xgrammar and outlines-core are not dependencies of moaspec; install them beside it, without their dependencies:

    .venv/bin/pip install --target /tmp/gx --no-deps xgrammar==0.2.9 outlines-core==0.2.14 apache-tvm-ffi
    PYTHONPATH=/tmp/gx .venv/bin/python -m experiments.grammar_engines --model qwen2.5-coder-0.5b

outlines-core's vocabulary is built from the raw token strings here (a byte-level approximation): its compile
time is what is measured, not its masks. Every engine is timed alike: its vocabulary build (once per tokenizer),
its compile of the schema (its index over the vocabulary, per schema), and the two together.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "address"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}},
                         "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                                     "properties": {"city": {"type": "string"},
                                                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}
ANSWER = {"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "engines"],
          "address": {"city": "London", "zip": "12345"}}


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    args = ap.parse_args()
    from moaspec.models.store import load_tokenizer, resolve

    folder = resolve(args.model)
    tok = load_tokenizer(folder)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    eos = tok.eos_token_id
    ids = tok.encode(json.dumps(ANSWER, separators=(",", ":")), add_special_tokens=False)
    print(f"{args.model}: {vocab} tokens; the answer is {len(ids)} tokens")

    import llguidance
    import torch

    t0 = time.perf_counter()
    lt = llguidance.LLTokenizer(tok.backend_json(), n_vocab=vocab, eos_token=eos)
    build = _ms(t0)
    t0 = time.perf_counter()
    m = llguidance.LLMatcher(lt, llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA), defaults={"whitespace_flexible": False}))
    compile_ms = _ms(t0)
    bits = torch.zeros((vocab + 31) // 32, dtype=torch.int32)
    masks = []
    for i in ids:
        t0 = time.perf_counter()
        m.unsafe_compute_mask_ptr(bits.data_ptr(), bits.numel() * 4)
        masks.append(_ms(t0))
        m.consume_token(i)
    print(f"llguidance {llguidance.__version__ if hasattr(llguidance, '__version__') else ''}: vocabulary + schema "
          f"{build + compile_ms:.0f} ms (vocabulary {build:.0f} ms, schema {compile_ms:.1f} ms), mask median "
          f"{statistics.median(masks) * 1e3:.0f} us, max {max(masks):.1f} ms; dependencies: none")
    try:
        import xgrammar as xgr
    except ImportError:
        print("xgrammar: not installed (see the docstring)")
    else:
        enc = [""] * vocab
        for s, i in tok.get_vocab().items():
            enc[i] = s
        t0 = time.perf_counter()
        info = xgr.TokenizerInfo(enc, vocab_type=xgr.VocabType.BYTE_LEVEL, vocab_size=vocab, stop_token_ids=[eos])
        compiler = xgr.GrammarCompiler(info, max_threads=2)
        build = _ms(t0)
        t0 = time.perf_counter()
        grammar = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
        compile_ms = _ms(t0)
        matcher, mask, masks = xgr.GrammarMatcher(grammar), xgr.allocate_token_bitmask(1, vocab), []
        for i in ids:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(mask)
            masks.append(_ms(t0))
            matcher.accept_token(i)
        print(f"xgrammar: vocabulary + schema {build + compile_ms:.0f} ms (vocabulary {build:.0f} ms, schema "
              f"{compile_ms:.1f} ms), mask median "
              f"{statistics.median(masks) * 1e3:.0f} us, max {max(masks):.1f} ms; dependencies: torch, transformers, "
              "triton, apache-tvm-ffi")
    try:
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema
    except ImportError:
        print("outlines-core: not installed (see the docstring)")
    else:
        words: dict[str, list[int]] = {}
        for s, i in tok.get_vocab().items():
            if i != eos:
                words.setdefault(s, []).append(i)
        t0 = time.perf_counter()
        vocabulary = outlines_core.Vocabulary(eos, words)
        build = _ms(t0)
        t0 = time.perf_counter()
        outlines_core.Index(build_regex_from_schema(json.dumps(SCHEMA)), vocabulary)
        compile_ms = _ms(t0)
        print(f"outlines-core: vocabulary + schema {build + compile_ms:.0f} ms (vocabulary {build:.0f} ms, schema "
              f"{compile_ms:.1f} ms); dependencies: none")


if __name__ == "__main__":
    main()
