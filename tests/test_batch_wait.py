"""An idle engine loop gathers the requests sent together before its first step, until none has come
for `--batch-wait-ms` and at most `--batch-wait-max-ms` from the first (engine/config.py
BATCH_WAIT_S, BATCH_WAIT_MAX_S), and the simulator predicts it: four chats sent at once were one,
two or three prompt steps from one run to the next before it, their TTFT median with them.

Real workers (the tiny model, in this process) and the real simulator; no timing is asserted, only
which requests shared a step.
"""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from contracts.worker import GenerateRequest, WorkerConfig
from costmodel.fit.step_fit import StepCostFit
from costmodel.sim.compare_predict import setup_from_steps, sim_config, simulate_specs
from costmodel.workloads import RequestSpec
from decode_worker.worker import DecodeWorker
from engine.config import BATCH_WAIT_MAX_S, BATCH_WAIT_S
from engine.sequence import SamplingParams
from prefill_worker.worker import PrefillWorker
from router.config import ConfigError, ServeConfig
from tests.helpers import wait_until

_names = itertools.count()
PROMPT = list(b"the quick brown fox jumps over")  # 30 tokens


def _cfg(**kw) -> WorkerConfig:
    return WorkerConfig(**{"model": "tiny", "transport": "local", "num_blocks": 64, **kw})


def _req(rid: str) -> GenerateRequest:
    return GenerateRequest(rid, list(PROMPT), SamplingParams(max_tokens=4, ignore_eos=True))


def _together(submit, n: int) -> None:
    """`submit(i)` for i < n from n threads released at once (as the router's Ray calls arrive)."""
    go = threading.Barrier(n)

    def one(i: int) -> None:
        go.wait()
        submit(i)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)


def _first_prompt_step(worker) -> dict:
    return next(s for s in worker.stats().step_log()["steps"] if s["prefill_seqs"] > 0)


def test_a_colocated_worker_prefills_requests_sent_together_in_one_step():
    d = DecodeWorker(_cfg(batch_wait_s=0.25), f"bw-colo-{next(_names)}", colocated=True)
    try:
        assert d.batch_wait_s == 0.25
        _together(lambda i: d.submit_prompt(_req(f"c{i}")), 3)
        wait_until(
            lambda: any(s["prefill_seqs"] for s in d.stats().step_log()["steps"]), timeout=30, what="a prompt step"
        )
        first = _first_prompt_step(d)
        assert first["prefill_seqs"] == 3 and first["prefill_tokens"] == 3 * len(PROMPT)
    finally:
        d.shutdown()


def test_a_prefill_worker_prefills_requests_sent_together_in_one_step():
    p = PrefillWorker(_cfg(batch_wait_s=0.25), f"bw-prefill-{next(_names)}")
    try:
        results: dict[int, object] = {}
        _together(lambda i: results.__setitem__(i, p.prefill(_req(f"p{i}"))), 3)
        assert len(results) == 3
        first = _first_prompt_step(p)
        assert first["prefill_seqs"] == 3
        for i in range(3):
            p.release(f"p{i}")
    finally:
        p.shutdown()


def _spaced(submit, n: int, gap_s: float) -> None:
    """`submit(i)` for i < n from n threads, each `gap_s` after the one before (the router hands a
    burst's requests on one after another)."""
    threads = []
    for i in range(n):
        threads.append(threading.Thread(target=submit, args=(i,)))
        threads[-1].start()
        time.sleep(gap_s)
    for t in threads:
        t.join(30)


@pytest.mark.parametrize(("cap_s", "whole"), [(3.0, True), (0.2, False)])
def test_each_arrival_restarts_the_wait_up_to_the_cap(cap_s: float, whole: bool):
    # five prompts 0.15 s apart: 0.6 s from first to last, past a fixed 0.35 s window; a quiet wait
    # of 0.35 s restarted by each takes all five, unless the cap ends the gather first
    d = DecodeWorker(_cfg(batch_wait_s=0.35, batch_wait_max_s=cap_s), f"bw-quiet-{next(_names)}", colocated=True)
    try:
        assert d.batch_wait_max_s == cap_s
        _spaced(lambda i: d.submit_prompt(_req(f"q{i}")), 5, 0.15)
        wait_until(
            lambda: sum(s["prefill_seqs"] for s in d.stats().step_log()["steps"]) == 5, timeout=30, what="5 prompts"
        )
        first = _first_prompt_step(d)
        assert (first["prefill_seqs"] == 5) is whole
    finally:
        d.shutdown()


def test_the_default_window_is_the_engines_and_zero_turns_it_off():
    assert ServeConfig().worker_config().batch_wait_s == BATCH_WAIT_S
    assert ServeConfig().worker_config().batch_wait_max_s == BATCH_WAIT_MAX_S
    assert ServeConfig(batch_wait_ms=0).worker_config().batch_wait_s == 0.0
    d = DecodeWorker(_cfg(), f"bw-default-{next(_names)}", colocated=True)
    try:
        assert d.batch_wait_s == BATCH_WAIT_S  # WorkerConfig's None: the engine's default
    finally:
        d.shutdown()
    with pytest.raises(ConfigError, match="--batch-wait-ms"):
        ServeConfig(batch_wait_ms=-1).validate()
    with pytest.raises(ConfigError, match="--batch-wait-max-ms"):
        ServeConfig(batch_wait_max_ms=5000).validate()


# ---- the simulator -------------------------------------------------------------------------------
FIT = StepCostFit(0.01, 0.001, 0.0, 0.002)  # 10 ms a step, 1 ms a prompt token, 2 ms a sequence


def _chats_at_once(batch_wait_s: float, mode: str = "colocated", chunk: int | None = None) -> list[float]:
    setup = setup_from_steps("tiny", FIT, None, None, "truth", 100)
    specs = [RequestSpec(f"chat-{i}", "x", 40, 4, 0.0, "chat") for i in range(4)]
    cfg = sim_config(mode, chunk, 1, 1, 64, setup.link, batch_wait_s=batch_wait_s)
    return sorted(r.ttft_s for r in simulate_specs(cfg, setup.steps, specs))


def test_the_simulator_starts_an_idle_worker_after_the_window_with_all_that_arrived():
    at_once = _chats_at_once(0.0)
    assert at_once[0] < at_once[1] == at_once[3]  # the first alone, then the other three
    gathered = _chats_at_once(0.002)
    assert gathered[0] == gathered[3] > 0.002  # one step of four, after the window
    # chunked at 128 tokens: the window gathers all four, the chunk budget still splits them
    chunked = _chats_at_once(0.002, "colocated", 128)
    assert chunked[0] == chunked[2] < chunked[3]


def _first_tokens_at(cap_s: float | None, gap_s: float = 0.003) -> list[float]:
    """When each of four chats `gap_s` apart gets its first token (not its TTFT: they arrive apart)."""
    setup = setup_from_steps("tiny", FIT, None, None, "truth", 100)
    specs = [RequestSpec(f"chat-{i}", "x", 40, 4, i * gap_s, "chat") for i in range(4)]
    cfg = sim_config("colocated", None, 1, 1, 64, setup.link, batch_wait_s=0.005, batch_wait_max_s=cap_s)
    return sorted(s.arrival_s + r.ttft_s for s, r in zip(specs, simulate_specs(cfg, setup.steps, specs)))


def test_the_simulator_restarts_the_wait_at_each_arrival_up_to_the_cap():
    gathered = _first_tokens_at(cap_s=0.025)
    assert gathered[0] == pytest.approx(gathered[3])  # one step, after the last one's quiet wait
    assert gathered[0] > 3 * 0.003 + 0.005
    fixed = _first_tokens_at(cap_s=None)  # no cap: a fixed window from the first (the last arrived past it)
    assert fixed[0] < fixed[3]
    capped = _first_tokens_at(cap_s=0.007)
    assert capped[0] < capped[3]


def test_a_prompt_sent_while_the_loop_is_busy_counts_that_wait_as_queue():
    """A colocated worker's queue time runs from the prompt's arrival, not from the loop's intake
    at its next step boundary: a prompt sent while the loop is busy (a long prefill; here a job
    that holds the loop 0.3 s) waits for it, and that wait is queue (before, it read ~0 and the wait
    landed in the serving hop)."""
    d = DecodeWorker(_cfg(batch_wait_s=0.0), f"bw-queue-{next(_names)}", colocated=True)
    try:
        d.post(lambda: time.sleep(0.3))
        d.submit_prompt(_req("late"))  # returns once the loop has taken it in, after the job
        timings = None
        deadline = time.monotonic() + 60
        while timings is None and time.monotonic() < deadline:
            timings = next((ev.timings for ev in d.poll_events(0.2) if ev.index == 0 and ev.timings), None)
        assert timings is not None and timings["queue_ms"] >= 250, timings
    finally:
        d.shutdown()
