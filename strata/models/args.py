"""Model hyper-parameters read from GGUF metadata into one dataclass shared by every family.

Each family file names its GGUF architecture; the keys are `{arch}.{key}` as llama.cpp's converter writes them.
Missing required keys are a clear error; optional ones fall back to the family's documented default.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from strata import StrataError
from strata.layers.rotary import RopeScaling  # noqa: F401 - part of ModelArgs, defined where it is used


@dataclass
class ModelArgs:
    arch: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int  # key length per head
    v_head_dim: int  # value length per head
    ffn_dim: int  # dense FFN hidden size (0 when every layer is MoE)
    vocab_size: int
    ctx_len: int
    norm_eps: float
    rope_theta: float = 10000.0
    rope_dim: int = 0  # rotated dims per head (0 = head_dim)
    rope_style: str = "neox"  # neox = rotate halves; norm = interleaved pairs (llama.cpp's LLAMA_ROPE_TYPE_NORM)
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    tied_embeddings: bool = False
    # MoE
    n_experts: int = 0
    n_experts_used: int = 0
    expert_ffn_dim: int = 0
    n_shared_experts: int = 0
    shared_ffn_dim: int = 0
    first_dense_layers: int = 0  # leading layers with a dense FFN
    gating: str = "softmax"  # softmax | sigmoid
    norm_topk: bool = True  # renormalise the k selected weights to sum to 1
    routed_scale: float = 1.0
    n_groups: int = 1  # group-limited routing (DeepSeek-V3)
    topk_groups: int = 1
    # MLA (DeepSeek-V2/V3)
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    def is_moe_layer(self, i: int) -> bool:
        return self.is_moe and i >= self.first_dense_layers

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.n_layers) if self.is_moe_layer(i)]


# llama.cpp's expert_gating_func enum (0 = unset; 3 = SOFTMAX_WEIGHT, which llama.cpp's gpt-oss uses)
GATING = {0: "softmax", 1: "softmax", 2: "sigmoid", 3: "softmax_weight"}


def read_args(md: dict[str, Any], arch: str, tensors: dict[str, Any] | None = None, **defaults) -> ModelArgs:
    """Build ModelArgs from GGUF metadata. `defaults` supplies family defaults for optional keys."""

    def get(key: str, default: Any = KeyError) -> Any:
        full = f"{arch}.{key}"
        if full in md and md[full] is not None:
            return md[full]
        if key in defaults:
            return defaults[key]
        if default is KeyError:
            raise StrataError(f"GGUF metadata is missing {full} (needed by the {arch} architecture)")
        return default

    n_heads = int(get("attention.head_count"))
    d_model = int(get("embedding_length"))
    n_kv = get("attention.head_count_kv", n_heads)
    if isinstance(n_kv, list):  # per-layer lists occur in some families; strata needs them uniform
        if len(set(n_kv)) != 1:
            raise StrataError(f"{arch}: per-layer attention.head_count_kv is not supported")
        n_kv = n_kv[0]
    head_dim = int(get("attention.key_length", d_model // n_heads))
    v_head_dim = int(get("attention.value_length", head_dim))
    tokens = md.get("tokenizer.ggml.tokens")
    vocab = int(get("vocab_size", len(tokens) if tokens else 0))
    if tensors is not None and "token_embd.weight" in tensors:
        vocab = tensors["token_embd.weight"].shape[0]
    if not vocab:
        raise StrataError(f"GGUF metadata gives no vocabulary size for {arch}")
    ffn = get("feed_forward_length", 0)
    if isinstance(ffn, list):
        ffn = max(ffn)
    scaling = RopeScaling()
    kind = get("rope.scaling.type", "none")
    if kind and kind != "none":
        scaling = RopeScaling(
            kind=str(kind),
            factor=float(get("rope.scaling.factor", 1.0)),
            original_ctx=int(get("rope.scaling.original_context_length", 0)),
            beta_fast=float(get("rope.scaling.yarn_beta_fast", 32.0)),
            beta_slow=float(get("rope.scaling.yarn_beta_slow", 1.0)),
            mscale_all_dim=float(get("rope.scaling.yarn_log_multiplier", 0.0)),
        )
    gating = get("expert_gating_func", 0)
    return ModelArgs(
        arch=arch,
        n_layers=int(get("block_count")),
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=int(n_kv),
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        ffn_dim=int(ffn),
        vocab_size=vocab,
        ctx_len=int(get("context_length", 4096)),
        norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_dim=int(get("rope.dimension_count", 0)),
        rope_scaling=scaling,
        tied_embeddings=tensors is not None and "output.weight" not in tensors,
        n_experts=int(get("expert_count", 0)),
        n_experts_used=int(get("expert_used_count", 0)),
        expert_ffn_dim=int(get("expert_feed_forward_length", 0)),
        n_shared_experts=int(get("expert_shared_count", 0)),
        shared_ffn_dim=int(get("expert_shared_feed_forward_length", 0)),
        first_dense_layers=int(get("leading_dense_block_count", 0)),
        gating=GATING.get(int(gating), "softmax") if not isinstance(gating, str) else gating,
        norm_topk=bool(get("expert_weights_norm", True)),
        routed_scale=float(get("expert_weights_scale", 1.0)),
        n_groups=int(get("expert_group_count", 1)),
        topk_groups=int(get("expert_group_used_count", 1)),
        q_lora_rank=int(get("attention.q_lora_rank", 0)),
        kv_lora_rank=int(get("attention.kv_lora_rank", 0)),
    )
