"""The `strata` command as a new user meets it: a mistake is one line naming it (and the closest word when one was
mistyped), never argparse's usage of every flag; --help shows each flag's default."""

import subprocess
import sys

import pytest

from strata.cli import main


def _error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert len(err.strip().splitlines()) == 1, err
    return err


def test_a_mistyped_subcommand_names_the_closest(capsys):
    err = _error(capsys, ["serv"])
    assert err.startswith("strata: error:") and "did you mean 'serve'?" in err


def test_an_unknown_flag_is_one_line_of_its_subcommand_with_the_closest(capsys):
    err = _error(capsys, ["generate", "--tempreture", "0"])
    assert err.startswith("strata generate: error: unknown flag --tempreture")
    assert "did you mean --temperature?" in err
    err = _error(capsys, ["serve", "--api_key=x"])
    assert err.startswith("strata serve: error:") and "did you mean --api-key?" in err
    err = _error(capsys, ["generate", "hello"])  # the prompt without -p
    assert "unexpected argument 'hello'" in err and "-p" in err


def test_a_bad_value_is_one_line_not_the_usage(capsys):
    err = _error(capsys, ["serve", "-np", "0"])
    assert err.startswith("strata serve: error: argument -np/--parallel") and "usage" not in err
    err = _error(capsys, ["generate", "--dtype", "bf17"])
    assert "invalid choice: 'bf17'" in err and "did you mean 'bf16'?" in err
    err = _error(capsys, ["chat", "--top-k", "many"])
    assert "--top-k" in err and "'many'" in err


def test_help_shows_defaults_and_groups(capsys):
    for argv, wanted in ((["generate", "--help"], ["(default 40)", "(default 0.8)", "sampling:", "model and engine:"]),
                         (["serve", "--help"], ["(default 8080)", "(default 1024)", "server:"])):
        with pytest.raises(SystemExit) as e:
            main(argv)
        out = " ".join(capsys.readouterr().out.split())  # (as wrapped at any width)
        assert e.value.code == 0
        for w in wanted:
            assert w in out, (argv, w)
        assert "default []" not in out
    # the server's own flags come before the engine's dozens
    assert out.index("--port") < out.index("--ctx-size")


def test_python_dash_m_strata_without_arguments_prints_the_commands():
    r = subprocess.run([sys.executable, "-m", "strata"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "serve" in r.stdout and "Traceback" not in r.stderr
    v = subprocess.run([sys.executable, "-m", "strata", "--version"], capture_output=True, text=True, timeout=120)
    assert v.returncode == 0 and v.stdout.startswith("strata ")


def test_one_dash_is_never_a_prefix(capsys):
    """argparse would take -p for -pp: `serve -p 8080` started 8080 pipeline stages, `chat -p hi` complained of
    -pp. One dash names one flag; -c4096 (a flag and its value) still reads as -c 4096."""
    from strata.cli import build_parser

    args = build_parser().parse_args(["serve", "-c4096", "-np", "2"])
    assert (args.ctx_size, args.parallel, args.pipeline_parallel_size) == (4096, 2, 1)
    assert "chat takes its messages from the terminal" in _error(capsys, ["chat", "-p", "hi"])
    with pytest.raises(SystemExit):  # (parsed only: a -p taken for -pp would start that many stages)
        build_parser().parse_args(["serve", "-p", "8080"])
    assert "did you mean --port?" in capsys.readouterr().err


def test_llama_cpp_flags_say_what_does_their_job(capsys):
    assert "--vram-gb N is its GPU budget" in _error(capsys, ["serve", "-ngl", "99"])
    assert "--vram-gb N" in _error(capsys, ["serve", "--n-cpu-moe", "10"])
    # (not read as -n gl / -c moe: commands with -n or -c took a llama.cpp flag for a short flag and its value)
    assert "-ngl is llama.cpp's" in _error(capsys, ["generate", "-ngl", "99"])
    assert "-cmoe is llama.cpp's" in _error(capsys, ["serve", "-cmoe"])
    assert "--cpu-threads N" in _error(capsys, ["generate", "-t", "8"])
    assert "always rendered with jinja" in _error(capsys, ["serve", "--jinja"])


def test_generate_n_minus_one_runs_to_the_end_of_the_context():
    # llama.cpp's -n -1: generate until the end of turn or a full context (it was refused as "not positive")
    import os
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "strata", "generate", "-p", "def add(a, b):", "-n", "-1", "-c", "48",
                        "--temp", "0"], env={**os.environ, "OMP_NUM_THREADS": "1"},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    n = int(r.stderr.split("generated ")[1].split()[0])
    assert n > 1
    assert "stopped at the end of the context" in r.stderr or n < 48
