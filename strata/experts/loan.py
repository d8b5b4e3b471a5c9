"""The prefill chunk buffers lent to the expert cache between prompts (`--chunk-buffer-loan`).

The buffers a prompt's chunks stream experts through sit idle while sequences decode. With the loan they are rows
of the slot pool (strata.experts.cache: past the staging ring), and each layer's policy counts its share of them as
extra slots while decoding. A step that may stream through them borrows them back first: the experts held there
stop being hits (the device map rows are cleared) and copies still landing there are forgotten; the next plain
decode step gives them back, empty, for the cache to refill from what decoding routes. Both turns wait for the
device once (a prompt's worth of work, not a step's): the rows' readers and writers of the other use finish first.
"""

from __future__ import annotations

import time

import torch

from strata.experts.tiered_eager import PAIRS_MAX

# auto takes the loan on a GPU: its GPU test (tests/experts/test_chunk_loan.py) has passed there
GPU_TESTED = True


def loan_tested() -> bool:
    return GPU_TESTED


def loan_turn(t, ctx) -> None:
    """The chunk buffers lie in the pool and are the layers' extra slots between prompts: a step that may
    stream through them (a chunk: more pairs than a decode step computes from the map) borrows them back,
    their experts forgotten; the next plain decode step gives them back, empty, for the cache to refill."""
    big = ctx.n_tokens * max(t.k, 1) > PAIRS_MAX if t.cuda else ctx.phase != "decode"
    cache = t.cache
    if big and cache.lent:
        t0 = time.perf_counter()
        for li, layer in enumerate(t.layer_ids):
            if cache.loan_slots[layer]:
                for e in t.policy.set_capacity(li, cache.layer_slots[layer]):
                    t.pending[li].pop(e, None)  # a copy into a lent row: forgotten (waited for below)
                cache.upload_map(li, t.policy.expert_map()[li])
        if t.cuda:  # (once a prompt) copies into those rows and their readers finish before a chunk's
            torch.cuda.synchronize(t.device)
        cache.lent = False
        t.loans += 1
        t.loan_ms += (time.perf_counter() - t0) * 1e3  # (the sync included: what a prompt waits for the loan)
    elif not big and ctx.phase == "decode" and not cache.lent:
        if t.cuda:  # (once a prompt) the chunk's reads and copies finish before admissions land there
            torch.cuda.synchronize(t.device)
        for st in cache._chunk_stage.values():
            st.pending = None
        for li, layer in enumerate(t.layer_ids):
            if cache.loan_slots[layer]:
                t.policy.set_capacity(li, cache.layer_slots[layer] + cache.loan_slots[layer])
        cache.lent = True

