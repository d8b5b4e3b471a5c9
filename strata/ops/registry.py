"""The one place strata chooses a kernel.

Every op has a reference twin (strata.ops.reference: pure torch, the CPU path and the test oracle) and may have
fast kernels, each with a `when(*args)` saying which inputs it takes; a call runs the first registered kernel
whose `when` holds, else the reference. The kernel modules are declared below (KERNEL_MODULES) and imported on
the first call of any op; each registers its kernels, or none when its toolchain (Triton, a GPU) is missing.
Nothing else registers kernels, and no caller checks for a kernel itself.

    op                  reference twin                       kernels
    rms_norm            reference.rms_norm                   fused.rms_norm            (Triton, CUDA)
    qk_norm_rope        reference.qk_norm_rope               fused.qk_norm_rope        (Triton, CUDA)
    qk_norm_rope_kv     reference.qk_norm_rope_kv            fused.qk_norm_rope_kv     (Triton, CUDA: k', v into
                                                                                        the KV cache as well)
    one_query_attention reference.gqa_attention              decode_attention          (Triton split-K, CUDA)
    one_query_attention_blocks  reference.one_query_blocks   decode_attention_kv       (Triton split-K reading
                                                                                        q8_0/q4_0 KV blocks, CUDA)
    dequantize_blocks   reference.dequantize_blocks          dequant_triton            (Triton, CUDA)
    gather_expert_ffn   reference.gather_expert_ffn          expert_triton             (Triton, CUDA: Q4_K, Q6_K, Q8_0,
                                                                                        IQ2_XXS, IQ3_XXS, IQ4_XS, MXFP4)
    two_tier_expert_ffn reference.two_tier_expert_ffn        expert_triton             (Triton, CUDA; misses read
                                                                                        from pinned host RAM)
    stage_misses        reference.stage_misses               host_stage                (Triton, CUDA: distinct
                                                                                        misses into staging slots)
    lookup_slots        reference.lookup_slots               host_stage                (Triton, CUDA: a layer's
                                                                                        pairs in the cache, one launch)
    commit_prefetch     reference.commit_prefetch            host_stage                (Triton, CUDA: a prefetch's
                                                                                        map and record, one launch)
    route_topk          reference.route_topk                 route.route_topk          (Triton, CUDA)
    router_logits       reference.router_logits              route.router_logits       (Triton, CUDA: float
                                                                                        routers, x as it is)
    delta_decode        reference.delta_decode               deltanet                  (Triton, CUDA: a gated
                                                                                        delta-net decode step, conv
                                                                                        and recurrence, 2 launches)
    qmatmul             reference.qmatmul (float32)          by (device, format): quant.matmul's table, which
                                                             qgemv fills (Triton GEMV, CUDA: Q4_K, Q6_K, Q8_0)
                                                             and cpu_gemv (the native kernel, CPU: its formats,
                                                             decode-sized batches)

(`qmatmul` keeps its per-format table in strata.quant.matmul, the format layer's dispatch; the registry decides
what goes in it. `grouped_expert_ffn` (strata.ops.moe_prefill) is batched torch on every device, its reference
twin the per-expert loop `strata.experts.resident.expert_loop`.)

Adding a kernel: write it in a module of strata/ops/, register it there on its op with a `when`, list the module
in KERNEL_MODULES, and test it against the op's reference over parametrized shapes.

This module imports nothing from strata at import time, so any layer may ask it for an op.
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass
from typing import Callable

KERNEL_MODULES = (
    "strata.ops.fused",
    "strata.ops.decode_attention",
    "strata.ops.decode_attention_kv",
    "strata.ops.dequant_triton",
    "strata.ops.expert_gather",
    "strata.ops.qgemv",
    "strata.ops.cpu_gemv",
    "strata.ops.cpu_attention",
    "strata.ops.cpu_fused",
    "strata.ops.host_stage",
    "strata.ops.route",
    "strata.ops.host_rows",
    "strata.ops.combine",
    "strata.ops.deltanet",
)


@dataclass
class Kernel:
    name: str
    fn: Callable
    when: Callable[..., bool]


class Op:
    """One operation: its reference twin and the kernels that may replace it."""

    def __init__(self, name: str):
        self.name = name
        self.reference: Callable | None = None
        self.kernels: list[Kernel] = []

    def register(self, name: str, fn: Callable, when: Callable[..., bool]) -> None:
        """Add a kernel (replacing one of the same name), tried after those registered before it."""
        self.kernels = [k for k in self.kernels if k.name != name] + [Kernel(name, fn, when)]

    def pick(self, *args, **kw) -> Kernel | None:
        """The kernel that takes these inputs, None for the reference."""
        _load()
        for k in self.kernels:
            if k.when(*args, **kw):
                return k
        return None

    def __call__(self, *args, **kw):
        k = self.pick(*args, **kw)
        if k is not None:
            return k.fn(*args, **kw)
        if self.reference is None:
            raise RuntimeError(f"op {self.name} has no reference twin (strata.ops.reference defines them)")
        return self.reference(*args, **kw)

    def __repr__(self) -> str:
        return f"Op({self.name}: {', '.join(k.name for k in self.kernels) or 'reference only'})"


OPS: dict[str, Op] = {}
_loaded = False
_lock = threading.RLock()  # a kernel module may ask for an op while the modules load


def op(name: str) -> Op:
    """The op of this name (created empty on first mention; strata.ops.reference gives it its twin)."""
    got = OPS.get(name)
    if got is None:
        got = OPS.setdefault(name, Op(name))
    return got


def reference(name: str):
    """Decorator: `fn` is the reference twin of op `name`."""

    def deco(fn):
        op(name).reference = fn
        return fn

    return deco


def _load() -> None:
    """Import the declared kernel modules once (each registers its kernels) and the reference twins."""
    global _loaded
    if _loaded:
        return
    with _lock:
        if _loaded:
            return
        importlib.import_module("strata.ops.reference")
        for m in KERNEL_MODULES:
            importlib.import_module(m)
        _loaded = True


def load() -> None:
    """Make sure every kernel is registered (ops do this on their first call)."""
    _load()
