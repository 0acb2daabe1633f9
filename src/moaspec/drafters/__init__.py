"""Drafters, one file each, all against `drafters.base.Drafter`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from moaspec.errors import UserError

if TYPE_CHECKING:
    from moaspec.drafters.base import Drafter
    from moaspec.pipeline import SpecDecoder

DRAFTERS = ("none", "lookup", "model")

# The same-tokenizer draft model a target gets when `--draft-model` is not given. SmolLM2 drafts
# for itself: useless for speed, but every draft is then accepted at T=0, a sharp engine test.
DEFAULT_DRAFT_MODEL = {
    "smollm2-135m": "smollm2-135m",
    "qwen2.5-coder-1.5b": "qwen2.5-coder-0.5b",
}


def build_drafter(name: str, dec: SpecDecoder, draft_model: str | None = None) -> Drafter | None:
    if name == "none":
        return None
    if name == "lookup":
        from moaspec.drafters.lookup import LookupDrafter

        return LookupDrafter()
    if name == "model":
        from moaspec.drafters.draft_model import DraftModelDrafter
        from moaspec.models.runtime import Transformer
        from moaspec.models.store import resolve

        draft_model = draft_model or DEFAULT_DRAFT_MODEL.get(dec.model_name)
        if draft_model is None:
            raise UserError(f"--drafter model needs --draft-model NAME for target {dec.model_name!r}")
        folder = resolve(draft_model)
        from moaspec.pipeline import load_tokenizer

        if load_tokenizer(folder).get_vocab() != dec.tokenizer.get_vocab():
            raise UserError(f"draft model {draft_model!r} does not share the target's tokenizer")
        model = Transformer(folder, weights=dec.target.weights, device=dec.target.device,
                            max_seq_len=dec.target.max_seq_len)
        return DraftModelDrafter(model)
    raise UserError(f"unknown drafter {name!r}; choose one of {', '.join(DRAFTERS)}")
