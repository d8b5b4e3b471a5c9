"""The `strata` command. Each subcommand lives beside the code it drives and registers itself here.

A subcommand module exposes `register(subparsers)`, which adds its parser and sets `func=callable(args) -> int`.
Modules are imported lazily-by-name so that a broken optional dependency of one command (say, the server
stack) never stops another (say, `strata generate`) from running.
"""

from __future__ import annotations

import argparse
import difflib
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


class HelpFormatter(argparse.HelpFormatter):
    """argparse's help with each flag's default, where the help text does not say it already."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if (default is None or default is False or default is argparse.SUPPRESS or default in ("", [])
                or "default" in text.lower() or not action.option_strings
                or isinstance(action, argparse.BooleanOptionalAction)):
            return text
        return f"{text} (default {default})" if text else f"(default {default})"


class Parser(argparse.ArgumentParser):
    """argparse, with a mistake said in one line (its usage of every flag is dozens of lines on serve, and buried
    the error), naming the closest word when one was mistyped: a subcommand, a choice, a flag."""

    def __init__(self, *args, **kw):
        kw.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kw)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")

    def _check_value(self, action, value):
        if action.choices is not None and value not in action.choices:
            near = difflib.get_close_matches(str(value), [str(c) for c in action.choices], n=1, cutoff=0.6)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            choices = ", ".join(map(repr, action.choices))
            raise argparse.ArgumentError(action, f"invalid choice: {value!r} (choose from {choices}){hint}")
        super()._check_value(action, value)

    def _get_option_tuples(self, option_string):
        # argparse takes a prefix of a flag for the flag: right for --temp, wrong for one dash, where -p is not
        # -pp (a user's `serve -p 8080` meant a port, not 8080 pipeline stages); -c4096 (-c, then its value) stays
        if option_string.split("=", 1)[0] in LLAMACPP_NAMES:  # (-ngl is not -n gl: said as llama.cpp's flag)
            return []
        found = super()._get_option_tuples(option_string)
        if option_string[:1] in self.prefix_chars and option_string[1:2] not in self.prefix_chars:
            found = [t for t in found if t[1] == option_string[:2]]
        return found

    def parse_args(self, args=None, namespace=None):
        args, extras = self.parse_known_args(args, namespace)
        if extras:
            sub = self._subcommand(args)
            sub.error(_unknown(sub, extras))
        return args

    def _subcommand(self, args) -> argparse.ArgumentParser:
        """The parser of the subcommand `args` ran (itself without one): its flags are what a mistyped one meant."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction) and getattr(args, action.dest, None):
                return action.choices[getattr(args, action.dest)]
        return self


# llama.cpp's flags that strata has no twin of, and what does their job here
LLAMACPP_FLAGS = {
    ("-ngl", "--n-gpu-layers", "--gpu-layers", "-ncmoe", "--n-cpu-moe", "-cmoe", "--cpu-moe", "-ot",
     "--override-tensor"): "strata places the model itself: --vram-gb N is its GPU budget (the expert cache takes "
                           "what the rest leaves)",
    ("-fa", "--flash-attn"): "strata's attention needs no switch",
    ("--jinja",): "chat templates are always rendered with jinja",
    ("--mlock", "--no-mmap"): "strata maps the file and pins what it keeps in RAM itself",
}

LLAMACPP_NAMES = frozenset(n for names in LLAMACPP_FLAGS for n in names)


def _unknown(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """What parse_known_args left over, in words, with the closest flag to the first unknown one."""
    word = extras[0]
    if not word.startswith("-") or word == "-":
        hint = "; the prompt goes after -p" if "-p" in parser._option_string_actions else ""
        return f"unexpected argument {word!r}{hint}"
    flag = word.split("=", 1)[0]
    for names, instead in LLAMACPP_FLAGS.items():
        if flag in names:
            return f"{flag} is llama.cpp's: {instead}"
    if flag in ("-t", "--threads"):
        return f"{flag}: --cpu-threads N sets the CPU lane's threads"
    if flag == "-p" and parser.prog.endswith(" chat"):
        return "-p: chat takes its messages from the terminal (`strata generate -p TEXT` answers one prompt)"
    if flag == "-p" and "--port" in parser._option_string_actions:
        return "unknown flag -p; did you mean --port?"
    flags = [f for f in parser._option_string_actions if f.startswith("--")]
    near = difflib.get_close_matches(flag, flags, n=1, cutoff=0.6)
    return f"unknown flag {flag}" + (f"; did you mean {near[0]}?" if near else "")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
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
