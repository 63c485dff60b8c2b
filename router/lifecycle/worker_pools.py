"""The prefill and decode pools as the router runs them, beside the requests: each decode worker's
event pump, the workers' stats, the prefix-index sync, and their health (router/workers/health.py).

Stats are read for everyone who needs them: placement's load figures (least_loaded, prefix's
tie-break), auto's step fits (the workers' recent steps), the RSS watch, and /metrics. They are
read by a refresh loop a few times a second when a policy or auto needs fresh figures, by each
/metrics scrape, and by the health loop when nothing else read them for `rss_check_s` (the RSS
watch needs a read every so often, even under round robin with no scrape).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from contracts.worker import StreamEvent, WorkerStats
from router.dispatch.dispatcher import AutoDispatcher
from router.lifecycle.placement import Placement
from router.workers.handle import WorkerDied, WorkerHandle
from router.workers.health import ReplaceFn, WorkerHealth
from router.workers.rss_watch import RssWatch

log = logging.getLogger("pdserve.router")
STATS_REFRESH_S = 0.25  # worker stats (load for least_loaded/prefix, step fits for auto) this fresh


class WorkerPools:
    def __init__(
        self,
        mode: str,
        prefill: list[WorkerHandle],
        decode: list[WorkerHandle],
        placement: Placement,
        dispatcher: AutoDispatcher | None,
        route: Callable[[StreamEvent], None],
        fail_requests: Callable[[WorkerHandle], None],
        replace: ReplaceFn | None,
        health_interval_s: float,
        cache_sync_s: float,
        rss_watch: RssWatch | None,
        rss_check_s: float,
    ):
        """`route(ev)` hands a decode worker's event to its request; `fail_requests(w)` ends the
        requests that need a dead `w`. A replacement takes the dead worker's slot in `prefill` or
        `decode` in place, so the lists always hold the pools as they are."""
        self.mode, self.prefill, self.decode = mode, prefill, decode
        self.placement, self.dispatcher = placement, dispatcher
        self._route = route
        self.cache_sync_s = cache_sync_s
        self.rss_watch, self.rss_check_s = rss_watch, rss_check_s  # fed every stats read
        self.health = WorkerHealth(
            prefill, decode, replace, fail_requests, placement.forget, self._started, health_interval_s
        )
        if rss_watch is not None:
            self.health.each_round = self._read_for_rss_watch
        self._tasks: dict[str, asyncio.Task] = {}  # the pumps by worker name, and the loops
        self._stats_read_t = 0.0  # monotonic time of the last stats read
        self.closed = False

    async def start(self) -> None:
        for w in self.decode:
            self._tasks[w.name] = asyncio.create_task(self._pump(w))
        if self.dispatcher is not None or self.placement.policy != "round_robin":
            self._tasks["_stats"] = asyncio.create_task(self._refresh_stats())
        if self.placement.hashes_wanted:  # the prefix policy, and auto's cached prefix per side
            self._tasks["_cache_sync"] = asyncio.create_task(self._sync_prefix_index())
        if self.health.interval_s > 0:
            self._tasks["_health"] = asyncio.create_task(self.health.loop())

    def close(self) -> None:
        """No loop starts another round (the requests still ending may use the workers)."""
        self.closed = self.health.closed = True

    async def stop(self) -> None:
        tasks = [*self._tasks.values(), *self.health.replacing.values()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def status(self) -> dict[str, dict[str, int]]:
        """Per pool: the configured size and how many workers are alive and not being replaced."""
        pools = {"prefill": self.prefill, "decode": self.decode} if self.mode == "disagg" else {"decode": self.decode}
        return {
            role: {"configured": len(ws), "live": sum(1 for w in ws if self.health.live(w))}
            for role, ws in pools.items()
        }

    async def stats(self) -> list[WorkerStats]:
        workers = self.decode if self.mode == "colocated" else self.prefill + self.decode
        results = await asyncio.gather(*(w.stats() for w in workers), return_exceptions=True)
        out = []
        for w, r in zip(workers, results):
            if isinstance(r, WorkerDied):  # noticed by a scrape: replaced like any other death
                await self.health.on_dead(w)
            if isinstance(r, WorkerStats):
                self.placement.worker_stats[w.name] = r
                out.append(r)
        self._stats_read_t = time.monotonic()
        if self.rss_watch is not None:
            self.rss_watch.observe(out)
        return out

    async def _refresh_stats(self) -> None:
        """Read every worker's stats a few times a second: least_loaded (and prefix's tie-break)
        weigh queue depth and free blocks from them, and auto's dispatcher refines its step fits
        from their recent steps. Without this loop only a /metrics scrape refreshed them."""
        while not self.closed:
            try:
                stats = await self.stats()
                if self.dispatcher is not None:
                    self.dispatcher.observe_stats(stats)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - a missed refresh only leaves the last stats a while longer
                log.debug("stats refresh failed: %r", e)
            await asyncio.sleep(STATS_REFRESH_S)

    async def _read_for_rss_watch(self) -> None:
        """Each health round: read the stats if nothing else did lately, for the RSS watch."""
        if time.monotonic() - self._stats_read_t < self.rss_check_s:
            return
        try:
            await self.stats()
        except Exception as e:  # noqa: BLE001 - a missed read only delays the check
            log.debug("stats read for the RSS watch failed: %r", e)

    async def _sync_prefix_index(self) -> None:
        """Poll every live worker's cache events into the prefix index."""
        while not self.closed:
            await self.placement.sync(self.prefill + self.decode)
            await asyncio.sleep(self.cache_sync_s)

    async def _pump(self, worker: WorkerHandle) -> None:
        """Collect token events from one decode worker and route them to their requests."""
        while not self.closed:
            try:
                events = await worker.poll_events(0.05)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - a dead worker fails its requests, then is replaced
                log.error("decode worker %s failed: %r", worker.name, e)
                await self.health.handle_death(None, worker)
                return
            for ev in events:
                self._route(ev)

    def _started(self, new: WorkerHandle) -> None:
        """A replacement is up: a decode worker's events need their pump."""
        if new.role != "prefill":
            self._tasks[new.name] = asyncio.create_task(self._pump(new))
