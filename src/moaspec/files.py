"""Files written whole or not at all: each goes to a temporary name beside its place and is renamed
into it (atomic on one filesystem), so a job stopped at any moment, or a disk that fills up mid-write,
never leaves a file that a later run would read as whole."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> None:
    """`write(tmp)` writes the file to a temporary path; it then replaces `path` at once."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(text))
