"""The training twin of transformers' ``Qwen3MoeForCausalLM``: the same math, written for fast training.

Why not train transformers' class directly: its experts run one small matmul per expert with a host sync per
step (or, in recent versions only, grouped GEMMs whose availability depends on the version and the GPU). This
module computes every expert for every token as two large GEMMs and weights the outputs by the router's
(sparse) top-k weights, so unpicked experts contribute exactly zero and get exactly zero gradient: the result is
the sparse MoE's, without data-dependent shapes or syncs. At this size (32 experts x 96) that costs less than
the launches it saves.

``hf_state_dict()`` / ``hf_config()`` export a checkpoint that ``Qwen3MoeForCausalLM.from_pretrained`` loads
(per-expert tensor names, which transformers 4.x reads natively and 5.x converts on load) and that
``strata.gguf.convert`` turns into a ``qwen3moe`` GGUF. Tests check the logits against transformers and strata.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class TinyConfig:
    vocab_size: int = 8192
    hidden: int = 384
    layers: int = 8
    heads: int = 6
    kv_heads: int = 2
    head_dim: int = 64
    experts: int = 32
    top_k: int = 4
    expert_ffn: int = 96
    ctx: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    init_std: float = 0.02
    aux_loss_coef: float = 0.01

    def n_params(self) -> int:
        d, e = self.hidden, self.experts
        attn = d * self.heads * self.head_dim * 2 + d * self.kv_heads * self.head_dim * 2 + 2 * self.head_dim
        moe = e * 3 * d * self.expert_ffn + e * d
        return self.vocab_size * d + d + self.layers * (attn + moe + 2 * d)

    def gguf_bytes_q8_0(self) -> int:
        """About the q8_0 GGUF's size: 34 bytes per 32 weights, routers and norms in f32, plus the vocabulary."""
        d = self.hidden
        f32 = self.layers * (self.experts * d + 2 * d + 2 * self.head_dim) + d
        return int((self.n_params() - f32) * 34 / 32 + f32 * 4 + self.vocab_size * 24)

    def to_dict(self) -> dict:
        return asdict(self)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # transformers' Qwen3MoeRMSNorm: normalise in float32, cast back, then scale
    dt = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return w * x.to(dt)


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


def rope_tables(cfg: TinyConfig, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32, device=device)
                                    / cfg.head_dim))
    f = torch.outer(torch.arange(n, dtype=torch.float32, device=device), inv)  # [T, hd/2]
    emb = torch.cat([f, f], dim=-1)  # [T, hd] (rotate-half / NEOX order)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    rot = torch.cat([-x[..., h:], x[..., :h]], dim=-1)
    return (x * cos + rot * sin).to(x.dtype)


class Attention(nn.Module):
    """Qwen3's: GQA with per-head Q/K RMSNorm and rotary over the whole head; a family changes the two below
    (tools/tiny/glm.py: Q/K/V biases, rotary over half of each head)."""

    qkv_bias = False
    rope = staticmethod(apply_rope)

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        d, hd, bias = cfg.hidden, cfg.head_dim, self.qkv_bias
        self.q_proj = nn.Linear(d, cfg.heads * hd, bias=bias)
        self.k_proj = nn.Linear(d, cfg.kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(d, cfg.kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(cfg.heads * hd, d, bias=False)
        self.q_norm = RMSNorm(hd, cfg.norm_eps)
        self.k_norm = RMSNorm(hd, cfg.norm_eps)

    def forward(self, x, cos, sin):
        c = self.cfg
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, c.heads, c.head_dim)).transpose(1, 2)  # [B, H, T, hd]
        k = self.k_norm(self.k_proj(x).view(b, t, c.kv_heads, c.head_dim)).transpose(1, 2)  # [B, Hkv, T, hd]
        v = self.v_proj(x).view(b, t, c.kv_heads, c.head_dim).transpose(1, 2)
        # the norms' float32 weights promote q and k; attention runs in v's dtype (bf16 under autocast)
        q, k = self.rope(q, cos, sin).to(v.dtype), self.rope(k, cos, sin).to(v.dtype)
        rep = c.heads // c.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # transformers' repeat_kv
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=c.head_dim ** -0.5)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, c.heads * c.head_dim))


def dense_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor,
                  w: torch.Tensor) -> torch.Tensor:
    """Every expert for every token, weighted by the sparse top-k weights (zero for the unpicked): the sparse MoE's
    exact output and gradients without data-dependent shapes. x [N, D], gate_up [E, 2F, D] (gate rows, then up
    rows), down [E, D, F], ids / w [N, k] -> [N, D]."""
    e, f2, d = gate_up.shape
    f = f2 // 2
    dense_w = torch.zeros(x.shape[0], e, dtype=w.dtype, device=w.device).scatter(1, ids, w)  # [N, E]
    gu = F.linear(x, gate_up.reshape(e * 2 * f, d)).view(-1, e, 2, f)  # [N, E, 2, F]
    a = F.silu(gu[:, :, 0]) * gu[:, :, 1]  # [N, E, F]
    a = a * dense_w.to(a.dtype).unsqueeze(-1)
    return a.reshape(-1, e * f) @ down.permute(0, 2, 1).reshape(e * f, d).to(a.dtype)  # [E*F, D]


class MoE(nn.Module):
    """Softmax router over E experts, top-k with renormalised weights (norm_topk_prob), SwiGLU experts."""

    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.cfg = cfg
        e, d, f = cfg.experts, cfg.hidden, cfg.expert_ffn
        self.gate = nn.Linear(d, e, bias=False)  # router
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * f, d))  # [E, 2F, D]: gate rows, then up rows
        self.down_proj = nn.Parameter(torch.empty(e, d, f))  # [E, D, F]

    def route(self, x: torch.Tensor):
        """x [N, D] -> probs [N, E] float32, ids [N, k], weights [N, k] float32 (routing in float32)."""
        with torch.autocast(x.device.type, enabled=False):  # autocast would compute the router in bf16
            probs = torch.softmax(F.linear(x.float(), self.gate.weight.float()), dim=-1)
        w, ids = probs.topk(self.cfg.top_k, dim=-1)
        return probs, ids, w / w.sum(-1, keepdim=True)

    def forward(self, x: torch.Tensor):
        c = self.cfg
        shape = x.shape
        x = x.reshape(-1, c.hidden)  # [N, D]
        probs, ids, w = self.route(x)
        y = dense_experts(x, self.gate_up_proj, self.down_proj, ids, w)
        # Switch-style load-balancing loss: E * sum_e (share of picks) * (mean router probability)
        picks = torch.zeros_like(probs).scatter(1, ids, 1.0).mean(0) / c.top_k
        aux = c.experts * (picks * probs.mean(0)).sum()
        return y.view(shape), aux, ids


class Layer(nn.Module):
    """A pre-norm decoder layer; attention and MoE are the family's (tools/tiny/glm.py passes its own)."""

    def __init__(self, cfg, attention=None, moe=None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.self_attn = (attention or Attention)(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.mlp = (moe or MoE)(cfg)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        y, aux, ids = self.mlp(self.post_attention_layernorm(x))
        return x + y, aux, ids


def put_hf(out: dict, name: str, p: torch.Tensor, experts: int, ffn: int) -> None:
    """One training-module tensor into a transformers checkpoint `out` (float32, contiguous): the stacked expert
    projections split into one tensor per expert and projection, the rest under `model.`."""
    p = p.detach().float().cpu()
    if name.endswith("mlp.gate_up_proj"):
        pre = name[: -len("gate_up_proj")] + "experts."
        for e in range(experts):
            out[f"model.{pre}{e}.gate_proj.weight"] = p[e, :ffn].contiguous()
            out[f"model.{pre}{e}.up_proj.weight"] = p[e, ffn:].contiguous()
    elif name.endswith("mlp.down_proj"):
        pre = name[: -len("down_proj")] + "experts."
        for e in range(experts):
            out[f"model.{pre}{e}.down_proj.weight"] = p[e].contiguous()
    else:
        out["model." + name] = p.contiguous()


class TinyMoE(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        c = self.cfg
        out_std = c.init_std / math.sqrt(2 * c.layers)  # residual branch outputs, GPT-2 style
        for name, p in self.named_parameters():
            if p.ndim == 1:
                p.fill_(1.0)
            elif name.endswith(("o_proj.weight", "down_proj")):
                p.normal_(0.0, out_std)
            else:
                p.normal_(0.0, c.init_std)

    def forward(self, tokens: torch.Tensor, return_ids: bool = False):
        """tokens [B, T] -> logits [B, T, V] (lm head tied to the embeddings), mean aux loss (, ids per layer)."""
        b, t = tokens.shape
        cos, sin = rope_tables(self.cfg, t, tokens.device)
        x = self.embed_tokens(tokens)
        aux, ids = 0.0, []
        for layer in self.layers:
            x, a, i = layer(x, cos, sin)
            aux, ids = aux + a, ids + [i]
        x = self.norm(x)
        logits = F.linear(x, self.embed_tokens.weight)
        aux = aux / len(self.layers)
        return (logits, aux, ids) if return_ids else (logits, aux)

    # -- export ------------------------------------------------------------------------------------------------
    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """transformers' Qwen3-MoE names, one tensor per expert projection, float32, contiguous."""
        out = {}
        for name, p in self.state_dict().items():
            put_hf(out, name, p, self.cfg.experts, self.cfg.expert_ffn)
        return out

    def hf_config(self, bos_id: int, eos_id: int, pad_id: int) -> dict:
        c = self.cfg
        return {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "vocab_size": c.vocab_size,
            "hidden_size": c.hidden,
            "intermediate_size": c.expert_ffn * c.top_k,  # unused: every layer is MoE
            "moe_intermediate_size": c.expert_ffn,
            "num_hidden_layers": c.layers,
            "num_attention_heads": c.heads,
            "num_key_value_heads": c.kv_heads,
            "head_dim": c.head_dim,
            "num_experts": c.experts,
            "num_experts_per_tok": c.top_k,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "max_position_embeddings": c.ctx,
            "rms_norm_eps": c.norm_eps,
            "rope_theta": c.rope_theta,  # transformers 4.x
            "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},  # 5.x
            "rope_scaling": None,
            "sliding_window": None,
            "use_sliding_window": False,
            "tie_word_embeddings": True,
            "router_aux_loss_coef": c.aux_loss_coef,
            "output_router_logits": False,
            "initializer_range": c.init_std,
            "use_cache": True,
            "bos_token_id": bos_id,
            "eos_token_id": eos_id,
            "pad_token_id": pad_id,
            "torch_dtype": "float32",
        }


def save_hf_checkpoint(model: TinyMoE, out_dir, bos_id: int, eos_id: int, pad_id: int) -> None:
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(model.hf_state_dict(), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(model.hf_config(bos_id, eos_id, pad_id), indent=2) + "\n")
