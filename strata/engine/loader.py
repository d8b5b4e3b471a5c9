"""Open a GGUF model for running: the family's modules, the tokenizer, the chat template, the KV sizing."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from strata import StrataError
from strata.config import EngineConfig
from strata.experts.sizing import DEFAULT_CTX
from strata.gguf.reader import GGUFModel, open_gguf
from strata.kv.window import default_ctx
from strata.models.registry import family_for

log = logging.getLogger("strata")


@dataclass
class LoadedModel:
    model: object  # strata.models.base.CausalLM
    gguf: GGUFModel
    args: object
    cfg: EngineConfig
    max_ctx: int
    tokenizer: object | None = None
    template: object | None = None


def make_experts_factory(cfg: EngineConfig):
    """Choose the experts backend: all resident on the compute device, or tiered (VRAM cache + RAM + CPU lane)."""
    from strata.experts.resident import ResidentExperts

    def make(layers: dict):
        if cfg.experts.tiered():
            from strata.experts.tiered import TieredExperts  # noqa: WPS433 - optional heavy path

            return TieredExperts(layers, cfg)
        dev = cfg.torch_device
        return ResidentExperts({i: (ew if dev.type == "cpu" else ew.to(dev)) for i, ew in layers.items()},
                               profile=cfg.experts.profile and dev.type == "cpu")

    return make


def expandable_segments() -> None:
    """Let torch's CUDA allocator grow segments in place (unless PYTORCH_CUDA_ALLOC_CONF says otherwise): under
    the budget's cap (strata.experts.cache.cap_to_budget) freed memory then goes back page by page rather than
    in whole segments (measured within budget and within the runs' spread either way: docs/BENCHMARKS.md). Called
    before the first weights are allocated (the
    setting applies to segments made afterwards); STRATA_FIXED_SEGMENTS=1 keeps torch's default."""
    from strata.config import fixed_segments

    if fixed_segments():
        return
    try:
        setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
        if setter is not None:
            setter("expandable_segments:True")
        else:  # older torch
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    except (RuntimeError, AttributeError) as e:  # a build without the option: fixed segments, as before
        log.info("strata: expandable CUDA segments unavailable (%s)", e)


def load_model(path: str, cfg: EngineConfig | None = None, with_tokenizer: bool = True,
               experts: Callable[[dict], object] | None = None) -> LoadedModel:
    """Open a GGUF and build its model. experts: a factory {layer: ExpertWeights} -> ExpertsBackend used instead of
    the one the config chooses (strata.experts.backend)."""
    cfg = cfg or EngineConfig(model=str(path))
    cfg.validate()
    g = open_gguf(path)
    fam = family_for(g.arch)
    args = fam.load_args(g)
    # (a KV window on a GPU: the model's own context, its KV in host RAM)
    max_ctx = cfg.ctx_size or default_ctx(cfg, args.ctx_len) or min(args.ctx_len, DEFAULT_CTX)
    if cfg.ctx_size and cfg.ctx_size > args.ctx_len:
        # (llama.cpp warns and runs it too: "possible training context overflow"; its server caps each slot)
        log.warning("strata: -c %d exceeds the model's trained context of %d: it runs, but past %d tokens the "
                    "model's text may fall apart", cfg.ctx_size, args.ctx_len, args.ctx_len)
    if cfg.torch_device.type == "cuda":
        from strata.experts.cache import release_caps

        expandable_segments()
        release_caps()
    model = fam.build(g, cfg, experts or make_experts_factory(cfg), max_ctx, args=args)
    if _host_embed(cfg, model):
        embed_on_host(model, g)
    if cfg.experts.routing != "model":
        model.set_expert_routing(cfg.experts.routing)
        if not args.n_experts:
            log.warning("strata: --expert-routing %s has no effect: the model has no MoE layers", cfg.experts.routing)
        else:
            log.warning("strata: WARNING: --expert-routing %s: every MoE layer ignores its router and sends each "
                        "token to %d random experts of %d: the output is NOT the model's (benchmarks of the expert "
                        "cache's worst case only)", cfg.experts.routing, args.n_experts_used, args.n_experts)
    if cfg.torch_device.type == "cuda":
        _say_slow_formats(g)
    lm = LoadedModel(model, g, args, cfg, max_ctx)
    if with_tokenizer and "tokenizer.ggml.model" in g.metadata:
        from strata.gguf.chat_template import ChatTemplate
        from strata.gguf.tokenizer import Tokenizer

        lm.tokenizer = Tokenizer.from_metadata(g.metadata)
        if g.get("tokenizer.chat_template"):
            lm.template = ChatTemplate.from_metadata(g.metadata)
    return lm


def _say_slow_formats(g: GGUFModel) -> None:
    """One warning per weight format that has no fused GPU kernel (it runs on the reference path: dequantized in
    chunks, then a matmul, each call), so a slow model is never slow silently."""
    from strata.ops import registry
    from strata.ops.expert_gather import expert_formats_fast
    from strata.quant.matmul import KERNELS

    registry.load()
    dense: dict[str, int] = {}
    experts: dict[str, int] = {}
    from gguf import GGMLQuantizationType

    for name, t in g.tensors.items():
        try:
            qt = GGMLQuantizationType(t.qtype)
        except ValueError:  # (a type strata does not know was refused with its own error already)
            continue
        if len(t.shape) < 2 or qt.name in ("F32", "F16", "BF16"):
            continue  # (float weights go through torch's own matmul)
        if "_exps" in name:
            if not expert_formats_fast((qt,)):
                experts[qt.name] = experts.get(qt.name, 0) + 1
        elif ("cuda", qt) not in KERNELS and "token_embd" not in name:
            dense[qt.name] = dense.get(qt.name, 0) + 1
    for what, found in (("expert", experts), ("dense", dense)):
        for fmt, n in sorted(found.items()):
            log.warning("strata: %d %s tensors in %s have no fused GPU kernel: they run dequantized, then multiplied "
                        "(slower than the formats that have one)", n, what, fmt)


def _host_embed(cfg: EngineConfig, model) -> bool:
    if model.device.type != "cuda" or model.head is model.embed:  # a tied table is the head too: it stays
        return False
    if cfg.host_embed is not None:
        return cfg.host_embed
    return cfg.experts.tiered and cfg.experts.vram_gb is not None


def embed_on_host(model, g) -> None:
    """Serve the input embedding from the GGUF's mapped rows on the host and free its VRAM (before the KV cache
    and the expert cache are sized, so the cache gets it): a token reads one row, a few KB, where the table is
    hundreds of MB (B1's: 151,936 x 2,048 in Q8_0, ~330 MB, two expert slots a layer)."""
    from strata.quant import QTensor

    t = g.tensors["token_embd.weight"]
    raw = t.raw()
    if model.device.type == "cuda":  # pinned: a decode step's graph reads its rows over the bus (ops.host_rows)
        raw = torch.empty(raw.shape, dtype=raw.dtype, pin_memory=True).copy_(raw)
    model.embed = QTensor.from_raw(raw, t.qtype, t.shape)
    model.host_embed = True
    if model.device.type == "cuda":
        torch.cuda.empty_cache()
    log.info("strata: input embedding table in host RAM (%.0f MiB of VRAM left to the cache)",
             model.embed.raw.numel() / 2**20)


@torch.inference_mode()
def forward_all(lm: LoadedModel, ids: list[int]) -> torch.Tensor:
    """Logits for every position of one prompt, run as a single segment (tests and perplexity)."""
    from strata.kv.cache import Segment

    m = lm.model
    if len(ids) > lm.max_ctx:
        raise StrataError(f"prompt of {len(ids)} tokens exceeds the context of {lm.max_ctx}")
    kv = m.new_kv_cache(1, lm.max_ctx)
    t = torch.tensor(ids, device=m.device)
    return m.forward(t, torch.arange(len(ids), device=m.device), [Segment(0, 0, len(ids))], kv, all_logits=True)
