"""The prefill chunk buffers lent to the expert cache between prompts (`--chunk-buffer-loan`), and with them the
VRAM a prompt chunk's activations take (`--prefill-loan`, strata.experts.releasable).

The buffers a prompt's chunks stream experts through sit idle while sequences decode. With the loan they are rows
of the slot pool (strata.experts.cache: past the staging ring), and each layer's policy counts its share of them as
extra slots while decoding. A step that may stream through them borrows them back first: the experts held there
stop being hits (the device map rows are cleared) and copies still landing there are forgotten; the next plain
decode step gives them back, empty, for the cache to refill from what decoding routes. Both turns wait for the
device once (a prompt's worth of work, not a step's): the rows' readers and writers of the other use finish first.
"""

from __future__ import annotations

import logging
import time

import torch

from strata.experts import cache as cache_mod
from strata.experts import releasable, sizing
from strata.experts.tiered_eager import PAIRS_MAX

log = logging.getLogger("strata")

# auto takes the loan on a GPU: its GPU test (tests/experts/test_chunk_loan.py) has passed there
GPU_TESTED = True


def loan_tested() -> bool:
    return GPU_TESTED


# slots a layer a CPU run lends as a GPU lends its prefill activations' VRAM (a CPU has none: the tests set it)
CPU_ACT_SLOTS = 0


def prefill_loan_slots(t, act_bytes: int) -> int:
    """--prefill-loan: the slots a layer the VRAM of a prompt chunk's activations holds between prompts (0: off).
    auto: on for a GPU once its GPU test has passed there (sizing.PREFILL_LOAN_GPU_TESTED), with the chunk
    buffers' loan."""
    want = t.ex.prefill_loan
    if want == "off" or not t._loan_wanted() or (want == "auto" and not (t.cuda and sizing.PREFILL_LOAN_GPU_TESTED)):
        return 0
    why = None if not t.cuda else ("the CUDA driver is not reachable" if not releasable.available()
                                   else releasable.probe(t.device))
    if why is not None:
        log.warning("strata: --prefill-loan off: the CUDA driver's virtual memory calls failed here (%s)", why)
        return 0
    per_slot = sum(t.store.expert_nbytes(i) for i in t.layer_ids)  # one slot in every layer
    n = int(act_bytes) // per_slot if t.cuda else CPU_ACT_SLOTS
    if n:
        log.info("strata: the prefill activations' VRAM (%.2f GiB) lent to the cache between prompts: %d more slots "
                 "a layer while decoding", n * per_slot / 2**30, n)
    return n


def _shift_cap(device: torch.device, delta: int) -> None:
    """Move the cap on torch's allocator (cache.cap_to_budget) by `delta` bytes: VRAM the pool handed back to the
    device is the prompt's to allocate, and no longer once the pool maps it again."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index in cache_mod.CAP_BYTES:
        cache_mod.CAP_BYTES[index] += int(delta)
        total = torch.cuda.mem_get_info(device)[1]
        torch.cuda.set_per_process_memory_fraction(min(1.0, max(cache_mod.CAP_BYTES[index], 0) / total), index)


def release_activations(t) -> int:
    """A prompt borrows the lent rows in the activations' VRAM: their memory goes back to the device (the rows'
    experts are already evicted and their readers done); returns the bytes released."""
    freed = sum(r.release() for pool in t.cache.pools for r in pool.releasable)
    if freed and t.cuda:
        _shift_cap(t.device, freed)
    return freed


def restore_activations(t) -> bool:
    """Map the activations' VRAM into the pool again after a prompt (its blocks given back to the device first);
    False when the device has no room for it now (those rows stay out of the cache until the next prompt), or once
    a step ran out of memory beside them (`end_activation_loan`: for good)."""
    if getattr(t, "act_loan_ended", False):
        return False
    bufs = [r for pool in t.cache.pools for r in pool.releasable if r.released]
    if not bufs:
        return True
    if t.cuda:
        torch.cuda.empty_cache()  # the prompt's freed activations, back to the device
        _shift_cap(t.device, -sum(r.lendable() for r in bufs))
    try:
        for r in bufs:
            r.restore()
    except torch.OutOfMemoryError as e:
        if t.cuda:
            _shift_cap(t.device, sum(r.lendable() for r in bufs if r.released))
        log.warning("strata: the prefill activations' VRAM could not go back to the expert cache (%s); its slots "
                    "stay empty until the next prompt", e)
        return False
    return True


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
        release_activations(t)
        cache.lent = False
        t.loans += 1
        t.loan_ms += (time.perf_counter() - t0) * 1e3  # (the sync included: what a prompt waits for the loan)
    elif not big and ctx.phase == "decode" and not cache.lent:
        if t.cuda:  # (once a prompt) the chunk's reads and copies finish before admissions land there
            torch.cuda.synchronize(t.device)
        for st in cache._chunk_stage.values():
            st.pending = None
        back = restore_activations(t)
        for li, layer in enumerate(t.layer_ids):
            if cache.loan_slots[layer]:
                out = 0 if back else cache.act_slots[layer]
                t.policy.set_capacity(li, cache.layer_slots[layer] + cache.loan_slots[layer] - out)
        cache.lent = True



def end_activation_loan(t) -> bool:
    """A decode step ran out of VRAM while the prompt activations' VRAM was the cache's: their rows' experts are
    evicted, the VRAM goes back to the device, and it is not lent again (the step can then run once more). False
    when nothing was lent there."""
    cache = t.cache
    if cache is None or getattr(t, "act_loan_ended", False) or not any(cache.act_slots.values()):
        return False
    t.act_loan_ended = True
    if not cache.lent:  # (a prompt holds them now; restore_activations keeps them out from here on)
        return True
    if t.cuda:  # (the rows' readers and the copies landing there finish first)
        torch.cuda.synchronize(t.device)
    for li, layer in enumerate(t.layer_ids):
        if cache.act_slots[layer]:
            cap = cache.layer_slots[layer] + cache.loan_slots[layer] - cache.act_slots[layer]
            for e in t.policy.set_capacity(li, cap):
                t.pending[li].pop(e, None)
            cache.upload_map(li, t.policy.expert_map()[li])
    release_activations(t)
    return True
