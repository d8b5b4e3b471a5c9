"""One query token's attention over a KV window stored in blocks (`-ctk/-ctv q8_0 | q4_0`), split along the keys,
reading the blocks where they lie.

Without it, a static decode step over a quantized cache first dequantizes each layer's whole window with torch ops
into a bf16 copy (B1 after a 32K prompt: ~67 MB written and read again a layer, ~6.4 GB a token) and only then runs
the split kernel of strata.ops.decode_attention over the copy. Here each program of that same split layout loads
its keys' int8 values (q8_0) or nibbles (q4_0) and their f16 block scales and multiplies in registers: the step
reads the window once, as stored (q8_0: 34 bytes per 32 values, 1.06 bytes a value).

q4_0 rows are stored Hadamard-rotated (strata.kv.quant: k~ = k H, H symmetric and its own inverse). The kernel
works in the rotated space: q . k = (q H) . k~, so the query is rotated once before the kernel, and
sum_i p_i v_i = (sum_i p_i v~_i) H, so the output is rotated once after it. Nothing per key.

Either of K and V may be plain (a tensor view of the cache, any float dtype) or blocks (strata.kv.quant.Blocks).
Rows must be whole blocks (head dims a multiple of 32, powers of two: every real model's). Math in float32.
Reference twin: dequantize both, then `one_query_attention`'s (strata.ops.reference.one_query_blocks).
With both K and V plain (modes 0) the kernel is strata.ops.decode_attention's, row for row: once this one has
passed its GPU test it can serve plain caches too, and that copy go.
"""

from __future__ import annotations

import torch

from strata.kv.quant import Blocks, rotate
from strata.ops import registry
from strata.ops.decode_attention import BLOCK_N, available, dynamic_splits, lean_tiles, splits_for

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

# taken on a GPU once its GPU test (tests/ops/test_decode_attention_kv.py, marked gpu) has passed there; the
# interpreter tests check the same kernel against the reference on the CPU
GPU_TESTED = True

_MODES = {None: 0, "q8_0": 1, "q4_0": 2}


def _mode(x) -> int:
    return _MODES[x.kind] if isinstance(x, Blocks) else 0


def _fits(x, width: int | None = None) -> bool:
    """Rows the kernel reads: whole blocks, a power-of-two width >= 32, contiguous along the row."""
    if isinstance(x, Blocks):
        if x.kind not in _MODES or x.dim % 32 or x.qs.stride(-1) != 1 or x.d.stride(-1) != 1:
            return False
        dim = x.dim
    else:
        if x.stride(-1) != 1:
            return False
        dim = x.shape[-1]
    return dim >= 32 and dim & (dim - 1) == 0


def use_for(q: torch.Tensor, ks, vs) -> bool:
    """Whether the kernel takes this one-query attention: CUDA (once GPU-tested), K or V in blocks, rows it reads."""
    if not (available() and GPU_TESTED and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)):
        return False
    return (isinstance(ks, Blocks) or isinstance(vs, Blocks)) and _fits(ks) and _fits(vs)


if triton is not None:

    @triton.jit
    def _rows(P, S, n, ok, h, sl, sh, dl, dh, c, MODE: tl.constexpr, BN: tl.constexpr, W: tl.constexpr,
              LEAN: tl.constexpr):
        """[BN, W] float32 rows at positions n of KV head h: plain (MODE 0), q8_0 (1) or q4_0 (2) blocks. LEAN
        (strata.ops.decode_attention.LEAN_GPU_TESTED): each row's block scales loaded once ([BN, W / 32]) and
        broadcast over their 32 values, where the other form loads the scale again for every value."""
        if MODE == 0:
            x = tl.load(P + n[:, None] * sl + h * sh + c[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        else:
            if MODE == 1:
                b = tl.load(P + n[:, None] * sl + h * sh + c[None, :], mask=ok[:, None], other=0)
                x = b.to(tl.int8, bitcast=True).to(tl.float32)
            else:
                # value j of a block in the low nibble of byte j, value j + 16 in the high nibble of byte j
                at = (c // 32) * 16 + c % 16
                b = tl.load(P + n[:, None] * sl + h * sh + at[None, :], mask=ok[:, None], other=0).to(tl.int32)
                nib = (b >> ((c % 32) // 16 * 4)[None, :]) & 0xF
                x = nib.to(tl.float32) - 8.0
            if LEAN:
                cb = tl.arange(0, W // 32)
                sc = tl.load(S + n[:, None] * dl + h * dh + cb[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
                x = tl.reshape(tl.reshape(x, (BN, W // 32, 32)) * sc[:, :, None], (BN, W))
            else:
                sc = tl.load(S + n[:, None] * dl + h * dh + (c // 32)[None, :], mask=ok[:, None], other=0.0)
                x = x * sc.to(tl.float32)
        return x

    @triton.jit
    def _split_blocks_kernel(Q, K, KS, V, VS, POS, Mo, Lo, Ao, scale, chunk,
                             sqh, sqg, skl, skh, kdl, kdh, svl, svh, vdl, vdh,
                             G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                             BN: tl.constexpr, KM: tl.constexpr, VM: tl.constexpr, DYN: tl.constexpr,
                             LEAN: tl.constexpr):
        h = tl.program_id(0)
        s = tl.program_id(1)
        S = tl.num_programs(1)
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        dv = tl.arange(0, DV)
        q = tl.load(Q + h * sqh + g[:, None] * sqg + d[None, :], mask=g[:, None] < G, other=0.0).to(tl.float32)
        end = tl.load(POS).to(tl.int32) + 1  # keys 0..pos are valid
        if DYN:  # (strata.ops.decode_attention.DYNAMIC_SPLITS_GPU_TESTED)
            chunk = tl.cdiv(tl.cdiv(end, BN), S) * BN
        start = s * chunk
        stop = tl.minimum(start + chunk, end)
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, DV], tl.float32)
        for n0 in range(start, stop, BN):
            n = n0 + tl.arange(0, BN)
            ok = n < stop
            k = _rows(K, KS, n, ok, h, skl, skh, kdl, kdh, d, KM, BN, D, LEAN)
            if LEAN:  # f16 operands (a q8_0 value times its scale to ~0.05%), float32 sums, as flash attention
                qk = tl.dot(q.to(tl.float16), tl.trans(k.to(tl.float16))) * scale  # [GP, BN]
            else:
                qk = tl.dot(q, tl.trans(k)) * scale
            qk = tl.where(ok[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.exp(qk - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = _rows(V, VS, n, ok, h, svl, svh, vdl, vdh, dv, VM, BN, DV, LEAN)
            if LEAN:
                acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v.to(tl.float16))
            else:
                acc = acc * alpha[:, None] + tl.dot(p, v)
            m_i = m_new
        row = (h * S + s) * GP + g  # partials laid out [Hkv, S, GP], merged by decode_attention's merge kernel
        tl.store(Mo + row, m_i)
        tl.store(Lo + row, l_i)
        tl.store(Ao + row[:, None] * DV + dv[None, :], acc)


def _parts(x):
    """(values, scales, row stride, head stride, scale row stride, scale head stride, width) of a window."""
    if isinstance(x, Blocks):
        return x.qs, x.d, x.qs.stride(0), x.qs.stride(1), x.d.stride(0), x.d.stride(1), x.dim
    return x, x, x.stride(0), x.stride(1), 0, 0, x.shape[-1]


def decode_attention_blocks(q: torch.Tensor, ks, vs, pos_t: torch.Tensor, scale: float) -> torch.Tensor:
    """q [1, H, D]; ks, vs: a slot's window [L, Hkv, D] as a tensor view or strata.kv.quant.Blocks; pos_t [1]
    int64 on the device (keys 0..pos attended) -> [1, H, Dv] in q's dtype."""
    from strata.ops.decode_attention import _merge_kernel

    _, H, D = q.shape
    K, KS, skl, skh, kdl, kdh, dk = _parts(ks)
    V, VS, svl, svh, vdl, vdh, DV = _parts(vs)
    L, hkv = K.shape[0], K.shape[1]
    if dk != D:
        raise ValueError(f"decode_attention_blocks: query rows of {D} against keys of {dk}")
    G = H // hkv
    qf = q.float()
    if isinstance(ks, Blocks) and ks.h is not None:  # (q H) . k~ = q . k
        qf = rotate(qf, ks.h)
    qg = qf.reshape(hkv, G, D).contiguous()
    S, chunk = splits_for(L, hkv)
    GP = max(16, triton.next_power_of_2(G))
    dev = q.device
    m = torch.empty(hkv * S * GP, dtype=torch.float32, device=dev)
    lsum = torch.empty_like(m)
    acc = torch.empty(hkv * S * GP, DV, dtype=torch.float32, device=dev)
    _split_blocks_kernel[(hkv, S)](qg, K, KS, V, VS, pos_t, m, lsum, acc, scale, chunk,
                                   qg.stride(0), qg.stride(1), skl, skh, kdl, kdh, svl, svh, vdl, vdh,
                                   G=G, GP=GP, D=D, DV=DV, BN=BLOCK_N, KM=_mode(ks), VM=_mode(vs),
                                   DYN=dynamic_splits(q.device), LEAN=lean_tiles(q.device), num_warps=4)
    rot_v = isinstance(vs, Blocks) and vs.h is not None
    out = torch.empty(hkv, G, DV, dtype=torch.float32 if rot_v else q.dtype, device=dev)
    _merge_kernel[(hkv, G)](m, lsum, acc, out, S, 0, out.stride(0), out.stride(1),
                            G=G, GP=GP, DV=DV, SP=max(2, triton.next_power_of_2(S)), NQ=1, num_warps=4)
    if rot_v:  # (sum p v~) H = sum p v
        return rotate(out, vs.h).to(q.dtype).view(1, H, DV)
    return out.view(1, H, DV)


def _one_query(q, ks, vs, pos_t, scale):
    return decode_attention_blocks(q, ks, vs, pos_t, scale)


registry.op("one_query_attention_blocks").register("triton", _one_query, lambda q, ks, vs, *a: use_for(q, ks, vs))
