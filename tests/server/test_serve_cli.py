"""`strata serve` as a process, in the environments a new user's machine has: no C compiler, a fresh cache shared by
two servers started together. Real processes on loopback, real HTTP."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

from .conftest import free_port


def _start(port: int, env: dict, log, *flags: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "strata", "serve", "--port", str(port), "-np", "1",
                             "--no-warmup", "--threads", "1", *flags], env=env, stdout=log, stderr=subprocess.STDOUT)


def _ready(proc: subprocess.Popen, port: int, timeout: float = 240) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        assert proc.poll() is None, "the server exited"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError("the server did not become ready")


def _complete(port: int) -> dict:
    body = json.dumps({"prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200
        return json.loads(r.read())


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(timeout=60)


def test_serve_without_a_c_compiler_says_so_once_and_serves(tmp_path):
    no_tools = tmp_path / "bin"
    no_tools.mkdir()
    env = {**os.environ, "PATH": str(no_tools), "CC": "strata-no-such-cc", "STRATA_CACHE_DIR": str(tmp_path / "c"),
           "STRATA_API_KEY": "", "OMP_NUM_THREADS": "1"}
    port = free_port()
    with open(tmp_path / "log", "wb") as log:
        proc = _start(port, env, log)
        try:
            _ready(proc, port)
            assert _complete(port)["choices"][0]["text"]
        finally:
            _stop(proc)
    out = (tmp_path / "log").read_text()
    said = [ln for ln in out.splitlines() if "C compiler" in ln]
    assert len(said) == 1 and "torch's kernels" in said[0], out
    assert "Traceback" not in out


def test_two_servers_started_together_share_a_fresh_cache(tmp_path):
    env = {**os.environ, "STRATA_CACHE_DIR": str(tmp_path / "cache"), "STRATA_API_KEY": "", "OMP_NUM_THREADS": "1"}
    ports = [free_port(), free_port()]
    logs = [open(tmp_path / f"log{i}", "wb") for i in range(2)]
    procs = [_start(p, env, log) for p, log in zip(ports, logs)]
    try:
        for proc, port in zip(procs, ports):
            _ready(proc, port)
        texts = [_complete(port)["choices"][0]["text"] for port in ports]
        assert texts[0] == texts[1]  # (the same model, greedy: the same text)
    finally:
        for proc in procs:
            _stop(proc)
        for log in logs:
            log.close()
    for i in range(2):
        out = (tmp_path / f"log{i}").read_text()
        assert "Traceback" not in out and "native CPU kernel" not in out, out
    # one complete build of the kernel (each server compiled it or took the other's), no temporary left behind
    native = tmp_path / "cache" / "native"
    assert [p.suffix for p in native.iterdir()] == [".so"]


def test_an_empty_api_key_is_refused(capsys, tmp_path):
    """`--api-key "$KEY"` with KEY unset would serve with no key at all: one line instead, before anything loads."""
    from strata.cli import main

    for key in ("", "  "):
        assert main(["serve", "--api-key", key, "-m", str(tmp_path / "missing.gguf")]) == 1
        err = capsys.readouterr().err
        assert err == "strata: error: --api-key is empty: pass a key, or leave the flag out to serve without one\n"


def test_a_file_that_holds_no_model_fails_before_listening(tmp_path):
    """A vocabulary-only GGUF, a safetensors file: one error line and a non-zero exit, without first claiming to
    listen (the model loads after the port is bound; the file's header is checked before)."""
    import pathlib

    from safetensors.torch import save_file
    import torch

    save_file({"w": torch.zeros(4)}, tmp_path / "model.safetensors")
    vocab = pathlib.Path(__file__).resolve().parents[1] / "data" / "llama.cpp-models" / "ggml-vocab-gpt-2.gguf"
    env = {**os.environ, "STRATA_API_KEY": "", "OMP_NUM_THREADS": "1"}
    for path, words in ((vocab, "holds no tensors"), (tmp_path / "model.safetensors", "a safetensors file")):
        r = subprocess.run([sys.executable, "-m", "strata", "serve", "-m", str(path), "--port", str(free_port())],
                           env=env, capture_output=True, text=True, timeout=120)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode == 1 and len(lines) == 1 and words in lines[0], r.stderr
        assert lines[0].startswith("strata: error:") and "listening" not in r.stderr


def test_port_0_listens_on_a_free_port_and_prints_it(tmp_path):
    # llama-server's --port 0: the system picks a free port; the "listening on" line must name the real one, and
    # that port is the server's own origin (a page served from it is not refused as cross-site)
    import re

    import openai

    env = {**os.environ, "STRATA_API_KEY": "", "OMP_NUM_THREADS": "1"}
    log_path = tmp_path / "log"
    with open(log_path, "wb") as log:
        proc = _start(0, env, log)
        try:
            port = None
            t0 = time.time()
            while port is None and time.time() - t0 < 120:
                assert proc.poll() is None, log_path.read_text()
                m = re.search(r"listening on http://127\.0\.0\.1:(\d+) ", log_path.read_text())
                port = int(m.group(1)) if m else None
                time.sleep(0.1)
            assert port, log_path.read_text()
            assert port != 0
            _ready(proc, port)
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
            r = client.completions.create(model="strata-tiny", prompt="def add(a, b):", max_tokens=4, temperature=0)
            assert r.usage.completion_tokens >= 1
            req = urllib.request.Request(f"http://127.0.0.1:{port}/props",
                                         headers={"Origin": f"http://127.0.0.1:{port}"})
            with urllib.request.urlopen(req, timeout=30) as resp:
                assert resp.status == 200
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics?format=json", timeout=30) as resp:
                assert json.loads(resp.read())["settings"]["port"] == port
        finally:
            _stop(proc)
    assert "Traceback" not in log_path.read_text()


def test_serve_takes_llama_server_sampling_flags_as_request_defaults(tmp_path):
    # `llama-server --temp 0.9 --seed 11 -n 6`: a request that leaves the fields out samples with them, /props
    # says so, and the same seed gives the same text from a second server run
    import openai

    env = {**os.environ, "STRATA_API_KEY": "", "OMP_NUM_THREADS": "1"}
    ports = [free_port(), free_port()]
    flags = ("--temp", "0.9", "--top-k", "0", "--seed", "11", "-n", "6")
    logs = [open(tmp_path / f"log{i}", "wb") for i in range(2)]
    procs = [_start(p, env, log, *flags) for p, log in zip(ports, logs)]
    try:
        texts = []
        for proc, port in zip(procs, ports):
            _ready(proc, port)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/props", timeout=30) as r:
                params = json.loads(r.read())["default_generation_settings"]["params"]
            assert (params["temperature"], params["top_k"], params["seed"], params["n_predict"]) == (0.9, 0, 11, 6)
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
            chat = dict(model="strata-tiny", messages=[{"role": "user", "content": "Write a sort function."}],
                        extra_body={"ignore_eos": True})
            r = client.chat.completions.create(**chat)
            assert r.usage.completion_tokens == 6  # serve's -n, not the whole context
            again = client.chat.completions.create(**chat)
            assert again.choices[0].message.content == r.choices[0].message.content  # the server's seed
            other = client.chat.completions.create(**chat, seed=12, max_tokens=6)
            texts.append((r.choices[0].message.content, other.choices[0].message.content))
            comp = client.completions.create(model="strata-tiny", prompt="def add(a, b):", extra_body={"ignore_eos": True})
            assert comp.usage.completion_tokens == 6
        assert texts[0] == texts[1]  # reproducible across server runs
    finally:
        for proc, log in zip(procs, logs):
            _stop(proc)
            log.close()
    for i in range(2):
        assert "Traceback" not in (tmp_path / f"log{i}").read_text()


def test_serve_refuses_bad_sampling_flags_in_one_line(tmp_path):
    env = {**os.environ, "STRATA_API_KEY": ""}
    for flags, said in ((("-n", "0"), "-n/--n-predict"), (("--temp", "-1"), "temperature"),
                        (("--top-p", "0"), "top_p")):
        r = subprocess.run([sys.executable, "-m", "strata", "serve", "--port", str(free_port()), *flags],
                           env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and said in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_timeout_that_is_not_positive_is_refused(capsys, tmp_path):
    from strata.cli import main

    for value in ("0", "-5", "nan"):
        assert main(["serve", "--timeout", value, "-m", str(tmp_path / "missing.gguf")]) == 1
        err = capsys.readouterr().err
        assert err == f"strata: error: --timeout must be a number of seconds > 0 (got {float(value)})\n", err
