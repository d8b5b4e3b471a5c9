"""The expert cache: slots of the hottest experts on the compute device, the expert_map, and the copies.

Slots hold experts in their stored format (the same bytes as the host store). Layers whose experts have the
same formats and shapes share one pool tensor per projection, `[n_layers_in_pool * slots + staging, rows,
row_bytes]`: layer `l` owns slots `base[l] .. base[l] + slots`, and the last `staging` slots are a ring that
misses streamed over PCIe land in (shared by the pool's layers). `expert_map` `[L, E]` (int64, on the device)
holds each ready expert's slot in its layer's pool, -1 elsewhere; the GPU reads it without the host.

Copies run on a side CUDA stream. Before a batch of copies the side stream waits for the main stream's work
issued so far (which may still read a victim's slot or a staging slot); each copy records an event, so the
main stream waits only for the copies it reads and the policy marks an expert ready only once its copy is done.
On a CPU-only machine the "device" is the host: the pool is a host tensor and copies are synchronous.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from strata import StrataError
from strata.config import ExpertConfig, chunk_ring_size, chunk_stage_mib
from strata.experts.releasable import Releasable
from strata.experts.resident import ExpertWeights
from strata.experts import sizing
from strata.experts.store import ExpertStore
from strata.quant import QTensor

log = logging.getLogger("strata")

GiB, MiB = 1 << 30, 1 << 20


def _sig(ew: ExpertWeights) -> tuple:
    return tuple((t.qtype, t.shape[1:]) for t in (ew.gate, ew.up, ew.down))


@dataclass
class Prefetch:
    """Experts of `layer` copied into chunk buffers ahead of its forward: per batch (buffer, experts in slot
    order, event after their copy), and expert -> (buffer, slot)."""

    layer: int
    batches: list[tuple[int, list[int], object]]
    index: dict[int, tuple[int, int]] = field(default_factory=dict)

    def __post_init__(self):
        self.index = {e: (b, j) for b, experts, _ in self.batches for j, e in enumerate(experts)}


@dataclass
class ChunkStage:
    """A ring of chunk buffers of `experts` slots each (gate, up, down stacks) for a chunk's streamed experts,
    and per buffer the event after the last compute that read it (None: none yet).

    The copy into buffer i waits only for buffer i's last reader, so copies run ahead of the compute by up to the
    ring's other buffers, across layer boundaries. Fewer, larger buffers measured faster (sizing.CHUNK_RING):
    each buffer is one grouped FFN call, and the chunk path is bound by the host's launches."""

    experts: int
    bufs: list[tuple[QTensor, QTensor, QTensor]]
    done: list[object] = field(default_factory=list)
    next: int = 0  # the buffer taken next (the one whose last reader was issued longest ago)
    pending: Prefetch | None = None

    def __post_init__(self):
        self.done = self.done or [None] * len(self.bufs)

    @property
    def capacity(self) -> int:
        return self.experts * len(self.bufs)

    def take(self) -> int:
        """The next buffer of the ring; the caller copies into it after `done[b]` and sets `done[b]`."""
        b = self.next
        self.next = (b + 1) % len(self.bufs)
        return b

    def prefetch(self, layer: int, batches: list[tuple[int, list[int], object]]) -> None:
        self.pending = Prefetch(layer, batches)

    def peek(self, layer: int) -> dict[int, tuple[int, int]]:
        """The experts prefetched for `layer` (expert -> (buffer, slot)), without taking them."""
        p = self.pending
        return p.index if p is not None and p.layer == layer else {}

    def held(self, layer: int, expert: int) -> tuple[tuple[QTensor, QTensor, QTensor], int, object] | None:
        """(the buffer's stacks, the expert's row there, the event after its copy) of an expert copied ahead for
        `layer`, without taking the prefetch; None if it was not."""
        p = self.pending
        got = p.index.get(expert) if p is not None and p.layer == layer else None
        if got is None:
            return None
        b, j = got
        return self.bufs[b], j, next(ev for bb, _, ev in p.batches if bb == b)

    def prefetched_for(self, layer: int) -> Prefetch | None:
        """The prefetch made for `layer` (once: taken by the call), None if there is none."""
        p, self.pending = self.pending, None
        return p if p is not None and p.layer == layer else None

    def nbytes(self) -> int:
        return sum(t.nbytes for b in self.bufs for t in b)


def _chunk_experts(left: int, expert_bytes: int, n_experts: int) -> int:
    # benchmarks compare buffer sizes (strata check does not see the override)
    return sizing.chunk_stage_experts(left, expert_bytes, n_experts, chunk_stage_mib())


def _runs(experts: list[int]) -> list[tuple[int, int, int]]:
    """[(first slot, first expert, length)] of the runs of consecutive ids in `experts` (slot j gets experts[j])."""
    runs: list[list[int]] = []
    for j, e in enumerate(experts):
        if runs and e == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([j, e, 1])
    return [tuple(r) for r in runs]


def _n_sigs(store: ExpertStore) -> int:
    return len({_sig(store[i]) for i in store.layer_ids})


@dataclass
class SlotPool:
    """Slots for the layers of one weight signature: gate, up, down raw blocks, each [n, rows, row_bytes]."""

    sig: tuple
    gate: QTensor
    up: QTensor
    down: QTensor
    stage_base: int  # first staging slot
    staging: int
    loan_base: int = 0  # first row of the chunk buffers when they lie in the pool (lent between prompts)
    act_base: int = 0  # first row of the prefill activations' VRAM lent as slots (released during prompts)
    releasable: list = field(default_factory=list)  # its projections' Releasable buffers (strata.experts.releasable)
    base: dict[int, int] = field(default_factory=dict)  # layer -> first slot
    stage_next: int = 0  # ring position

    def expert(self, slot: int) -> tuple[QTensor, QTensor, QTensor]:
        return self.gate[slot], self.up[slot], self.down[slot]

    def nbytes(self) -> int:
        return self.gate.nbytes + self.up.nbytes + self.down.nbytes


def budget_slots(cfg: ExpertConfig, store: ExpertStore, device: torch.device, staging: int,
                 act_bytes: int = 0) -> tuple[int, int, sizing.VramSplit | None]:
    """(cache slots per layer (uniform), experts per chunk buffer, the VRAM split) from --expert-slots, --vram-gb /
    --vram-reserve-mib, or the free VRAM (the split: None with --expert-slots, or on a CPU without a budget).

    GPU: the budget is the whole process's (`--vram-gb`, or the whole device), less everything the device holds
    now (the CUDA context, which torch's allocator does not see (a few hundred MiB), dense weights, KV and buffers
    allocated before the cache), the reserve (decode activations, graphs, allocator slack), `act_bytes` (one
    prefill chunk's activations) and the staging ring; the chunk buffers and the slots share the rest
    (sizing.split_budget, which `strata check` uses too). CPU: the pool lives in RAM; --vram-gb less the reserve
    sizes it as it would on a GPU, and without a budget every expert gets a slot.
    """
    E, eb = store.n_experts, store.expert_nbytes()
    if cfg.slots is not None:
        if cfg.slots < 0:
            raise StrataError("--expert-slots must be >= 0")
        return min(cfg.slots, E), _chunk_experts(store.nbytes(), eb, E), None
    common = dict(reserve=cfg.vram_reserve_mib * MiB, staging=staging * eb, expert_bytes=eb, n_experts=E,
                  per_slot=sum(store.expert_nbytes(i) for i in store.layer_ids),  # one slot in every layer
                  chunk_mib=chunk_stage_mib())  # benchmarks compare buffer sizes (strata check does not see it)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = total if cfg.vram_gb is None else min(total, int(cfg.vram_gb * GiB))
        # in use now: this process's context and tensors (and any other process's)
        held, alloc = torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device)
        split = sizing.split_budget(budget, context=(total - free) - held, dense=alloc, other=held - alloc,
                                    prefill=act_bytes, n_sigs=_n_sigs(store), **common)
    elif cfg.vram_gb is not None:  # chunk buffers in RAM: not taken from the cache
        split = sizing.split_budget(int(cfg.vram_gb * GiB), context=0, prefill=0, buffers_in_budget=False, **common)
    else:
        return E, _chunk_experts(store.nbytes(), eb, E), None
    return split.slots, split.chunk_experts, split


OUTSIDE_GROWTH_MIB = sizing.OUTSIDE_GROWTH_MIB


def cap_to_budget(device: torch.device, vram_gb: float) -> float:
    """Hold torch's allocator to the rest of a --vram-gb budget: the budget less what the device holds outside
    torch (the CUDA context, its modules) and room for that to grow. At the cap torch first frees its cached
    blocks and retries, so freed prefill temporaries go back instead of the process growing past the budget;
    only a working set truly larger than the budget fails (out of memory, reported by the engine). Returns the
    cap in GiB (0: no GPU)."""
    if device.type != "cuda":
        return 0.0
    free, total = torch.cuda.mem_get_info(device)
    outside = (total - free) - torch.cuda.memory_reserved(device)
    cap = int(vram_gb * GiB) - outside - OUTSIDE_GROWTH_MIB * MiB
    if cap <= torch.cuda.memory_reserved(device):
        raise StrataError(f"--vram-gb {vram_gb:g} leaves nothing for the model: the CUDA context and what is already "
                          f"loaded take {(total - free) / GiB:.2f} GiB")
    index = device.index if device.index is not None else torch.cuda.current_device()  # "cuda" names no index
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), index)
    _CAPPED.add(index)
    CAP_BYTES[index] = cap
    return cap / GiB


_CAPPED: set[int] = set()  # devices whose allocator a budget capped in this process
CAP_BYTES: dict[int, int] = {}  # device -> the cap in bytes (strata.experts.loan moves it by the lent VRAM)


def release_caps() -> None:
    """Lift the caps an earlier model's budget set (a new model in the same process sizes itself afresh)."""
    while _CAPPED:
        torch.cuda.set_per_process_memory_fraction(1.0, _CAPPED.pop())


class ExpertCache:
    """The slot pools, the device expert_map and the copy machinery for `store`'s layers."""

    def __init__(self, store: ExpertStore, slots: int | list[int], staging: int, device: torch.device,
                 chunk_experts: int = 0, loan: bool = False, act_slots: int = 0):
        """slots: per layer, one count for all (uniform) or a list in `store.layer_ids` order. loan: the prefill
        chunk buffers lie in the pool, past the staging ring, and are lent to the layers as extra slots between
        prompts (`loan_slots`; a chunk step borrows them back: TieredExperts.borrow). act_slots: with the loan, each
        layer's slots in the VRAM a prompt chunk's activations take, lent the same way and released to the device
        while a prompt runs (`--prefill-loan`: strata.experts.releasable)."""
        per = [int(slots)] * len(store.layer_ids) if isinstance(slots, (int, np.integer)) else [int(v) for v in slots]
        if len(per) != len(store.layer_ids) or min(per, default=0) < 0 or staging < 1:
            raise StrataError(f"expert cache needs slots >= 0 for each of {len(store.layer_ids)} layers and staging "
                              f">= 1 (got {slots}, {staging})")
        self.store, self.staging, self.device = store, staging, device
        self.loan = bool(loan)
        self.lent = self.loan  # the chunk buffers' rows are the layers' extra slots now (not a chunk's)
        self.layer_slots = dict(zip(store.layer_ids, per))  # layer -> its slots
        self.slots = per[0] if len(set(per)) == 1 else per  # an int when uniform
        # experts per prefill chunk buffer (0: sized from the store alone)
        self.chunk_experts = chunk_experts or _chunk_experts(store.nbytes(), store.expert_nbytes(),
                                                                  store.n_experts)
        self.layer_ids = store.layer_ids
        self.index = {layer: li for li, layer in enumerate(self.layer_ids)}
        self.cuda = device.type == "cuda"
        self.side = torch.cuda.Stream(device) if self.cuda else None
        self._views: dict[tuple, tuple] = {}  # (pool, slot) -> its projections' rows
        self._src_views: dict[tuple, tuple] = {}  # (layer, expert) -> the host store's rows
        # a prefill chunk's buffer copies get a stream of their own: on `side` they queued behind begin_copies()'
        # wait for the main stream (the layer's hit compute, issued just before), and the next layer's prefetch
        # behind them; their only hazard is the buffer's last reader, which `after` orders them after
        self.chunk_copies = torch.cuda.Stream(device) if self.cuda else None
        # the decode hand-off's staged experts get a stream of their own: on `side` they would queue behind the
        # cache's admissions (which wait for the main stream's queued work) while the GPU waits for them
        self.urgent = torch.cuda.Stream(device, priority=-1) if self.cuda else None
        groups: dict[tuple, list[int]] = {}
        for i in self.layer_ids:
            groups.setdefault(_sig(store[i]), []).append(i)
        self.pools: list[SlotPool] = []
        self._chunk_stage: dict[tuple, ChunkStage] = {}  # weight signature -> prefill chunk buffers
        self.pool_of: dict[int, SlotPool] = {}
        # the chunk buffers' slots in the pool (loan) and each layer's share of them as extra cache slots
        self.ring = sizing.chunk_ring(self.chunk_experts, chunk_ring_size())  # (buffers, experts each)
        self.loan_slots: dict[int, int] = {i: 0 for i in self.layer_ids}
        self.act_slots: dict[int, int] = {i: 0 for i in self.layer_ids}  # of those, in the activations' VRAM
        self.rows: dict[int, np.ndarray] = {}  # layer -> the pool row of each of its slots (lent ones last)
        try:
            for sig, layers in groups.items():
                cached = sum(self.layer_slots[i] for i in layers)
                lent = self.ring[0] * self.ring[1] if loan else 0
                share = min(lent // len(layers), store.n_experts) if lent else 0
                # (no layer holds more slots than it has experts)
                room = max(store.n_experts - self.layer_slots[i] - min(share, store.n_experts - self.layer_slots[i])
                           for i in layers)
                act = min(int(act_slots), max(room, 0)) * len(layers) if loan else 0
                n = cached + staging + lent + act
                ew = store[layers[0]]
                spare = [Releasable((n, *t.raw.shape[1:]), device, n - act) for t in (ew.gate, ew.up, ew.down)] \
                    if act else []
                ts = [QTensor(spare[j].raw if act else torch.zeros((n, *t.raw.shape[1:]), dtype=torch.uint8,
                                                                   device=device), t.qtype, (n, *t.shape[1:]))
                      for j, t in enumerate((ew.gate, ew.up, ew.down))]
                pool = SlotPool(sig, *ts, stage_base=cached, staging=staging, loan_base=cached + staging,
                                act_base=n - act, releasable=spare)
                base = 0
                for j, i in enumerate(layers):
                    pool.base[i] = base
                    own = self.layer_slots[i]
                    self.loan_slots[i] = max(0, min(share, store.n_experts - own))
                    extra = max(0, min(act // len(layers), store.n_experts - own - self.loan_slots[i]))
                    self.act_slots[i] = extra
                    self.rows[i] = np.concatenate([base + np.arange(own, dtype=np.int64), pool.loan_base + j * share
                                                   + np.arange(self.loan_slots[i], dtype=np.int64),
                                                   pool.act_base + j * (act // len(layers))
                                                   + np.arange(extra, dtype=np.int64)])
                    self.loan_slots[i] += extra
                    base += own
                    self.pool_of[i] = pool
                self.pools.append(pool)
                if self.cuda or loan:  # allocated with the cache, so the budget holds them from the start
                    self._chunk_stage[sig] = self._alloc_stage(layers[0])
        except torch.OutOfMemoryError:
            need = (sum(per) + staging * len(groups)) * store.expert_nbytes()
            raise StrataError(f"the expert cache ({need / GiB:.1f} GiB) does not fit in VRAM; lower --vram-gb or "
                              "--expert-slots, or raise --vram-reserve-mib") from None
        L, E = len(self.layer_ids), store.n_experts
        self.map = torch.full((L, E), -1, dtype=torch.int64, device=device)  # [L, E] slot in the layer's pool
        self.copies = 0
        self.copied_bytes = 0
        self.promoted = 0  # admissions copied on the device from a staging slot (no second PCIe copy)
        self.prefetched = 0  # experts copied ahead into a chunk buffer ...
        self.prefetch_used = 0  # ... and of those, computed from there

    def nbytes(self) -> int:
        # (lent chunk buffers are rows of the pools)
        return sum(p.nbytes() for p in self.pools) + (0 if self.loan else sum(st.nbytes() for st in
                                                                             self._chunk_stage.values()))

    # --- the map ----------------------------------------------------------------------------------------------
    def pool_rows(self, layer: int, row: np.ndarray) -> np.ndarray:
        """A policy row (slot within the layer, -1) as pool rows (int64, -1 kept)."""
        rows = self.rows[layer]
        if not rows.size:  # no slots: every expert misses
            return np.full(np.shape(row), -1, dtype=np.int64)
        return np.where(row >= 0, rows[np.clip(row, 0, rows.size - 1)], -1)

    def upload_map(self, li: int, row: np.ndarray) -> None:
        """Set expert_map[li] from the host policy's row (slot within the layer, -1) on the main stream."""
        r = self.pool_rows(self.layer_ids[li], row)
        t = torch.from_numpy(r)
        if self.cuda:
            # a fresh pinned buffer from torch's caching host allocator, not reused before the copy ran
            self.map[li].copy_(t.pin_memory(), non_blocking=True)
        else:
            self.map[li].copy_(t)

    def slot(self, layer: int, slot_in_layer: int) -> int:
        return int(self.rows[layer][slot_in_layer])

    # --- copies -----------------------------------------------------------------------------------------------
    def begin_copies(self) -> None:
        """Order the next copies after the main stream's work issued so far (readers of victim/staging slots) and
        after the urgent stream's copies (a decode prefetch nobody waited for may still be writing a staging
        slot)."""
        if self.cuda:
            self.side.wait_stream(torch.cuda.current_stream(self.device))
            self.side.wait_stream(self.urgent)

    # A decode step with misses copies a few experts per layer, three projections each: indexing the stacks and
    # dispatching each copy from Python cost ~13 us a copy (measured on the development machine; ~1 us with the
    # views kept and one _foreach_copy_ per call), ~40 us an expert on the step's critical path.
    def _slot_views(self, layer: int, slot: int) -> tuple[torch.Tensor, ...]:
        pool = self.pool_of[layer]
        key = (id(pool), slot)
        v = self._views.get(key)
        if v is None:
            v = self._views[key] = (pool.gate.raw[slot], pool.up.raw[slot], pool.down.raw[slot])
        return v

    def _expert_views(self, layer: int, expert: int) -> tuple[torch.Tensor, ...]:
        key = (layer, expert)
        v = self._src_views.get(key)
        if v is None:
            src = self.store[layer]
            v = self._src_views[key] = (src.gate.raw[expert], src.up.raw[expert], src.down.raw[expert])
        return v

    def _copy_experts(self, layer: int, experts: list[int], slots: list[int], stream) -> object:
        """Copy experts[i] into pool slot slots[i] (all projections in one _foreach_copy_), on `stream` (CUDA);
        returns the event after them (CUDA) or None."""
        dst = [t for sl in slots for t in self._slot_views(layer, sl)]
        src = [t for e in experts for t in self._expert_views(layer, e)]
        self.copies += len(experts)
        self.copied_bytes += len(experts) * self.store[layer].expert_nbytes()
        if not self.cuda:
            torch._foreach_copy_(dst, src)
            return None
        with torch.cuda.stream(stream):
            torch._foreach_copy_(dst, src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
        return ev

    def copy(self, layer: int, expert: int, slot: int):
        """Copy one expert from the host store into `slot` of its layer's pool; returns its event (CUDA) or None."""
        return self._copy_experts(layer, [expert], [slot], self.side)

    def copy_into(self, layer: int, experts: list[int], slots: list[int]):
        """copy() of several experts of a layer into their slots in one call: one event after them all (CUDA) or
        None."""
        return self._copy_experts(layer, experts, slots, self.side)

    def promote(self, layer: int, src_slot: int, dst_slot: int):
        """Copy a pool slot into another on the device, on the main stream (after every queued reader of
        either): a streamed expert admitted to the cache from its staging slot instead of over PCIe again;
        returns its event (CUDA) or None."""
        for d, s in zip(self._slot_views(layer, dst_slot), self._slot_views(layer, src_slot)):
            d.copy_(s, non_blocking=True)
        self.promoted += 1
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def promote_row(self, layer: int, src: tuple[QTensor, QTensor, QTensor], row: int, slot: int, after=None):
        """Copy row `row` of the stacks `src` (a chunk buffer holding an expert copied ahead for this chunk) into
        pool `slot`, on the device, on the main stream after the event `after` (its copy): the chunk streams it
        anyway, so the cache admits it without a second trip over PCIe; returns its event (CUDA) or None."""
        self.wait(after)
        for d, s in zip(self._slot_views(layer, slot), src):
            d.copy_(s.raw[row], non_blocking=True)
        self.promoted += 1
        return self.record()

    def copy_slots(self, layer: int, experts: list[int], slots: list[int]):
        """Copy experts[i] into pool slot slots[i] (one stream switch, one event for all: the decode hand-off's
        streamed experts) on the urgent stream, unordered with the main stream: the slots' last readers must
        have finished (the hand-off's staging ring: read by an earlier piece the host has waited past); returns
        the event (CUDA) or None."""
        return self._copy_experts(layer, experts, slots, self.urgent)

    def wait(self, ev) -> None:
        """Make the main stream wait for a copy (no host sync)."""
        if ev is not None:
            torch.cuda.current_stream(self.device).wait_event(ev)

    def copy_many(self, layer: int, experts: list[int], dst: tuple[QTensor, QTensor, QTensor], after=None):
        """Copy `experts` of `layer` into slots 0.. of the stacks `dst` (a chunk buffer), after the event
        `after` (the buffer's last reader); returns the event of the last copy (CUDA) or None."""
        src = self.store[layer]
        self.copies += len(experts)
        self.copied_bytes += len(experts) * src.expert_nbytes()
        if not self.cuda:
            for j, e in enumerate(experts):
                for d, s in zip(dst, (src.gate, src.up, src.down)):
                    d.raw[j].copy_(s.raw[e])
            return None
        # consecutive experts into consecutive slots: one copy per projection and run, all issued by one
        # _foreach_copy_ (the host issues a 4K prefill's ~7K copies; from Python each took ~13 us more)
        d_all, s_all = [], []
        for j, e, n in _runs(experts):
            for d, s in zip(dst, (src.gate, src.up, src.down)):
                d_all.append(d.raw.narrow(0, j, n))
                s_all.append(s.raw.narrow(0, e, n))
        st = self.chunk_copies
        with torch.cuda.stream(st):
            if after is not None:
                st.wait_event(after)
            torch._foreach_copy_(d_all, s_all, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(st)
        return ev

    def record(self):
        """An event after the main stream's work issued so far (CUDA), else None."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def chunk_stage(self, layer: int) -> ChunkStage:
        """The chunk buffers for the layer's weight signature (allocated at first use on the CPU; on CUDA
        with the cache, inside the budget)."""
        sig = self.pool_of[layer].sig
        st = self._chunk_stage.get(sig)
        if st is None:
            st = self._chunk_stage[sig] = self._alloc_stage(layer)
        return st

    def _alloc_stage(self, layer: int) -> ChunkStage:
        ew = self.store[layer]
        ring, n = self.ring  # benchmarks compare ring sizes
        pool = self.pool_of[layer]
        if self.loan:
            # the buffers are the pool's lent rows (views: what a chunk writes there, the cache forgets)
            bufs = [tuple(QTensor(t.raw[pool.loan_base + r * n:pool.loan_base + (r + 1) * n], t.qtype, (n, *t.shape[1:]))
                          for t in (pool.gate, pool.up, pool.down)) for r in range(ring)]
            return ChunkStage(n, bufs)
        bufs = [tuple(QTensor(torch.zeros((n, *t.raw.shape[1:]), dtype=torch.uint8, device=self.device), t.qtype,
                              (n, *t.shape[1:])) for t in (ew.gate, ew.up, ew.down)) for _ in range(ring)]
        return ChunkStage(n, bufs)

    # --- the staging ring ---------------------------------------------------------------------------------------
    def stage_slots(self, layer: int, n: int) -> list[int]:
        """n ring slots of the layer's pool for streamed experts (n <= staging); their previous readers must
        be done, which begin_copies() ensures for work issued before it."""
        pool = self.pool_of[layer]
        if n > pool.staging:
            raise ValueError(f"{n} streamed experts exceed the staging ring of {pool.staging}")
        out = []
        for _ in range(n):
            out.append(pool.stage_base + pool.stage_next)
            pool.stage_next = (pool.stage_next + 1) % pool.staging
        return out

    def staging_for(self, layer: int) -> int:
        return self.pool_of[layer].staging
