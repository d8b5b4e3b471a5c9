"""`strata check -m MODEL`: what a model needs (VRAM, RAM), how many expert slots a VRAM budget holds, and
the verdict.

The split follows strata's design: every non-expert tensor (embeddings, attention, norms, routers, shared
experts, head) lives on the GPU with the KV cache; every expert lives in pinned host RAM; what VRAM is left
becomes slots, each holding one expert of one layer. Expert tensors are the ones named `*_exps*`
(`blk.N.ffn_{gate,up,down}_exps.weight`, shape [n_expert, ...] in torch order).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from strata.experts.sizing import (DEFAULT_CTX, OUTSIDE_GROWTH_MIB, VRAM_RESERVE_MIB, VramSplit,
                                   deltanet_prefill_bytes, kv_row_bytes, lent_slots, prefill_bytes_for,
                                   prefill_chunk_for, prefill_left, split_budget, staging_slots)
from strata.hub.machine import MachineInfo
from strata.hub.verify import GGUFHeader, read_gguf_header

GiB = 1 << 30
MiB = 1 << 20
# The engine's own sizing rules and constants, imported from strata.experts.sizing (torch-free, so `strata check`
# answers in a moment).
VRAM_RESERVE = VRAM_RESERVE_MIB * MiB  # ExpertConfig.vram_reserve_mib's default
# The engine also leaves out what the device holds when it sizes the cache, its own CUDA context included, which
# it measures at start-up; check, before any context exists, counts this estimate for it (the context with cuBLAS
# up, rounded up from what the GPU machine's driver counted: docs/history/benchmarks-2026-11.md, "Where the memory
# went"), and the room the engine keeps for it to grow (strata.experts.cache.OUTSIDE_GROWTH_MIB).
CUDA_CONTEXT_ESTIMATE = (704 + OUTSIDE_GROWTH_MIB) * MiB


RAM_HEADROOM = 2 * GiB  # OS, the server process itself, page cache for the memory-mapped files
KV_CACHE_TYPE = "f16"  # the engine's default KV on a GPU is bf16, the same size; -ctk/-ctv choose others
_LAYER = re.compile(r"^blk\.(\d+)\.")


@dataclass
class ModelFootprint:
    files: list[str]
    architecture: str | None
    total_bytes: int  # all tensor data
    dense_bytes: int  # everything that is not an expert: resident on the GPU
    expert_bytes: int  # all routed experts: pinned in host RAM
    n_expert: int  # experts per MoE layer (0: a dense model)
    n_expert_used: int  # top-k
    n_moe_layers: int
    slot_bytes: int  # bytes of one expert of one layer (the largest layer's, if they differ)
    kv_bytes_per_token: int  # all layers, K and V
    context_length: int | None  # the model's trained context
    d_model: int = 0  # hidden size (sizes a prefill chunk's activations)
    # the input embedding table when the model has its own output head: under a VRAM budget a MoE model serves
    # it from host RAM (EngineConfig.host_embed), so it is not part of the dense weights on the GPU
    embed_bytes: int = 0
    state_bytes_per_slot: int = 0  # recurrent layers' state per sequence (qwen3next's delta-net), beside the KV
    mixer_prefill_bytes: int = 0  # a prompt token's VRAM in a delta-net layer's chunked form (sizing.deltanet_prefill_bytes)
    # bytes per weight format (GGML type name), routed experts and the rest apart: what llama.cpp's loader lists as
    # "type q4_K: N tensors", here weighted by size
    expert_formats: dict[str, int] = field(default_factory=dict)
    dense_formats: dict[str, int] = field(default_factory=dict)
    # KV bytes per token with K and V both of a compact type (q8_0, q4_0): the "would fit with" of a context too
    # long for the budget at the asked types
    kv_compact_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def n_expert_total(self) -> int:
        return self.n_expert * self.n_moe_layers



def kv_bytes_per_token(h: GGUFHeader, cache_type_k: str = "f16", cache_type_v: str = "f16") -> int:
    """KV-cache bytes one token occupies across all layers, from the GGUF metadata (multi-token-prediction
    blocks, which hold no KV here, left out), K and V stored as the engine's -ctk/-ctv would (MLA's latent: -ctk)."""
    n_layer = int(h.arch_value("block_count", 0) or 0) - int(h.arch_value("nextn_predict_layers", 0) or 0)
    n_head = h.arch_value("attention.head_count", 0) or 0
    n_embd = int(h.arch_value("embedding_length", 0) or 0)
    kv_lora = h.arch_value("attention.kv_lora_rank")
    if kv_lora:  # MLA (DeepSeek-style): one compressed latent plus the rope part per token and layer
        rope = int(h.arch_value("rope.dimension_count", 0) or 0)
        return n_layer * kv_row_bytes(int(kv_lora) + rope, cache_type_k)
    n_kv = h.arch_value("attention.head_count_kv", n_head)
    heads = n_head if isinstance(n_head, int) else max(n_head or [0])
    head_dim = n_embd // heads if heads else 0
    k_len = int(h.arch_value("attention.key_length", head_dim) or head_dim)
    v_len = int(h.arch_value("attention.value_length", head_dim) or head_dim)
    if isinstance(n_kv, list):  # per-layer counts; 0 marks a layer without attention (recurrent/SSM)
        kv_heads_total = sum(int(x) for x in n_kv)
    else:
        kv_heads_total = int(n_kv) * (n_layer - _recurrent_count(h, n_layer, 1))
    return kv_heads_total * (kv_row_bytes(k_len, cache_type_k) + kv_row_bytes(v_len, cache_type_v))


def _recurrent_count(h: GGUFHeader, n_layer: int, default_interval: int) -> int:
    """Recurrent (not attention) layers of a hybrid: llama.cpp's per-layer `attention.recurrent_layers` flags, or
    all but every `full_attention_interval`-th layer (older files)."""
    flags = h.arch_value("attention.recurrent_layers")
    if isinstance(flags, list):
        return sum(1 for f in flags[:n_layer] if f)
    interval = int(h.arch_value("full_attention_interval", default_interval) or default_interval)
    return n_layer - n_layer // interval


def state_bytes_per_slot(h: GGUFHeader) -> int:
    """The recurrent layers' state one sequence holds whatever its length (gated delta-net: a float32 [value heads,
    key dim, value dim] matrix and the last kernel - 1 inputs of the short conv per layer; see
    strata.kv.recurrent); 0 for a model of attention layers only."""
    keys = ("ssm.group_count", "ssm.time_step_rank", "ssm.state_size", "ssm.inner_size", "ssm.conv_kernel")
    vals = [h.arch_value(k) for k in keys]
    if any(v is None for v in vals) or not int(vals[1]):
        return 0
    hk, hv, dk, inner, kernel = (int(v) for v in vals)
    n_layer = int(h.arch_value("block_count", 0) or 0)
    n_recurrent = _recurrent_count(h, n_layer, 4)
    per_layer = (kernel - 1) * (2 * hk * dk + inner) + hv * dk * (inner // hv)
    return n_recurrent * per_layer * 4


def mixer_prefill_bytes(h: GGUFHeader) -> int:
    """sizing.deltanet_prefill_bytes from a hybrid model's metadata (0 for a model of attention layers only)."""
    keys = ("ssm.group_count", "ssm.time_step_rank", "ssm.state_size", "ssm.inner_size")
    vals = [h.arch_value(k) for k in keys]
    if any(v is None for v in vals) or not int(vals[1]):
        return 0
    hk, hv, dk, inner = (int(v) for v in vals)
    return deltanet_prefill_bytes(hk, hv, dk, inner // hv)


def model_footprint(paths: list[Path], cache_type_k: str = KV_CACHE_TYPE,
                    cache_type_v: str = KV_CACHE_TYPE) -> ModelFootprint:
    """Sizes from the tensor tables of a model's GGUF file(s) (all shards; metadata from the first); the KV as
    stored in the given -ctk/-ctv types."""
    headers = [read_gguf_header(p) for p in paths]
    first = headers[0]
    total = expert = 0
    per_layer: dict[int, int] = {}  # layer -> bytes of its routed experts
    n_expert = int(first.arch_value("expert_count", 0) or 0)
    embed, has_head = 0, False
    formats: tuple[dict[str, int], dict[str, int]] = ({}, {})  # experts, the rest
    # multi-token-prediction blocks (glm4moe's nextn) after the trunk are kept in host RAM and never run: not
    # part of what the GPU holds, nor of the KV
    trunk = int(first.arch_value("block_count", 0) or 0) - int(first.arch_value("nextn_predict_layers", 0) or 0)
    for h in headers:
        for t in h.tensors:
            m = _LAYER.match(t.name)
            if m and int(m.group(1)) >= trunk > 0 and first.arch_value("nextn_predict_layers"):
                continue
            total += t.n_bytes
            if t.name == "token_embd.weight":
                embed = t.n_bytes
            has_head = has_head or t.name == "output.weight"
            kind = formats[0 if "_exps" in t.name else 1]
            kind[_type_name(t.ggml_type)] = kind.get(_type_name(t.ggml_type), 0) + t.n_bytes
            if "_exps" not in t.name:
                continue
            expert += t.n_bytes
            layer = int(m.group(1)) if m else -1
            per_layer[layer] = per_layer.get(layer, 0) + t.n_bytes
            if not n_expert and len(t.shape) >= 3:
                n_expert = t.shape[-1]  # ggml order: the expert index is the outermost dimension
    slot = max(per_layer.values()) // n_expert if per_layer and n_expert else 0
    return ModelFootprint(
        files=[str(p) for p in paths],
        architecture=first.architecture,
        total_bytes=total,
        dense_bytes=total - expert,
        expert_bytes=expert,
        n_expert=n_expert if per_layer else 0,
        n_expert_used=int(first.arch_value("expert_used_count", 0) or 0),
        n_moe_layers=len(per_layer),
        slot_bytes=slot,
        kv_bytes_per_token=kv_bytes_per_token(first, cache_type_k, cache_type_v),
        kv_compact_bytes={t: kv_bytes_per_token(first, t, t) for t in ("q8_0", "q4_0")},
        state_bytes_per_slot=state_bytes_per_slot(first),
        mixer_prefill_bytes=mixer_prefill_bytes(first),
        context_length=first.arch_value("context_length"),
        d_model=int(first.arch_value("embedding_length", 0) or 0),
        embed_bytes=embed if has_head else 0,
        expert_formats=dict(sorted(formats[0].items(), key=lambda kv: -kv[1])),
        dense_formats=dict(sorted(formats[1].items(), key=lambda kv: -kv[1])),
    )


def _type_name(ggml_type: int) -> str:
    """A GGML type's name (gguf-py's), or its number where gguf-py does not know it."""
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


def stage_footprints(paths: list[Path], size: int, spec: str = "auto", cache_type_k: str = KV_CACHE_TYPE,
                     cache_type_v: str = KV_CACHE_TYPE) -> list[tuple[range, ModelFootprint]]:
    """Each pipeline stage's share of the model (`--pipeline-parallel-size size --layer-split spec`): the tensors
    of its layers counted exactly, the input embedding with the first stage, the output norm and head with the
    last (a tied head: both), its KV and recurrent state by its share of the layers."""
    from strata.engine.layer_split import layer_split

    whole = model_footprint(paths, cache_type_k, cache_type_v)
    headers = [read_gguf_header(p) for p in paths]
    n_layers = int(headers[0].arch_value("block_count", 0) or 0) - int(
        headers[0].arch_value("nextn_predict_layers", 0) or 0)
    splits = layer_split(n_layers, size, spec)
    layer_bytes: dict[int, list[int]] = {}  # layer -> [all bytes, expert bytes]
    other: dict[str, int] = {}  # tensors of no layer, by name
    for h in headers:
        for t in h.tensors:
            m = _LAYER.match(t.name)
            if m is None:
                other[t.name] = t.n_bytes
                continue
            i = int(m.group(1))
            if i >= n_layers:
                continue  # an MTP block beyond the trunk: never on a GPU
            b = layer_bytes.setdefault(i, [0, 0])
            b[0] += t.n_bytes
            if "_exps" in t.name:
                b[1] += t.n_bytes
    tied = "output.weight" not in other
    out = []
    for r, layers in enumerate(splits):
        first, last = r == 0, r == len(splits) - 1
        own = [layer_bytes.get(i, [0, 0]) for i in layers]
        expert = sum(b[1] for b in own)
        total = sum(b[0] for b in own)
        embed = other.get("token_embd.weight", 0) if first or (last and tied) else 0
        total += embed + sum(v for k, v in other.items() if k != "token_embd.weight" and last)
        share = len(layers) / max(n_layers, 1)
        out.append((layers, ModelFootprint(
            files=whole.files, architecture=whole.architecture, total_bytes=total, dense_bytes=total - expert,
            expert_bytes=expert, n_expert=whole.n_expert if expert else 0, n_expert_used=whole.n_expert_used,
            n_moe_layers=sum(1 for b in own if b[1]), slot_bytes=whole.slot_bytes,
            kv_bytes_per_token=int(round(whole.kv_bytes_per_token * share)),
            context_length=whole.context_length, d_model=whole.d_model,
            embed_bytes=embed if not tied and first else 0,
            state_bytes_per_slot=int(round(whole.state_bytes_per_slot * share)),
            mixer_prefill_bytes=whole.mixer_prefill_bytes)))
    return out


@dataclass
class Fit:
    mode: str  # "gpu" (dense + KV on the GPU, experts in RAM) or "cpu" (everything in RAM)
    ctx: int
    ok: bool
    vram_budget: int | None
    vram_needed: int | None  # dense + KV + reserve + staging ring (without any cache slot)
    kv_bytes: int
    ram_needed: int
    ram_available: int
    slots: int  # cache slots per MoE layer (the engine gives every layer the same number)
    slots_share: float  # slots / experts per layer
    reasons: list[str] = field(default_factory=list)  # why it cannot run
    fixes: list[str] = field(default_factory=list)  # what would make it fit
    notes: list[str] = field(default_factory=list)
    prefill_chunk: int = 0  # prompt tokens per forward the budget leaves room for (GPU, MoE)
    prefill_bytes: int = 0  # that chunk's activations, inside vram_needed
    # how the budget divides (GPU, MoE): the engine's own arithmetic (strata.experts.sizing.split_budget)
    vram_split: VramSplit | None = None
    kv_host_bytes: int = 0  # with a KV window (--kv-vram-tokens): the whole KV, in host RAM
    kv_window: int = 0  # tokens a layer of it in VRAM (0: no window)


def fit(fp: ModelFootprint, machine: MachineInfo, ctx: int = 0, vram_budget: int | None = None,
        kv_window: int | None = None) -> Fit:
    """The verdict for running `fp` with a context of `ctx` tokens (0: the engine's default) on `machine`.

    `vram_budget` (bytes) defaults to the first GPU's free VRAM; with no GPU and no budget the model runs on
    the CPU, all of it from RAM. Slots are counted as the engine counts them: one slot per layer costs one
    expert of every MoE layer. kv_window (tokens a layer, --kv-vram-tokens): the KV in host RAM and that much of
    it in VRAM, with one layer's whole context as the stage attention reads (strata.kv.window).
    """
    ctx = ctx or min(fp.context_length or DEFAULT_CTX, DEFAULT_CTX)
    if vram_budget is None and machine.gpus:
        vram_budget = machine.gpus[0].vram_free
    kv = fp.kv_bytes_per_token * ctx + fp.state_bytes_per_slot  # one sequence: its KV and any recurrent state
    if vram_budget is None:
        return _fit_cpu(fp, machine, ctx, kv)
    kv += fp.state_bytes_per_slot  # (a GPU: a copy of the state for the decode step launched ahead; not with
    # a KV window below, whose steps run one at a time)
    host_kv, window = 0, 0
    if kv_window and kv_window < ctx:
        host_kv, window = fp.kv_bytes_per_token * ctx, int(kv_window)
        # (the stage: one layer's whole context; MoE layers stand for the layers, about)
        kv = fp.kv_bytes_per_token * window + host_kv // max(fp.n_moe_layers, 1) + fp.state_bytes_per_slot
    staging = staging_slots(fp.n_expert_used) * fp.slot_bytes if fp.n_expert else 0
    dense = fp.dense_bytes - (fp.embed_bytes if fp.n_expert else 0)  # the embedding in host RAM (MoE, a budget)
    held = CUDA_CONTEXT_ESTIMATE + dense + kv
    # a MoE model's cache leaves room for one prefill chunk (4096 tokens, fewer on a small budget), as the engine
    # does on a GPU
    chunk, prefill, split = 0, 0, None
    if fp.n_expert:
        bpt = prefill_bytes_for(fp.d_model, fp.n_expert_used, fp.mixer_prefill_bytes)
        chunk = prefill_chunk_for(prefill_left(vram_budget, held, VRAM_RESERVE), bpt)
        prefill = chunk * bpt
        split = split_budget(vram_budget, context=CUDA_CONTEXT_ESTIMATE, dense=dense, kv=kv,
                             reserve=VRAM_RESERVE, staging=staging, prefill=prefill, expert_bytes=fp.slot_bytes,
                             per_slot=fp.expert_bytes // fp.n_expert,  # one expert in every layer
                             n_experts=fp.n_expert, prefill_chunk=chunk)
        split = replace(split, lent_slots=lent_slots(split, fp.n_moe_layers, fp.expert_bytes // fp.n_expert))
    vram_needed = held + VRAM_RESERVE + staging + prefill
    # the experts pinned, and the input embedding pinned beside them when it is served from host RAM
    ram_needed = fp.expert_bytes + (fp.embed_bytes if fp.n_expert else 0) + RAM_HEADROOM + host_kv
    spare = vram_budget - vram_needed
    slots = split.slots if split is not None else 0
    share = slots / fp.n_expert if fp.n_expert else 1.0
    f = Fit("gpu", ctx, True, vram_budget, vram_needed, kv, ram_needed, machine.ram_available, int(slots), share,
            prefill_chunk=chunk, prefill_bytes=prefill, vram_split=split, kv_host_bytes=host_kv, kv_window=window)
    if window:
        f.notes.append(f"KV window: {window} tokens a layer and the stage in VRAM ({_g(kv)}), the whole KV for "
                       f"{ctx} tokens in host RAM ({_g(host_kv)}); decode steps run without CUDA graphs")
    if spare < 0:
        f.ok = False
        f.reasons.append(
            f"VRAM: needs {_g(vram_needed)} (dense weights {_g(dense)} + "
            + (f"a KV window of {window} tokens and its stage" if window else f"KV for {ctx} tokens")
            + f" {_g(kv)} "
            f"+ reserve {_g(VRAM_RESERVE)} + staging {_g(staging)} + a {chunk}-token prefill chunk "
            f"{_g(prefill)} + the CUDA context, about {_g(CUDA_CONTEXT_ESTIMATE)}), budget is {_g(vram_budget)}"
        )
        f.fixes.append(f"{_g(-spare)} more free VRAM (--vram-gb sets the budget)")
        room = vram_budget - (vram_needed - kv)
        max_ctx = room // fp.kv_bytes_per_token if fp.kv_bytes_per_token else 0
        if max_ctx >= 512:
            f.fixes.append(f"a smaller context: -c {int(max_ctx) // 256 * 256} fits")
        if not window:
            # the first compact KV type (q8_0 before q4_0: less lost) that holds this context in the budget
            for t, per in fp.kv_compact_bytes.items():
                if per < fp.kv_bytes_per_token and per * ctx <= room:
                    f.fixes.append(f"a compact KV cache: -ctk {t} -ctv {t} ({_g(per * ctx)} for {ctx} tokens)")
                    break
        if not window and max_ctx >= 1024:
            f.fixes.append(f"the KV in host RAM and a window of it in VRAM: --kv-vram-tokens "
                           f"{int(max_ctx) // 2 // 256 * 256}")
        f.fixes.append("a smaller quant of the model")
    if ram_needed > machine.ram_available:
        f.ok = False
        f.reasons.append(
            f"RAM: needs {_g(ram_needed)} (all experts pinned {_g(fp.expert_bytes)} + headroom {_g(RAM_HEADROOM)}"
            + (f" + the KV for {ctx} tokens {_g(host_kv)}" if host_kv else "") + "), "
            f"{_g(machine.ram_available)} available of {_g(machine.ram_total)}"
        )
        if ram_needed <= machine.ram_total:
            f.fixes.append(f"free {_g(ram_needed - machine.ram_available)} of RAM (close other programs)")
        else:
            f.fixes.append(f"{_g(ram_needed - machine.ram_total)} more RAM, or a smaller quant of the model")
    if f.ok and fp.n_expert and slots < fp.n_expert_used:
        f.notes.append(
            f"{slots} slots per layer are fewer than the {fp.n_expert_used} experts each token uses: most experts "
            "are computed by the CPU or copied each token; expect CPU-bound speed"
        )
    if fp.n_expert and fp.embed_bytes:
        f.notes.append(f"the input embedding table ({_g(fp.embed_bytes)}) is read from host RAM, its VRAM left to "
                       "the expert cache (--no-host-embed keeps it on the GPU)")
    _past_trained(f, fp, ctx)
    return f


def _past_trained(f: Fit, fp: ModelFootprint, ctx: int) -> None:
    """A context past the model's trained one runs (as llama.cpp runs it, with a warning), but is said."""
    if fp.context_length and ctx > fp.context_length:
        f.notes.append(f"-c {ctx} is beyond the model's trained context of {fp.context_length}: it runs, but past "
                       f"{fp.context_length} tokens the model's text may fall apart")


def _fit_cpu(fp: ModelFootprint, machine: MachineInfo, ctx: int, kv: int) -> Fit:
    ram_needed = fp.total_bytes + kv + RAM_HEADROOM
    f = Fit("cpu", ctx, True, None, None, kv, ram_needed, machine.ram_available, 0, 0.0)
    f.notes.append("no GPU: everything runs on the CPU from RAM (pass --vram-gb to plan for a GPU)")
    if ram_needed > machine.ram_available:
        f.ok = False
        f.reasons.append(
            f"RAM: needs {_g(ram_needed)} (weights {_g(fp.total_bytes)} + KV for {ctx} tokens {_g(kv)} + headroom "
            f"{_g(RAM_HEADROOM)}), {_g(machine.ram_available)} available of {_g(machine.ram_total)}"
        )
        f.fixes.append(f"{_g(ram_needed - machine.ram_available)} more free RAM, a GPU, or a smaller quant")
    _past_trained(f, fp, ctx)
    return f


def _g(n: int | float) -> str:
    return f"{n / GiB:.2f} GiB"
