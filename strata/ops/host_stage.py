"""Missed experts staged from pinned host RAM into VRAM slots by a kernel, inside a captured decode step.

A decode step of several sequences routes many of them to the same expert, and a kernel reading misses in place
(`two_tier_expert_ffn`) reads such an expert over the bus once per pair that uses it. Here one launch first
copies each DISTINCT missed expert of a layer into a staging slot of the layer's pool (gate, up and down rows,
raw bytes: any format), and the pairs' slots are rewritten to point at it; the fused expert kernel then reads
only VRAM. Everything is decided on the device (no host in the loop, static shapes: capturable):

    slots [P] (negative: a miss), eids [P] each pair's expert
    distinct missed experts, numbered j = 0, 1, ... in order of first occurrence
    j < n:   host[e_j] -> pool[base + j] (three tensors), and its pairs' slots := base + j
    j >= n:  the pairs stay misses (the caller's kernel reads them in place)

Reference twin: `strata.ops.reference.stage_misses` (torch). The Triton kernel is tested in the interpreter on
the CPU and on the GPU (tests/ops/test_host_stage.py).
"""

from __future__ import annotations

import torch

from strata.ops import registry

try:  # Triton is optional: without it the torch twin runs
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

WORDS = 2048  # u32 words one program copies (8 KB: enough bytes in flight per program for a bus read)


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _leaders(slots, eids, P, PB: tl.constexpr):
        """Each pair's slot and expert, which pairs miss, which lead (the first miss of their expert) and the
        leaders' numbers (in order of first occurrence)."""
        i = tl.arange(0, PB)
        im = i < P
        s = tl.load(slots + i, mask=im, other=0)
        e = tl.load(eids + i, mask=im, other=-1)
        miss = im & (s < 0)
        same = (e[:, None] == e[None, :]) & miss[:, None] & miss[None, :] & (i[None, :] < i[:, None])
        lead = miss & (tl.sum(same.to(tl.int32), axis=1) == 0)
        rank = tl.cumsum(lead.to(tl.int32), axis=0) - 1
        return i, im, s, e, miss, lead, rank

    @triton.jit
    def _rewrite(out, i, im, s, e, miss, lead, rank, base, n):
        # pair p's number: the rank of the leader of its expert
        first = (e[:, None] == e[None, :]) & lead[None, :]  # [p, q]: q leads p's expert
        rp = tl.sum(tl.where(first, rank[None, :], 0), axis=1)
        tl.store(out + i, tl.where(miss & (rp < n), base + rp, s), mask=im)

    @triton.jit
    def _copy_part(j, c, t, e, lead, rank, h0, h1, h2, p0, p1, p2, w0, w1, w2, base, n, BLOCK: tl.constexpr):
        """Words c*BLOCK .. of tensor t (gate, up, down) of the j-th distinct missed expert into staging slot
        base + j (nothing when there is no j-th, or j >= n)."""
        mine = lead & (rank == j)
        if j < n:
            if tl.sum(mine.to(tl.int32), axis=0) > 0:
                ex = tl.sum(tl.where(mine, e, 0), axis=0).to(tl.int64)
                if t == 0:
                    src, dst, W = h0, p0, w0
                elif t == 1:
                    src, dst, W = h1, p1, w1
                else:
                    src, dst, W = h2, p2, w2
                off = c.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
                m = off < W
                v = tl.load(src + ex * W + off, mask=m, other=0)
                tl.store(dst + (base + j).to(tl.int64) * W + off, v, mask=m)

    @triton.jit
    def _stage_kernel(slots, eids, out, h0, h1, h2, p0, p1, p2, w0, w1, w2, P, base, n,
                      PB: tl.constexpr, BLOCK: tl.constexpr):
        j = tl.program_id(0)  # the staging slot (distinct missed expert number j)
        c = tl.program_id(1)  # the chunk of words of a tensor
        t = tl.program_id(2)  # gate, up, down
        i, im, s, e, miss, lead, rank = _leaders(slots, eids, P, PB)
        if (j == 0) & (c == 0) & (t == 0):  # one program rewrites the slots
            _rewrite(out, i, im, s, e, miss, lead, rank, base, n)
        _copy_part(j, c, t, e, lead, rank, h0, h1, h2, p0, p1, p2, w0, w1, w2, base, n, BLOCK)

    @triton.jit
    def _stage_loop_kernel(slots, eids, out, h0, h1, h2, p0, p1, p2, w0, w1, w2, P, base, n, chunks, items,
                           PB: tl.constexpr, BLOCK: tl.constexpr, PROGRAMS: tl.constexpr):
        """The same copies by PROGRAMS programs, each looping over the (expert, chunk, tensor) parts: a launch
        that leaves the other SMs to work running beside it (a prefetch on a side stream)."""
        pid = tl.program_id(0)
        i, im, s, e, miss, lead, rank = _leaders(slots, eids, P, PB)
        if pid == 0:
            _rewrite(out, i, im, s, e, miss, lead, rank, base, n)
        for w in range(pid, items, PROGRAMS):
            t = w % 3
            c = (w // 3) % chunks
            j = w // (3 * chunks)
            _copy_part(j, c, t, e, lead, rank, h0, h1, h2, p0, p1, p2, w0, w1, w2, base, n, BLOCK)


    @triton.jit
    def _lookup_kernel(flat, smap, pmap, rec, out, P, R, PB: tl.constexpr, MODE: tl.constexpr):
        """lookup_slots in one program: MODE 0 plain, 1 with the prefetch's map, 2 filling the record's row 2."""
        i = tl.arange(0, PB)
        m = i < P
        e = tl.load(flat + i, mask=m, other=0).to(tl.int64)
        s = tl.load(smap + e, mask=m, other=-1)
        tl.store(rec + i, e, mask=m)
        tl.store(rec + R + i, s, mask=m)
        if MODE == 1:
            s = tl.where(s >= 0, s, tl.load(pmap + e, mask=m, other=-1))
        if MODE == 2:
            tl.store(rec + 2 * R + i, tl.full([PB], -1, tl.int64), mask=m)
        tl.store(out + i, s, mask=m)

    @triton.jit
    def _commit_kernel(pid, cached, staged, pmap, rec2, P, E, PB: tl.constexpr, EB: tl.constexpr):
        """commit_prefetch in one program: the map cleared, a barrier, then the staged experts written."""
        a = tl.arange(0, EB)
        tl.store(pmap + a, tl.full([EB], -1, tl.int64), mask=a < E)
        tl.debug_barrier()  # (the clearing stores land before the writes below, made by other threads)
        i = tl.arange(0, PB)
        m = i < P
        e = tl.load(pid + i, mask=m, other=0).to(tl.int64)
        got = tl.where(tl.load(cached + i, mask=m, other=0) < 0, tl.load(staged + i, mask=m, other=-1), -1)
        tl.store(pmap + e, got, mask=m)
        tl.store(rec2 + i, tl.where(got >= 0, e, -1), mask=m)


def triton_lookup_slots(flat, slot_map, rec, pmap=None, fill: bool = False) -> torch.Tensor:
    P = flat.shape[0]
    out = torch.empty(P, dtype=slot_map.dtype, device=flat.device)
    if P:
        mode = 1 if pmap is not None else 2 if fill else 0
        _lookup_kernel[(1,)](flat, slot_map, pmap if pmap is not None else slot_map, rec, out, P, rec.stride(0),
                             PB=triton.next_power_of_2(P), MODE=mode, num_warps=1)
    return out


def triton_commit_prefetch(pid, cached, staged, pmap, rec2) -> None:
    P, E = pid.shape[0], pmap.shape[0]
    _commit_kernel[(1,)](pid, cached, staged, pmap, rec2, P, E, PB=triton.next_power_of_2(max(P, 1)),
                         EB=triton.next_power_of_2(E), num_warps=4)


def _words(raw: torch.Tensor) -> torch.Tensor:
    """A stack's bytes as u32 words [n, words of one expert] (int32 view: the copy moves bits)."""
    return raw.view(raw.shape[0], -1).view(torch.int32)


def triton_stage_misses(slots: torch.Tensor, eids: torch.Tensor, host, pool, base: int, n: int,
                        programs: int = 0) -> torch.Tensor:
    P = slots.shape[0]
    out = torch.empty_like(slots)
    if P == 0:
        return out
    h = [_words(t.raw) for t in host]
    p = [_words(t.raw) for t in pool]
    W = [x.shape[1] for x in h]
    chunks = triton.cdiv(max(W), WORDS)
    args = (slots, eids, out, h[0], h[1], h[2], p[0], p[1], p[2], W[0], W[1], W[2], P, base, n)
    js = max(1, min(n, P))
    if programs > 0:  # a bounded grid, each program looping over its share of the parts
        _stage_loop_kernel[(programs,)](*args, chunks, js * chunks * 3, PB=triton.next_power_of_2(P),
                                        BLOCK=WORDS, PROGRAMS=programs, num_warps=4)
    else:
        _stage_kernel[(js, chunks, 3)](*args, PB=triton.next_power_of_2(P), BLOCK=WORDS, num_warps=4)
    return out


def stageable(stacks) -> bool:
    """Whether the kernel copies these stacks' experts (each a whole number of u32 words, 4-byte aligned): a GPU
    decode path checks this before it stages misses inside a captured step, where the torch twin cannot run."""
    return triton is not None and all(t.raw[0].numel() % 4 == 0 and t.raw.is_contiguous()
                                      and t.raw.data_ptr() % 4 == 0 for t in stacks)


def _when(slots, eids, host, pool, base, n, programs: int = 0) -> bool:
    return slots.is_cuda and slots.shape[0] <= 128 and stageable((*host, *pool))


registry.op("stage_misses").register("triton", triton_stage_misses, _when)

# The bookkeeping around the staging, a MoE layer's ~15 small torch launches in a decode step (the cache map's
# lookups, `where`, fills and the record's copies), in one launch each side: taken on a GPU since
# tests/ops/test_host_stage.py's GPU test passed on an H200 (the interpreter tests run them on the CPU; B2's decode
# step went from ~2,100 to ~1,300 launches with these and the shared gate's: docs/BENCHMARKS.md, "B2 at 24 GiB").
BOOKKEEPING_GPU_TESTED = True


def _one_program(t: torch.Tensor, *_a, **_k) -> bool:
    return BOOKKEEPING_GPU_TESTED and triton is not None and t.is_cuda and t.shape[0] <= 4096


def _lookup_when(flat, slot_map, rec, pmap=None, fill=False) -> bool:
    return _one_program(flat) and rec.is_contiguous() and rec.dtype == slot_map.dtype == torch.int64


def _commit_when(pid, cached, staged, pmap, rec2) -> bool:
    return _one_program(pid) and pmap.shape[0] <= 4096 and pmap.is_contiguous() and rec2.is_contiguous()


registry.op("lookup_slots").register("triton", triton_lookup_slots, _lookup_when)
registry.op("commit_prefetch").register("triton", triton_commit_prefetch, _commit_when)
lookup_slots = registry.op("lookup_slots")
commit_prefetch = registry.op("commit_prefetch")
# slots [P] int64 (negative: a miss), eids [P] int64, host: the layer's expert stacks where they lie (QTensors [E,
# ...], pinned on CUDA), pool: the pool's stacks (QTensors [S, ...]), base/n: the staging slots base .. base+n ->
# slots [P]: each distinct missed expert (first n, in order of first occurrence) copied into a staging slot and its
# pairs pointed at it; the rest unchanged. programs > 0 (keyword): the copies by that many programs looping over
# the parts (a launch beside other work: the decode prefetch), else one program per part.
stage_misses = registry.op("stage_misses")
