"""Structured outputs and speculation side by side: tokens/s and tau of free text and of answers held to a JSON
schema, with no drafter, the lookup drafter and the suffix drafter, in interleaved rounds (docs/serving.md).

    .venv/bin/python -m experiments.grammar_speed --model qwen2.5-coder-0.5b --weights gguf --rounds 2

Run it on a quiet machine: the rows of one run are comparable, runs of different days are not.
"""

from __future__ import annotations

import argparse

from moaspec.decoding.engine import GenerationConfig
from moaspec.decoding.grammar import Grammar, Vocabulary
from moaspec.decoding.logit_rules import LogitRules
from moaspec.pipeline import SpecDecoder

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "year", "fields", "summary"],
          "properties": {"name": {"type": "string", "maxLength": 40},
                         "year": {"type": "integer", "minimum": 0, "maximum": 3000},
                         "fields": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 4},
                         "summary": {"type": "string", "maxLength": 200}}}
PEOPLE = ("Ada Lovelace", "Alan Turing", "Marie Curie", "Isaac Newton", "Grace Hopper", "Carl Gauss")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--weights", default="gguf")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    dec = SpecDecoder(args.model, weights=args.weights, threads="auto")
    cfg = dec.target.cfg
    grammar = Grammar.json_schema(Vocabulary.of(dec.tokenizer, cfg.vocab_size, cfg.eos_token_ids), SCHEMA)
    asks = [[{"role": "user", "content": f"Describe {p} as JSON with name, year of birth, fields of work and a "
                                         "summary."}] for p in PEOPLE]
    print("round | drafter | output | tokens | tok/s | tau")
    for r in range(args.rounds):
        for drafter in ("none", "lookup", "suffix"):
            dec.set_drafter(drafter)
            for rules in (None, LogitRules(grammar=grammar)):
                tokens, seconds, taus = 0, 0.0, []
                for ask in asks:
                    dec.target.reset()  # cold, as every other row: no prompt prefix kept from the ask before
                    g = dec.generate(ask, GenerationConfig(max_new_tokens=args.max_new_tokens, rules=rules))
                    tokens += len(g.token_ids)
                    seconds += g.metrics.decode_s
                    taus.append(g.metrics.tau)
                print(f"{r} | {drafter} | {'schema' if rules else 'free'} | {tokens} | {tokens / seconds:.1f} | "
                      f"{sum(taus) / len(taus):.2f}", flush=True)


if __name__ == "__main__":
    main()
