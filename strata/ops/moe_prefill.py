"""Grouped expert FFN for a prefill chunk: every (token, choice) pair of a MoE layer in a few batched calls.

`grouped_expert_ffn(x, gate, up, down, ids)` computes, for each token n and choice j, expert ids[n, j] applied
to x[n] -- what the per-expert loop (`strata.experts.resident.expert_ffn` on each used expert's tokens, the
reference twin) computes, without a Python loop of matmuls per expert:

 1. the pairs are sorted by expert on the device (argsort + bincount); the counts are read by the host once;
 2. used experts, ordered by token count, are cut into batches of G experts whose dequantized weights
    (G * ff * d elements per projection) and padded activations (G * Tmax rows) stay within a budget;
 3. per batch: the G experts' raw blocks are gathered with one index_select per projection and dequantized in
    one call (`dequantize_flat`, one Triton launch on CUDA), their tokens gathered into a zero-padded
    [G, Tmax, d] tensor, and `torch.bmm` computes silu(x @ gate.T) * (x @ up.T) and then @ down.T;
 4. the rows are scattered back to their pairs (padding rows go to a dummy row).

So a batch costs a constant number of launches, whatever its experts. The math runs in x's dtype (bf16 on the
GPU, float32 on the CPU), as `qmatmul` does per expert.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from strata.quant import QTensor
from strata.quant.dequant import dequantize_flat

# Bytes of dequantized weights per projection per batch (one projection's [G, out, in] is alive at a time).
# The GPU wants few, large batches (launches bound it); the CPU wants batches that stay in its caches: with
# 256 MiB a 64-expert layer ran ~2x slower than the per-expert loop on a 2-core machine, with 4 MiB as fast.
WEIGHT_BYTES = 128 << 20
CPU_WEIGHT_BYTES = 4 << 20
# Bytes of padded activations per batch ([G, Tmax, max(d, ff)] in x's dtype, a few of them alive at a time).
# These two bound a prefill chunk's VRAM beside the expert cache (strata.experts.sizing.prefill_bytes_per_token):
# at 256 MiB each a 4K chunk of a Qwen3-30B-A3B layer peaked at 1.27 GiB above the weights.
ACT_BYTES = 128 << 20
# With every expert resident there is no budget to share: the larger batches (fewer launches) are faster on a 4K
# chunk (docs/BENCHMARKS.md, "Measurements behind the engine's constants")
ROOMY_BYTES = 256 << 20
# Rows of a batch's output widened to float32 at a time on their way into y (the float32 copy of a whole batch
# was the largest temporary of a chunk)
WIDEN_ROWS = 8192
PAD_SHAPES: bool | None = None  # round batch shapes up (None: on CUDA only)


def _dequant(w: QTensor, experts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The experts `experts` [G] of a stack [E, out, in] -> [G, out, in] in dtype, in one dequantize call."""
    raw = w.raw.index_select(0, experts)  # [G, out, row_bytes]
    return dequantize_flat(raw, w.qtype, dtype).view(experts.numel(), *w.shape[1:])


def _batches(counts: list[int], per_expert: int, itemsize: int, width: int, budget: int,
             act_bytes: int = ACT_BYTES) -> list[list[int]]:
    """Used experts cut into batches, largest counts first (so experts of similar counts share the padding):
    each batch within `budget` bytes of one projection and `act_bytes` of [G, Tmax, width] activations."""
    used = sorted((e for e, c in enumerate(counts) if c), key=lambda e: -counts[e])
    g_max = max(1, budget // (per_expert * itemsize))
    batches: list[list[int]] = []
    for e in used:
        b = batches[-1] if batches else None
        # counts only fall along `used`, so the batch's Tmax is its first expert's count
        if b is not None and len(b) < g_max and (len(b) + 1) * counts[b[0]] * width * itemsize <= act_bytes:
            b.append(e)
        else:
            batches.append([e])
    return batches


def _round_g(g: int) -> int:
    return -(-g // 8) * 8


def _round_t(t: int) -> int:
    """Rows per expert rounded up to one of a few dozen sizes (padding <= 1/8 of the rows past 64)."""
    if t <= 64:
        return max(8, 1 << (t - 1).bit_length())
    step = 1 << max((t - 1).bit_length() - 4, 4)  # 1/16 .. 1/8 of t
    return -(-t // step) * step


def grouped_expert_ffn(x: torch.Tensor, gate: QTensor, up: QTensor, down: QTensor, ids: torch.Tensor, *,
                       counts: list[int] | None = None, out: torch.Tensor | None = None,
                       roomy: bool = False) -> torch.Tensor:
    """x [N, d], expert stacks gate/up [E, ff, d] and down [E, d, ff], ids [N, k] int64 -> y [N, k, d] float32:
    y[n, j] = down[e] @ (silu(gate[e] @ x[n]) * (up[e] @ x[n])) for e = ids[n, j] (0 where e < 0), computed in
    x's dtype.

    counts: pairs per expert [E] when the caller knows them on the host (then nothing here waits for the GPU).
    out: a float32 [N * k + 1, d] buffer to write into instead of a new zeroed one: only the pairs with an
    expert are written (the last row takes the padding), so several calls over disjoint pairs fill one buffer.
    roomy: on a GPU, batches of ROOMY_BYTES (no VRAM budget to share: every expert resident).
    """
    N, d = x.shape
    k = ids.shape[1]
    E, ff = gate.shape[0], gate.shape[1]
    dtype = x.dtype if x.dtype.is_floating_point else torch.float32
    dev = x.device
    flat = ids.reshape(-1)  # [P] expert of each pair, pair p = n * k + j; negative: no expert (output 0)
    P = flat.numel()
    flat = torch.where(flat < 0, E, flat)  # no expert (tiered: pairs not on the GPU): sorted last, never computed
    order = torch.argsort(flat, stable=True)  # [P] pairs grouped by expert
    if counts is None:
        counts = torch.bincount(flat, minlength=E + 1).tolist()[:E]  # the one host read
    elif len(counts) != E:
        raise ValueError(f"counts has {len(counts)} entries for {E} experts")
    starts = [0, *itertools.accumulate(counts[:-1])]  # where each expert's pairs begin in `order`

    # one zero row past the tokens (padding reads it) and one dummy row past the pairs (padding writes it)
    xp = torch.cat([x.to(dtype), x.new_zeros(1, d, dtype=dtype)])  # [N + 1, d]
    if out is None:
        y = torch.zeros(P + 1, d, dtype=torch.float32, device=dev)  # [P + 1, d]: pairs without an expert stay 0
    elif out.shape != (P + 1, d) or out.dtype != torch.float32:
        raise ValueError(f"out must be float32 [{P + 1}, {d}], got {out.dtype} {list(out.shape)}")
    else:
        y = out
    order_p = torch.cat([order, order.new_full((1,), P)])  # [P + 1]: index P -> the dummy pair
    itemsize = torch.finfo(dtype).bits // 8
    budget = (ROOMY_BYTES if roomy else WEIGHT_BYTES) if dev.type == "cuda" else CPU_WEIGHT_BYTES
    act_bytes = ROOMY_BYTES if roomy and dev.type == "cuda" else ACT_BYTES
    batches = _batches(counts, ff * d, itemsize, max(d, ff), budget, act_bytes)
    # On CUDA the batch shapes are rounded up (padding experts with no tokens, padding rows): cuBLAS picks a
    # kernel per new shape at a host cost of ~0.3 ms, which a chunk's varying counts would pay on every call.
    pad = dev.type == "cuda" if PAD_SHAPES is None else PAD_SHAPES
    shapes = [(_round_g(len(b)) if pad else len(b), _round_t(counts[b[0]]) if pad else counts[b[0]]) for b in batches]
    cols: list[tuple[int, int, int]] = []
    for b, (G, _) in zip(batches, shapes):
        cols += [(starts[e], counts[e], e) for e in b] + [(0, 0, b[0])] * (G - len(b))  # padding: no tokens
    # every batch's (start, count, expert) in one host->device copy (pinned: no wait for the stream)
    host = torch.tensor(list(zip(*cols)), dtype=torch.int64)
    meta = host.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else host  # [3, columns]
    a = 0
    for G, T in shapes:
        start, count, experts = meta[:, a:a + G]  # [G] each
        a += G
        t = torch.arange(T, device=dev)  # [T]
        valid = t < count[:, None]  # [G, T]
        pos = torch.where(valid, start[:, None] + t, P)  # [G, T] position in order_p (P: padding)
        pair = order_p[pos]  # [G, T] pair index, P for padding
        tok = torch.where(valid, pair // k, N)  # [G, T] token row of xp, N (the zero row) for padding
        xs = xp[tok]  # [G, T, d]
        w = _dequant(gate, experts, dtype)  # [G, ff, d]
        h = F.silu(torch.bmm(xs, w.transpose(1, 2)))  # [G, T, ff]
        del w
        w = _dequant(up, experts, dtype)
        h = h * torch.bmm(xs, w.transpose(1, 2))
        del w, xs
        w = _dequant(down, experts, dtype)  # [G, d, ff]
        out = torch.bmm(h, w.transpose(1, 2))  # [G, T, d]
        del w, h
        pair, out = pair.reshape(-1), out.reshape(G * T, d)
        for r in range(0, G * T, WIDEN_ROWS):
            y.index_copy_(0, pair[r:r + WIDEN_ROWS], out[r:r + WIDEN_ROWS].float())
    return y[:P].view(N, k, d)
