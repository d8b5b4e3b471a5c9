"""Per-expert costs measured on this machine: what `--cpu-plan auto` and the prefill split decide from.

- `measure_cpu_expert_ms(weights, threads)`: one token through one expert on the CPU lane, weights read from
  RAM (the experts sampled cycle through more bytes than the last-level cache holds).
- `measure_pcie_expert_ms(weights)`: one expert's bytes host -> device (pinned, async); on a CPU-only
  machine the copy into the host slot pool.
- `measure_gpu_expert_ms(weights)`: one token through one expert from device slots (grouped call on CUDA).
- `cost_model_for(backend)`: those three (and per-further-token costs for prefill) as a CostModel, cached per
  machine and expert shape in the user's cache directory (`strata calibrate` will re-measure).
- `cpu_bandwidth(weights, threads)`: GB/s of the CPU lane (packed bytes read per second), for reports.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from strata.config import cache_dir, env  # noqa: F401 - cache_dir: where callers found it before
from strata.experts.cpu_lane import CpuLane
from strata.experts.plan import CostModel
from strata.experts.resident import ExpertWeights, expert_ffn
from strata.quant import QTensor

log = logging.getLogger("strata")

DECODE_GAP_MS = 0.2  # the lane's idle time between a decode step's calls (a layer's GPU work)
SAMPLE_EXPERTS = 32  # experts cycled through per measurement (more bytes than a last-level cache)


def machine_id(device: torch.device) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return f"{cpu} x{os.cpu_count()} | {gpu} | torch {torch.__version__}"


def model_id(ew: ExpertWeights, dtype: torch.dtype, threads: int, kernel: str) -> str:
    shapes = "/".join(f"{t.qtype.name}{list(t.shape[1:])}" for t in (ew.gate, ew.up, ew.down))
    return f"{shapes} {str(dtype).replace('torch.', '')} threads={threads} kernel={kernel}"


def _sample(ew: ExpertWeights, n: int | None = None) -> list[int]:
    return list(range(min(ew.n_experts, n or SAMPLE_EXPERTS)))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_passes(fn, passes: int, device: torch.device = torch.device("cpu")) -> float:
    """Median seconds of fn() over `passes` timed runs, after one warm-up."""
    fn()
    _sync(device)
    times = []
    for _ in range(passes):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_cpu_expert_ms(weights: ExpertWeights, threads: int = 0, *, dtype: torch.dtype = torch.bfloat16,
                          kernel: str = "auto", tokens: int = 1, lane: CpuLane | None = None, layer: int = 0,
                          passes: int = 3, n_experts: int | None = None, gap_ms: float = 0.0) -> float:
    """ms for `tokens` tokens through one expert on the CPU lane (its kernel for `dtype`), weights from RAM.

    gap_ms > 0: as in decode, each call comes after the lane idled that long (the GPU's share of a layer), so
    the cost includes waking the thread pool; the median call is returned."""
    before = torch.get_num_threads()
    if lane is None:
        lane, layer = CpuLane({0: weights}, threads, kernel, dtype), 0
    elif threads:
        torch.set_num_threads(threads)
    try:
        experts = _sample(weights, n_experts)
        x = torch.randn(tokens, weights.gate.shape[-1]).to(dtype)

        if gap_ms > 0:
            lane.expert(layer, experts[0], x)
            times = []
            for _ in range(passes):
                for e in experts:
                    until = time.perf_counter() + gap_ms * 1e-3
                    while time.perf_counter() < until:  # idle lane, busy host thread: as in a decode step
                        pass
                    t0 = time.perf_counter()
                    lane.expert(layer, e, x)
                    times.append(time.perf_counter() - t0)
            return statistics.median(times) * 1e3

        def run():
            for e in experts:
                lane.expert(layer, e, x)

        return _time_passes(run, passes) / len(experts) * 1e3
    finally:
        torch.set_num_threads(before)


def cpu_bandwidth(weights: ExpertWeights, threads: int = 0, *, dtype: torch.dtype = torch.bfloat16,
                  kernel: str = "auto", passes: int = 3, n_experts: int | None = None) -> tuple[float, float, str]:
    """(ms per expert, GB/s of the bytes the kernel reads, kernel) for one token on the CPU lane."""
    lane = CpuLane({0: weights}, threads, kernel, dtype)
    before = torch.get_num_threads()
    ms = measure_cpu_expert_ms(weights, threads, dtype=dtype, lane=lane, passes=passes, n_experts=n_experts)
    torch.set_num_threads(before)
    kind = lane.kernel[0]
    nbytes = lane.nbytes() / max(len(lane._int4[0]), 1) if kind == "int4" else weights.expert_nbytes()
    return ms, nbytes / (ms * 1e-3) / 1e9, kind


def measure_pcie_expert_ms(weights: ExpertWeights, device: torch.device | str | None = None,
                           passes: int = 3, n_experts: int | None = None) -> float:
    """ms to copy one expert's stored bytes host -> device (pinned source on CUDA)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    experts = _sample(weights, n_experts)
    ts = (weights.gate, weights.up, weights.down)
    if device.type == "cuda":
        src = [[t.raw[e].pin_memory() if not t.raw.is_pinned() else t.raw[e] for t in ts] for e in experts]
    else:
        src = [[t.raw[e] for t in ts] for e in experts]
    dst = [torch.empty_like(s, device=device) for s in src[0]]

    def run():
        for parts in src:
            for d, s in zip(dst, parts):
                d.copy_(s, non_blocking=True)

    return _time_passes(run, passes, device) / len(experts) * 1e3


def measure_gpu_expert_ms(weights: ExpertWeights, device: torch.device | str | None = None, *,
                          dtype: torch.dtype | None = None, tokens: int = 1, k: int = 8, passes: int = 3) -> float:
    """ms for `tokens` tokens through one expert held in device slots (the grouped call for decode on CUDA)."""
    from strata.ops.expert_gather import gather_expert_ffn

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    n = min(weights.n_experts, max(k, 1))
    pool = [QTensor(t.raw[:n].to(device), t.qtype, (n, *t.shape[1:])) for t in (weights.gate, weights.up, weights.down)]
    d = weights.gate.shape[-1]
    if device.type == "cuda" and tokens == 1:
        x = torch.randn(n, d, device=device).to(dtype)
        slots = torch.arange(n, device=device)
        return _time_passes(lambda: gather_expert_ffn(x, *pool, slots), passes, device) / n * 1e3
    x = torch.randn(tokens, d, device=device).to(dtype)

    def run():
        for e in range(n):
            expert_ffn(x, pool[0][e], pool[1][e], pool[2][e])

    return _time_passes(run, passes, device) / n * 1e3


def measure_gpu_pair_ms(weights: ExpertWeights, device: torch.device | str, *, dtype: torch.dtype = torch.bfloat16,
                        tokens: int = 512, n: int = 8, passes: int = 3) -> float:
    """ms per (token, expert) pair of a prefill chunk on the GPU: the grouped FFN (the chunk path's call) over
    n experts in device slots with `tokens` tokens each."""
    from strata.ops.moe_prefill import grouped_expert_ffn

    device = torch.device(device)
    n = min(weights.n_experts, n)
    pool = [QTensor(t.raw[:n].to(device), t.qtype, (n, *t.shape[1:])) for t in (weights.gate, weights.up, weights.down)]
    x = torch.randn(tokens, weights.gate.shape[-1], device=device).to(dtype)
    ids = torch.arange(n, device=device).expand(tokens, n).contiguous()  # every token through all n experts
    counts = [tokens] * n
    return _time_passes(lambda: grouped_expert_ffn(x, *pool, ids, counts=counts), passes, device) / (tokens * n) * 1e3


def _handoff_ms(device: torch.device) -> float:
    """One GPU -> CPU -> GPU round trip of a token's activations (the CPU lane's per-layer hand-off)."""
    if device.type != "cuda":
        return 0.0
    x = torch.randn(1, 4096, device=device)
    buf = torch.empty_like(x, device="cpu").pin_memory()

    def run():
        buf.copy_(x, non_blocking=True)
        torch.cuda.current_stream(device).synchronize()
        x.copy_(buf, non_blocking=True)

    return _time_passes(run, 20, device) * 1e3


def measure_cost_model(weights: ExpertWeights, device: torch.device, dtype: torch.dtype, threads: int = 0,
                       lane: CpuLane | None = None, layer: int = 0) -> CostModel:
    # one token's expert as decode calls it: after the lane idled for the rest of the layer
    cpu1 = measure_cpu_expert_ms(weights, threads, dtype=dtype, lane=lane, layer=layer, gap_ms=DECODE_GAP_MS)
    cpu1_hot = measure_cpu_expert_ms(weights, threads, dtype=dtype, lane=lane, layer=layer, passes=1)
    cpu8 = measure_cpu_expert_ms(weights, threads, dtype=dtype, lane=lane, layer=layer, tokens=8, passes=1)
    gpu1 = measure_gpu_expert_ms(weights, device, dtype=dtype)
    if device.type == "cuda":  # a chunk's further tokens cost what the grouped call spends per pair
        gpu_pair = measure_gpu_pair_ms(weights, device, dtype=dtype)
    else:  # the CPU-only "GPU" computes chunks per expert
        gpu_pair = (measure_gpu_expert_ms(weights, device, dtype=dtype, tokens=8, passes=1) - gpu1) / 7
    return CostModel(
        cpu_ms_per_expert=cpu1,
        pcie_ms_per_expert=measure_pcie_expert_ms(weights, device),
        gpu_ms_per_expert=gpu1,
        cpu_ms_per_token_expert=max((cpu8 - cpu1_hot) / 7, 0.0),
        gpu_ms_per_token_expert=max(gpu_pair, 0.0),
        cpu_overhead_ms=_handoff_ms(device),
    )


def _cost_key(backend) -> tuple[str, str, Path]:
    """(machine, expert shape and lane, the cost model's cache file) of a backend."""
    layer = backend.layer_ids[0]
    ew = backend.store[layer]
    lane = backend.lane
    threads = lane.threads if lane is not None else torch.get_num_threads()
    kernel = lane.kernel[layer] if lane is not None else "none"
    machine, model = machine_id(backend.device), model_id(ew, backend.dtype, threads, kernel)
    path = cache_dir() / "costs" / (hashlib.sha256(f"{machine}\n{model}".encode()).hexdigest()[:24] + ".json")
    return machine, model, path


def save_verdict(backend, path: str, plan: str, why: str) -> Path | None:
    """Keep what the plan tuner's trials found on this machine for this expert shape (`path`: "staged" or
    "handoff", the plan kept, why), beside the cost model: later loads take it instead of trying plans again
    (delete the file to try them again). Returns the file, None if it could not be written."""
    machine, model, cm_path = _cost_key(backend)
    out = cm_path.with_suffix(".verdict.json")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"machine": machine, "model": model, "path": path, "plan": plan, "why": why},
                                  indent=1))
    except OSError as e:
        log.warning("strata: could not keep the plan trials' verdict in %s: %s", out, e)
        return None
    return out


def load_verdict(backend) -> dict | None:
    """The saved verdict of the plan tuner's trials for this machine and expert shape (save_verdict), or None."""
    machine, model, cm_path = _cost_key(backend)
    f = cm_path.with_suffix(".verdict.json")
    if not f.exists():
        return None
    try:
        v = json.loads(f.read_text())
        if v.get("machine") == machine and v.get("model") == model and v.get("path") in ("staged", "handoff"):
            v["file"] = str(f)
            return v
    except (OSError, ValueError) as e:  # a damaged entry: the trials run again
        log.warning("strata: ignoring the saved plan verdict %s: %s", f, e)
    return None


def cost_model_for(backend) -> CostModel:
    """The backend's costs: this machine's cached measurement for its expert shape, else measured now and cached."""
    layer = backend.layer_ids[0]
    ew = backend.store[layer]
    lane = backend.lane
    threads = lane.threads if lane is not None else torch.get_num_threads()
    machine, model, path = _cost_key(backend)
    if path.exists():
        try:
            cm = CostModel.load(path)
            if cm.matches(machine, model):
                return cm
        except Exception as e:  # a damaged cache entry is re-measured, never fatal
            log.warning("strata: ignoring cached cost model %s: %s", path, e)
    log.info("strata: measuring expert costs on this machine (cached in %s)", path)
    if lane is None:
        lane = CpuLane({layer: ew}, threads, "auto", backend.dtype)
    cm = measure_cost_model(ew, backend.device, backend.dtype, threads, lane=lane, layer=layer)
    cm = dataclasses.replace(cm, machine=machine, model=model)
    try:
        cm.save(path)
    except OSError as e:
        log.warning("strata: could not cache the cost model in %s: %s", path, e)
    return cm
