"""`strata serve -np auto` (the default): how many sequences the server decodes together, from memory.

llama-server's automatic slot count is 4 over one KV pool the slots share. strata preallocates each slot's KV for
the whole context, so every slot costs its full KV up front, and on a GPU under a --vram-gb budget that memory is
taken from the expert cache (fewer slots a layer: a slower single client). So the default takes as many slots as
llama-server does (AUTO_SLOTS) only while their KV stays a small share of the memory it lives in (KV_SHARE of the
VRAM budget, of the GPU's free memory without a budget, of the free RAM on a CPU), and fewer otherwise, never
fewer than one. An explicit `-np N` is taken as given.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strata.experts.sizing import KV_TYPE_BLOCKS

AUTO_SLOTS = 4  # what llama-server's `-np -1` (auto) gives
KV_SHARE = 1 / 16  # the KV of all slots at most this share of the memory it lives in: a sixteenth of a
# budget costs a single client little of the expert cache (the extra slots serve concurrent clients)

_NAMES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


@dataclass
class AutoSlots:
    slots: int
    kv_bytes_per_slot: int
    room_bytes: int  # the memory the KV lives in (budget, free VRAM or free RAM)
    room_name: str

    def render(self) -> str:
        gib = 2**30
        return (f"{self.slots} slot(s) (-np auto: each slot's KV {self.kv_bytes_per_slot / gib:.2f} GiB; the slots' KV "
                f"kept within {KV_SHARE:.0%} of {self.room_name} {self.room_bytes / gib:.1f} GiB; -np N sets it)")


def choose_slots(kv_bytes_per_slot: int, room_bytes: int, most: int = AUTO_SLOTS) -> int:
    """The most slots, up to `most`, whose KV fits in KV_SHARE of `room_bytes`; at least one."""
    fit = int(KV_SHARE * room_bytes) // max(1, kv_bytes_per_slot)
    return max(1, min(most, fit))


def type_name(kind) -> str:
    """A K or V cache type as strata.experts.sizing.KV_TYPE_BLOCKS names it (a torch dtype or a quantized name)."""
    name = kind if isinstance(kind, str) else _NAMES.get(kind, "f32")
    return name if name in KV_TYPE_BLOCKS else "f32"


def kv_bytes_per_slot(lm) -> int:
    """One slot's KV (all layers, K and V, the whole context, as -ctk/-ctv store it) and any recurrent state, from
    the GGUF metadata (strata.hub.check: the figures `strata check` prints)."""
    from strata.hub.check import kv_bytes_per_token, state_bytes_per_slot
    from strata.hub.verify import read_gguf_header

    h = read_gguf_header(lm.gguf.paths[0])
    k, v = lm.cfg.kv_cache_types
    return kv_bytes_per_token(h, type_name(k), type_name(v)) * lm.max_ctx + state_bytes_per_slot(h)


def room(lm) -> tuple[int, str]:
    """(bytes, what they are) the slots' KV is weighed against, with the model already loaded."""
    from strata.kv.window import parse_tokens

    dev = lm.cfg.torch_device
    # a KV window of N tokens (strata.kv.window) keeps every slot's whole KV in host RAM: slots cost RAM there
    # (auto may end in no window at all, so it is weighed as VRAM)
    window = isinstance(parse_tokens(getattr(lm.cfg, "kv_vram_tokens", None)), int)
    if dev.type == "cuda" and not window:
        budget = lm.cfg.experts.vram_gb
        if budget is not None:
            return int(budget * 2**30), "the VRAM budget"
        free, _ = torch.cuda.mem_get_info(dev)
        return int(free), "the GPU's free memory"
    import psutil

    return int(psutil.virtual_memory().available), "the free RAM"


def auto_slots(lm) -> AutoSlots:
    per = kv_bytes_per_slot(lm)
    nbytes, name = room(lm)
    return AutoSlots(choose_slots(per, nbytes), per, nbytes, name)
