"""Pipeline parallel: the model's layers split over processes ("stages") through torch.distributed.

`--pipeline-parallel-size N` (vLLM's name) runs N processes, one per stage; stage r computes a contiguous range of
the layers (`--layer-split auto`: as equal as the count allows; `K1,K2,...`: that many layers each) with its own
weights, KV cache (its layers' rows only), recurrent state and experts backend (its own VRAM budget, expert cache,
CPU lane and pinned host memory for its layers). Weights of other stages' layers are never copied anywhere: they
stay mapped in the GGUF file, untouched. Between stages only the hidden states of the step's tokens cross ([N,
d_model] in the compute dtype; hybrid layers' state stays where it is); the last stage sends the logits back.

Rank 0 is the driver: it runs the engine (scheduling, sampling, the server) and stands in for the model
(`PipelineModel.forward`). Each step it sends the step's header (positions, segments, which rows to score) down
the pipeline, embeds the tokens, runs its layers and sends the hidden states on; every other rank waits in `serve`
for headers, passes each on, receives, runs its layers and sends on. A step of several sequences is cut into
micro-batches (up to one per stage), sent without waiting, so that every stage works on one of them at once.
Transport: torch.distributed's point-to-point sends, gloo on CPUs and NCCL between GPUs (nothing home-made).

Launch: on one machine the driver starts the other stages itself (`LocalPipeline`: spawned processes, a rendezvous
on a free loopback port). Across machines, torchrun starts one process per stage with its environment (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT; `--nnodes`, `--rdzv-endpoint`): `stage_from_env` finds it, rank 0 runs the
command and the others serve. A stage that fails or dies is reported by the collectives' timeout or the closed
connection on the other ranks (an error, never a hang past `TIMEOUT_S`).

Not yet through the pipeline: CUDA graphs (steps run eagerly), speculative drafts (refused with one line) and the
conversation cache's saved rows (the server turns it off, saying so).
"""

from __future__ import annotations

import datetime
import logging
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from strata import StrataError
from strata.engine.layer_split import layer_split  # noqa: F401 - (torch-free: strata check uses it too)
from strata.kv.cache import Segment

log = logging.getLogger("strata")

TIMEOUT_S = 600  # a collective waiting longer than this fails (a dead or stuck stage), instead of hanging


@dataclass
class Stage:
    rank: int
    size: int
    layers: range

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1


def stage_from_env() -> tuple[int, int] | None:
    """(rank, world size) when torchrun (or another launcher) started this process as one of several, else None."""
    from strata.config import launcher_ranks

    got = launcher_ranks()
    return None if got is None else got[:2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init(rank: int, size: int, device: torch.device, init_method: str) -> None:
    """Join the process group: NCCL between GPUs, gloo on CPUs."""
    if dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))


def stage_device(cfg, rank: int) -> str:
    """A stage's device: on CUDA the rank's GPU on its machine (LOCAL_RANK under torchrun), else the CPU."""
    from strata.config import launcher_ranks

    if not cfg.device.startswith("cuda"):
        return cfg.device
    got = launcher_ranks()
    local = got[2] if got is not None else rank
    return f"cuda:{local % max(1, torch.cuda.device_count())}"


def load_stage(path: str, cfg, rank: int, size: int, with_tokenizer: bool = True):
    """Load this stage's part of the model (its layers' weights, its experts) as a LoadedModel whose model is, on
    rank 0, the pipeline's stand-in (PipelineModel)."""
    import dataclasses

    from strata.engine.loader import load_model
    from strata.gguf.reader import open_gguf
    from strata.models.base import STAGE_LAYERS
    from strata.models.registry import family_for

    g = open_gguf(path)
    n_layers = family_for(g.arch).load_args(g).n_layers
    stage = Stage(rank, size, layer_split(n_layers, size, cfg.layer_split)[rank])
    cfg = dataclasses.replace(cfg, device=stage_device(cfg, rank), cuda_graphs=False)
    token = STAGE_LAYERS.set(frozenset(stage.layers))
    try:
        lm = load_model(path, cfg, with_tokenizer=with_tokenizer)
    finally:
        STAGE_LAYERS.reset(token)
    log.info("strata: pipeline stage %d of %d: layers %d-%d on %s", rank, size, stage.layers.start,
             stage.layers.stop - 1, cfg.device)
    lm.model = PipelineModel(lm.model, stage)
    return lm


def _rows(h: dict) -> int:
    if h["rows"] is not None:
        return len(h["rows"])
    if h["all"]:
        return len(h["pos"])
    return len(h["segs"])


def _stage_forward(model, stage: Stage, h: dict, kv, x: torch.Tensor | None, tokens: torch.Tensor | None,
                   ctx=None) -> torch.Tensor:
    """This stage's part of a step: embed (first), its layers, the chosen rows' logits (last)."""
    dev = model.device
    pos = torch.tensor(h["pos"], device=dev)
    segs = [Segment(*s) for s in h["segs"]]
    if ctx is None:
        ctx = model.step_context(segs, len(h["pos"]), phase=h["phase"] or "decode")
    if model.experts is not None and ctx.live:
        model.experts.begin_step(ctx)
    if stage.first:
        x = model.embed_tokens(tokens)
    x = model.run_blocks(x, pos, segs, kv, ctx)
    if not stage.last:
        return x
    if h["rows"] is not None:
        x = x.index_select(0, torch.tensor(h["rows"], device=dev))
    elif not h["all"] and any(s[2] != 1 for s in h["segs"]):
        ends, at = [], 0
        for s in h["segs"]:
            at += s[2]
            ends.append(at - 1)
        x = x.index_select(0, torch.tensor(ends, device=dev))
    return model.logits(x)


def _send(t: torch.Tensor, dst: int) -> None:
    dist.send(t.contiguous(), dst)


def _recv(shape, dtype, device, src: int) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(t, src)
    return t


def _send_header(h: dict, dst: int, device: torch.device, pending: list | None = None) -> None:
    """A step's header to the next stage: its length, then its pickled bytes (p2p, so that a stage can be sent the
    next micro-batch while it still computes the last: a collective would wait for every rank). pending: post
    the sends without waiting (their handles and buffers kept there)."""
    import pickle

    data = torch.frombuffer(bytearray(pickle.dumps(h)), dtype=torch.uint8).to(device)
    n = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    if pending is None:
        dist.send(n, dst)
        dist.send(data, dst)
    else:
        pending += [(dist.isend(n, dst), n), (dist.isend(data, dst), data)]


def _recv_header(src: int, device: torch.device) -> dict:
    import pickle

    n = _recv((1,), torch.int64, device, src)
    data = _recv((int(n.item()),), torch.uint8, device, src)
    return pickle.loads(data.cpu().numpy().tobytes())


def micro_batches(segments: list[Segment], parts: int) -> list[tuple[int, int]]:
    """The step's segments cut into at most `parts` runs of consecutive segments with about equal token counts:
    (first segment, end) pairs. A stage computes one run while the next stage computes the run before."""
    n = len(segments)
    parts = max(1, min(parts, n))
    total = sum(s.n for s in segments)
    out, first, acc = [], 0, 0
    for i, s in enumerate(segments):
        acc += s.n
        left = parts - len(out) - 1  # runs still to start after this one
        if left and acc >= total * (len(out) + 1) / parts and n - i - 1 >= left:
            out.append((first, i + 1))
            first = i + 1
    out.append((first, n))
    return out


class PipelineModel:
    """The model as rank 0's engine sees it: forward() runs the whole pipeline; everything else is this stage's
    model (its device, experts backend, KV cache of its layers, step contexts)."""

    def __init__(self, model, stage: Stage):
        self.inner, self.stage = model, stage
        self.d_model = model.args.d_model
        self.vocab = model.head.shape[0]
        self.kv = None  # this stage's cache, known once the engine made it (kv ops go to every stage)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def new_kv_cache(self, *a, **kw):
        self.kv = self.inner.new_kv_cache(*a, **kw)
        return self.kv

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, segments: list[Segment], kv, all_logits: bool = False,
                rows: list[int] | None = None, ctx=None, embeds=None, hidden_out=None) -> torch.Tensor:
        """The step through every stage. Several sequences are cut into micro-batches (one per stage at most):
        while stage 1 computes the first, stage 0 computes the second, and so on down the pipeline; each
        micro-batch's logits come back in order and are joined as one forward's would be."""
        if embeds is not None or hidden_out is not None:
            raise StrataError("pipeline parallel: input rows given by the caller and hidden-state outputs (MTP "
                              "drafts) are not supported across stages")
        st, dev = self.stage, self.inner.device
        if st.size == 1:
            h = self._header(pos.tolist(), segments, rows, all_logits, ctx)
            return _stage_forward(self.inner, st, h, kv, None, tokens, ctx)
        runs = micro_batches(segments, st.size) if rows is None else [(0, len(segments))]
        starts, at = [], 0
        for seg in segments:
            starts.append(at)
            at += seg.n
        starts.append(at)
        pending: list = []  # sends in flight (handles and their buffers)
        headers = []
        for a, b in runs:
            lo, hi = starts[a], starts[b]
            h = self._header(pos[lo:hi].tolist(), segments[a:b], rows, all_logits, ctx if len(runs) == 1 else None)
            headers.append(h)
            _send_header(h, 1, dev, pending)
            out = _stage_forward(self.inner, st, h, kv, None, tokens[lo:hi], ctx if len(runs) == 1 else None)
            out = out.to(self.inner.dtype).contiguous()
            pending.append((dist.isend(out, 1), out))
        logits = [_recv((_rows(h), self.vocab), torch.float32, dev, st.size - 1) for h in headers]
        for work, _ in pending:
            work.wait()
        return logits[0] if len(logits) == 1 else torch.cat(logits)

    @staticmethod
    def _header(pos: list[int], segments, rows, all_logits: bool, ctx) -> dict:
        return {"op": "forward", "pos": pos, "segs": [(s.slot, s.start, s.n) for s in segments], "rows": rows,
                "all": all_logits, "phase": ctx.phase if ctx is not None else None}

    def kv_op(self, name: str, *args) -> None:
        """A KV cache operation (swap_slots, copy_prefix) on every stage's cache."""
        if self.stage.size > 1:
            _send_header({"op": "kv", "name": name, "args": list(args)}, 1, self.inner.device)
        getattr(self.kv, name)(*args)

    def shutdown(self) -> None:
        """Tell the other stages to leave `serve` (rank 0, once)."""
        if self.stage.size > 1 and dist.is_initialized():
            try:
                _send_header({"op": "stop"}, 1, self.inner.device)
            finally:
                dist.destroy_process_group()


def serve(lm, n_slots: int) -> None:
    """A stage other than rank 0: hold its layers' KV cache and answer what comes down the pipeline (each header
    passed on to the next stage first) until the driver says stop."""
    from strata.engine.engine import Engine

    pm: PipelineModel = lm.model
    model, st = pm.inner, pm.stage
    dev = model.device
    # the engine's own set-up of a model: this stage's KV cache, then its expert cache sized from what the budget
    # leaves beside it and a prefill chunk's activations, as on the driver (it schedules nothing here)
    kv = Engine(lm, n_slots=n_slots).kv
    with torch.inference_mode():
        while True:
            h = _recv_header(st.rank - 1, dev)
            if not st.last:
                _send_header(h, st.rank + 1, dev)
            if h["op"] == "stop":
                break
            if h["op"] == "kv":
                getattr(kv, h["name"])(*h["args"])
                continue
            x = _recv((len(h["pos"]), pm.d_model), model.dtype, dev, st.rank - 1)
            out = _stage_forward(model, st, h, kv, x, None)
            _send(out if st.last else out.to(model.dtype), 0 if st.last else st.rank + 1)
    dist.destroy_process_group()


def _stage_main(path: str, cfg, rank: int, size: int, init_method: str, n_slots: int, threads: int) -> None:
    """A spawned stage process (LocalPipeline), computing with the driver's intra-op thread count (so a CPU
    stage sums in the same order as one process would)."""
    lm = None
    try:
        import strata  # noqa: F401 - the OpenMP environment before torch's threads start

        torch.set_num_threads(threads)
        dev = torch.device(stage_device(cfg, rank))
        init(rank, size, dev, init_method)
        lm = load_stage(path, cfg, rank, size, with_tokenizer=False)
        serve(lm, n_slots)
    except Exception as e:  # reported here; the driver's next collective fails on the closed connection
        log.error("strata: pipeline stage %d failed: %s: %s", rank, type(e).__name__, e)
        raise


class LocalPipeline:
    """The stages of a pipeline on this machine: rank 0 is this process, the others spawned processes."""

    def __init__(self, path: str, cfg, n_slots: int):
        import torch.multiprocessing as mp

        size = cfg.pipeline_parallel_size
        if cfg.device.startswith("cuda") and torch.cuda.device_count() < size:
            raise StrataError(f"--pipeline-parallel-size {size} on CUDA needs {size} GPUs on this machine (one a "
                              f"stage), found {torch.cuda.device_count()}; across machines, start the stages "
                              "with torchrun")
        from strata.gguf.reader import open_gguf
        from strata.models.registry import family_for

        g = open_gguf(path)  # a split the model cannot take (more stages than layers) fails before a process starts
        layer_split(family_for(g.arch).load_args(g).n_layers, size, cfg.layer_split)
        self.init_method = f"tcp://127.0.0.1:{free_port()}"
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=_stage_main, args=(path, cfg, r, size, self.init_method, n_slots,
                                                            torch.get_num_threads()), daemon=True)
                      for r in range(1, size)]
        for p in self.procs:
            p.start()
        init(0, size, torch.device(stage_device(cfg, 0)), self.init_method)
        self.lm = load_stage(path, cfg, 0, size)

    def close(self) -> None:
        try:
            self.lm.model.shutdown()
        finally:
            for p in self.procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()


def open_pipeline(path: str, cfg):
    """The model for a command run as a pipeline: under torchrun (WORLD_SIZE > 1) this process's stage (rank 0
    returns the LoadedModel; the others serve the driver and exit when it stops), else `--pipeline-parallel-size`
    local processes. None when neither asks for a pipeline. The driver stops the stages when it exits."""
    import atexit
    import dataclasses
    import sys

    env_stage = stage_from_env()
    if env_stage is None and cfg.pipeline_parallel_size <= 1:
        return None
    if env_stage is not None:
        rank, size = env_stage
        cfg = dataclasses.replace(cfg, pipeline_parallel_size=size)
        init(rank, size, torch.device(stage_device(cfg, rank)), "env://")
        lm = load_stage(path, cfg, rank, size, with_tokenizer=rank == 0)
        if rank > 0:
            serve(lm, cfg.n_slots)
            sys.exit(0)
        atexit.register(lm.model.shutdown)
        _say_split(lm, cfg)
        return lm
    pipe = LocalPipeline(path, cfg, cfg.n_slots)
    atexit.register(pipe.close)
    _say_split(pipe.lm, cfg)
    return pipe.lm


def _say_split(lm, cfg) -> None:
    import sys

    splits = layer_split(lm.args.n_layers, cfg.pipeline_parallel_size, cfg.layer_split)
    parts = ", ".join(f"stage {r}: layers {s.start}-{s.stop - 1} on {stage_device(cfg, r)}" for r, s in enumerate(splits))
    print(f"strata: pipeline of {len(splits)} stages ({parts}); hidden states of "
          f"{lm.args.d_model * torch.empty(0, dtype=lm.model.dtype).element_size()} bytes a token cross each "
          "boundary", file=sys.stderr)
