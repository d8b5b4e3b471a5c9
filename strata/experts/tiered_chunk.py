"""The tiered backend's prefill-chunk streaming (the eager executor, `strata.experts.tiered_eager`, on a chunk).

A chunk routes its tokens to most experts of a layer; the uncached ones cross PCIe once for the chunk. They land
in the cache's ring of chunk buffers (`ExpertCache.chunk_stage`), one grouped FFN call per buffer. The copy into
a buffer waits only for that buffer's last reader, so copies run ahead of the compute by up to the ring's size.
While a layer computes, the next layer's uncached experts (hottest first, up to the ring's capacity) are copied
ahead: a large chunk will need nearly all of them, and those copies overlap this layer's compute and the next
attention instead of waiting for the next layer's routing.
"""

from __future__ import annotations

import numpy as np


def stream_chunk(ex, layer: int, x, staged, y, t_pcie, waited: bool, pre) -> None:
    """A chunk's streamed experts (ex: the eager executor; staged: [(expert, tokens, pairs)]) computed
    from the chunk ring: first those prefetched (copied during the previous layer), then the rest, a buffer per
    batch (one grouped call per buffer, no host waits)."""
    be = ex.t
    cache = be.cache
    stage = cache.chunk_stage(layer)

    def compute(b, groups, ev):
        nonlocal waited
        cache.wait(ev)
        if be.profiler and not waited:
            be.profiler.span("pcie_wait", t_pcie)
            waited = True
        ex.grouped(*stage.bufs[b], x, groups, y)
        stage.done[b] = cache.record()

    if pre is not None:
        routed = {e: (tok, p) for e, tok, p in staged}
        for b, experts, ev in pre.batches:
            mine = [(j, *routed[e]) for j, e in enumerate(experts) if e in routed]
            if mine:  # a batch nobody was routed to has no reader: the copy stream orders its buffer's next copy
                cache.prefetch_used += len(mine)
                compute(b, mine, ev)
        staged = [g for g in staged if g[0] not in pre.index]
    n = stage.experts
    for i in range(0, len(staged), n):
        batch = staged[i:i + n]
        b = stage.take()
        ev = cache.copy_many(layer, [e for e, _, _ in batch], stage.bufs[b], after=stage.done[b])
        compute(b, [(s, tok, p) for s, (_, tok, p) in enumerate(batch)], ev)
    if be.profiler and not waited:
        be.profiler.span("pcie_wait", t_pcie)


def prefetch(be, li: int) -> None:
    """(be: the TieredExperts backend.) Copy MoE layer li's uncached experts, hottest first and at most the ring's capacity (more would overwrite
    its own first batches), into the ring's next buffers: a large chunk routes to nearly every expert, so they
    will be needed (those that are not cost link time only). The layer's forward computes them from there."""
    layer = be.layer_ids[li]
    stage = be.cache.chunk_stage(layer)
    row, pending = be.policy.expert_map()[li], be.pending[li]
    scores = be.policy.scores(li)
    cand = [e for e in np.argsort(-scores, kind="stable").tolist() if row[e] < 0 and e not in pending]
    cand = sorted(cand[:stage.capacity])  # in id order: runs of consecutive experts copy as one
    if not cand:
        return
    batches = []
    for i in range(0, len(cand), stage.experts):
        part = cand[i:i + stage.experts]
        b = stage.take()
        batches.append((b, part, be.cache.copy_many(layer, part, stage.bufs[b], after=stage.done[b])))
    stage.prefetch(layer, batches)
    be.cache.prefetched += len(cand)
