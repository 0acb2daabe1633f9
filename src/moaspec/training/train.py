"""Drafter training with the target in the loop: MoA on-policy (arXiv 2410.03804, section 4), and the EAGLE-2
and independent baselines with the same data, loop, loss weights and budget.

The frozen target's features come from a cache (features.py): computed the first time a sequence is
used (fp16 on disk, 23 KB per token for SmolLM2, 12 KB for Qwen 0.5B) and read back for every later
epoch, drafter and learning-curve point. Several drafters train side by side
(`kind="moa,eagle,independent"`, `tli_layers="0,1,3"`): the same sequences, `every` draws and steps for
each, so equal budgets hold by construction.

Per sequence: the frozen target gives every layer's K/V and the hidden states; `every` is drawn
from 6..14; CA row i may read only contexts j <= start_i; SA is causal, except that in the first
half of training it is, with a probability falling linearly to 0, limited to tokens after start_i.
The loss covers every row whose label the target pass gives, prompt rows included (they are
verified context, so a prompt row drafts one step ahead): `ce_weight` x soft cross-entropy against the
target's next-token distribution + SmoothL1 to the target state the drafter regresses.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from moaspec.drafters import SPECS, TRAINED, eagle, independent, moa
from moaspec.errors import UserError
from moaspec.files import atomic_write, atomic_write_text
from moaspec.models.runtime import Transformer
from moaspec.models.store import resolve, weights_fingerprint
from moaspec.training import data
from moaspec.training.features import AnswerFeatures, FeatureCache, compute
from moaspec.training.stop import StopRequest

KINDS = {name: SPECS[name] for name in TRAINED}


@dataclass
class TrainConfig:
    model: str = "smollm2-135m"
    data: str = ""  # a `moaspec data` folder (training.data)
    data_tokens: int = 0  # train on a seeded subset of this many tokens (0 = all): learning curves
    answers_only: bool = False  # train on the target's own answers only, not on package text
    epochs: float = 0.0  # > 0: steps = epochs x the subset's sequences / batch_size (overrides steps)
    out: str = "runs/moa"
    kind: str = "moa"  # comma-separated among "moa", "eagle", "independent": trained side by side
    tli_layers: int | str = 0  # MoA Target Layer Inference N; "0,1,3" trains one MoA per N
    query_state: bool = False  # MoA's query rows also read the target's last verified final state (not in the paper)
    vocab_ids: int = 16384  # trimmed drafter head (0 = full vocabulary)
    steps: int = 300
    batch_size: int = 4
    max_len: int = 1024
    lr: float = 6e-4
    lr_min: float = 3e-5
    warmup: int = 30
    clip: float = 1.0
    # verified slots every `every` tokens, drawn per sequence: MoA trains drafting 1..every steps ahead
    # (the paper's 6-14; 1-4, for this CPU's chains of 1-3 tokens, measured no better: docs/training.md)
    every_min: int = 6
    every_max: int = 14
    ce_weight: float = 0.1
    val_every: int = 100
    val_sequences: int = 24
    seed: int = 0
    save_every: int = 100
    feature_cache: bool = True
    match_params: bool = True  # EAGLE-2's MLP sized so that it has MoA N=0's trainable parameter count
    device: str = "cpu"  # "cuda" (the target's features computed there, drafters under bf16 autocast)
    init: str = ""  # fine-tuning: every drafter starts from <init>/<label> (a run, a curve point, checkpoints)
    # the target mode whose features the drafters learn (fp32: the exact model; a served mode reads what
    # `moaspec data --features` stored, and computes the rest in that mode)
    target_weights: str = "fp32"


@dataclass
class Example:
    ids: list[int]
    prompt_len: int
    index: int = 0  # position in its split: the feature cache's key
    answer_from_target: bool = False  # the answer is the target's own generation (not package text)
    sid: str = ""  # the data's sequence id

@dataclass
class Student:
    """One drafter being trained: its label (run sub-folder), kind, MoA N, weights and optimiser."""

    label: str
    kind: str
    tli: int
    drafter: torch.nn.Module
    opt: torch.optim.Optimizer
    seconds: float = 0.0  # time in this drafter's own forward/backward/step


def student_specs(kind: str, tli_layers: int | str) -> list[tuple[str, str, int]]:
    """(label, kind, N) for each drafter a config asks for, e.g. `moa,eagle` with N `0,3` gives
    moa, moa-n3, eagle."""
    kinds = [k.strip() for k in str(kind).split(",") if k.strip()]
    try:
        tlis = [int(n) for n in str(tli_layers).split(",") if n.strip()]
    except ValueError:
        raise UserError(f"Target Layer Inference N must be integers like 0,1,3, not {tli_layers!r}") from None
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise UserError(f"unknown drafter kind {','.join(bad) or kind!r}; choose among {', '.join(KINDS)}")
    if any(n < 0 for n in tlis) or len(set(kinds)) != len(kinds):
        raise UserError(f"bad drafter list: kind={kind!r}, tli_layers={tli_layers!r}")
    specs = []
    for k in kinds:
        for n in (tlis or [0]) if k == "moa" else [0]:
            specs.append((k if n == 0 else f"{k}-n{n}", k, n))
    return specs


def load_examples(folder: str | Path, max_len: int) -> dict[str, list[Example]]:
    """A data folder's train and val splits as examples cut to `max_len` tokens (one read of the shards)."""
    rows = data.load(folder)
    fraction = json.loads((Path(folder) / "config.json").read_text())["val_fraction"]
    out: dict[str, list[Example]] = {"train": [], "val": []}
    for r in rows:
        ids = r.ids[:max_len]
        if len(ids) >= 3:
            split = out["val" if data.is_val(r.id, fraction) else "train"]
            split.append(Example(ids, min(max(1, r.prompt_len), len(ids)), len(split), r.mode != "text", r.id))
    return out


def subset(examples: list[Example], tokens: int, seed: int) -> list[Example]:
    """A seeded random subset of about `tokens` tokens; a smaller budget's subset is a prefix of a
    larger one's, so the points of a learning curve nest."""
    order = random.Random(f"subset-{seed}").sample(examples, len(examples))
    kept, total = [], 0
    for e in order:
        if total >= tokens:
            break
        kept.append(e)
        total += len(e.ids)
    return kept


def top_vocab(examples: list[Example], k: int, vocab_size: int) -> torch.Tensor:
    """The k tokens the target writes most often in its own answers (ties by id), then those most
    frequent anywhere in the data, padded with the lowest ids: the drafter drafts what the target
    generates, so the trimmed head is chosen from the answers, not from prompts or package text."""
    answers = Counter(t for e in examples if e.answer_from_target for t in e.ids[e.prompt_len:])
    anywhere = Counter(t for e in examples for t in e.ids)
    ranked = sorted(anywhere, key=lambda t: (-answers[t], -anywhere[t], t))[:k]
    seen = set(ranked)
    ranked += [t for t in range(vocab_size) if t not in seen][: k - len(ranked)]
    return torch.tensor(sorted(ranked))


def matched_eagle_config(target_cfg, common: dict) -> eagle.EagleConfig:
    """EAGLE-2's config with the MLP width (a multiple of 64) that gives it the trainable parameter
    count of MoA N=0 for the same target, as the paper compares them (e.g. Qwen 0.5B: 11.7M vs
    11.6M, where a target-shaped layer would have 16.5M)."""
    want = moa.MoADrafter(moa.MoAConfig.for_target(target_cfg, **common)).num_trainable_parameters()
    D = target_cfg.hidden_size
    base = eagle.EagleDrafter(eagle.EagleConfig.for_target(target_cfg, mlp=64, **common)).num_trainable_parameters()
    mlp = max(64, round((want - base) / (3 * D) / 64) * 64 + 64)
    return eagle.EagleConfig.for_target(target_cfg, mlp=mlp, **common)


def _distributed(device: str) -> tuple[int, int, torch.device]:
    """(rank, world size, this process's device). Under a launcher that sets WORLD_SIZE (torchrun,
    accelerate), joins its process group: NCCL on CUDA, gloo on CPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda, but PyTorch sees no CUDA device here")
    if world == 1:
        return 0, 1, dev
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    if dev.type == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
    return torch.distributed.get_rank(), world, dev


def _barrier(world: int) -> None:
    if world > 1:
        torch.distributed.barrier()


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr_min + 0.5 * (cfg.lr - cfg.lr_min) * (1 + math.cos(math.pi * min(1.0, t)))


class Trainer:
    def __init__(self, cfg: TrainConfig):
        from moaspec.models.store import load_tokenizer

        self.cfg = cfg
        if not 1 <= cfg.every_min <= cfg.every_max:
            raise UserError(f"the verification spacing must be 1 <= min <= max, got {cfg.every_min}-{cfg.every_max}")
        specs = student_specs(cfg.kind, cfg.tli_layers)
        self.rank, self.world, device = _distributed(cfg.device)
        torch.manual_seed(cfg.seed)
        self.rng = random.Random(cfg.seed)
        folder = resolve(cfg.model)
        self.tokenizer = load_tokenizer(folder)
        self.target = Transformer(folder, weights="fp32", device=device, max_seq_len=cfg.max_len + 8)
        manifest = Path(cfg.data) / "manifest.json"
        fingerprint = weights_fingerprint(folder)
        if manifest.exists() and json.loads(manifest.read_text()).get("target_fingerprint") != fingerprint:
            raise UserError(f"{cfg.data} was built for other weights than {cfg.model}'s: pass its own --model")
        splits = load_examples(cfg.data, cfg.max_len)
        everything = splits["train"]  # the feature cache's key: every subset of it shares one cache
        pool = [e for e in everything if e.answer_from_target] if cfg.answers_only else everything
        self.train = subset(pool, cfg.data_tokens, cfg.seed) if cfg.data_tokens else pool
        # validation: the target's own answers only (package text is not what the target writes)
        val = [e for e in splits["val"]
               if e.answer_from_target and e.prompt_len < len(e.ids) - 2][: cfg.val_sequences]
        self.val = [replace(e, index=i) for i, e in enumerate(val)]
        if not self.train or not self.val:
            raise UserError(f"{cfg.data} has {len(self.train)} training and {len(self.val)} validation sequences; "
                            "both must be non-empty")
        self.train_tokens = sum(len(e.ids) for e in self.train)
        if cfg.epochs > 0:
            cfg.steps = max(1, math.ceil(cfg.epochs * len(self.train) / cfg.batch_size))
        L = self.target.cfg.num_layers
        if any(n >= L for _, _, n in specs):
            raise UserError(f"Target Layer Inference N must be below the target's {L} layers")
        # the head is chosen from all the training data, so that every budget of a learning curve shares it
        vocab = top_vocab(everything, cfg.vocab_ids, self.target.cfg.vocab_size) if cfg.vocab_ids else None
        common = dict(vocab_ids=cfg.vocab_ids, target_name=cfg.model, target_fingerprint=fingerprint)
        self.students: list[Student] = []
        for label, kind, n in specs:
            if kind == "moa":
                dcfg = moa.MoAConfig.for_target(self.target.cfg, tli_layers=n, query_state=cfg.query_state,
                                                **common)
                drafter = moa.MoADrafter.from_target(self.target, dcfg, vocab)
            elif kind == "eagle":
                ecfg = matched_eagle_config(self.target.cfg, common) if cfg.match_params else \
                    eagle.EagleConfig.for_target(self.target.cfg, **common)
                drafter = eagle.EagleDrafter.from_target(self.target, ecfg, vocab)
            else:
                drafter = independent.IndependentDrafter.from_target(
                    self.target, independent.IndependentConfig.for_target(self.target.cfg, **common), vocab)
            drafter.train()
            self.students.append(Student(label, kind, n, drafter, self._optimizer(drafter)))
        if cfg.init:  # the drafters' own trimmed vocabulary comes with them
            self.load_drafters(Path(cfg.init))
            if len({tuple(st.drafter.vocab_ids.tolist()) for st in self.students}) > 1:
                raise UserError(f"the drafters in {cfg.init} were trained on different data (their trimmed "
                                "vocabularies differ): fine-tune them in separate runs (--kind/--tli)")
        self.layers = tuple(sorted({L} | {L - s.tli for s in self.students}))
        # the target whose features the drafters learn: the exact one, or the mode they will serve
        self.features_target = self.target if cfg.target_weights == "fp32" else \
            Transformer(folder, weights=cfg.target_weights, device=device, max_seq_len=cfg.max_len + 8)
        key = fingerprint if cfg.target_weights == "fp32" else f"{fingerprint}|{cfg.target_weights}"
        stored = AnswerFeatures(fingerprint, cfg.target_weights)
        stored = stored if stored.exists() else None
        self.caches = {}
        if cfg.feature_cache:
            for rank in range(self.world):  # one process creates the cache files, then the others open them
                if rank == self.rank:
                    for split, exs in (("train", everything), ("val", self.val)):
                        self.caches[split] = FeatureCache(self.features_target, key, [e.ids for e in exs],
                                                          self.layers, greedy=split == "val", stored=stored,
                                                          names=[e.sid for e in exs])
                _barrier(self.world)
        self.step = 0
        self.history: list[dict] = []
        self.out = Path(cfg.out)

    @property
    def drafter(self) -> torch.nn.Module:
        """The first (with one kind, the only) drafter."""
        return self.students[0].drafter

    # ------------------------------------------------------------------ target pass
    def target_pass(self, ex: Example, split: str = "train") -> dict:
        """Everything the drafters need from the frozen target for one sequence (no autograd), from
        the feature cache; validation adds the target's full-vocabulary argmax per row."""
        greedy = split == "val"
        cache = self.caches.get(split)
        f = cache.get(ex.index) if cache is not None else compute(self.features_target, ex.ids, self.layers, greedy)
        f = f.to(self.target.device)
        final = f.hidden[self.target.cfg.num_layers]
        head = self.drafter.head  # every drafter shares the trimmed vocabulary of the same data
        with torch.inference_mode():
            probs = F.linear(final, head).softmax(-1)  # over the drafter's vocabulary
        res = {"k": f.K.permute(2, 0, 1, 3), "v": f.V.permute(2, 0, 1, 3), "K": f.K, "V": f.V, "final": final,
               "probs": probs.clone(), "hidden": f.hidden}
        if greedy:
            res["argmax"] = f.argmax
        return res

    # ------------------------------------------------------------------ loss
    def sequence_loss(self, st: Student, ex: Example, tp: dict, every: int,
                      curriculum: bool, answer_only: bool = False, context_mean: bool = False
                      ) -> tuple[torch.Tensor, dict]:
        """Loss of one sequence for one drafter and what validation reads: top-1 agreement with the
        target's greedy token per loss row, and the draft depth of each row (steps ahead of the last
        verified token). `context_mean` (an ablation): each MoA Cross-Attention row reads one vector,
        the mean of the contexts it may read, which shows how much it uses the per-token context (the
        TLI layers of N >= 1 still read the target's own K/V)."""
        drafter = st.drafter
        T = len(ex.ids)
        dev = self.target.device
        rows = torch.arange(T, device=dev)
        tokens = torch.tensor([ex.ids], device=dev)
        # MoA/independent row i predicts x_{i+1}; row 0 has no verified context before it.
        start = moa.verification_starts(T, ex.prompt_len, every).to(dev)
        first = ex.prompt_len - 1 if answer_only else 1  # validation: the rows a drafter drafts at inference
        keep = (rows >= first) & (rows < T - 1)
        target_row = rows
        L = self.target.cfg.num_layers
        if st.kind == "moa":
            ctx = drafter.encoder(tp["k"][None], tp["v"][None])
            visible = None
            if context_mean:  # row i reads one vector: the mean of the contexts it may read (j <= start_i)
                ctx = ctx.cumsum(1) / torch.arange(1, T + 1, device=dev)[None, :, None]
                visible = (rows[None, None, :] == start[None, :, None])
            tail = (tp["K"][L - st.tli:][None], tp["V"][L - st.tli:][None]) if st.tli else None
            sa_mask = moa.sa_curriculum_mask(start[None])[0] if curriculum else None
            out = drafter.forward_train(tokens, ctx, start[None], tail, sa_mask, ca_visible=visible,
                                        states=tp["final"][None])
            hidden, final, logits = out.hidden[0], out.final[0], out.logits[0]
            depth = rows - start
        elif st.kind == "eagle":
            # EAGLE row i reads (f_i, x_{i+1}) and predicts f_{i+1}, x_{i+2}: its targets sit at row i + 1.
            keep = (rows >= first - 1) & (rows < T - 2)
            target_row = (rows + 1).clamp(max=T - 1)
            hidden, logits, depth = self.eagle_outputs(drafter, tokens, tp, start)
            final = hidden
        else:
            hidden, logits = drafter.forward_train(tokens)
            hidden, final, logits = hidden[0], hidden[0], logits[0]
            depth = torch.ones(T, dtype=torch.long, device=dev)  # token-only drafter: no stale target state
        t = target_row[keep]
        logits = logits[keep].float()
        ce = -(tp["probs"][t] * logits.log_softmax(-1)).sum(-1).mean()
        if st.kind == "moa" and st.tli:
            reg = 0.5 * F.smooth_l1_loss(hidden[keep].float(), tp["hidden"][L - st.tli][t]) + \
                0.5 * F.smooth_l1_loss(final[keep].float(), tp["final"][t])
        else:
            reg = F.smooth_l1_loss(hidden[keep].float(), tp["final"][t])
        loss = self.cfg.ce_weight * ce + reg
        stats = {"ce": ce.item(), "reg": reg.item(), "tokens": int(keep.sum()), "depth": depth[keep]}
        if not drafter.training:
            vocab = drafter.draft_vocab
            pred = logits.argmax(-1) if vocab is None else vocab[logits.argmax(-1)]
            stats["agree"] = pred == tp["argmax"][t]
        return loss, stats

    @staticmethod
    def eagle_outputs(drafter: torch.nn.Module, tokens: torch.Tensor, tp: dict, start: torch.Tensor):
        """Training: teacher forcing on the target's features (EAGLE is off-policy by design).
        Validation: the drafter's own features fed back as at inference. Row i uses the target's f_i
        only if slot i is verified (i <= s_i, s_i = last verified slot before row i + 1); otherwise the
        feature its previous row predicted. One pass per draft level makes levels 1..6 exact."""
        f = tp["final"][None]
        T = tokens.shape[1]
        s_next = torch.cat([start[1:], start.new_full((1,), T - 1)])  # s_i = start of row i + 1
        rows = torch.arange(T, device=tokens.device)
        verified = rows <= s_next
        depth = rows + 1 - s_next
        pred, logits = drafter.forward_train(tokens, f)
        if not drafter.training:
            for _ in range(5):
                fed = torch.where(verified[None, :, None], f, torch.cat([f[:, :1], pred[:, :-1]], 1))
                pred, logits = drafter.forward_train(tokens, fed)
        return pred[0], logits[0], depth

    # ------------------------------------------------------------------ loop
    def stop_requested(self, stop: StopRequest) -> bool:
        """Whether any process was asked to stop: all of them end after the same step (torchrun signals
        each worker, not necessarily within the same step)."""
        if self.world == 1:
            return stop.requested
        flag = torch.tensor([float(stop.requested)], device=self.target.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())

    def all_reduce(self, values: dict[str, float]) -> dict[str, float]:
        t = torch.tensor(list(values.values()), dtype=torch.float64, device=self.target.device)
        torch.distributed.all_reduce(t)
        return dict(zip(values, t.tolist(), strict=True))

    def batch(self, step: int) -> list[Example]:
        """Step `step`'s sequences: epochs walk seeded permutations of the training set in turn."""
        n, B = len(self.train), min(self.cfg.batch_size, len(self.train))
        out = []
        for j in range(step * B, step * B + B):
            epoch, pos = divmod(j, n)
            if epoch != getattr(self, "_order_epoch", None):
                self._order = random.Random(f"order-{self.cfg.seed}-{epoch}").sample(range(n), n)
                self._order_epoch = epoch
            out.append(self.train[self._order[pos]])
        return out

    def train_step(self, index: int, lr: float) -> tuple[dict[str, float], int, float]:
        """One optimiser step of every drafter on batch `index` at learning rate `lr`: the mean losses,
        the loss rows and the seconds spent in the target's features."""
        cfg = self.cfg
        tokens, target_s = 0, 0.0
        for st in self.students:
            for g in st.opt.param_groups:
                g["lr"] = lr
            st.opt.zero_grad(set_to_none=True)
        p_curriculum = max(0.0, 1.0 - index / (cfg.steps / 2))
        losses = {s.label: 0.0 for s in self.students}
        for k, ex in enumerate(self.batch(index)):
            every = self.rng.randint(cfg.every_min, cfg.every_max)
            curriculum = self.rng.random() < p_curriculum
            if k % self.world != self.rank:  # data parallel: each process takes its share of the batch
                continue
            t1 = time.time()
            tp = self.target_pass(ex)
            target_s += time.time() - t1
            for st in self.students:
                t1 = time.time()
                with torch.autocast("cuda", torch.bfloat16, enabled=self.target.device.type == "cuda"):
                    loss, s = self.sequence_loss(st, ex, tp, every, curriculum)
                (loss / cfg.batch_size).backward()
                st.seconds += time.time() - t1
                losses[st.label] += loss.item() / cfg.batch_size
            tokens += s["tokens"]
        if self.world > 1:
            losses = self.all_reduce(losses)
        for st in self.students:
            t1 = time.time()
            if self.world > 1:  # the gradients of the whole batch, as one process would have them
                for p in st.drafter.parameters():
                    if p.requires_grad:
                        if p.grad is None:
                            p.grad = torch.zeros_like(p)
                        torch.distributed.all_reduce(p.grad)
            torch.nn.utils.clip_grad_norm_([p for p in st.drafter.parameters() if p.requires_grad], cfg.clip)
            st.opt.step()
            st.seconds += time.time() - t1
        return losses, tokens, target_s

    def run(self, resume: bool = True, until: int | None = None) -> dict:
        """Train to `cfg.steps` (or stop after step `until`, saved, as a stopped session would)."""
        cfg = self.cfg
        if resume and (self.out / "trainer.pt").exists():
            self.load_state()
        labels = ", ".join(s.label for s in self.students)
        bar = tqdm(total=cfg.steps, initial=self.step, desc=f"train {labels}", unit="step")
        t0, tokens, target_s = time.time(), 0, 0.0
        stop = StopRequest()
        try:
            while self.step < min(cfg.steps, until or cfg.steps):
                losses, n, seconds = self.train_step(self.step, lr_at(self.step, cfg))
                tokens, target_s = tokens + n, target_s + seconds
                self.step += 1
                bar.update(1)
                bar.set_postfix(loss=" ".join(f"{v:.3f}" for v in losses.values()),
                                tok_s=f"{tokens / (time.time() - t0):.0f}")
                self.history.append({"step": self.step, "loss": losses, "lr": lr_at(self.step - 1, cfg)})
                if (self.step % cfg.val_every == 0 or self.step == cfg.steps) and self.rank == 0:
                    v = self.validate()
                    self.history[-1]["val"] = v
                    for label, r in v.items():
                        bar.write(f"step {self.step} {label}: val loss {r['loss']:.4f} top-1 by depth "
                                  f"{r['top1_by_depth']}")
                stopping = self.stop_requested(stop)  # read once: the save and the exit must agree
                if self.step % cfg.save_every == 0 or self.step in (cfg.steps, until) or stopping:
                    if self.rank == 0:
                        self.save_state()
                    _barrier(self.world)
                if stopping:
                    break
        finally:
            stop.restore()
        bar.close()
        stopped = self.step < min(cfg.steps, until or cfg.steps)  # ended by a signal before its end
        if stopped:
            bar.write(f"stopped by signal after step {self.step}, saved to {self.out}: "
                      "rerun the same command to resume")
        final = next((h["val"] for h in reversed(self.history) if "val" in h), {})
        # "signalled" also covers a signal in the last step: a caller running several runs stops there too
        result = {"steps": self.step, "stopped": stopped, "signalled": stop.requested, "train_tokens": tokens,
                  "seconds": round(time.time() - t0, 1),
                  "target_seconds": round(target_s, 1), "distinct_tokens": self.train_tokens, "drafters": {}}
        if "train" in self.caches:
            c = self.caches["train"]
            c.flush()
            result["feature_extraction"] = {"tokens": c.computed_tokens, "seconds": round(c.compute_s, 1),
                                            "tokens_per_s": round(c.computed_tokens / c.compute_s, 1)
                                            if c.compute_s else None}
        for st in self.students:
            result["drafters"][st.label] = {"seconds": round(st.seconds, 1), "final_val": final.get(st.label)}
            if self.rank == 0 and self.step == cfg.steps and (self.out / st.label).exists():
                info = {"data": cfg.data, "data_tokens": self.train_tokens, "answers_only": cfg.answers_only,
                        "epochs": cfg.epochs,
                        "steps": cfg.steps, "batch_size": cfg.batch_size, "max_len": cfg.max_len,
                        "vocab_ids": cfg.vocab_ids, "threads": torch.get_num_threads(), "train_tokens": tokens,
                        "trained_with": [s.label for s in self.students], "shared_target_seconds": result[
                            "target_seconds"], "seconds": result["seconds"], "own_seconds": round(st.seconds, 1),
                        "final_val": final.get(st.label), **fine_tuned_from(cfg.init, st.label)}
                atomic_write_text(self.out / st.label / "training.json", json.dumps(info, indent=1))
        return result

    @contextlib.contextmanager
    def branch(self):
        """Train inside the block, then return to the state before it: drafters, optimisers, random
        generators and step (a learning curve's decay branch leaves the constant-rate run untouched)."""
        saved = ([copy.deepcopy(st.drafter.state_dict()) for st in self.students],
                 [copy.deepcopy(st.opt.state_dict()) for st in self.students],
                 [st.seconds for st in self.students], self.rng.getstate(), torch.get_rng_state(), self.step)
        try:
            yield
        finally:
            drafters, opts, seconds, rng, torch_rng, self.step = saved
            for st, d, o, sec in zip(self.students, drafters, opts, seconds, strict=True):
                st.drafter.load_state_dict(d)
                st.opt.load_state_dict(o)
                st.seconds = sec
            self.rng.setstate(rng)
            torch.set_rng_state(torch_rng)

    def decay(self, steps: int, lr_end: float) -> None:
        """Warmup-stable-decay's last phase: `steps` more steps over the batches of the last `steps`
        steps again (no token beyond the budget), the learning rate falling linearly from `cfg.lr` to
        `lr_end`. A constant-rate run is not what one would ship; this is (use it inside `branch`)."""
        first = max(0, self.step - steps)
        for i in tqdm(range(steps), desc="decay", unit="step", leave=False):
            lr = self.cfg.lr + (lr_end - self.cfg.lr) * (i + 1) / steps
            self.train_step(first + i % max(1, self.step - first), lr)

    @torch.no_grad()
    def validate(self, every: int = 7, context_mean: bool = False) -> dict[str, dict]:
        """Per drafter: validation loss and top-1 agreement with the target's greedy token at draft
        depth 1..6 (depth = steps ahead of the last verified context), with a fixed `every`, over the
        answer rows of the target's own answers (`context_mean`: MoA drafters only, the ablation of
        `sequence_loss`)."""
        students = [st for st in self.students if st.kind == "moa" or not context_mean]
        if not students:
            return {}
        for st in students:
            st.drafter.eval()
        res = {st.label: {"loss": [], "agree": [], "depth": []} for st in students}
        for ex in self.val:
            tp = self.target_pass(ex, "val")
            for st in students:
                loss, s = self.sequence_loss(st, ex, tp, every, curriculum=False, answer_only=True,
                                             context_mean=context_mean)
                r = res[st.label]
                r["loss"].append(loss.item())
                r["agree"].append(s["agree"])
                r["depth"].append(s["depth"])
        out = {}
        for st in students:
            st.drafter.train()
            r = res[st.label]
            agree_t, depth_t = torch.cat(r["agree"]), torch.cat(r["depth"])
            by_depth = {d: round(agree_t[depth_t == d].float().mean().item(), 4) for d in range(1, 7)
                        if (depth_t == d).any()}
            rows = {d: int((depth_t == d).sum()) for d in by_depth}
            agreed = {d: int(agree_t[depth_t == d].sum()) for d in by_depth}
            out[st.label] = {"loss": round(sum(r["loss"]) / max(1, len(r["loss"])), 5), "top1_by_depth": by_depth,
                             "rows_by_depth": rows, "agreed_by_depth": agreed}
        return out

    # ------------------------------------------------------------------ checkpoints
    def save_state(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        for st in self.students:
            KINDS[st.kind].save(st.drafter, self.out / st.label)
        # the one file a resume reads: the drafters' weights with their optimisers and step, written whole
        state = {"step": self.step, "opt": {st.label: st.opt.state_dict() for st in self.students},
                 "drafters": {st.label: st.drafter.state_dict() for st in self.students},
                 "seconds": {st.label: st.seconds for st in self.students}, "rng": self.rng.getstate(),
                 "torch_rng": torch.get_rng_state(), "history": self.history, "config": asdict(self.cfg)}
        atomic_write(self.out / "trainer.pt", lambda tmp: torch.save(state, tmp))

    def _optimizer(self, drafter: torch.nn.Module) -> torch.optim.Optimizer:
        params = [p for p in drafter.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=self.cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)

    def load_drafters(self, folder: Path) -> None:
        """Every drafter's weights from `folder`/<label> (a run, or one of a learning curve's points). A
        drafter saved at another size than this config builds (an EAGLE-2 trained before `match_params`)
        is taken at its own size, with a new optimiser. A MoA saved without `query_state` starts one with it
        (its state projection at zero: the same drafter until it trains)."""
        for st in self.students:
            fresh = KINDS[st.kind].load(folder / st.label, self.target, self.cfg.model,
                                        st.drafter.cfg.target_fingerprint)
            if fresh.cfg == st.drafter.cfg:
                st.drafter.load_state_dict(fresh.state_dict())
            elif st.kind == "moa" and replace(fresh.cfg, query_state=True) == st.drafter.cfg:
                missing, unexpected = st.drafter.load_state_dict(fresh.state_dict(), strict=False)
                if unexpected or missing != ["state_proj.weight"]:
                    raise UserError(f"{folder / st.label}: cannot start a query_state MoA from it "
                                    f"(missing {missing}, unexpected {unexpected})")
            else:
                st.drafter = fresh.train(st.drafter.training)
                st.opt = self._optimizer(fresh)

    def save_point(self, folder: Path, info: dict) -> None:
        """The drafters as they are now, with `info`, into `folder` (a learning curve's point): a folder
        that `export`, `bench --checkpoints` and `experiments.agreement` take like a finished run."""
        if self.rank != 0:  # data parallel: every process holds the same weights; one writes them
            return
        for st in self.students:
            KINDS[st.kind].save(st.drafter, folder / st.label)
            (folder / st.label / "training.json").write_text(json.dumps(
                {"data": self.cfg.data, **info, "trained_with": [s.label for s in self.students]}, indent=1))
        (folder / "point.json").write_text(json.dumps({**info, "config": asdict(self.cfg)}, indent=1))

    def load_state(self) -> None:
        state = torch.load(self.out / "trainer.pt", weights_only=True)  # tensors and plain data only: no code runs
        missing = [st.label for st in self.students if st.label not in state["opt"]]
        if missing:
            raise UserError(f"{self.out} holds a run without {', '.join(missing)}: resume it with the same "
                            f"--kind/--tli, or pick a new --out")
        if "drafters" in state:  # weights saved with their step (runs before: the label folders)
            for st in self.students:
                st.drafter.load_state_dict(state["drafters"][st.label])
        else:
            self.load_drafters(self.out)
        for st in self.students:
            st.opt.load_state_dict(state["opt"][st.label])
            st.seconds = state["seconds"][st.label]
        self.rng.setstate(state["rng"])
        torch.set_rng_state(state["torch_rng"])
        self.step, self.history = state["step"], state["history"]


def fine_tuned_from(init: str, label: str) -> dict:
    """A fine-tuned drafter's provenance for its training.json: where it started, and how that was
    trained (empty for a drafter trained from scratch)."""
    if not init:
        return {}
    base = Path(init) / label / "training.json"
    try:
        return {"init": init, "init_training": json.loads(base.read_text())}
    except (OSError, ValueError):
        return {"init": init}


def run_config(run: str | Path) -> dict:
    """The `TrainConfig` (as a dict) of a training run folder (trainer.pt), of a learning curve's
    point (point.json), or of a folder of exported drafters (the shipped checkpoints: those trained
    side by side with `moa`, or with the first drafter, as their config.json and training.json say)."""
    run = Path(run)
    try:
        if (run / "point.json").exists():
            return json.loads((run / "point.json").read_text())["config"]
        if not (run / "trainer.pt").exists() and run.is_dir():
            exported = _exported_config(run)
            if exported is not None:
                return exported
        return torch.load(run / "trainer.pt", weights_only=True)["config"]
    except (OSError, KeyError, RuntimeError, ValueError) as e:
        raise UserError(f"{run} is neither a training run folder (readable trainer.pt) nor a learning "
                        f"curve's point (point.json): {e}") from None


def _exported_config(folder: Path) -> dict | None:
    labels = sorted(p.name for p in folder.iterdir()
                    if (p / "training.json").is_file() and (p / "config.json").is_file())
    if not labels:
        return None
    info = json.loads((folder / ("moa" if "moa" in labels else labels[0]) / "training.json").read_text())
    together = [label for label in info.get("trained_with", labels) if label in labels]
    configs = [json.loads((folder / label / "config.json").read_text()) for label in together]
    kinds = [k for k in KINDS if any(c["kind"] == k for c in configs)]
    tlis = sorted({c.get("tli_layers", 0) for c in configs if c["kind"] == "moa"}) or [0]
    return {**asdict(TrainConfig()), "model": configs[0]["target_name"], "data": info["data"],
            "kind": ",".join(kinds), "tli_layers": ",".join(map(str, tlis)), "vocab_ids": configs[0]["vocab_ids"],
            "query_state": any(c.get("query_state", False) for c in configs if c["kind"] == "moa"),
            "max_len": info.get("max_len", TrainConfig.max_len), "batch_size": info.get("batch_size", 4)}


def export(run: str | Path, dest: str | Path | None = None) -> list[Path]:
    """Copy a finished run's drafters as fp16 checkpoints (half the size, same drafts within fp16
    rounding) with their training.json, to `dest`/<label> (default: the checkpoints shipped in the
    package for the run's target, so that `--drafter <kind>` finds them)."""
    import shutil

    from moaspec.drafters import shipped_checkpoint

    run = Path(run)
    cfg = run_config(run)
    folder = resolve(cfg["model"])
    target = Transformer(folder, weights="fp32", max_seq_len=64)
    fingerprint = weights_fingerprint(folder)
    out = []
    for label, kind, _ in student_specs(cfg["kind"], cfg["tli_layers"]):
        if not (run / label / "training.json").exists():
            raise UserError(f"{run / label} has not finished training (no training.json): resume the run first")
        drafter = KINDS[kind].load(run / label, target, cfg["model"], fingerprint)
        to = Path(dest) / label if dest else shipped_checkpoint(label, cfg["model"])
        KINDS[kind].save(drafter, to, fp16=True)
        shutil.copy(run / label / "training.json", to / "training.json")
        out.append(to)
    return out
