"""GET /metrics: Prometheus text with vLLM's metric names plus `strata_*`, or JSON for humans and dashboards.

Counters are fed by the engine thread (admission, first token, each token, the end of a request); gauges are
read when scraped.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import GaugeMetricFamily, CounterMetricFamily

from strata.experts.stats import ExpertStats

disable_created_metrics()  # the *_created samples only add noise to every scrape

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class _StrataCollector:
    """strata_* gauges read at scrape time from the experts backend and the conversation cache."""

    def __init__(self, m: "Metrics"):
        self.m = m

    def collect(self):
        ex = self.m.expert_stats()
        g = GaugeMetricFamily
        yield g("strata_expert_hit_rate", "Share of routed experts found in the GPU expert cache",
                value=ex.get("hit_rate", 1.0))
        yield g("strata_cpu_experts_per_token", "Routed experts computed by the CPU per token",
                value=ex.get("cpu_per_token", 0.0))
        yield g("strata_pcie_experts_per_token", "Routed experts copied over PCIe per token",
                value=ex.get("pcie_per_token", 0.0))
        yield CounterMetricFamily("strata_expert_swaps", "Experts copied into the GPU cache",
                                  value=ex.get("swaps", 0))
        kw = self.m.kv_window_stats()
        if kw:  # (--kv-vram-tokens: the share of KV pages attention found in the VRAM window)
            yield g("strata_kv_window_hit_rate", "Share of KV pages attention read from the VRAM window",
                    value=kw["hit_rate"])
            yield CounterMetricFamily("strata_kv_window_miss_bytes", "KV bytes attention read from host RAM",
                                      value=kw["miss_bytes"])
        for lane, name in (("cpu", "the CPU lane computed from RAM"), ("pcie", "PCIe copied to the GPU")):
            yield CounterMetricFamily(f"strata_expert_{lane}_bytes", f"Expert bytes {name} (misses, all phases)",
                                      value=ex.get(f"{lane}_bytes", 0))
        lanes = self.m.lane_stats()
        for key, name in (("experts_cpu_gbps", "the CPU lane"), ("experts_pcie_gbps", "the PCIe lane"),
                          ("experts_miss_gbps", "both miss lanes together")):
            yield g(f"strata_{key}", f"GB/s {name} moved over the finished requests' decode time",
                    value=lanes[key])
        yield g("strata_expert_cache_vram_bytes", "VRAM held by the expert cache", value=ex.get("vram_bytes", 0))
        split = self.m.vram_split()
        if split is not None:
            parts = g("strata_vram_split_bytes", "How the VRAM budget was divided at start-up, by part", labels=["part"])
            for p in split.PARTS:
                parts.add_metric([p], getattr(split, p))
            yield parts
            yield g("strata_vram_budget_bytes", "The VRAM budget the expert cache was sized in", value=split.budget)
            yield g("strata_expert_cache_slots_per_layer", "Expert cache slots per MoE layer", value=split.slots)
        pc = self.m.prompt_cache_stats()
        yield g("strata_prompt_cache_bytes", "Host RAM held by the conversation cache", value=pc.get("bytes", 0))
        yield g("strata_prompt_cache_entries", "Conversations held in the conversation cache",
                value=pc.get("entries", 0))
        yield g("strata_tokens_per_second", "Generated tokens per second over the last 5 seconds",
                value=self.m.tok_per_s())


class Metrics:
    def __init__(self, model_name: str):
        self.model_name = model_name
        self.worker = None  # set once the engine is up
        self.reg = reg = CollectorRegistry()
        L, M = ["model_name"], [model_name]
        self._running = Gauge("vllm:num_requests_running", "Requests in the engine (reading or generating)", L,
                              registry=reg)
        self._waiting = Gauge("vllm:num_requests_waiting", "Requests waiting for a slot", L, registry=reg)
        self._running.labels(*M).set_function(lambda: self.worker.n_running if self.worker else 0)
        self._waiting.labels(*M).set_function(lambda: self.worker.n_waiting if self.worker else 0)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed", L, registry=reg).labels(*M)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated", L, registry=reg).labels(*M)
        self._success = Counter("vllm:request_success", "Finished requests", L + ["finished_reason"], registry=reg)
        self.cache_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", L,
                                     registry=reg).labels(*M)
        self.cache_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache", L,
                                  registry=reg).labels(*M)
        self.spec_drafts = Counter("vllm:spec_decode_num_drafts", "Speculative drafts", L, registry=reg).labels(*M)
        self.spec_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed", L,
                                         registry=reg).labels(*M)
        self.spec_accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted", L,
                                     registry=reg).labels(*M)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", L, buckets=TTFT_BUCKETS,
                              registry=reg).labels(*M)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between tokens", L, buckets=ITL_BUCKETS,
                             registry=reg).labels(*M)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency", L, buckets=E2E_BUCKETS,
                             registry=reg).labels(*M)
        self.queue_time = Histogram("vllm:request_queue_time_seconds", "Time waiting for a slot", L,
                                    buckets=E2E_BUCKETS, registry=reg).labels(*M)
        reg.register(_StrataCollector(self))
        self.recent = deque(maxlen=256)  # the last finished requests
        self._tok_times = deque(maxlen=4096)
        self._lock = threading.Lock()
        self.totals = {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "generated_tokens": 0, "errors": 0,
                       "aborted": 0}
        self.started = time.time()
        self.settings: dict = {}
        self.prompt_cache = None
        # the miss lanes' bytes while requests decoded, and their decode seconds (requests in flight together
        # count their shared steps each: the ratio is a decode-time-weighted mean of the requests' GB/s)
        self.lanes = {"decode_s": 0.0, "cpu_bytes": 0, "pcie_bytes": 0}

    # -- fed by the engine thread --------------------------------------------------------------------------------
    def admitted(self, req) -> None:
        seq = req.seq
        self.cache_queries.inc(len(seq.prompt))
        self.cache_hits.inc(seq.cached)
        self.queue_time.observe(req.t_admit - req.t_submit)

    def first_token(self, req, ttft: float) -> None:
        self.ttft.observe(ttft)
        self._tok_times.append(time.perf_counter())

    def inter_token(self, dt: float) -> None:
        self.itl.observe(dt)
        self._tok_times.append(time.perf_counter())

    def finished(self, req) -> None:
        seq = req.seq
        reason = req.finish_reason or "stop"
        first = getattr(req.job, "choice", 0) == 0  # a request of n choices is one request, its prompt one prompt
        if first:
            self._success.labels(self.model_name, reason).inc()
            self.e2e.observe(req.t_end - req.t_submit)
        n_prompt = len(req.job.prompt)
        cached = seq.cached if seq is not None else 0
        if seq is not None and first:
            self.prompt_tokens.inc(n_prompt)
        self.generation_tokens.inc(req.n_out)
        ex = seq.experts_decode if seq is not None else None
        if seq is not None and seq.draft_n:
            self.spec_drafts.inc(seq.draft_steps)
            self.spec_draft_tokens.inc(seq.draft_n)
            self.spec_accepted.inc(seq.draft_accepted)
        with self._lock:
            t = self.totals
            t["requests"] += first
            t["prompt_tokens"] += n_prompt if seq is not None and first else 0
            t["cached_tokens"] += cached if first else 0
            t["generated_tokens"] += req.n_out
            t["errors"] += reason == "error"
            t["aborted"] += reason == "abort"
            if ex is not None:
                self.lanes["decode_s"] += seq.predicted_ms / 1e3
                self.lanes["cpu_bytes"] += ex.cpu_bytes
                self.lanes["pcie_bytes"] += ex.pcie_bytes
            self.recent.append({
                "id": req.id, "kind": req.job.kind, "finish_reason": reason, "prompt_tokens": n_prompt,
                "cached_tokens": cached, "completion_tokens": req.n_out,
                "queued_ms": round(((req.t_admit or req.t_end) - req.t_submit) * 1e3, 3),
                "ttft_ms": round((req.t_first - req.t_submit) * 1e3, 3) if req.t_first else None,
                "total_ms": round((req.t_end - req.t_submit) * 1e3, 3),
                "prompt_ms": round(seq.prompt_ms, 3) if seq else None,
                "predicted_ms": round(seq.predicted_ms, 3) if seq else None,
                "admit_step": req.admit_step, "cancel_step": req.cancel_step, "end_time": time.time(),
                **(seq.lane_gbps if seq is not None else {}),
            })

    # -- read when scraped ---------------------------------------------------------------------------------------
    def tok_per_s(self, window: float = 5.0) -> float:
        now = time.perf_counter()
        n = sum(1 for t in list(self._tok_times) if now - t <= window)
        return n / window

    def expert_stats(self) -> dict:
        w = self.worker
        experts = getattr(getattr(w.engine, "model", None), "experts", None) if w else None
        out: dict = {}
        st = getattr(experts, "stats", None)
        if st is not None:
            # raw counts plus the derived rates (properties on ExpertStats)
            out.update(st.as_dict() if hasattr(st, "as_dict") else {})
            out["swaps"] = int(getattr(st, "swaps", 0))
        prof = getattr(experts, "profile", None)
        if getattr(experts, "profiling", False) and hasattr(prof, "as_dict"):
            out["profile"] = prof.as_dict()
        vb = getattr(experts, "vram_bytes", None)
        if vb is not None:
            out["vram_bytes"] = int(vb() if callable(vb) else vb)
        return out

    def kv_window_stats(self) -> dict:
        """The KV window's page hits and misses (strata.kv.window.WindowStats); empty without a window."""
        w = self.worker
        st = getattr(getattr(w, "engine", None), "kv_window_stats", None) if w else None
        return st.as_dict() if st is not None else {}

    def lane_stats(self) -> dict:
        """The miss lanes over the finished requests' decode: seconds, bytes and GB/s (ExpertStats.lane_gbps)."""
        with self._lock:
            la = dict(self.lanes)
        st = ExpertStats(cpu_bytes=la["cpu_bytes"], pcie_bytes=la["pcie_bytes"])
        return {**la, **st.lane_gbps(la["decode_s"])}

    def vram_split(self):
        """The engine's VramSplit (strata.experts.sizing), None before the engine is up or without a budget."""
        w = self.worker
        return w.engine.vram_split if w is not None else None

    def prompt_cache_stats(self) -> dict:
        return self.prompt_cache.stats() if self.prompt_cache is not None else {}

    def prometheus(self) -> bytes:
        return generate_latest(self.reg)

    def as_json(self) -> dict:
        w = self.worker
        with self._lock:
            totals = dict(self.totals)
            recent = list(self.recent)
        return {
            "model": self.model_name,
            "settings": self.settings,
            "state": {
                "status": w.state if w else "loading", "running": w.n_running if w else 0,
                "waiting": w.n_waiting if w else 0, "tokens_per_second": self.tok_per_s(),
                "steps": w.steps if w else 0, "last_step_ms": w.last_step_ms if w else 0.0,
                "slots": w.slots() if w else [],
            },
            "experts": {**self.expert_stats(), "decode_lanes": self.lane_stats()},
            "kv_window": self.kv_window_stats() or None,
            "prompt_cache": self.prompt_cache_stats(),
            "totals": totals,
            "recent_requests": recent,
            "uptime_s": time.time() - self.started,
            "machine": machine(),
        }


def machine() -> dict:
    """CPU and RAM (psutil) and, where NVML answers, each GPU's utilisation, VRAM, temperature, power, PCIe link."""
    out: dict = {}
    try:
        import psutil

        vm = psutil.virtual_memory()
        out["cpu"] = {"percent": psutil.cpu_percent(interval=None), "count": psutil.cpu_count()}
        out["ram"] = {"total_bytes": vm.total, "used_bytes": vm.total - vm.available, "percent": vm.percent}
        out["process_rss_bytes"] = psutil.Process().memory_info().rss
    except Exception:  # noqa: BLE001 - statistics never fail a request
        pass
    out["gpus"] = _nvml()
    return out


def _nvml() -> list[dict]:
    try:
        import pynvml as nv

        nv.nvmlInit()
    except Exception:  # noqa: BLE001 - no NVIDIA driver: no GPU section
        return []
    gpus = []
    try:
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            g: dict = {"index": i, "name": _s(nv.nvmlDeviceGetName(h))}
            for key, fn in (
                ("util_percent", lambda: nv.nvmlDeviceGetUtilizationRates(h).gpu),
                ("vram_used_bytes", lambda: nv.nvmlDeviceGetMemoryInfo(h).used),
                ("vram_total_bytes", lambda: nv.nvmlDeviceGetMemoryInfo(h).total),
                ("temperature_c", lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
                ("power_w", lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000.0),
                ("pcie_gen", lambda: nv.nvmlDeviceGetCurrPcieLinkGeneration(h)),
                ("pcie_width", lambda: nv.nvmlDeviceGetCurrPcieLinkWidth(h)),
            ):
                try:
                    g[key] = fn()
                except Exception:  # noqa: BLE001 - not every board reports every field
                    g[key] = None
            gpus.append(g)
    finally:
        try:
            nv.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass
    return gpus


def _s(x) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)
