"""Command line: `moaspec generate | chat | serve | serve-target | data | train | export | datastore | bench |
models`, one module per command group, each parsing its options and calling the package.

Checks run before a model loads, so mistakes fail at once. Errors the user can fix (`moaspec.errors.UserError`,
bad arguments) print `error: <message>` on stderr and exit 2; Ctrl-C exits 130.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import sys

from moaspec.cli import bench, generate, models, serve, training
from moaspec.cli.options import EXIT_INTERRUPT, EXIT_USAGE, error, generation_config, load_decoder, tree_config
from moaspec.errors import UserError
from moaspec.threads import set_threads

__all__ = ["build_parser", "generation_config", "load_decoder", "main", "tree_config"]

GROUPS = (generate, serve, training, bench, models)


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # no usage dump and no sys.exit: main() reports it like any other mistake
        raise _UsageError(f"{message} (see `{self.prog} --help`)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="moaspec", description="Speculative decoding with a Mixture-of-Attentions drafter (CPU).")
    sub = p.add_subparsers(dest="command", required=True,
                           metavar="{generate,chat,serve,serve-target,data,train,export,datastore,bench,models}")
    for group in GROUPS:
        group.add_parsers(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if getattr(args, "kernel_threads", None) is not None:
            set_threads(None if args.kernel_threads == "auto" else args.kernel_threads)
        return args.func(args)
    except (_UsageError, UserError) as e:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        error(e)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPT
    except BrokenPipeError:  # e.g. `moaspec generate ... | head -1` (an OSError: caught before them)
        with contextlib.suppress(Exception):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            raise
        # a full disk (or a file size limit) mid-write: every file is written aside first, nothing is half-written
        error(UserError(f"could not write {e.filename or 'a file'}: {e.strerror}; free some space and run the same "
                        "command again: it resumes from what was written whole"))
        return 1
    except SystemExit as e:  # --help / --version from argparse
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)


if __name__ == "__main__":
    sys.exit(main())
