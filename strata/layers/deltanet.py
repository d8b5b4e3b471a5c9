"""Gated delta-net linear attention (Qwen3-Next's recurrent layers), in torch, float32.

Per value head the layer keeps a state S [key_dim, value_dim] and, for each token t (q, k L2-normalised, q scaled
by 1/sqrt(key_dim); g_t <= 0 a log decay, beta_t in (0, 1) a write strength):

    S   <- exp(g_t) * S                      decay
    S   <- S + k_t (beta_t (v_t - S^T k_t))^T  delta rule: write the part of v_t that S does not predict yet
    o_t  = S^T q_t

`delta_step` is that recurrence for one token (decode). `delta_chunked` computes the same outputs and final state
for a run of tokens in chunks (prefill): within a chunk the writes depend on each other only through a
unit-lower-triangular system, solved once per chunk, so the work is matmuls instead of a loop over tokens; the
loop is over chunks. Inputs reach the delta rule through a short depthwise causal convolution (`causal_conv`)
whose last `kernel - 1` inputs are the other half of a sequence's state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from strata.kv.cache import KVCache, Segment
from strata.layers.attention import fuse_rows, row_views
from strata.ops import registry
from strata.quant import QTensor, qmatmul
from strata.quant.matmul import CPU_ROWS_ALONE

delta_decode = registry.op("delta_decode")
gated_rms_norm = registry.op("gated_rms_norm")

CHUNK = 64
GROUP = 8  # chunks whose solves and products are batched together in a prompt (delta_chunked)
_SLOT_INDEX: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def causal_conv(x: torch.Tensor, state: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, C] new inputs, state [K-1, C] the inputs before them, w [C, K] -> (silu(conv) [n, C], the new state
    [K-1, C]: the last K-1 inputs)."""
    k, n = w.shape[1], x.shape[0]
    full = torch.cat([state, x])  # [K-1+n, C]
    # window t covers inputs t .. t+K-1, the last being token t: K shifted multiply-adds of [n, C] (the same sums
    # as a product over [n, C, K] windows, without that K-times-larger temporary: a long prompt's largest here)
    out = full[0:n] * w[:, 0]
    for j in range(1, k):
        out += full[j:j + n] * w[:, j]
    return F.silu(out), full[full.shape[0] - (k - 1):]


def delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor) -> torch.Tensor:
    """One token: q, k [..., H, Dk], v [..., H, Dv], g, beta [..., H]; state [..., H, Dk, Dv] is updated in place.
    Returns o [..., H, Dv]."""
    state.mul_(g.exp()[..., None, None])
    predicted = torch.einsum("...hk,...hkv->...hv", k, state)
    state.add_(k.unsqueeze(-1) * ((v - predicted) * beta.unsqueeze(-1)).unsqueeze(-2))
    return torch.einsum("...hk,...hkv->...hv", q, state)


def delta_steps(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A few tokens one by one, keeping the state after each (a speculative verify segment, whose drafts may be
    taken back): q, k [T, H, Dk], ... -> (o [T, H, Dv], states [T, H, Dk, Dv]); `state` is not modified."""
    s = state.clone()
    outs, states = [], []
    for t in range(q.shape[0]):
        outs.append(delta_step(q[t], k[t], v[t], g[t], beta[t], s))
        states.append(s.clone())
    return torch.stack(outs), torch.stack(states)


def delta_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor, chunk: int = CHUNK, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """A run of T tokens: q, k [T, H, Dk], v [T, H, Dv], g, beta [T, H], state [H, Dk, Dv] (before the run; not
    modified) -> (o [T, H, Dv], the state after the run).

    In a chunk starting from state S0, with c_t the cumulative log decay from the chunk's start to t, the writes
    u_t = beta_t (v_t - S_{t-1}'^T k_t) satisfy (I + A) u = beta v - beta exp(c) k S0, A[t, j] = beta_t exp(c_t - c_j)
    k_t.k_j for j < t. Then o_t = exp(c_t) q_t S0 + sum_{j<=t} exp(c_t - c_j) (q_t.k_j) u_j and the chunk's end
    state is exp(c_C) S0 + sum_j exp(c_C - c_j) k_j u_j^T.

    The chunks' own work (the triangular solves, the [chunk, chunk] products) is batched over `group` chunks at a
    time: a prompt chunk's temporaries then grow with the group, not with the prompt (they were most of a 4K
    prompt's VRAM in this layer), in the same few launches per group."""
    t_len, h, dk = k.shape
    c = min(chunk, t_len)
    n = -(-t_len // c)
    out = torch.empty(t_len, h, v.shape[-1], dtype=v.dtype, device=v.device)
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    eye = torch.eye(c, dtype=q.dtype, device=q.device)
    s = state
    for g0 in range(0, n, group):
        a, b = g0 * c, min(t_len, (g0 + group) * c)
        m = -(-(b - a) // c)
        pad = m * c - (b - a)
        # padded tokens have beta = 0 (no write) and g = 0 (no decay): they leave the state as it is
        qg, kg, vg = (F.pad(x[a:b], (0, 0, 0, 0, 0, pad)).transpose(0, 1).reshape(h, m, c, x.shape[-1])
                      for x in (q, k, v))  # [H, M, C, D]
        gg, bg = (F.pad(x[a:b], (0, 0, 0, pad)).transpose(0, 1).reshape(h, m, c) for x in (g, beta))
        cum = gg.cumsum(-1)  # [H, M, C]
        # exp(c_i - c_j) for j <= i, 0 above the diagonal (masked before exp: c_i - c_j > 0 there could overflow)
        decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()  # [H, M, C, C]
        kb = kg * bg.unsqueeze(-1)
        system = eye + (kb @ kg.transpose(-1, -2) * decay).tril(-1)  # I + A, unit lower triangular
        u0 = torch.linalg.solve_triangular(system, vg * bg.unsqueeze(-1), upper=False, unitriangular=True)
        w = torch.linalg.solve_triangular(system, kb * cum.exp().unsqueeze(-1), upper=False, unitriangular=True)
        del kb, system
        inner = qg @ kg.transpose(-1, -2) * decay  # [H, M, C, C]
        q_dec = qg * cum.exp().unsqueeze(-1)  # reads of the chunk's start state
        k_dec = kg * (cum[..., -1:] - cum).exp().unsqueeze(-1)  # writes decayed to the chunk's end
        end_decay = cum[..., -1].exp()[..., None, None]  # [H, M, 1, 1]
        og = torch.empty_like(vg)
        for i in range(m):
            u = u0[:, i] - w[:, i] @ s  # [H, C, Dv]
            og[:, i] = q_dec[:, i] @ s + inner[:, i] @ u
            s = s * end_decay[:, i] + k_dec[:, i].transpose(-1, -2) @ u
        out[a:b] = og.reshape(h, m * c, -1)[:, : b - a].transpose(0, 1)
    return out, s


class GatedDeltaNet:
    """A Qwen3-Next linear-attention layer: projections -> causal conv -> gated delta rule -> gated RMSNorm -> out.

    Weights (llama.cpp's GGUF layout): qkv [2*Hk*Dk + Hv*Dv, d] (all q heads, all k heads, all v heads), gate z
    [Hv*Dv, d], ba [2*Hv, d] (per key head: its r = Hv/Hk betas, then its r alphas), conv [C, K], dt_bias [Hv],
    a [Hv] (= -exp(A_log)), norm [Dv], out [d, Hv*Dv]. Value heads are grouped by key head: value head h reads key
    head h // r."""

    def __init__(self, layer: int, dims: dict, w: dict, eps: float):
        self.layer, self.eps = layer, eps
        self.hk, self.hv, self.dk, self.dv = dims["hk"], dims["hv"], dims["dk"], dims["dv"]
        self.r = self.hv // self.hk
        self.wqkv, self.wz, self.wba, self.wout = w["qkv"], w["z"], w["ba"], w["out"]
        # on a GPU the three input projections as one weight (one GEMV launch a step), each a view of it
        self.w_in, self.in_sizes = fuse_rows((self.wqkv, self.wz, self.wba))
        if self.w_in is not None:
            self.wqkv, self.wz, self.wba = row_views(self.w_in, self.in_sizes)
        self.conv_w, self.dt_bias, self.a, self.norm = w["conv"], w["dt_bias"], w["a"], w["norm"]
        self.scale = self.dk ** -0.5

    def _per_value_head(self, x: torch.Tensor) -> torch.Tensor:
        """[n, Hk, Dk] -> [n, Hv, Dk]: each key head serves its r value heads (an expand, no host sync)."""
        n = x.shape[0]
        return x.unsqueeze(2).expand(n, self.hk, self.r, self.dk).reshape(n, self.hv, self.dk)

    @staticmethod
    def state_shapes(dims: dict) -> tuple[tuple[int, int], tuple[int, int, int]]:
        conv_dim = 2 * dims["hk"] * dims["dk"] + dims["hv"] * dims["dv"]
        return (dims["kernel"] - 1, conv_dim), (dims["hv"], dims["dk"], dims["dv"])

    def __call__(self, x: torch.Tensor, pos: torch.Tensor, segments: list[Segment], kv: KVCache) -> torch.Tensor:
        n = x.shape[0]
        if self.w_in is not None:  # (column views of one [n, qkv + z + ba] product: rows strided, columns not)
            qkv, z, ba = qmatmul(x, self.w_in).float().split(self.in_sizes, dim=-1)
        else:
            qkv, z, ba = (qmatmul(x, w).float() for w in (self.wqkv, self.wz, self.wba))
        z = z.view(n, self.hv, self.dv)  # qkv [n, conv_dim]; ba [n, Hk * 2r]: per key head its r betas, r alphas
        st = kv.recurrent
        if all(seg.n == 1 and (seg.window or seg.start > 0) and seg.slot not in st.track for seg in segments):
            # (the common step: every sequence decoding) conv and recurrence on the slots' states in place
            slots = _slot_index(tuple(seg.slot for seg in segments), qkv.device)
            o = delta_decode(qkv, ba, st.conv[self.layer], self.conv_w, st.ssm[self.layer], slots, self.dt_bias,
                             self.a, self.hk, self.dk, self.dv)
        else:
            o = self._segments(qkv, ba, segments, st)
        # the gated RMSNorm (plain weight, not 1 + w), [n, Hv * Dv] in x's dtype
        return qmatmul(gated_rms_norm(o, z, self.norm, self.eps, x.dtype), self.wout)

    def _segments(self, qkv, ba, segments: list[Segment], st) -> torch.Tensor:
        """Segment by segment (prefill chunks, verify segments, a lone decode token): o [n, Hv, Dv]."""
        n = qkv.shape[0]
        conv_all, ssm_all = st.conv[self.layer], st.ssm[self.layer]
        bav = ba.view(n, self.hk, 2 * self.r)
        beta = bav[..., : self.r].reshape(n, self.hv).sigmoid()
        g = self.a * F.softplus(bav[..., self.r:].reshape(n, self.hv) + self.dt_bias)  # [n, Hv], <= 0
        outs, i = [], 0
        for seg in segments:
            conv_s, ssm_s = conv_all[seg.slot], ssm_all[seg.slot]
            if not seg.window and seg.start == 0:  # a sequence's first tokens: whatever the slot held is gone
                conv_s.zero_()
                ssm_s.zero_()
            track = seg.slot in st.track  # a verify segment: keep the state after each token
            if track:
                inputs = torch.cat([conv_s, qkv[i : i + seg.n]])
            if _stepwise(seg, qkv):
                o, states = self._token_by_token(qkv[i : i + seg.n], ba[i : i + seg.n], seg.slot, st, track)
                if track:
                    st.pending[(self.layer, seg.slot)] = (states, inputs)
                outs.append(o)
                i += seg.n
                continue
            mixed, new_conv = causal_conv(qkv[i : i + seg.n], conv_s, self.conv_w)
            conv_s.copy_(new_conv)
            q, k, v = mixed.split([self.hk * self.dk, self.hk * self.dk, self.hv * self.dv], dim=-1)
            q = self._per_value_head(l2norm(q.reshape(seg.n, self.hk, self.dk)) * self.scale)
            k = self._per_value_head(l2norm(k.reshape(seg.n, self.hk, self.dk)))
            v = v.reshape(seg.n, self.hv, self.dv)
            gs, bs = g[i : i + seg.n], beta[i : i + seg.n]
            if track:
                o, states = delta_steps(q, k, v, gs, bs, ssm_s)
                ssm_s.copy_(states[-1])
                st.pending[(self.layer, seg.slot)] = (states, inputs)
                outs.append(o)
            elif seg.n == 1:
                outs.append(delta_step(q, k, v, gs, bs, ssm_s.unsqueeze(0)))  # (updates the slot's state)
            else:
                o, s = delta_chunked(q, k, v, gs, bs, ssm_s)
                ssm_s.copy_(s)
                outs.append(o)
            i += seg.n
        return outs[0] if len(outs) == 1 else torch.cat(outs)  # [n, Hv, Dv]

    def _token_by_token(self, qkv, ba, slot: int, st, track: bool):
        """A segment's tokens one at a time through the decode step's own recurrence (`delta_decode` on the slot's
        states in place) -> (o [n, Hv, Dv], the state after each token [n, Hv, Dk, Dv] when `track`, else None)."""
        conv_all, ssm_all = st.conv[self.layer], st.ssm[self.layer]
        slots = _slot_index((slot,), qkv.device)
        outs, states = [], []
        for j in range(qkv.shape[0]):
            outs.append(delta_decode(qkv[j : j + 1], ba[j : j + 1], conv_all, self.conv_w, ssm_all, slots,
                                     self.dt_bias, self.a, self.hk, self.dk, self.dv))
            if track:
                states.append(ssm_all[slot].clone())
        return torch.cat(outs), (torch.stack(states) if track else None)


def _stepwise(seg: Segment, x: torch.Tensor) -> bool:
    """Whether a segment runs token by token as decode steps do: on the CPU, a continuation of up to
    CPU_ROWS_ALONE tokens (a verify segment), so that each token's output is the one a one-token step gives
    (strata.layers.attention.units says why); a prompt's first chunk and GPU steps keep the chunked form."""
    return not x.is_cuda and 1 <= seg.n <= CPU_ROWS_ALONE and (bool(seg.window) or seg.start > 0)


def _slot_index(slots: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The slots as an index tensor on `device`, built once per set (a host copy each step would wait for the
    device, and a graph capture forbids one; the capture's warm-up builds it first)."""
    key = (slots, device)
    t = _SLOT_INDEX.get(key)
    if t is None:
        t = torch.tensor(slots, dtype=torch.long, device=device)
        if not (t.is_cuda and torch.cuda.is_current_stream_capturing()):
            _SLOT_INDEX[key] = t
    return t


def legacy_split(ssm_in: QTensor, hk: int, dk: int, r: int, dv: int) -> tuple[QTensor, QTensor]:
    """Older GGUFs store the fused input projection `ssm_in` as transformers does, interleaved per key head
    ([q, k, v, z] x Hk); current ones store qkv and z apart (`attn_qkv`, `attn_gate`). Rows are reordered in their
    stored format (a row is whole blocks), so no value changes."""
    per = 2 * dk + 2 * r * dv
    base = torch.arange(hk).unsqueeze(1) * per

    def rows(lo: int, width: int) -> torch.Tensor:
        return (base + lo + torch.arange(width)).reshape(-1)

    qkv = torch.cat([rows(0, dk), rows(dk, dk), rows(2 * dk, r * dv)])
    z = rows(2 * dk + r * dv, r * dv)

    def take(idx: torch.Tensor) -> QTensor:
        return QTensor(ssm_in.raw.index_select(0, idx.to(ssm_in.raw.device)), ssm_in.qtype,
                       (idx.numel(), ssm_in.shape[-1]))

    return take(qkv), take(z)
