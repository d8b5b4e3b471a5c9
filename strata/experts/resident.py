"""Every expert on the compute device: the reference backend, and the oracle for every offload plan.

Per-(token, choice) outputs are gathered into [N, k, d] and summed over k in routing order, the same order the
tiered backend uses, so both produce bit-identical sums for the same expert outputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from strata.quant import QTensor, qmatmul


def expert_ffn(x: torch.Tensor, gate: QTensor, up: QTensor, down: QTensor) -> torch.Tensor:
    return qmatmul(F.silu(qmatmul(x, gate)) * qmatmul(x, up), down)


def combine(y: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """y [N, k, d] per-choice expert outputs, w [N, k] -> [N, d], summed in routing order in float32."""
    return (y.float() * w.unsqueeze(-1).float()).sum(1).to(dtype)


DECODE_PAIRS = 64  # up to this many (token, expert) pairs the grouped kernel beats per-expert GEMMs


class ExpertWeights:
    """One MoE layer's stacked expert tensors, each `[E, out, in]` in its stored format."""

    def __init__(self, gate: QTensor, up: QTensor, down: QTensor):
        self.gate, self.up, self.down = gate, up, down

    @property
    def n_experts(self) -> int:
        return self.gate.shape[0]

    def expert_nbytes(self) -> int:
        return (self.gate.nbytes + self.up.nbytes + self.down.nbytes) // self.n_experts

    def to(self, device) -> "ExpertWeights":
        return ExpertWeights(self.gate.to(device), self.up.to(device), self.down.to(device))


class ResidentExperts:
    """Every expert on the compute device (an `ExpertsBackend`): nothing to cache, plan or count."""

    sizes_cache = False
    profiler = None
    stats = None

    def __init__(self, layers: dict[int, ExpertWeights]):
        self.layers = layers

    def setup(self, k: int, act_bytes: int = 0) -> None:
        pass

    def max_graph_batch(self, k: int) -> int:
        return max(1, DECODE_PAIRS // max(k, 1))

    def set_routers(self, moes: dict) -> None:
        pass

    def begin_step(self, ctx) -> None:
        pass

    def begin_request(self) -> None:
        return None

    def profile_report(self, measured_ms: float | None = None) -> str:
        return ""

    def tuning(self) -> bool:
        return False

    def end_tuning(self) -> str:
        return ""

    def close(self) -> None:
        pass

    def forward(self, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, ctx=None) -> torch.Tensor:
        ew = self.layers[layer]
        n, k = ids.shape
        if x.is_cuda and n * k <= DECODE_PAIRS:
            # Decode: every (token, choice) pair through the grouped kernel over the whole expert stack (the
            # "slot pool" is all experts): a constant number of launches and no host sync.
            from strata.ops.expert_gather import gather_expert_ffn

            y = gather_expert_ffn(x.repeat_interleave(k, 0), ew.gate, ew.up, ew.down, ids.reshape(-1))
            return combine(y.view(n, k, -1), w, x.dtype)
        # A chunk on the GPU: pairs sorted by expert, experts in batches of batched matmuls (a constant number
        # of launches per batch). On the CPU the per-expert loop through qmatmul stays: it is the reference
        # (and qmatmul's kernel registry is where tests swap in llama.cpp's activation rounding).
        if not x.is_cuda:
            return combine(expert_loop(ew, x, ids), w, x.dtype)
        from strata.ops.moe_prefill import grouped_expert_ffn

        return combine(grouped_expert_ffn(x, ew.gate, ew.up, ew.down, ids), w, x.dtype)


def expert_loop(ew: ExpertWeights, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """x [N, d], ids [N, k] -> [N, k, d] float32: `expert_ffn` once per used expert on its tokens (the
    reference for the grouped prefill path; one host read of the counts, then a Python loop)."""
    n, k = ids.shape
    y = torch.zeros(n, k, x.shape[-1], dtype=torch.float32, device=x.device)
    flat = ids.reshape(-1)
    # Tokens grouped by expert: one matmul chain per used expert.
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=ew.n_experts).tolist()
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        sel = order[start : start + c]
        start += c
        tok = sel // k
        out = expert_ffn(x[tok], ew.gate[e], ew.up[e], ew.down[e])
        y.view(n * k, -1)[sel] = out.float()
    return y
