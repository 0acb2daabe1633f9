"""Command-line flags declared on the config fields they set: a limit's name, default and meaning are
written once, beside its check, and the CLI builds its options (and the config) from them."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import field
from typing import Any, TypeVar

C = TypeVar("C")


def flagged(default: Any, flag: str, help: str = "", metavar: str | None = None, csv: bool = False) -> Any:
    """A dataclass field set by `flag` (`csv`: a tuple written comma-separated)."""
    return field(default=default, metadata={"flag": flag, "help": help, "metavar": metavar, "csv": csv})


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def add_flags(p: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type) -> None:
    """An option for every flagged field of `cls`, its default the field's."""
    for f in dataclasses.fields(cls):
        if "flag" not in f.metadata:
            continue
        m = f.metadata
        if m["csv"]:
            kind, default = str, ",".join(f.default)
        else:
            kind, default = (float if f.default is None else type(f.default)), f.default
        p.add_argument(m["flag"], dest=_dest(m["flag"]), type=kind, default=default, metavar=m["metavar"],
                       help=m["help"] or None)


def from_flags(cls: type[C], args: argparse.Namespace) -> C:
    """`cls` from the options `add_flags` made (its other fields at their defaults); it checks itself."""
    kw = {}
    for f in dataclasses.fields(cls):
        if "flag" in f.metadata:
            value = getattr(args, _dest(f.metadata["flag"]))
            kw[f.name] = tuple(v.strip() for v in value.split(",") if v.strip()) if f.metadata["csv"] else value
    return cls(**kw)
