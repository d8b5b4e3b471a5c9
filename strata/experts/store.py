"""The expert store: every routed expert's weights in host memory, in their stored format.

The canonical copy of the experts (principle 3). With a CUDA GPU the bytes are copied into page-locked
(pinned) memory once, so that copies to the GPU run asynchronously at the link's full speed; in low-RAM mode,
or without a GPU, the store is the memory-mapped GGUF itself (pages come from the file on first use and the
OS may drop them again). Never a dequantized copy.
"""

from __future__ import annotations

import logging
import sys

import torch

from strata import StrataError
from strata.experts.resident import ExpertWeights
from strata.quant import QTensor

log = logging.getLogger("strata")

PIN_CHUNK = 64 << 20  # bytes copied into pinned memory per step (progress, and page-in of the mapped file)
RAM_MARGIN = 2 << 30  # RAM left to the OS and the rest of the process when pinning


def _fmt_gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


class ExpertStore:
    """layers: model layer index -> ExpertWeights (host, usually views of the mapped file).

    pin: None = pin when CUDA is available and not low_ram.
    """

    def __init__(self, layers: dict[int, ExpertWeights], pin: bool | None = None, low_ram: bool = False,
                 progress: bool = True):
        if not layers:
            raise StrataError("the model has no routed experts to store")
        self.layer_ids = sorted(layers)
        first = layers[self.layer_ids[0]]
        self.n_experts = first.n_experts
        for i in self.layer_ids:
            ew = layers[i]
            if ew.n_experts != self.n_experts:
                raise StrataError(f"layer {i} has {ew.n_experts} experts, layer {self.layer_ids[0]} has {self.n_experts}")
            for t in (ew.gate, ew.up, ew.down):
                if t.device.type != "cpu":
                    raise StrataError(f"layer {i}: the expert store takes host tensors, got one on {t.device}")
        self.low_ram = low_ram
        self.pinned = (torch.cuda.is_available() and not low_ram) if pin is None else bool(pin)
        if self.pinned:
            layers = self._pin(layers, progress)
        self.layers: dict[int, ExpertWeights] = dict(layers)

    # --- sizes ---------------------------------------------------------------------------------------------
    def expert_nbytes(self, layer: int | None = None) -> int:
        """Bytes of one expert (gate + up + down) of `layer` (default: the largest over layers)."""
        if layer is not None:
            return self.layers[layer].expert_nbytes()
        return max(ew.expert_nbytes() for ew in self.layers.values())

    def nbytes(self) -> int:
        return sum(ew.gate.nbytes + ew.up.nbytes + ew.down.nbytes for ew in self.layers.values())

    def __getitem__(self, layer: int) -> ExpertWeights:
        return self.layers[layer]

    # --- pinning ---------------------------------------------------------------------------------------------
    def _pin(self, layers: dict[int, ExpertWeights], progress: bool) -> dict[int, ExpertWeights]:
        import psutil

        total = sum(ew.gate.nbytes + ew.up.nbytes + ew.down.nbytes for ew in layers.values())
        avail = psutil.virtual_memory().available
        if total + RAM_MARGIN > avail:
            raise StrataError(
                f"pinning the experts ({_fmt_gib(total)}) would exceed the free RAM ({_fmt_gib(avail)}, keeping "
                f"{_fmt_gib(RAM_MARGIN)} for the system); run with --low-ram to read experts from the "
                "memory-mapped file instead (slower misses)"
            )
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=total, unit="B", unit_scale=True, desc="strata: pinning experts", leave=False,
                       mininterval=0.1 if sys.stderr.isatty() else 15)  # a log file gets a line now and then
        out = {}
        try:
            for i, ew in layers.items():
                out[i] = ExpertWeights(*(self._pin_tensor(t, bar) for t in (ew.gate, ew.up, ew.down)), act=ew.act)
        except RuntimeError as e:  # cudaHostAlloc failed: locked-memory limits, or RAM taken meanwhile
            raise StrataError(
                f"pinning {_fmt_gib(total)} of experts failed ({str(e).splitlines()[0]}); run with --low-ram, "
                "or raise the locked-memory limit (ulimit -l)"
            ) from None
        finally:
            if bar is not None:
                bar.close()
        return out

    @staticmethod
    def _pin_tensor(t: QTensor, bar) -> QTensor:
        if t.raw.is_pinned():
            return t
        dst = torch.empty(t.raw.shape, dtype=torch.uint8, pin_memory=True)
        src, flat = t.raw.reshape(-1), dst.view(-1)
        for a in range(0, flat.numel(), PIN_CHUNK):
            b = min(a + PIN_CHUNK, flat.numel())
            flat[a:b].copy_(src[a:b])
            if bar is not None:
                bar.update(b - a)
        return QTensor(dst, t.qtype, t.shape)
