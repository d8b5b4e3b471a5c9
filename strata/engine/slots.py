"""Decoding sequences kept in the lowest KV slots, so that captured decode steps are keyed by a count.

A graphed decode step bakes its sequences' KV slots into the graph (attention reads a slot's window as a view),
so `DecodeGraphs` captures once per (set of slots, window). With `--parallel N` and clients coming and going, the
decoding set changes at every request boundary ({0}, {0, 2}, {1, 2, 3}, ...), and each new set cost a capture
(two warm-up forwards and a captured one) inside somebody's request. Here, before a graphed step, every decoding
sequence that sits outside slots 0 .. b-1 trades places with a slot in that range that no decoding sequence
holds: the two slots' KV rows (and recurrent state) are exchanged on the device, and with them everything the
engine knows about each slot (its tokens for prefix reuse, free or taken, the sequence in it). The step's
segments are then put in slot order, so a step of b sequences always has the slots (0, ..., b-1): at most one
capture per count and window, ever. An exchange copies the two slots' used rows once each way (device memory,
microseconds for a short context) and happens only when the set changes.
"""

from __future__ import annotations


def compact(engine, plan) -> None:
    """Move the plan's sequences (a decode or verify step: no prefill) into slots 0 .. b-1 and sort its segments
    by slot (owners, segments, tokens, positions and the rows drawn from alike)."""
    b = len(plan.segs)
    held = {seg.slot for seg in plan.segs}
    targets = sorted(set(range(b)) - held)
    if targets:
        movers = sorted((s for s in plan.owners if s.slot >= b), key=lambda s: s.slot)
        by_slot = {s.slot: s for s in engine.running}
        for s, t in zip(movers, targets):
            _exchange(engine, s.slot, t, by_slot)
        for seg, s in zip(plan.segs, plan.owners):
            seg.slot = s.slot
    order = sorted(range(b), key=lambda i: plan.segs[i].slot)
    if order == list(range(b)):
        return
    at, spans = 0, []  # each segment's run of the flattened tokens (a verify segment has several)
    for seg in plan.segs:
        spans.append((at, at + seg.n))
        at += seg.n
    rows = None
    if plan.rows is not None:  # the rows drawn from, as offsets within each segment's run
        rows = [[r - a for r in plan.rows if a <= r < e] for a, e in spans]
    plan.segs = [plan.segs[i] for i in order]
    plan.owners = [plan.owners[i] for i in order]
    plan.toks = [t for i in order for t in plan.toks[spans[i][0]:spans[i][1]]]
    plan.poss = [p for i in order for p in plan.poss[spans[i][0]:spans[i][1]]]
    if rows is not None:
        plan.rows, at = [], 0
        for i in order:
            plan.rows += [at + r for r in rows[i]]
            at += spans[i][1] - spans[i][0]


def _exchange(engine, a: int, b: int, by_slot: dict) -> None:
    """Slots a and b trade contents and identities (KV rows, recurrent state, the engine's records)."""
    sa, sb = by_slot.get(a), by_slot.get(b)
    toks = engine.slot_tokens
    n = max(len(toks[a]), len(toks[b]), sa.pos + 1 if sa else 0, sb.pos + 1 if sb else 0)
    engine.kv.swap_slots(a, b, min(n, engine.max_ctx))
    if engine.mtp is not None:  # the MTP block's own cache rows sit one past the trunk's
        engine.mtp.kv.swap_slots(a, b, min(n + 2, engine.mtp.kv.max_ctx))
    toks[a], toks[b] = toks[b], toks[a]
    st = engine._state_tokens
    va, vb = st.pop(a, None), st.pop(b, None)
    if va is not None:
        st[b] = va
    if vb is not None:
        st[a] = vb
    bad = engine._state_bad
    ia, ib = a in bad, b in bad
    bad.discard(a)
    bad.discard(b)
    if ia:
        bad.add(b)
    if ib:
        bad.add(a)
    free = engine.free_slots
    fa, fb = a in free, b in free
    if fa != fb:  # one of them is free: the free one's number changes
        free[free.index(a if fa else b)] = b if fa else a
    if sa is not None:
        sa.slot = b
    if sb is not None:
        sb.slot = a
    by_slot.pop(a, None)
    by_slot.pop(b, None)
    if sa is not None:
        by_slot[b] = sa
    if sb is not None:
        by_slot[a] = sb


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two token lists share (what a slot's KV serves of a new prompt)."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
