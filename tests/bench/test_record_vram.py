"""The VRAM poller of `strata bench` (strata.bench.record.VramPeak): NVML opened once for the whole block (not per
reading: each nvmlInit is driver work beside the servers being timed), and without NVML nvidia-smi started at most
once a second. The CPU machine has neither, so the library is stood in by a module with NVML's calls."""

from __future__ import annotations

import sys
import time
import types

from strata.bench import record


def _fake_nvml(used: list[int], calls: dict):
    m = types.ModuleType("pynvml")

    def count(name):
        def f(*a):
            calls[name] = calls.get(name, 0) + 1
        return f

    m.nvmlInit = count("init")
    m.nvmlShutdown = count("shutdown")
    m.nvmlDeviceGetCount = lambda: 1
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    def info(h):
        calls["reads"] = calls.get("reads", 0) + 1
        return types.SimpleNamespace(used=used[min(calls["reads"] - 1, len(used) - 1)])

    m.nvmlDeviceGetMemoryInfo = info
    return m


def test_nvml_is_opened_once_and_the_peak_is_kept(monkeypatch):
    calls: dict = {}
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml([100, 300, 900, 200], calls))
    with record.VramPeak(interval=0.01) as p:
        time.sleep(0.2)
    assert calls["init"] == 1 and calls["shutdown"] == 1 and calls["reads"] >= 4
    assert p.baseline == 100 and p.peak == 800


def test_without_nvml_nvidia_smi_runs_at_most_once_a_second(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    n = {"smi": 0}

    def smi():
        n["smi"] += 1
        return 5 << 30

    monkeypatch.setattr(record, "gpu_memory_used", smi)
    monkeypatch.setattr(record, "SMI_INTERVAL", 0.2)
    with record.VramPeak(interval=0.01) as p:
        time.sleep(0.5)
    assert 2 <= n["smi"] <= 4 and p.peak == 0  # the baseline and a reading every 0.2 s, not every 0.01 s
