"""`strata generate`: only the generated text on stdout, statistics on stderr, same seed -> same text."""

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
    ]:
        prompt = ["-p", "x"] if cmd == "generate" else []
        r = subprocess.run([sys.executable, "-m", "strata", cmd, *prompt, "--device", "cpu", *flags],
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
