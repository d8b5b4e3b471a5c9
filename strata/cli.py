"""The `strata` command. Each subcommand lives beside the code it drives and registers itself here.

A subcommand module exposes `register(subparsers)`, which adds its parser and sets `func=callable(args) -> int`.
Modules are imported lazily-by-name so that a broken optional dependency of one command (say, the server
stack) never stops another (say, `strata generate`) from running.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from strata import StrataError, __version__

# Subcommand modules, in the order `strata --help` lists them.
COMMAND_MODULES = [
    "strata.engine.cli",  # generate, chat, perplexity
    "strata.server.cli",  # serve
    "strata.hub.cli",  # pull, check
    "strata.gguf.cli",  # convert, synth
    "strata.bench.cli",  # bench, calibrate
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="strata", description="Run Mixture-of-Experts models larger than your GPU, and serve them over the "
        "OpenAI and Anthropic APIs.")
    parser.add_argument("--version", action="version", version=f"strata {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name and e.name.startswith(name):
                continue  # the command's module is not written yet
            raise
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except StrataError as e:
        print(f"strata: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("strata: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout's reader left (`strata generate | head`): stop quietly, as a shell tool does
        _drop_stdout()
        return 141  # (128 + SIGPIPE, what the shell reports for a tool that pipe ended)


def _drop_stdout() -> None:
    """stdout to /dev/null: Python flushes it at exit, and the unwritten text would raise there once more."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # (a stdout without a descriptor: nothing is flushed to a pipe at exit)
        pass


if __name__ == "__main__":
    sys.exit(main())
