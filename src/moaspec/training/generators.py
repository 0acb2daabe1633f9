"""Engines that write the target's answers for the training data.

The answers only need to be close to the target's own: the labels always come from the fp32
target's pass over the finished text (teacher forcing). llama.cpp's server with continuous batching
over the quantised GGUF the model store checks (`make llama-cpp` builds it) is the default where
built, else transformers' batched `generate` on the fp32 weights. `RuntimeGenerator` writes them with
this project's own runtime, batched, in the weight mode the drafter will serve (`--engine moaspec
--weights MODE`): the answers of the target it will draft for, and with `features` the target's
features of each whole sequence from the same passes (no second pass at training time).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from moaspec.errors import UserError


@dataclass
class Request:
    key: str
    prompt: list[int]
    temperature: float  # 0 = greedy
    seed: int


@dataclass
class Answer:
    key: str
    tokens: list[int]  # ends with the end-of-turn token when the answer ended on its own
    finished: bool
    # the target's features of prompt + tokens from the passes that wrote them (RuntimeGenerator with
    # `features`): kv [T, 2, L, Hkv, d] and {layer: [T, D]}, fp16
    features: tuple[np.ndarray, dict[int, np.ndarray]] | None = None


class LlamaServer:
    """llama.cpp's `llama-server` as a subprocess on a free loopback port; `parallel` slots decode
    together (continuous batching), so the CPU's matrix units see several rows per weight read."""

    name = "llama.cpp"

    def __init__(self, binary: Path, gguf: Path, eos: int, parallel: int, threads: int, slot_len: int):
        self.eos, self.parallel = eos, parallel
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port), "-t", str(threads),
               "-tb", str(threads), "-np", str(parallel), "-c", str(parallel * slot_len), "--no-webui", "-ngl", "0",
               "--log-disable"]
        self.log = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the server
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise UserError(f"llama-server exited with code {self.proc.returncode}: {' '.join(cmd)}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                time.sleep(0.5)
        self.close()
        raise UserError("llama-server did not become healthy within 5 minutes")

    def _one(self, req: Request, max_new: int) -> Answer:
        body = {"prompt": req.prompt, "n_predict": max_new, "temperature": req.temperature, "seed": req.seed,
                "top_k": 0, "top_p": 1.0, "min_p": 0.0, "return_tokens": True, "cache_prompt": False,
                "samplers": ["temperature"]}  # plain temperature sampling; at 0, the argmax
        data = json.dumps(body).encode()
        for attempt in range(3):
            try:
                r = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", data=data,
                                           headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(r, timeout=3600) as resp:
                    out = json.loads(resp.read())
                break
            except (urllib.error.URLError, OSError):
                if attempt == 2 or self.proc.poll() is not None:
                    raise
                time.sleep(2)
        tokens = [int(t) for t in out["tokens"]]
        finished = out.get("stop_type") == "eos"
        if finished and (not tokens or tokens[-1] != self.eos):  # the server may or may not return it
            tokens.append(self.eos)
        return Answer(req.key, tokens, finished)

    def generate(self, requests: Sequence[Request], max_new: int) -> Iterator[Answer]:
        with ThreadPoolExecutor(self.parallel) as pool:
            yield from pool.map(lambda r: self._one(r, max_new), requests)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


class TransformersGenerator:
    """Batched `generate` on the fp32 weights (left padding): slow, but needs nothing built."""

    name = "transformers"

    def __init__(self, folder: Path, tokenizer, eos: int, batch_size: int):
        from moaspec.models.store import reference_model

        self.model = reference_model(folder)
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        self.eos, self.batch_size = eos, batch_size
        eos_ids = self.model.generation_config.eos_token_id
        self.stops = set(eos_ids if isinstance(eos_ids, list) else [eos_ids]) | {eos}

    def generate(self, requests: Sequence[Request], max_new: int) -> Iterator[Answer]:
        for mode in (0, 1):  # a batch shares its sampling mode
            group = sorted((r for r in requests if (r.temperature > 0) == bool(mode)), key=lambda r: len(r.prompt))
            for i in range(0, len(group), self.batch_size):
                batch = group[i:i + self.batch_size]
                width = max(len(r.prompt) for r in batch)
                ids = torch.tensor([[self.pad] * (width - len(r.prompt)) + r.prompt for r in batch])
                mask = (torch.arange(width)[None] >= torch.tensor([width - len(r.prompt) for r in batch])[:, None])
                torch.manual_seed(batch[0].seed)
                with torch.inference_mode():
                    gen = self.model.generate(ids, attention_mask=mask.long(), max_new_tokens=max_new,
                                              do_sample=bool(mode), temperature=batch[0].temperature if mode else None,
                                              top_p=None, top_k=None, pad_token_id=self.pad)
                for r, row in zip(batch, gen[:, width:].tolist(), strict=True):
                    cut = next((j for j, t in enumerate(row) if t in self.stops), None)
                    yield Answer(r.key, row if cut is None else row[:cut] + [self.eos], cut is not None)

    def close(self) -> None:
        pass


class RuntimeGenerator:
    """This project's runtime in a weight mode, many answers at once (`pipeline.generate_many`: plain
    decoding on forks of one model, their passes batched, each answer what that mode writes alone)."""

    name = "moaspec"

    def __init__(self, model: str, weights: str, eos: int, parallel: int, max_len: int,
                 features: bool = False):
        from moaspec.pipeline import SpecDecoder
        from moaspec.training.features import RECORDED_TLI

        self.dec = SpecDecoder(model, drafter="none", weights=weights, max_seq_len=max_len + 1)
        self.eos, self.parallel = eos, parallel
        L = self.dec.target.cfg.num_layers
        self.features = tuple(sorted({L - n for n in RECORDED_TLI if n < L})) if features else None

    def generate(self, requests: Sequence[Request], max_new: int) -> Iterator[Answer]:
        from moaspec.decoding.engine import GenerationConfig
        from moaspec.decoding.sampling import SamplingParams
        from moaspec.pipeline import generate_many
        from moaspec.training.features import Recorder

        requests = list(requests)
        cfgs = [GenerationConfig(max_new_tokens=max_new, sampling=SamplingParams(r.temperature, seed=r.seed))
                for r in requests]
        recorders: dict[int, Recorder] = {}

        def recorder(i: int) -> Recorder:
            recorders[i] = Recorder(self.features, self.eos)
            return recorders[i]

        for i, gen in generate_many(self.dec, [r.prompt for r in requests], cfgs, chat=False, parallel=self.parallel,
                                    recorders=recorder if self.features else None):
            if isinstance(gen, Exception):
                raise gen
            finished = gen.finish_reason == "stop"
            tokens = gen.token_ids + ([self.eos] if finished else [])
            features = recorders.pop(i).arrays() if self.features else None
            if features is not None and features[0].shape[0] != len(requests[i].prompt) + len(tokens):
                raise RuntimeError(f"recorded {features[0].shape[0]} positions for a sequence of "
                                   f"{len(requests[i].prompt) + len(tokens)} tokens")
            yield Answer(requests[i].key, tokens, finished, features)

    def close(self) -> None:
        pass
