"""`strata bench` hands the engine flags it was given to the strata servers it starts: each as the user wrote it."""

from strata.bench.cli import engine_argv
from strata.cli import build_parser


def _argv(*flags):
    return engine_argv(build_parser().parse_args(["bench", "sweep", "-m", "x.gguf", *flags]))


def test_a_boolean_flag_keeps_its_sense():
    # both spellings of an on/off flag are one argparse action: the server must get the one that was given
    assert "--expert-prefetch" in _argv("--expert-prefetch")
    assert "--no-expert-prefetch" not in _argv("--expert-prefetch")
    assert "--no-expert-prefetch" in _argv("--no-expert-prefetch")
    assert not any("expert-prefetch" in a for a in _argv())


def test_valued_flags_pass_with_their_values():
    argv = _argv("--vram-gb", "8", "-ctk", "q8_0")
    assert argv[argv.index("--vram-gb") + 1] == "8.0"
    assert argv[argv.index("--cache-type-k") + 1] == "q8_0"
