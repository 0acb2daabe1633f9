"""Drafters, one file each, all against `decoding.drafter.Drafter`."""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from moaspec.errors import UserError

if TYPE_CHECKING:
    from moaspec.decoding.drafter import Drafter
    from moaspec.models.parts import TargetParts


@dataclass(frozen=True)
class DrafterSpec:
    """One kind of drafter: the module under `moaspec.drafters` that holds it and whether it is trained. A
    training-free module defines `build(request)`; a trained one its drafter class as `DRAFTER` (its config
    `DRAFTER.config_cls`) and, if it has a target-side half, `load_encoder`. A new drafter is its module and
    one line in `SPECS`."""

    name: str
    module: str
    trained: bool = False  # loaded from a checkpoint folder that `moaspec train --kind NAME` writes

    def impl(self) -> ModuleType:
        return importlib.import_module(f"moaspec.drafters.{self.module}")

    def build(self, request: DrafterRequest) -> Drafter:
        if not self.trained:
            return self.impl().build(request)
        from moaspec.models.store import resolve, weights_fingerprint

        folder = Path(request.drafter_path) if request.drafter_path else shipped_checkpoint(self.name, request.model)
        if not folder.exists():
            raise UserError(f"no {self.name} drafter for {request.model!r} at {folder}: train one with `moaspec "
                            f"train --kind {self.name} --model {request.model}` and pass --drafter-path, or use "
                            "--drafter lookup")
        return self.load(folder, request.target, request.model, weights_fingerprint(resolve(request.model)))

    # ---- checkpoints of a trained kind: config.json + model.safetensors, naming the target they were made for
    def save(self, drafter: Any, folder: str | Path, fp16: bool = False) -> Path:
        """config.json (kind, sizes, target name + fingerprint) + model.safetensors (trainable weights and
        vocab ids; fp16 halves the float tensors)."""
        from moaspec.drafters.trained import save_checkpoint

        return save_checkpoint(drafter, folder, self.name, fp16)

    def read_config(self, folder: str | Path) -> Any:
        from moaspec.drafters.trained import read_checkpoint_config

        return read_checkpoint_config(folder, self.name, self.impl().DRAFTER.config_cls)

    def load(self, folder: str | Path, target: TargetParts, target_name: str, fingerprint: str) -> Any:
        """A drafter `save` wrote, attached to `target`. UserError for a checkpoint of another target (name,
        weights fingerprint or dimensions) and for missing or corrupt files."""
        from moaspec.drafters.trained import load_checkpoint

        return load_checkpoint(folder, self.name, self.impl().DRAFTER, target, target_name, fingerprint)

    def load_encoder(self, folder: str | Path, target: Any, target_name: str, fingerprint: str) -> Any | None:
        """The target-side half of a checkpoint alone, for a server (None: the kind reads token ids only)."""
        load = getattr(self.impl(), "load_encoder", None)
        return None if load is None else load(folder, target, target_name, fingerprint)


@dataclass(frozen=True)
class DrafterRequest:
    """What building a drafter may need: the target's name and the frozen parts it shares, and the options
    that name the drafter's own parts (a draft model, a checkpoint, a hybrid's halves, a datastore)."""

    model: str
    target: TargetParts
    draft_model: str | None = None
    drafter_path: str | None = None
    hybrid_model: str = "moa"
    hybrid_policy: str = "switch"
    datastore: str | None = None


SPECS = {s.name: s for s in (
    DrafterSpec("lookup", "lookup"),
    DrafterSpec("suffix", "suffix"),
    DrafterSpec("recycling", "recycling"),
    DrafterSpec("hybrid", "hybrid"),
    DrafterSpec("model", "draft_model"),
    DrafterSpec("moa", "moa", trained=True),
    DrafterSpec("eagle", "eagle", trained=True),
    DrafterSpec("independent", "independent", trained=True),
)}
DRAFTERS = ("auto", "none", *SPECS)
TRAINED = tuple(name for name, spec in SPECS.items() if spec.trained)
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


def drafter_spec(name: str) -> DrafterSpec:
    try:
        return SPECS[name]
    except KeyError:
        raise UserError(f"unknown drafter {name!r}; choose one of {', '.join(DRAFTERS)}") from None


def build_drafter(name: str, model: str, target: TargetParts, **options: Any) -> Drafter | None:
    """The drafter `name` ("auto": `resolve_auto`; "none": None) for target `model`, whose frozen parts (a
    `Transformer`, or a `PartialTarget` on a client) the trained drafters share; `options`: the rest of a
    `DrafterRequest`."""
    if name == "auto":
        name = resolve_auto(model)
    if name == "none":
        return None
    return drafter_spec(name).build(DrafterRequest(model, target, **options))
