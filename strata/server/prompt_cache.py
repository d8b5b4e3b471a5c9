"""The conversation cache: KV of past conversations kept in host RAM so that a follow-up turn re-reads only its
new tokens, even after its KV slot went to someone else.

The engine already reuses the longest prefix that a free slot still holds. This adds a second tier: before a
slot's content is overwritten by an unrelated prompt, its KV is copied to RAM (within a byte budget, least
recently used evicted), and a prompt whose longest cached prefix lives in RAM gets it copied back into a free
slot before the engine places it. Only the engine thread calls this (it touches the engine's KV).

A model with recurrent layers (qwen3next's delta-net) folds its whole past into a state per slot: an entry then
also keeps the state after its last token, and serves only a prompt that goes on past all of its tokens (the
state of a shorter prefix cannot be read back from it), as the engine's own slot reuse does.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

MIN_TOKENS = 16  # shorter prefixes are cheaper to recompute than to copy around


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class Entry:
    tokens: list[int]
    k: list[list[torch.Tensor]]  # per layer, on the host, as the cache stores them (KVCache.save_rows)
    v: list[list[torch.Tensor]] | None
    nbytes: int
    state: dict | None = None  # a recurrent model's state after the last token (Engine.slot_state)

    def serves(self, prompt: list[int], recurrent: bool) -> int:
        """Tokens of `prompt` this entry serves."""
        n = common_prefix(self.tokens, prompt)
        if recurrent:  # only its whole content, and the prompt must go on past it
            return n if n == len(self.tokens) < len(prompt) and self.state is not None else 0
        return n


class PromptCache:
    def __init__(self, budget_mib: int):
        self.budget = max(0, budget_mib) << 20
        self.entries: OrderedDict[tuple, Entry] = OrderedDict()  # key: tuple(tokens); last = most recent
        self.used = 0
        self.slot_used: dict[int, float] = {}  # slot -> last time it was handed out (LRU victim choice)
        self.saves = self.restores = self.evictions = 0

    # -- bookkeeping ---------------------------------------------------------------------------------------------
    def _save(self, engine, slot: int) -> None:
        toks = engine.slot_tokens[slot]
        n = len(toks)
        if n < MIN_TOKENS or not self.budget:
            return
        key = tuple(toks)
        if key in self.entries:
            self.entries.move_to_end(key)
            return
        recurrent = engine.recurrent is not None
        state = engine.slot_state(slot) if recurrent else None
        if recurrent and state is None:
            return  # the slot's state is not that of its tokens: its rows alone cannot be reused
        for other in self.entries.values():  # already held as the prefix of a longer entry
            if not recurrent and len(other.tokens) >= n and other.tokens[:n] == toks:
                return
        kv = engine.kv
        # each layer's rows as stored (a quantized cache's blocks and scales, copied as they are)
        k = [kv.save_rows(layer, slot, n, "k") for layer in range(kv.n_layers)]
        v = [kv.save_rows(layer, slot, n, "v") for layer in range(kv.n_layers)] if kv.v is not None else None
        nbytes = sum(t.numel() * t.element_size() for rows in k + (v or []) for t in rows)
        if state is not None:
            nbytes += sum(t.numel() * t.element_size() for d in state.values() for t in d.values())
        if nbytes > self.budget:
            return
        # drop entries that are prefixes of this one (the conversation moved on)
        for key2 in [k2 for k2, e in self.entries.items() if len(e.tokens) <= n and toks[: len(e.tokens)] == e.tokens]:
            self._drop(key2)
        while self.used + nbytes > self.budget and self.entries:
            self._drop(next(iter(self.entries)))
            self.evictions += 1
        self.entries[key] = Entry(list(toks), k, v, nbytes, state)
        self.used += nbytes
        self.saves += 1

    def _drop(self, key) -> None:
        e = self.entries.pop(key)
        self.used -= e.nbytes

    def _restore(self, engine, slot: int, e: Entry, n: int) -> None:
        kv = engine.kv
        for layer in range(kv.n_layers):
            kv.load_rows(layer, slot, n, e.k[layer], "k")
            if kv.v is not None and e.v is not None:
                kv.load_rows(layer, slot, n, e.v[layer], "v")
        engine.load_slot(slot, e.tokens[:n], e.state if n == len(e.tokens) else None)
        self.restores += 1

    # -- the one entry point -------------------------------------------------------------------------------------
    def prepare(self, engine, prompt: list[int], claim=None) -> None:
        """Arrange the engine's free slots so that `engine.add` finds the longest cached prefix of `prompt`, and
        save whatever KV the chosen slot held that the new prompt will overwrite. `claim(slot)` is told the slot
        once it is chosen, before any copy (a slot being saved and restored is its new request's, not idle)."""
        def chose(slot: int) -> int:
            if claim is not None:
                claim(slot)
            return slot

        free = engine.free_slots
        if not free:
            return
        recurrent = engine.recurrent is not None
        best, best_n = None, 0
        for s in free:
            n = engine.reusable_prefix(s, prompt)
            if n > best_n:
                best, best_n = s, n
        ram, ram_n = None, 0
        for e in self.entries.values():
            n = e.serves(prompt, recurrent)
            if n > ram_n:
                ram, ram_n = e, n
        if ram is not None and ram_n > best_n and ram_n >= MIN_TOKENS:
            # the entry moves into the slot (which will be saved again, grown, when it is next overwritten):
            # take it out first so that saving the slot's old content cannot evict it
            self._drop(tuple(ram.tokens))
            slot = chose(self._victim(free))
            self._save(engine, slot)
            self._restore(engine, slot, ram, ram_n)
        elif best is not None:
            slot = chose(best)
            held = len(engine.slot_tokens[slot])
            if held - best_n >= max(MIN_TOKENS, held // 2):
                # a branch: most of what the slot holds is about to be overwritten, keep it. (A follow-up turn
                # overwrites only the tail where the re-tokenized reply differs: not worth a copy.)
                self._save(engine, slot)
        else:
            slot = chose(self._victim(free))
            self._save(engine, slot)
        free.remove(slot)
        free.insert(0, slot)  # engine.add takes the first slot of the longest prefix, or the first one
        self.slot_used[slot] = time.monotonic()

    def _victim(self, free: list[int]) -> int:
        return min(free, key=lambda s: self.slot_used.get(s, 0.0))

    def stats(self) -> dict:
        return {"entries": len(self.entries), "bytes": self.used, "budget_bytes": self.budget,
                "saves": self.saves, "restores": self.restores, "evictions": self.evictions}
