"""The CPU lane: missed experts computed on the host, from the host copy, while the GPU computes the hits.

Kernels per expert FFN (`silu(x @ gate.T) * (x @ up.T) @ down.T`):

- `ref`: `strata.experts.resident.expert_ffn` on the stored blocks: the exact reference math (float32, also where
  CPU qmatmul would take the native kernel for few tokens), so offloaded runs match a float32 resident one. Slow:
  it dequantizes the expert's rows on every call.
- `int4`: the weights repacked once at load into the layout of torch's fused
  `aten._weight_int4pack_mm_for_cpu` (4-bit values, a bf16 scale and zero per 32-group), which reads the
  packed weights once per call without materialising floats. Exact where the format allows, up to the bf16
  rounding of the scales and zeros: Q4_K `w = d*sc*q - dmin*m = (q - 8)*scale + zero` with `scale = d*sc`,
  `zero = 8*d*sc - dmin*m`; Q4_0 `w = (q - 8)*d`. Needs bf16/f16 activations (the kernel takes bf16; float32
  activations would be 20x slower), i.e. the GPU's compute dtype; gate and up are packed as one [2*ff, d]
  weight so an expert is two calls. Q8_0 (per-32-block scales, which the per-row `_weight_int8pack_mm`
  cannot take) goes as two int4 halves along a doubled k: exact up to the bf16 scales, 10 bits per weight.

- `native`: Q2_K / Q3_K / Q4_K / Q5_K / Q6_K / Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 / MXFP4 / TQ1_0 / TQ2_0 and the i-quants IQ4_XS /
  IQ4_NL / IQ3_XXS / IQ3_S / IQ2_XXS / IQ2_XS / IQ2_S / IQ1_S / IQ1_M: experts read in place by a compiled kernel
  (`strata.ops.cpu_native`: int8 activations, AVX2 integer dot products, every expert of a token-layer in one
  call); needs a C compiler at first use. Rows are multiples of 256, or of 32 for the 32-wide block formats (Q8_0,
  MXFP4, IQ4_NL, Q4_0, Q4_1, Q5_0, Q5_1); experts with biases and gpt-oss's clamped SwiGLU (`ExpertAct` kind
  `swiglu_oai`) go through it too.

- `resident` (`auto` where the compute device is this CPU, `host=True`): each pair as the resident backend computes
  it on the CPU (strata.experts.cpu_mirror: the native kernel's fused call for a decode-sized part of the step, the
  per-expert qmatmul chain past it), so a missed expert gives the bits it gives from a cache slot or in a resident
  run: without a GPU the lane and the "GPU" are the same cores, and a greedy text must not depend on the cache.

`auto` takes `native` for bf16/f16 activations and experts in those formats when the kernel builds, else `int4` for a
repackable format (Q4_K, Q4_0, Q8_0; plain SwiGLU, and preferred for rows with a partial 256-block), else `ref`.
Other formats (float experts) use `ref`; with bf16/f16
activations that logs one warning per such format.

Threads: torch's intra-op pool is process-wide; `CpuLane(threads=n)` sets it (0 leaves torch's default, one
per physical core). The lane runs on the calling thread: the backend launches the GPU's work first, then
calls the lane, so both run at once.
"""

from __future__ import annotations

import logging
import sys

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from strata import StrataError
from strata.experts.cpu_mirror import resident_rows, store_fused
from strata.experts.resident import ExpertWeights, expert_ffn
from strata.ops import cpu_native
from strata.quant import QTensor
from strata.quant.formats import warn_reference_path
from strata.quant.matmul import exact_cpu

log = logging.getLogger("strata")

Q = GGMLQuantizationType
KERNELS = ("auto", "ref", "int4", "native")
INT4_TYPES = frozenset({Q.Q4_K, Q.Q4_0, Q.Q8_0})
GROUP = 32  # int4pack group size: the sub-block of Q4_K, the block of Q4_0


def _f16_field(b: np.ndarray, off: int) -> np.ndarray:
    """The f16 at byte offset `off` of each block (last axis = block bytes) as float32, shape [..., 1]."""
    return np.ascontiguousarray(b[..., off:off + 2]).view(np.float16).astype(np.float32)


def _q4k_unpack(raw: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K rows [n, k/256*144] -> (q uint8 [n, k], scale f32 [n, k/32], zero f32 [n, k/32])."""
    b = raw.reshape(n, k // 256, 144)
    d, dmin = _f16_field(b, 0), _f16_field(b, 2)  # [n, nb, 1]
    s = b[..., 4:16].reshape(n, k // 256, 3, 4)
    s0, s1, s2 = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = np.concatenate([s0 & 0x3F, (s2 & 0x0F) | ((s0 >> 2) & 0x30)], -1).astype(np.float32)  # [n, nb, 8]
    mn = np.concatenate([s1 & 0x3F, (s2 >> 4) | ((s1 >> 2) & 0x30)], -1).astype(np.float32)
    scale = (d * sc).reshape(n, k // GROUP)  # d*sc in float32, as the reference dequantizer computes it
    zero = 8.0 * scale - (dmin * mn).reshape(n, k // GROUP)
    qs = b[..., 16:].reshape(n, k // 256, 4, 1, 32)  # 32 bytes hold sub-blocks 2i (low) and 2i+1 (high)
    q = np.concatenate([qs & 0x0F, qs >> 4], 3).reshape(n, k)
    return q, scale, zero


def _q4_0_unpack(raw: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    b = raw.reshape(n, k // 32, 18)
    d = _f16_field(b, 0).reshape(n, k // 32)
    qs = b[..., 2:].reshape(n, k // 32, 1, 16)
    q = np.concatenate([qs & 0x0F, qs >> 4], 2).reshape(n, k)
    return q, d, np.zeros_like(d)


def _q8_0_unpack(raw: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q8_0 as two int4 halves along a doubled k: q = 16*hi + lo (hi = q >> 4 in -8..7, lo = q & 15), so
    d*q = (hi + 8 - 8)*16d + (lo - 8)*d + 8d: columns 0..k-1 hold hi + 8 (scale 16d, zero 0), columns k..2k-1
    hold lo (scale d, zero 8d). The kernel then reads [x, x] against [n, 2k]: 10 bits per weight, exact up to
    the bf16 rounding of the scales."""
    b = raw.reshape(n, k // 32, 34)
    d = _f16_field(b, 0).reshape(n, k // 32)
    q = np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(n, k)
    hi = ((q >> 4) + 8).astype(np.uint8)
    lo = (q & 15).astype(np.uint8)
    scale = np.concatenate([16.0 * d, d], 1)
    zero = np.concatenate([np.zeros_like(d), 8.0 * d], 1)
    return np.concatenate([hi, lo], 1), scale, zero


_UNPACK = {Q.Q4_K: _q4k_unpack, Q.Q4_0: _q4_0_unpack, Q.Q8_0: _q8_0_unpack}
DOUBLED = frozenset({Q.Q8_0})  # formats packed along a doubled k (the input is repeated)


class Int4Weight:
    """One [n, k] weight in `_weight_int4pack_mm_for_cpu`'s layout (k doubled for DOUBLED formats)."""

    __slots__ = ("packed", "sz", "n", "doubled")

    def __init__(self, packed: torch.Tensor, sz: torch.Tensor, n: int, doubled: bool = False):
        self.packed, self.sz, self.n, self.doubled = packed, sz, n, doubled

    @classmethod
    def from_parts(cls, q: np.ndarray, scale: np.ndarray, zero: np.ndarray, doubled: bool = False) -> "Int4Weight":
        n, _ = q.shape
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(q.astype(np.int32)), 1)
        sz = torch.stack([torch.from_numpy(scale).t(), torch.from_numpy(zero).t()], -1)  # [k/32, n, 2]
        return cls(packed, sz.to(torch.bfloat16).contiguous(), n, doubled)

    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + self.sz.numel() * self.sz.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, k] bf16 -> [T, n] bf16
        if self.doubled:
            x = torch.cat([x, x], -1)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.sz)


def repack_int4(*weights: QTensor) -> Int4Weight:
    """2-D QTensors of one format (stacked along rows, e.g. gate and up) -> one Int4Weight."""
    parts = []
    for w in weights:
        if w.qtype not in _UNPACK or len(w.shape) != 2:
            raise StrataError(f"no int4 repack for a {w.qtype.name} weight of shape {w.shape}")
        n, k = w.shape
        parts.append(_UNPACK[w.qtype](w.raw.numpy(), n, k))
    if len({w.qtype in DOUBLED for w in weights}) > 1:
        raise StrataError("weights stacked into one int4 weight must all be doubled formats or none")
    q, scale, zero = (np.concatenate([p[i] for p in parts], 0) for i in range(3))
    return Int4Weight.from_parts(q, scale, zero, doubled=weights[0].qtype in DOUBLED)


def int4_supported(ew: ExpertWeights) -> bool:
    """The int4 kernel takes this layer's experts (each projection's format repacks, rows are whole groups)."""
    if not all(t.qtype in INT4_TYPES for t in (ew.gate, ew.up, ew.down)):
        return False
    if ew.gate.qtype != ew.up.qtype:
        return False
    # the CPU kernel wants k a multiple of the group and n a multiple of its 64-wide blocks
    return all(t.shape[-1] % GROUP == 0 and t.shape[-2] % 64 == 0 for t in (ew.gate, ew.down))


NATIVE_TYPES = frozenset(Q[name] for name in cpu_native.FORMATS)  # the formats the native kernel reads
NATIVE_ACTS = frozenset({"swiglu_oai"})  # the ExpertAct kinds the native kernel computes (with their biases)


def native_width(qtype) -> int:
    """The row length a format needs for the native kernel: its 32-wide blocks (Q8_0, MXFP4, IQ4_NL, Q4_0, Q4_1, Q5_0,
    Q5_1) read activations quantized per 256 with a partial last block; the others need whole 256-blocks."""
    return cpu_native.WIDTHS.get(Q(qtype).name, 256)


def native_supported(ew: ExpertWeights) -> bool:
    """The native kernel takes this layer's experts: each projection in NATIVE_TYPES (gate's and up's may differ)
    with rows a multiple of native_width, and plain SwiGLU or an activation in NATIVE_ACTS."""
    return (all(t.qtype in NATIVE_TYPES for t in (ew.gate, ew.up, ew.down))
            and not _short_rows(ew) and (ew.act is None or ew.act.kind in NATIVE_ACTS)
            and all(t.raw.is_contiguous() for t in (ew.gate, ew.up, ew.down)))


def _short_rows(ew: ExpertWeights) -> list:
    """The native formats among gate/up and down whose rows are not a multiple of their native_width."""
    return sorted({t.qtype for t in (ew.gate, ew.down)
                   if t.qtype in NATIVE_TYPES and t.shape[-1] % native_width(t.qtype)})


def _native_act(ew: ExpertWeights) -> dict:
    """NativeExperts' activation and bias arguments for these experts."""
    a = ew.act
    if a is None:
        return {}
    return dict(act=a.kind, alpha=a.alpha, limit=a.limit, gate_b=a.gate_b, up_b=a.up_b, down_b=a.down_b)


def _native_lib():
    return cpu_native.load()


class _Int4Expert:
    __slots__ = ("gate_up", "down", "ff")

    def __init__(self, ew: ExpertWeights, e: int):
        self.ff = ew.gate.shape[1]
        self.gate_up = repack_int4(ew.gate[e], ew.up[e])  # [2*ff, d]
        self.down = repack_int4(ew.down[e])  # [d, ff]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, d] bf16 -> [T, d] bf16
        h = self.gate_up(x)
        return self.down(F.silu(h[:, : self.ff]) * h[:, self.ff :])


class CpuLane:
    """Computes (expert, tokens) jobs of one MoE layer on the host.

    layers: model layer -> ExpertWeights on the host (the store's copy). `dtype` is the activations' dtype
    (the model's compute dtype), which picks the kernel under `auto`.
    """

    def __init__(self, layers: dict[int, ExpertWeights], threads: int = 0, kernel: str = "auto",
                 dtype: torch.dtype = torch.float32, repack: bool = True, host: bool = False):
        if kernel not in KERNELS:
            raise StrataError(f"cpu kernel must be one of {', '.join(KERNELS)} (got {kernel!r})")
        if threads < 0:
            raise StrataError("--cpu-threads must be >= 0")
        if threads:
            torch.set_num_threads(threads)
        self.threads = torch.get_num_threads()
        # a prefill chunk's CPU share is many rows per expert: it runs at the start-up count (what the cost model
        # measured), not at the fewer threads the decode tuner may pick for one-token GEMVs (a long prompt's
        # prefill lost most of its speed when its CPU share ran on the tuner's count: docs/BENCHMARKS.md)
        self.full_threads = self.threads
        self.layers, self.dtype = layers, dtype
        self.kernel: dict[int, str] = {}
        self._int4: dict[int, dict[int, _Int4Expert]] = {}
        self._native: dict[int, object] = {}
        for i, ew in layers.items():
            want = kernel
            if ew.act is not None and (kernel == "int4" or (kernel == "native" and ew.act.kind not in NATIVE_ACTS)):
                raise StrataError(f"layer {i}: the {kernel} CPU kernel computes plain SwiGLU experts; these have "
                                  f"biases and the {ew.act.kind} activation (use --cpu-kernel ref or auto)")
            if kernel == "auto" and host:  # no GPU: the lane computes as the resident backend does on this CPU
                want = "resident"
            elif kernel == "auto":  # float32 activations keep the exact reference (a GPU's float32 hits)
                low = dtype in (torch.bfloat16, torch.float16)
                native = low and native_supported(ew) and _native_lib() is not None
                # rows with a partial 256-block: the int4 repack keeps the plain experts it takes (the native
                # kernel's partial blocks are untimed against it); native takes the rest (gpt-oss's MXFP4, 2880)
                whole = ew.gate.shape[-1] % 256 == 0 and ew.down.shape[-1] % 256 == 0
                int4 = low and ew.act is None and int4_supported(ew) and repack
                if native and (whole or not int4):
                    want = "native"  # reads the stored blocks in place: no repacked copy, one call per token-layer
                elif int4:
                    want = "int4"
                else:
                    want = "ref"
                    if low:  # a format no CPU kernel reads is slow here by nature, not by choice: say so, once
                        for t in sorted({ew.gate.qtype, ew.up.qtype, ew.down.qtype} - NATIVE_TYPES - INT4_TYPES):
                            warn_reference_path(t, "the CPU lane")
                        for t in _short_rows(ew):  # a format of 256-wide blocks in rows of another length
                            warn_reference_path(t, f"the CPU lane at rows that are not a multiple of "
                                                   f"{native_width(t)}")
            elif kernel == "int4" and not int4_supported(ew):
                raise StrataError(f"layer {i}: the int4 CPU kernel does not take {ew.gate.qtype.name}/"
                                  f"{ew.down.qtype.name} experts of shape {ew.gate.shape[1:]}")
            elif kernel == "native" and _native_lib() is None:
                why = cpu_native.unavailable() or "it did not load"
                raise StrataError(f"--cpu-kernel native: the native CPU kernel is unavailable: {why}")
            elif kernel == "native" and not native_supported(ew):
                raise StrataError(f"layer {i}: the native CPU kernel takes "
                                  f"{'/'.join(sorted(t.name for t in NATIVE_TYPES))} experts with rows that are "
                                  f"multiples of 256 (of 32 for Q8_0 and MXFP4) and needs a C compiler (got "
                                  f"{ew.gate.qtype.name}/{ew.down.qtype.name}, {ew.gate.shape[1:]})")
            self.kernel[i] = want
            if want == "int4":
                self._int4[i] = {}  # filled lazily per expert, or all at once by prepare()
            elif want == "native":
                from strata.ops.cpu_native import NativeExperts

                self._native[i] = NativeExperts(ew.gate.raw, ew.up.raw, ew.down.raw, fmt_gate_up=ew.gate.qtype.name,
                                                fmt_up=ew.up.qtype.name, fmt_down=ew.down.qtype.name,
                                                **_native_act(ew))

    def set_threads(self, threads: int) -> None:
        """The lane's thread count from now on (torch's intra-op pool, which the native kernel follows too)."""
        if threads < 1:
            raise StrataError("the CPU lane needs at least one thread")
        torch.set_num_threads(threads)
        self.threads = threads

    def prepare(self, progress: bool = False) -> None:
        """Repack every expert the int4 kernel will read now (load time), not on first use."""
        todo = [(i, e) for i in self._int4 for e in range(self.layers[i].n_experts) if e not in self._int4[i]]
        if not todo:
            return
        import psutil

        need = self.repacked_nbytes(todo)
        avail = psutil.virtual_memory().available
        if need + (2 << 30) > avail:
            raise StrataError(
                f"repacking experts for the CPU lane needs {need / 2**30:.1f} GiB of RAM, {avail / 2**30:.1f} GiB "
                "are free; use --cpu-plan 0...0 (misses over PCIe only) or --low-ram (repack on first use)"
            )
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(todo), unit="expert", desc="strata: repacking experts for the CPU", leave=False,
                       mininterval=0.1 if sys.stderr.isatty() else 15)  # a log file gets a line now and then

        def one(item):
            i, e = item
            return i, e, _Int4Expert(self.layers[i], e)

        # numpy and torch release the GIL in the heavy parts: one worker per lane thread
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max(1, self.threads)) as pool:
            for i, e, packed in pool.map(one, todo):
                self._int4[i][e] = packed
                if bar is not None:
                    bar.update()
        if bar is not None:
            bar.close()

    def repacked_nbytes(self, todo=None) -> int:
        """Host bytes the int4 copies of `todo` [(layer, expert)] (default: all int4 experts) take: 5 bits/weight."""
        if todo is None:
            todo = [(i, e) for i in self._int4 for e in range(self.layers[i].n_experts)]
        total = 0
        for i, _ in todo:
            ew = self.layers[i]
            total += sum(t.numel() // ew.n_experts * (10 if t.qtype in DOUBLED else 5) // 8
                         for t in (ew.gate, ew.up, ew.down))
        return total

    def nbytes(self) -> int:
        """Host bytes of the repacked copies made so far."""
        return sum(x.gate_up.nbytes() + x.down.nbytes() for d in self._int4.values() for x in d.values())

    def _resident(self, layer: int, x: torch.Tensor, jobs) -> torch.Tensor:
        """`run` under the `resident` kernel: jobs (expert, token indices) over the step's rows x."""
        ew = self.layers[layer]
        groups = [(e, e, tok) for e, tok in jobs]
        return resident_rows(x, groups, lambda e: (ew.gate[e], ew.up[e], ew.down[e]), store_fused(ew), ew.act)

    def expert(self, layer: int, e: int, x: torch.Tensor) -> torch.Tensor:
        """One expert over tokens x [T, d] (host) -> [T, d] float32."""
        if self.kernel[layer] == "resident":  # (x: one sequence's rows)
            return self._resident(layer, x, [(e, torch.arange(x.shape[0]))])
        if self.kernel[layer] == "native":
            return self._native[layer](np.full(x.shape[0], e), x)
        if self.kernel[layer] == "int4":
            packed = self._int4[layer].get(e)
            if packed is None:
                packed = self._int4[layer][e] = _Int4Expert(self.layers[layer], e)
            return packed(x.to(torch.bfloat16)).float()
        ew = self.layers[layer]
        with exact_cpu():  # float32 math, not the native kernel's int8 activations (what `ref` promises)
            return expert_ffn(x, ew.gate[e], ew.up[e], ew.down[e], ew.act, e).float()

    def run_experts(self, layer: int, x: torch.Tensor, experts: list[int]) -> torch.Tensor:
        """One token x [1, d] (host) through each of `experts` -> [len(experts), d] float32."""
        if self.kernel[layer] == "native":  # all of them in one call (one thread-pool region)
            return self._native[layer](experts, x.reshape(1, -1), rows=[0] * len(experts))
        if self.kernel[layer] == "resident":
            return self._resident(layer, x.reshape(1, -1), [(e, torch.zeros(1, dtype=torch.long)) for e in experts])
        xin = x.to(torch.bfloat16) if self.kernel[layer] == "int4" else x
        return torch.cat([self.expert(layer, e, xin) for e in experts])

    def run_chunk(self, layer: int, x: torch.Tensor, jobs: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
        """`run` for a prefill chunk's CPU share, at the lane's start-up thread count."""
        now = self.threads
        if now == self.full_threads:
            return self.run(layer, x, jobs)
        torch.set_num_threads(self.full_threads)
        try:
            return self.run(layer, x, jobs)
        finally:
            torch.set_num_threads(now)

    def run(self, layer: int, x: torch.Tensor, jobs: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
        """jobs: (expert, token indices [n_e]) -> outputs [sum n_e, d] float32 in job order. x [N, d] on the host."""
        total = sum(int(t.numel()) for _, t in jobs)
        if self.kernel[layer] == "resident" and total:
            return self._resident(layer, x, jobs)
        if self.kernel[layer] == "native" and total:  # every (expert, token) row in one call
            rows = torch.cat([t.reshape(-1) for _, t in jobs]).numpy()
            return self._native[layer](np.repeat([e for e, _ in jobs], [int(t.numel()) for _, t in jobs]), x, rows)
        out = torch.empty(total, x.shape[-1], dtype=torch.float32)
        xin = x.to(torch.bfloat16) if self.kernel[layer] == "int4" else x  # convert once per layer
        r = 0
        for e, tok in jobs:
            n = int(tok.numel())
            out[r:r + n] = self.expert(layer, e, xin[tok])
            r += n
        return out
