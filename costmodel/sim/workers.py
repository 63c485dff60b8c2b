"""The simulated workers (costmodel/sim/engine.py drives them): each plans its next step from its
queue and running batch, prices it with the `StepModel`, and at the step's end hands out tokens.
`ColocatedWorker` prefills whole prompts (freezing the decode batch) or in chunks beside it;
`PrefillWorker` runs whole prompts and sends the KV on (streamed layer-wise, it opens the stream
as the step starts); `DecodeWorker` takes requests in off its link and decodes. A worker sees the
simulator only through `SimHost`, so this module does not import the simulator.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from costmodel.sim.model import Request, SimConfig, StepModel
from costmodel.sim.stretch import STRETCH_STEPS, StepRecord, Stretch, in_progress


class SimHost(Protocol):
    """What a worker uses of the simulator: the clock, the event queue and the request hand-offs."""

    cfg: SimConfig
    steps: StepModel
    now: float
    prefill: list[Worker]
    decode: list[Worker]

    def at(self, t: float, fn: Callable, *args: Any) -> None: ...

    def finish(self, r: Request) -> None: ...

    def open_kv_stream(self, r: Request, prefill_s: float) -> None: ...

    def send_kv(self, r: Request) -> None: ...


class Worker:
    def __init__(self, sim: SimHost, name: str):
        self.sim, self.name = sim, name
        self.queue: deque[Request] = deque()
        self.running: list[Request] = []
        self.busy = False
        self.waking = False  # an idle worker gathers arrivals before its step (`wake`)
        self._gather_start = 0.0  # when the gather began (its first arrival)
        self._gather_version = 0  # bumped when an arrival moves the gather's end: earlier end events are stale
        self._run: Stretch | None = None  # a decode-only stretch in flight
        self._run_version = 0  # bumped when a stretch is cut: its first end event is stale
        self.log: list[StepRecord] = []
        self.prefixes: dict[str, int] = {}  # prefix key -> how many of its tokens this worker's KV cache holds

    def held(self, r: Request, leave_one: bool = True) -> int:
        """Tokens of `r`'s prompt this worker's prefix cache holds, in whole blocks. A prefill
        leaves at least one token to compute (its logits give the first token); a decode worker
        taking a prefilled prompt in reuses every whole block it holds."""
        if r.prefix_key is None:
            return 0
        n = min(self.prefixes.get(r.prefix_key, 0), r.prefix_len, r.prompt - 1 if leave_one else r.prompt)
        return n - n % self.sim.cfg.block_size

    def remember(self, r: Request, upto: int) -> None:
        """`r`'s prompt KV up to token `upto` is in this worker's cache now: its shared prefix part is
        a hit for the next request with the same prefix (full blocks register as they fill)."""
        if r.prefix_key is not None:
            self.prefixes[r.prefix_key] = max(self.prefixes.get(r.prefix_key, 0), min(upto, r.prefix_len))

    @property
    def load(self) -> int:
        return len(self.queue) + len(self.running)

    def decoding_for(self) -> float:
        """How long from now this worker goes on decoding what it runs (its streams' tokens left
        at its last step's pace; 0 when it runs nothing)."""
        if not self.running or not self.log:
            return 0.0
        last = self.log[-1]
        left = max(r.output - len(r.token_times) for r in self.running)
        return max(0.0, last.end - self.sim.now) + left * (last.end - last.start)

    def plan(self) -> tuple[float, int, int, Callable[[], None]] | None:
        raise NotImplementedError

    def admit(self, landed: deque[Request]) -> None:
        """Requests whose KV has landed here join the running batch, up to the batch limit."""
        while landed and len(self.running) < self.sim.cfg.max_batch:
            r = landed.popleft()
            r.admitted = self.sim.now
            self.running.append(r)

    def beside_prefill(self, dur: float) -> float:
        """A decode-pool step of `dur` at the price, run with both pools on one host's cores: the
        share of it a prefill worker is busy for costs `decode_slowdown` times as much."""
        k = self.sim.cfg.decode_slowdown
        if k == 1.0 or dur <= 0:
            return dur
        busy_until = max((w.log[-1].end for w in self.sim.prefill if w.busy and w.log), default=self.sim.now)
        share = min(1.0, max(0.0, busy_until - self.sim.now) / dur)
        return dur * (1.0 + (k - 1.0) * share)

    def wake(self) -> None:
        """A request has arrived: an idle worker starts its step once no other has arrived for
        `batch_wait_s`, at most `batch_wait_max_s` after the first, with whatever arrived by then
        (pdserve's engine loop, engine/worker_base.py); a busy one takes it at its next step."""
        self.cut()
        cfg, now = self.sim.cfg, self.sim.now
        if self.busy or cfg.batch_wait_s <= 0:
            self.kick()
            return
        if not self.waking:
            self.waking, self._gather_start = True, now
        cap = self._gather_start + max(cfg.batch_wait_s, cfg.batch_wait_max_s or 0.0)
        self._gather_version += 1
        self.sim.at(min(now + cfg.batch_wait_s, cap), self._woken, self._gather_version)

    def _woken(self, version: int) -> None:
        if version != self._gather_version:
            return  # a later arrival moved the gather's end
        self.waking = False
        self.kick()

    def kick(self) -> None:
        if self.busy:
            return
        p = self.plan()
        if p is None:
            return
        dur, ptok, dtok, fin = p
        self.busy = True
        if ptok == 0 and self.can_stretch():
            self._stretch()
            return
        self.log.append(StepRecord(self.sim.now, self.sim.now + dur, ptok, dtok))
        self.sim.at(self.sim.now + dur, self._done, fin)

    # ---- decode-only stretches: many steps, one event --------------------------------------------
    # Between two changes to its batch (a request finishing, one arriving), a worker's decode steps
    # are known in advance: each sequence's context grows by one a step. A 16-worker plan simulates
    # ~2 million steps, most of them such (a request or two decoding alone on a worker), so a run of
    # them is priced in one loop and scheduled as one event: the same step ends and token times as
    # step by step (tests/test_sim_stretch.py), at a fraction of the events; the log holds the run's
    # earlier steps as one record. An arrival for the worker cuts the run at the end of the step in
    # progress, where the step-by-step loop would have taken it in.

    def can_stretch(self) -> bool:
        """Whether this worker's decode-only steps may run as one event (`SimConfig.fast_forward`):
        not where a step's price depends on what other workers do meanwhile (a decode step beside
        a prefill on shared cores, `beside_prefill`)."""
        cfg = self.sim.cfg
        return cfg.fast_forward and (cfg.decode_slowdown == 1.0 or not self.sim.prefill)

    def _stretch(self) -> None:
        """From now, the running batch's decode steps up to the first that finishes a request (at most
        STRETCH_STEPS)."""
        batch = list(self.running)
        k = min(STRETCH_STEPS, *(r.output - len(r.token_times) for r in batch))
        t, ends = self.sim.now, []
        for dur in self.sim.steps.decode_run(batch, k):
            t += dur
            ends.append(t)
        self._run = Stretch(batch, self.sim.now, ends)
        self._run_version += 1
        self.sim.at(ends[-1], self._stretch_done, self._run_version)

    def sync(self) -> None:
        """The worker's batch and step log as the step-by-step loop has them now, for a reader
        that prices from them (auto's rule): the steps ended hand out their tokens, the step in
        progress is logged."""
        if self._run is not None:
            self._run.settle(self.log, in_progress(self._run.ends, self.sim.now))

    def cut(self) -> None:
        """Something arrived for this worker: a stretch ends with the step in progress."""
        run = self._run
        if run is None:
            return
        j = in_progress(run.ends, self.sim.now)
        if j < len(run.ends) - 1:
            del run.ends[j + 1 :]
            self._run_version += 1
            self.sim.at(run.ends[j], self._stretch_done, self._run_version)

    def _stretch_done(self, version: int) -> None:
        run = self._run
        if version != self._run_version or run is None:
            return  # cut short: a later event ends it
        self._run = None
        run.settle(self.log, len(run.ends) - 1)
        self._done(lambda: self._emit(run.batch))  # the last step, as a step's end hands out tokens

    def flush(self, horizon: float) -> None:
        """The simulation stopped at `horizon` with a stretch in flight: its steps as the
        step-by-step loop left them (each step begun logged, each ended its tokens out)."""
        run, self._run = self._run, None
        if run is not None:
            run.settle(self.log, next((i for i, t in enumerate(run.ends) if t > horizon), len(run.ends)))

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
        while (
            self.queue
            and batch + len(out) < cfg.max_batch
            and (not out or self.queue[0].prompt - self.held(self.queue[0]) <= budget)
        ):
            r = self.queue.popleft()
            r.cached = self.held(r)
            r.prefilled, r.prefill_start = r.prompt, self.sim.now
            budget -= r.prompt - r.cached
            out.append(r)
        return out

    @staticmethod
    def _computed(prompts: list[Request]) -> list[tuple[int, int]]:
        """The (start, tokens) each whole prompt computes: what its cached prefix leaves."""
        return [(r.cached, r.prompt - r.cached) for r in prompts]

    def _prefilled(self, r: Request) -> None:
        """First token of `r` is out: decode it here, or finish."""
        r.token_times.append(self.sim.now)
        self.remember(r, r.prompt)
        if r.done:
            self.sim.finish(r)
        else:
            self.running.append(r)


class ColocatedWorker(Worker):
    def __init__(self, sim: SimHost, name: str):
        super().__init__(sim, name)
        self.prefilling = 0  # whole prompts in the step now running: out of the queue, not yet decoding

    @property
    def load(self) -> int:
        # the router counts a request against its worker from dispatch to its end, so a prompt in
        # its prefill step counts too (without it a second worker's arrivals queued behind a busy
        # worker's prefill: rag on two colocated workers, `plan-verify-rag-i`, 2026-12-05)
        return len(self.queue) + len(self.running) + self.prefilling

    def plan(self):
        cfg, steps = self.sim.cfg, self.sim.steps
        if cfg.mode == "colocated":
            if self.queue and len(self.running) < cfg.max_batch:
                if steps.fit is None:  # the article's freeze: the prefill runs instead of the decode step
                    r = self.queue.popleft()
                    r.cached = self.held(r)
                    r.prefilled, r.prefill_start = r.prompt, self.sim.now
                    n = r.prompt - r.cached
                    dur = steps.chunk(r.cached, n) if r.cached else steps.prefill(r.prompt)
                    self.prefilling += 1

                    def fin_whole() -> None:
                        self.prefilling -= 1
                        self._prefilled(r)

                    return dur, n, 0, fin_whole
                # the engine's: one forward of the decode batch + every waiting prompt that fits
                batch, prompts = list(self.running), self._take_whole(len(self.running))
                self.prefilling += len(prompts)

                def fin_mixed() -> None:
                    self._emit(batch)
                    self.prefilling -= len(prompts)
                    for r in prompts:
                        self._prefilled(r)

                whole = self._computed(prompts)
                return steps.step(batch, whole), sum(n for _, n in whole), len(batch), fin_mixed
            return self._decode_step() if self.running else None
        batch, budget = list(self.running), cfg.chunk
        parts: list[tuple[Request, int, int]] = []  # (request, chunk start, chunk tokens)
        for r in self.queue:
            if budget == 0 or len(batch) + len(parts) >= cfg.max_batch:
                break
            if r.prefill_start is None:  # its first chunk starts past the prefix the cache holds
                r.prefill_start = self.sim.now
                r.cached = r.prefilled = self.held(r)
            n = min(budget, r.prompt - r.prefilled)
            parts.append((r, r.prefilled, n))
            budget -= n
        if not batch and not parts:
            return None
        dur = steps.step(batch, [(s, n) for _, s, n in parts])

        def fin() -> None:
            self._emit(batch)
            for r, s, n in parts:
                r.prefilled = s + n
                self.remember(r, r.prefilled)
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
        if measured:
            prompts = self._take_whole(0)
        else:
            prompts = [self.queue.popleft()]
            prompts[0].cached = self.held(prompts[0])
        for r in prompts:
            r.prefilled, r.prefill_start = r.prompt, self.sim.now

        def fin() -> None:
            for r in prompts:
                r.token_times.append(self.sim.now)
                self.remember(r, r.prompt)
                if r.done:
                    self.sim.finish(r)
                else:
                    self.sim.send_kv(r)

        parts = self._computed(prompts)
        dur = steps.prefill_pool_step(parts)
        k = self.sim.cfg.prefill_slowdown
        if k != 1.0:  # the share of the step a decode worker is decoding for, at k times the price
            for w in self.sim.decode:
                w.sync()
            share = min(1.0, max((w.decoding_for() for w in self.sim.decode), default=0.0) / dur) if dur > 0 else 0.0
            dur *= 1.0 + (k - 1.0) * share
        for r in prompts:
            if r.output > 1:  # its KV crosses once this step ends (a 1-token request just finishes)
                self.sim.open_kv_stream(r, dur)
        return dur, sum(n for _, n in parts), 0, fin


class DecodeWorker(Worker):
    def __init__(self, sim: SimHost, name: str):
        super().__init__(sim, name)
        self.link_free = 0.0  # when its link has carried every pull charged to it so far
        self.inflight = 0

    @property
    def load(self) -> int:
        return len(self.queue) + len(self.running) + self.inflight

    def receive(self, r: Request) -> None:
        self.inflight -= 1
        self.remember(r, r.prompt)
        self.queue.append(r)
        self.wake()

    def plan(self):
        self.admit(self.queue)
        if not self.running:
            return None
        dur, ptok, dtok, fin = self._decode_step()
        return self.beside_prefill(dur), ptok, dtok, fin
