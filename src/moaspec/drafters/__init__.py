"""Drafters, one file each, all against `decoding.drafter.Drafter`."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from moaspec.errors import UserError

if TYPE_CHECKING:
    from moaspec.decoding.drafter import Drafter
    from moaspec.drafters.datastore import Datastore
    from moaspec.models.parts import TargetParts

DRAFTERS = ("auto", "none", "lookup", "suffix", "recycling", "hybrid", "model", "moa", "eagle", "independent")
TRAINED = ("moa", "eagle", "independent")  # drafters loaded from a checkpoint folder
# `hybrid` = the suffix drafter + one of these (its --drafter-path / --draft-model), per `hybrid.POLICIES`
HYBRID_MODELS = ("model", "recycling", *TRAINED)

# The same-tokenizer draft model a target gets when `--draft-model` is not given. SmolLM2 drafts
# for itself: useless for speed, but every draft is then accepted at T=0, a sharp engine test.
DEFAULT_DRAFT_MODEL = {
    "smollm2-135m": "smollm2-135m",
    "qwen2.5-coder-1.5b": "qwen2.5-coder-0.5b",
}


def drafter_kind(label: str) -> str:
    """The drafter kind of a checkpoint label: "moa-n3" -> "moa" (labels of `moaspec train`)."""
    return label.split("-")[0]


def shipped_checkpoint(kind: str, model: str) -> Path:
    """Where the checkpoint of a drafter kind trained for a target ships inside the package."""
    return Path(__file__).resolve().parent.parent / "checkpoints" / model / kind


def resolve_auto(model: str) -> str:
    """`auto`: the MoA drafter shipped for the target once its checkpoint is marked as the default
    (`"default": true` in its training.json, set when it measures faster than the suffix drafter), else
    the suffix drafter, which needs no training (it measured at or above prompt lookup on both targets,
    and seeded sampling is the same whatever the drafter, so its memory of earlier requests changes no
    seeded answer)."""
    meta = shipped_checkpoint("moa", model) / "training.json"
    if meta.exists() and json.loads(meta.read_text()).get("default", False):
        return "moa"
    return "suffix"


def ready_drafters(model: str) -> list[str]:
    """The drafters that run for target `model` with nothing more given: the training-free ones, and the
    trained ones whose checkpoint ships for it (the hybrid pairs the suffix drafter with its MoA)."""
    trained = [k for k in TRAINED if shipped_checkpoint(k, model).exists()]
    return ["none", "lookup", "suffix", "recycling", *trained, *(["hybrid"] if "moa" in trained else [])]


@lru_cache(maxsize=4)
def load_datastore(model: str, datastore: str | None = None) -> Datastore | None:
    """The suffix drafter's datastore (`drafters.datastore`): the one shipped for the target when
    `datastore` is None (none shipped: no store), none for "none", else the folder given. Read-only
    once built, so one copy serves every drafter of the process (a folder is read once per process)."""
    from moaspec.drafters.datastore import Datastore

    if datastore == "none":
        return None
    if datastore is None:
        folder = shipped_checkpoint("datastore", model)
        return Datastore.load(folder, model) if folder.exists() else None
    return Datastore.load(datastore, model)


def _store(model: str, datastore: str | None, target: TargetParts) -> Datastore | None:
    store = load_datastore(model, datastore)
    if store is not None and store.max_token >= target.cfg.vocab_size:
        raise UserError(f"the datastore {datastore or '(shipped)'} holds token {store.max_token}, past {model}'s "
                        f"vocabulary of {target.cfg.vocab_size}: rebuild it with `moaspec datastore --model {model}`")
    return store


def build_drafter(name: str, model_name: str, target: TargetParts, draft_model: str | None = None,
                  drafter_path: str | None = None, hybrid_model: str = "moa",
                  hybrid_policy: str = "switch", datastore: str | None = None) -> Drafter | None:
    """The drafter `name` for target `model_name`, whose frozen parts (a `Transformer`, or a
    `PartialTarget` on a client) the trained drafters share. `datastore`: the suffix drafter's (also
    a hybrid's), see `load_datastore`."""
    if name == "auto":
        name = resolve_auto(model_name)
    if name == "none":
        return None
    if name == "lookup":
        from moaspec.drafters.lookup import LookupDrafter

        return LookupDrafter()
    if name == "recycling":
        from moaspec.drafters.recycling import RecyclingDrafter

        return RecyclingDrafter()
    if name == "suffix":
        from moaspec.drafters.suffix import SuffixDrafter

        return SuffixDrafter(store=_store(model_name, datastore, target))
    if name == "hybrid":
        from moaspec.drafters.hybrid import HybridDrafter
        from moaspec.drafters.suffix import SuffixDrafter

        if hybrid_model not in HYBRID_MODELS:
            raise UserError(f"the hybrid drafter pairs the suffix drafter with one of {', '.join(HYBRID_MODELS)}; "
                            f"got {hybrid_model!r}")
        model = build_drafter(hybrid_model, model_name, target, draft_model=draft_model, drafter_path=drafter_path)
        return HybridDrafter(SuffixDrafter(store=_store(model_name, datastore, target)), model, hybrid_policy)
    if name == "model":
        from moaspec.drafters.draft_model import DraftModelDrafter
        from moaspec.models.runtime import Transformer
        from moaspec.models.store import load_tokenizer, resolve

        draft_model = draft_model or DEFAULT_DRAFT_MODEL.get(model_name)
        if draft_model is None:
            raise UserError(f"--drafter model needs --draft-model NAME for target {model_name!r}")
        folder = resolve(draft_model)
        if draft_model != model_name and \
                load_tokenizer(folder).get_vocab() != load_tokenizer(resolve(model_name)).get_vocab():
            raise UserError(f"draft model {draft_model!r} does not share the target's tokenizer")
        model = Transformer(folder, weights=target.weights, device=target.device, max_seq_len=target.max_seq_len)
        return DraftModelDrafter(model)
    if name in TRAINED:
        import importlib

        from moaspec.models.store import resolve, weights_fingerprint

        folder = Path(drafter_path) if drafter_path else shipped_checkpoint(name, model_name)
        if not folder.exists():
            raise UserError(
                f"no {name} drafter for {model_name!r} at {folder}: train one with "
                f"`moaspec train --kind {name} --model {model_name}` and pass --drafter-path, "
                "or use --drafter lookup"
            )
        module = importlib.import_module(f"moaspec.drafters.{name}")
        return module.load(folder, target, model_name, weights_fingerprint(resolve(model_name)))
    raise UserError(f"unknown drafter {name!r}; choose one of {', '.join(DRAFTERS)}")
