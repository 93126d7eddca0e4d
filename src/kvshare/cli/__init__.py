"""The `kvshare` command line: one subcommand per module in this package.

Each subcommand module exposes ``register(subparsers) -> None``, which adds its parser and sets
``func`` (a callable taking the parsed args and returning an exit code) as a default. Subcommand
modules import torch (and the server stack) only inside ``func``, so ``kvshare --help`` is fast.
Errors a user can cause end as one ``error: ...`` line with exit code 2; Ctrl-C exits with 130.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = ("plan", "generate", "chat", "serve", "bench", "convert")


def build_parser() -> argparse.ArgumentParser:
    from kvshare import __version__

    parser = argparse.ArgumentParser(
        prog="kvshare",
        description="Inference engine for DeepSeek-V4 / V4.1 models with cross-layer KV sharing.",
    )
    parser.add_argument("--version", action="version", version=f"kvshare {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f"kvshare.cli.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"kvshare.cli.{name}":
                continue  # subcommand not built yet
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the command line itself (not a caller passing arguments): huge pages first
        from kvshare.hugepages import reexec_if_wanted

        reexec_if_wanted(sys.argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from kvshare.errors import KVShareError

    try:
        return int(args.func(args) or 0)
    except KVShareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
