"""Attention: grouped-query attention (Qwen3, Llama, Mixtral; with sinks and sliding windows: gpt-oss) and
multi-head latent attention (DeepSeek-V2/V3).

Tokens of several sequences arrive flattened ([N, d]); `segments` says which slot and positions each run of
tokens belongs to. Projections run once over all N tokens; the score/softmax part runs per segment against that
slot's cache.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from strata.kv.cache import KVCache, Segment
from strata.layers.norm import rms_norm
from strata.layers.rotary import Rotary
from strata.ops import registry
from strata.ops.reference import gqa_attention as _gqa  # the one-segment attention (tests/layers)
from strata.ops.reference import sink_attention
from strata.quant import QTensor, qmatmul
from strata.quant.matmul import CPU_ROWS_ALONE

_ARANGES: dict[tuple[int, torch.device], torch.Tensor] = {}


_ONE_QUERY = registry.op("one_query_attention")
_ONE_QUERY_BLOCKS = registry.op("one_query_attention_blocks")
_ROWS = registry.op("rows_attention")

def _capturing(t: torch.Tensor) -> bool:
    # a tensor made inside a CUDA-graph capture holds nothing until the graph replays: cache only eager ones
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _arange(n: int, device: torch.device) -> torch.Tensor:
    """0..n-1 on `device`, built once (a constant: the windowed mask is then one comparison kernel a layer)."""
    key = (n, device)
    t = _ARANGES.get(key)
    if t is None:
        t = torch.arange(n, device=device)
        if not _capturing(t):
            _ARANGES[key] = t
    return t


def _window_mask(window: int, pos_t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[n, window] additive mask in the query's dtype for the n queries at the device-side positions pos_t [n]: 0
    up to each query's position, -inf beyond (n > 1: a verify step's causal mask). (Given a boolean mask, SDPA
    would spend three more kernels a call turning it into this.) Built from device tensors and Python scalars
    only: a CPU tensor operand would be a host copy, which CUDA-graph capture forbids."""
    m = torch.zeros(pos_t.shape[0], window, dtype=dtype, device=pos_t.device)
    return m.masked_fill_(_arange(window, pos_t.device)[None, :] > pos_t[:, None], float("-inf"))


# Device types whose prompt chunks take SDPA's lower-right causal bias instead of a materialized [n, L] mask: the
# bias lets SDPA pick its flash / memory-efficient kernels for a chunk of n queries at the end of L keys (a mask
# rules flash out; a long prefix's chunks then ran far from the tensor cores' rate). "cuda" once
# tests/layers/test_causal_bias.py (marked gpu) has passed on a GPU. Not "cpu": there SDPA materializes the bias into
# the same mask anyway, after a Python-level dispatch through the bias's tensor subclass that made a verify step of
# 2-4 tokens spend more on its masks than on its attention (the test still checks the bias on the CPU).
CAUSAL_BIAS_ON = frozenset({"cuda"})


def _causal_mask(seg: Segment, device):
    if seg.n == 1:
        return None  # one query sees the whole prefix
    if torch.device(device).type in CAUSAL_BIAS_ON:
        # (imported here: torch.nn.attention.bias imports torch._dynamo, over a second of every process's start)
        from torch.nn.attention.bias import causal_lower_right

        return causal_lower_right(seg.n, seg.end)  # query i of the chunk sees keys 0 .. start + i
    q = torch.arange(seg.start, seg.end, device=device).unsqueeze(1)
    k = torch.arange(seg.end, device=device).unsqueeze(0)
    return k <= q  # [n, L]


def units(segments: list[Segment], x: torch.Tensor) -> list[Segment]:
    """The segments as attention computes them: on the CPU, one of 2 .. CPU_ROWS_ALONE tokens (a verify step's, a
    short prompt tail's) becomes one-token segments, each computed as a one-token step computes it (its KV row
    written, its own prefix read). A product over the whole segment would sum in another order than a one-token
    step does, and a token's logits would depend on the tokens beside it (strata.quant.matmul.CPU_ROWS_ALONE)."""
    if x.is_cuda or all(s.n == 1 or s.window or s.n > CPU_ROWS_ALONE for s in segments):
        return segments
    out = []
    for s in segments:
        if 1 < s.n <= CPU_ROWS_ALONE and not s.window:
            out.extend(Segment(s.slot, s.start + j, 1) for j in range(s.n))
        else:
            out.append(s)
    return out


def _rows_alone(seg: Segment, x: torch.Tensor) -> bool:
    """A CPU segment of 2 .. CPU_ROWS_ALONE queries (a verify step's): attended one query at a time (`attend`),
    so it needs no causal mask."""
    return 1 < seg.n <= CPU_ROWS_ALONE and not seg.window and not x.is_cuda


def attend(q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, mask, seg: Segment, scale: float) -> torch.Tensor:
    """_gqa of a segment's queries q [n, H, D] over the slot's keys up to its end. On the CPU a segment of 1 ..
    CPU_ROWS_ALONE queries (a decode or verify step's) is op `rows_attention`: each query over its own prefix, what
    a one-token step computes, bit for bit (a masked product sums in another order: `units`)."""
    if not q.is_cuda and not seg.window and seg.n <= CPU_ROWS_ALONE:
        return _ROWS(q, ks, vs, seg.start, scale)
    return _gqa(q, ks, vs, mask, scale)


def _cache_step(kv: KVCache, layer: int, seg: Segment, k: torch.Tensor, v: torch.Tensor | None,
                want_mask: bool = True):
    """Write a segment's K/V and return (keys, values, mask) to attend over: the slot's prefix, or for a
    static-shape decode segment the fixed window masked beyond the device-side position (None without
    `want_mask`: a caller that may not need it builds it itself, see _one_query)."""
    if seg.window:
        kv.write_at(layer, seg.slot, seg.pos_t, k, v)
        ks, vs = kv.read_window(layer, seg.slot, seg.window)
        return ks, vs, (_window_mask(seg.window, seg.pos_t, k.dtype) if want_mask else None)
    kv.write(layer, seg, k, v)
    ks, vs = kv.read(layer, seg)
    return ks, vs, (_causal_mask(seg, k.device) if want_mask else None)


def _one_query(q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, seg: Segment, scale: float,
               mask_dtype: torch.dtype) -> torch.Tensor:
    """A static decode step's one query [1, H, D] over its window: the split kernel reads the position on the
    device and needs no mask, so the window's mask (three launches a layer) is built only for the reference."""
    if _ONE_QUERY.pick(q, ks, vs, None, seg.pos_t, scale) is not None:
        return _ONE_QUERY(q, ks, vs, None, seg.pos_t, scale)
    return _ONE_QUERY(q, ks, vs, _window_mask(seg.window, seg.pos_t, mask_dtype), seg.pos_t, scale)


def _one_query_blocks(kv: KVCache, layer: int, seg: Segment, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      scale: float) -> torch.Tensor | None:
    """A static decode step's query over a quantized KV cache, read where it lies (q8_0/q4_0 blocks, not a
    dequantized copy of the window) by the kernel that takes it; None where none does (nothing written then)."""
    kb, vb = kv.read_window_blocks(layer, seg.slot, seg.window)
    if vb is None or _ONE_QUERY_BLOCKS.pick(q, kb, vb, seg.pos_t, scale) is None:
        return None
    kv.write_at(layer, seg.slot, seg.pos_t, k, v)
    return _ONE_QUERY_BLOCKS(q, kb, vb, seg.pos_t, scale)


# A static (graphed) segment of 2 .. VERIFY_ROWS queries — a speculative verify step's — runs the decode step's
# split-key kernel with every query at its own device-side position (a q8_0 / q4_0 cache: its block kernel once per
# query), instead of SDPA over the whole window under an [n, window] mask: the keys read stop at the last query's
# position (a verify step near the start of a long window read all of it). On "cuda" since
# tests/layers/test_verify_rows.py (marked gpu) passed on an H200 (the flag turns it off there, for comparisons);
# elsewhere it is always on (the reference twin).
VERIFY_ROWS = 8
VERIFY_ROWS_GPU_TESTED = True
# such a segment's K/V rows written by the rotary kernel into a plain cache (GQAttention._fold: the slot's rows
# expanded, slot stride 0) instead of an index_copy_ each for K and V a layer: taken on "cuda" once
# tests/engine/test_graphed_verify.py (its cuda test, fold=True) and tests/ops/test_fused_interpret.py (marked gpu)
# have passed there
VERIFY_KV_FOLD_GPU_TESTED = True


def _verify_rows(seg: Segment, device: torch.device) -> bool:
    return bool(seg.window) and 1 < seg.n <= VERIFY_ROWS and (device.type != "cuda" or VERIFY_ROWS_GPU_TESTED)


def _rows_one_query(kv: KVCache, layer: int, seg: Segment, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    scale: float, dtype: torch.dtype) -> torch.Tensor:
    """A static segment's n queries q [n, H, D] each over its own prefix of the window (its K/V rows k, v written
    first, all n at once), by the op a decode step calls: [n, H, Dv]."""
    rows = [Segment(seg.slot, seg.start + j, 1, pos_t=seg.pos_t[j:j + 1], window=seg.window) for j in range(seg.n)]
    if kv.quantized:
        kb, vb = kv.read_window_blocks(layer, seg.slot, seg.window)
        if vb is not None and _ONE_QUERY_BLOCKS.pick(q[:1], kb, vb, rows[0].pos_t, scale) is not None:
            kv.write_at(layer, seg.slot, seg.pos_t, k, v)
            return torch.cat([_ONE_QUERY_BLOCKS(q[j:j + 1], kb, vb, r.pos_t, scale) for j, r in enumerate(rows)])
    ks, vs, _ = _cache_step(kv, layer, seg, k, v, want_mask=False)
    ks, vs = _as_dtype(ks, vs, dtype)
    # all n queries in one launch of the split kernel (each key read once for them); its twin: the [n, window] mask
    return _one_query(q, ks, vs, seg, scale, k.dtype)


def _as_dtype(ks: torch.Tensor, vs: torch.Tensor | None, dtype: torch.dtype):
    """Keys and values in the activations' dtype (a cache in another dtype: each of K and V may have its own)."""
    if ks.dtype != dtype:
        ks = ks.to(dtype)
    if vs is not None and vs.dtype != dtype:
        vs = vs.to(dtype)
    return ks, vs


FUSE_QKV_ON = ("cuda",)  # device types whose attention weights are fused (tests add "cpu")


def fuse_rows(ws, biases=None, always: bool = False) -> tuple[QTensor | None, list[int]]:
    """On a GPU, projections of one input and one format (attention's q, k and v; a delta-net layer's qkv, gate
    and ba; a SwiGLU's gate and up) as one weight (their rows one after another): a decode step then reads them in
    one GEMV launch instead of one each (each launch of a small GEMV costs a few microseconds whatever its size).
    Not on a CPU, where the weights stay mapped from the file, nor across formats (a Q4_K_M file's attn_v is often
    Q6_K), nor with some biases but not all. always: on any device (a small set copied: an MTP block's one layer,
    whose forwards a drafted step runs several times). Returns (the fused weight, each part's rows) or (None, [])."""
    ws = tuple(ws)
    biases = tuple(biases) if biases is not None else (None,) * len(ws)
    if any(w is None or len(w.shape) != 2 for w in ws) or not (always or ws[0].raw.device.type in FUSE_QKV_ON):
        return None, []
    if len({w.qtype for w in ws}) != 1 or len({w.shape[1] for w in ws}) != 1 or len({b is None for b in biases}) != 1:
        return None, []
    sizes = [w.shape[0] for w in ws]
    raw = torch.cat([w.raw.reshape(w.shape[0], -1) for w in ws])
    return QTensor(raw, ws[0].qtype, (sum(sizes), ws[0].shape[1])), sizes


def row_views(w: QTensor, sizes: list[int]) -> list[QTensor]:
    out, a = [], 0
    for n in sizes:
        out.append(QTensor(w.raw[a:a + n], w.qtype, (n, w.shape[1])))
        a += n
    return out


def _linear(x: torch.Tensor, w: QTensor, b: torch.Tensor | None) -> torch.Tensor:
    y = qmatmul(x, w)
    return y + b.to(y.dtype) if b is not None else y


class GQAttention:
    """Grouped-query attention with optional per-head Q/K RMSNorm (Qwen3) and optional biases (Qwen2)."""

    def __init__(self, layer: int, args, w: dict, rotary: Rotary):
        self.layer, self.rotary = layer, rotary
        self.n_heads, self.n_kv, self.hd, self.vd = args.n_heads, args.n_kv_heads, args.head_dim, args.v_head_dim
        self.eps = args.norm_eps
        self.wq, self.wk, self.wv, self.wo = w["attn_q"], w["attn_k"], w["attn_v"], w["attn_output"]
        self.bq, self.bk, self.bv = w.get("attn_q.bias"), w.get("attn_k.bias"), w.get("attn_v.bias")
        self.q_norm, self.k_norm = w.get("attn_q_norm"), w.get("attn_k_norm")
        self.scale = 1.0 / math.sqrt(self.hd)
        # a static step's K/V rows written by the rotary kernel at the rotary's positions: only where a token's
        # position is its cache row (an MTP block rotates row i at position i + 1, and turns this off)
        self.fold_kv = True
        self._cast_biases: dict[torch.dtype, tuple] = {}
        self.wqkv, self.qkv_sizes = fuse_rows((self.wq, self.wk, self.wv), (self.bq, self.bk, self.bv))
        if self.wqkv is not None:  # the three become row views of the one copy (no second copy kept)
            self.wq, self.wk, self.wv = row_views(self.wqkv, self.qkv_sizes)

    @staticmethod
    def cache_shapes(args) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (args.n_kv_heads, args.head_dim), (args.n_kv_heads, args.v_head_dim)

    def _project(self, x: torch.Tensor, bq, bk, bv) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [n, d] -> q, k, v [n, *] (views of one output when the weights are fused)."""
        if self.wqkv is None:
            return _linear(x, self.wq, bq), _linear(x, self.wk, bk), _linear(x, self.wv, bv)
        y = qmatmul(x, self.wqkv)
        if bq is not None:
            y = y + torch.cat([bq, bk, bv])
        return y.split(self.qkv_sizes, dim=-1)

    def _biases(self, dtype: torch.dtype) -> tuple:
        # cast once per activation dtype, not in every step (a cast is a kernel)
        got = self._cast_biases.get(dtype)
        if got is None:
            got = tuple(b.to(dtype) if b is not None else None for b in (self.bq, self.bk, self.bv))
            if not any(b is not None and _capturing(b) for b in got):
                self._cast_biases[dtype] = got
        return got

    def _fold(self, q, k, v, pos, segments: list[Segment], kv: KVCache):
        """q' with the step's K/V rows written into a plain cache by the rotary kernel (no index_copy_ after it),
        or None where no kernel takes the step: a decode step of sequences in slots 0 .. n-1 (token t at (slot t,
        pos[t])), or one sequence's verify segment (every token in its slot: the slot's rows expanded n times, the
        kernel's slot stride 0)."""
        n, L = q.shape[0], self.layer
        kc, vc = kv.k[L], kv.v[L]
        if len(segments) == n and all(s.window and s.n == 1 and s.slot == j for j, s in enumerate(segments)):
            pass
        elif len(segments) == 1 and _verify_rows(segments[0], q.device) and (
                q.device.type != "cuda" or VERIFY_KV_FOLD_GPU_TESTED):
            s = segments[0].slot
            kc = kc[s : s + 1].expand(n, *kc.shape[1:])
            vc = vc[s : s + 1].expand(n, *vc.shape[1:])
        else:
            return None
        return self.rotary.qk_into_cache(q, k, v, pos, self.q_norm, self.k_norm, self.eps, kc, vc)

    def last_query(self, x: torch.Tensor, pos: torch.Tensor, seg: Segment, kv: KVCache) -> torch.Tensor:
        """One plain segment's K/V rows written (all of x's rows, at pos) and its last row's attention output alone
        [1, d], for a caller that reads no other row's (an MTP block over the rows a step settled)."""
        n = x.shape[0]
        bq, bk, bv = self._biases(x.dtype)
        q = _linear(x[-1:], self.wq, bq).view(1, self.n_heads, self.hd)
        k = _linear(x, self.wk, bk).view(n, self.n_kv, self.hd)
        v = _linear(x, self.wv, bv).view(n, self.n_kv, self.vd)
        # (the last query broadcast over the rows: the rotary takes q and k row for row; its last row is the one kept)
        q, k = self.rotary.qk(q.expand(n, -1, -1), k, pos, self.q_norm, self.k_norm, self.eps)
        kv.write(self.layer, seg, k, v)
        ks, vs = _as_dtype(*kv.read(self.layer, seg), x.dtype)
        # one query over the whole prefix, as the last row of the whole forward computes it
        o = _ROWS(q[-1:], ks, vs, ks.shape[0] - 1, self.scale) if not x.is_cuda else _gqa(q[-1:], ks, vs, None,
                                                                                              self.scale)
        return qmatmul(o.reshape(1, self.n_heads * self.vd), self.wo)

    def __call__(self, x: torch.Tensor, pos: torch.Tensor, segments: list[Segment], kv: KVCache) -> torch.Tensor:
        n = x.shape[0]
        bq, bk, bv = self._biases(x.dtype)
        q, k, v = self._project(x, bq, bk, bv)
        q = q.view(n, self.n_heads, self.hd)
        k = k.view(n, self.n_kv, self.hd)
        v = v.view(n, self.n_kv, self.vd)
        written = self._fold(q, k, v, pos, segments, kv) if self.fold_kv and kv.plain else None
        if written is not None:
            q = written
        else:
            q, k = self.rotary.qk(q, k, pos, self.q_norm, self.k_norm, self.eps)  # one launch on CUDA
        outs, i = [], 0
        for seg in segments:
            one = bool(seg.window) and seg.n == 1  # a static decode step's query: split over the keys on a GPU
            if written is not None:  # (the rows are in the cache): each query over its own prefix of the window
                ks, vs = _as_dtype(*kv.read_window(self.layer, seg.slot, seg.window), x.dtype)
                outs.append(_one_query(q[i : i + seg.n], ks, vs, seg, self.scale, x.dtype))
                i += seg.n
                continue
            if one and kv.quantized:
                o = _one_query_blocks(kv, self.layer, seg, q[i : i + 1], k[i : i + 1], v[i : i + 1], self.scale)
                if o is not None:
                    outs.append(o)
                    i += 1
                    continue
            if _verify_rows(seg, x.device):
                outs.append(_rows_one_query(kv, self.layer, seg, q[i : i + seg.n], k[i : i + seg.n],
                                            v[i : i + seg.n], self.scale, x.dtype))
                i += seg.n
                continue
            ks, vs, mask = _cache_step(kv, self.layer, seg, k[i : i + seg.n], v[i : i + seg.n],
                                       want_mask=not (one or _rows_alone(seg, x)))  # [L, Hkv, D]
            ks, vs = _as_dtype(ks, vs, x.dtype)  # (a cache in another dtype than the activations)
            if one:
                outs.append(_one_query(q[i : i + 1], ks, vs, seg, self.scale, k.dtype))
            else:
                outs.append(attend(q[i : i + seg.n], ks, vs, mask, seg, self.scale))  # [n, H, Dv]
            i += seg.n
        out = outs[0] if len(outs) == 1 else torch.cat(outs)  # [n, H, Dv]
        return qmatmul(out.reshape(n, self.n_heads * self.vd), self.wo)


class SinkAttention(GQAttention):
    """GQA with a learned sink logit per head in each softmax, an output bias, and (when `sliding` > 0) a sliding
    window: a query at position i sees the keys at i - sliding + 1 .. i (gpt-oss's alternate layers).

    Always the torch reference (`strata.ops.reference.sink_attention`): the one-query split kernel and SDPA take
    neither sinks nor per-layer windows. The KV cache keeps every position of every layer (a sliding layer
    reads only its window of it)."""

    def __init__(self, layer: int, args, w: dict, rotary: Rotary, sinks: torch.Tensor, sliding: int = 0):
        super().__init__(layer, args, w, rotary)
        self.sinks, self.sliding = sinks.float(), int(sliding)
        self.bo = w.get("attn_output.bias")

    def _mask(self, seg: Segment, device) -> tuple[int, torch.Tensor | None]:
        """(first key read, additive mask [n or 1, keys read] or None) of an eager segment."""
        first = max(0, seg.start - self.sliding + 1) if self.sliding else 0
        if seg.n == 1:
            return first, None  # one query sees every key read
        q = torch.arange(seg.start, seg.end, device=device).unsqueeze(1)
        k = torch.arange(first, seg.end, device=device).unsqueeze(0)
        seen = k <= q
        if self.sliding:
            seen &= q - k < self.sliding
        m = torch.zeros(seen.shape, dtype=torch.float32, device=device)
        return first, m.masked_fill_(~seen, float("-inf"))

    def _static_mask(self, window: int, pos_t: torch.Tensor) -> torch.Tensor:
        """[n, window] for a static step's n queries at pos_t [n] (device tensors only: capturable): past each
        query's position, and for a sliding layer before its window, -inf."""
        ar = _arange(window, pos_t.device)[None, :]
        pt = pos_t[:, None]
        off = ar > pt
        if self.sliding:
            off |= ar <= pt - self.sliding
        return torch.zeros(off.shape, dtype=torch.float32, device=pos_t.device).masked_fill_(off, float("-inf"))

    # (the sinks and the sliding window are not in GQAttention's one-query tail: MtpHead takes the whole forward)
    last_query = None

    def __call__(self, x: torch.Tensor, pos: torch.Tensor, segments: list[Segment], kv: KVCache) -> torch.Tensor:
        n = x.shape[0]
        bq, bk, bv = self._biases(x.dtype)
        q, k, v = self._project(x, bq, bk, bv)
        q = q.view(n, self.n_heads, self.hd)
        k = k.view(n, self.n_kv, self.hd)
        v = v.view(n, self.n_kv, self.vd)
        q, k = self.rotary.qk(q, k, pos)
        sinks = self.sinks if self.sinks.device == x.device else self.sinks.to(x.device)
        outs, i = [], 0
        for seg in units(segments, x):
            kk, vv = k[i : i + seg.n], v[i : i + seg.n]
            if seg.window:
                kv.write_at(self.layer, seg.slot, seg.pos_t, kk, vv)
                ks, vs = kv.read_window(self.layer, seg.slot, seg.window)
                mask = self._static_mask(seg.window, seg.pos_t)
            else:
                first, mask = self._mask(seg, x.device)
                kv.write(self.layer, seg, kk, vv, first)
                ks, vs = kv.read_from(self.layer, seg, first)  # a sliding layer reads its window only
            outs.append(sink_attention(q[i : i + seg.n], ks, vs, mask, self.scale, sinks))  # [n, H, Dv]
            i += seg.n
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return _linear(out.reshape(n, self.n_heads * self.vd), self.wo, self.bo)


class MLAttention:
    """DeepSeek's multi-head latent attention, computed in the absorbed form over a latent cache.

    The cache holds c_kv (kv_lora_rank) and the rotated shared key k_pe (rope_dim) per token. Queries are mapped
    into the latent space through W_kb, so scores are q_lat·c_kv + q_pe·k_pe; values come out latent and go
    through W_vb. This equals the expanded form exactly in real arithmetic.
    """

    def __init__(self, layer: int, args, w: dict, rotary: Rotary):
        self.layer, self.rotary = layer, rotary
        self.h, self.nope, self.rope, self.vd = args.n_heads, args.qk_nope_dim, args.qk_rope_dim, args.v_head_dim
        self.lora, self.eps = args.kv_lora_rank, args.norm_eps
        self.wq = w.get("attn_q")
        self.wq_a, self.q_a_norm, self.wq_b = w.get("attn_q_a"), w.get("attn_q_a_norm"), w.get("attn_q_b")
        self.wkv_a, self.kv_a_norm = w["attn_kv_a_mqa"], w["attn_kv_a_norm"]
        self.wo = w["attn_output"]
        if "attn_k_b" in w:  # newer GGUFs store the two halves of kv_b already split per head
            self.w_kb = w["attn_k_b"]  # QTensor (H, lora, nope) or as converted
            self.w_vb = w["attn_v_b"]
            self._split = True
        else:
            self.wkv_b = w["attn_kv_b"]  # (H*(nope+v), lora)
            self._split = False
        # YaRN-extended DeepSeek models scale the softmax by mscale^2 (the rotary tables carry no factor then).
        mscale = args.extra.get("mla_mscale", 1.0)
        self.scale = mscale * mscale / math.sqrt(self.nope + self.rope)

    @staticmethod
    def cache_shapes(args) -> tuple[tuple[int, ...], None]:
        return (1, args.kv_lora_rank + args.qk_rope_dim), None

    def _kv_b(self, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self._split:
            # llama.cpp's layout: k_b [H, lora, nope] (stored transposed for its kernels), v_b [H, v, lora]
            kb = self.w_kb.dequantize(torch.float32).view(self.h, self.lora, self.nope).transpose(1, 2)
            vb = self.w_vb.dequantize(torch.float32).view(self.h, self.vd, self.lora)
        else:
            kvb = self.wkv_b.dequantize(torch.float32).view(self.h, self.nope + self.vd, self.lora)
            kb, vb = kvb[:, : self.nope], kvb[:, self.nope :]
        return kb.to(dtype), vb.to(dtype)  # [H, nope, lora], [H, v, lora]

    def __call__(self, x: torch.Tensor, pos: torch.Tensor, segments: list[Segment], kv: KVCache) -> torch.Tensor:
        n = x.shape[0]
        if self.wq is not None:
            q = qmatmul(x, self.wq)
        else:
            q = qmatmul(rms_norm(qmatmul(x, self.wq_a), self.q_a_norm, self.eps), self.wq_b)
        q = q.view(n, self.h, self.nope + self.rope)
        q_nope, q_pe = q[..., : self.nope], q[..., self.nope :]
        kv_a = qmatmul(x, self.wkv_a)  # [n, lora + rope]
        c_kv = rms_norm(kv_a[:, : self.lora], self.kv_a_norm, self.eps)
        k_pe = kv_a[:, self.lora :].unsqueeze(1)  # [n, 1, rope]
        q_pe, k_pe = self.rotary.qk(q_pe, k_pe, pos)  # one launch on CUDA (strided views are read in place)
        kb, vb = self._kv_b(x.dtype)
        latent = torch.cat([c_kv, k_pe.squeeze(1)], dim=-1).unsqueeze(1)  # [n, 1, lora + rope]
        segs = units(segments, x)
        if x.is_cuda:
            o = self._attend(q_nope, q_pe, latent, segs, kv, kb, vb)
        else:  # (CPU: each sequence's, each verify row's products as a one-token step computes them)
            outs, i = [], 0
            for seg in segs:
                r = slice(i, i + seg.n)
                outs.append(self._attend(q_nope[r], q_pe[r], latent[r], [seg], kv, kb, vb))
                i += seg.n
            o = torch.cat(outs)
        return qmatmul(o.reshape(n, self.h * self.vd), self.wo)

    def _attend(self, q_nope, q_pe, latent, segments: list[Segment], kv: KVCache, kb, vb) -> torch.Tensor:
        """The absorbed attention of the rows of `segments` (their latents written to the cache) -> [m, H, v]."""
        m = q_nope.shape[0]
        q_lat = torch.einsum("nhd,hdc->nhc", q_nope, kb)  # [m, H, lora]
        q_full = torch.cat([q_lat, q_pe], dim=-1)  # [m, H, lora + rope]
        out = torch.empty(m, self.h, self.lora, dtype=q_nope.dtype, device=q_nope.device)
        i = 0
        for seg in segments:
            ks, _, mask = _cache_step(kv, self.layer, seg, latent[i : i + seg.n], None)  # [L, 1, lora + rope]
            ks = ks.to(q_nope.dtype).transpose(0, 1).unsqueeze(0)  # [1, 1, L, lora + rope]: one latent "head"
            qs = q_full[i : i + seg.n].transpose(0, 1).unsqueeze(0)  # [1, H, n, lora + rope]
            o = F.scaled_dot_product_attention(
                qs, ks, ks[..., : self.lora], attn_mask=mask, scale=self.scale,
                enable_gqa=True,
            )
            out[i : i + seg.n] = o[0].transpose(0, 1)
            i += seg.n
        return torch.einsum("nhc,hvc->nhv", out, vb)  # [m, H, v]
