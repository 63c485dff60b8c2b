"""Worker lifecycle without Ray: prefill and decode workers in this process over the "local"
transport. Every test ends with every KV block back on both free lists.

Covers what the serving tests cannot provoke on demand: an engine loop that dies, a pool that
has no free blocks, a prefill lease that runs out before (or while) decode pulls, aborts that land
while a request waits for blocks, while its KV is in flight, or before its submit, and the
orchestrator's bookkeeping (`active`, timelines) on every ending.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time

import pytest

from contracts.worker import GenerateRequest, StreamEvent, WorkerConfig, WorkerError
from decode_worker.worker import DecodeWorker
from engine.config import PRESETS
from engine.sequence import SamplingParams
from prefill_worker.worker import PrefillWorker
from router.lifecycle.orchestrator import STATS_REFRESH_S, Orchestrator
from router.workers.handle import WorkerHandle
from tests.helpers import async_wait_until, wait_until

_names = itertools.count()
PROMPT = list(b"the quick brown fox jumps over")  # 30 tokens: 2 blocks of 16
LONG = list(b"0123456789" * 6)  # 60 tokens: 4 blocks of 16, with room for 4 generated


def _cfg(**kw) -> WorkerConfig:
    return WorkerConfig(**{"model": "tiny", "transport": "local", "num_blocks": 32, **kw})


def _req(rid: str, max_tokens: int = 8, prompt: list[int] = PROMPT) -> GenerateRequest:
    return GenerateRequest(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


@pytest.fixture
def make_pair():
    """make_pair(prefill_kw, decode_kw) -> (PrefillWorker, DecodeWorker); shut down after the test."""
    made = []

    def make(prefill_kw: dict | None = None, decode_kw: dict | None = None):
        n = next(_names)
        p = PrefillWorker(_cfg(**(prefill_kw or {})), f"lc-prefill-{n}")
        d = DecodeWorker(_cfg(**(decode_kw or {})), f"lc-decode-{n}")
        made.append((p, d))
        return p, d

    yield make
    for p, d in made:
        d.shutdown()
        p.shutdown()


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


def _all_free(*workers) -> bool:
    """No block in use on any of `workers`, and each one's ledger holds (free/cached/in use)."""
    for w in workers:
        try:
            w.call(w.engine.blocks.check)  # on the loop thread: the only one that touches blocks
        except WorkerError:
            w.engine.blocks.check()  # the loop is gone: nothing else touches them now
    return all(w.stats().blocks_free == w.stats().blocks_total for w in workers)


def _tokens(events: list[StreamEvent]) -> list[int]:
    return [e.token_id for e in events if e.kind == "token"]


# ---- (1) a dead engine loop: nothing waits forever ---------------------------------------------
def test_prefill_loop_death_fails_waiting_callers_and_ping():
    w = PrefillWorker(_cfg(), f"lc-prefill-{next(_names)}")
    try:

        def boom(on_layer=None):
            raise RuntimeError("kernel exploded")

        w.engine.step = boom
        out: dict = {}

        def caller():
            try:
                out["result"] = w.prefill(_req("r1"))
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
            w.prefill(_req("r2"))
    finally:
        w.shutdown()


def test_decode_loop_death_ends_streams_then_poll_raises():
    d = DecodeWorker(_cfg(), f"lc-colo-{next(_names)}", colocated=True)
    try:
        # The loop itself fails (a failed engine step would only fail its batch: test_step_failure.py)
        real_tick_part = d._start_transfers
        calls = itertools.count()

        def transfers_then_die():
            if next(calls) >= 2:
                raise RuntimeError("decode kernel exploded")
            return real_tick_part()

        d._start_transfers = transfers_then_die
        d.submit_prompt(_req("c1", max_tokens=50))
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
    reqs = [_req("k1", 30), _req("k2", 30, prompt=LONG)]
    for r in reqs:
        d.submit_prefilled(r, p.prefill(r))
    armed.set()
    events = _collect(d, {"k1", "k2"})
    assert all(evs[-1].kind == "error" for evs in events.values())
    wait_until(
        lambda: _all_free(p), 10, "the prefill pool to free every block (pulled or lease expired)", interval=0.01
    )
    d.engine.blocks.check()


def test_calls_after_shutdown_fail_fast():
    w = PrefillWorker(_cfg(), f"lc-prefill-{next(_names)}")
    w.shutdown()
    t0 = time.time()
    with pytest.raises(WorkerError, match="shut down"):
        w.prefill(_req("late"))
    assert time.time() - t0 < 1


# ---- (2) no free blocks: admissions wait without spinning, then proceed -------------------------
def test_blocked_prefill_waits_without_spinning_then_proceeds():
    # 4 blocks: one 60-token prompt parks all of them until its lease runs out
    w = PrefillWorker(_cfg(num_blocks=4, lease_s=1.0), f"lc-prefill-{next(_names)}")
    try:
        w.prefill(_req("a", prompt=list(b"x" * 60)))
        out: dict = {}
        t = threading.Thread(target=lambda: out.setdefault("b", w.prefill(_req("b"))), daemon=True)
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
    r1, r2 = _req("d1", 4, prompt=LONG), _req("d2", 20)
    res1, res2 = p.prefill(r1), p.prefill(r2)
    d.engine.step = _slowed(d.engine.step, 0.2)  # d1 holds the pool for ~0.6 s
    d.submit_prefilled(r1, res1)
    wait_until(lambda: d.stats().blocks_free == 0, 10, "d1 to take every block", interval=0.01)
    d.submit_prefilled(r2, res2)
    s = d.stats()
    assert s.queue_depth >= 1 and s.blocks_free == 0  # stats show the admission waiting
    events = _collect(d, {"d1", "d2"})
    assert [len(_tokens(events[r])) for r in ("d1", "d2")] == [3, 19]  # + the first from prefill
    wait_until(lambda: _all_free(p, d), 10, "every block freed", interval=0.01)


def test_decode_pool_too_small_for_both_preempts_and_recomputes(make_pair):
    p, d = make_pair({}, {"num_blocks": 4})
    # the same prompt twice; each grows to 30 + 20 tokens = 4 blocks, the whole pool: blocks are
    # given on demand, so both are admitted, and the newer is preempted when the pool runs out
    r1, r2 = _req("e1", 20), _req("e2", 20)
    res1, res2 = p.prefill(r1), p.prefill(r2)
    d.submit_prefilled(r1, res1)
    d.submit_prefilled(r2, res2)
    events = _collect(d, {"e1", "e2"})
    assert d.stats().preemptions >= 1 and any(e.kind == "preempted" for e in events["e2"])
    assert len(_tokens(events["e1"])) == 19 and _tokens(events["e1"]) == _tokens(events["e2"])  # greedy
    assert [e.index for e in events["e2"] if e.kind == "token"] == list(range(1, 20))  # nothing twice
    wait_until(lambda: _all_free(p, d), 10, "every block freed", interval=0.01)


# ---- (3) lease expiry racing the pull ------------------------------------------------------------
def test_lease_expired_while_waiting_for_blocks_fails_clearly(make_pair):
    p, d = make_pair({"lease_s": 1.0}, {"num_blocks": 4})
    r1, r2 = _req("l1", 4, prompt=LONG), _req("l2", 20)  # l1 holds the whole decode pool
    res1, res2 = p.prefill(r1), p.prefill(r2)
    d.engine.step = _slowed(d.engine.step, 0.6)  # l1 decodes for ~1.8 s, longer than l2's lease
    d.submit_prefilled(r1, res1)
    d.submit_prefilled(r2, res2)
    events = _collect(d, {"l1", "l2"})
    assert len(_tokens(events["l1"])) == 3
    assert _tokens(events["l2"]) == [] and events["l2"][-1].kind == "error"
    assert "lease" in events["l2"][-1].error and "--lease-s" in events["l2"][-1].error
    wait_until(lambda: _all_free(p, d), 10, "every block freed", interval=0.01)


def test_pull_that_outlives_the_lease_is_discarded(make_pair):
    p, d = make_pair({"lease_s": 0.3}, {})
    real_read = d.transport.read

    def slow_read(handle, blocks, timeout_s, *a):
        out = real_read(handle, blocks, timeout_s, *a)
        time.sleep(max(0.0, handle.lease_deadline - time.time()) + 0.1)  # done, but after the lease
        return out

    d.transport.read = slow_read
    r = _req("x1")
    d.submit_prefilled(r, p.prefill(r))
    events = _collect(d, {"x1"})["x1"]
    assert _tokens(events) == [] and events[-1].kind == "error" and "lease" in events[-1].error
    wait_until(lambda: _all_free(p, d), 10, "every block freed", interval=0.01)


# ---- (4) aborts at every phase free everything and silence the request ---------------------------
def test_abort_while_waiting_for_blocks(make_pair):
    p, d = make_pair({}, {"num_blocks": 4})
    r1, r2 = _req("w1", 4, prompt=LONG), _req("w2", 20)  # w1 holds the whole decode pool
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
    wait_until(lambda: _all_free(p, d), 10, "every block freed", interval=0.01)


def test_abort_during_transfer_discards_the_pull(make_pair):
    p, d = make_pair()
    entered, release = threading.Event(), threading.Event()
    real_read = d.transport.read

    def gated_read(*a, **kw):
        entered.set()
        release.wait(10)
        return real_read(*a, **kw)

    d.transport.read = gated_read
    r = _req("t1")
    d.submit_prefilled(r, p.prefill(r))
    assert entered.wait(10)
    assert d.abort("t1") and p.abort("t1")
    release.set()
    wait_until(lambda: _all_free(p, d), 10, "every block freed", interval=0.01)
    time.sleep(0.1)
    assert [e for e in d.poll_events(0.05) if e.request_id == "t1"] == []


def test_submit_after_its_abort_is_refused(make_pair):
    p, d = make_pair()
    r = _req("s1")
    res = p.prefill(r)
    assert d.abort("s1") is False and p.abort("s1") is True  # decode had not seen it yet
    d.submit_prefilled(r, res)
    events = _collect(d, {"s1"})["s1"]
    assert _tokens(events) == [] and events[-1].finish_reason == "abort"
    wait_until(lambda: _all_free(p, d), 10, "every block freed", interval=0.01)


def test_abort_of_unknown_ids_is_harmless(make_pair):
    p, d = make_pair()
    assert p.abort("nope") is False and d.abort("nope") is False and p.release("nope") is False
    assert _all_free(p, d)


# ---- (5) the orchestrator's bookkeeping -----------------------------------------------------------
def _orchestrator(mode: str, prefill: list, decode: list) -> Orchestrator:
    ph = [WorkerHandle(w.name, "prefill", w, is_ray=False) for w in prefill]
    dh = [WorkerHandle(w.name, "decode", w, is_ray=False) for w in decode]
    return Orchestrator(mode, PRESETS["tiny"], ph, dh)


async def _drain(orch: Orchestrator, req: GenerateRequest) -> list[StreamEvent]:
    return [ev async for ev in orch.generate(req)]


def test_orchestrator_colocated_timeline_and_active_counts():
    d = DecodeWorker(_cfg(), f"lc-colo-{next(_names)}", colocated=True)
    orch = _orchestrator("colocated", [], [d])

    async def main():
        await orch.start()
        try:
            evs = await _drain(orch, _req("o1", 5))
            assert [e.index for e in evs] == list(range(5)) and evs[-1].finish_reason == "length"
            tl = orch.timeline("o1")
            assert tl.finish_reason == "length" and tl.output_tokens == 5
            assert tl.token_ids == [e.token_id for e in evs] and tl.prefill_worker is None
            assert 0 <= tl.first_token_ms <= tl.last_token_ms
            # a consumer that stops early: the request is aborted on the worker, active drops back
            gen = orch.generate(_req("o2", 50))
            await gen.__anext__()
            await gen.aclose()
            assert orch.timeline("o2").finish_reason == "abort"
            assert all(w.active == 0 for w in orch.decode)
        finally:
            await orch.shutdown()  # waits for the abort it sent to the worker

    try:
        asyncio.run(main())
        wait_until(lambda: _all_free(d), 10, "every block freed", interval=0.01)
    finally:
        d.shutdown()


def test_least_loaded_reads_stats_refreshed_without_a_metrics_scrape():
    """least_loaded weighs the workers' own stats (queue depth, free blocks): the orchestrator
    refreshes them itself, so a worker busy with work the router did not count (here a request
    submitted to it directly) is avoided although no /metrics scrape ever ran."""
    busy = DecodeWorker(_cfg(num_blocks=128), f"ll-busy-{next(_names)}", colocated=True)
    idle = DecodeWorker(_cfg(num_blocks=128), f"ll-idle-{next(_names)}", colocated=True)
    dh = [WorkerHandle(w.name, "decode", w, is_ray=False) for w in (busy, idle)]
    orch = Orchestrator("colocated", PRESETS["tiny"], [], dh, policy="least_loaded")
    busy.submit_prompt(_req("direct", 1500, LONG))  # grows on `busy` for seconds; the router never saw it

    async def main():
        await orch.start()
        try:
            await async_wait_until(
                lambda: busy.stats().blocks_free < idle.stats().blocks_free, 10, "the direct request's blocks", 0.02
            )
            await asyncio.sleep(3 * STATS_REFRESH_S)  # at least one refresh after it took them
            await _drain(orch, _req("ll1", 2))
            assert orch.timeline("ll1").decode_worker == idle.name
        finally:
            await orch.shutdown()

    try:
        asyncio.run(main())
        assert busy.abort("direct")
        wait_until(lambda: _all_free(busy, idle), 10, "every block freed", interval=0.01)
    finally:
        busy.shutdown()
        idle.shutdown()


def test_orchestrator_failed_transfer_is_an_error_and_frees_both_pools(make_pair):
    p, d = make_pair({}, {"num_blocks": 4})
    orch = _orchestrator("disagg", [p], [d])

    def broken_read(*a, **kw):
        raise RuntimeError("link down")

    d.transport.read = broken_read

    async def main():
        await orch.start()
        try:
            with pytest.raises(WorkerError, match="link down"):
                await _drain(orch, _req("f1", 5))
            assert orch.timeline("f1").finish_reason == "error"  # not "abort"
            assert all(w.active == 0 for w in orch.prefill + orch.decode)
            assert all(w.alive for w in orch.prefill + orch.decode)  # failed, not dead
        finally:
            await orch.shutdown()  # waits for the abort it sent to the prefill worker

    asyncio.run(main())
    wait_until(lambda: _all_free(p, d), 10, "every block freed", interval=0.01)


def _slowed(step, seconds: float):
    def slow(on_layer=None):
        time.sleep(seconds)
        return step(on_layer)

    return slow
