"""What `strata check` reports about the machine: GPUs (VRAM, PCIe link), RAM, CPU (SIMD flags), disk.

Everything is read without torch (so `strata check` answers in a moment even where CUDA is broken): NVIDIA
GPUs through NVML (`pynvml`, from nvidia-ml-py), the rest through psutil and /proc/cpuinfo. A missing NVML
library or driver gives an empty GPU list with the reason, never an exception.
"""

from __future__ import annotations

import os
import platform
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import psutil

# PCIe usable bandwidth per lane and direction, GB/s (after line coding), by generation.
PCIE_LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}

# The flags that decide which CPU expert kernels can run fast, in the order they are listed.
SIMD_FLAGS = [
    "sse4_2", "avx", "f16c", "fma", "avx2", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
    "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8",  # x86
    "asimd", "asimdhp", "asimddp", "sve", "sve2", "i8mm", "bf16",  # arm64 ("Features" in /proc/cpuinfo)
]  # fmt: skip


@dataclass
class GPUInfo:
    index: int
    name: str
    vram_total: int  # bytes
    vram_free: int  # bytes
    pcie_gen: int | None = None  # current link generation
    pcie_gen_max: int | None = None
    pcie_width: int | None = None  # current lanes
    pcie_width_max: int | None = None

    def pcie_gbps(self, current: bool = True) -> float | None:
        """Link bandwidth per direction in GB/s, now (current) or at the link's maximum."""
        gen, width = (self.pcie_gen, self.pcie_width) if current else (self.pcie_gen_max, self.pcie_width_max)
        if gen is None or width is None or gen not in PCIE_LANE_GBPS:
            return None
        return PCIE_LANE_GBPS[gen] * width

    def pcie_warnings(self) -> list[str]:
        out = []
        if self.pcie_width and self.pcie_width_max and self.pcie_width < self.pcie_width_max:
            out.append(
                f"GPU {self.index}: PCIe link runs at x{self.pcie_width} but can do x{self.pcie_width_max}: "
                f"expert copies get {self.pcie_width / self.pcie_width_max:.0%} of the bandwidth "
                "(check the slot the card sits in, risers, and BIOS lane sharing)"
            )
        if self.pcie_gen and self.pcie_gen_max and self.pcie_gen < self.pcie_gen_max:
            out.append(
                f"GPU {self.index}: PCIe link at gen {self.pcie_gen}, maximum gen {self.pcie_gen_max} "
                "(GPUs drop the generation when idle; if it stays low under load, check BIOS/slot settings)"
            )
        return out


@dataclass
class CPUInfo:
    model: str
    cores_physical: int | None
    cores_logical: int | None
    flags: list[str] = field(default_factory=list)  # the SIMD_FLAGS present, in SIMD_FLAGS order
    # why strata's native CPU kernel (the CPU lane's expert FFNs, a CPU run's decode matmuls) is unavailable here,
    # "" when it built; None: not probed
    native_kernel: str | None = None


@dataclass
class MachineInfo:
    gpus: list[GPUInfo]
    gpu_note: str | None  # why there is no GPU list (no NVML, no driver), None when probed
    ram_total: int
    ram_available: int
    cpu: CPUInfo
    disk_path: str
    disk_free: int

    def warnings(self) -> list[str]:
        out = [w for g in self.gpus for w in g.pcie_warnings()]
        if self.cpu.native_kernel:
            out.append(f"the native CPU kernel is unavailable ({self.cpu.native_kernel}): experts computed on the "
                       "CPU and a CPU run's decode take torch's slower paths")
        return out


def parse_cpuinfo(text: str) -> tuple[str, set[str]]:
    """/proc/cpuinfo text -> (model name, set of flags) from its first processor block."""
    model, flags = "", set()
    for line in text.splitlines():
        key, _, val = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "hardware", "cpu model") and not model:
            model = val.strip()
        elif key in ("flags", "features") and not flags:
            flags = set(val.split())
    return model, flags


def probe_cpu(cpuinfo_path: str = "/proc/cpuinfo") -> CPUInfo:
    model, flags = "", set()
    try:
        model, flags = parse_cpuinfo(Path(cpuinfo_path).read_text())
    except OSError:
        pass
    return CPUInfo(
        model=model or platform.processor() or platform.machine(),
        cores_physical=psutil.cpu_count(logical=False),
        cores_logical=psutil.cpu_count(logical=True),
        flags=[f for f in SIMD_FLAGS if f in flags],
        native_kernel=_native_kernel(),
    )


def _native_kernel() -> str:
    """'' when the native CPU kernel builds (or is cached) here, else why not (one line)."""
    from strata.ops import cpu_native

    return cpu_native.unavailable()


def _nvidia_device_present() -> bool:
    """An NVIDIA driver's device node or proc entry: whether suggesting NVML's Python binding makes sense."""
    return Path("/proc/driver/nvidia").exists() or any(Path("/dev").glob("nvidia[0-9]*"))


def probe_gpus() -> tuple[list[GPUInfo], str | None]:
    """NVIDIA GPUs through NVML: (list, None), or ([], why not)."""
    try:
        import pynvml
    except ImportError:
        if not _nvidia_device_present():
            return [], "no NVIDIA GPU found"
        return [], "NVML not available to read the GPU (pip install nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound / DriverNotLoaded / ...
        return [], f"no NVIDIA driver ({e})"
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            gpus.append(
                GPUInfo(
                    index=i,
                    name=name.decode() if isinstance(name, bytes) else str(name),
                    vram_total=int(mem.total),
                    vram_free=int(mem.free),
                    pcie_gen=_nvml(pynvml.nvmlDeviceGetCurrPcieLinkGeneration, h),
                    pcie_gen_max=_nvml(pynvml.nvmlDeviceGetMaxPcieLinkGeneration, h),
                    pcie_width=_nvml(pynvml.nvmlDeviceGetCurrPcieLinkWidth, h),
                    pcie_width_max=_nvml(pynvml.nvmlDeviceGetMaxPcieLinkWidth, h),
                )
            )
        return gpus, None if gpus else "NVML found no GPU"
    except Exception as e:
        return [], f"NVML failed ({e})"
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _nvml(fn, handle) -> int | None:
    try:
        return int(fn(handle))
    except Exception:  # NVMLError_NotSupported on some boards/VMs
        return None


def disk_free_at(path: str | os.PathLike) -> tuple[str, int]:
    """(nearest existing directory, free bytes there)."""
    p = Path(path).expanduser().absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return str(p), shutil.disk_usage(p).free


def probe(disk_path: str | os.PathLike) -> MachineInfo:
    gpus, note = probe_gpus()
    vm = psutil.virtual_memory()
    where, free = disk_free_at(disk_path)
    return MachineInfo(
        gpus=gpus,
        gpu_note=note,
        ram_total=int(vm.total),
        ram_available=int(vm.available),
        cpu=probe_cpu(),
        disk_path=where,
        disk_free=free,
    )
