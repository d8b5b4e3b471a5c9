"""The KV cache: one preallocated buffer per layer, indexed by slot (a sequence being served) and position.

Standard attention stores K and V per KV head; MLA stores the compressed latent and the shared rotary key
(one "head" of kv_lora_rank + rope_dim values), which is what makes DeepSeek's cache small.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Segment:
    """A run of `n` consecutive tokens of one sequence in a flattened batch."""

    slot: int
    start: int  # position of the first token
    n: int
    # Static-shape decode (CUDA graphs): the position lives on the device and attention spans a fixed window of
    # the cache, masked beyond the position, so one captured graph serves every position up to `window`.
    pos_t: "torch.Tensor | None" = None  # [1] int64 on the cache's device
    window: int = 0

    @property
    def end(self) -> int:
        return self.start + self.n


class KVCache:
    # the recurrent layers' per-slot state (strata.kv.recurrent.HybridCache); None: every layer is attention
    recurrent = None

    def __init__(self, n_layers: int, n_slots: int, max_ctx: int, k_shape: tuple[int, ...],
                 v_shape: tuple[int, ...] | None, dtype: torch.dtype, device: torch.device | str):
        self.n_layers, self.n_slots, self.max_ctx = n_layers, n_slots, max_ctx
        self.dtype, self.device = dtype, torch.device(device)
        self.k = [torch.zeros(n_slots, max_ctx, *k_shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = (
            [torch.zeros(n_slots, max_ctx, *v_shape, dtype=dtype, device=device) for _ in range(n_layers)]
            if v_shape is not None
            else None
        )

    @property
    def nbytes(self) -> int:
        per = self.k[0].numel() * self.k[0].element_size()
        if self.v is not None:
            per += self.v[0].numel() * self.v[0].element_size()
        return per * self.n_layers

    @staticmethod
    def bytes_per_token(n_layers: int, k_shape, v_shape, dtype: torch.dtype) -> int:
        n = 1
        for d in k_shape:
            n *= d
        m = 0
        if v_shape is not None:
            m = 1
            for d in v_shape:
                m *= d
        return (n + m) * n_layers * torch.empty(0, dtype=dtype).element_size()

    def write(self, layer: int, seg: Segment, k: torch.Tensor, v: torch.Tensor | None) -> None:
        self.k[layer][seg.slot, seg.start : seg.end] = k.to(self.dtype)
        if v is not None and self.v is not None:
            self.v[layer][seg.slot, seg.start : seg.end] = v.to(self.dtype)

    def write_at(self, layer: int, slot: int, pos_t: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> None:
        """Write one token's K/V at a device-side position (no host value involved)."""
        self.k[layer][slot].index_copy_(0, pos_t, k.to(self.dtype))
        if v is not None and self.v is not None:
            self.v[layer][slot].index_copy_(0, pos_t, v.to(self.dtype))

    def read(self, layer: int, seg: Segment) -> tuple[torch.Tensor, torch.Tensor | None]:
        k = self.k[layer][seg.slot, : seg.end]
        v = self.v[layer][seg.slot, : seg.end] if self.v is not None else None
        return k, v

    def copy_prefix(self, src_slot: int, dst_slot: int, n: int) -> None:
        """Copy the first n positions of one slot to another (conversation cache restore)."""
        for layer in range(self.n_layers):
            self.k[layer][dst_slot, :n] = self.k[layer][src_slot, :n]
            if self.v is not None:
                self.v[layer][dst_slot, :n] = self.v[layer][src_slot, :n]
