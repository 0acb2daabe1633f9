"""A GGUF read as it is: metadata, tokenizer and tensors from the file, in its own block formats, no transformers
in the process, and a bad file refused with a clear message before anything is written."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from tokenizers import Tokenizer

from moaspec.models import store
from moaspec.models.gguf_file import GGUFFile, build_tokenizer
from moaspec.models.store import ModelStoreError
from moaspec.models.weights import RowTable, gguf_path, open_weights

SMOL = "smollm2-135m"
needs_kernels = pytest.mark.needs_kernels


@pytest.fixture
def home(tmp_path, monkeypatch):
    h = tmp_path / "home"
    monkeypatch.setenv("MOASPEC_HOME", str(h))
    return h


def _models_written(home) -> list:
    models = home / "models"
    return [p for p in models.iterdir() if p.is_dir()] if models.exists() else []


@needs_kernels
def test_a_gguf_runs_in_its_own_formats_without_transformers(smol_folder):
    """The model folder is metadata; the runtime reads the GGUF's blocks (SmolLM2: Q4_1 layers, a Q8_0 tied
    embedding and head) and never imports transformers."""
    code = f"""
import sys, torch
from moaspec.models.store import resolve
from moaspec.models.runtime import Transformer
m = Transformer(resolve({SMOL!r}, progress=False), weights="auto", max_seq_len=64)
assert m.weights == "gguf", m.weights
fmts = sorted({{lin.blocks.fmt for lin in m.linears() if lin.blocks is not None}})
assert fmts == ["Q4_1", "Q8_0"], fmts
assert m.forward(torch.tensor([1, 2, 3])).logits.isfinite().all()
assert "transformers" not in sys.modules
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
    assert not list(smol_folder.glob("*.safetensors"))


def test_the_tokenizer_built_from_the_file_matches_transformers(smol_folder):
    """Our tokenizer (vocabulary, merges, SmolLM2's digit split, special tokens, from the file alone) gives the
    token ids of transformers' own reading of the same GGUF."""
    from prompts import PROMPTS
    from transformers import AutoTokenizer

    path = gguf_path(smol_folder)
    ours = build_tokenizer(GGUFFile(path))
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    texts = [*PROMPTS, "x 2024 and 3.14159", "  two  spaces\n\n\ttab", "<|im_start|>user\nhi<|im_end|>",
             "naïve 日本 😀"]
    for text in texts:
        assert ours.encode(text).ids == theirs.encode(text, add_special_tokens=False), text
    assert Tokenizer.from_file(str(smol_folder / "tokenizer.json")).encode(texts[0]).ids == ours.encode(texts[0]).ids


def test_embedding_rows_are_those_of_the_whole_table(smol_folder):
    """An embedding kept in its blocks de-quantises a row the same alone, with others, and in the full table."""
    cfg = json.loads((smol_folder / "config.json").read_text())
    src = open_weights(smol_folder, cfg["num_attention_heads"], cfg["num_key_value_heads"], torch.device("cpu"))
    table = RowTable(src, "model.embed_tokens.weight")
    assert table.fmt == "Q8_0" and table.nbytes < 0.3 * 4 * table.shape[0] * table.shape[1]
    ids = torch.tensor([5, 49151, 0, 5, 1234])
    full = table.full()
    assert torch.equal(table.rows(ids), full[ids])
    assert torch.equal(table.rows(ids[1:2]), full[ids[1:2]])
    assert torch.equal(full, src.tensor("model.embed_tokens.weight"))


def test_a_corrupt_file_is_refused_before_anything_is_written(tmp_path, home):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (1 << 62).to_bytes(8, "little") + bytes(64))
    with pytest.raises(ModelStoreError, match="corrupt"):
        store.resolve(bad, progress=False)
    not_gguf = tmp_path / "y.gguf"
    not_gguf.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ModelStoreError, match="not a GGUF"):
        store.resolve(not_gguf, progress=False)
    assert not _models_written(home)


def test_a_truncated_file_is_refused_before_anything_is_written(tmp_path, home, smol_folder):
    real = gguf_path(smol_folder)
    for cut in (5_000, 2_000_000, real.stat().st_size - 1):  # in the header, in the tensors, the last byte
        short = tmp_path / f"cut{cut}.gguf"
        with open(real, "rb") as f:
            short.write_bytes(f.read(cut))
        with pytest.raises(ModelStoreError, match="truncated"):
            store.resolve(short, progress=False)
    assert not _models_written(home)


def _tiny_gguf(path, arch: str, **keys) -> None:
    w = GGUFWriter(path, arch)
    w.add_block_count(1)
    w.add_embedding_length(64)
    w.add_head_count(2)
    for key, value in keys.items():
        w.add_string(f"{arch}.{key}", value)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b"])
    w.add_tensor("token_embd.weight", np.zeros((2, 64), np.float32), raw_dtype=GGMLQuantizationType.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_an_unsupported_family_or_rope_is_refused_at_once(tmp_path, home):
    """A family this runtime does not run (or RoPE scaling it does not apply) is named, with what runs, in well
    under a second and before anything is written."""
    for name, arch, keys, why in (("g.gguf", "gemma2", {}, "unsupported architecture 'gemma2'"),
                                  ("l.gguf", "llama", {"rope.scaling.type": "su"}, "RoPE scaling 'su'")):
        _tiny_gguf(tmp_path / name, arch, **keys)
        t = time.perf_counter()
        with pytest.raises(ModelStoreError, match=why) as e:
            store.resolve(tmp_path / name, progress=False)
        assert time.perf_counter() - t < 1.0
        assert "gemma3, llama, phi3, qwen2, qwen3" in str(e.value) or "YaRN" in str(e.value)
    assert not _models_written(home)


CHATS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Sum 2 and 3."},
     {"role": "assistant", "content": "5"}, {"role": "user", "content": "And <b>4</b> & \"5\"?"}],
    [{"role": "user", "content": "naïve 日本 😀\n\n  indented"}, {"role": "assistant", "content": "ok"}],
]


def test_our_tokenizer_and_chat_template_match_transformers(smol_folder):
    """The tokenizer the runtime loads (no transformers) renders every chat, encodes and decodes as transformers'
    own tokenizer of the same folder does."""
    from transformers import AutoTokenizer

    from moaspec.models.store import load_tokenizer

    ours, theirs = load_tokenizer(smol_folder), AutoTokenizer.from_pretrained(str(smol_folder))
    for chat in CHATS:
        for gen in (True, False):
            text = theirs.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
            assert ours.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False) == text
            assert ours.apply_chat_template(chat, add_generation_prompt=gen) == theirs.encode(
                text, add_special_tokens=False)
    ids = torch.randint(0, len(ours), (300,), generator=torch.Generator().manual_seed(0)).tolist()
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    assert (ours.eos_token_id, ours.pad_token_id) == (theirs.eos_token_id, theirs.pad_token_id)
    assert ours.convert_tokens_to_ids("<|im_end|>") == theirs.convert_tokens_to_ids("<|im_end|>")
