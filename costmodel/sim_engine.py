"""Discrete-event simulator of continuous-batching serving: colocated and disaggregated pools.

Time only moves at step boundaries, as on a real engine: a worker picks a step (a prefill, a
decode step over its running batch, or a decode step with a prefill chunk), the step's duration
comes from `StepModel` (the cost model, optionally calibrated), and at its end every sequence in
it gets its token. Modes:

- ``colocated``: one queue per worker, whole-prompt prefill runs *instead of* the decode step
  (prefill first, as vLLM's default scheduler); this is the article's freeze.
- ``chunked``: each step is the decode batch plus up to `chunk` prompt tokens (Sarathi-style);
  its time is decode step + chunk time, the article's additive accounting.
- ``disagg``: `prefill_workers` run whole prompts; the first token streams at the end of
  prefill; the KV cache then crosses the link (one FIFO link into each decode worker) and the
  request joins a decode worker's batch at its next step.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from costmodel import cost_model as cm
from costmodel.step_fit import StepCostFit, StepShape

MODES = ("colocated", "chunked", "disagg")


@dataclass
class Request:
    rid: int
    kind: str  # "chat" | "doc"
    arrival: float
    prompt: int
    output: int  # tokens to generate, the first (from prefill) included
    prefilled: int = 0
    token_times: list[float] = field(default_factory=list)
    # disagg only: the KV pull's own time on the link, and when a decode worker's batch took the
    # request in (what pdserve's timeline calls decode_admitted; decode wait = admitted - first
    # token - transfer, the link's queue included)
    transfer_s: float | None = None
    admitted: float | None = None
    prefill_start: float | None = None  # when its first prefill step began

    @property
    def done(self) -> bool:
        return len(self.token_times) >= self.output

    @property
    def ctx(self) -> int:
        return self.prompt + len(self.token_times)


@dataclass(frozen=True)
class StepModel:
    """Step durations from the cost model. `fixed_ctx` pins every decode sequence's context (the
    article's "every stream at 4k"); None uses each sequence's real context."""

    model: cm.ModelSpec
    hw: cm.HardwareSpec
    mfu: float = cm.ARTICLE_MFU
    weight_dtype: str = "fp8"
    kv_dtype: str = "fp8"
    fixed_ctx: float | None = None
    # A measured step-cost fit (costmodel/step_fit.py): when set it prices every step from its
    # shape, and a colocated whole prompt runs *with* the decode batch, as the engine does.
    fit: StepCostFit | None = None
    # A disaggregated run's prefill pool priced apart (fitted on its own steps: on a CPU the two
    # pools share cores, so each pool's steps cost what they cost beside the other); None: `fit`.
    prefill_fit: StepCostFit | None = None

    def _ctx(self, r: Request) -> int:
        return int(self.fixed_ctx) if self.fixed_ctx is not None else r.ctx

    def step(self, batch: list[Request], parts: list[tuple[int, int]]) -> float:
        """One engine step: the decode batch plus prompt chunks (start, n)."""
        if self.fit is not None:
            return self.fit.seconds(StepShape.of([self._ctx(r) for r in batch], parts))
        return (self.decode(batch) if batch else 0.0) + sum(self.chunk(s, n) for s, n in parts)

    def prefill_pool_step(self, prompts: list[int]) -> float:
        """One step of a disaggregated prefill worker: these whole prompts, batched."""
        f = self.prefill_fit or self.fit
        if f is not None:
            return f.seconds(StepShape.of((), [(0, n) for n in prompts]))
        return self.prefill(prompts[0])

    def decode(self, batch: list[Request]) -> float:
        if self.fit is not None:
            return self.fit.decode_seconds([self._ctx(r) for r in batch])
        kv = self.fixed_ctx * len(batch) if self.fixed_ctx is not None else sum(r.ctx for r in batch)
        return cm.decode_step_tokens(
            self.model, self.hw, len(batch), kv, self.mfu, self.weight_dtype, self.kv_dtype
        ).time_s

    def prefill(self, tokens: int) -> float:
        if self.fit is not None:
            return self.fit.prefill_seconds(tokens)
        return cm.prefill(self.model, self.hw, tokens, self.mfu, self.weight_dtype).time_s

    def chunk(self, start: int, n: int) -> float:
        if self.fit is not None:
            return self.fit.chunk_extra_seconds(start, n)
        return cm.prefill_chunk_seconds(self.model, self.hw, start, n, self.mfu, self.weight_dtype)

    def transfer(self, tokens: int, link: cm.Link) -> float:
        return cm.kv_transfer_seconds(self.model, tokens, link, self.kv_dtype)


@dataclass(frozen=True)
class SimConfig:
    mode: str = "colocated"
    workers: int = 1  # colocated workers (GPUs or nodes)
    prefill_workers: int = 1
    decode_workers: int = 1
    chunk: int = 512  # prompt tokens per step in chunked mode
    max_batch: int = 256
    link: cm.Link = cm.LINKS["nvlink"]
    max_prefill_tokens: int = 8192  # whole prompts batched into one step, as the engine's default
    # disagg: what a request waits beyond the pull and the next step boundary before a decode
    # worker takes it in (router and Ray hops, the worker's inbox); measured, not modelled
    admit_s: float = 0.0
    # disagg with both pools on one host's CPU cores: a decode step costs this many times its
    # price for the share of it during which a prefill step runs (1 on separate GPUs; measured)
    decode_slowdown: float = 1.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if min(self.workers, self.prefill_workers, self.decode_workers, self.chunk, self.max_batch) < 1:
            raise ValueError("workers, chunk and max_batch must be positive")

    @property
    def gpus(self) -> int:
        return self.prefill_workers + self.decode_workers if self.mode == "disagg" else self.workers

    @property
    def label(self) -> str:
        if self.mode == "disagg":
            return f"disagg {self.prefill_workers}P{self.decode_workers}D {self.link.name}"
        return f"chunked {self.chunk}" if self.mode == "chunked" else "colocated"


@dataclass(frozen=True)
class Workload:
    """Chat streams (closed loop of `streams`, or Poisson at `chat_rate`) plus Poisson documents."""

    streams: int = 32
    chat_rate: float = 0.0
    chat_prompt: tuple[int, int] = (64, 512)
    chat_output: tuple[int, int] = (128, 1024)
    doc_rate: float = 0.25
    doc_prompt: tuple[int, int] = (4096, 4096)
    doc_output: tuple[int, int] = (128, 128)
    duration: float = 60.0
    arrivals: str = "poisson"  # "poisson" | "uniform" (evenly spaced documents)
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("chat_prompt", "chat_output", "doc_prompt", "doc_output"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be 1 <= lo <= hi, got {lo}:{hi}")
        if self.arrivals not in ("poisson", "uniform"):
            raise ValueError(f"arrivals must be poisson or uniform, got {self.arrivals!r}")
        if self.duration <= 0 or min(self.streams, self.chat_rate, self.doc_rate) < 0:
            raise ValueError("duration must be positive and rates/streams non-negative")


def _times(rate: float, duration: float, rng: random.Random, process: str) -> list[float]:
    if rate <= 0:
        return []
    if process == "uniform":
        return [(i + 0.5) / rate for i in range(int(duration * rate))]
    out, t = [], rng.expovariate(rate)
    while t < duration:
        out.append(t)
        t += rng.expovariate(rate)
    return out


class Sim:
    def __init__(self, cfg: SimConfig, steps: StepModel, wl: Workload):
        self.cfg, self.steps, self.wl = cfg, steps, wl
        self.now = 0.0
        self._heap: list = []
        self._seq = itertools.count()
        self._rid = itertools.count()
        self.requests: list[Request] = []
        self.finished: list[Request] = []
        self.chat_rng = random.Random(f"{wl.seed}-chat")
        self.prefill: list[Worker]
        self.decode: list[Worker]  # DecodeWorkers, or ColocatedWorkers that also prefill
        if cfg.mode == "disagg":
            self.prefill = [PrefillWorker(self, f"P{i}") for i in range(cfg.prefill_workers)]
            self.decode = [DecodeWorker(self, f"D{i}") for i in range(cfg.decode_workers)]
            self.front = self.prefill
        else:
            self.prefill, self.decode = [], [ColocatedWorker(self, f"C{i}") for i in range(cfg.workers)]
            self.front = self.decode

    def at(self, t: float, fn: Callable, *args) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), fn, args))

    def new_request(self, kind: str, arrival: float, rng: random.Random) -> Request:
        p, o = (
            (self.wl.chat_prompt, self.wl.chat_output) if kind == "chat" else (self.wl.doc_prompt, self.wl.doc_output)
        )
        r = Request(next(self._rid), kind, arrival, rng.randint(*p), rng.randint(*o))
        self.requests.append(r)
        self.at(arrival, self.dispatch, r)
        return r

    def dispatch(self, r: Request) -> None:
        w = min(self.front, key=lambda w: w.load)
        w.queue.append(r)
        w.kick()

    def finish(self, r: Request) -> None:
        self.finished.append(r)
        if r.kind == "chat" and self.wl.streams and self.now < self.wl.duration:
            self.new_request("chat", self.now, self.chat_rng)  # closed loop: the user asks again

    def send_kv(self, r: Request) -> None:
        dw = min(self.decode, key=lambda w: w.load)
        assert isinstance(dw, DecodeWorker)  # KV is only sent in disaggregated mode
        start = max(self.now, dw.link_free)
        r.transfer_s = self.steps.transfer(r.prompt, self.cfg.link)
        dw.link_free = start + r.transfer_s
        dw.inflight += 1
        self.at(dw.link_free + self.cfg.admit_s, dw.receive, r)

    def run(self, horizon: float | None = None) -> Sim:
        """Run until every request is done, or until simulated time `horizon` (endless streams)."""
        wl = self.wl
        doc_rng = random.Random(f"{wl.seed}-docs")  # documents identical across modes
        for _ in range(wl.streams):  # streams start staggered over the first second
            self.new_request("chat", self.chat_rng.random(), self.chat_rng)
        for t in _times(wl.chat_rate, wl.duration, self.chat_rng, "poisson"):
            self.new_request("chat", t, self.chat_rng)
        for t in _times(wl.doc_rate, wl.duration, doc_rng, wl.arrivals):
            self.new_request("doc", t, doc_rng)
        while self._heap:
            t, _, fn, args = heapq.heappop(self._heap)
            if horizon is not None and t > horizon:
                break
            self.now = t
            fn(*args)
        return self

    @property
    def workers(self) -> list[Worker]:
        return [*self.prefill, *self.decode]


@dataclass
class StepRecord:
    start: float
    end: float
    prefill_tokens: int
    decode_tokens: int


class Worker:
    def __init__(self, sim: Sim, name: str):
        self.sim, self.name = sim, name
        self.queue: deque[Request] = deque()
        self.running: list[Request] = []
        self.busy = False
        self.log: list[StepRecord] = []

    @property
    def load(self) -> int:
        return len(self.queue) + len(self.running)

    def plan(self) -> tuple[float, int, int, Callable[[], None]] | None:
        raise NotImplementedError

    def kick(self) -> None:
        if self.busy:
            return
        p = self.plan()
        if p is None:
            return
        dur, ptok, dtok, fin = p
        self.busy = True
        self.log.append(StepRecord(self.sim.now, self.sim.now + dur, ptok, dtok))
        self.sim.at(self.sim.now + dur, self._done, fin)

    def _done(self, fin: Callable[[], None]) -> None:
        fin()  # still busy: a request dispatched from inside fin() must not start a step here
        self.busy = False
        self.kick()

    def _emit(self, reqs: list[Request]) -> None:
        now = self.sim.now
        for r in reqs:
            r.token_times.append(now)
        if any(r.done for r in reqs):
            for r in [r for r in self.running if r.done]:
                self.running.remove(r)
                self.sim.finish(r)

    def _decode_step(self) -> tuple[float, int, int, Callable[[], None]]:
        batch = list(self.running)
        return self.sim.steps.decode(batch), 0, len(batch), lambda: self._emit(batch)

    def _take_whole(self, batch: int) -> list[Request]:
        """Whole prompts for one step, FIFO, as the engine schedules them unchunked: the first
        whatever its length, then more while they fit `max_prefill_tokens` and the batch limit."""
        cfg, budget = self.sim.cfg, self.sim.cfg.max_prefill_tokens
        out: list[Request] = []
        while self.queue and batch + len(out) < cfg.max_batch and (not out or self.queue[0].prompt <= budget):
            r = self.queue.popleft()
            r.prefilled, r.prefill_start = r.prompt, self.sim.now
            budget -= r.prompt
            out.append(r)
        return out

    def _prefilled(self, r: Request) -> None:
        """First token of `r` is out: decode it here, or finish."""
        r.token_times.append(self.sim.now)
        if r.done:
            self.sim.finish(r)
        else:
            self.running.append(r)


class ColocatedWorker(Worker):
    def plan(self):
        cfg, steps = self.sim.cfg, self.sim.steps
        if cfg.mode == "colocated":
            if self.queue and len(self.running) < cfg.max_batch:
                if steps.fit is None:  # the article's freeze: the prefill runs instead of the decode step
                    r = self.queue.popleft()
                    r.prefilled, r.prefill_start = r.prompt, self.sim.now
                    return steps.prefill(r.prompt), r.prompt, 0, lambda: self._prefilled(r)
                # the engine's: one forward of the decode batch + every waiting prompt that fits
                batch, prompts = list(self.running), self._take_whole(len(self.running))

                def fin_mixed() -> None:
                    self._emit(batch)
                    for r in prompts:
                        self._prefilled(r)

                whole = [(0, r.prompt) for r in prompts]
                return steps.step(batch, whole), sum(r.prompt for r in prompts), len(batch), fin_mixed
            return self._decode_step() if self.running else None
        batch, budget = list(self.running), cfg.chunk
        parts: list[tuple[Request, int, int]] = []  # (request, chunk start, chunk tokens)
        for r in self.queue:
            if budget == 0 or len(batch) + len(parts) >= cfg.max_batch:
                break
            n = min(budget, r.prompt - r.prefilled)
            parts.append((r, r.prefilled, n))
            budget -= n
            if r.prefill_start is None:
                r.prefill_start = self.sim.now
        if not batch and not parts:
            return None
        dur = steps.step(batch, [(s, n) for _, s, n in parts])

        def fin() -> None:
            self._emit(batch)
            for r, s, n in parts:
                r.prefilled = s + n
                if r.prefilled == r.prompt:
                    self.queue.remove(r)
                    self._prefilled(r)

        return dur, sum(n for *_, n in parts), len(batch), fin


class PrefillWorker(Worker):
    @property
    def load(self) -> int:
        return len(self.queue) + int(self.busy)  # the prompt in flight counts: it left the queue

    def plan(self):
        if not self.queue:
            return None
        steps = self.sim.steps
        # measured steps (a fit): the engine's batch of waiting whole prompts; else one at a time
        measured = steps.fit is not None or steps.prefill_fit is not None
        prompts = self._take_whole(0) if measured else [self.queue.popleft()]
        for r in prompts:
            r.prefilled, r.prefill_start = r.prompt, self.sim.now

        def fin() -> None:
            for r in prompts:
                r.token_times.append(self.sim.now)
                if r.done:
                    self.sim.finish(r)
                else:
                    self.sim.send_kv(r)

        dur = steps.prefill_pool_step([r.prompt for r in prompts])
        return dur, sum(r.prompt for r in prompts), 0, fin


class DecodeWorker(Worker):
    def __init__(self, sim: Sim, name: str):
        super().__init__(sim, name)
        self.link_free = 0.0
        self.inflight = 0

    @property
    def load(self) -> int:
        return len(self.queue) + len(self.running) + self.inflight

    def receive(self, r: Request) -> None:
        self.inflight -= 1
        self.queue.append(r)
        self.kick()

    def plan(self):
        while self.queue and len(self.running) < self.sim.cfg.max_batch:
            r = self.queue.popleft()
            r.admitted = self.sim.now
            self.running.append(r)
        if not self.running:
            return None
        dur, ptok, dtok, fin = self._decode_step()
        k = self.sim.cfg.decode_slowdown
        if k != 1.0:  # the share of the step a prefill worker is busy for, at k times the price
            busy_until = max((w.log[-1].end for w in self.sim.prefill if w.busy and w.log), default=self.sim.now)
            share = min(1.0, max(0.0, busy_until - self.sim.now) / dur) if dur > 0 else 0.0
            dur *= 1.0 + (k - 1.0) * share
        return dur, ptok, dtok, fin


def simulate(cfg: SimConfig, steps: StepModel, wl: Workload, horizon: float | None = None) -> Sim:
    return Sim(cfg, steps, wl).run(horizon)
