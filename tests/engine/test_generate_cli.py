"""`strata generate`: only the generated text on stdout, statistics on stderr, same seed -> same text."""

import re
import subprocess
import sys


def gen(path, *extra):
    cmd = [sys.executable, "-m", "strata", "generate", "-m", str(path), "--device", "cpu", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_generate_streams_only_text(hf_and_gguf):
    from strata.config import EngineConfig
    from strata.engine.engine import Engine
    from strata.engine.loader import load_model
    from strata.engine.sampler import SamplingParams

    _, path = hf_and_gguf("qwen3moe")
    r = gen(path, "-p", "def hello():", "-n", "12", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    assert "tok/s" in r.stderr and "tok/s" not in r.stdout
    # stdout is exactly the decoded greedy continuation (+ a final newline)
    lm = load_model(str(path), EngineConfig(device="cpu", dtype="float32"))
    ids = lm.tokenizer.encode("def hello():")
    toks = list(Engine(lm).generate(ids, SamplingParams(temperature=0), 12, stop_ids=lm.tokenizer.eot_ids))
    toks = [t for t in toks if t not in lm.tokenizer.eot_ids]
    assert r.stdout == lm.tokenizer.decode(toks) + "\n"


def test_same_seed_same_text(hf_and_gguf):
    _, path = hf_and_gguf("qwen3moe")
    a = gen(path, "-p", "x = ", "-n", "16", "--temperature", "1.0", "--seed", "42")
    b = gen(path, "-p", "x = ", "-n", "16", "--temperature", "1.0", "--seed", "42")
    c = gen(path, "-p", "x = ", "-n", "16", "--temperature", "1.0", "--seed", "43")
    assert a.returncode == 0 and a.stdout == b.stdout
    assert a.stdout != c.stdout


def test_chat_flag_uses_template(hf_and_gguf):
    _, path = hf_and_gguf("qwen3moe")
    r = gen(path, "-p", "hi", "-n", "4", "--chat", "--temperature", "0")
    assert r.returncode == 0, r.stderr


def test_generate_with_drafts_prints_the_same_text(hf_and_gguf):
    """`--draft-max` through the CLI: the same greedy text on stdout, the drafts' count on stderr."""
    _, path = hf_and_gguf("qwen3moe")
    prompt = "x = 1\ny = 2\nz = 3\n" * 8
    plain = gen(path, "-p", prompt, "-n", "24", "--temperature", "0")
    drafted = gen(path, "-p", prompt, "-n", "24", "--temperature", "0", "--draft-max", "6")
    assert plain.returncode == 0 and drafted.returncode == 0, drafted.stderr
    assert drafted.stdout == plain.stdout
    assert "drafts accepted" in drafted.stderr and "drafts accepted" not in plain.stderr
    bad = gen(path, "-p", "x", "--draft-max", "4", "--draft-ngram-min", "3", "--draft-ngram-max", "2")
    assert bad.returncode != 0 and "--draft-ngram-min" in bad.stderr and "Traceback" not in bad.stderr


def test_bad_settings_fail_before_the_model_loads():
    """One line naming the problem, non-zero exit, no traceback, and the model never loaded (no 'loading')."""
    for cmd, flags, needle in [
        ("generate", ["-n", "0"], "--n-predict"),
        ("generate", ["-n", "-5"], "--n-predict"),
        ("chat", ["-n", "0"], "--n-predict"),
        ("generate", ["--temperature", "-1"], "temperature"),
        ("generate", ["--temperature", "nan"], "temperature"),
        ("generate", ["--top-p", "0"], "top_p"),
        ("generate", ["--repeat-penalty", "0"], "repetition_penalty"),
        # flags that contradict the others: what they ask for would silently not happen
        ("generate", ["--draft-source", "mtp"], "without --draft-max N"),
        ("chat", ["--draft-source", "ngram"], "without --draft-max N"),
        ("generate", ["--layer-split", "3,5"], "pass -pp N"),
        ("check", ["-m", "x.gguf", "--layer-split", "3,5"], "pass -pp N"),
    ]:
        prompt = ["-p", "x"] if cmd == "generate" else []
        device = [] if cmd == "check" else ["--device", "cpu"]
        r = subprocess.run([sys.executable, "-m", "strata", cmd, *prompt, *device, *flags],
                           capture_output=True, text=True, timeout=120, input="")
        assert r.returncode != 0, (cmd, flags)
        assert needle in r.stderr and "Traceback" not in r.stderr, (flags, r.stderr)
        assert "loading" not in r.stderr, (flags, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_generate_and_chat_leave_the_plan_trials_to_the_server_and_calibrate():
    """The plan trials (all-CPU plans among them) run over the first decode steps; in generate and chat those are
    the user's own tokens, so there they are off unless asked for. The server keeps them for its warm-up."""
    from strata.cli import build_parser
    from strata.engine.cli import engine_config

    p = build_parser()
    for cmd in ("generate", "chat"):
        assert engine_config(p.parse_args([cmd])).experts.plan_tune is False
        assert engine_config(p.parse_args([cmd, "--cpu-plan-tune"])).experts.plan_tune is True
    assert engine_config(p.parse_args(["serve"])).experts.plan_tune is True


def test_bad_engine_flags_are_one_line_before_the_model_loads():
    """--device other than cpu / cuda[:N], and negative counts, are named in one line before anything loads
    (torch's own words for a device came as a traceback, or only once the native kernel met a meta tensor)."""
    for flags, needle in [
        (["--device", "tpu"], "--device 'tpu': want cpu or cuda[:N]"),
        (["--device", ""], "--device '': want cpu or cuda[:N]"),
        (["--device", "xla"], "--device 'xla': want cpu or cuda[:N]"),
        (["--device", "mps"], "--device 'mps': want cpu or cuda[:N]"),
        (["--device", "meta"], "--device 'meta': want cpu or cuda[:N]"),
        (["--device", "cuda:abc"], "--device 'cuda:abc': want cpu or cuda[:N]"),
        (["--device", "cpu", "--cpu-threads", "-2"], "--cpu-threads must be >= 0, got -2"),
        (["--device", "cpu", "--swap-budget", "-1"], "--swap-budget must be >= 0, got -1"),
        (["--device", "cpu", "--promote-min", "-1"], "--promote-min must be >= 0"),
        (["--device", "cpu", "-c", "-1"], "--ctx-size must be >= 0, got -1"),
    ]:
        r = subprocess.run([sys.executable, "-m", "strata", "generate", "-p", "x", *flags],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode != 0, flags
        assert needle in r.stderr and "Traceback" not in r.stderr, (flags, r.stderr)
        assert "loading" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, (flags, r.stderr)


def test_serve_names_a_bad_engine_flag_once_before_listening():
    """strata serve checks the engine's flags before it binds and says "listening" (they were checked only in the
    model's background load, and the error came twice, after the claim)."""
    r = subprocess.run([sys.executable, "-m", "strata", "serve", "--port", "18977", "--device", "tpu"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert r.stderr.strip().splitlines() == ["strata: error: --device 'tpu': want cpu or cuda[:N]"], r.stderr
    r = subprocess.run([sys.executable, "-m", "strata", "serve", "--port", "18977", "--threads", "-1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert r.stderr.strip().splitlines() == ["strata: error: --threads must be >= 0, got -1"], r.stderr


# bytes that are not UTF-8: Python hands them on as lone surrogates (argv always; stdin under surrogateescape)
BAD_UTF8 = b"abc\xff\xfe def"


def _env(stdin_errors: str) -> dict:
    import os

    # the locale fixed (a machine's own may be anything), stdin's error handler as each kind of machine has it
    return {**os.environ, "LC_ALL": "C.UTF-8", "PYTHONIOENCODING": f"utf-8:{stdin_errors}"}


def test_a_prompt_of_invalid_utf8_on_the_command_line_generates():
    cmd = [sys.executable.encode(), b"-m", b"strata", b"generate", b"--device", b"cpu", b"-n", b"3",
           b"--temperature", b"0", b"-p", BAD_UTF8]
    r = subprocess.run(cmd, capture_output=True, timeout=300, env=_env("strict"))
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 0 and "Traceback" not in err, err
    assert r.stdout.strip() and "generated 3 tokens" in err


def test_a_prompt_of_invalid_utf8_on_stdin_generates():
    for errors in ("strict", "surrogateescape"):
        r = subprocess.run([sys.executable, "-m", "strata", "generate", "--device", "cpu", "-n", "3", "--temperature",
                            "0"],
                           input=BAD_UTF8, capture_output=True, timeout=300, env=_env(errors))
        err = r.stderr.decode("utf-8", "replace")
        assert r.returncode == 0 and "Traceback" not in err, (errors, err)
        assert r.stdout.strip() and "generated 3 tokens" in err


def test_the_default_length_stops_at_the_context_and_an_asked_one_is_checked():
    """Without -n, generate writes up to its default, fewer where the context (-c) ends sooner; an -n that does not
    fit is one clear line."""
    base = [sys.executable, "-m", "strata", "generate", "--device", "cpu", "-c", "64", "--temperature", "0",
            "-p", "The capital of France is"]
    r = subprocess.run(base, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    m = re.search(r"prompt (\d+) tokens .* generated (\d+) tokens", r.stderr)
    assert m and int(m.group(1)) + int(m.group(2)) <= 64, r.stderr
    r = subprocess.run(base + ["-n", "128"], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert re.search(r"the prompt of \d+ tokens \+ -n 128 exceeds the context of 64 tokens \(-c sets it\)",
                     r.stderr) and "max_tokens" not in r.stderr, r.stderr  # (-n's words, not an API's)
    r = subprocess.run(base[:6] + ["-c", "2"] + base[8:], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "the prompt of " in r.stderr and "exceeds the context of 2 tokens" in r.stderr


def test_gpu_only_flags_on_a_cpu_are_named_in_one_warning():
    """GPU-only flags stay accepted on a CPU (the CPU tests run the GPU paths' code eagerly through them), with one
    line naming those typed; none without them, nor for a value of auto."""
    from strata.models.default import default_model_path

    tiny = str(default_model_path())
    r = gen(tiny, "-p", "x", "-n", "2", "--cuda-graphs", "--decode-misses", "staged", "--kv-vram-tokens", "1024",
            "--no-decode-ahead")
    assert r.returncode == 0, r.stderr
    said = [ln for ln in r.stderr.splitlines() if "no effect on the CPU" in ln]
    assert said == ["strata: --kv-vram-tokens 1024, --cuda-graphs, --no-decode-ahead, --decode-misses staged: GPU "
                    "settings, no effect on the CPU (at most their GPU code paths run eagerly)"], r.stderr
    for extra in ([], ["--decode-misses", "auto", "--kv-vram-tokens", "auto"]):
        r = gen(tiny, "-p", "x", "-n", "2", *extra)
        assert r.returncode == 0 and "no effect on the CPU" not in r.stderr, r.stderr
        assert "--vram-gb on the CPU" not in r.stderr
    # a budget does act on a CPU (the tiers run in RAM as under it: how plans are tried without a GPU), and is said
    r = gen(tiny, "-p", "x", "-n", "2", "--vram-gb", "8")
    assert r.returncode == 0 and "--vram-gb on the CPU: the experts run tiered in RAM" in r.stderr, r.stderr


def test_generate_says_when_the_context_ends_the_text():
    base = [sys.executable, "-m", "strata", "generate", "--device", "cpu", "--temperature", "0", "-p", "def fib(n):"]
    r = subprocess.run(base + ["-c", "16"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "stopped at the end of the context (16 tokens" in r.stderr, r.stderr
    r = subprocess.run(base + ["-n", "4"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "end of the context" not in r.stderr, r.stderr


def test_a_reader_that_leaves_the_pipe_ends_it_quietly():
    """`strata generate | head -c 5`: the reader gone, the command stops with the shell's status for a closed pipe
    and no traceback (BrokenPipeError came out of the stream, then again at exit)."""
    p = subprocess.Popen([sys.executable, "-m", "strata", "generate", "--device", "cpu", "-p", "def fib(n):", "-n",
                          "64"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # before the first token: its write finds no reader
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == 141, err
    assert "Traceback" not in err and "Broken pipe" not in err and "Exception ignored" not in err, err


def test_text_the_terminal_cannot_encode_is_replaced_not_a_traceback():
    """A non-UTF-8 terminal (PYTHONIOENCODING=ascii stands for a latin-1 locale): the embedded model echoes the
    prompt's accented letters, which print as '?', and the run ends normally; chat alike."""
    import os

    env = {**os.environ, "PYTHONIOENCODING": "ascii"}
    prompt = "# " + " ".join(["\u00fcn\u00efc\u00f6d\u00e9"] * 7)
    run = ["-m", "strata", "--device", "cpu", "-n", "16", "--temperature", "0"]
    g = subprocess.run([sys.executable, *run[:2], "generate", *run[2:], "-p", prompt], capture_output=True,
                       text=True, encoding="utf-8", timeout=300, env=env)
    assert g.returncode == 0 and "Traceback" not in g.stderr, g.stderr
    assert "?" in g.stdout  # (the letters the model wrote, as the terminal can show them)
    c = subprocess.run([sys.executable, *run[:2], "chat", *run[2:]], input=prompt + "\n", capture_output=True,
                       text=True, encoding="utf-8", timeout=300, env=env)
    assert c.returncode == 0 and "Traceback" not in c.stderr, c.stderr


def test_generate_without_a_prompt_on_a_terminal_says_it_reads_one():
    """No -p, stdin a terminal: the command says it waits for the prompt (and how to end it), then takes it."""
    import os
    import pty

    master, slave = pty.openpty()
    p = subprocess.Popen([sys.executable, "-m", "strata", "generate", "--device", "cpu", "-n", "4", "--temperature",
                          "0"], stdin=slave, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    os.close(slave)
    try:
        os.write(master, b"def add(a, b):\n\x04")  # a line, then Ctrl-D at the start of the next
        out, err = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
        os.close(master)
    assert p.returncode == 0 and "Traceback" not in err, err
    assert "reading the prompt from the terminal: end it with Ctrl-D" in err and out.strip()


def test_more_pipeline_stages_than_layers_fail_before_any_stage_starts():
    """-pp past the model's layers (strata-tiny has 8): one line, before a process is spawned for each stage."""
    r = subprocess.run([sys.executable, "-m", "strata", "generate", "--device", "cpu", "-pp", "9", "-p", "x"],
                       capture_output=True, text=True, timeout=120)
    said = [ln for ln in r.stderr.splitlines() if "error" in ln.lower()]
    assert r.returncode == 1 and said == ["strata: error: --pipeline-parallel-size 9 exceeds the model's 8 layers"], \
        r.stderr
