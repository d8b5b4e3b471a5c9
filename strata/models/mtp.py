"""A model's multi-token-prediction block as a draft model (glm4moe's and deepseek2's `nextn` blocks and qwen3next's
MTP block, as llama.cpp's converter and model loader name them).

The block predicts the token after next. For position i it takes the trunk's last hidden state h_i (before the
output norm) and the embedding of the token at i + 1:

    x = eh_proj(concat(enorm(embed(t[i+1])), hnorm(h[i])))          [n, d]
    x = a transformer block (attention over its own KV cache, post-attention norm, MoE + shared expert)
    logits = head(shared_head_norm(x))                               -> t[i+2]

(llama.cpp's GLM-4.5, DeepSeek-V3 and Qwen3-Next MTP graphs, b11434: the same order and norms, the block's attention
the family's own — Qwen3-Next's gated one, DeepSeek's latent one; optional embed/head/norm tensors fall back to the trunk's.) The block's output x also stands in for the trunk's h[i+1] when drafts are chained. Its experts
go through the trunk's tiered backend as one more layer when the model's experts are tiered (within the VRAM
budget), else they are resident on the compute device; its KV cache is a one-layer cache of its own.
"""

from __future__ import annotations

import torch

from strata.experts.resident import ExpertWeights, ResidentExperts
from strata.kv.cache import KVCache, Segment
from strata.layers.attention import GQAttention, fuse_rows, row_views
from strata.layers.embedding import MAX_TOKENS as EMBED_KEEP_TOKENS
from strata.layers.embedding import EmbedRows
from strata.layers.ffn import SwiGLU
from strata.layers.moe import MoE, Routing
from strata.layers.norm import add_rms_norm, rms_norm
from strata.layers.rotary import Rotary
from strata.quant import dequantize, qmatmul


class MtpHead:
    """model: the trunk (a CausalLM with `nextn` blocks); block: one NextNLayer; max_ctx: positions its KV holds."""

    def __init__(self, model, block, max_ctx: int):
        args, dev = model.args, model.device
        self.model, self.args, self.device, self.dtype = model, args, dev, model.dtype
        t = block.tensors

        def q(name):
            return t[name].to(dev)

        def f(name):
            w = t[name]
            return w.dequantize(torch.float32).reshape(w.shape).to(dev)

        self.eh_proj = q("nextn.eh_proj.weight")  # [d, 2d]
        self.enorm, self.hnorm = f("nextn.enorm.weight"), f("nextn.hnorm.weight")
        self.eh_norms = torch.stack([self.enorm, self.hnorm])  # [2, d]: the CPU's one call for both
        # the block's own table (GLM's nextn.embed_tokens) lies where the trunk's does: on the device unless the
        # trunk's was left in host RAM for the cache (rows are looked up where the table lies)
        own = t.get("nextn.embed_tokens.weight")
        self.embed = own.to(model.embed.raw.device) if own is not None else model.embed
        self.head = q("nextn.shared_head_head.weight") if "nextn.shared_head_head.weight" in t else model.head
        self.head_norm = (f("nextn.shared_head_norm.weight") if "nextn.shared_head_norm.weight" in t
                          else model.out_norm)
        make = getattr(model, "mtp_attention_of", None)
        if make is not None:  # the family builds the block's attention itself (deepseek2: latent attention)
            self.attn, (self.k_shape, self.v_shape) = make(q, f, t, args, max_ctx)
        else:
            w = {n: q(n + ".weight") for n in ("attn_q", "attn_k", "attn_v", "attn_output")}
            for n in ("attn_q", "attn_k", "attn_v"):
                if n + ".bias" in t:
                    w[n + ".bias"] = f(n + ".bias")
            if "attn_q_norm.weight" in t:
                w["attn_q_norm"], w["attn_k_norm"] = f("attn_q_norm.weight"), f("attn_k_norm.weight")
            rotary = Rotary(args.rope_dim or args.head_dim, args.rope_theta, "neox", max_ctx, args.rope_scaling)
            # the family's attention (qwen3next: gated), layer 0 of the block's own KV cache
            self.attn = getattr(model, "mtp_attention", GQAttention)(0, args, w, rotary)
            self.k_shape, self.v_shape = GQAttention.cache_shapes(args)
            a = self.attn
            # q, k and v as one weight on the CPU too (the trunk's stay apart there, mapped from the file): a drafted
            # step runs the block up to --draft-max times, and a small weight's product costs about its call's
            # Python; one layer's copy. Each output row is its own dot product: the same bits as apart.
            if type(a) is GQAttention and a.wqkv is None:
                a.wqkv, a.qkv_sizes = fuse_rows((a.wq, a.wk, a.wv), (a.bq, a.bk, a.bv), always=True)
                if a.wqkv is not None:
                    a.wq, a.wk, a.wv = row_views(a.wqkv, a.qkv_sizes)
        self.attn.fold_kv = False  # row i of its cache is rotated at position i + 1: the rows are written apart
        # (the post-attention norm: `post_attention_norm` in glm4moe / qwen3next files, `ffn_norm` in deepseek2's)
        post = "post_attention_norm.weight" if "post_attention_norm.weight" in t else "ffn_norm.weight"
        self.attn_norm, self.ffn_norm = f("attn_norm.weight"), f(post)
        # the trunk's routing (the block is one of its layers)
        routing = next((b.ffn.routing for b in model.blocks if isinstance(b.ffn, MoE)), None) or Routing(
            args.n_experts, args.n_experts_used, args.gating, norm_topk=args.norm_topk, scale=args.routed_scale,
            n_groups=args.n_groups, topk_groups=args.topk_groups)
        shared = None
        if "ffn_gate_shexp.weight" in t:
            shared = SwiGLU(q("ffn_gate_shexp.weight"), q("ffn_up_shexp.weight"), q("ffn_down_shexp.weight"),
                            fuse=True)
        layer = block.layer
        self.moe = MoE(layer, routing, q("ffn_gate_inp.weight"), None,
                       bias=f("exp_probs_b.bias") if "exp_probs_b.bias" in t else None, shared=shared,
                       shared_gate=q("ffn_gate_inp_shexp.weight") if "ffn_gate_inp_shexp.weight" in t else None)
        backend = model.experts
        if backend is not None and layer in getattr(backend, "index", {}):
            self.moe.experts = backend  # the trunk's tiered backend holds the block's experts as one more layer
        else:
            experts = ExpertWeights(t["ffn_gate_exps.weight"], t["ffn_up_exps.weight"], t["ffn_down_exps.weight"])
            self.moe.experts = ResidentExperts({layer: experts.to(dev)})
        self.eps = args.norm_eps

    def new_kv_cache(self, n_slots: int, max_ctx: int, dtype: torch.dtype | None = None) -> KVCache:
        return KVCache(1, n_slots, max_ctx, self.k_shape, self.v_shape, dtype or self.dtype, self.device)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        e = self.embed
        if tokens.numel() <= EMBED_KEEP_TOKENS and EmbedRows.serves(e, self.device):
            return self.embed_rows_kept().lookup(tokens)  # (strata.layers.embedding)
        rows = e.raw.index_select(0, tokens.to(e.raw.device)).to(self.device)
        return dequantize(rows, e.qtype, (rows.shape[0], e.shape[-1])).to(self.dtype)

    def embed_rows_kept(self) -> EmbedRows:
        """The table's rows kept dequantized: the trunk's where the block reads the trunk's table."""
        if self.embed is self.model.embed and self.dtype == self.model.dtype:
            return self.model.embed_rows_kept()
        got = getattr(self, "_kept_rows", None)
        if got is None or got.table is not self.embed:
            got = self._kept_rows = EmbedRows(self.embed, self.dtype)
        return got

    def forward(self, h: torch.Tensor, tokens: torch.Tensor, pos: torch.Tensor, seg: Segment,
                kv: KVCache, last_only: bool = False, logits: bool = True,
                tail: bool = False) -> tuple[torch.Tensor | None, torch.Tensor]:
        """h [n, d]: the trunk's (or a previous block output's) hidden states at positions pos [n] (contiguous, in
        seg's slot); tokens [n]: the tokens at pos + 1 -> (logits [n, V] float32 for the tokens at pos + 2, the
        block's output [n, d]). last_only: the logits of the last row alone ([1, V]: after a prompt only its last
        prediction is used, and the head is most of the block's work); logits=False: none (None), for a caller
        that takes another row's with `logits`. tail: past the K/V rows the cache needs, only the last row goes
        through the block (its output [1, d]; the other rows' outputs are not computed) where the attention can
        (a plain segment of a GQA block): what a drafter reads after a step."""
        if h.is_cuda:
            e = rms_norm(self._embed(tokens), self.enorm, self.eps)
            eh = torch.cat([e, rms_norm(h.to(self.dtype), self.hnorm, self.eps)], -1)
        else:  # both norms in one call over rows [n, 2, d], each with its weight (a row's bits are its own)
            eh = rms_norm(torch.stack([self._embed(tokens), h.to(self.dtype)], 1), self.eh_norms,
                          self.eps).view(h.shape[0], -1)
        x = qmatmul(eh, self.eh_proj)
        a = rms_norm(x, self.attn_norm, self.eps)
        if tail and seg.n > 1 and not seg.window and getattr(self.attn, "last_query", None) is not None:
            att = self.attn.last_query(a, pos, seg, kv)
            x, seg = x[-1:], Segment(seg.slot, seg.end - 1, 1)
        else:
            att = self.attn(a, pos, [seg], kv)
        # the residual adds fused into the next norm (one launch each on a GPU)
        x, xn = add_rms_norm(x, att, self.ffn_norm, self.eps)
        ctx = self.model.step_context([seg], int(x.shape[0]))
        x = x + self.moe(xn, ctx)
        if not logits:
            return None, x
        return self.logits(x[-1:] if last_only else x), x

    def logits(self, y: torch.Tensor) -> torch.Tensor:
        """The head over block outputs y [n, d]: float32 logits [n, V] for the tokens after next."""
        return qmatmul(rms_norm(y, self.head_norm, self.eps), self.head).float()
