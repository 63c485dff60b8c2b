"""The orchestrator's bookkeeping over in-process workers (no Ray, the "local" transport): `active`
counts and timelines on every ending (a finished stream, a consumer that stops early, a failed
transfer), and least_loaded reading stats it refreshes itself. Every test ends with every KV block
back on the free lists. The workers' own lifecycle: tests/test_worker_lifecycle.py.
"""

from __future__ import annotations

import asyncio

import pytest

from contracts.worker import GenerateRequest, StreamEvent, WorkerError
from decode_worker.worker import DecodeWorker
from engine.config import PRESETS
from router.lifecycle.orchestrator import STATS_REFRESH_S, Orchestrator
from router.workers.handle import WorkerHandle
from tests.helpers import async_wait_until, wait_until
from tests.local_workers import LONG, NAMES, all_free, make_request, worker_cfg, worker_pair_fixture

make_pair = worker_pair_fixture()


def _orchestrator(mode: str, prefill: list, decode: list) -> Orchestrator:
    ph = [WorkerHandle(w.name, "prefill", w, is_ray=False) for w in prefill]
    dh = [WorkerHandle(w.name, "decode", w, is_ray=False) for w in decode]
    return Orchestrator(mode, PRESETS["tiny"], ph, dh)


async def _drain(orch: Orchestrator, req: GenerateRequest) -> list[StreamEvent]:
    return [ev async for ev in orch.generate(req)]


def test_orchestrator_colocated_timeline_and_active_counts():
    d = DecodeWorker(worker_cfg(), f"lc-colo-{next(NAMES)}", colocated=True)
    orch = _orchestrator("colocated", [], [d])

    async def main():
        await orch.start()
        try:
            evs = await _drain(orch, make_request("o1", 5))
            assert [e.index for e in evs] == list(range(5)) and evs[-1].finish_reason == "length"
            tl = orch.timeline("o1")
            assert tl.finish_reason == "length" and tl.output_tokens == 5
            assert tl.token_ids == [e.token_id for e in evs] and tl.prefill_worker is None
            assert 0 <= tl.first_token_ms <= tl.last_token_ms
            # a consumer that stops early: the request is aborted on the worker, active drops back
            gen = orch.generate(make_request("o2", 50))
            await gen.__anext__()
            await gen.aclose()
            assert orch.timeline("o2").finish_reason == "abort"
            assert all(w.active == 0 for w in orch.decode)
        finally:
            await orch.shutdown()  # waits for the abort it sent to the worker

    try:
        asyncio.run(main())
        wait_until(lambda: all_free(d), 10, "every block freed", interval=0.01)
    finally:
        d.shutdown()


def test_least_loaded_reads_stats_refreshed_without_a_metrics_scrape():
    """least_loaded weighs the workers' own stats (queue depth, free blocks): the orchestrator
    refreshes them itself, so a worker busy with work the router did not count (here a request
    submitted to it directly) is avoided although no /metrics scrape ever ran."""
    busy = DecodeWorker(worker_cfg(num_blocks=128), f"ll-busy-{next(NAMES)}", colocated=True)
    idle = DecodeWorker(worker_cfg(num_blocks=128), f"ll-idle-{next(NAMES)}", colocated=True)
    dh = [WorkerHandle(w.name, "decode", w, is_ray=False) for w in (busy, idle)]
    orch = Orchestrator("colocated", PRESETS["tiny"], [], dh, policy="least_loaded")
    busy.submit_prompt(make_request("direct", 1500, LONG))  # grows on `busy` for seconds; the router never saw it

    async def main():
        await orch.start()
        try:
            await async_wait_until(
                lambda: busy.stats().blocks_free < idle.stats().blocks_free, 10, "the direct request's blocks", 0.02
            )
            await asyncio.sleep(3 * STATS_REFRESH_S)  # at least one refresh after it took them
            await _drain(orch, make_request("ll1", 2))
            assert orch.timeline("ll1").decode_worker == idle.name
        finally:
            await orch.shutdown()

    try:
        asyncio.run(main())
        assert busy.abort("direct")
        wait_until(lambda: all_free(busy, idle), 10, "every block freed", interval=0.01)
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
                await _drain(orch, make_request("f1", 5))
            assert orch.timeline("f1").finish_reason == "error"  # not "abort"
            assert all(w.active == 0 for w in orch.prefill + orch.decode)
            assert all(w.alive for w in orch.prefill + orch.decode)  # failed, not dead
        finally:
            await orch.shutdown()  # waits for the abort it sent to the prefill worker

    asyncio.run(main())
    wait_until(lambda: all_free(p, d), 10, "every block freed", interval=0.01)
