"""What every bench result carries besides its numbers: the machine (`strata check`), the model, the server's
flags and settings, strata's version and commit, and the expert statistics of each suite.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import platform
import subprocess
import sys
import threading
from pathlib import Path

from strata import __version__

_EXPERT_COUNTS = ("lookups", "hits", "cpu", "pcie", "swaps", "tokens", "layers")


def machine_record(models_dir: str | Path | None = None) -> dict:
    """`strata check`'s machine probe (GPUs with their PCIe link, CPU and SIMD flags, RAM, disk) + software."""
    from strata.hub.local import default_models_dir
    from strata.hub.machine import probe

    m = probe(models_dir or default_models_dir())
    out = {"check": dataclasses.asdict(m), "warnings": m.warnings(), "python": platform.python_version(),
           "platform": platform.platform(), "strata": __version__, "commit": git_commit()}
    try:
        import torch

        out["torch"] = torch.__version__
        out["cuda"] = torch.version.cuda  # never torch.cuda.*: a CUDA context here would take VRAM from the budget
        out["torch_threads"] = torch.get_num_threads()
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return out


def git_commit() -> str | None:
    """The commit strata runs from (with `+dirty` for local changes), None outside a git checkout."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=5)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def model_record(path: str | Path | None, vram_gb: float | None = None, ctx: int = 0) -> dict:
    """The model file(s): footprint (dense / expert bytes, experts, layers), `strata check`'s fit verdict for
    the budget, and whether the weights are synthetic (`strata synth` marks its files)."""
    if path is None:
        return {}
    from strata.hub.check import GiB, fit, model_footprint
    from strata.hub.local import resolve_model
    from strata.hub.machine import probe
    from strata.hub.verify import read_gguf_header

    try:
        paths = resolve_model(str(path))
    except Exception as e:  # noqa: BLE001 - a remote server's path may not exist here
        return {"path": str(path), "error": str(e)}
    fp = model_footprint(paths)
    meta = read_gguf_header(paths[0]).metadata
    out = {"path": str(paths[0]), "files": [str(p) for p in paths], "name": meta.get("general.name"),
           "footprint": dataclasses.asdict(fp), "synthetic": is_synthetic(meta)}
    try:
        machine = probe(Path(paths[0]).parent)
        out["fit"] = dataclasses.asdict(fit(fp, machine, ctx, int(vram_gb * GiB) if vram_gb else None))
    except Exception as e:  # noqa: BLE001 - the verdict is context, never a reason to fail a run
        out["fit"] = {"error": str(e)}
    return out


def is_synthetic(meta: dict) -> bool:
    return bool(meta.get("strata.synthetic")) or "synthetic" in str(meta.get("general.description", "")).lower()


def expert_delta(before: dict | None, after: dict | None) -> dict:
    """Expert statistics of what ran between two /metrics snapshots.

    With raw counts (lookups, hits, cpu, pcie, tokens) the rates are those of the interval; a server that only
    reports cumulative rates gets them labelled `cumulative` (they then include the warm-up and earlier
    suites)."""
    a = (after or {}).get("experts") or {}
    b = (before or {}).get("experts") or {}
    if not a:
        return {}
    if all(k in a for k in ("lookups", "hits", "cpu", "pcie", "tokens")):
        d = {k: int(a.get(k, 0)) - int(b.get(k, 0)) for k in _EXPERT_COUNTS if k in a}
        lk, tk = d.get("lookups", 0), d.get("tokens", 0)
        d["hit_rate"] = d["hits"] / lk if lk else None
        d["cpu_per_token"] = d["cpu"] / tk if tk else None
        d["pcie_per_token"] = d["pcie"] / tk if tk else None
        d["swaps_per_token"] = d.get("swaps", 0) / tk if tk else None
        d["interval"] = True
        return d
    out = {k: a[k] for k in ("hit_rate", "cpu_per_token", "pcie_per_token", "swaps", "vram_bytes") if k in a}
    if "swaps" in a and "swaps" in b:
        out["swaps_interval"] = int(a["swaps"]) - int(b["swaps"])
    out["cumulative"] = True
    return out


def kv_window_delta(before: dict | None, after: dict | None) -> dict:
    """The KV window's page hits, misses and bytes read from host RAM between two /metrics snapshots ({} without a
    window: --kv-vram-tokens)."""
    a = (after or {}).get("kv_window") or {}
    b = (before or {}).get("kv_window") or {}
    if not a:
        return {}
    d = {k: int(a.get(k, 0)) - int(b.get(k, 0)) for k in ("hits", "misses", "miss_bytes")}
    n = d["hits"] + d["misses"]
    d["hit_rate"] = d["hits"] / n if n else None
    return d


def now_stamp() -> tuple[str, str]:
    """(date for directory names, ISO time for records)."""
    t = _dt.datetime.now().astimezone()
    return t.strftime("%Y-%m-%d"), t.isoformat(timespec="seconds")


def command_line() -> list[str]:
    return list(sys.argv)


def gpu_memory_used() -> int | None:
    """Bytes of VRAM in use on all GPUs (NVML, else nvidia-smi), None without an NVIDIA GPU.

    Read from outside CUDA: the bench process must not create a CUDA context of its own."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return sum(int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).used)
                       for i in range(pynvml.nvmlDeviceGetCount()))
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no NVML: try the command line tool
        pass
    try:
        cp = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                            capture_output=True, text=True, timeout=10)
        if cp.returncode == 0 and cp.stdout.strip():
            return sum(int(x) for x in cp.stdout.split()) << 20
    except (OSError, ValueError, subprocess.SubprocessError):
        pass
    return None


class _Nvml:
    """NVML opened once for a poller (nvmlInit per reading costs milliseconds of driver work, repeated ten times a
    second beside the servers being timed); None when the library or the driver is missing."""

    def __init__(self):
        import pynvml

        pynvml.nvmlInit()
        self.nv = pynvml
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]

    def used(self) -> int:
        return sum(int(self.nv.nvmlDeviceGetMemoryInfo(h).used) for h in self.handles)

    def close(self) -> None:
        self.nv.nvmlShutdown()


# Without NVML the poller runs nvidia-smi, a process start and a driver query each time: at most once a second
# (the peak of a server's VRAM is a plateau it holds for the whole run; a tighter poll only loads the machine)
SMI_INTERVAL = 1.0


class VramPeak:
    """The peak VRAM in use while the block runs (polled), and what was in use before it: `peak - baseline` is
    what the block's processes took. Both None on machines without an NVIDIA GPU. NVML stays open while it polls;
    without it, nvidia-smi runs at most every SMI_INTERVAL seconds."""

    def __init__(self, interval: float = 0.1):
        self.interval = interval
        self.baseline: int | None = None
        self.max_used: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml: _Nvml | None = None

    @property
    def peak(self) -> int | None:
        """VRAM taken by the block: the peak above the baseline."""
        if self.max_used is None:
            return None
        return self.max_used - (self.baseline or 0)

    def _read(self) -> int | None:
        if self._nvml is not None:
            try:
                return self._nvml.used()
            except Exception:  # noqa: BLE001 - the driver went away: nvidia-smi from now on
                self._nvml = None
        return gpu_memory_used()

    def _poll(self) -> None:
        wait = self.interval if self._nvml is not None else max(self.interval, SMI_INTERVAL)
        while not self._stop.wait(wait):
            used = self._read()
            if used is not None:
                self.max_used = max(self.max_used or 0, used)

    def __enter__(self) -> "VramPeak":
        try:
            self._nvml = _Nvml()
        except Exception:  # noqa: BLE001 - no NVML: gpu_memory_used's nvidia-smi
            self._nvml = None
        self.baseline = self._read()
        if self.baseline is not None:
            self.max_used = self.baseline
            self._thread = threading.Thread(target=self._poll, daemon=True, name="strata-vram-peak")
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self._nvml is not None:
            try:
                self._nvml.close()
            except Exception:  # noqa: BLE001 - shutting down a library that is going away anyway
                pass
            self._nvml = None
