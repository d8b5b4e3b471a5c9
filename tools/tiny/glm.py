"""The training twin of transformers' ``Glm4MoeForCausalLM`` plus GLM's multi-token-prediction (``nextn``) block.

The trunk is transformers' GLM-4.5 math: GQA with Q/K/V biases and per-head Q/K RMSNorm, rotary over the first
half of each head (rotate-half order), sigmoid router scores whose correction bias (``e_score_correction_bias``)
steers the top-k choice but not the weights, the chosen scores renormalised and scaled, and one shared expert
next to the routed ones; every layer MoE (``first_k_dense_replace`` = 0), embeddings tied to the output head. As
in ``tools/tiny/model.py`` every expert is computed for every token and weighted by the sparse top-k weights
(unpicked experts weigh exactly zero), which gives the sparse model's outputs and gradients without
data-dependent shapes.

Balancing is DeepSeek-V3's: the correction bias is not trained by gradient; after each step it moves by
``bias_rate`` towards the experts that got fewer than their share of the batch's picks (auxiliary-loss-free
balancing), and a small balance loss (``aux_loss_coef``; normalised sigmoid scores) keeps single sequences from
collapsing onto a few experts.

The MTP block is llama.cpp's and strata's GLM MTP graph (``strata/models/mtp.py``): for position i,

    x = eh_proj(concat(enorm(embed(t[i+1])), hnorm(h[i])))    h: the trunk's last hidden state, before its norm
    x = a decoder layer (attention over the block's own sequence, MoE + shared expert)
    logits = lm_head(shared_head_norm(x))                       -> t[i+2]

with the embedding and the head shared with the trunk (GLM's checkpoints may carry their own copies; llama.cpp
and strata fall back to the trunk's). It trains jointly: loss = CE(trunk) + ``mtp_weight`` * CE(block), the
block's gradient flowing into the trunk through h and the shared embedding, as DeepSeek-V3 trains its MTP module
(whose weight is 0.3, then 0.1 for the last 30% of the steps: ``mtp_weight``, ``mtp_weight_late``).

``hf_state_dict()`` / ``hf_config()`` export the checkpoint as GLM-4.5 ships it: the trunk in transformers'
names, the block as ``model.layers.{layers}.*`` with ``num_nextn_predict_layers: 1`` (transformers ignores it;
``strata.gguf.convert`` keeps it as llama.cpp's ``blk.{layers}.nextn.*``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from tools.tiny.model import Attention as TinyAttention
from tools.tiny.model import Layer as TinyLayer
from tools.tiny.model import RMSNorm, TinyConfig, dense_experts, put_hf


@dataclass
class GlmConfig(TinyConfig):
    shared_experts: int = 1  # each of width expert_ffn (llama.cpp sizes the shared FFN as n_shared * expert_ffn)
    partial_rotary: float = 0.5
    routed_scale: float = 1.0
    mtp_layers: int = 1
    mtp_weight: float = 0.3
    mtp_weight_late: float = 0.1  # over the last 30% of the steps (DeepSeek-V3: 0.3 for the first 10T tokens, then 0.1)
    bias_rate: float = 1e-3
    aux_loss_coef: float = 1e-3
    norm_eps: float = 1e-5

    @property
    def rope_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary)

    def layer_params(self) -> int:
        d, e, hd = self.hidden, self.experts, self.head_dim
        q, kv = self.heads * hd, self.kv_heads * hd
        attn = d * q * 2 + d * kv * 2 + q + 2 * kv + 2 * hd
        moe = e * 3 * d * self.expert_ffn + e * d + e + 3 * d * self.expert_ffn * self.shared_experts
        return attn + moe + 2 * d

    def mtp_params(self) -> int:
        d = self.hidden
        return self.mtp_layers * (self.layer_params() + 2 * d * d + 3 * d)

    def n_params(self) -> int:
        d = self.hidden
        return self.vocab_size * d + d + self.layers * self.layer_params() + self.mtp_params()

    def active_params(self) -> int:
        """Per token, the trunk only (the MTP block runs only when drafting)."""
        d = self.hidden
        unused = (self.experts - self.top_k) * 3 * d * self.expert_ffn
        return self.n_params() - self.mtp_params() - self.layers * unused

    def gguf_bytes_q8_0(self) -> int:
        d, e = self.hidden, self.experts
        n_layers = self.layers + self.mtp_layers
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        f32 = n_layers * (e * d + e + 2 * d + 2 * self.head_dim + q + 2 * kv) + d + self.mtp_layers * 3 * d
        return int((self.n_params() - f32) * 34 / 32 + f32 * 4 + self.vocab_size * 24)


def rope_tables(cfg: GlmConfig, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    rd = cfg.rope_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, rd, 2, dtype=torch.float32, device=device) / rd))
    f = torch.outer(torch.arange(n, dtype=torch.float32, device=device), inv)
    emb = torch.cat([f, f], dim=-1)  # [T, rd]
    return emb.cos(), emb.sin()


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rd = cos.shape[-1]
    r, rest = x[..., :rd], x[..., rd:]
    h = rd // 2
    rot = torch.cat([-r[..., h:], r[..., :h]], dim=-1)
    return torch.cat([r * cos + rot * sin, rest], dim=-1).to(x.dtype)


class Attention(TinyAttention):
    qkv_bias = True
    rope = staticmethod(apply_partial_rope)


class Router(nn.Module):
    """transformers' Glm4MoeTopkRouter with n_group = topk_group = 1 (the released GLM models' setting)."""

    def __init__(self, cfg: GlmConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.experts, cfg.hidden))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.experts))

    def forward(self, x: torch.Tensor):
        """x [N, D] -> scores [N, E] float32 (sigmoid), ids [N, k], weights [N, k] float32."""
        c = self.cfg
        with torch.autocast(x.device.type, enabled=False):
            scores = torch.sigmoid(F.linear(x.float(), self.weight.float()))
        ids = (scores.detach() + self.e_score_correction_bias).topk(c.top_k, dim=-1).indices
        w = scores.gather(1, ids)
        w = w / (w.sum(-1, keepdim=True) + 1e-20) * c.routed_scale
        return scores, ids, w


class SwiGLU(nn.Module):
    def __init__(self, d: int, f: int):
        super().__init__()
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    def __init__(self, cfg: GlmConfig):
        super().__init__()
        self.cfg = cfg
        e, d, f = cfg.experts, cfg.hidden, cfg.expert_ffn
        self.gate = Router(cfg)
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * f, d))  # [E, 2F, D]: gate rows, then up rows
        self.down_proj = nn.Parameter(torch.empty(e, d, f))  # [E, D, F]
        self.shared_experts = SwiGLU(d, f * cfg.shared_experts)

    def forward(self, x: torch.Tensor):
        c = self.cfg
        shape = x.shape
        x = x.reshape(-1, c.hidden)
        scores, ids, w = self.gate(x)
        y = dense_experts(x, self.gate_up_proj, self.down_proj, ids, w)
        y = y + self.shared_experts(x)
        # balance loss (DeepSeek-V3's complementary one, over the batch): E * sum_e (share of picks) * (mean
        # normalised score)
        picks = torch.zeros_like(scores).scatter(1, ids, 1.0).mean(0) / c.top_k
        p = scores / scores.sum(-1, keepdim=True)
        aux = c.experts * (picks * p.mean(0)).sum()
        return y.view(shape), aux, ids


class Layer(TinyLayer):
    def __init__(self, cfg: GlmConfig):
        super().__init__(cfg, Attention, MoE)


class NextN(Layer):
    """GLM's MTP block: a decoder layer behind eh_proj(concat(enorm(embed), hnorm(h))), with its own head norm."""

    def __init__(self, cfg: GlmConfig):
        super().__init__(cfg)
        self.enorm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.hnorm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden, cfg.hidden, bias=False)
        self.shared_head_norm = RMSNorm(cfg.hidden, cfg.norm_eps)

    def block(self, emb, h, cos, sin):
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1)).float()  # (a float32 stream, as the trunk's)
        x, aux, ids = super().forward(x, cos, sin)
        return self.shared_head_norm(x), aux, ids


class TinyGlm(nn.Module):
    family = "glm4moe"
    hf_class = "Glm4MoeForCausalLM"

    def __init__(self, cfg: GlmConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.mtp = nn.ModuleList(NextN(cfg) for _ in range(cfg.mtp_layers))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        c = self.cfg
        out_std = c.init_std / math.sqrt(2 * (c.layers + c.mtp_layers))
        for name, p in self.named_parameters():
            if name.endswith(".bias"):
                p.zero_()
            elif p.ndim == 1:
                p.fill_(1.0)
            elif name.endswith(("o_proj.weight", "down_proj", "down_proj.weight")):
                p.normal_(0.0, out_std)
            else:
                p.normal_(0.0, c.init_std)

    def trunk(self, tokens: torch.Tensor):
        """tokens [B, T] -> the last layer's hidden states [B, T, D] (before the norm), summed aux, ids per layer."""
        cos, sin = rope_tables(self.cfg, tokens.shape[1], tokens.device)
        x = self.embed_tokens(tokens)
        aux, ids = 0.0, []
        for layer in self.layers:
            x, a, i = layer(x, cos, sin)
            aux, ids = aux + a, ids + [i]
        return x, aux, ids

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.embed_tokens.weight)

    def forward(self, tokens: torch.Tensor, return_ids: bool = False):
        """tokens [B, T] -> the trunk's logits [B, T, V], mean aux loss (, ids per layer) — as TinyMoE."""
        x, aux, ids = self.trunk(tokens)
        logits = self.head(self.norm(x))
        aux = aux / len(self.layers)
        return (logits, aux, ids) if return_ids else (logits, aux)

    def mtp_logits(self, h: torch.Tensor, next_tokens: torch.Tensor, return_ids: bool = False):
        """The first MTP block: h [B, n, D] (the trunk's states at positions i), next_tokens [B, n] (t[i+1]) ->
        logits [B, n, V] for t[i+2], its aux loss (, its ids)."""
        cos, sin = rope_tables(self.cfg, h.shape[1], h.device)
        x, aux, ids = self.mtp[0].block(self.embed_tokens(next_tokens), h, cos, sin)
        logits = self.head(x)
        return (logits, aux, ids) if return_ids else (logits, aux)

    def train_losses(self, x: torch.Tensor, y: torch.Tensor) -> dict:
        """x, y [B, T] (y = x shifted by one) -> {'ce', 'mtp_ce', 'aux', 'ids'}: the trunk's and the block's
        cross-entropies (the block predicts y[:, 1:] from h[:, :-1] and y[:, :-1]), the mean aux loss over all
        MoE layers, the routed ids of every layer (trunk, then block)."""
        dev = x.device
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            h, aux, ids = self.trunk(x)
            logits = self.head(self.norm(h))
            out = {"ce": F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))}
            del logits
            n = len(self.layers)
            if self.cfg.mtp_layers and x.shape[1] > 1:
                ml, maux, mids = self.mtp_logits(h[:, :-1], y[:, :-1], return_ids=True)
                out["mtp_ce"] = F.cross_entropy(ml.float().reshape(-1, ml.shape[-1]), y[:, 1:].reshape(-1))
                aux, ids, n = aux + maux, ids + [mids], n + 1
        out["aux"], out["ids"] = aux / n, ids
        return out

    @torch.no_grad()
    def update_bias(self, ids: list[torch.Tensor]) -> None:
        """Auxiliary-loss-free balancing (DeepSeek-V3): each layer's correction bias moves by bias_rate towards the
        experts that got fewer than the mean number of picks in this batch."""
        rate = self.cfg.bias_rate
        if not rate:
            return
        routers = [layer.mlp.gate for layer in self.layers] + [b.mlp.gate for b in self.mtp]
        for r, i in zip(routers, ids):
            load = torch.bincount(i.reshape(-1), minlength=self.cfg.experts).float()
            r.e_score_correction_bias += rate * torch.sign(load.mean() - load)

    # -- export ------------------------------------------------------------------------------------------------
    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """GLM-4.5's checkpoint names: transformers' for the trunk, ``model.layers.{L + j}.*`` for MTP block j (the
        decoder layer, eh_proj, enorm, hnorm, shared_head.norm), one tensor per expert projection, float32."""
        c, out = self.cfg, {}
        for name, p in self.state_dict().items():
            if name.startswith("mtp."):
                j, rest = name[4:].split(".", 1)
                name = f"layers.{c.layers + int(j)}." + rest.replace("shared_head_norm.", "shared_head.norm.")
            put_hf(out, name, p, c.experts, c.expert_ffn)
        return out

    def hf_config(self, bos_id: int, eos_id: int, pad_id: int) -> dict:
        c = self.cfg
        rope = {"rope_type": "default", "rope_theta": c.rope_theta, "partial_rotary_factor": c.partial_rotary}
        return {
            "architectures": ["Glm4MoeForCausalLM"],
            "model_type": "glm4_moe",
            "vocab_size": c.vocab_size,
            "hidden_size": c.hidden,
            "intermediate_size": c.expert_ffn * c.top_k,  # unused: every layer is MoE
            "moe_intermediate_size": c.expert_ffn,
            "num_hidden_layers": c.layers,
            "num_attention_heads": c.heads,
            "num_key_value_heads": c.kv_heads,
            "head_dim": c.head_dim,
            "partial_rotary_factor": c.partial_rotary,  # transformers 4.x
            "rope_theta": c.rope_theta,
            "rope_parameters": rope,  # 5.x
            "rope_scaling": None,
            "n_routed_experts": c.experts,
            "num_experts_per_tok": c.top_k,
            "n_shared_experts": c.shared_experts,
            "n_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 0,
            "norm_topk_prob": True,
            "routed_scaling_factor": c.routed_scale,
            "use_qk_norm": True,
            "attention_bias": True,
            "attention_dropout": 0.0,
            "hidden_act": "silu",
            "num_nextn_predict_layers": c.mtp_layers,
            "max_position_embeddings": c.ctx,
            "rms_norm_eps": c.norm_eps,
            "tie_word_embeddings": True,
            "initializer_range": c.init_std,
            "use_cache": True,
            "bos_token_id": bos_id,
            "eos_token_id": eos_id,
            "pad_token_id": pad_id,
            "torch_dtype": "float32",
        }
