"""What one decode step launches (`strata generate --profile`): a few decode steps of a fresh sequence under
torch.profiler, counted per step and per layer, with the busiest kernels.

On a GPU it counts the device's kernels (inside replayed CUDA graphs too) and their time; on the CPU, where there
are no kernels, the top-level torch operators the step ran (an operator's own nested calls are not counted again).
The per-layer figure divides by the model's blocks: what a layer costs in launches, the number the decode step's
fusions (route, add + RMSNorm, combine, fused q/k/v) bring down.
"""

from __future__ import annotations

import json
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

TOP = 6  # kernels listed by time


def decode_census(engine, prompt: list[int], steps: int = 8) -> dict:
    """Decode `steps` tokens after `prompt` (greedy, after a few untraced steps: graphs captured, the window
    settled) under torch.profiler; returns {"steps", "layers", "device", "launches", "per_step", "per_layer",
    "busy_ms_per_step" (GPU only), "top": [(name, count per step, ms per step)]}. The sequence is dropped after
    (nothing of it stays in a slot's record)."""
    from torch.profiler import ProfilerActivity, profile

    from strata.engine.engine import Sequence
    from strata.engine.sampler import SamplingParams

    if steps < 1:
        raise ValueError("the census needs at least one decode step")
    cuda = engine.device.type == "cuda"
    seq = Sequence(list(prompt), SamplingParams(temperature=0), steps + 4, set())
    engine.add(seq, reuse_prefix=False)
    try:
        while len(seq.output) < 3 and not seq.finished:
            engine.step()
        _sync(engine.device)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        done = 0
        with profile(activities=acts) as prof:
            while done < steps and not seq.finished:
                engine.step()
                done += 1
            _sync(engine.device)
    finally:
        engine.release(seq, "abort")
    if done == 0:
        raise ValueError("the sequence ended before a decode step could be traced")
    counts, ms = (_kernels(prof) if cuda else _operators(prof))
    layers = max(1, len(getattr(engine.model, "blocks", ())) or 1)
    total = sum(counts.values())
    top = sorted(counts, key=lambda k: (-ms[k], -counts[k]))[:TOP]
    out = {"steps": done, "layers": layers, "device": "cuda" if cuda else "cpu",
           "launches": "kernels" if cuda else "operators", "per_step": round(total / done, 1),
           "per_layer": round(total / done / layers, 1),
           "top": [(k, round(counts[k] / done, 1), round(ms[k] / done, 3)) for k in top]}
    if cuda:
        out["busy_ms_per_step"] = round(sum(ms.values()) / done, 3)
    return out


def render(c: dict) -> str:
    """The census as a few lines for stderr."""
    busy = f", {c['busy_ms_per_step']:.2f} ms of kernel time" if "busy_ms_per_step" in c else ""
    lines = [f"strata: a decode step ({c['device']}, {c['steps']} traced): {c['per_step']:g} {c['launches']} "
             f"({c['per_layer']:g} per layer of {c['layers']}){busy}"]
    for name, n, t in c["top"]:
        lines.append(f"strata:   {n:>6g} x  {t:8.3f} ms  {name[:90]}")
    return "\n".join(lines)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _kernels(prof) -> tuple[dict, dict]:
    """The device kernels of the trace (Chrome trace events of category "kernel": replayed graphs' included)."""
    counts: dict[str, int] = defaultdict(int)
    ms: dict[str, float] = defaultdict(float)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "census.json"
        prof.export_chrome_trace(str(path))
        data = json.loads(path.read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    for ev in events:
        if ev.get("ph") == "X" and ev.get("cat") == "kernel":
            counts[ev["name"]] += 1
            ms[ev["name"]] += float(ev.get("dur", 0.0)) / 1e3
    return counts, ms


def _operators(prof) -> tuple[dict, dict]:
    """Top-level torch operators (an aten:: call not made by another aten:: call) and their host time."""
    counts: dict[str, int] = defaultdict(int)
    ms: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        if not ev.name.startswith("aten::"):
            continue
        parent = ev.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if parent is not None:
            continue
        counts[ev.name] += 1
        ms[ev.name] += ev.cpu_time_total / 1e3
    return counts, ms
