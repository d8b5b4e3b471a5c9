"""The KV cache: one preallocated buffer per layer, indexed by slot (a sequence being served) and position.

Standard attention stores K and V per KV head; MLA stores the compressed latent and the shared rotary key
(one "head" of kv_lora_rank + rope_dim values), which is what makes DeepSeek's cache small.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from strata import StrataError
from strata.kv.quant import QuantRows

log = logging.getLogger("strata")


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


def _is_quant(t) -> bool:
    return isinstance(t, str)


def ram_available() -> int | None:
    """Bytes of host RAM free for new allocations (None: unknown, then nothing is checked)."""
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.virtual_memory().available)


def _type_name(t) -> str:
    return t if isinstance(t, str) else str(t).removeprefix("torch.")


def _too_large(n_slots: int, max_ctx: int, per_token: int, need: int, avail: int | None, where: str) -> StrataError:
    """The error for a KV cache the device cannot hold: the numbers, and the context that would fit."""
    have = f", {avail / 2**30:.2f} GiB is free" if avail is not None else ""
    fits = f": -c {avail // max(1, n_slots * per_token)} fits" if avail is not None else ": use a smaller -c"
    slots = avail // max(1, max_ctx * per_token) if avail is not None and n_slots > 1 else 0
    if slots:  # (too many slots, rather than too long a context: -np is the other way)
        fits += f", or -np {slots} at this -c"
    return StrataError(f"the KV cache of {n_slots} slot(s) x {max_ctx} tokens needs {need / 2**30:.2f} GiB of "
                       f"{where}{have}{fits}")


def _stored(kind, dtype: torch.dtype):
    """A K or V cache type: None (the cache's dtype), a torch dtype, or a quantized type's name ("q8_0")."""
    return dtype if kind is None else kind


class KVCache:
    # the recurrent layers' per-slot state (strata.kv.recurrent.HybridCache); None: every layer is attention
    recurrent = None
    # positions are host values only (no captured decode step at a device-side position): strata.kv.window
    eager_only = False

    def __init__(self, n_layers: int, n_slots: int, max_ctx: int, k_shape: tuple[int, ...],
                 v_shape: tuple[int, ...] | None, dtype: torch.dtype, device: torch.device | str,
                 k_type: "torch.dtype | str | None" = None, v_type: "torch.dtype | str | None" = None,
                 layers=None):
        """`dtype`: the dtype of what reads return (a plain cache's storage). k_type / v_type: how K and V are
        stored, when not in `dtype`: another torch dtype, or a quantized type of strata.kv.quant ("q8_0", read
        back dequantized to `dtype`). layers: the layer indices this process holds (a pipeline stage's; None:
        all): the others get no buffer."""
        self.n_layers, self.n_slots, self.max_ctx = n_layers, n_slots, max_ctx
        self.dtype, self.device = dtype, torch.device(device)
        self.k_type, self.v_type = _stored(k_type, dtype), _stored(v_type, dtype)
        self.quantized = _is_quant(self.k_type) or (v_shape is not None and _is_quant(self.v_type))
        # K or V stored otherwise than in `dtype`: each buffer says how it is written and read. Not so (the
        # default), the plain tensor path below runs unchanged
        self._typed = self.k_type != dtype or (v_shape is not None and self.v_type != dtype)
        # K and V stored as plain tensors [slots, positions, ...] in `dtype` (a kernel may write rows itself)
        self.plain = not self._typed and v_shape is not None
        own = set(range(n_layers)) if layers is None else set(layers)
        # a context too large for the memory is one error with the numbers: on a CPU before torch touches the
        # pages (zeroing more than the RAM gets the process killed, with no message), anywhere when it fails
        per_token = self.bytes_per_token(len(own), k_shape, v_shape, dtype, k_type, v_type)
        need = per_token * n_slots * max_ctx
        where = "RAM" if self.device.type == "cpu" else f"memory on {self.device}"
        avail = ram_available() if self.device.type == "cpu" else None
        if avail is not None and need > avail:
            raise _too_large(n_slots, max_ctx, per_token, need, avail, where)
        try:
            self.k = [self._buffer(k_shape, self.k_type) if i in own else None for i in range(n_layers)]
            self.v = [self._buffer(v_shape, self.v_type) if i in own else None
                      for i in range(n_layers)] if v_shape is not None else None
        except RuntimeError as e:  # (torch.OutOfMemoryError is one; the CPU allocator raises a plain one)
            if not isinstance(e, torch.OutOfMemoryError) and "allocate" not in str(e):
                raise
            self.k = self.v = None
            raise _too_large(n_slots, max_ctx, per_token, need, avail, where) from None
        if self.quantized:
            names = [_type_name(t) for t in (self.k_type, self.v_type)]
            log.info("strata: KV cache K %s, V %s: a GPU decode step's attention reads the blocks in place where its "
                     "kernel runs (strata.ops.decode_attention_kv), else dequantized by torch ops", *names)

    def _buffer(self, shape, kind):
        if _is_quant(kind):
            return QuantRows(self.n_slots, self.max_ctx, tuple(shape), kind, self.device)
        return torch.zeros(self.n_slots, self.max_ctx, *shape, dtype=kind, device=self.device)

    @staticmethod
    def _nbytes(t) -> int:
        return t.nbytes if isinstance(t, QuantRows) else t.numel() * t.element_size()

    @property
    def nbytes(self) -> int:
        n = 0
        for bufs in (self.k, self.v):
            if bufs is not None:
                n += sum(self._nbytes(b) for b in bufs if b is not None)
        return n

    @staticmethod
    def bytes_per_token(n_layers: int, k_shape, v_shape, dtype: torch.dtype, k_type=None, v_type=None) -> int:
        def row(shape, kind) -> int:
            n = 1
            for d in shape[:-1]:
                n *= d
            if _is_quant(kind):
                return n * QuantRows.bytes_per_row(shape[-1], kind)
            return n * shape[-1] * torch.empty(0, dtype=kind).element_size()

        per = row(k_shape, _stored(k_type, dtype))
        if v_shape is not None:
            per += row(v_shape, _stored(v_type, dtype))
        return per * n_layers

    def write(self, layer: int, seg: Segment, k: torch.Tensor, v: torch.Tensor | None, first: int = 0) -> None:
        """Store a segment's rows. first: the first position the segment's read will want (a sliding-window
        layer's); a cache that fetches rows before reading them (strata.kv.window) fetches none before it."""
        if self._typed:
            self._put(self.k[layer], seg, k)
            if v is not None and self.v is not None:
                self._put(self.v[layer], seg, v)
            return
        self.k[layer][seg.slot, seg.start : seg.end] = k.to(self.dtype)
        if v is not None and self.v is not None:
            self.v[layer][seg.slot, seg.start : seg.end] = v.to(self.dtype)

    @staticmethod
    def _put(buf, seg: Segment, x: torch.Tensor) -> None:
        if isinstance(buf, QuantRows):
            buf.write(seg.slot, seg.start, seg.end, x)
        else:
            buf[seg.slot, seg.start : seg.end] = x.to(buf.dtype)

    def write_at(self, layer: int, slot: int, pos_t: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> None:
        """Write one token's K/V at a device-side position (no host value involved)."""
        if self._typed:
            for buf, x in ((self.k[layer], k), (self.v[layer] if self.v is not None else None, v)):
                if buf is None or x is None:
                    continue
                if isinstance(buf, QuantRows):
                    buf.write_at(slot, pos_t, x)
                else:
                    buf[slot].index_copy_(0, pos_t, x.to(buf.dtype))
            return
        self.k[layer][slot].index_copy_(0, pos_t, k.to(self.dtype))
        if v is not None and self.v is not None:
            self.v[layer][slot].index_copy_(0, pos_t, v.to(self.dtype))

    def _view(self, buf, slot: int, n: int) -> torch.Tensor:
        return buf.read(slot, n, self.dtype) if isinstance(buf, QuantRows) else buf[slot, :n]

    def read(self, layer: int, seg: Segment) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.read_window(layer, seg.slot, seg.end)

    def read_from(self, layer: int, seg: Segment, first: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A segment's prefix from position `first` on (a sliding-window layer reads no further back)."""
        ks, vs = self.read(layer, seg)
        return ks[first:], (vs[first:] if vs is not None else None)

    def read_window(self, layer: int, slot: int, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A slot's first n positions (the whole static window of a captured decode step, or a segment's prefix):
        views of a plain cache; a quantized type dequantized to `dtype` (torch ops, static shapes)."""
        if self._typed:
            return self._view(self.k[layer], slot, n), (
                self._view(self.v[layer], slot, n) if self.v is not None else None)
        k = self.k[layer][slot, :n]
        v = self.v[layer][slot, :n] if self.v is not None else None
        return k, v

    def read_window_blocks(self, layer: int, slot: int, n: int):
        """A slot's first n positions as stored: tensor views of a plain K or V, strata.kv.quant.Blocks of a
        quantized one (for a kernel that reads the blocks in place: strata.ops.decode_attention_kv)."""
        def view(buf):
            return buf.window(slot, n) if isinstance(buf, QuantRows) else buf[slot, :n]

        return view(self.k[layer]), (view(self.v[layer]) if self.v is not None else None)

    def copy_prefix(self, src_slot: int, dst_slot: int, n: int) -> None:
        """Copy the first n positions of one slot to another (conversation cache restore)."""
        for layer in range(self.n_layers):
            for bufs in (self.k, self.v):
                if bufs is None or bufs[layer] is None:
                    continue
                if isinstance(bufs[layer], QuantRows):
                    bufs[layer].copy_prefix(src_slot, dst_slot, n)
                else:
                    bufs[layer][dst_slot, :n] = bufs[layer][src_slot, :n]

    def swap_slots(self, a: int, b: int, n: int) -> None:
        """Exchange what two slots hold in their first n positions (every layer, K and V, as stored): the engine
        moves decoding sequences into the lowest slots, so captured decode steps are keyed by a count, not by a
        set of slots. Device copies through one layer's temporary at a time."""
        if a == b or n <= 0:
            return
        n = min(n, self.max_ctx)
        for layer in range(self.n_layers):
            for bufs in (self.k, self.v):
                if bufs is None or bufs[layer] is None:
                    continue
                buf = bufs[layer]
                for t in ((buf.qs, buf.d) if isinstance(buf, QuantRows) else (buf,)):
                    tmp = t[a, :n].clone()
                    t[a, :n] = t[b, :n]
                    t[b, :n] = tmp

    def save_rows(self, layer: int, slot: int, n: int, which: str = "k") -> list[torch.Tensor]:
        """Host copies of what a slot's first n positions store for K (or V), as stored (a quantized type's
        blocks and scales, not dequantized): the conversation cache's entries."""
        buf = (self.k if which == "k" else self.v)[layer]
        if isinstance(buf, QuantRows):
            return buf.rows(slot, n, "cpu")
        return [buf[slot, :n].to("cpu", copy=True)]

    def load_rows(self, layer: int, slot: int, n: int, rows: list[torch.Tensor], which: str = "k") -> None:
        """Put back what save_rows copied (its first n positions) into a slot."""
        buf = (self.k if which == "k" else self.v)[layer]
        if isinstance(buf, QuantRows):
            buf.put_rows(slot, n, rows)
        else:
            buf[slot, :n] = rows[0][:n].to(self.device, non_blocking=True)
