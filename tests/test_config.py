"""config.py: flags generated from the dataclasses (written once), the environment read in one place."""

import argparse
import re
from dataclasses import fields
from pathlib import Path

import pytest

from strata import StrataError
from strata.config import (EngineConfig, ExpertConfig, add_flags, cache_dir, env_number, from_flags,
                           models_dir)

ROOT = Path(__file__).resolve().parents[1]


def _parser():
    from strata.engine.cli import add_engine_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p


def test_flags_carry_the_dataclass_defaults_and_choices():
    p = _parser()
    args = p.parse_args([])
    cfg = from_flags(EngineConfig, args, experts=from_flags(ExpertConfig, args))
    assert cfg == EngineConfig(device=cfg.device)  # every default comes through unchanged
    actions = {a.dest: a for a in p._actions}
    for cls in (EngineConfig, ExpertConfig):
        for f in fields(cls):
            cli = f.metadata.get("cli")
            if cli and cli["choices"]:
                assert tuple(actions[cli["dest"] or f.name].choices) == cli["choices"]


def test_flags_round_trip_and_one_error_for_a_bad_choice():
    p = _parser()
    args = p.parse_args(["--experts", "tiered", "--vram-gb", "6.5", "--no-cpu-plan-tune", "--expert-slots", "3",
                         "-c", "512", "--cache-policy", "lru", "--low-ram"])
    ex = from_flags(ExpertConfig, args)
    assert (ex.mode, ex.vram_gb, ex.plan_tune, ex.slots, ex.cache_policy, ex.low_ram) == \
        ("tiered", 6.5, False, 3, "lru", True)
    assert from_flags(EngineConfig, args, experts=ex).ctx_size == 512
    with pytest.raises(SystemExit):
        p.parse_args(["--cache-policy", "fifo"])
    with pytest.raises(StrataError, match="--cache-policy must be one of lfu-decay, lru"):
        ExpertConfig(cache_policy="fifo").validate()


def test_add_flags_on_a_new_dataclass():
    """A field with opt(...) metadata becomes a flag with its type; one without stays out."""
    from dataclasses import dataclass, field

    from strata.config import opt

    @dataclass
    class Knobs:
        rate: float = field(default=0.5, metadata=opt("a rate"))
        on: bool = field(default=False, metadata=opt("a switch"))
        hidden: int = 3

    p = argparse.ArgumentParser()
    add_flags(p, Knobs)
    a = p.parse_args(["--rate", "2", "--on"])
    assert from_flags(Knobs, a) == Knobs(rate=2.0, on=True, hidden=3)
    assert not hasattr(a, "hidden")


def test_one_cache_root(monkeypatch, tmp_path):
    monkeypatch.delenv("STRATA_MODELS_DIR", raising=False)
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path / "s"))
    assert cache_dir() == tmp_path / "s" and models_dir() == tmp_path / "s" / "models"
    monkeypatch.delenv("STRATA_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cache_dir() == tmp_path / "x" / "strata"
    monkeypatch.setenv("STRATA_MODELS_DIR", str(tmp_path / "m"))
    assert models_dir() == tmp_path / "m"


def test_a_bad_number_in_the_environment_names_the_variable(monkeypatch):
    monkeypatch.setenv("STRATA_CHUNK_RING", "four")
    with pytest.raises(StrataError, match="STRATA_CHUNK_RING='four'"):
        env_number("STRATA_CHUNK_RING", int)
    monkeypatch.delenv("STRATA_CHUNK_RING")
    assert env_number("STRATA_CHUNK_RING", int) is None


def test_the_environment_is_read_in_config_only():
    """No module but config.py reads the environment (strata/__init__.py sets the OpenMP spin count before torch
    loads, which must happen before config.py, which imports torch, can run)."""
    allowed = {ROOT / "strata" / "config.py", ROOT / "strata" / "__init__.py"}
    bad = []
    for path in (ROOT / "strata").rglob("*.py"):
        if path in allowed:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if re.search(r"os\.environ\.get|os\.getenv|\bgetenv\(|environ\[", code) or \
                    re.search(r"\benv\(\s*[\"']", code):
                bad.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not bad, "\n".join(bad)


def test_no_module_of_strata_past_500_lines():
    """Files past ~500 lines want splitting (one family per file, small executors, a thin server)."""
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "strata").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 500}
    assert not long, long


def test_device_is_cpu_or_cuda():
    """--device takes what strata runs on; anything else is one line naming the value, before torch sees it."""
    EngineConfig(device="cpu").validate()
    for bad in ("tpu", "", "xla", "mps", "meta", "cuda:abc", "cuda:", "CPU", "cpu:0", " cpu"):
        with pytest.raises(StrataError) as e:
            EngineConfig(device=bad).validate()
        assert str(e.value) == f"--device {bad!r}: want cpu or cuda[:N]"
    import torch

    n = torch.cuda.device_count()
    with pytest.raises(StrataError, match=f"device cuda:{n} requested but"):  # one past the last GPU, or none
        EngineConfig(device=f"cuda:{n}").validate()


@pytest.mark.parametrize("experts, flag", [
    (dict(cpu_threads=-2), "--cpu-threads"), (dict(swap_budget=-1), "--swap-budget"),
    (dict(vram_reserve_mib=-1), "--vram-reserve-mib"), (dict(promote_min=-0.5), "--promote-min"),
    (dict(slots=-1), "--expert-slots"), (dict(prefetch_programs=-1), "--expert-prefetch-programs")])
def test_negative_expert_settings_are_refused(experts, flag):
    """Counts that cannot be negative fail in validate, on any device (the CPU lane's threads were checked only
    where a GPU builds the lane); their zeros keep their meanings."""
    with pytest.raises(StrataError, match=f"^{flag} must be >= 0, got -"):
        EngineConfig(device="cpu", experts=ExpertConfig(**experts)).validate()
    EngineConfig(device="cpu", experts=ExpertConfig(**{k: 0 for k in experts})).validate()


def test_negative_engine_settings_are_refused():
    for kw, needle in [(dict(ctx_size=-1), "--ctx-size must be >= 0, got -1"),
                       (dict(prefill_chunk=-4), "--prefill-chunk must be >= 0, got -4"),
                       (dict(draft_p_min=-0.1), "--draft-p-min must be >= 0"),
                       (dict(draft_p_min=1.5), "--draft-p-min is a probability"),
                       (dict(n_slots=0), "--parallel must be >= 1")]:
        with pytest.raises(StrataError, match=re.escape(needle)):
            EngineConfig(device="cpu", **kw).validate()


def test_gpu_only_flags_are_the_ones_typed_away_from_their_defaults():
    """gpu_only_flags: the flags marked opt(gpu=True) that the command line moved from their defaults, as typed;
    defaults and auto are never named."""
    from strata.config import gpu_only_flags

    def named(*argv):
        args = _parser().parse_args(list(argv))
        return gpu_only_flags(from_flags(EngineConfig, args, experts=from_flags(ExpertConfig, args)))

    assert named() == []
    assert named("--decode-misses", "auto", "--kv-vram-tokens", "auto", "--prefill-loan", "auto") == []
    assert named("--vram-gb", "4", "--chunk-buffer-loan", "on", "--cpu-threads", "2") == []  # (these act on a CPU)
    assert named("--cuda-graphs", "--decode-misses", "staged", "--kv-vram-tokens", "64") == [
        "--kv-vram-tokens 64", "--cuda-graphs", "--decode-misses staged"]
    assert named("--no-decode-ahead", "--no-expert-prefetch", "--expert-prefetch-programs", "8") == [
        "--no-decode-ahead", "--no-expert-prefetch", "--expert-prefetch-programs 8"]
