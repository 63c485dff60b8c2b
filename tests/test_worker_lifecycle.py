"""Worker lifecycle without Ray: prefill and decode workers in this process over the "local"
transport. Every test ends with every KV block back on both free lists.

Covers what the serving tests cannot provoke on demand: an engine loop that dies, a pool that
has no free blocks, a prefill lease that runs out before (or while) decode pulls, and aborts that
land while a request waits for blocks, while its KV is in flight, or before its submit. The
orchestrator's bookkeeping over such workers: tests/test_orchestrator_lifecycle.py.
"""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from contracts.worker import StreamEvent, WorkerError
from decode_worker.worker import DecodeWorker
from prefill_worker.worker import PrefillWorker
from tests.helpers import wait_until
from tests.local_workers import LONG, NAMES, all_free, make_request, worker_cfg, worker_pair_fixture

make_pair = worker_pair_fixture()


def _collect(d: DecodeWorker, rids: set[str], timeout_s: float = 30.0) -> dict[str, list[StreamEvent]]:
    """Poll `d` until every id in `rids` has a finished event; every event seen, by request."""
    out: dict[str, list[StreamEvent]] = {}
    done: set[str] = set()

    def all_done() -> bool:
        for ev in d.poll_events(0.05):  # waits up to 50 ms itself
            out.setdefault(ev.request_id, []).append(ev)
            if ev.finished:
                done.add(ev.request_id)
        return done == rids

    wait_until(all_done, timeout_s, lambda: f"requests {rids - done} to finish", interval=0)
    return out


def _tokens(events: list[StreamEvent]) -> list[int]:
    return [e.token_id for e in events if e.kind == "token"]


# ---- (1) a dead engine loop: nothing waits forever ---------------------------------------------
def test_prefill_loop_death_fails_waiting_callers_and_ping():
    w = PrefillWorker(worker_cfg(), f"lc-prefill-{next(NAMES)}")
    try:

        def boom(on_layer=None):
            raise RuntimeError("kernel exploded")

        w.engine.step = boom
        out: dict = {}

        def caller():
            try:
                out["result"] = w.prefill(make_request("r1"))
            except Exception as e:  # noqa: BLE001
                out["error"] = e

        t = threading.Thread(target=caller, daemon=True)
        t.start()
        t.join(10)
        assert not t.is_alive(), "prefill() hung after the worker's loop died"
        assert isinstance(out.get("error"), WorkerError) and "kernel exploded" in str(out["error"])
        with pytest.raises(WorkerError, match="loop died"):
            w.ping()  # the router's liveness probe sees it, so the pool replaces the worker
        with pytest.raises(WorkerError, match="loop died"):
            w.prefill(make_request("r2"))
    finally:
        w.shutdown()


def test_decode_loop_death_ends_streams_then_poll_raises():
    d = DecodeWorker(worker_cfg(), f"lc-colo-{next(NAMES)}", colocated=True)
    try:
        # The loop itself fails (a failed engine step would only fail its batch: test_step_failure.py)
        real_tick_part = d._start_transfers
        calls = itertools.count()

        def transfers_then_die():
            if next(calls) >= 2:
                raise RuntimeError("decode kernel exploded")
            return real_tick_part()

        d._start_transfers = transfers_then_die
        d.submit_prompt(make_request("c1", max_tokens=50))
        events = _collect(d, {"c1"})["c1"]
        assert events[-1].kind == "error" and "decode kernel exploded" in events[-1].error
        with pytest.raises(WorkerError, match="loop died"):  # drained: the router's pump sees it
            for _ in range(100):
                d.poll_events(0.01)
        with pytest.raises(WorkerError):
            d.ping()
        d.engine.blocks.check()  # the dead pool's ledger still holds (its blocks go with the worker)
    finally:
        d.shutdown()


def test_decode_death_in_disagg_leaves_the_prefill_pool_clean(make_pair):
    p, d = make_pair({"lease_s": 2.0}, {})
    real_step, calls, armed = d.engine.step, itertools.count(), threading.Event()

    def step_then_die(on_layer=None):
        if armed.is_set() and next(calls) >= 3:  # both admitted first: the death hits running streams
            raise RuntimeError("decode kernel exploded")
        return real_step()

    d.engine.step = step_then_die
    reqs = [make_request("k1", 30), make_request("k2", 30, prompt=LONG)]
    for r in reqs:
        d.submit_prefilled(r, p.prefill(r))
    armed.set()
    events = _collect(d, {"k1", "k2"})
    assert all(evs[-1].kind == "error" for evs in events.values())
    wait_until(lambda: all_free(p), 10, "the prefill pool to free every block (pulled or lease expired)", interval=0.01)
    d.engine.blocks.check()


def test_calls_after_shutdown_fail_fast():
    w = PrefillWorker(worker_cfg(), f"lc-prefill-{next(NAMES)}")
    w.shutdown()
    t0 = time.time()
    with pytest.raises(WorkerError, match="shut down"):
        w.prefill(make_request("late"))
    assert time.time() - t0 < 1


# ---- (2) no free blocks: admissions wait without spinning, then proceed -------------------------
def test_blocked_prefill_waits_without_spinning_then_proceeds():
    # 4 blocks: one 60-token prompt parks all of them until its lease runs out
    w = PrefillWorker(worker_cfg(num_blocks=4, lease_s=1.0), f"lc-prefill-{next(NAMES)}")
    try:
        w.prefill(make_request("a", prompt=list(b"x" * 60)))
        out: dict = {}
        t = threading.Thread(target=lambda: out.setdefault("b", w.prefill(make_request("b"))), daemon=True)
        t.start()
        wait_until(lambda: w.stats().queue_depth == 1, 10, "b to queue", interval=0.01)
        steps = w.steps
        time.sleep(0.3)
        assert w.steps == steps, "a loop with nothing it can run counted steps (it spins)"
        t.join(10)
        assert out["b"].first_token >= 0 and w.leases_expired == 1
    finally:
        w.shutdown()


def test_decode_admission_waits_for_blocks_then_proceeds(make_pair):
    p, d = make_pair({}, {"num_blocks": 4})
    # d1's 63-token prompt takes the whole decode pool (4 blocks of 16) from its admission
    r1, r2 = make_request("d1", 4, prompt=LONG), make_request("d2", 20)
    res1, res2 = p.prefill(r1), p.prefill(r2)
    d.engine.step = _slowed(d.engine.step, 0.2)  # d1 holds the pool for ~0.6 s
    d.submit_prefilled(r1, res1)
    wait_until(lambda: d.stats().blocks_free == 0, 10, "d1 to take every block", interval=0.01)
    d.submit_prefilled(r2, res2)
    s = d.stats()
    assert s.queue_depth >= 1 and s.blocks_free == 0  # stats show the admission waiting
    events = _collect(d, {"d1", "d2"})
    assert [len(_tokens(events[r])) for r in ("d1", "d2")] == [3, 19]  # + the first from prefill
    wait_until(lambda: all_free(p, d), 10, "every block freed", interval=0.01)


def test_decode_pool_too_small_for_both_preempts_and_recomputes(make_pair):
    p, d = make_pair({}, {"num_blocks": 4})
    # the same prompt twice; each grows to 30 + 20 tokens = 4 blocks, the whole pool: blocks are
    # given on demand, so both are admitted, and the newer is preempted when the pool runs out
    r1, r2 = make_request("e1", 20), make_request("e2", 20)
    res1, res2 = p.prefill(r1), p.prefill(r2)
    d.submit_prefilled(r1, res1)
    d.submit_prefilled(r2, res2)
    events = _collect(d, {"e1", "e2"})
    assert d.stats().preemptions >= 1 and any(e.kind == "preempted" for e in events["e2"])
    assert len(_tokens(events["e1"])) == 19 and _tokens(events["e1"]) == _tokens(events["e2"])  # greedy
    assert [e.index for e in events["e2"] if e.kind == "token"] == list(range(1, 20))  # nothing twice
    wait_until(lambda: all_free(p, d), 10, "every block freed", interval=0.01)


# ---- (3) lease expiry racing the pull ------------------------------------------------------------
def test_lease_expired_while_waiting_for_blocks_fails_clearly(make_pair):
    p, d = make_pair({"lease_s": 1.0}, {"num_blocks": 4})
    r1, r2 = make_request("l1", 4, prompt=LONG), make_request("l2", 20)  # l1 holds the whole decode pool
    res1, res2 = p.prefill(r1), p.prefill(r2)
    d.engine.step = _slowed(d.engine.step, 0.6)  # l1 decodes for ~1.8 s, longer than l2's lease
    d.submit_prefilled(r1, res1)
    d.submit_prefilled(r2, res2)
    events = _collect(d, {"l1", "l2"})
    assert len(_tokens(events["l1"])) == 3
    assert _tokens(events["l2"]) == [] and events["l2"][-1].kind == "error"
    assert "lease" in events["l2"][-1].error and "--lease-s" in events["l2"][-1].error
    wait_until(lambda: all_free(p, d), 10, "every block freed", interval=0.01)


def test_pull_that_outlives_the_lease_is_discarded(make_pair):
    p, d = make_pair({"lease_s": 0.3}, {})
    real_read = d.transport.read

    def slow_read(handle, blocks, timeout_s, *a):
        out = real_read(handle, blocks, timeout_s, *a)
        time.sleep(max(0.0, handle.lease_deadline - time.time()) + 0.1)  # done, but after the lease
        return out

    d.transport.read = slow_read
    r = make_request("x1")
    d.submit_prefilled(r, p.prefill(r))
    events = _collect(d, {"x1"})["x1"]
    assert _tokens(events) == [] and events[-1].kind == "error" and "lease" in events[-1].error
    wait_until(lambda: all_free(p, d), 10, "every block freed", interval=0.01)


# ---- (4) aborts at every phase free everything and silence the request ---------------------------
def test_abort_while_waiting_for_blocks(make_pair):
    p, d = make_pair({}, {"num_blocks": 4})
    r1, r2 = make_request("w1", 4, prompt=LONG), make_request("w2", 20)  # w1 holds the whole decode pool
    res1, res2 = p.prefill(r1), p.prefill(r2)
    d.engine.step = _slowed(d.engine.step, 0.1)
    d.submit_prefilled(r1, res1)
    d.submit_prefilled(r2, res2)
    assert d.abort("w2") and p.abort("w2")
    events = _collect(d, {"w1"})
    time.sleep(0.1)
    for ev in d.poll_events(0.05):
        events.setdefault(ev.request_id, []).append(ev)
    assert "w2" not in events
    wait_until(lambda: all_free(p, d), 10, "every block freed", interval=0.01)


def test_abort_during_transfer_discards_the_pull(make_pair):
    p, d = make_pair()
    entered, release = threading.Event(), threading.Event()
    real_read = d.transport.read

    def gated_read(*a, **kw):
        entered.set()
        release.wait(10)
        return real_read(*a, **kw)

    d.transport.read = gated_read
    r = make_request("t1")
    d.submit_prefilled(r, p.prefill(r))
    assert entered.wait(10)
    assert d.abort("t1") and p.abort("t1")
    release.set()
    wait_until(lambda: all_free(p, d), 10, "every block freed", interval=0.01)
    time.sleep(0.1)
    assert [e for e in d.poll_events(0.05) if e.request_id == "t1"] == []


def test_submit_after_its_abort_is_refused(make_pair):
    p, d = make_pair()
    r = make_request("s1")
    res = p.prefill(r)
    assert d.abort("s1") is False and p.abort("s1") is True  # decode had not seen it yet
    d.submit_prefilled(r, res)
    events = _collect(d, {"s1"})["s1"]
    assert _tokens(events) == [] and events[-1].finish_reason == "abort"
    wait_until(lambda: all_free(p, d), 10, "every block freed", interval=0.01)


def test_abort_of_unknown_ids_is_harmless(make_pair):
    p, d = make_pair()
    assert p.abort("nope") is False and d.abort("nope") is False and p.release("nope") is False
    assert all_free(p, d)


def _slowed(step, seconds: float):
    def slow(on_layer=None):
        time.sleep(seconds)
        return step(on_layer)

    return slow
