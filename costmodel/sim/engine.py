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
  prefill; the KV cache crosses the link (one FIFO link into each decode worker) and the request
  joins a decode worker's batch at its next step. Bulk (`SimConfig.kv_transfer`), the whole KV
  crosses after the prefill; layer-wise, its groups of layers cross while the prefill runs and only
  what the link has not caught up with is left after it (costmodel/article/layerwise.py prices both).
- ``auto``: the disaggregated pools, and each request prefilled either remotely (as ``disagg``) or
  locally in `chunk`-token chunks on its decode worker (as ``chunked``), by the router's rule
  (costmodel/sim/auto.py).

This module holds the workload and the event loop (`Sim`); the request, step prices and
configuration are costmodel/sim/model.py, the workers costmodel/sim/workers.py, and their names
are re-exported here.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass

from costmodel.article.layerwise import layerwise_exposed_s, layerwise_gain_s
from costmodel.sim import auto
from costmodel.sim.model import MODES as MODES
from costmodel.sim.model import Request as Request
from costmodel.sim.model import SimConfig as SimConfig
from costmodel.sim.model import StepModel as StepModel
from costmodel.sim.stretch import StepRecord as StepRecord
from costmodel.sim.workers import ColocatedWorker as ColocatedWorker
from costmodel.sim.workers import DecodeWorker as DecodeWorker
from costmodel.sim.workers import PrefillWorker as PrefillWorker
from costmodel.sim.workers import Worker as Worker


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


# a worker the KV of a remote prefill lands on
Receiver = DecodeWorker | auto.AutoDecodeWorker


@dataclass
class _OpenStream:
    """A layer-wise stream whose prefill is running: its decode worker, when the prefill began, and
    the link time ahead of its groups (the link's backlog then, plus the part after that start
    of every pull charged to the link since: a fluid FIFO, those pulls interleave with its groups)."""

    worker: Receiver
    start: float
    ahead_s: float


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
        self._open: dict[int, _OpenStream] = {}  # layer-wise streams whose prefill is running, by rid
        self._bound: dict[int, Receiver] = {}  # auto: remote prompts' decode workers
        self.placements: dict[int, str] = {}  # auto: "local" or "remote", by rid
        self.prefill: list[Worker]
        self.decode: list[Worker]  # DecodeWorkers, or ColocatedWorkers that also prefill
        if cfg.mode == "disagg":
            self.prefill = [PrefillWorker(self, f"P{i}") for i in range(cfg.prefill_workers)]
            self.decode = [DecodeWorker(self, f"D{i}") for i in range(cfg.decode_workers)]
            self.front = self.prefill
        elif cfg.mode == "auto":
            self.prefill = [PrefillWorker(self, f"P{i}") for i in range(cfg.prefill_workers)]
            self.decode = [auto.AutoDecodeWorker(self, f"D{i}") for i in range(cfg.decode_workers)]
            self.front = self.decode
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
        w = self._pick(self.front, r)
        if self.cfg.mode == "auto":  # the router picks a worker of each pool, then local or remote
            assert isinstance(w, auto.AutoDecodeWorker)
            pw = self._pick(self.prefill, r)
            assert isinstance(pw, PrefillWorker)
            w.sync()  # the rule reads its batch and step in progress
            choice = auto.choose(auto.predict_local(self, w, r), auto.predict_remote(self, pw, w, r))
            self.placements[r.rid] = choice
            if choice == "remote":
                if r.output > 1:  # its KV will land on `w`: assigned to it from now, as the router counts it
                    w.inflight += 1
                    self._bound[r.rid] = w
                w = pw
        w.queue.append(r)
        w.wake()

    def _pick(self, workers: list[Worker], r: Request) -> Worker:
        """The least loaded worker; under the prefix policy, the one holding most of `r`'s prefix first."""
        if self.cfg.prefix_policy and r.prefix_key is not None:
            return min(workers, key=lambda w: (-w.held(r), w.load))
        return min(workers, key=lambda w: w.load)

    def finish(self, r: Request) -> None:
        self.finished.append(r)
        if r.kind == "chat" and self.wl.streams and self.now < self.wl.duration:
            self.new_request("chat", self.now, self.chat_rng)  # closed loop: the user asks again

    def open_kv_stream(self, r: Request, prefill_s: float) -> None:
        """`r`'s prefill step starts and takes `prefill_s`. If its KV streams (pdserve's router
        decides before the prefill, and reserves the decode worker then), pick that worker now and
        note what its link already carries: the stream's groups queue behind it."""
        if not self._streams(r, prefill_s):
            return
        dw = self._decode_for(r)
        self._open[r.rid] = _OpenStream(dw, self.now, max(0.0, dw.link_free - self.now))

    def send_kv(self, r: Request) -> None:
        """`r`'s prefill has just ended: its KV lands on a decode worker (whole after the prefill,
        or what is left of its stream) and the request joins that worker's batch once it has."""
        stream = self._open.pop(r.rid, None)
        if stream is None:
            dw = self._decode_for(r)
            landed = self._pull_kv(r, dw)
        else:
            dw, landed = stream.worker, self._stream_kv(r, stream)
        r.exposed_transfer_s = landed - self.now
        self.at(landed + self.cfg.admit_s, dw.receive, r)

    def _decode_for(self, r: Request) -> Receiver:
        """The decode worker `r`'s KV goes to, counted in its load from now: the least loaded
        (auto: the one the router picked with the placement)."""
        bound = self._bound.pop(r.rid, None)
        if bound is not None:
            return bound
        dw = self._pick(self.decode, r)
        assert isinstance(dw, DecodeWorker)  # KV is only sent in disaggregated mode
        dw.inflight += 1
        return dw

    @staticmethod
    def _pulled(r: Request, dw: Receiver) -> int:
        """Prompt tokens whose KV crosses to `dw`: those its own prefix cache does not hold."""
        return r.prompt - dw.held(r, leave_one=False)

    def _pull_kv(self, r: Request, dw: Receiver) -> float:
        """Bulk: the whole KV crosses once the prefill has ended and the link is free."""
        r.kv_transfer = "bulk"
        r.transfer_s = self.steps.transfer(self._pulled(r, dw), self.cfg.link)
        landed = max(self.now, dw.link_free) + r.transfer_s
        self._charge_link(dw, landed - r.transfer_s, landed, r.transfer_s)
        return landed

    def _stream_kv(self, r: Request, stream: _OpenStream) -> float:
        """Layer-wise: the groups crossed while the prefill ran, behind the link time ahead of
        them; what is left now is the layer-wise recurrence's exposed part (costmodel/article/layerwise.py)."""
        cfg = self.cfg
        groups = cfg.kv_groups(self.steps.model)
        pulled = self._pulled(r, stream.worker)
        kv, prefill_s = self.steps.kv_bytes(pulled), self._prefill_s(r)
        exposed = layerwise_exposed_s(kv, prefill_s, groups, cfg.kv_link(), stream.ahead_s)
        r.kv_transfer = "layerwise"
        r.transfer_s = self.steps.transfer(pulled, cfg.link)  # its bytes' time on the link, as bulk's
        landed = self.now + exposed
        # its pulls and their overheads, spread over the prefill and the exposed part after it
        self._charge_link(stream.worker, stream.start, landed, r.transfer_s + groups * cfg.kv_group_overhead_s)
        return landed

    def _charge_link(self, dw: Receiver, since: float, landed: float, work_s: float) -> None:
        """A pull of `work_s` seconds on `dw`'s link, spread evenly over [since, landed]: every
        stream still prefilling toward `dw` has the part of it after its own start ahead of it."""
        dw.link_free = max(dw.link_free, landed)
        for s in self._open.values():
            after = landed - max(since, s.start)
            if s.worker is dw and after > 0:
                s.ahead_s += work_s * after / (landed - since)

    def _streams(self, r: Request, prefill_s: float) -> bool:
        """Whether `r`'s KV streams: always under layerwise; under auto when the cost model says
        streaming gains (the router's rule, with this link and this prompt's prefill known)."""
        cfg = self.cfg
        if cfg.kv_transfer != "auto":
            return cfg.kv_transfer == "layerwise"
        groups = cfg.kv_groups(self.steps.model)
        return layerwise_gain_s(self.steps.kv_bytes(r.prompt), prefill_s, groups, cfg.kv_link()) > 0

    def _prefill_s(self, r: Request) -> float:
        """The prefill step that just ended for `r` (its groups were written over it)."""
        assert r.prefill_start is not None
        return self.now - r.prefill_start

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
        if horizon is not None:
            for w in self.workers:
                w.flush(horizon)
        return self

    @property
    def workers(self) -> list[Worker]:
        return [*self.prefill, *self.decode]


def simulate(cfg: SimConfig, steps: StepModel, wl: Workload, horizon: float | None = None) -> Sim:
    return Sim(cfg, steps, wl).run(horizon)
