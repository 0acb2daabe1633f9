"""Every family the runtime runs, checked against transformers' own implementation: a tiny random model of the
family written as a GGUF (and as a Hugging Face folder) gives transformers' logits and its 32 greedy tokens,
past the original context where a RoPE scaling applies and past the window where one slides; an
unsupported file is refused before anything is written."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch
from family_models import build, write_folder, write_gguf

from moaspec.models import store
from moaspec.models.runtime import Transformer

LLAMA_CPP = __import__("moaspec.llamacpp").llamacpp.bin_dir()  # before a test's own MOASPEC_HOME
KINDS = ["llama", "llama3-scaled", "qwen2", "qwen2-yarn", "qwen3", "mistral", "gemma3", "phi3", "phi3-longrope"]


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("MOASPEC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture(scope="module")
def smol_gguf():
    return store.gguf_file("smollm2-135m", progress=False)


def _ours(model: Transformer, ids: torch.Tensor) -> torch.Tensor:
    model.reset()
    return model.forward(ids).logits


def _greedy_ours(model: Transformer, prompt: list[int], n: int) -> list[int]:
    model.reset()
    logits = model.prefill(prompt).logits[-1]
    out = []
    for _ in range(n):
        tok = int(logits.argmax())
        out.append(tok)
        logits = model.forward(torch.tensor([tok])).logits[-1]
        model.advance(1)
    return out


def _greedy_hf(hf, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                          pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _check(hf, ours: Transformer, length: int = 80) -> None:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(10, 40000, (length,), generator=gen)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    got = _ours(ours, ids)
    assert (got - ref).abs().max().item() < 1e-3 * max(1.0, ref.abs().max().item())
    # past 32 positions from the prompt on: transformers switches LongRoPE's factors by the sequence's length
    # (re-using a cache computed with the other factors), llama.cpp and we by the context's size
    prompt = ids[:40].tolist()
    assert _greedy_ours(ours, prompt, 32) == _greedy_hf(hf, prompt, 32)


@pytest.mark.parametrize("kind", KINDS)
def test_a_family_gguf_gives_transformers_logits_and_greedy_tokens(kind, home, tmp_path, smol_gguf):
    """80 positions (past a scaled RoPE's original 32, past Gemma's 24-token window) and 32 greedy tokens."""
    hf = build(kind)
    path = write_gguf(hf, tmp_path / f"{kind}.gguf", smol_gguf)
    folder = store.resolve(path, progress=False)
    ours = Transformer(folder, weights="fp32", max_seq_len=hf.config.max_position_embeddings)
    assert ours.cfg.model_type == hf.config.model_type or kind.startswith("mistral")
    _check(hf, ours)


@pytest.mark.parametrize("kind", ["mistral-window", "gemma3", "phi3", "qwen3", "llama3-scaled"])
def test_a_family_hf_folder_gives_transformers_logits(kind, tmp_path):
    """The same from a Hugging Face folder (safetensors): Mistral's window, Gemma's norms stored as w - 1."""
    hf = build(kind)
    folder = write_folder(hf, tmp_path / kind)
    _check(hf, Transformer(folder, weights="fp32", max_seq_len=hf.config.max_position_embeddings))


@pytest.mark.needs_kernels
@pytest.mark.parametrize("kind", ["gemma3", "qwen3", "phi3"])
def test_a_family_runs_the_same_through_the_one_call_stack_and_layer_by_layer(kind, home, tmp_path, smol_gguf):
    """The compiled Stack (the family's norms, gelu, window masks, two RoPE tables) gives the bits of the
    layer-by-layer path, at 1 row and at a 5-row tree past the window."""
    hf = build(kind)
    folder = store.resolve(write_gguf(hf, tmp_path / f"{kind}.gguf", smol_gguf), progress=False)
    model = Transformer(folder, weights="int8", max_seq_len=128)
    assert model.stack is not None
    ids = torch.randint(10, 40000, (60,), generator=torch.Generator().manual_seed(2))
    outs = []
    for stack in (model.stack, None):
        model.stack = stack
        model.reset()
        model.prefill(ids[:50], chunk=16)
        step = model.forward(ids[50:51]).logits
        mask = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]],
                            dtype=torch.bool)
        tree = model.forward(ids[50:55], positions=torch.tensor([50, 51, 51, 52, 52]), tree_mask=mask).logits
        outs.append((step, tree))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_an_unsupported_architecture_is_refused_at_once_leaving_nothing(home, tmp_path):
    from gguf import GGUFWriter

    path = tmp_path / "falcon.gguf"
    w = GGUFWriter(str(path), "falcon")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", torch.zeros(8, 4).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "moaspec", "generate", "--model", str(path), "--prompt", "hi"],
                         capture_output=True, text=True, timeout=120, env={**__import__("os").environ})
    took = time.perf_counter() - t
    assert out.returncode != 0
    assert "unsupported architecture 'falcon'" in out.stderr and "gemma3" in out.stderr
    assert "Traceback" not in out.stderr
    assert took < 15  # the interpreter and torch's import included; the refusal itself reads only the header
    assert not (home / "models").exists() or not any(p.is_dir() for p in (home / "models").iterdir())


def test_models_inspect_and_list_name_a_gguf_by_path(home, tmp_path, smol_gguf, capsys):
    """`models inspect` reads a header and says whether the file runs (nothing written); a file run by path is
    listed by `models list` with its family, format, size and context."""
    from moaspec import cli

    path = write_gguf(build("qwen3"), tmp_path / "tiny-qwen3.gguf", smol_gguf)
    assert cli.main(["models", "inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "qwen3" in out and "runs here" in out and "context 512" in out
    assert not (home / "models").exists()
    bad = tmp_path / "phi2.gguf"
    from gguf import GGUFWriter

    w = GGUFWriter(str(bad), "phi2")
    w.add_tensor("token_embd.weight", torch.zeros(8, 4).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert cli.main(["models", "inspect", str(bad)]) == 2
    assert "does not run here: unsupported architecture 'phi2'" in capsys.readouterr().out
    store.resolve(path, progress=False)
    assert cli.main(["models", "list", "--json"]) == 0
    rows = __import__("json").loads(capsys.readouterr().out)
    mine = [r for r in rows if r["name"] == str(path.resolve())]
    assert mine and mine[0]["family"] == "qwen3" and mine[0]["context"] == 512 and mine[0]["format"] == "ALL_F32"


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_llama_cpp_agrees_on_a_family_ggufs_greedy_tokens(kind, home, tmp_path, smol_gguf, monkeypatch):
    """llama.cpp, reading the same file, writes the same 32 greedy tokens (as text) after the same prompt."""
    from moaspec import llamacpp
    from moaspec.models.store import load_tokenizer

    monkeypatch.setenv("MOASPEC_LLAMA_CPP", str(LLAMA_CPP))
    if why := llamacpp.missing((llamacpp.PLAIN,)):  # `make test-slow` builds it first: missing, it fails
        pytest.fail(f"llama.cpp, this slow test's peer, is missing: {why}", pytrace=False)
    hf = build(kind)
    path = write_gguf(hf, tmp_path / f"{kind}.gguf", smol_gguf)
    folder = store.resolve(path, progress=False)
    tok = load_tokenizer(folder)
    prompt = "The quick brown fox jumps over the lazy dog, and then the dog wakes up and"
    ours = Transformer(folder, weights="fp32", max_seq_len=hf.config.max_position_embeddings)
    text = tok.decode(_greedy_ours(ours, tok.encode(prompt), 32))
    theirs = llamacpp.generate(prompt, path, 32, ctx=hf.config.max_position_embeddings, raw=True, timeout=120)
    assert theirs.text.startswith(text) and not theirs.text[len(text):].strip("\n")  # it ends with newlines
