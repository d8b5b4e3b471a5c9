"""`strata bench` and `strata calibrate` as a user meets them: a bad --out, a peer that is not there, a server
that dies mid-run, an impossible length. Real processes, real files; each must end in one clear error line."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from strata.bench.client import strata_server

ROOT = Path(__file__).resolve().parents[2]


def strata(*argv, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "strata", *argv], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def one_error(r, *words):
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("strata: error:")]
    assert len(err) == 1, r.stderr
    for w in words:
        assert w in err[0], err[0]
    return err[0]


def test_an_out_that_is_a_file_is_refused_before_any_server_starts(tmp_path):
    f = tmp_path / "results"
    f.write_text("not a directory")
    r = strata("bench", "sweep", "--lengths", "64", "--out", str(f))
    one_error(r, "--out", "is not a directory")
    assert "starting" not in r.stderr and f.read_text() == "not a directory"


def test_a_wrong_llama_server_path_is_refused_before_strata_runs(tmp_path):
    """Found only after strata's own run, it used to throw that run's results away."""
    for flag in ("--llama-server", "--llama-bench"):
        r = strata("bench", "sweep", "--lengths", "64", "--out", str(tmp_path), "--vs", "llamacpp",
                   flag, str(tmp_path / "absent"))
        one_error(r, flag, "no such file")
        assert "starting" not in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_no_llama_cpp_at_all_says_what_to_install(tmp_path):
    """A Python without the xllamacpp package and no llama-server binary: one line naming the ways to get one,
    before strata's run, not a child process's traceback in the report."""
    shadow = tmp_path / "site" / "xllamacpp"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ModuleNotFoundError('No module named xllamacpp', name='xllamacpp')\n")
    r = subprocess.run([sys.executable, "-m", "strata", "bench", "sweep", "--lengths", "64", "--out",
                        str(tmp_path / "out"), "--vs", "llamacpp"], capture_output=True, text=True, timeout=120,
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{ROOT}"})
    one_error(r, "--llama-server PATH", "xllamacpp")
    assert not (tmp_path / "out").exists()


def test_a_server_that_dies_mid_run_ends_in_one_error(tmp_path):
    """The server is killed while it generates for the bench: the bench says the server stopped answering and
    that no results were written, without a traceback and without a results directory that looks finished."""
    with strata_server(str(ROOT / "strata" / "data" / "strata-tiny.gguf"), ["--device", "cpu", "-c", "2048"],
                       tmp_path / "serve.log") as srv:
        out = tmp_path / "out"
        bench = subprocess.Popen([sys.executable, "-m", "strata", "bench", "sweep", "--url", srv.url, "--lengths",
                                  "64", "--runs", "1", "--warmup", "0", "--gen", "1900", "--out", str(out)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                 env={**os.environ, "PYTHONPATH": str(ROOT)})
        try:
            while True:  # until the server is generating the bench's request
                assert bench.poll() is None, bench.communicate()
                h = httpx.get(srv.url + "/health", timeout=10).json()
                if h.get("slots_processing"):
                    break
                time.sleep(0.05)
            os.kill(srv.proc.pid, signal.SIGKILL)
            _, err = bench.communicate(timeout=120)
        finally:
            if bench.poll() is None:
                bench.kill()
    r = subprocess.CompletedProcess(bench.args, bench.returncode, "", err)
    one_error(r, srv.url, "stopped answering")
    assert "no results written" in err
    assert not out.exists() or not any(out.rglob("results.json"))


def test_results_are_written_whole_or_not_at_all(tmp_path):
    """results.json replaces the old file in one rename; a results.md that cannot be written is a clear error
    and leaves no temporary file behind."""
    from strata import StrataError
    from strata.bench import report

    d = tmp_path / "run"
    d.mkdir()
    (d / "results.json").write_text("old")
    (d / "results.md").mkdir()  # (something in the way: the write fails)
    with pytest.raises(StrataError, match="cannot write .*results.md"):
        report.write({"name": "x", "date": "now", "suites": {}, "peers": {}}, d)
    assert json.loads((d / "results.json").read_text())["name"] == "x"
    assert [p.name for p in d.iterdir() if p.name.startswith(".")] == []


def test_calibrate_refuses_a_json_path_it_cannot_write_before_loading(tmp_path):
    """Found only when the result was written, it ended minutes of measuring in a FileNotFoundError."""
    r = strata("calibrate", "--device", "cpu", "--expert-slots", "4", "--no-save", "--json",
               str(tmp_path / "absent" / "calib.json"), env={"STRATA_CACHE_DIR": str(tmp_path / "cache")})
    one_error(r, "--json", "does not exist")
    assert "loading" not in r.stderr


def test_calibrate_refuses_a_prompt_past_the_context_with_the_numbers(tmp_path):
    """A huge --prompt-tokens used to build its filler text first (gigabytes, for minutes) before anything
    compared it with the context."""
    r = strata("calibrate", "--device", "cpu", "--expert-slots", "4", "--no-save", "--prompt-tokens", "999999999",
               "--decode-tokens", "3", "--repeats", "1", "--knobs", "pcie_share",
               env={"STRATA_CACHE_DIR": str(tmp_path / "cache")}, timeout=120)
    one_error(r, "--prompt-tokens 999999999", "2048")
