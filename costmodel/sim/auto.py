"""`--mode auto` in the simulator: each request is prefilled locally (in chunks, on the decode
worker it will decode on) or remotely (on a prefill worker, its KV then crossing the link),
whichever the router's rule picks (router/dispatch/dispatcher.py, `AutoDispatcher.decide`).

The rule, as the router applies it to the state it predicts:

  local   TTFT  = what is left of the decode worker's step + every chunk step until the prompt's
                  last chunk (the prompts queued ahead of it first, FIFO, `chunk` tokens a step)
          stall = what its chunks add to the streams' steps; admissible if TTFT meets the TTFT SLO
                  and every stream's mean inter-token latency, the stall added, meets the ITL SLO
  remote  TTFT  = what is left of the prefill worker's step + its waiting prompts and this one,
                  batched whole; admissible if it meets the TTFT SLO; on shared cores the streams
                  lose (1 - 1/k) of the prefill's time, k the decode slowdown beside a prefill
  both admissible: the cheaper in user-seconds (TTFT + streams x stall; remote adds the pull and
  the admission step); one: it; neither: the earlier first token.

The simulator reads the state exactly where the router replays a queue model learned from the
workers' steps, and it leaves out the router's learned hops and its TTFT-error margin: an auto
candidate is priced as the rule would decide with perfect knowledge of the queues.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from costmodel.sim.model import Request
from costmodel.sim.workers import ColocatedWorker, PrefillWorker, SimHost, Worker


class AutoDecodeWorker(ColocatedWorker):
    """A decode worker under auto: it decodes, prefills local prompts in chunks beside its
    streams (the chunked path of ColocatedWorker), and takes remote prompts' KV in."""

    def __init__(self, sim: SimHost, name: str):
        super().__init__(sim, name)
        self.arrived: deque[Request] = deque()  # remote prompts whose KV has landed: join at the next step
        self.inflight = 0  # remote prompts assigned here whose KV has not landed yet
        self.link_free = 0.0  # when its link has carried every pull charged to it so far

    @property
    def load(self) -> int:
        return super().load + len(self.arrived) + self.inflight

    def receive(self, r: Request) -> None:
        self.inflight -= 1
        self.remember(r, r.prompt)
        self.arrived.append(r)
        self.wake()

    def plan(self):
        self.admit(self.arrived)
        p = super().plan()
        if p is None:
            return None
        dur, ptok, dtok, fin = p
        return self.beside_prefill(dur), ptok, dtok, fin


@dataclass(frozen=True)
class Placement:
    """One side's prediction for a request, as the router's `Prediction`."""

    ttft_s: float
    stall_s: float  # what each stream in flight loses to it
    cost_s: float  # user-seconds: its TTFT plus what the streams lose (remote: the pull and admission too)
    admissible: bool


def _left(w: Worker) -> float:
    """What is left of `w`'s running step."""
    return max(0.0, w.log[-1].end - w.sim.now) if w.busy and w.log else 0.0


def predict_local(sim: SimHost, dw: AutoDecodeWorker, r: Request) -> Placement:
    """Replay `dw`'s chunk steps, the prompts queued ahead first, until `r`'s last chunk."""
    cfg, steps = sim.cfg, sim.steps
    batch = list(dw.running) + list(dw.arrived)
    base = steps.decode(batch) if batch else 0.0
    todo = [(q.prefilled, q.prompt) for q in dw.queue] + [(dw.held(r), r.prompt)]
    t, stall, longest = _left(dw), 0.0, base
    while todo:
        budget, parts, mine = cfg.chunk, [], 0
        while todo and budget > 0:
            start, end = todo[0]
            n = min(budget, end - start)
            parts.append((start, n))
            budget -= n
            if len(todo) == 1:
                mine += n
            if start + n == end:
                todo.pop(0)
            else:
                todo[0] = (start + n, end)
        step = steps.step(batch, parts)
        t += step
        if mine:  # a step carrying this prompt's chunk: what it adds to the streams' step is its stall
            stall += step - base
            longest = max(longest, step)
    slo_ttft, slo_itl = cfg.slo_ttft_s, cfg.slo_itl_s
    ok = slo_ttft is None or t <= slo_ttft
    if ok and slo_itl is not None and batch:
        ok = all(_mean_itl(s, base, stall, longest, sim.now) <= slo_itl for s in batch)
    return Placement(t, stall, t + len(batch) * stall, ok)


def predict_remote(sim: SimHost, pw: PrefillWorker, dw: AutoDecodeWorker, r: Request) -> Placement:
    """`pw`'s running step, then its waiting prompts and `r` batched whole; the pull and one
    decode step (the admission) after it."""
    cfg, steps = sim.cfg, sim.steps
    parts = [(q.cached, q.prompt - q.cached) for q in pw.queue] + [(pw.held(r), r.prompt - pw.held(r))]
    compute = steps.prefill_pool_step(parts)
    ttft = _left(pw) + compute
    batch = list(dw.running) + list(dw.arrived)
    admission = steps.decode(batch) if batch else 0.0
    k = cfg.decode_slowdown
    stall = compute * (1 - 1 / k) if batch and k > 1 else 0.0
    transfer = steps.transfer(r.prompt - dw.held(r, leave_one=False), cfg.link)
    ok = cfg.slo_ttft_s is None or ttft <= cfg.slo_ttft_s
    return Placement(ttft, stall, ttft + transfer + admission + len(batch) * stall, ok)


def choose(local: Placement, remote: Placement) -> str:
    """The router's choice between the two predictions ("local" or "remote")."""
    if local.admissible != remote.admissible:
        return "local" if local.admissible else "remote"
    if local.admissible:
        return "local" if local.cost_s <= remote.cost_s else "remote"
    return "local" if local.ttft_s <= remote.ttft_s else "remote"


def _mean_itl(s: Request, step_s: float, stall_s: float, longest_s: float, now: float) -> float:
    """A stream's mean inter-token latency over its whole output once `stall_s` is added (its
    length is known to the simulator, as to the router from max_tokens)."""
    done, total = len(s.token_times), s.output
    if total <= max(1, done):
        return longest_s
    so_far = now - s.token_times[0] if s.token_times else 0.0
    return (so_far + (total - done) * step_s + stall_s) / (total - 1)
