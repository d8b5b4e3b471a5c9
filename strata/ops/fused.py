"""Fused elementwise kernels of the attention half of a decode step, in Triton: one launch where torch needs many.

A decode step replayed as a CUDA graph costs the number of kernels it launches (a few microseconds each, however
small); torch spends ~8 kernels on one RMSNorm (casts, pow, mean, add, rsqrt, two muls) and ~11 on one rotary.

- `rms_norm`: y = x * rsqrt(mean(x^2) + eps) * w over the last dim, float32 math, output in x's dtype.
  Reference twin: `strata.ops.reference.rms_norm`.
- `qk_norm_rope`: per-head RMSNorm (optional, Qwen3's q_norm / k_norm) then rotary (neox or norm pair order,
  partial `rot < head_dim`) of q and of k in one launch, the position read from the device `pos` tensor (no host
  value: CUDA-graph capture works). Reference twin: `strata.ops.reference.qk_norm_rope`.
  Like the twin, the normalized row is rounded to the activation dtype before it is rotated. Given the layer's KV
  cache (op `qk_norm_rope_kv`, a decode step's sequences in slots 0 .. N-1 of a plain cache), the same launch
  writes k' and v into it at each token's position: the step's two index_copy_ launches a layer are gone.
  Reference twin: `strata.ops.reference.qk_norm_rope_kv`.

- `silu_mul`: SwiGLU's silu(g) * u in one launch (torch: two), g and u rows read where they lie (the two halves of
  one gate|up GEMV output), the silu rounded to the activation dtype before the product as torch's is.
  Reference twin: `strata.ops.reference.silu_mul`.

Tests run the kernels in Triton's interpreter on the CPU against the twins (tests/ops/test_fused_interpret.py).
"""

from __future__ import annotations

import torch

from strata.ops import registry

try:  # Triton is optional: without it (or without a GPU) the torch twins run
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

MAX_ONE_PASS = 8192  # rows up to this length are held in registers; longer ones are walked in two passes
LOOP_BLOCK = 4096
TILE = 2048  # elements of q/k (heads x head dim) one program of qk_norm_rope rotates


def available() -> bool:
    return triton is not None


def use_for(x: torch.Tensor) -> bool:
    """Whether the fused kernels should replace the torch twins for x (CUDA, Triton, no autograd needed)."""
    return x.is_cuda and triton is not None and not (x.requires_grad and torch.is_grad_enabled())


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(X, W, Y, D, stride_x, stride_y, eps, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        xr = X + row * stride_x
        yr = Y + row * stride_y
        if ONE_PASS:
            offs = tl.arange(0, BLOCK)
            m = offs < D
            x = tl.load(xr + offs, mask=m, other=0.0).to(tl.float32)
            r = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
            w = tl.load(W + offs, mask=m, other=0.0).to(tl.float32)
            tl.store(yr + offs, (x * r * w).to(Y.dtype.element_ty), mask=m)
        else:
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for s in range(0, D, BLOCK):
                offs = s + tl.arange(0, BLOCK)
                x = tl.load(xr + offs, mask=offs < D, other=0.0).to(tl.float32)
                acc += x * x
            r = tl.rsqrt(tl.sum(acc, axis=0) / D + eps)
            for s in range(0, D, BLOCK):
                offs = s + tl.arange(0, BLOCK)
                m = offs < D
                x = tl.load(xr + offs, mask=m, other=0.0).to(tl.float32)
                w = tl.load(W + offs, mask=m, other=0.0).to(tl.float32)
                tl.store(yr + offs, (x * r * w).to(Y.dtype.element_ty), mask=m)

    @triton.jit
    def _add_rms_norm_kernel(X, A, W, H, Y, D, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        m = offs < D
        # the residual sum in float32, rounded to the activation dtype as torch's add does (bfloat16 by hand on
        # the bits, round to nearest even: Triton's interpreter rounds bf16 differently from the GPU), then
        # normalized from the rounded value
        s = tl.load(X + row * D + offs, mask=m, other=0.0).to(tl.float32) \
            + tl.load(A + row * D + offs, mask=m, other=0.0).to(tl.float32)
        if H.dtype.element_ty == tl.bfloat16:
            bits = s.to(tl.uint32, bitcast=True)
            r16 = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16)
            tl.store(H.to(tl.pointer_type(tl.uint16)) + row * D + offs, r16, mask=m)
            hf = (r16.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            h = s.to(H.dtype.element_ty)
            tl.store(H + row * D + offs, h, mask=m)
            hf = h.to(tl.float32)
        r = tl.rsqrt(tl.sum(hf * hf, axis=0) / D + eps)
        w = tl.load(W + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(Y + row * D + offs, (hf * r * w).to(Y.dtype.element_ty), mask=m)

    @triton.jit
    def _norm_rope_tile(src, dst, W, cos_row, sin_row, h0, H, sh, D, eps, ROT: tl.constexpr,
                        HAS_NORM: tl.constexpr, NEOX: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        """Heads h0 .. h0+BLOCK_H of one token: src points at its head 0 (head stride sh), dst at its contiguous
        output row; cos_row/sin_row at the position's table rows."""
        offs = tl.arange(0, BLOCK_D)
        heads = h0 + tl.arange(0, BLOCK_H)
        rot = offs < ROT
        HALF = ROT // 2
        if NEOX:  # element j pairs with j +- ROT/2; frequency j mod ROT/2; the first half takes -partner*sin
            first = offs < HALF
            partner = tl.where(first, offs + HALF, offs - HALF)
            f = tl.where(first, offs, offs - HALF)
        else:  # adjacent pairs (2i, 2i+1) share frequency i; the even element takes -partner*sin
            first = (offs % 2) == 0
            partner = tl.where(first, offs + 1, offs - 1)
            f = offs // 2
        hm = (heads < H)[:, None]
        m = hm & (offs < D)[None, :]  # [BLOCK_H, BLOCK_D]
        mr = hm & rot[None, :]
        row = src + heads[:, None] * sh
        x = tl.load(row + offs[None, :], mask=m, other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_D]
        xp = tl.load(row + partner[None, :], mask=mr, other=0.0).to(tl.float32)
        if HAS_NORM:
            r = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]  # [BLOCK_H, 1]
            w = tl.load(W + offs, mask=offs < D, other=0.0).to(tl.float32)[None, :]
            wp = tl.load(W + partner, mask=rot, other=0.0).to(tl.float32)[None, :]
            # rounded to the activation dtype as the twin's rms_norm output is, before rotation
            x = (x * r * w).to(dst.dtype.element_ty).to(tl.float32)
            xp = (xp * r * wp).to(dst.dtype.element_ty).to(tl.float32)
        c = tl.load(cos_row + f, mask=rot, other=1.0)[None, :]
        s = tl.load(sin_row + f, mask=rot, other=0.0)[None, :]
        sign = tl.where(first, -1.0, 1.0)[None, :]
        y = tl.where(rot[None, :], x * c + sign * (xp * s), x)
        tl.store(dst + heads[:, None] * D + offs[None, :], y.to(dst.dtype.element_ty), mask=m)

    @triton.jit
    def _qk_norm_rope_kernel(Q, K, QO, KO, QW, KW, POS, COS, SIN, HQ, HK, D, sqn, sqh, skn, skh, eps,
                             V, VO, HV, DV, svn, svh, sko_t, sko_p, svo_t, svo_p,
                             ROT: tl.constexpr, HAS_NORM: tl.constexpr, NEOX: tl.constexpr,
                             BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
        # grid (N, head blocks of q, then of k, then of v): program (t, b) does BLOCK_H heads of token t. k's rows
        # go to KO + t * sko_t + pos * sko_p (a contiguous output: sko_t = HK * D, sko_p = 0; a decode step's KV
        # cache, token t in slot t: the slot's and the position's strides), v's rows likewise, copied (HV = 0: none)
        t = tl.program_id(0).to(tl.int64)
        b = tl.program_id(1)
        nq = tl.cdiv(HQ, BLOCK_H)
        nk = tl.cdiv(HK, BLOCK_H)
        p = tl.load(POS + t).to(tl.int64)
        cos_row = COS + p * (ROT // 2)
        sin_row = SIN + p * (ROT // 2)
        if b < nq:
            _norm_rope_tile(Q + t * sqn, QO + t * HQ * D, QW, cos_row, sin_row, b * BLOCK_H, HQ, sqh, D, eps,
                            ROT, HAS_NORM, NEOX, BLOCK_H, BLOCK_D)
        elif b < nq + nk:
            _norm_rope_tile(K + t * skn, KO + t * sko_t + p * sko_p, KW, cos_row, sin_row, (b - nq) * BLOCK_H, HK,
                            skh, D, eps, ROT, HAS_NORM, NEOX, BLOCK_H, BLOCK_D)
        else:
            heads = (b - nq - nk) * BLOCK_H + tl.arange(0, BLOCK_H)
            offs = tl.arange(0, BLOCK_DV)
            m = (heads < HV)[:, None] & (offs < DV)[None, :]
            x = tl.load(V + t * svn + heads[:, None] * svh + offs[None, :], mask=m, other=0.0)
            dst = VO + t * svo_t + p * svo_p
            tl.store(dst + heads[:, None] * DV + offs[None, :], x.to(dst.dtype.element_ty), mask=m)


if triton is not None:

    @triton.jit
    def _silu_mul_kernel(G, U, Y, N, sg, su, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = offs < N
        g = tl.load(G + row * sg + offs, mask=m, other=0.0).to(tl.float32)
        u = tl.load(U + row * su + offs, mask=m, other=0.0).to(tl.float32)
        # torch's silu: x / (1 + exp(-x)) in float32, rounded to the dtype; then the product, rounded
        s = (g / (1.0 + tl.exp(-g))).to(Y.dtype.element_ty).to(tl.float32)
        tl.store(Y + row * N + offs, (s * u).to(Y.dtype.element_ty), mask=m)


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(g) * u in one launch: g, u [..., N] (rows may be strided: views of one [.., 2N] output) -> contiguous."""
    N = g.shape[-1]
    g2, u2 = g.reshape(-1, N), u.reshape(-1, N)
    if g2.stride(-1) != 1:
        g2 = g2.contiguous()
    if u2.stride(-1) != 1:
        u2 = u2.contiguous()
    y = torch.empty(g2.shape, dtype=g.dtype, device=g.device)
    if y.numel():
        block = min(1024, triton.next_power_of_2(N))
        _silu_mul_kernel[(g2.shape[0], triton.cdiv(N, block))](g2, u2, y, N, g2.stride(0), u2.stride(0),
                                                               BLOCK=block, num_warps=4)
    return y.view(g.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., D] in one launch; output [..., D] in x's dtype."""
    D = x.shape[-1]
    x2 = x.reshape(-1, D)  # [R, D]: a view for contiguous input and for 2-D row slices
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0] == 0 or D == 0:
        return y.view(x.shape)
    one_pass = D <= MAX_ONE_PASS
    block = triton.next_power_of_2(D) if one_pass else LOOP_BLOCK
    _rms_norm_kernel[(x2.shape[0],)](x2, weight.contiguous(), y, D, x2.stride(0), y.stride(0), float(eps),
                                     BLOCK=block, ONE_PASS=one_pass, num_warps=min(max(block // 256, 1), 8))
    return y.view(x.shape)


def add_rms_norm(x: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, eps: float):
    """h = x + a (the residual stream, in x's dtype) and rms_norm(h, weight, eps), in one launch: -> (h, y)."""
    D = x.shape[-1]
    x2, a2 = x.reshape(-1, D), a.reshape(-1, D)
    h, y = torch.empty_like(x2), torch.empty_like(x2)
    if x2.shape[0]:
        block = triton.next_power_of_2(D)
        _add_rms_norm_kernel[(x2.shape[0],)](x2, a2, weight.contiguous(), h, y, D, float(eps), BLOCK=block,
                                             num_warps=min(max(block // 256, 1), 8))
    return h.view(x.shape), y.view(x.shape)


# the residual add fused into the next RMSNorm, taken on a GPU since its GPU test passed there (the
# interpreter does not catch what only compiled code does); False puts its twin back (torch's add, then rms_norm)
ADD_NORM_GPU_TESTED = True
# the decode step's K/V rows written into the cache by qk_norm_rope itself (qk_norm_rope_kv): taken on a GPU once its
# GPU test (tests/ops/test_fused_interpret.py, marked gpu) has passed there; the interpreter tests check it on the CPU
KV_FOLD_GPU_TESTED = True
# SwiGLU's silu(g) * u in one launch (dense FFNs and shared experts): taken on a GPU once its GPU test
# (tests/ops/test_fused_interpret.py, marked gpu) has passed there
SILU_MUL_GPU_TESTED = True


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor | None, pos: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, rot: int, neox: bool, q_norm: torch.Tensor | None = None,
                 k_norm: torch.Tensor | None = None, eps: float = 0.0, v: torch.Tensor | None = None,
                 k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None):
    """q [N, Hq, D], k [N, Hk, D] or None, pos [N] (device), cos/sin [S, rot/2] float32 tables
    -> (q', k') contiguous in their own dtypes: per-head RMSNorm with q_norm/k_norm [D] when given, then
    rotary of the first `rot` dims at each token's position. One launch for both.

    With k_cache/v_cache (a layer's cache [slots, positions, Hk, D] and [.., Hk, Dv], token t of slot t: a decode
    step's sequences in slots 0 .. N-1) k' and v go straight into the cache at each token's position, in the same
    launch (no index_copy_ after it): returns (q', None). A cache of slot stride 0 (one slot expanded N times:
    a verify step's tokens, all in one slot) gets every token in that slot."""
    N, HQ, D = q.shape
    if rot % 2 or rot > D:
        raise ValueError(f"rotary dims {rot} must be even and at most the head dim {D}")
    has_norm = q_norm is not None
    if has_norm and k is not None and k_norm is None:
        raise ValueError("qk_norm_rope: q_norm given without k_norm")
    if q.stride(-1) != 1:
        q = q.contiguous()
    kk = q if k is None else (k if k.stride(-1) == 1 else k.contiguous())
    HK = 0 if k is None else k.shape[1]
    if k is not None and (k.shape[0] != N or k.shape[2] != D):
        raise ValueError(f"qk_norm_rope: q {tuple(q.shape)} and k {tuple(k.shape)} disagree")
    qo = torch.empty(N, HQ, D, dtype=q.dtype, device=q.device)
    into = k_cache is not None
    if into and (k is None or v is None or v_cache is None or k_cache.shape[2:] != k.shape[1:]
                 or v_cache.shape[2:] != v.shape[1:] or k_cache.shape[0] < N or v_cache.shape[0] < N
                 or k_cache.stride(-1) != 1 or k_cache.stride(-2) != D or v_cache.stride(-1) != 1
                 or v_cache.stride(-2) != v.shape[2] or v.stride(-1) != 1):
        raise ValueError("qk_norm_rope: k, v and their caches disagree")
    ko = k_cache if into else (torch.empty(N, HK, D, dtype=kk.dtype, device=q.device) if k is not None else None)
    if N == 0:
        return qo, (None if into else ko)
    pos = pos.to(q.device)
    qw = q_norm.contiguous() if has_norm else q
    kw = (k_norm.contiguous() if k_norm is not None else qw) if has_norm else q
    block = triton.next_power_of_2(D)
    HV, DV = (v.shape[1], v.shape[2]) if into else (0, 1)
    bh = min(triton.next_power_of_2(max(HQ, HK)), max(TILE // block, 1))  # heads per program
    grid = (N, triton.cdiv(HQ, bh) + triton.cdiv(HK, bh) + triton.cdiv(HV, bh))
    vv, vo = (v, v_cache) if into else (q, qo)
    _qk_norm_rope_kernel[grid](
        q, kk, qo, ko if ko is not None else qo, qw, kw, pos, cos, sin, HQ, HK, D,
        q.stride(0), q.stride(1), kk.stride(0), kk.stride(1), float(eps),
        vv, vo, HV, DV, vv.stride(0), vv.stride(1),
        ko.stride(0) if into else HK * D, ko.stride(1) if into else 0,
        vo.stride(0) if into else 0, vo.stride(1) if into else 0,
        ROT=rot, HAS_NORM=has_norm, NEOX=neox, BLOCK_H=bh, BLOCK_D=block,
        BLOCK_DV=triton.next_power_of_2(DV), num_warps=4 if bh * block >= 2048 else 2,
    )
    return qo, (None if into else ko)


def qk_norm_rope_kv(q, k, v, pos, cos, sin, rot, neox, q_norm, k_norm, eps, k_cache, v_cache) -> torch.Tensor:
    """The op `qk_norm_rope_kv` (reference twin: strata.ops.reference.qk_norm_rope_kv): q' returned, k' and v
    written into the caches at (slot t, pos[t]) in the same launch."""
    return qk_norm_rope(q, k, pos, cos, sin, rot, neox, q_norm, k_norm, eps, v, k_cache, v_cache)[0]


# the kernels' seats in the registry (strata.ops.registry): `use_for` is looked up at each call
registry.op("rms_norm").register("triton", rms_norm, lambda x, weight, eps: use_for(x))
registry.op("add_rms_norm").register(
    "triton", add_rms_norm,
    lambda x, a, weight, eps: (ADD_NORM_GPU_TESTED and use_for(x) and x.dtype == a.dtype and x.is_contiguous()
                               and a.is_contiguous() and x.shape == a.shape and x.shape[-1] <= MAX_ONE_PASS))
registry.op("silu_mul").register(
    "triton", silu_mul,
    lambda g, u: SILU_MUL_GPU_TESTED and use_for(g) and g.dtype == u.dtype and g.shape == u.shape and g.dim() >= 1)
registry.op("qk_norm_rope").register("triton", qk_norm_rope, lambda q, *args, **kw: use_for(q) and q.dim() == 3)
registry.op("qk_norm_rope_kv").register(
    "triton", qk_norm_rope_kv,
    lambda q, k, v, pos, cos, sin, rot, neox, q_norm, k_norm, eps, k_cache, v_cache: (
        KV_FOLD_GPU_TESTED and use_for(q) and q.dim() == 3 and k_cache.dtype == k.dtype and v_cache.dtype == v.dtype))
