"""The bridge between the async server and the synchronous engine.

One thread owns the Engine and is the only one that touches it. Requests wait in a first-in first-out queue;
between steps the thread drops cancelled requests (a client that went away, a stop string that matched),
admits waiting requests into free slots in arrival order, then runs one `engine.step()` (one prefill chunk plus
one decode token of every running sequence) and hands each new token to its request's asyncio queue.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from strata.engine.engine import Engine, Sequence
from strata.server.job import Job
from strata.server.prompt_cache import PromptCache

log = logging.getLogger("strata.server")


@dataclass
class Ticket:
    """A submitted job's runtime state: its event queue, its sequence once admitted, cancellation and timings.
    It refers to the job instead of copying its fields, so a new request field never passes through here."""

    job: Job
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    id: int = 0
    seq: Sequence | None = None
    cancelled: str | None = None  # the reason, once cancelled
    t_submit: float = field(default_factory=time.perf_counter)
    t_admit: float = 0.0
    t_first: float = 0.0
    t_last: float = 0.0
    t_end: float = 0.0
    admit_step: int = -1
    cancel_step: int = -1
    n_out: int = 0
    finish_reason: str | None = None

    def _emit(self, ev) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, ev)


class EngineWorker:
    """Owns the engine on one thread. `submit` / `cancel` may be called from any thread."""

    def __init__(self, engine: Engine, prompt_cache: PromptCache | None = None, metrics=None,
                 fault_after_tokens: int | None = None):
        self.engine = engine
        self.fault_after_tokens = fault_after_tokens  # tests only (strata.config.fault_after_tokens_for_tests)
        self.cache = prompt_cache
        self.metrics = metrics
        self.waiting: deque[Ticket] = deque()
        self.active: dict[int, Ticket] = {}  # seq id -> request (engine thread only)
        self.steps = 0
        self.tokens_out = 0
        self._cv = threading.Condition()
        self._stop = False
        self._ids = 0
        self.state = "idle"  # idle | reading | generating
        # the sequence being placed in a slot, and that slot once chosen (-1 before): out of the queue, not yet
        # running, while the conversation cache saves the slot's old KV and restores the request's prefix into it
        # (on a large model a copy of gigabytes). /slots, /health and /metrics count it as processing, as
        # llama-server counts a slot from the moment it takes a task
        self.placing: tuple[int, Sequence] | None = None
        # each slot's last finished sequence: an idle slot shows its task as llama-server's /slots does (task_prev)
        self.prev: dict[int, Sequence] = {}
        self.last_step_ms = 0.0
        # why the engine can serve no more (a pipeline stage died: its collectives are out of step), None: fine
        self.broken: str | None = None
        # set when the server shuts down: every request ends with this error (streams end cleanly, not cut)
        self.closing: str | None = None
        self._thread = threading.Thread(target=self._run, name="strata-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=10)

    # -- called from the server ----------------------------------------------------------------------------------
    def submit(self, job: Job) -> Ticket:
        """Queue `job` (from a coroutine: events go to the running loop); its ticket carries the events."""
        if self.broken:
            from strata.server.protocol import APIError

            raise APIError(503, self.broken)
        req = Ticket(job, asyncio.get_running_loop())
        if self.closing:
            req._emit(("error", self.closing, 503))
            return req
        with self._cv:
            self._ids += 1
            req.id = self._ids
            req.t_submit = time.perf_counter()
            self.waiting.append(req)
            self._cv.notify_all()
        return req

    def cancel(self, req: Ticket, reason: str = "abort") -> None:
        with self._cv:
            if req.cancelled is None and req.finish_reason is None:
                req.cancelled = reason
                req.cancel_step = self.steps
                self._cv.notify_all()

    def close(self, message: str) -> None:
        """End every request, waiting or running, with an error event (`message`, a 503), and any submitted from
        now on: a server shutting down answers its open streams instead of cutting them."""
        with self._cv:
            self.closing = message
            self._cv.notify_all()

    @property
    def n_waiting(self) -> int:
        return len(self.waiting)

    def _unplaced(self) -> int:
        """1 while a sequence is being placed and is not yet among the running (it will take a free slot)."""
        placing = self.placing
        return int(placing is not None and not any(s is placing[1] for s in list(self.engine.running)))

    @property
    def n_running(self) -> int:
        return len(self.engine.running) + self._unplaced()

    @property
    def n_idle(self) -> int:
        return max(0, len(self.engine.free_slots) - self._unplaced())

    # -- the engine thread ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self.waiting and not self.engine.running:
                    self.state = "idle"
                    self._cv.wait()
                if self._stop:
                    break
                if self.closing:
                    for r in [*self.waiting, *self.active.values()]:
                        if r.cancelled is None:
                            r.cancelled, r.cancel_step = "shutdown", self.steps
                dropped = [r for r in self.waiting if r.cancelled]
                if dropped:
                    self.waiting = deque(r for r in self.waiting if not r.cancelled)
            for req in dropped:
                self._finish(req, req.cancelled)
            self._drop_cancelled()
            while self.engine.free_slots:
                with self._cv:
                    if not self.waiting:
                        break
                    req = self.waiting.popleft()
                if req.cancelled:
                    self._finish(req, req.cancelled)
                    continue
                self._admit(req)
            if not self.engine.running:
                continue
            self.state = "reading" if any(not s.prompt_done for s in self.engine.running) else "generating"
            t0 = time.perf_counter()
            try:
                if self.fault_after_tokens is not None:
                    self._injected_fault()
                out = self.engine.step()
            except Exception as e:  # a failing step fails its requests, never the server
                log.exception("engine step failed")
                if getattr(self.engine.model, "stage", None) is not None:  # a pipeline cannot resume mid-step
                    self.broken = f"a pipeline stage failed ({type(e).__name__}: {e}); restart the server"
                for seq in list(self.engine.running):
                    self.engine.release(seq, "error")
                    req = self.active.pop(seq.id, None)
                    if req is not None:
                        req._emit(("error", f"engine failure: {type(e).__name__}: {e}"))
                        self._finish(req, "error", emit=False)
                continue
            for seq in self.engine.take_failed():  # its own work failed (a grammar, say): only it ends
                self.engine.release(seq, "error")
                req = self.active.pop(seq.id, None)
                if req is not None:
                    req._emit(("error", f"generation failed: {seq.error}"))
                    self._finish(req, "error", emit=False)
            now = time.perf_counter()
            self.last_step_ms = (now - t0) * 1e3
            self.steps += 1
            last = {seq.id: i for i, (seq, _) in enumerate(out)}  # a verify step gives a sequence several tokens
            for i, (seq, tok) in enumerate(out):
                req = self.active.get(seq.id)
                if req is None:
                    continue
                if not req.t_first:
                    req.t_first = now
                    if self.metrics:
                        self.metrics.first_token(req, now - req.t_submit)
                elif self.metrics:
                    self.metrics.inter_token(now - req.t_last)
                req.t_last = now
                req.n_out += 1
                self.tokens_out += 1
                req._emit(("token", tok))
                if seq.finished and last[seq.id] == i:
                    self.active.pop(seq.id, None)
                    self._finish(req, seq.finish_reason or "stop")

    def _injected_fault(self) -> None:
        k = self.fault_after_tokens
        if any(len(s.output) == k for s in self.engine.running):
            raise RuntimeError(f"injected fault: a sequence reached {k} tokens (STRATA_TEST_FAULT_AFTER_TOKENS)")

    def _drop_cancelled(self) -> None:
        for sid, req in list(self.active.items()):
            if req.cancelled:
                self.engine.release(req.seq, req.cancelled)
                del self.active[sid]
                self._finish(req, req.cancelled)

    def _admit(self, req: Ticket) -> None:
        e = self.engine
        job = req.job
        seq = Sequence.of(job)
        self.placing = (-1, seq)
        try:
            if job.make_processor is not None:
                seq.logits_processor = job.make_processor(seq)
            if self.cache is not None:
                claim = lambda slot: setattr(self, "placing", (slot, seq))  # noqa: E731
                self.cache.prepare(e, seq.prompt if job.cache_prompt else [], claim)
            e.add(seq, reuse_prefix=job.cache_prompt)
        except Exception as ex:  # noqa: BLE001 - reported to the client
            req._emit(("error", str(ex)))
            self._finish(req, "error", emit=False)
            return
        finally:
            self.placing = None
        req.seq = seq
        req.t_admit = time.perf_counter()
        req.admit_step = self.steps
        self.active[seq.id] = req
        if self.metrics:
            self.metrics.admitted(req)
        req._emit(("start", seq))

    def _finish(self, req: Ticket, reason: str, emit: bool = True) -> None:
        req.finish_reason = reason
        req.t_end = time.perf_counter()
        seq = getattr(req, "seq", None)
        if seq is not None and getattr(seq, "slot", -1) >= 0:
            self.prev[seq.slot] = seq
        if self.metrics:
            self.metrics.finished(req)
        if emit:
            req._emit(("error", self.closing, 503) if reason == "shutdown" else ("done", reason))

    # -- introspection (any thread; a snapshot, good enough for /slots and /metrics) ------------------------------
    def slots(self) -> list[dict]:
        e = self.engine
        by_slot = {s.slot: s for s in list(e.running)}
        placing = self.placing
        if placing is not None and placing[0] >= 0:
            by_slot.setdefault(placing[0], placing[1])
        out = []
        for i in range(e.n_slots):
            s = by_slot.get(i)
            held = len(e.slot_tokens.get(i, ()))  # tokens in the slot's KV
            # n_cached: an idle slot's, what it holds (a next prompt reuses its prefix); a request's, the prompt tokens
            # it reused (it was the KV's length: the prompt read so far plus the tokens decoded, over the prompt's
            # size while generating). A sequence being placed has nothing in the slot yet
            placed = s is not None and s.slot == i
            cached = (s.cached if placed else 0) if s is not None else held
            past = held if s is None or placed else 0
            read = max(0, min(s.pos, len(s.prompt)) - s.cached) if placed else 0
            # an idle slot's task figures are its last request's (-1 / 0 before its first), as llama-server's are
            t = s if s is not None else self.prev.get(i)
            n_out = len(t.output) if t else 0
            if s is None and t is not None:
                read = max(0, len(t.prompt) - t.cached)
            out.append({
                "id": i, "id_task": t.id if t else -1, "n_ctx": e.max_ctx, "is_processing": s is not None,
                "n_prompt_tokens": len(t.prompt) if t else 0, "n_cached": cached, "n_decoded": n_out,
                "state": ("reading" if not s.prompt_done else "generating") if s else "idle",
                # llama-server's names: the KV's length, the prompt tokens read and those reused, the tokens left
                "n_past": past, "n_prompt_tokens_processed": read, "n_prompt_tokens_cache": cached if s else (t.cached if t else 0),
                "next_token": [{"has_next_token": s is not None,
                                "n_remain": max(0, t.max_tokens - n_out) if t else -1, "n_decoded": n_out}],
            })
        return out
