"""Tiered experts on a CPU alone: every (token, expert) pair computed as the resident backend computes it there.

Without a GPU the cache's slots, the staging ring and the CPU lane all live in RAM and run on the same cores, so a
cached expert, a streamed one and one the lane computes can give the same bits. They must: the resident backend's
CPU path rounds activations to int8 (the native kernel, `strata.experts.resident._cpu_native` and
`strata.ops.cpu_gemv`) for decode-sized work and keeps float32 for larger per-expert products, and a missed expert
computed another way (the lane's float32 `ref`) made a greedy text depend on what the cache held.

The resident rule, per MoE layer on the CPU: the step's rows are cut as `group_slices(N, CPU_NATIVE_TOKENS)` cuts
them (each sequence's rows as its step alone computes them); a part of at most CPU_NATIVE_TOKENS tokens takes the
native kernel's fused call for each pair (where it reads the format and cpu_exact() is off), a larger part the
per-expert chain `expert_ffn` over that part's tokens of the expert (qmatmul, whose own choice between int8 and
float32 follows the rows it is given). The fused kernel and the chain round alike but sum in other orders: the same
pair on the two paths is close, not equal, so the part's size must pick the path here exactly as it does there.
Each pair's result depends only on its row, its expert's bytes and that choice (the fused kernel quantizes and dots
each pair by itself), so hits, streamed experts and the lane's share may be computed in separate calls.
"""

from __future__ import annotations

from typing import Callable

import torch

from strata.experts.resident import CPU_NATIVE_TOKENS, ExpertAct, _cpu_native, expert_ffn
from strata.quant.matmul import group_slices

# (keys [n], expert ids [n], x [m, d] float32, rows [n]) -> [n, d] float32: the fused kernel over pairs
Fused = Callable[[list, list, torch.Tensor, list], torch.Tensor]


def parts(n: int) -> list[slice]:
    """The row ranges of an n-row step that the resident backend computes apart on the CPU."""
    return group_slices(n, CPU_NATIVE_TOKENS) or [slice(0, n)]


def resident_rows(x: torch.Tensor, groups, weights, fused: Fused | None, act: ExpertAct | None) -> torch.Tensor:
    """groups [(key, expert id, token indices [t] ascending)] over x [N, d] (the whole step's rows) -> [sum t, d]
    float32 in group order, each row the pair's output as ResidentExperts gives it on the CPU. weights(key) -> the
    expert's (gate, up, down) QTensors; fused: the native kernel over keys, or None where the resident path would
    not take it (a format it lacks, cpu_exact)."""
    sizes = [int(t.numel()) for _, _, t in groups]
    out = torch.empty(sum(sizes), x.shape[-1], dtype=torch.float32)
    starts = torch.tensor([0] + sizes).cumsum(0).tolist()
    xf = None
    for c in parts(x.shape[0]):
        picks = []  # (key, expert, tokens in this part, their output rows)
        for (key, e, tok), s in zip(groups, starts):
            m = (tok >= c.start) & (tok < c.stop)
            if bool(m.any()):
                picks.append((key, e, tok[m], s + torch.nonzero(m).view(-1)))
        if not picks:
            continue
        if fused is not None and c.stop - c.start <= CPU_NATIVE_TOKENS:
            if xf is None:
                xf = x.float().contiguous()
            keys = [key for key, _, t, _ in picks for _ in range(t.numel())]
            eids = [e for _, e, t, _ in picks for _ in range(t.numel())]
            rows = torch.cat([t for _, _, t, _ in picks]).tolist()
            out[torch.cat([r for _, _, _, r in picks])] = fused(keys, eids, xf, rows)
            continue
        for key, e, t, r in picks:
            out[r] = expert_ffn(x[t], *weights(key), act, e).float()
    return out


def store_fused(ew) -> Fused | None:
    """The resident backend's own fused call for these (host) experts, keyed by expert id; None where it has none."""
    nat = _cpu_native(ew)
    if nat is None:
        return None
    return lambda keys, eids, x, rows: nat(keys, x, rows)


class PoolFused:
    """The fused kernel over a slot pool's stacks (keys: pool slots). The pool's slots change experts, and a layer of
    biased experts (gpt-oss) needs each pair's biases by its expert: they are written into per-slot rows of the
    kernel's bias tables just before each call (a pool serves several layers; the calls are on one thread)."""

    def __init__(self, pool, act: ExpertAct | None):
        from strata.ops.cpu_native import NativeExperts

        kw = {}
        if act is not None:
            n = pool.gate.shape[0]
            kw = dict(act=act.kind, alpha=act.alpha, limit=act.limit)
            kw.update({k: torch.zeros(n, getattr(act, k).shape[-1]) for k in ("gate_b", "up_b", "down_b")
                       if getattr(act, k) is not None})
        self.bias = {k: kw[k] for k in ("gate_b", "up_b", "down_b") if k in kw}
        self.nat = NativeExperts(pool.gate.raw, pool.up.raw, pool.down.raw, fmt_gate_up=pool.gate.qtype.name,
                                 fmt_up=pool.up.qtype.name, fmt_down=pool.down.qtype.name, **kw)
        self.ptr = pool.gate.raw.data_ptr()

    def __call__(self, act: ExpertAct | None, keys, eids, x, rows) -> torch.Tensor:
        if self.bias:
            slots, ids = torch.tensor(keys), torch.tensor(eids)
            for name, table in self.bias.items():
                table[slots] = getattr(act, name).index_select(0, ids).to(torch.float32)
        return self.nat(keys, x, rows)


def pool_fused(cache: dict, pool, store_ew, act: ExpertAct | None) -> Fused | None:
    """The fused call over `pool` (made once, kept in `cache` by the pool), or None where the resident path would
    not take the fused kernel for these experts (`store_ew`: the layer's host experts)."""
    if _cpu_native(store_ew) is None or not all(t.raw.is_contiguous() for t in (pool.gate, pool.up, pool.down)):
        return None
    key = (id(pool), act is None)
    got = cache.get(key)
    if got is None or got.ptr != pool.gate.raw.data_ptr():  # (a pool's buffers are fixed on a CPU; checked anyway)
        got = cache[key] = PoolFused(pool, act)
    return lambda keys, eids, x, rows: got(act, keys, eids, x, rows)
