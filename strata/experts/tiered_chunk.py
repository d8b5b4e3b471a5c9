"""The tiered backend's prefill-chunk streaming (`strata.experts.tiered.TieredExperts` on a chunk).

A chunk routes its tokens to most experts of a layer; the uncached ones cross PCIe once for the chunk. They land
in the cache's two chunk buffers (`ExpertCache.chunk_stage`), as many per batch as a buffer holds, one grouped
FFN call per batch; buffers alternate so the copy of batch i + 1 runs while batch i computes. And while a layer
computes, the next layer's uncached experts (hottest first) are copied into the buffer it is not using: a large
chunk will need nearly all of them, and that copy then overlaps this layer's rest and the next attention.
"""

from __future__ import annotations

import numpy as np


def stream_chunk(be, layer: int, x, staged, y, t_pcie, waited: bool, pre) -> None:
    """A chunk's streamed experts (be: the TieredExperts backend) through the two chunk buffers: first those
    prefetched (copied during the previous layer), then the rest, as many per batch as a buffer holds, alternating
    buffers so the copy of batch i + 1 runs while batch i computes (one grouped call per batch, no host waits)."""
    cache = be.cache
    stage = cache.chunk_stage(layer)
    n = stage.experts
    j = 0
    if pre is not None:
        mine = [(pre.index[e], tok, p) for e, tok, p in staged if e in pre.index]
        staged = [g for g in staged if g[0] not in pre.index]
        j = pre.buf
        cache.wait(pre.event)
        if be.profiling and not waited:
            be._span("pcie_wait", t_pcie)
            waited = True
        if mine:
            cache.prefetch_used += len(mine)
            be._grouped(*stage.bufs[j], x, mine, y)
        stage.done[j] = cache.record()
        stage.last, j = j, 1 - j
    for i in range(0, len(staged), n):
        batch = staged[i:i + n]
        buf = stage.bufs[j]
        # the copy waits only for the last compute that read this buffer
        ev = cache.copy_many(layer, [e for e, _, _ in batch], buf, after=stage.done[j])
        cache.wait(ev)
        if be.profiling and not waited:
            be._span("pcie_wait", t_pcie)
            waited = True
        be._grouped(*buf, x, [(s, tok, p) for s, (_, tok, p) in enumerate(batch)], y)
        stage.done[j] = cache.record()
        stage.last, j = j, 1 - j
    if be.profiling and not waited:
        be._span("pcie_wait", t_pcie)


def prefetch(be, li: int) -> None:
    """Copy MoE layer li's uncached experts, hottest first, into the chunk buffer its layer is not using:
    a large chunk routes to nearly every expert, so they will be needed (those that are not cost link time
    only). The layer's forward computes them from there."""
    layer = be.layer_ids[li]
    stage = be.cache.chunk_stage(layer)
    row, pending = be.policy.expert_map()[li], be._pending[li]
    scores = be.policy.scores(li)
    cand = [e for e in np.argsort(-scores, kind="stable").tolist() if row[e] < 0 and e not in pending]
    cand = sorted(cand[:stage.experts])  # in id order: runs of consecutive experts copy as one
    if not cand:
        return
    j = 1 - stage.last
    ev = be.cache.copy_many(layer, cand, stage.bufs[j], after=stage.done[j])
    stage.prefetch(layer, cand, j, ev)
    be.cache.prefetched += len(cand)
