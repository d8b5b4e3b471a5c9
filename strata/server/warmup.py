"""What the server runs before it says ready: one forward pass, then — while the experts backend is still choosing
its CPU / PCIe plan (`--cpu-plan auto` on a GPU, strata.experts.tuner) — sampled decoding of filler text until the
choice is made; on a GPU, prompts of the sizes requests send (alone, and several together where there are parallel
slots), so that the prompt path's kernels are compiled and its buffers sized before the first request, not in it.

The plan tuner times decode steps under each candidate plan, all-CPU ones included, and a step under a poor
candidate can take several times a good one's. Tuned inside user requests, the first requests after start-up
decoded under those trials (a short request after a long prompt ran at a fraction of the steady speed). So the
server makes its own traffic first: sampled text (the tuner prices plans by their misses, and sampled text misses
like real text does; greedy filler repeats itself and barely misses), bounded in time; past the bound the tuner
keeps the best plan it has measured. Requests only arrive once this returns (/health says 503 until then).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from strata.engine.sampler import SamplingParams

log = logging.getLogger("strata.server")

WARMUP_PROMPT_CHARS = 1600  # a few hundred tokens: decode steps attend over a context, as a request's do
WARMUP_TOKENS = 256  # per warm-up generation (the tuner's trials span several)
CAPTURE_WINDOWS = (256, 512, 1024, 2048, 4096)  # decode windows captured for every batch size before ready
CAPTURE_S = 30.0  # at most this long capturing (longer contexts capture when a request first reaches them)
TUNE_TEMPERATURE = 0.8
# Prompt lengths run once each before ready on a GPU: Triton compiles a kernel per specialisation of its integer
# arguments (a length divisible by 16 or not), and the first request of each kind would wait for the compiles. Then,
# with parallel slots, PACKED_PROMPTS prompts arriving together (they share a prefill chunk) and a step of them all.
WARM_PROMPT_TOKENS = (301, 512)
PACKED_PROMPTS = 4


def warm_up(engine, tokenizer, say: Callable[[str], None], tune_s: float, prompts: bool | None = None) -> dict:
    """Warm the engine up; returns what was done ({"tuned": plan or None, "steps": decode steps, "seconds", and
    "prompts": warm-up prompts run}). prompts: run warm_prompts (default: on a GPU)."""
    t0 = time.perf_counter()
    say("warming up (one forward pass)")
    for _ in engine.generate(tokenizer.encode("Hello", add_special=False) or [0], max_tokens=1):
        pass
    experts = engine.model.experts
    out = {"tuned": None, "steps": 0, "seconds": 0.0}
    if experts is not None and experts.tuning():
        from strata.bench.prompts import filler_text

        say(f"choosing the CPU/PCIe plan on warm-up text (at most {tune_s:g} s)")
        deadline = t0 + max(float(tune_s), 0.0)
        seed = 0
        gen = max(1, min(WARMUP_TOKENS, engine.max_ctx // 2))
        while experts.tuning() and time.perf_counter() < deadline:
            # our own filler: cut to what the context holds beside the tokens generated
            prompt = tokenizer.encode(filler_text(WARMUP_PROMPT_CHARS, seed), add_special=False)[:engine.max_ctx - gen]
            params = SamplingParams(temperature=TUNE_TEMPERATURE, seed=seed)
            for _ in engine.generate(prompt or [0], params, max_tokens=gen):
                out["steps"] += 1
                if not experts.tuning() or time.perf_counter() >= deadline:
                    break
            seed += 1
        bounded = experts.tuning()
        out["tuned"] = experts.end_tuning()
        how = "stopped at the time bound, best measured" if bounded else "tuned"
        say(f"CPU/PCIe plan {how}: {out['tuned']} ({out['steps']} decode steps)")
    if (prompts if prompts is not None else engine.device.type == "cuda"):
        t1 = time.perf_counter()
        out["prompts"] = warm_prompts(engine, tokenizer)
        say(f"ran {out['prompts']} warm-up prompts (alone and together) in {time.perf_counter() - t1:.1f} s")
    graphs = getattr(engine, "graphs", None)
    if graphs is not None and graphs.cuda:
        t1 = time.perf_counter()
        n = graphs.prepare(list(CAPTURE_WINDOWS), deadline=t1 + CAPTURE_S)
        say(f"captured {n} decode steps (1-{engine.graph_batch} sequences) in {time.perf_counter() - t1:.1f} s")
        out["captured"] = n
    path = getattr(experts, "decode_misses_path", None)
    if path is not None:  # (a tuned hand-off may have moved to the staged path at the captures' first step)
        why = getattr(experts, "path_reason", "")
        say(f"decode misses: {path}" + (f" ({why})" if why else ""))
    split = getattr(engine, "vram_split", None)
    if split is not None and engine.device.type == "cuda":
        say(vram_after_warm_up(engine.device, split, out))
    # the warm-up's text is nobody's conversation: no slot keeps it, no request's counts include it
    engine.slot_tokens = {s: [] for s in range(engine.n_slots)}
    if experts is not None:
        experts.begin_request()
    out["seconds"] = round(time.perf_counter() - t0, 3)
    return out


def warm_prompts(engine, tokenizer) -> int:
    """Filler prompts of WARM_PROMPT_TOKENS tokens one at a time, then (with several slots) PACKED_PROMPTS of them
    at once, each decoding two sampled tokens; returns how many ran. Lengths are cut to what the context holds."""
    from strata.bench.prompts import filler_text
    from strata.engine.sampler import SamplingParams
    from strata.engine.sequence import Sequence

    gen = 2
    longest = engine.max_ctx - gen
    groups = [[n] for n in WARM_PROMPT_TOKENS]
    if engine.n_slots > 1:
        groups.append([WARM_PROMPT_TOKENS[-1]] * min(engine.n_slots, PACKED_PROMPTS))
    ran = 0
    for g, lengths in enumerate(groups):
        seqs = []
        for j, n in enumerate(lengths):
            n = min(n, longest)
            toks = tokenizer.encode(filler_text(8 * n, 100 + 10 * g + j), add_special=False)[:n]
            if len(toks) >= 2:
                seqs.append(Sequence(toks, SamplingParams(temperature=TUNE_TEMPERATURE, seed=j), gen, set()))
        for s in seqs:
            engine.add(s, reuse_prefix=False)
        try:
            while any(not s.finished for s in seqs):
                engine.step()
            engine.take_failed()
        finally:
            for s in seqs:
                engine.release(s, "abort")
        ran += len(seqs)
    return ran


def vram_after_warm_up(device, split, out: dict) -> str:
    """What the budget holds once prompts ran and decode steps were captured (what the reserve is measured by:
    the device's use against the budget, and torch's allocated / cached bytes); recorded in `out`."""
    import torch

    free, total = torch.cuda.mem_get_info(device)
    used, alloc, held = total - free, torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    retries = int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))  # (at the budget's cap: slow steps)
    out.update(vram_used_gib=round(used / 2**30, 3), torch_allocated_gib=round(alloc / 2**30, 3),
               torch_reserved_gib=round(held / 2**30, 3), budget_gib=round(split.budget / 2**30, 3),
               alloc_retries=retries)
    return (f"VRAM after warm-up: {used / 2**30:.2f} GiB of the {split.budget / 2**30:.2f} GiB budget in use (torch: "
            f"{alloc / 2**30:.2f} allocated, {held / 2**30:.2f} held, {retries} allocator retries; "
            f"{(split.budget - used) / 2**20:.0f} MiB of the budget free, the reserve {split.reserve / 2**20:.0f} MiB)")
