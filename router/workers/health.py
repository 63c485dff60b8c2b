"""Worker health: dead workers found and replaced while serving goes on.

A death is noticed however it shows (a failed request, a stats read, a decode worker's event pump,
or this module's health loop pinging every worker, idle ones included) and handled once: the
requests that still need the worker fail at once, and its replacement is started, retried with
backoff until it starts (a replacement cannot be placed while the dead worker's node is down).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from router.workers.handle import WorkerHandle

log = logging.getLogger("pdserve.router")

# Called with a dead worker; returns its replacement (or None if it cannot be replaced).
ReplaceFn = Callable[[WorkerHandle], Awaitable["WorkerHandle | None"]]
HEALTH_INTERVAL_S = 1.0  # every worker is pinged this often (a dead idle prefill worker is found)
HEALTH_TIMEOUT_S = 10.0  # a ping unanswered this long (after transient-error retries) means dead
REPLACE_BACKOFF_MAX_S = 5.0  # between attempts to replace a dead worker whose node is still down


class WorkerHealth:
    def __init__(
        self,
        prefill: list[WorkerHandle],
        decode: list[WorkerHandle],
        replace: ReplaceFn | None,
        fail_requests: Callable[[WorkerHandle], None],
        forget: Callable[[WorkerHandle], None],
        started: Callable[[WorkerHandle], None],
        interval_s: float = HEALTH_INTERVAL_S,
    ):
        """The pools are the orchestrator's own lists: a replacement takes the dead worker's slot
        in place. `fail_requests(w)` ends the requests that need a dead `w`; `forget(w)` drops what
        the router knew of its cache; `started(new)` takes a replacement into service."""
        self.prefill, self.decode = prefill, decode
        self._replace = replace
        self._fail_requests, self._forget, self._started = fail_requests, forget, started
        self.interval_s = interval_s
        self.each_round: Callable[[], Awaitable[None]] | None = None  # after each round of pings
        self.replacing: dict[str, asyncio.Task] = {}  # dead worker name -> its replacement task
        self.replacements = 0  # workers replaced since start (each death once)
        self.closed = False

    def live(self, w: WorkerHandle) -> bool:
        """Alive and not being replaced."""
        return w.alive and w.name not in self.replacing

    async def handle_death(self, prefill: WorkerHandle | None, decode: WorkerHandle) -> None:
        """A request failed: whichever of its workers is really dead (pinged) is handled."""
        for w in (prefill, decode):
            if w is not None and (not w.alive or await self.is_dead(w)):
                await self.on_dead(w)

    async def on_dead(self, w: WorkerHandle) -> None:
        """Fail the requests that still need `w` and start its replacement: once per death, however
        it was noticed (a request, a scrape, the event pump, the health check)."""
        pool = self.prefill if w.role == "prefill" else self.decode
        if w not in pool or w.name in self.replacing:
            return
        w.alive = False
        self._fail_requests(w)
        if self._replace is not None:
            log.warning("%s worker %s is dead; starting its replacement", w.role, w.name)
            self.replacing[w.name] = asyncio.create_task(self._replace_worker(w, pool))

    async def loop(self) -> None:
        """Ping every worker each interval; a dead one (idle or not) is replaced without waiting
        for a request to trip over it."""
        while not self.closed:
            await asyncio.sleep(self.interval_s)
            workers = [w for w in (*self.prefill, *self.decode) if w.name not in self.replacing]
            dead = await asyncio.gather(*(self.is_dead(w) for w in workers))
            for w, d in zip(workers, dead):
                if d and not self.closed:
                    await self.on_dead(w)
            if self.each_round is not None:
                await self.each_round()

    async def _replace_worker(self, dead: WorkerHandle, pool: list[WorkerHandle]) -> None:
        """Start a replacement, retrying with backoff until one starts or the router shuts down: a
        replacement fails while the dead worker's node is down (Ray can place it only on a node
        with the pool's resources), and serving must resume by itself once the node is back."""
        assert self._replace is not None  # only scheduled when there is one
        delay, attempts = 1.0, 0
        try:
            self._forget(dead)
            while not self.closed:
                attempts += 1
                new = await self._replace(dead)
                if new is not None and dead in pool:
                    pool[pool.index(dead)] = new
                    self.replacements += 1
                    log.warning(
                        "replaced dead %s worker %s with %s (attempt %d)", dead.role, dead.name, new.name, attempts
                    )
                    self._started(new)
                    return
                if new is not None or dead not in pool:
                    return
                await asyncio.sleep(delay)
                delay = min(delay * 2, REPLACE_BACKOFF_MAX_S)
        finally:
            self.replacing.pop(dead.name, None)

    async def is_dead(self, w: WorkerHandle) -> bool:
        if not w.alive:
            return True
        try:
            await asyncio.wait_for(w.ping(), timeout=HEALTH_TIMEOUT_S)  # retries transient errors
            return False
        except Exception:  # noqa: BLE001
            return True
