"""strata.ops.registry: the one place a kernel is chosen. Every op has its reference twin, CPU tensors take the
twin, a registered kernel takes the inputs its `when` accepts, and the layers reach kernels only through it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from strata.ops import registry

OPS = ("rms_norm", "silu_mul", "qk_norm_rope", "qk_norm_rope_kv", "router_logits", "one_query_attention",
       "one_query_attention_blocks", "rows_attention", "dequantize_blocks", "gather_expert_ffn", "qmatmul",
       "two_tier_expert_ffn", "stage_misses")
# modules that hold kernels: only strata/ops itself imports them
KERNELS = {"strata.ops.fused", "strata.ops.decode_attention", "strata.ops.decode_attention_kv",
           "strata.ops.dequant_triton", "strata.ops.expert_triton",
           "strata.ops.qgemv", "strata.ops.cpu_gemv", "strata.ops.host_stage", "strata.ops.route", "strata.ops.host_rows",
           "strata.ops.combine", "strata.ops.deltanet", "strata.ops.cpu_attention", "strata.ops.cpu_fused",
           "strata.ops.iquant_triton", "strata.ops.kquant_triton", "strata.ops.kquant_rows"}
ROOT = Path(__file__).parents[2] / "strata"


def test_every_op_has_its_reference_twin():
    registry.load()
    for name in OPS:
        assert callable(registry.op(name).reference), name
    assert set(registry.KERNEL_MODULES) <= KERNELS | {"strata.ops.expert_gather"}


def test_cpu_inputs_take_no_gpu_kernel():
    """CPU tensors never reach a GPU kernel: the twin, or a CPU kernel (strata.ops.cpu_fused / cpu_attention)."""
    x, w = torch.randn(3, 16), torch.ones(16)
    got = registry.op("rms_norm").pick(x, w, 1e-6)
    assert got is None or got.name == "cpu_native"
    q = torch.randn(2, 4, 16)
    got = registry.op("qk_norm_rope").pick(q, q, torch.arange(2), torch.ones(8, 8), torch.ones(8, 8), 16, True)
    assert got is None or got.name == "cpu_native"
    assert registry.op("rms_norm").pick(x.double(), w.double(), 1e-6) is None  # nothing takes float64


def test_a_registered_kernel_takes_what_its_when_accepts(monkeypatch):
    """The norm layer reaches a kernel only through the registry: one registered for odd widths takes those."""
    from strata.layers.norm import rms_norm
    from strata.ops.reference import rms_norm as ref

    op = registry.op("rms_norm")
    calls = []

    def spy(x, w, eps):
        calls.append(x.shape[-1])
        return ref(x, w, eps)

    monkeypatch.setattr(op, "kernels", [k for k in op.kernels if k.name != "cpu_native"])  # (the CPU's own)
    op.register("spy", spy, lambda x, w, eps: x.shape[-1] % 2 == 1)
    x = torch.randn(2, 15)
    torch.testing.assert_close(rms_norm(x, torch.ones(15), 1e-6), ref(x, torch.ones(15), 1e-6))
    rms_norm(torch.randn(2, 16), torch.ones(16), 1e-6)
    assert calls == [15]
    assert "spy" in repr(op)


def test_an_op_without_a_twin_is_a_clear_error():
    with pytest.raises(RuntimeError, match="no reference twin"):
        registry.Op("nothing")(1)


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_kernels_are_imported_only_inside_ops():
    bad = [f"{p.relative_to(ROOT.parent)}: {m}" for p in ROOT.rglob("*.py") if "ops" not in p.relative_to(ROOT).parts
           for m in _imports(p) if m in KERNELS]
    assert not bad, bad


# package -> packages it must not import (layers import only downward)
FORBIDDEN = {
    "quant": {"layers", "experts", "models", "engine", "server", "bench"},
    "ops": {"layers", "experts", "models", "engine", "server", "bench"},
    "layers": {"models", "engine", "server", "bench"},
    "experts": {"models", "engine", "server", "bench"},
    "models": {"engine", "server", "bench"},
    "engine": {"server", "bench"},
}


def test_packages_import_only_downward():
    bad = []
    for p in ROOT.rglob("*.py"):
        pkg = p.relative_to(ROOT).parts[0]
        for m in _imports(p):
            parts = m.split(".")
            if parts[0] == "strata" and len(parts) > 1 and parts[1] in FORBIDDEN.get(pkg, ()):
                bad.append(f"{p.relative_to(ROOT.parent)} imports {m}")
    assert not bad, "\n".join(sorted(set(bad)))


def test_no_import_cycle_between_the_cost_model_and_the_cpu_lane():
    costs = _imports(ROOT / "experts" / "costs.py")
    lane = _imports(ROOT / "experts" / "cpu_lane.py")
    native = _imports(ROOT / "ops" / "cpu_native.py")
    assert "strata.experts.cpu_lane" in costs
    assert not any(m.startswith("strata.experts.costs") for m in lane | native)
    assert not any(m.startswith("strata.experts") for m in native)
