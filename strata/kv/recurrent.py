"""Per-slot recurrent state of linear-attention layers (gated delta-net), kept beside the KV cache.

A recurrent layer does not keep one row per past token: it folds the whole past into a fixed-size state per
sequence (the delta-net's [heads, key, value] matrix and the last `kernel - 1` inputs of its short causal
convolution). So a slot holds the state *after the last token it absorbed*, and nothing else: a KV-style prefix
of a longer run cannot be read back from it. The engine follows from that (strata.engine.engine): a cached
prefix is reused only when it is the slot's whole content; and a speculative verify step, which folds drafts
that may be rejected into the state, runs with its slot in `track`: the layers then keep the state after each of
the segment's tokens (`pending`), and once the engine knows how many stand, `keep` puts the state after those.

The state is float32 whatever the activations: it is a running sum over the whole context, and bf16 rounding
would accumulate in it.
"""

from __future__ import annotations

import torch

from strata.kv.cache import KVCache


class RecurrentState:
    """conv[layer] [n_slots, kernel - 1, channels] and ssm[layer] [n_slots, heads, key_dim, value_dim] for each
    recurrent layer (keyed by the model's layer index)."""

    def __init__(self, layers: list[int], n_slots: int, conv_shape: tuple[int, int], ssm_shape: tuple[int, int, int],
                 device: torch.device | str, dtype: torch.dtype = torch.float32):
        self.layers, self.n_slots = list(layers), n_slots
        self.conv = {i: torch.zeros(n_slots, *conv_shape, dtype=dtype, device=device) for i in self.layers}
        self.ssm = {i: torch.zeros(n_slots, *ssm_shape, dtype=dtype, device=device) for i in self.layers}
        self.track: set[int] = set()  # slots whose segment in this step is a verify segment (set by the engine)
        # (layer, slot) -> (the state after each of the segment's tokens [n, H, Dk, Dv], the conv's inputs
        # [K-1+n, C]: its state before the segment, then the segment's)
        self.pending: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._saved: dict | None = None  # `save`'s standing copy of every slot's state (None until first used)
        self._pairs: dict[tuple[int, ...], tuple[list, list]] = {}

    @staticmethod
    def bytes_per_slot(n_layers: int, conv_shape, ssm_shape, dtype: torch.dtype = torch.float32) -> int:
        n = conv_shape[0] * conv_shape[1] + ssm_shape[0] * ssm_shape[1] * ssm_shape[2]
        return n * n_layers * torch.empty(0, dtype=dtype).element_size()

    @property
    def nbytes(self) -> int:
        """The states, and `save`'s standing copy once made (`reserve_saved`: counted with the KV cache)."""
        dicts = (self.conv, self.ssm) + ((self._saved["conv"], self._saved["ssm"]) if self._saved else ())
        return sum(t.numel() * t.element_size() for d in dicts for t in d.values())

    def keep(self, slot: int, n: int) -> None:
        """After a verify segment in `slot`: its state is the one after the segment's first n tokens."""
        for i in self.layers:
            states, inputs = self.pending.pop((i, slot))
            self.ssm[i][slot].copy_(states[n - 1])
            k1 = self.conv[i].shape[1]
            self.conv[i][slot].copy_(inputs[n : n + k1])  # the last K-1 inputs up to token n - 1

    def swap(self, a: int, b: int) -> None:
        """Exchange two slots' states (KVCache.swap_slots' counterpart)."""
        for d in (self.conv, self.ssm):
            for t in d.values():
                t[[a, b]] = t[[b, a]]

    def snapshot(self, slots: list[int] | None = None, host: bool = False) -> dict:
        """A copy of the given slots' state (all slots: None), for `restore` after work that must not count (a
        CUDA-graph warm-up, a forward that ran out of memory half-way); host: the copy in host memory (no VRAM
        taken beside the states themselves)."""
        idx = list(range(self.n_slots)) if slots is None else sorted(set(slots))

        def copy(t: torch.Tensor) -> torch.Tensor:
            if host:  # slot by slot from views: a gather (t[idx]) would take its size in VRAM first
                return torch.stack([t[s].to("cpu") for s in idx])
            return t[idx].clone()

        return {"slots": idx,
                "conv": {i: copy(t) for i, t in self.conv.items()},
                "ssm": {i: copy(t) for i, t in self.ssm.items()}}

    def save(self, slots: list[int]) -> None:
        """Copy the given slots' state aside on the device (one standing copy of every slot's state, made on first
        use), for `load_saved`: a decode step launched ahead of the host's read of its input token folds that
        token in, and a sequence that stopped at it takes the state back (strata.engine.ahead). Raises
        torch.OutOfMemoryError when the copy has no room."""
        self.reserve_saved()
        key = tuple(slots)
        if key not in self._pairs:  # the views, once per set of slots (a step's copy is one foreach call)
            src = [d[i][s] for d in (self.conv, self.ssm) for i in self.layers for s in key]
            dst = [self._saved[k][i][s] for k in ("conv", "ssm") for i in self.layers for s in key]
            self._pairs[key] = (dst, src)
        dst, src = self._pairs[key]
        torch._foreach_copy_(dst, src)

    def reserve_saved(self) -> None:
        """Make `save`'s copy now (an engine that will launch steps ahead, before the budget is divided)."""
        if self._saved is None:
            self._saved = {k: {i: torch.empty_like(t) for i, t in d.items()}
                           for k, d in (("conv", self.conv), ("ssm", self.ssm))}

    def load_saved(self, slot: int) -> None:
        """Put back the state `save` set aside for `slot` (in stream order: after the step that changed it)."""
        torch._foreach_copy_([d[i][slot] for d in (self.conv, self.ssm) for i in self.layers],
                             [self._saved[k][i][slot] for k in ("conv", "ssm") for i in self.layers])

    def restore(self, snap: dict) -> None:
        """Put a snapshot back, in place (captured graphs hold these buffers' addresses)."""
        idx = snap["slots"]
        for i in self.layers:
            for slot_pos, s in enumerate(idx):
                self.conv[i][s].copy_(snap["conv"][i][slot_pos])
                self.ssm[i][s].copy_(snap["ssm"][i][slot_pos])


class HybridCache(KVCache):
    """The KV cache of a model whose attention layers are a subset of its layers (`n_layers` here counts those),
    with the recurrent layers' state beside it."""

    def __init__(self, n_layers: int, n_slots: int, max_ctx: int, k_shape, v_shape, dtype, device,
                 recurrent: RecurrentState, k_type=None, v_type=None, layers=None):
        super().__init__(n_layers, n_slots, max_ctx, k_shape, v_shape, dtype, device, k_type, v_type, layers)
        self.recurrent = recurrent

    @property
    def nbytes(self) -> int:
        return super().nbytes + self.recurrent.nbytes

    def swap_slots(self, a: int, b: int, n: int) -> None:
        super().swap_slots(a, b, n)
        if a != b:
            self.recurrent.swap(a, b)
