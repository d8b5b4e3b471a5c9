"""The KV window (`--kv-vram-tokens N`): every slot's whole KV in host RAM, and per layer a pool of N tokens of it
in VRAM, in pages of `page` tokens.

Attention reads exactly the rows the full-VRAM cache would hold. Before a layer attends over a slot's positions,
the pages it needs are gathered, in the cache's stored format (float rows or q8_0/q4_0 blocks), into one stage
buffer on the device (one layer's worth of a slot's context, shared by every layer): pages resident in the pool
by a device copy, the others read from host RAM over PCIe (pinned on CUDA). The new rows are written (quantized)
into the stage, then copied to the host copy and to the pool pages that hold their page. The attention code then
reads the stage as it reads a plain cache, so the output equals the full cache's bit for bit.

Which pages the pool keeps (PagePolicy, pure Python): the first page of a slot (attention sinks) and its most
recent pages are pinned, the rest is least-recently-used. A page read from the host is admitted only while the
pool has a free page or the page is pinned: full attention reads every page of the context each step in the same
order, where LRU admission would evict each page just before it is needed again (no hits at all); kept out, the
pages admitted stay and hit every step.

Costs, against the full cache: each attention call copies the slot's context into the stage (a device copy of
the window, at HBM speed) and reads the pages outside the pool over PCIe (the context less the window, per layer
per step); the page tables are Python, so decode steps run eagerly (no CUDA graphs).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from strata import StrataError
from strata.kv.cache import KVCache, Segment, ram_available
from strata.kv.quant import QuantRows

log = logging.getLogger("strata")

PAGE_TOKENS = 256  # tokens a page (--kv-page-tokens)
SINK_PAGES = 1  # a slot's first pages, always resident (attention sinks: the first tokens draw much attention)
RECENT_PAGES = 2  # a slot's last pages, always resident (the page being written and the one before it)


def parse_tokens(value) -> "int | str | None":
    """--kv-vram-tokens: None (the whole KV in VRAM), "auto", or a positive token count; anything else is one
    StrataError naming the flag and the value."""
    if value is None or isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    s = str(value).strip().lower()
    if s == "auto":
        return "auto"
    try:
        n = int(s)
    except ValueError:
        n = 0
    if n <= 0:
        raise StrataError(f"--kv-vram-tokens {value!r}: expected a positive number of tokens a layer, or auto")
    return n


@dataclass
class WindowStats:
    """Pages attention read from the VRAM pool (hits) and from host RAM (misses), cumulative."""

    hits: int = 0
    misses: int = 0
    miss_bytes: int = 0  # bytes read over PCIe (or from host RAM on a CPU)

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 1.0

    def as_dict(self) -> dict:
        return {"hits": self.hits, "misses": self.misses, "miss_bytes": self.miss_bytes,
                "hit_rate": round(self.hit_rate, 4)}

    def summary(self) -> str:
        return (f"hit {100 * self.hit_rate:.1f}% of {self.hits + self.misses} pages read, "
                f"{self.miss_bytes / 2**20:.1f} MiB from host RAM")


@dataclass
class Access:
    """What one attention call moves: pages gathered from the pool (page, pool index), pages read from the host,
    and the pages whose stage copy goes to the pool afterwards (page, pool index)."""

    hits: list = field(default_factory=list)
    misses: list = field(default_factory=list)
    to_pool: list = field(default_factory=list)


class PagePolicy:
    """One layer's page pool: which (slot, page) sits in which of `capacity` pool pages."""

    def __init__(self, capacity: int, sink_pages: int = SINK_PAGES, recent_pages: int = RECENT_PAGES):
        self.capacity, self.sink, self.recent = capacity, sink_pages, recent_pages
        self.where: OrderedDict = OrderedDict()  # (slot, page) -> pool index, least recently used first
        self.free = list(range(capacity - 1, -1, -1))
        self.pins: dict[int, set[int]] = {}  # slot -> its pinned pages as of its last access

    def pinned(self, end_page: int) -> set[int]:
        """A slot's pinned pages when its content ends in page end_page - 1."""
        return set(range(min(self.sink, end_page))) | set(range(max(0, end_page - self.recent), end_page))

    def _victim(self, keep: set) -> int | None:
        """A pool index to reuse: the least recently used page pinned by no slot, else one pinned by another slot
        (a slot not served lately), never one in `keep` (this access's pinned pages)."""
        pinned = {(s, p) for s, ps in self.pins.items() for p in ps}
        for unpinned_only in (True, False):
            for key in self.where:
                if key in keep or (unpinned_only and key in pinned):
                    continue
                return self.where.pop(key)
        return None

    def access(self, slot: int, first: int, end: int, fresh: int, written: int) -> Access:
        """Pages first .. end - 1 of a slot are read; pages from `written` on get new rows (their stage copy goes
        to the pool where they are resident), and those from `fresh` on hold nothing before them (all they hold
        is written now), so they are admitted without a read."""
        pins = self.pinned(end)
        self.pins[slot] = pins
        keep = {(slot, p) for p in pins}
        out = Access()
        for p in range(first, end):
            key = (slot, p)
            idx = self.where.get(key)
            if idx is not None:
                self.where.move_to_end(key)
                if p < fresh:
                    out.hits.append((p, idx))
                if p >= written:
                    out.to_pool.append((p, idx))
                continue
            if p < fresh:
                out.misses.append(p)
            if self.free:
                idx = self.free.pop()
            elif p in pins:
                idx = self._victim(keep)
                # a victim this access already gathered keeps its hit (the gather runs before any pool write),
                # but its rows no longer go to the pool page it gave up
                out.to_pool = [(q, i) for q, i in out.to_pool if i != idx]
            if idx is not None:
                self.where[key] = idx
                out.to_pool.append((p, idx))
        return out

    def drop(self, slot: int, first_page: int = 0) -> None:
        """Forget a slot's pages from first_page on (their rows changed on the host)."""
        for key in [k for k in self.where if k[0] == slot and k[1] >= first_page]:
            self.free.append(self.where.pop(key))

    def swap(self, a: int, b: int) -> None:
        moved = OrderedDict()
        for (s, p), idx in self.where.items():
            moved[({a: b, b: a}.get(s, s), p)] = idx
        self.where = moved
        pa, pb = self.pins.pop(a, None), self.pins.pop(b, None)
        if pa is not None:
            self.pins[b] = pa
        if pb is not None:
            self.pins[a] = pb


MAX_RUNS = 4  # page runs copied as slices; more take one indexed copy


def _runs(pairs: list) -> list[tuple[int, int, int]]:
    """(page, pool index) pairs sorted by page -> runs (first page, first index, length) where both go up by one."""
    out: list[list[int]] = []
    for p, i in pairs:
        if out and out[-1][0] + out[-1][2] == p and out[-1][1] + out[-1][2] == i:
            out[-1][2] += 1
        else:
            out.append([p, i, 1])
    return [(p, i, n) for p, i, n in out]


def _parts(buf) -> list[torch.Tensor]:
    """The tensors a K or V buffer is made of, each indexed [slot, position, ...]."""
    return [buf.qs, buf.d] if isinstance(buf, QuantRows) else [buf]


def _pin(cache: KVCache) -> None:
    """Move a host cache's buffers to pinned memory (copies over PCIe run at the link's speed from there)."""
    for bufs in (cache.k, cache.v):
        if bufs is None:
            continue
        for i, buf in enumerate(bufs):
            if isinstance(buf, QuantRows):
                buf.qs, buf.d = buf.qs.pin_memory(), buf.d.pin_memory()
            elif buf is not None:
                bufs[i] = buf.pin_memory()


class WindowKVCache:
    """KVCache's interface over a host copy of every slot and a VRAM page pool per layer (the module's
    docstring). Eager steps only: positions are host values (CUDA-graph decode is turned off with the window)."""

    plain = False  # (no kernel writes rows into these buffers itself)
    eager_only = True

    def __init__(self, n_layers: int, n_slots: int, max_ctx: int, k_shape, v_shape, dtype: torch.dtype, device,
                 window: int, page: int = PAGE_TOKENS, k_type=None, v_type=None, layers=None, recurrent=None):
        if page <= 0 or window < page * (SINK_PAGES + RECENT_PAGES):
            raise StrataError(f"--kv-vram-tokens {window}: the window needs at least {SINK_PAGES + RECENT_PAGES} "
                              f"pages of {page} tokens ({page * (SINK_PAGES + RECENT_PAGES)} tokens a layer)")
        self.n_layers, self.n_slots, self.max_ctx = n_layers, n_slots, max_ctx
        self.dtype, self.device, self.page, self.window = dtype, torch.device(device), page, window
        self.recurrent = recurrent
        self.pages = -(-max_ctx // page)
        padded = self.pages * page
        own = list(range(n_layers)) if layers is None else list(layers)
        types = dict(k_type=k_type, v_type=v_type)
        self.host = KVCache(n_layers, n_slots, padded, k_shape, v_shape, dtype, "cpu", layers=own, **types)
        if self.device.type == "cuda":
            _pin(self.host)
        self.pool = KVCache(n_layers, window // page, page, k_shape, v_shape, dtype, self.device, layers=own, **types)
        self.stage = KVCache(1, 1, padded, k_shape, v_shape, dtype, self.device, **types)
        self.k, self.v = self.host.k, self.host.v  # (what the cache stores, as KVCache's attributes say)
        self.k_type, self.v_type, self.quantized = self.host.k_type, self.host.v_type, self.host.quantized
        self.policy = {i: PagePolicy(window // page) for i in own}
        self.stats = WindowStats()
        # bytes of one page in every part (K and V, blocks and scales): what a miss moves
        self.page_bytes = sum(t[0, :page].numel() * t.element_size() for buf in (self.host.k[own[0]],
                              self.host.v[own[0]] if self.host.v is not None else None) if buf is not None
                              for t in _parts(buf)) if own else 0
        self._staged: tuple | None = None  # (layer, slot, first, end) the stage holds now

    # -- sizes ---------------------------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """VRAM held: the page pools and the stage (the host copy is host_nbytes)."""
        return self.pool.nbytes + self.stage.nbytes + (self.recurrent.nbytes if self.recurrent is not None else 0)

    @property
    def host_nbytes(self) -> int:
        return self.host.nbytes

    bytes_per_token = staticmethod(KVCache.bytes_per_token)

    def describe(self) -> str:
        where = "VRAM" if self.device.type == "cuda" else f"{self.device.type} memory"
        return (f"KV window: {self.window} tokens a layer in {where} ({self.window // self.page} pages of {self.page}; "
                f"{(self.pool.nbytes + self.stage.nbytes) / 2**20:.0f} MiB with the stage), the whole KV "
                f"({self.n_slots} x {self.max_ctx} tokens, {self.host.nbytes / 2**20:.0f} MiB) in host RAM")

    # -- the stage -----------------------------------------------------------------------------------------------
    def _bufs(self, cache: KVCache, layer: int) -> list:
        return [b for b in (cache.k[layer], cache.v[layer] if cache.v is not None else None) if b is not None]

    def _pages(self, t: torch.Tensor) -> torch.Tensor:
        """A slot's [padded, ...] rows (the stage's or a host slot's) viewed as [pages, page, ...]."""
        return t.view(self.pages, self.page, *t.shape[1:])

    def _gather(self, layer: int, slot: int, acc: Access) -> None:
        """Fill the stage's pages this access reads: from the pool (one indexed copy a part) and from the host (one
        copy per run of consecutive pages)."""
        st, pool, host = self._bufs(self.stage, 0), self._bufs(self.pool, layer), self._bufs(self.host, layer)
        for s, q in zip(st, pool):
            for ts, tq in zip(_parts(s), _parts(q)):
                self._copy(self._pages(ts[0]), tq, acc.hits, to_pool=False)
        runs = _runs([(p, p) for p in acc.misses])
        for s, h in zip(st, host):
            for ts, th in zip(_parts(s), _parts(h)):
                sv, hv = self._pages(ts[0]), self._pages(th[slot])
                for a, _, n in runs:
                    sv[a:a + n].copy_(hv[a:a + n], non_blocking=True)
        self.stats.hits += len(acc.hits)
        self.stats.misses += len(acc.misses)
        self.stats.miss_bytes += len(acc.misses) * self.page_bytes

    def _copy(self, staged: torch.Tensor, pool: torch.Tensor, pairs: list, to_pool: bool) -> None:
        """Copy pages between the stage [pages, page, ...] and a pool part [pool pages, page, ...], (page, pool
        index) pairs: a slice copy per run where the pairs run in step (the usual case: pages admitted in order
        take pool pages in order), else one indexed copy (fewer launches than many short runs)."""
        if not pairs:
            return
        runs = _runs(sorted(pairs))
        if len(runs) <= MAX_RUNS:
            for p, i, n in runs:
                if to_pool:
                    pool[i:i + n].copy_(staged[p:p + n])
                else:
                    staged[p:p + n].copy_(pool[i:i + n])
            return
        pages = torch.tensor([p for p, _ in pairs], device=self.device)
        idx = torch.tensor([i for _, i in pairs], device=self.device)
        if to_pool:
            pool.index_copy_(0, idx, staged.index_select(0, pages))
        else:
            staged.index_copy_(0, pages, pool.index_select(0, idx))

    def _to_pool(self, layer: int, acc: Access) -> None:
        for s, q in zip(self._bufs(self.stage, 0), self._bufs(self.pool, layer)):
            for ts, tq in zip(_parts(s), _parts(q)):
                self._copy(self._pages(ts[0]), tq, acc.to_pool, to_pool=True)

    def _access(self, layer: int, slot: int, first: int, end: int, k=None, v=None, start: int = 0) -> None:
        """Stage positions first .. end - 1 of a slot's layer, writing k, v at start .. end - 1 (k None: a read)."""
        P = self.page
        if end > self.max_ctx or first < 0:
            raise StrataError(f"KV positions {first}..{end} are outside the context of {self.max_ctx}")
        if k is None:
            fresh = written = -(-end // P)
        else:
            fresh, written = -(-start // P), start // P
        acc = self.policy[layer].access(slot, first // P, -(-end // P), fresh, written)
        self._gather(layer, slot, acc)
        if k is not None:
            self.stage.write(0, Segment(0, start, end - start), k, v)
            for s, h in zip(self._bufs(self.stage, 0), self._bufs(self.host, layer)):
                for ts, th in zip(_parts(s), _parts(h)):
                    th[slot, start:end].copy_(ts[0, start:end], non_blocking=True)
        self._to_pool(layer, acc)
        self._staged = (layer, slot, first, end)

    def _stage_view(self, first: int, end: int):
        # (a quantized stage is dequantized from position 0 as the full cache's read is: the same arithmetic)
        ks, vs = self.stage.read_window(0, 0, end)
        return ks[first:], (vs[first:] if vs is not None else None)

    # -- KVCache's interface -------------------------------------------------------------------------------------
    def write(self, layer: int, seg: Segment, k: torch.Tensor, v: torch.Tensor | None, first: int = 0) -> None:
        self._access(layer, seg.slot, first, seg.end, k, v, seg.start)

    def read(self, layer: int, seg: Segment):
        return self.read_from(layer, seg, 0)

    def read_from(self, layer: int, seg: Segment, first: int):
        st = self._staged
        if st is None or st[:2] != (layer, seg.slot) or st[2] > first or st[3] != seg.end:
            self._access(layer, seg.slot, first, seg.end)
        return self._stage_view(first, seg.end)

    def read_window(self, layer: int, slot: int, n: int):
        self._access(layer, slot, 0, n)
        return self._stage_view(0, n)

    def write_at(self, *a, **kw):
        raise StrataError("the KV window runs decode steps eagerly (a device-side position has no page table)")

    read_window_blocks = write_at

    # -- slots ---------------------------------------------------------------------------------------------------
    def _sync(self) -> None:
        # host rows are written by asynchronous copies on the device's stream: wait before the host reads them
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self._staged = None

    def _drop(self, slot: int, first: int = 0) -> None:
        for pol in self.policy.values():
            pol.drop(slot, first // self.page)
        self._staged = None

    def copy_prefix(self, src_slot: int, dst_slot: int, n: int) -> None:
        self._sync()
        self.host.copy_prefix(src_slot, dst_slot, n)
        self._drop(dst_slot)

    def swap_slots(self, a: int, b: int, n: int) -> None:
        if a == b or n <= 0:
            return
        self._sync()
        for bufs in (self.host.k, self.host.v):
            for buf in bufs or ():
                for t in _parts(buf) if buf is not None else ():
                    tmp = t[a].clone()
                    t[a] = t[b]
                    t[b] = tmp
        for pol in self.policy.values():
            pol.swap(a, b)
        if self.recurrent is not None:
            self.recurrent.swap(a, b)

    def save_rows(self, layer: int, slot: int, n: int, which: str = "k") -> list[torch.Tensor]:
        self._sync()
        return self.host.save_rows(layer, slot, n, which)

    def load_rows(self, layer: int, slot: int, n: int, rows: list[torch.Tensor], which: str = "k") -> None:
        self._sync()
        self.host.load_rows(layer, slot, n, rows, which)
        if layer in self.policy:  # (the pool's copies of the slot's pages are stale now)
            self.policy[layer].drop(slot)


# -- choosing the cache ------------------------------------------------------------------------------------------
def auto_tokens(left: int, per_token: int, full_tokens: int, stage: int, expert_min: int, page: int) -> int | None:
    """--kv-vram-tokens auto: the window that `left` bytes of VRAM hold once `expert_min` bytes are kept for the
    expert cache and `stage` for the stage buffer; None when the whole KV (`full_tokens` a layer, `per_token` bytes
    a token over every layer) fits beside them (no window)."""
    if full_tokens * per_token + expert_min <= left:
        return None
    room = left - expert_min - stage
    return max(0, room // max(per_token, 1)) // page * page


def _auto(model, cfg, n_slots: int, max_ctx: int, n_layers: int, dtype, k_type, v_type, page: int) -> int | None:
    dev = torch.device(model.device)
    if dev.type != "cuda":
        return None  # on a CPU the KV is in RAM either way
    from strata.experts.sizing import PREFILL_TARGET, model_prefill_bytes, prefill_left

    ex = cfg.experts
    free, total = torch.cuda.mem_get_info(dev)
    budget = total if ex.vram_gb is None else min(total, int(ex.vram_gb * (1 << 30)))
    left = prefill_left(budget, total - free, ex.vram_reserve_mib * (1 << 20))
    per_token = model.kv_bytes_per_token(dtype, k_type, v_type)  # every layer's
    stage = per_token // max(1, n_layers) * (-(-max_ctx // page) * page)  # one layer's whole context
    args = model.args
    k = max(1, int(getattr(args, "n_experts_used", 0) or 1))
    # the expert cache keeps at least two slots a layer for every expert a token routes to, and a default prefill
    # chunk's activations beside it (the engine sizes both after the KV cache)
    store = getattr(model.experts, "store", None)  # (the tiered backend's host copy; None: resident or dense)
    expert_min = 2 * k * sum(store.expert_nbytes(i) for i in model.experts.layer_ids) if store is not None else 0
    expert_min += PREFILL_TARGET * model_prefill_bytes(args)
    return auto_tokens(left, per_token, n_slots * max_ctx, stage, expert_min, page)


def default_ctx(cfg, trained: int | None) -> int | None:
    """The context when -c is not given: with a KV window on a GPU, the model's trained context (its KV lives in
    host RAM, which new_kv_cache checks with the numbers); None otherwise (the usual default)."""
    if parse_tokens(getattr(cfg, "kv_vram_tokens", None)) is None or cfg.torch_device.type != "cuda" or not trained:
        return None
    log.info("strata: context %d tokens, the model's own: the KV window keeps the KV in host RAM (-c sets it)",
             trained)
    return int(trained)


def _check_host_ram(n_slots: int, max_ctx: int, page: int, per_token: int) -> None:
    """A context whose whole KV the host cannot hold is refused with the numbers, never cut short silently."""
    need = n_slots * -(-max_ctx // page) * page * per_token
    avail = ram_available()
    if avail is None or need <= avail:
        return
    fits = avail // max(1, n_slots * per_token) // page * page
    raise StrataError(f"--kv-vram-tokens: the KV of {n_slots} slot(s) x {max_ctx} tokens needs {need / 2**30:.2f} "
                      f"GiB of host RAM, {avail / 2**30:.2f} GiB is available: -c {fits} fits")


def new_kv_cache(model, n_slots: int, max_ctx: int, cfg, dtype=None, k_type=None, v_type=None):
    """The engine's KV cache: the model's own (everything in VRAM) unless --kv-vram-tokens asks for a window
    smaller than every slot's context, then a WindowKVCache over the same layers (and recurrent state)."""
    tokens = parse_tokens(getattr(cfg, "kv_vram_tokens", None))
    if tokens is None:
        return model.new_kv_cache(n_slots, max_ctx, dtype, k_type, v_type)
    page = int(getattr(cfg, "kv_page_tokens", PAGE_TOKENS))
    if getattr(model, "cache_spec", None) is None:
        raise StrataError("--kv-vram-tokens: this model's KV cache has no window (pipeline stages, say); leave "
                          "the flag out")
    # the layers this process holds and any recurrent state, from the model itself (a context of one position)
    probe = model.new_kv_cache(n_slots, 1, dtype, k_type, v_type)
    if tokens == "auto":
        tokens = _auto(model, cfg, n_slots, max_ctx, probe.n_layers, dtype, k_type, v_type, page)
        if tokens is None:
            log.info("strata: --kv-vram-tokens auto: the whole KV fits in VRAM (no window)")
            return model.new_kv_cache(n_slots, max_ctx, dtype, k_type, v_type)
        log.info("strata: --kv-vram-tokens auto: a window of %d tokens a layer", tokens)
    asked = tokens
    if tokens % page:
        rounded = -(-tokens // page) * page
        log.info("strata: --kv-vram-tokens %d rounded up to %d (whole pages of %d tokens)", tokens, rounded, page)
        tokens = rounded
    whole = n_slots * -(-max_ctx // page) * page
    if tokens >= whole:
        log.info("strata: --kv-vram-tokens %d holds every slot's whole context (%d x %d tokens): the KV cache is "
                 "all in VRAM, no window", tokens, n_slots, max_ctx)
        return model.new_kv_cache(n_slots, max_ctx, dtype, k_type, v_type)
    least = page * (SINK_PAGES + RECENT_PAGES)
    if tokens < least:  # (named as typed: the rounded figure is one the user never wrote)
        raise StrataError(f"--kv-vram-tokens {asked}: the window needs at least {SINK_PAGES + RECENT_PAGES} pages "
                          f"of {page} tokens ({least} tokens a layer; --kv-page-tokens sets the page)")
    _check_host_ram(n_slots, max_ctx, page, model.kv_bytes_per_token(dtype, k_type, v_type))
    own = [i for i, b in enumerate(probe.k) if b is not None]
    spec = model.cache_spec
    kv = WindowKVCache(probe.n_layers, n_slots, max_ctx, spec.k_shape, spec.v_shape, dtype or model.dtype,
                       model.device, tokens, page, k_type, v_type, own, probe.recurrent)
    log.info("strata: %s; decode steps run without CUDA graphs", kv.describe())
    return kv
