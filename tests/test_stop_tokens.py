"""Stop strings cut the token ids as well as the text: `token_ids` (yielded and in `Generation`) hold the
tokens up to and including the one whose decoded text reaches the cut, and `metrics.new_tokens` counts
exactly those. A stop string that starts inside a token keeps that token.
"""

from __future__ import annotations

import pytest
from prompts import PROMPTS

from moaspec.decoding.engine import GenerationConfig

MAX_NEW = 64


def _decode(dec, ids: list[int]) -> str:
    return dec.tokenizer.decode(ids, skip_special_tokens=True)


def _stop_at(dec, ids: list[int], k: int, offset: int, length: int | None = None) -> tuple[str, int, str]:
    """A stop string of `length` characters (default: the text of three tokens) that starts `offset`
    characters into token `start` >= k of a greedy output and occurs nowhere earlier: (stop string,
    start, the text before it)."""
    text = _decode(dec, ids)
    for start in range(k, len(ids) - 4):
        at = len(_decode(dec, ids[:start]))
        token_text = _decode(dec, ids[: start + 1])[at:]
        if len(token_text) <= offset or not token_text[offset:].strip():
            continue
        n = length if length is not None else len(_decode(dec, ids[: start + 3])) - at
        stop = text[at + offset: at + offset + n]
        if len(stop) == n and len(stop.strip()) >= 3 and stop.strip() and text.find(stop) == at + offset:
            return stop, start, text[: at + offset]
    raise AssertionError("no usable stop string in the output")


def _check(dec, g, expected_text: str, expected_ids: list[int]) -> None:
    assert g.finish_reason == "stop"
    assert g.text == expected_text
    assert g.token_ids == expected_ids
    assert g.metrics.new_tokens == len(g.token_ids)
    assert _decode(dec, g.token_ids).startswith(g.text)


@pytest.mark.parametrize("drafter", ["none", "lookup"])
def test_stop_on_token_boundary_drops_the_tokens_after_it(decoders, plain_greedy, drafter):
    """A stop string spanning three whole tokens: with plain decoding (one token a round) its first
    tokens are held back a round or two before the match, and must not have been yielded."""
    prompt_ids, plain = plain_greedy(PROMPTS[0], MAX_NEW)
    dec = decoders[drafter]
    stop, start, before = _stop_at(dec, plain, 20, 0)
    cfg = GenerationConfig(max_new_tokens=MAX_NEW, stop=(stop,))
    g = dec.generate(prompt_ids, cfg)
    kept = plain[:start]
    _check(dec, g, before, kept)
    assert _decode(dec, g.token_ids) == g.text
    parts = list(dec.stream(prompt_ids, cfg))
    assert [t for p in parts for t in p.tokens] == kept
    assert "".join(p.text for p in parts) == before
    assert dec.engine.metrics.new_tokens == len(kept)


@pytest.mark.parametrize("drafter", ["none", "lookup"])
def test_stop_inside_a_token_keeps_that_token(decoders, plain_greedy, drafter):
    """A stop string starting one character into a token: the text ends before the stop string, and
    that token (whose text reaches the cut) is the last one kept."""
    prompt_ids, plain = plain_greedy(PROMPTS[0], MAX_NEW)
    dec = decoders[drafter]
    stop, start, before = _stop_at(dec, plain, 3, 1, 6)
    cfg = GenerationConfig(max_new_tokens=MAX_NEW, stop=("<never>", stop))
    g = dec.generate(prompt_ids, cfg)
    _check(dec, g, before, plain[: start + 1])
    assert _decode(dec, g.token_ids) != g.text  # the kept token runs past the cut
    parts = list(dec.stream(prompt_ids, cfg))
    assert [t for p in parts for t in p.tokens] == g.token_ids
    assert [p.finish for p in parts][-1] == "stop"


def test_stop_at_the_very_start_keeps_no_tokens(dec_none, plain_greedy):
    prompt_ids, plain = plain_greedy(PROMPTS[0], MAX_NEW)
    stop = _decode(dec_none, plain)[:4]
    g = dec_none.generate(prompt_ids, GenerationConfig(max_new_tokens=MAX_NEW, stop=(stop,)))
    _check(dec_none, g, "", [])


def test_no_stop_hit_keeps_every_token(dec_lookup, plain_greedy):
    prompt_ids, plain = plain_greedy(PROMPTS[0], 24)
    # a stop string whose prefixes keep appearing (held back, then released)
    g = dec_lookup.generate(prompt_ids, GenerationConfig(max_new_tokens=24, stop=("\n@@", " n +9")))
    assert g.finish_reason == "length"
    assert g.token_ids == plain and g.metrics.new_tokens == 24
    assert g.text == _decode(dec_lookup, plain)
