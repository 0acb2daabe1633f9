"""Logit rules under speculation (`decoding.logit_rules`): logit bias, presence / frequency / repetition penalties
and grammars (llguidance) leave speculative decoding lossless.

- In law: with sampled draft trees (recursive rejection sampling over siblings), a path-dependent rule (a grammar
  that forbids repeating the last token, a frequency penalty, a bias) gives the first three tokens exactly the law
  of plain sampling under the same rule; the chi-square test has power against a verifier that ignores the rule.
- On SmolLM2: greedy and seeded generations under a JSON schema (plus penalties and a bias) are the same tokens
  with and without drafts, and every answer parses and validates; drafts the grammar refuses are never scored.
"""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest
import torch
from test_sampling import SD_PARAMS, V_SD, chi2_critical, chi_square, sampled_tree, sd_target

from moaspec.decoding.engine import GenerationConfig
from moaspec.decoding.grammar import Grammar, Vocabulary
from moaspec.decoding.logit_rules import LogitRules
from moaspec.decoding.sampling import SamplingParams, target_probs
from moaspec.decoding.target import LocalTarget
from moaspec.decoding.tree import Tree
from moaspec.decoding.verify import verify
from moaspec.errors import UserError


class NoRepeat:
    """A toy grammar over the toy vocabulary: never the token just taken (path-dependent, like a real one)."""

    vocab = type("V", (), {"size": V_SD})()

    def matcher(self):
        return NoRepeatMatcher()


class NoRepeatMatcher:
    def __init__(self):
        self.taken: list[int] = []

    def allowed(self) -> torch.Tensor:
        ok = torch.ones(V_SD, dtype=torch.bool)
        if self.taken:
            ok[self.taken[-1]] = False
        return ok

    def take(self, token: int) -> None:
        assert not self.taken or token != self.taken[-1]
        self.taken.append(token)

    def tries(self, token: int) -> bool:
        if self.taken and token == self.taken[-1]:
            return False
        self.taken.append(token)
        return True

    def back(self, n: int = 1) -> None:
        del self.taken[-n:]


TOY_RULES = LogitRules(logit_bias=((0, 0.8),), frequency_penalty=0.7, presence_penalty=0.2, grammar=NoRepeat())


def _toy_law(rules: LogitRules) -> dict[tuple[int, ...], float]:
    law = {}
    for seq in ((a, b, c) for a in range(V_SD) for b in range(V_SD) for c in range(V_SD)):
        p, state = 1.0, rules.follow([])
        for i in range(3):
            p *= float(target_probs(state.apply(sd_target(seq[:i])), SD_PARAMS)[seq[i]])
            if p == 0:
                break
            state.take(seq[i])
        law[seq] = p
    return law


def _toy_counts(rules: LogitRules, n: int, apply: bool = True) -> Counter:
    """The first three tokens of n toy generations: sampled sibling trees, each round verified under the rule
    (its pruning too) as LocalTarget does it."""
    g_draft, g_target = torch.Generator().manual_seed(11), torch.Generator().manual_seed(12)
    counts: Counter = Counter()
    for _ in range(n):
        state, out = rules.follow([]), ()
        while len(out) < 3:
            tree = sampled_tree(out, g_draft, shape=(3, 2))
            keep = state.keep(tree)
            kept = set(range(len(tree)) if keep is None else keep)
            paths = [(*out, *(tree.tokens[i] for i in tree.path_to(node)[1:])) for node in range(len(tree))]
            logits = {i: sd_target(paths[i]) for i in kept}  # refused drafts get no row
            v = verify(tree, logits, SD_PARAMS, g_target, rule=state.walk(tree) if apply else None)
            state.take(v.bonus)
            out = (*out, *v.new_tokens)
        counts[out[:3]] += 1
    return counts


def test_a_path_dependent_rule_keeps_sampled_speculation_exact_in_law():
    law = _toy_law(TOY_RULES)
    assert sum(law.values()) == pytest.approx(1.0, abs=1e-6)
    assert sum(p == 0 for p in law.values()) >= 40  # the grammar forbids every immediate repeat
    n = 8000
    counts = _toy_counts(TOY_RULES, n)
    stat, dof = chi_square(counts, law, n)
    assert dof >= 30
    assert stat < chi2_critical(dof), f"chi-square {stat:.1f} on {dof} dof (critical {chi2_critical(dof):.1f})"


def test_the_law_test_has_power_against_a_verifier_that_ignores_the_rule():
    n = 4000
    stat, dof = chi_square(_toy_counts(LogitRules(frequency_penalty=0.7, logit_bias=((0, 0.8),)), n, apply=False),
                           _toy_law(LogitRules(frequency_penalty=0.7, logit_bias=((0, 0.8),))), n)
    assert stat > chi2_critical(dof)


def test_rules_are_checked():
    for kw in ({"logit_bias": ((1, 101.0),)}, {"logit_bias": ((-1, 1.0),)}, {"presence_penalty": 2.5},
               {"frequency_penalty": float("nan")}, {"repetition_penalty": 0.0}, {"repetition_penalty": 5e-324}):
        with pytest.raises(UserError):
            LogitRules(**kw)
    with pytest.raises(UserError, match="past this model's vocabulary"):
        LogitRules(logit_bias=((10**6, 1.0),)).check_vocab(49152)
    assert not LogitRules().active and LogitRules(repetition_penalty=1.1).active


def test_penalties_follow_the_generated_tokens():
    logits = torch.tensor([2.0, 1.0, -1.0, 0.5])
    state = LogitRules(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0).follow([3])
    state.take(0)
    state.take(0)
    state.take(2)
    out = state.apply(logits)
    # token 0: twice generated -> 2 - 0.5 - 0.5 = 1.0, then positive / 2; token 2: -1 - 0.75 = -1.75, then * 2;
    # token 3 (prompt only): no presence/frequency penalty, 0.5 / 2; token 1: untouched
    assert out.tolist() == pytest.approx([0.5, 1.0, -3.5, 0.25])


# ------------------------------------------------------------------------------------ on SmolLM2
SCHEMA = {"type": "object", "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]},
                                           "count": {"type": "integer"}, "why": {"type": "string"}},
          "required": ["color", "count", "why"], "additionalProperties": False}
QUESTION = [{"role": "user", "content": "Pick a primary color, how many apples you have, and why. Answer in JSON."}]


@pytest.fixture(scope="module")
def vocab(dec_none):
    cfg = dec_none.target.cfg
    return Vocabulary.of(dec_none.tokenizer, cfg.vocab_size, cfg.eos_token_ids)


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.9, seed=5)],
                         ids=["greedy", "seeded"])
def test_a_schema_answer_is_the_same_tokens_with_and_without_drafts(dec_none, dec_lookup, vocab, sampling):
    grammar = Grammar.json_schema(vocab, SCHEMA)
    for rules in (LogitRules(grammar=grammar),
                  LogitRules(grammar=grammar, frequency_penalty=0.3, repetition_penalty=1.1, logit_bias=((28, 2.0),))):
        cfg = GenerationConfig(max_new_tokens=60, sampling=sampling, rules=rules)
        plain = dec_none.generate(QUESTION, cfg)
        spec = dec_lookup.generate(QUESTION, cfg)
        assert spec.token_ids == plain.token_ids
        if plain.finish_reason == "stop":
            answer = json.loads(plain.text)
            assert set(answer) == {"color", "count", "why"} and answer["color"] in ("red", "green", "blue")
    unconstrained = dec_none.generate(QUESTION, GenerationConfig(max_new_tokens=60, sampling=sampling))
    assert unconstrained.token_ids != plain.token_ids  # the rules did change the answer


def test_drafts_the_grammar_refuses_get_no_row(smol_model, smol_tokenizer, vocab):
    target = LocalTarget(smol_model)
    rows: list[int] = []
    real = target._pass
    target._pass = lambda r: rows.append(len(r.tokens)) or real(r)
    grammar = Grammar.regex(vocab, "(ab|ac)+")
    a, b, x = (smol_tokenizer.encode(t, add_special_tokens=False)[0] for t in ("a", "b", "x"))
    prompt = smol_tokenizer.encode("letters: ", add_special_tokens=False)
    step = target.start(prompt, SamplingParams(), rules=LogitRules(grammar=grammar))
    assert step.verdict.bonus == a
    # root a -> b (allowed) -> a (allowed), x (refused); root a -> x (refused) -> a
    tree = Tree([a, b, a, x, x, a], [-1, 0, 1, 1, 0, 4])
    v = target.verify(tree).verdict
    assert rows[-1] == 3  # a, b, a: the refused x's and what hangs below them were never scored
    text = smol_tokenizer.decode([tree.tokens[i] for i in v.path] + [v.bonus])
    assert re.fullmatch("(ab|ac)*a?", text), text  # a prefix of the grammar's language
    assert target.length == len(prompt) + len(v.path)
    smol_model.reset()


def test_the_end_of_sequence_is_allowed_once_the_grammar_accepts_and_then_only_it(smol_tokenizer, vocab):
    m = Grammar.regex(vocab, "ab?").matcher()
    a, b = (smol_tokenizer.encode(t, add_special_tokens=False)[0] for t in ("a", "b"))
    eos = vocab.eos_token_ids[0]
    assert not m.allowed()[eos] and not m.tries(eos)
    m.take(a)
    assert m.allowed()[eos] and m.allowed()[b]
    assert m.tries(eos) and m.allowed().sum() == len(set(vocab.eos_token_ids)) and not m.tries(b)
    m.back()
    assert m.tries(b) and m.tries(eos)  # "ab", then the end
    m.back(2)
    assert m.allowed()[b]


# ------------------------------------------------------------------------------------ 100 schema x prompt pairs
def _schemas() -> list[dict]:
    """Ten schemas of the kinds clients send (enums, bounded strings and arrays, nesting, numbers, optional
    fields, anyOf), each bounded so that an answer ends within the token budget."""
    s = lambda n: {"type": "string", "maxLength": n}  # noqa: E731
    obj = lambda props, req=None: {"type": "object", "properties": props,  # noqa: E731
                                   "required": list(props) if req is None else req, "additionalProperties": False}
    return [
        obj({"answer": {"type": "string", "enum": ["yes", "no", "maybe"]}}),
        obj({"name": s(24), "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
        obj({"tags": {"type": "array", "items": s(12), "minItems": 1, "maxItems": 3}}),
        obj({"city": s(20), "country": s(20), "population": {"type": "integer", "minimum": 0, "maximum": 10**10}}),
        obj({"ok": {"type": "boolean"}, "score": {"type": "integer", "minimum": 0, "maximum": 10}}),
        obj({"title": s(30), "author": obj({"first": s(12), "last": s(12)})}),
        obj({"color": {"type": "string", "enum": ["red", "green", "blue"]}, "hex": {"type": "string",
                                                                                 "pattern": "^#[0-9a-f]{6}$"}}),
        obj({"items": {"type": "array", "items": obj({"n": {"type": "integer", "maximum": 999}, "w": s(8)}),
                       "maxItems": 2}}),
        obj({"kind": {"type": "string", "enum": ["cat", "dog"]}, "note": s(16)}, req=["kind"]),
        {"anyOf": [obj({"error": s(20)}), obj({"value": {"type": "integer", "minimum": -999, "maximum": 999}})]},
    ]


PROMPTS = ["Describe a famous scientist.", "What is the capital of France?", "Summarise a book you like.",
           "Give me a color.", "Is the sky blue?", "List some fruits.", "Tell me about a city.",
           "Rate this answer from 0 to 10.", "Pick a pet.", "What is 2 + 2?"]


@pytest.mark.slow  # 100 pairs, each with and without drafts: ~1 minute
def test_100_schema_prompt_pairs_parse_and_are_the_same_tokens_with_drafts():
    import jsonschema

    from moaspec.pipeline import SpecDecoder

    plain = SpecDecoder("qwen2.5-coder-0.5b", weights="gguf", warmup=False)
    cfg0 = plain.target.cfg
    vocab = Vocabulary.of(plain.tokenizer, cfg0.vocab_size, cfg0.eos_token_ids)
    drafted = {d: plain.fork() for d in ("lookup", "suffix")}
    for name, fork in drafted.items():
        fork.set_drafter(name)
    same = parsed = 0
    for i, schema in enumerate(_schemas()):
        grammar = Grammar.json_schema(vocab, schema)
        for j, prompt in enumerate(PROMPTS):
            ask = [{"role": "user", "content": f"{prompt} Answer in JSON."}]
            cfg = GenerationConfig(max_new_tokens=96, rules=LogitRules(grammar=grammar))
            want = plain.generate(ask, cfg)
            got = drafted[("lookup", "suffix")[(i + j) % 2]].generate(ask, cfg)
            same += got.token_ids == want.token_ids
            assert want.finish_reason == "stop", (schema, prompt, want.text)
            jsonschema.validate(json.loads(want.text), schema)
            parsed += 1
    assert same == parsed == 100


def test_tokens_the_grammar_forces_are_drafted_by_the_engine(dec_none, vocab):
    """With no drafter, the tokens a grammar forces (a JSON key after its object's last field...) are drafted for
    the target to verify: more than one token per target call, each such token marked 'grammar'."""
    from moaspec.decoding.engine import GRAMMAR

    cfg = GenerationConfig(max_new_tokens=60, rules=LogitRules(grammar=Grammar.json_schema(vocab, SCHEMA)))
    chunks = list(dec_none.engine.stream(dec_none.encode(QUESTION), cfg))
    origins = [o for c in chunks for o in c.origins]
    assert GRAMMAR in origins and dec_none.engine.metrics.tau > 1.0
    assert dec_none.engine.metrics.drafted_tokens >= origins.count(GRAMMAR)
