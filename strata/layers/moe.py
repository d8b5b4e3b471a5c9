"""The MoE block: router -> top-k (family-specific scoring as data) -> the experts backend -> + shared experts.

Routing is computed in float32 on the device that holds the router. The block knows nothing about where
experts live: `experts.forward(layer, x, ids, weights, ctx)` is the only call (an `ExpertsBackend`, with the
step's `StepContext`), and the backend (all resident, or tiered across VRAM / CPU / PCIe) decides.

`--expert-routing uniform` (benchmarks only) replaces the router's choice by `uniform_route` in `MoE.__call__`,
the one place every family's MoE layer routes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strata.layers.ffn import SwiGLU
from strata.ops import registry
from strata.ops.reference import sigmoid_rows
from strata.quant import QTensor, qmatmul
from strata.quant.formats import FLOAT_TYPES

_ROUTER_LOGITS = registry.op("router_logits")


@dataclass
class Routing:
    n_experts: int
    k: int
    gating: str = "softmax"  # softmax | sigmoid | softmax_weight (top-k of the logits, softmax over those k)
    norm_topk: bool = True
    scale: float = 1.0
    n_groups: int = 1
    topk_groups: int = 1


def route(logits: torch.Tensor, r: Routing, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, E] float32 -> (ids [N, k] int64, weights [N, k] float32)."""
    if r.gating == "softmax_weight":  # gpt-oss: choose on the logits, weigh the chosen k by their own softmax
        top = logits.topk(r.k, dim=-1)
        return top.indices, torch.softmax(top.values, dim=-1) * r.scale
    if r.n_groups == 1:  # one op (one launch on a GPU): scores, the biased choice, top-k, renormalized weights
        return registry.op("route_topk")(logits, r.k, r.gating == "sigmoid", r.norm_topk, r.scale, bias)
    probs = torch.softmax(logits, dim=-1) if r.gating == "softmax" else sigmoid_rows(logits)  # (row-invariant)
    choose = probs + bias if bias is not None else probs  # the correction bias steers choice, not weights
    if r.n_groups > 1:
        n = choose.shape[0]
        g = choose.view(n, r.n_groups, -1)
        group_score = g.topk(2, dim=-1).values.sum(-1)  # [N, G] (DeepSeek-V3: sum of each group's top two)
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(r.topk_groups, dim=-1).indices, True)
        choose = g.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(n, -1)
    ids = choose.topk(r.k, dim=-1).indices
    w = probs.gather(1, ids)
    if r.norm_topk:
        w = w / (w.sum(-1, keepdim=True) + (1e-20 if r.gating == "sigmoid" else 0.0))
    if r.scale != 1.0:
        w = w * r.scale
    return ids, w


def uniform_route(n: int, r: Routing, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """n tokens -> (ids [n, k] int64, weights [n, k] float32): k distinct experts per token drawn uniformly at
    random, each weighted 1/k (the benchmark's worst case for an expert cache: no expert is hotter than another).

    The top-k of E i.i.d. uniforms is a uniformly random k-subset, drawn on the device by torch's generator: no
    host sync and no Python random, so it runs in eager steps and inside captured CUDA graphs (a replay advances
    the generator's offset, so each replay draws anew). Equal weights rather than the router's top-k weights:
    those belong to the experts the router chose, and carried over to random experts they would only add a
    score unrelated to the draw; 1/k keeps the sum at 1 whatever the family's gating or scale."""
    ids = torch.rand(n, r.n_experts, device=device).topk(r.k, dim=-1).indices  # [n, k]
    w = torch.full((n, r.k), 1.0 / r.k, device=device, dtype=torch.float32)
    return ids, w


class MoE:
    def __init__(self, layer: int, routing: Routing, router: QTensor, experts, bias: torch.Tensor | None = None,
                 shared: SwiGLU | None = None, shared_gate: QTensor | None = None,
                 router_bias: torch.Tensor | None = None):
        # bias steers the choice only (DeepSeek-V3); router_bias is added to the router's logits (gpt-oss)
        self.layer, self.routing, self.router, self.bias = layer, routing, router, bias
        self.router_bias = router_bias.float() if router_bias is not None else None
        self.experts, self.shared, self.shared_gate = experts, shared, shared_gate
        self.uniform = False  # --expert-routing uniform (set once at load: strata.models.base.CausalLM)
        # a float shared-expert gate of the router's format rides along as the router's last row: its logit comes
        # with the routing's (one launch a layer on a GPU instead of a matmul of its own)
        self._gate_row = None
        if shared_gate is not None and router_bias is None and shared_gate.qtype == router.qtype \
                and shared_gate.qtype in FLOAT_TYPES and tuple(shared_gate.shape) == (1, router.shape[1]) \
                and shared_gate.raw.device == router.raw.device and len(router.shape) == 2:
            self._gate_row = router.shape[0]
            self.router = QTensor(torch.cat([router.raw, shared_gate.raw]), router.qtype,
                                  (router.shape[0] + 1, router.shape[1]))

    def route_ids(self, x: torch.Tensor) -> torch.Tensor:
        """The experts this layer's router picks for x [N, d] -> ids [N, k] (a backend predicting this layer's
        routing from an earlier layer's input)."""
        return route(self._logits(x)[0], self.routing, self.bias)[0]

    def _logits(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The router's logits [N, E] float32, and the shared expert's gate logit [N, 1] where it rides along."""
        out = _ROUTER_LOGITS(x, self.router, self.router_bias)
        if self._gate_row is None:
            return out, None
        return out[:, :self._gate_row], out[:, self._gate_row:]

    def __call__(self, x: torch.Tensor, ctx) -> torch.Tensor:
        """x [N, d] -> [N, d] within the step `ctx` (strata.experts.backend.StepContext)."""
        prof = ctx.profiler
        t = prof.mark() if prof else None
        logits, gate = self._logits(x)  # [N, E], [N, 1] or None
        ids, w = route(logits, self.routing, self.bias)
        if self.uniform:  # the router still ran (its cost stays in the step); its choice is dropped
            ids, w = uniform_route(x.shape[0], self.routing, logits.device)
        if prof:
            prof.span("router_shared", t)
        if ctx.on_route is not None:
            ctx.on_route(self.layer, ids)
        out = self.experts.forward(self.layer, x, ids, w, ctx)
        if self.shared is not None:
            t = prof.mark() if prof else None
            s = self.shared(x)
            if gate is not None:  # (the gate's product and the sum in one op)
                out = torch.addcmul(out, s, torch.sigmoid(gate).to(s.dtype))
            elif self.shared_gate is not None:
                out = out + s * torch.sigmoid(qmatmul(x, self.shared_gate))
            else:
                out = out + s
            if prof:
                prof.span("router_shared", t)
        return out
