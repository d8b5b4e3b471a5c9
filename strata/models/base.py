"""What every family shares: the weight loader over a GGUF file, the pre-norm decoder block, the causal LM.

Families describe themselves as data (a load map, routing settings, the rope style) and build their attention
and FFN modules; nothing here branches on the family.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from strata import StrataError
from strata.experts.backend import StepContext
from strata.gguf.reader import GGUFModel
from strata.kv.cache import KVCache, Segment
from strata.layers.embedding import MAX_TOKENS as EMBED_KEEP_TOKENS
from strata.layers.embedding import EmbedRows
from strata.layers.moe import MoE
from strata.layers.norm import add_rms_norm, rms_norm
from strata.quant import QTensor, dequantize, qmatmul
from strata.quant.matmul import row_groups


# The layers this process computes when the model is split over pipeline stages (strata.engine.pipeline), None:
# all. Set around a family's build: a weight of another stage's layer stays mapped in the file (no device copy,
# no RAM: its pages are never touched), and only this stage's experts reach the experts backend.
STAGE_LAYERS: contextvars.ContextVar[frozenset[int] | None] = contextvars.ContextVar("stage_layers", default=None)
_LAYER = re.compile(r"blk\.(\d+)\.")


class WeightLoader:
    """Hands out GGUF tensors by name and remembers which were used, so that nothing is silently ignored."""

    def __init__(self, g: GGUFModel, device: torch.device):
        self.g, self.device = g, device
        self.used: set[str] = set()
        self.stage = STAGE_LAYERS.get()

    def owned(self, name: str) -> bool:
        """Whether this process computes the layer the tensor belongs to (a tensor of no layer: yes)."""
        if self.stage is None:
            return True
        m = _LAYER.match(name)
        return m is None or int(m.group(1)) in self.stage

    def has(self, name: str) -> bool:
        return name in self.g.tensors

    def q(self, name: str, device: torch.device | None = None, required: bool = True) -> QTensor | None:
        """A weight kept in its stored format (moved to `device`, or left mapped on the host if None/cpu)."""
        t = self.g.tensors.get(name)
        if t is None:
            if required:
                raise StrataError(f"{self.g.paths[0].name}: tensor {name} is missing (needed by {self.g.arch})")
            return None
        self.used.add(name)
        qt = QTensor.from_raw(t.raw(), t.qtype, t.shape)
        dev = self.device if device is None else device
        if not self.owned(name):
            return qt  # another stage's layer: left mapped
        return qt if dev.type == "cpu" else qt.to(dev)

    def f(self, name: str, required: bool = True) -> torch.Tensor | None:
        """A small tensor (norm weights, biases) dequantized to float32 on the compute device."""
        qt = self.q(name, torch.device("cpu"), required)
        if qt is None:
            return None
        return qt.dequantize(torch.float32).reshape(qt.shape).to(self.device)

    def finish(self, ignore: tuple[str, ...] = ()) -> None:
        left = [n for n in self.g.tensors if n not in self.used and not any(n.startswith(p) for p in ignore)]
        if left:
            more = f" and {len(left) - 5} more" if len(left) > 5 else ""
            raise StrataError(
                f"{self.g.paths[0].name}: tensors not understood by the {self.g.arch} loader: {', '.join(left[:5])}{more}"
            )


class Block:
    def __init__(self, attn_norm: torch.Tensor, attn: Callable, ffn_norm: torch.Tensor, ffn: Callable, eps: float):
        self.attn_norm, self.attn, self.ffn_norm, self.ffn, self.eps = attn_norm, attn, ffn_norm, ffn, eps
        self.moe = isinstance(ffn, MoE)  # an MoE block takes the step context (its experts backend needs it)

    def step(self, x, delta, pos, segments, kv, ctx: StepContext):
        """x + delta through the block, delta being the previous block's output not yet added (None: x is whole):
        (h, out) with this block's own output `out` left unadded, so that each residual add is one launch with
        the RMSNorm after it (add_rms_norm: the attention's norm here, the FFN's below) on a GPU."""
        if delta is None:
            a = rms_norm(x, self.attn_norm, self.eps)
        else:
            x, a = add_rms_norm(x, delta, self.attn_norm, self.eps)
        h, n = add_rms_norm(x, self.attn(a, pos, segments, kv), self.ffn_norm, self.eps)
        return h, (self.ffn(n, ctx) if self.moe else self.ffn(n))

    def __call__(self, x, pos, segments, kv, ctx: StepContext):
        prof = ctx.profiler
        if prof is None:
            h, out = self.step(x, None, pos, segments, kv, ctx)
            return h + out
        # --profile: spans on the GPU stream (events), resolved once per step
        t = prof.mark()
        h = x + self.attn(rms_norm(x, self.attn_norm, self.eps), pos, segments, kv)
        prof.span("mla" if type(self.attn).__name__ == "MLAttention" else "attention", t)
        if self.moe:
            return h + self.ffn(rms_norm(h, self.ffn_norm, self.eps), ctx)
        t = prof.mark()
        out = h + self.ffn(rms_norm(h, self.ffn_norm, self.eps))
        prof.span("dense_other", t)
        return out


@dataclass
class NextNLayer:
    """One MTP block as stored: `tensors` maps the names below `blk.{layer}.` (`attn_q.weight`,
    `ffn_gate_exps.weight`, `nextn.eh_proj.weight`, ...) to weights in their stored format, on the host.
    Absent optional tensors fall back to the trunk's (token_embd, output, output_norm), as in llama.cpp."""

    layer: int  # its GGUF block index (the trunk has blocks 0..layer-1 when it is the first)
    tensors: dict[str, QTensor] = field(default_factory=dict)

    def __getitem__(self, name: str) -> QTensor:
        return self.tensors[name]

    def get(self, name: str) -> QTensor | None:
        return self.tensors.get(name)

    @property
    def nbytes(self) -> int:
        return sum(t.raw.numel() * t.raw.element_size() for t in self.tensors.values())


@dataclass
class CacheSpec:
    k_shape: tuple[int, ...]
    v_shape: tuple[int, ...] | None


class CausalLM:
    def __init__(self, args, embed: QTensor, blocks: list[Block], out_norm: torch.Tensor, head: QTensor,
                 cache_spec: CacheSpec, device: torch.device, dtype: torch.dtype, experts=None):
        self.args, self.embed, self.blocks, self.out_norm, self.head = args, embed, blocks, out_norm, head
        self.cache_spec, self.device, self.dtype, self.experts = cache_spec, device, dtype, experts
        # the input embedding lives in host RAM (strata.engine.loader.embed_on_host): a captured decode step then
        # takes its input rows in a device buffer, filled before each replay (strata.engine.graphs)
        self.host_embed = False
        self._route_taps: list[Callable[[int, torch.Tensor], None]] = []
        self.stage_layers: frozenset[int] | None = STAGE_LAYERS.get()  # a pipeline stage's blocks (None: all)

    @contextlib.contextmanager
    def tap_routing(self, fn: Callable[[int, torch.Tensor], None]) -> Iterator[None]:
        """Within the block, every forward calls fn(layer, ids [N, k]) after each MoE router (routing traces)."""
        self._route_taps.append(fn)
        try:
            yield
        finally:
            self._route_taps.remove(fn)

    def set_expert_routing(self, mode: str) -> None:
        """`model` (the routers' choice) or `uniform` (random experts, strata.layers.moe.uniform_route) in every MoE
        layer: --expert-routing, a benchmark switch."""
        if mode not in ("model", "uniform"):
            raise StrataError(f"--expert-routing must be model or uniform (got {mode!r})")
        for b in self.blocks:
            if isinstance(b.ffn, MoE):
                b.ffn.uniform = mode == "uniform"

    def step_context(self, segments: list[Segment], n_tokens: int, **kw) -> StepContext:
        """The context of a forward over `segments` (the engine passes what it knows: graphs, phase)."""
        kw.setdefault("profiler", self.experts.profiler if self.experts is not None else None)
        return StepContext.for_segments(segments, n_tokens, **kw)

    def new_kv_cache(self, n_slots: int, max_ctx: int, dtype: torch.dtype | None = None, k_type=None,
                     v_type=None) -> KVCache:
        """k_type / v_type: how K and V are stored when not in `dtype` (strata.kv.cache.KVCache)."""
        return KVCache(len(self.blocks), n_slots, max_ctx, self.cache_spec.k_shape, self.cache_spec.v_shape,
                       dtype or self.dtype, self.device, k_type, v_type, layers=self.stage_layers)

    def kv_bytes_per_token(self, dtype: torch.dtype | None = None, k_type=None, v_type=None) -> int:
        return KVCache.bytes_per_token(len(self.blocks), self.cache_spec.k_shape, self.cache_spec.v_shape,
                                       dtype or self.dtype, k_type, v_type)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        e = self.embed
        if tokens.numel() <= EMBED_KEEP_TOKENS and EmbedRows.serves(e, self.device):
            return self.embed_rows_kept().lookup(tokens)  # (a decode step's rows, dequantized once)
        rows = e.raw.index_select(0, tokens.to(e.raw.device))  # [N, row_bytes]: only the rows used
        return self.embed_rows(rows.to(self.device))  # (a table on the host: its rows cross, still quantized)

    def embed_rows_kept(self) -> EmbedRows:
        """The table's dequantized rows kept by token (strata.layers.embedding), made anew for a new table."""
        got = getattr(self, "_kept_rows", None)
        if got is None or got.table is not self.embed or got.dtype != self.dtype:
            got = self._kept_rows = EmbedRows(self.embed, self.dtype)
        return got

    def embed_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The input vectors [N, d] of embedding-table rows [N, row_bytes] in the table's stored format."""
        e = self.embed
        return dequantize(rows, e.qtype, (rows.shape[0], e.shape[-1])).to(dtype=self.dtype)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, segments: list[Segment], kv: KVCache,
                all_logits: bool = False, rows: list[int] | None = None,
                ctx: StepContext | None = None, embeds: torch.Tensor | None = None,
                hidden_out: list | None = None) -> torch.Tensor:
        """tokens, pos [N] -> logits [N, V] (all_logits), [len(rows), V] (rows: indices into the N tokens, e.g.
        every position of a speculative verify segment) or [len(segments), V] (each segment's last token).
        ctx: the step as its runner sees it (default: read from the segments). embeds: the tokens' input rows
        [N, d] already looked up (a captured step whose embedding table is on the host). hidden_out: a list that
        gets the last block's output for every token [N, d] (before the output norm: what an MTP block reads)."""
        if ctx is None:
            ctx = self.step_context(segments, int(tokens.shape[0]))
        if self._route_taps:
            taps, inner = list(self._route_taps), ctx.on_route

            def on_route(layer, ids):
                for fn in taps:
                    fn(layer, ids)
                if inner is not None:
                    inner(layer, ids)

            ctx.on_route = on_route
        prof = ctx.profiler
        if prof is not None:
            prof.begin(ctx)
        if self.experts is not None and ctx.live:
            self.experts.begin_step(ctx)
        t = prof.mark() if prof else None
        x = self.embed_tokens(tokens) if embeds is None else embeds
        if prof:
            prof.span("dense_other", t)
        # (CPU: each sequence's rows computed as its step alone computes them, strata.quant.matmul.row_groups)
        with row_groups([s.n for s in segments] if not x.is_cuda else ()):
            x = self.run_blocks(x, pos, segments, kv, ctx)
            if hidden_out is not None:
                hidden_out.append(x)
            t = prof.mark() if prof else None
            if rows is not None:
                x = x.index_select(0, torch.tensor(rows, device=x.device))
            elif not all_logits and any(seg.n != 1 for seg in segments):  # (all-decode: already one row each)
                last = torch.tensor(_last_indices(segments), device=x.device)
                x = x.index_select(0, last)
            logits = self.logits(x)
        if prof:
            prof.span("dense_other", t)
        return logits

    def run_blocks(self, x: torch.Tensor, pos: torch.Tensor, segments: list[Segment], kv: KVCache,
                   ctx: StepContext) -> torch.Tensor:
        """The blocks this process computes (a pipeline stage's range, else all) over hidden states x [N, d]."""
        own = self.stage_layers
        if ctx.profiler is not None:  # --profile times each block whole
            for i, blk in enumerate(self.blocks):
                if own is None or i in own:
                    x = blk(x, pos, segments, kv, ctx)
            return x
        delta = None  # the last block's output, added with the next block's norm (Block.step)
        for i, blk in enumerate(self.blocks):
            if own is None or i in own:
                x, delta = blk.step(x, delta, pos, segments, kv, ctx)
        return x if delta is None else x + delta

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The output norm and head over the last block's hidden states [R, d] -> float32 [R, V]."""
        return qmatmul(rms_norm(x, self.out_norm, self.args.norm_eps), self.head).float()


def _last_indices(segments: list[Segment]) -> list[int]:
    out, i = [], 0
    for s in segments:
        i += s.n
        out.append(i - 1)
    return out


def expert_weights(L: WeightLoader, i: int):
    """Layer i's stacked experts, left on the host in their stored format: the experts backend places them."""
    from strata.experts.resident import ExpertWeights

    cpu = torch.device("cpu")
    names = [f"blk.{i}.ffn_{p}_exps.weight" for p in ("gate", "up", "down")]
    fused = f"blk.{i}.ffn_gate_up_exps.weight"
    if not L.has(names[0]) and L.has(fused):
        # llama.cpp's converter with --fuse-gate-up-exps: [E, 2 ff, d], each expert's gate rows then its up rows.
        # Rows are whole blocks, so the halves are the two projections as stored (copied: the store, the slots and
        # the kernels address an expert as one contiguous stack)
        gu = L.q(fused, cpu)
        E, ff2 = gu.shape[0], gu.shape[1]
        if ff2 % 2:
            raise StrataError(f"{L.g.paths[0].name}: {fused} has {ff2} rows per expert, not gate + up halves")
        ff = ff2 // 2
        gate, up = (QTensor(gu.raw[:, a:a + ff].contiguous(), gu.qtype, (E, ff, *gu.shape[2:])) for a in (0, ff))
        return ExpertWeights(gate, up, L.q(names[2], cpu))
    if not L.has(names[0]) and L.has(f"blk.{i}.ffn_gate.0.weight"):
        raise StrataError(
            f"{L.g.paths[0].name}: experts stored one tensor per expert (an old GGUF layout); re-convert the model "
            "with a current converter (strata convert or llama.cpp's convert_hf_to_gguf.py)"
        )
    return ExpertWeights(*(L.q(n, cpu) for n in names))


def gqa_weights(L: WeightLoader, p: str) -> dict:
    """Layer weights of grouped-query attention under prefix `p` (`blk.N.`): projections, optional Q/K/V biases
    (Qwen2) and optional per-head Q/K norms (Qwen3)."""
    w = {n: L.q(p + n + ".weight") for n in ("attn_q", "attn_k", "attn_v", "attn_output")}
    for n in ("attn_q", "attn_k", "attn_v"):
        w[n + ".bias"] = L.f(p + n + ".bias", required=False)
    w["attn_q_norm"] = L.f(p + "attn_q_norm.weight", required=False)
    w["attn_k_norm"] = L.f(p + "attn_k_norm.weight", required=False)
    return w


def build_ffn(L: WeightLoader, args, i: int, routing, experts_out: dict):
    """Dense SwiGLU or MoE for layer i, by the standard GGUF names."""
    from strata.layers.ffn import SwiGLU
    from strata.layers.moe import MoE

    p = f"blk.{i}."
    if not args.is_moe_layer(i):
        return SwiGLU(L.q(p + "ffn_gate.weight"), L.q(p + "ffn_up.weight"), L.q(p + "ffn_down.weight"))
    experts_out[i] = expert_weights(L, i)
    shared = None
    if L.has(p + "ffn_gate_shexp.weight"):
        shared = SwiGLU(L.q(p + "ffn_gate_shexp.weight"), L.q(p + "ffn_up_shexp.weight"),
                        L.q(p + "ffn_down_shexp.weight"))
    return MoE(i, routing, L.q(p + "ffn_gate_inp.weight"), None,
               bias=L.f(p + "exp_probs_b.bias", required=False), shared=shared,
               shared_gate=L.q(p + "ffn_gate_inp_shexp.weight", required=False))


NEXTN_REQUIRED = ("nextn.eh_proj.weight", "nextn.enorm.weight", "nextn.hnorm.weight")


def split_nextn(g: GGUFModel, args) -> None:
    """`block_count` counts the MTP blocks after the trunk (`nextn_predict_layers` of them, llama.cpp's layout for
    glm4moe and deepseek2): args.n_layers keeps the trunk's, args.extra["nextn_layers"] the blocks'."""
    nextn = int(g.arch_get("nextn_predict_layers", 0) or 0)
    if not 0 <= nextn < args.n_layers:
        raise StrataError(f"{g.paths[0].name}: {g.arch}.nextn_predict_layers = {nextn} does not fit "
                          f"block_count = {args.n_layers}")
    args.n_layers -= nextn
    args.extra["nextn_layers"] = nextn


def nextn_layers(L: WeightLoader, args, layer_names: Callable[[int], list[str]]) -> list[NextNLayer]:
    """The MTP blocks after the trunk, every tensor of each (none dropped) left in host RAM, mapped from the file,
    for `--draft-source mtp`: the forward runs the trunk only. A block the file does not hold is skipped (llama.cpp
    can write the MTP blocks to a file of their own, or leave them out); one it holds in part is an error naming
    the missing tensor. layer_names(i): the block tensors block i needs besides NEXTN_REQUIRED."""
    import logging

    out = []
    cpu = torch.device("cpu")
    for i in range(args.n_layers, args.n_layers + args.extra.get("nextn_layers", 0)):
        p = f"blk.{i}."
        names = [n for n in L.g.tensors if n.startswith(p)]
        if not names:
            continue
        for n in layer_names(i) + [p + r for r in NEXTN_REQUIRED]:
            if not L.has(n):
                raise StrataError(f"{L.g.paths[0].name}: tensor {n} is missing (needed by the MTP block)")
        out.append(NextNLayer(i, {n[len(p):]: L.q(n, cpu) for n in sorted(names)}))
    log = logging.getLogger("strata")
    if args.extra.get("nextn_layers") and not out:
        log.info("strata: %s: no MTP block tensors in this file (nextn_predict_layers = %d): trunk only",
                 L.g.paths[0].name, args.extra["nextn_layers"])
    for b in out:
        log.info("strata: MTP block %d kept on the host (%.1f MiB, mapped from the file), not run by the forward",
                 b.layer, b.nbytes / 2**20)
    return out


def mtp_experts_tiered(cfg, nextn: list, experts: dict) -> None:
    """With tiered experts and drafts from the MTP block asked for, the block's experts join the trunk's backend
    (its pinned store and VRAM cache, one more layer under the same budget) instead of sitting whole on the device
    outside the budget: `experts` gains them, keyed by the block's GGUF index."""
    if not nextn or not cfg.experts.tiered() or not getattr(cfg, "draft_max", 0) \
            or getattr(cfg, "draft_source", "auto") == "ngram":
        return
    from strata.experts.resident import ExpertWeights

    for b in nextn[:1]:  # (the drafter runs the first block)
        experts[b.layer] = ExpertWeights(b["ffn_gate_exps.weight"], b["ffn_up_exps.weight"], b["ffn_down_exps.weight"])


def finish_model(L: WeightLoader, args, blocks, experts: dict, cache_spec: CacheSpec, dtype, make_experts,
                 lm_class: type | None = None):
    """Embeddings, final norm, head; attach the experts backend to every MoE block; check all tensors used.
    lm_class: a CausalLM subclass taking the same arguments (default CausalLM)."""
    if L.stage is not None:  # a pipeline stage: the embedding on the first, the head on the last (else mapped)
        first, last = 0 in L.stage, args.n_layers - 1 in L.stage
        tied = not L.has("output.weight")
        embed = L.q("token_embd.weight", None if first or (last and tied) else torch.device("cpu"))
        head = L.q("output.weight", None if last else torch.device("cpu"), required=False) or embed
    else:
        embed = L.q("token_embd.weight")
        head = L.q("output.weight", required=False) or embed
    out_norm = L.f("output_norm.weight")
    if L.stage is not None:  # a pipeline stage places and caches its own layers' experts only
        experts = {i: w for i, w in experts.items() if i in L.stage}
    backend = make_experts(experts) if experts else None
    for b in blocks:
        if isinstance(b.ffn, MoE):
            b.ffn.experts = backend
    if backend is not None:  # a backend may predict the next layer's routing with its router
        backend.set_routers({b.ffn.layer: b.ffn for b in blocks if isinstance(b.ffn, MoE) and L.owned(f"blk.{b.ffn.layer}.")})
    L.finish()
    return (lm_class or CausalLM)(args, embed, blocks, out_norm, head, cache_spec, L.device, dtype, experts=backend)
