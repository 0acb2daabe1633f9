"""llama.cpp as a benchmark peer: its plain decoding (`llama-completion`) and its speculative
decoding with a draft model (`llama-speculative-simple`, llama.cpp's own defaults), on the GGUF
files our models ship as (quantised weights, which we run de-quantised to fp32 or fp16).

The programs are built from the llama.cpp that llama-cpp-python vendors (`make llama-cpp`, about
5 minutes) into ``~/.cache/moaspec/llama.cpp/build/bin``; ``$MOASPEC_LLAMA_CPP`` points elsewhere.
Each answer is one process, warmed up as our decoders are (llama.cpp's own warm-up pass, its timers reset
after it); the times are llama.cpp's own timers: `prompt eval` for the prompt and `eval` for the generation
(its sampling and printing left out, where our engine's wall time counts everything after the load). The
prompt is checked to be as many tokens on both sides (`prompt_tokens`): a chat prompt whose text opens with
the BOS that llama.cpp adds itself is passed without it.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from moaspec.errors import UserError
from moaspec.models.store import cache_dir

PLAIN, SPEC, LOOKUP = "llama-completion", "llama-speculative-simple", "llama-lookup"


def bin_dir() -> Path:
    env = os.environ.get("MOASPEC_LLAMA_CPP")
    return Path(env).expanduser() if env else cache_dir() / "llama.cpp" / "build" / "bin"


def missing(programs: tuple[str, ...] = (PLAIN, SPEC)) -> str | None:
    """Why llama.cpp can't run here, or None when the programs are built."""
    absent = [b for b in programs if not (bin_dir() / b).is_file()]
    if absent:
        return f"{', '.join(absent)} not found in {bin_dir()}; build them with `make llama-cpp`"
    return None


@dataclass
class LlamaCppAnswer:
    text: str
    new_tokens: int
    prompt_s: float
    decode_s: float
    drafted: int = 0
    accepted: int = 0
    prompt_tokens: int = 0  # as llama.cpp counted them


@lru_cache(maxsize=16)
def adds_bos(gguf: Path) -> bool:
    """Whether llama.cpp puts a BOS token before a prompt it tokenizes (the file's `add_bos_token`; llama.cpp
    adds one unless the file says not to, for a vocabulary that has a BOS)."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf)).fields
    flag = fields.get("tokenizer.ggml.add_bos_token")
    if flag is not None:
        return bool(flag.parts[flag.data[0]][0])
    return "tokenizer.ggml.bos_token_id" in fields and \
        bytes(fields["tokenizer.ggml.model"].parts[-1]).decode() == "llama"


def _sampling(temperature: float, seed: int) -> list[str]:
    if temperature <= 0:
        return ["--temp", "0", "--seed", str(seed)]
    # plain temperature sampling: llama.cpp's default top-k/top-p/min-p filters off, as in our engine
    return ["--temp", f"{temperature:g}", "--top-k", "0", "--top-p", "1", "--min-p", "0", "--seed", str(seed)]


def _run(cmd: list[str], timeout: float) -> tuple[str, str]:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise UserError(f"llama.cpp failed to run ({e}): {' '.join(cmd[:3])} ...") from e
    if p.returncode != 0:
        raise UserError(f"llama.cpp exited with code {p.returncode}: {p.stderr.strip()[-800:]}")
    return p.stdout, p.stderr


def _num(pattern: str, text: str, what: str) -> list[str]:
    m = re.search(pattern, text)
    if m is None:
        raise UserError(f"could not read {what} from llama.cpp's output (a different llama.cpp version?)")
    return list(m.groups())


def generate(prompt: str, model_gguf: Path, max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
             draft_gguf: Path | None = None, threads: int = 2, ctx: int = 4096,
             timeout: float = 1800, raw: bool = False, lookup: bool = False,
             prompt_tokens: int | None = None) -> LlamaCppAnswer:
    """One answer to an already chat-templated `prompt` (special tokens are parsed, as our tokenizer does);
    `raw`: the plain program's text as written (a code completion keeps its leading indentation);
    `lookup`: llama.cpp's prompt-lookup decoding (`llama-lookup`, n-grams of the context as drafts);
    `prompt_tokens`: the prompt's length on our side, which llama.cpp's count must equal (else the two sides
    would not have answered the same prompt)."""
    if why := missing((PLAIN, LOOKUP if lookup else SPEC)):
        raise UserError(f"llama.cpp is not built: {why}")
    common = ["-m", str(model_gguf), "-p", prompt, "-n", str(max_new_tokens), "-c", str(ctx), "-t", str(threads),
              *_sampling(temperature, seed)]
    if draft_gguf is None and not lookup:
        out, err = _run([str(bin_dir() / PLAIN), *common, "-no-cnv", "--no-display-prompt", "--simple-io"], timeout)
        p_ms, n_prompt = _num(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens", err, "the prompt time")
        e_ms, = _num(r"(?<!prompt )eval time =\s*([\d.]+) ms /\s*\d+ runs", err, "the generation time")
        sampled, = _num(r"samplers time =\s*[\d.]+ ms /\s*(\d+) tokens", err, "the token count")
        n = int(sampled) - int(n_prompt)
        n -= n < max_new_tokens  # it stopped on an end-of-generation token, which our count leaves out
        a = LlamaCppAnswer(out if raw else out.strip(), n, float(p_ms) / 1e3, float(e_ms) / 1e3,
                           prompt_tokens=int(n_prompt))
    else:
        if lookup:
            out, err = _run([str(bin_dir() / LOOKUP), *common], timeout)
        else:
            out, err = _run([str(bin_dir() / SPEC), *common, "--spec-type", "draft-simple", "-md", str(draft_gguf),
                             "-td", str(threads)], timeout)
        n_prompt, enc = _num(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds", err, "the prompt time")
        n, dec = _num(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", err, "the generation time")
        drafted, = _num(r"n_drafted\s*=\s*(\d+)", err, "the drafted count")
        accepted, = _num(r"n_accept\s*=\s*(\d+)", err, "the accepted count")
        text = out.strip()
        head = prompt.strip()
        if text.startswith(head):  # the program echoes the prompt first
            text = text[len(head):].strip()
        a = LlamaCppAnswer(text, int(n), float(enc), float(dec), int(drafted), int(accepted), int(n_prompt))
    if prompt_tokens is not None and a.prompt_tokens != prompt_tokens:
        raise UserError(f"llama.cpp read the prompt as {a.prompt_tokens} tokens where ours has {prompt_tokens}: the "
                        "two sides would not answer the same prompt (a doubled BOS, or special tokens read as text)")
    return a
