"""Self-distillation data: the target answers the training prompts (greedy and sampled).

Decoding is memory-bound on this CPU, so a batch of 16 sequences costs little more than one:
generation runs batched through transformers `generate` (left padding). Results are appended per
batch to `responses.jsonl`, so a stopped job resumes where it stopped; `finalise` writes the
deduplicated train/validation split and a manifest (counts, tokens, wall time, seed, version).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from moaspec.models.store import resolve, weights_fingerprint
from moaspec.training.prompts import Prompt, build_prompts

DATA_VERSION = 1


@dataclass
class DataConfig:
    model: str = "smollm2-135m"
    prompts: int = 2000
    seed: int = 0
    batch_size: int = 16
    max_new_tokens: int = 256
    sampled_fraction: float = 0.5  # the rest is greedy
    temperature: float = 0.7
    val_fraction: float = 0.05

    def folder_name(self) -> str:
        return f"{self.model}-v{DATA_VERSION}-seed{self.seed}"


def _is_val(pid: str, fraction: float) -> bool:
    return int(hashlib.sha1(pid.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF < fraction


def generate(cfg: DataConfig, out_root: Path, time_budget_s: float | None = None) -> Path:
    """Generate (or resume) the data set; returns its folder."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out_root) / cfg.folder_name()
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(asdict(cfg), indent=1))
    done_path = out / "responses.jsonl"
    done = set()
    if done_path.exists():
        done = {json.loads(line)["id"] for line in done_path.read_text().splitlines() if line.strip()}
    prompts = build_prompts(cfg.prompts, cfg.seed)
    rng = random.Random(cfg.seed)
    modes = {p.id: ("sampled" if rng.random() < cfg.sampled_fraction else "greedy") for p in prompts}
    todo = [p for p in prompts if p.id not in done]
    folder = resolve(cfg.model)
    tok = AutoTokenizer.from_pretrained(str(folder))
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()

    def encode(p: Prompt) -> list[int]:
        ids = tok.apply_chat_template([{"role": "user", "content": p.text}], add_generation_prompt=True,
                                      tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    encoded = {p.id: encode(p) for p in todo}
    eos_ids = model.generation_config.eos_token_id
    eos = set(eos_ids if isinstance(eos_ids, list) else [eos_ids])
    per_mode = []
    for mode in ("greedy", "sampled"):
        group = sorted((p for p in todo if modes[p.id] == mode), key=lambda p: len(encoded[p.id]))
        per_mode.append([(mode, group[i:i + cfg.batch_size]) for i in range(0, len(group), cfg.batch_size)])
    # alternate greedy and sampled batches, so that a job stopped early still holds both kinds
    batches = [b for pair in itertools.zip_longest(*per_mode) for b in pair if b is not None]
    t0 = time.time()
    bar = tqdm(total=len(prompts), initial=len(prompts) - len(todo), desc="self-distillation", unit="prompt")
    new_tokens = 0
    with done_path.open("a") as f:
        for b, (mode, batch) in enumerate(batches):
            if time_budget_s is not None and time.time() - t0 > time_budget_s:
                break
            width = max(len(encoded[p.id]) for p in batch)
            ids = torch.tensor([[tok.pad_token_id] * (width - len(encoded[p.id])) + encoded[p.id] for p in batch])
            mask = torch.tensor([[0] * (width - len(encoded[p.id])) + [1] * len(encoded[p.id]) for p in batch])
            torch.manual_seed(cfg.seed * 100003 + b)
            with torch.inference_mode():
                gen = model.generate(ids, attention_mask=mask, max_new_tokens=cfg.max_new_tokens,
                                     do_sample=mode == "sampled", temperature=cfg.temperature if mode == "sampled"
                                     else None, top_p=None, top_k=None, pad_token_id=tok.pad_token_id)
            for p, row in zip(batch, gen[:, width:].tolist(), strict=True):
                cut = next((i for i, t in enumerate(row) if t in eos), len(row))
                response = tok.decode(row[:cut], skip_special_tokens=True)
                new_tokens += cut
                f.write(json.dumps({"id": p.id, "source": p.source, "mode": mode, "prompt": p.text,
                                    "response": response, "response_tokens": cut}) + "\n")
            f.flush()
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{new_tokens / (time.time() - t0):.0f}")
    bar.close()
    elapsed = time.time() - t0
    log = out / "generation_log.jsonl"
    with log.open("a") as f:
        f.write(json.dumps({"seconds": round(elapsed, 1), "new_tokens": new_tokens,
                            "prompts_done": len(prompts) - len(todo)}) + "\n")
    finalise(cfg, out, folder)
    return out


def finalise(cfg: DataConfig, out: Path, model_folder: Path) -> dict:
    """Deduplicate, split train/validation by a hash of the prompt id, and write the manifest."""
    rows, seen = [], set()
    for line in (out / "responses.jsonl").read_text().splitlines():
        r = json.loads(line)
        key = (r["prompt"], r["response"])
        if line.strip() and key not in seen and r["response"].strip():
            seen.add(key)
            rows.append(r)
    rows.sort(key=lambda r: r["id"])
    splits = {"train": [r for r in rows if not _is_val(r["id"], cfg.val_fraction)],
              "val": [r for r in rows if _is_val(r["id"], cfg.val_fraction)]}
    for name, part in splits.items():
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    logs = [json.loads(x) for x in (out / "generation_log.jsonl").read_text().splitlines()] \
        if (out / "generation_log.jsonl").exists() else []
    manifest = {
        "version": DATA_VERSION, "model": cfg.model, "target_fingerprint": weights_fingerprint(model_folder),
        "seed": cfg.seed, "prompts_requested": cfg.prompts,
        "train": len(splits["train"]), "val": len(splits["val"]),
        "response_tokens": {k: sum(r["response_tokens"] for r in v) for k, v in splits.items()},
        "generation_seconds": round(sum(x["seconds"] for x in logs), 1),
        "complete": len(rows) >= cfg.prompts,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest
