"""Orchestrator: the router's request lifecycle over prefill and decode pools.

Disaggregated:  pick (prefill, decode) -> prefill.prefill(req) -> stream the first token (TTFT)
                -> decode.submit_prefilled(req, result) -> decode pulls KV, streams the rest.
Colocated:      pick decode -> decode.submit_prompt(req) -> stream every token.
Auto:           both pools; router/dispatch.py decides per request which of the two above runs.

Tokens come back through one pump task per decode worker (`poll_events` long-poll) and are
routed to per-request queues. Every phase is stamped into a per-request timeline.

Policies: round_robin; least_loaded (router-assigned requests + queue depth, then free KV
blocks); prefix (the worker of each pool holding the longest cached prefix of the request, from
a PrefixIndex fed by the workers' cache events; ties and misses go to the least loaded).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable

from contracts.worker import GenerateRequest, PrefillResult, StreamEvent, WorkerError, WorkerStats
from engine.config import ModelConfig
from engine.prefix_cache import block_hashes
from router.dispatch import AutoDispatcher, Stream
from router.prefix_index import PrefixIndex
from router.rss_watch import RSS_CHECK_S, RssWatch
from router.worker_handle import WorkerDied, WorkerHandle

log = logging.getLogger("pdserve.router")
TIMELINES_KEPT = 2048
REPLACE_BACKOFF_MAX_S = 5.0  # between attempts to replace a dead worker whose node is still down

# Called with a dead worker; returns its replacement (or None if it cannot be replaced).
ReplaceFn = Callable[[WorkerHandle], Awaitable["WorkerHandle | None"]]
HEALTH_INTERVAL_S = 1.0  # every worker is pinged this often (a dead idle prefill worker is found)
HEALTH_TIMEOUT_S = 10.0  # a ping unanswered this long (after transient-error retries) means dead
STATS_REFRESH_S = 0.25  # worker stats (load for least_loaded/prefix, step fits for auto) this fresh
# What a prefill worker's death can still break: requests waiting for it, or pulling its KV.
# Past the pull ("decode"), the KV lives on the decode worker and the stream needs nothing from it.
NEEDS_PREFILL = ("prefill", "pull")


class Orchestrator:
    def __init__(
        self,
        mode: str,
        model_config: ModelConfig,
        prefill: list[WorkerHandle],
        decode: list[WorkerHandle],
        policy: str = "round_robin",
        eos_ids: tuple[int, ...] = (),
        replace: ReplaceFn | None = None,
        on_shutdown: Callable[[list[WorkerHandle]], Awaitable[None]] | None = None,
        link_gbps: float | None = None,
        dispatcher: AutoDispatcher | None = None,
        block_size: int = 16,
        cache_sync_s: float = 0.05,
        health_interval_s: float = HEALTH_INTERVAL_S,
        rss_watch: RssWatch | None = None,
    ):
        if mode not in ("disagg", "colocated", "auto"):
            raise ValueError(f"mode must be disagg, colocated or auto, got {mode!r}")
        if (mode == "auto") != (dispatcher is not None):
            raise ValueError("auto mode needs a dispatcher (and only auto mode takes one)")
        if policy not in ("round_robin", "least_loaded", "prefix"):
            raise ValueError(f"policy must be round_robin, least_loaded or prefix, got {policy!r}")
        if not decode or (mode != "colocated" and not prefill):
            raise ValueError("need at least one decode worker (and one prefill worker in disagg/auto mode)")
        self.mode, self.model_config, self.policy = mode, model_config, policy
        self.prefill, self.decode = prefill, decode
        self.eos_ids = set(eos_ids) | ({model_config.eos_token_id} if model_config.eos_token_id is not None else set())
        self._replace, self._on_shutdown = replace, on_shutdown
        self.link_gbps = link_gbps  # nominal Gbit/s between the pools, shown beside each measured pull
        self._rr = {"prefill": itertools.count(), "decode": itertools.count()}
        self._streams: dict[str, asyncio.Queue[StreamEvent]] = {}
        self._assigned: dict[str, tuple[WorkerHandle | None, WorkerHandle]] = {}
        self._timelines: OrderedDict[str, dict] = OrderedDict()
        self._stats: dict[str, WorkerStats] = {}
        self._pumps: dict[str, asyncio.Task] = {}
        self._transfer_bytes, self._transfer_seconds = 0, 0.0
        self._closed = False
        self._cleanup: set[asyncio.Task] = set()
        self._replacing: dict[str, asyncio.Task] = {}  # dead worker name -> its replacement task
        self.dispatcher = dispatcher
        self._local_open: dict[str, set[str]] = {}  # auto, colocated: decode worker -> prompts before their 1st token
        self._last_token_t: dict[str, float] = {}  # request id -> time of its last token (stall outcome)
        self.block_size, self.cache_sync_s = block_size, cache_sync_s
        self.prefix_index = PrefixIndex()  # policy "prefix": which worker caches which blocks
        self._cache_sync: asyncio.Task | None = None
        # one drain at a time per worker: draining is destructive, and two drains applied out of
        # order could re-add an evicted hash (or drop a stored one)
        self._sync_locks: dict[str, asyncio.Lock] = {}
        self._phase: dict[str, str] = {}  # request id -> "prefill" | "pull" | "decode"
        self._health_interval_s = health_interval_s
        self._health: asyncio.Task | None = None
        self.replacements = 0  # workers replaced since start (each death once)
        self.rss_watch = rss_watch  # fed every stats read; warns when a worker's RSS keeps growing
        self._stats_read_t = 0.0  # monotonic time of the last stats() (the health loop reads if stale)

    # ---- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        for w in self.decode:
            self._pumps[w.name] = asyncio.create_task(self._pump(w))
        if self.dispatcher is not None or self.policy != "round_robin":
            self._pumps["_stats"] = asyncio.create_task(self._refresh_stats())
        if self.policy == "prefix" or self.dispatcher is not None:  # auto: the cached prefix per side
            self._cache_sync = asyncio.create_task(self._sync_prefix_index())
        if self._health_interval_s > 0:
            self._health = asyncio.create_task(self._health_loop())

    async def shutdown(self) -> None:
        self._closed = True
        if self._cleanup:  # aborts of requests that ended early still reach the workers
            await asyncio.wait(list(self._cleanup), timeout=10)
        tasks = [*self._pumps.values(), *self._replacing.values()]
        tasks += [t for t in (self._cache_sync, self._health) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._on_shutdown is not None:
            await self._on_shutdown(self.prefill + self.decode)

    # ---- public API (used by router/app.py) ----------------------------------------------------
    def queue_depth(self) -> int:
        return len(self._streams)

    def pool_status(self) -> dict[str, dict[str, int]]:
        """Per pool: the configured size and how many workers are alive and not being replaced."""
        pools = {"prefill": self.prefill, "decode": self.decode} if self.mode == "disagg" else {"decode": self.decode}
        return {
            role: {"configured": len(ws), "live": sum(1 for w in ws if w.alive and w.name not in self._replacing)}
            for role, ws in pools.items()
        }

    def transfer_totals(self) -> tuple[int, float]:
        return self._transfer_bytes, self._transfer_seconds

    def timeline(self, request_id: str) -> dict | None:
        return self._timelines.get(request_id)

    async def stats(self) -> list[WorkerStats]:
        workers = self.decode if self.mode == "colocated" else self.prefill + self.decode
        results = await asyncio.gather(*(w.stats() for w in workers), return_exceptions=True)
        out = []
        for w, r in zip(workers, results):
            if isinstance(r, WorkerDied):  # noticed by a scrape: replaced like any other death
                await self._on_dead(w)
            if isinstance(r, WorkerStats):
                self._stats[w.name] = r
                out.append(r)
        self._stats_read_t = time.monotonic()
        if self.rss_watch is not None:
            self.rss_watch.observe(out)
        return out

    async def generate(self, req: GenerateRequest) -> AsyncIterator[StreamEvent]:
        rid = req.request_id
        tl = self._new_timeline(req)
        queue: asyncio.Queue[StreamEvent] = asyncio.Queue()
        self._streams[rid] = queue
        # auto prices a prompt after the prefix each side already caches
        wants_hashes = self.policy == "prefix" or self.dispatcher is not None
        hashes = block_hashes(req.prompt_ids, self.block_size) if wants_hashes else []
        decode = self._pick(self.decode, "decode", hashes)
        prefill = self._pick(self.prefill, "prefill", hashes) if self.mode != "colocated" else None
        if self.dispatcher is not None:
            assert prefill is not None  # auto has both pools
            prefill = self._dispatch(req, tl, prefill, decode, hashes)
        if hashes:  # what the router expected each side to hold (its index may lag by one poll)
            tl["routed_prefix_blocks"] = {
                w.role: self.prefix_index.matched_blocks(w.name, hashes) for w in (prefill, decode) if w is not None
            }
        self._assigned[rid] = (prefill, decode)
        for w in (prefill, decode):
            if w is not None:
                w.active += 1
        tl.update(decode_worker=decode.name, prefill_worker=prefill.name if prefill else None)
        reason = "; ".join(f"{w.role} {w.name}: {self._why(w, hashes)}" for w in (prefill, decode) if w is not None)
        tl.update(policy=self.policy, dispatch_reason=reason, dispatched_ms=self._rel(tl, time.time()))
        if prefill is None and self.mode == "colocated":  # auto's local prompts are added by _dispatch
            self._local_open.setdefault(decode.name, set()).add(rid)
        finished = False
        try:
            if prefill is not None:
                self._phase[rid] = "prefill"
                result: PrefillResult = await prefill.prefill(req)
                first = StreamEvent(
                    rid,
                    "token",
                    result.first_token,
                    0,
                    t=time.time(),
                    logprob=result.first_logprob,
                    prompt_logprobs=result.prompt_logprobs,
                )
                tl.update(
                    queue_ms=result.timings["queue_ms"],
                    prefill_ms=result.timings["prefill_ms"],
                    prefill_start_ms=self._rel(tl, result.timings.get("prefill_start", result.timings["prefill_end"])),
                    prefill_end_ms=self._rel(tl, result.timings["prefill_end"]),
                    kv_blocks=len(result.handle.block_ids),
                    prefill_cached_tokens=int(result.timings.get("cached_tokens", 0)),
                )
                if self._first_is_last(req, result.first_token):
                    await prefill.release(rid)
                    first.finished = True
                    first.finish_reason = "length" if req.params.max_tokens == 1 else "stop"
                self._on_token(tl, first)
                yield first
                if first.finished:
                    finished = True
                    return
                self._phase[rid] = "pull"
                await decode.submit_prefilled(req, result)
            else:
                await decode.submit_prompt(req)
            while True:
                ev = await queue.get()
                if ev.kind == "error":
                    raise WorkerError(ev.error or "worker error")
                if ev.kind == "admitted":
                    self._phase[rid] = "decode"  # the KV is on the decode worker now
                    self._on_admitted(tl, ev)
                    continue
                if ev.kind == "preempted":  # KV taken back under memory pressure; recomputed, not re-sent
                    tl["preemptions"] = tl.get("preemptions", 0) + 1
                    continue
                self._on_token(tl, ev)
                if ev.finished and self.policy == "prefix":
                    # Read-your-writes for the next turn: a client that sends turn 2 once turn 1
                    # ended must find turn 1's blocks in the index, not wait for the next poll
                    # (under load a poll round can take longer than the client's reply).
                    await self._sync_workers([w for w in (prefill, decode) if w is not None])
                yield ev
                if ev.finished:
                    finished = True
                    return
        except WorkerError as e:
            tl["finish_reason"] = "error"
            # Not only WorkerDied: a worker whose engine loop died still answers Ray calls but
            # fails every request, and a failed KV pull often means the prefill side is gone.
            # _handle_death pings both and replaces whichever is really dead.
            await self._handle_death(prefill, decode)
            raise WorkerError(str(e)) from None
        finally:
            self._streams.pop(rid, None)
            self._assigned.pop(rid, None)
            self._last_token_t.pop(rid, None)
            self._local_open.get(decode.name, set()).discard(rid)
            if self.dispatcher is not None:
                self.dispatcher.forget(rid)  # no-op once its first token came
            self._phase.pop(rid, None)
            for w in (prefill, decode):
                if w is not None:
                    w.active -= 1
            if not finished:
                tl.setdefault("finish_reason", "abort")
                # A task, not an await: when the caller was cancelled (client disconnect), an
                # await here would be cancelled too and the workers would keep the request.
                task = asyncio.get_running_loop().create_task(self._abort_on(rid, prefill, decode))
                self._cleanup.add(task)
                task.add_done_callback(self._cleanup.discard)

    async def abort(self, request_id: str) -> None:
        pair = self._assigned.get(request_id)
        if pair is not None:
            await self._abort_on(request_id, *pair)

    # ---- auto mode -----------------------------------------------------------------------------
    def dispatch_summary(self) -> dict | None:
        return self.dispatcher.summary() if self.dispatcher is not None else None

    def _dispatch(
        self, req: GenerateRequest, tl: dict, prefill: WorkerHandle, decode: WorkerHandle, hashes: list[int]
    ) -> WorkerHandle | None:
        """Ask the dispatcher; returns the prefill worker for remote, None for local."""
        assert self.dispatcher is not None
        now = time.time()
        tl["max_tokens"] = req.params.max_tokens
        streams = self._streams_on(decode, now)
        n = len(req.prompt_ids)
        bs = self.block_size
        cached = [min(n - 1, self.prefix_index.matched_blocks(w.name, hashes) * bs) for w in (decode, prefill)]
        decision = self.dispatcher.decide(
            n, cached[0], cached[1], streams, now, decode.name, prefill.name, request_id=req.request_id
        )
        tl["dispatch"] = decision.to_dict()
        if decision.choice == "local":
            self._local_open.setdefault(decode.name, set()).add(req.request_id)
            return None
        return prefill

    def _streams_on(self, decode: WorkerHandle, now: float) -> list[Stream]:
        """The sequences decoding on `decode`: local ones past their first token, remote ones
        admitted (their KV pulled)."""
        out = []
        for rid, (p, d) in self._assigned.items():
            other = self._timelines.get(rid)
            if d is not decode or other is None or "first_token_ms" not in other:
                continue
            if p is None or "decode_admitted_ms" in other:
                out.append(
                    Stream(
                        other["prompt_tokens"] + other["output_tokens"],
                        other["output_tokens"],
                        max(0.0, now - other["arrival"] - other["first_token_ms"] / 1e3),
                        other.get("max_tokens", 0),
                    )
                )
        return out

    async def _refresh_stats(self) -> None:
        """Read every worker's stats a few times a second: least_loaded (and prefix's tie-break)
        weigh queue depth and free blocks from them, and auto's dispatcher refines its step fits
        from their recent steps. Without this loop only a /metrics scrape refreshed them."""
        while not self._closed:
            try:
                stats = await self.stats()
                if self.dispatcher is not None:
                    self.dispatcher.observe_stats(stats)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - a missed refresh only leaves the last stats a while longer
                log.debug("stats refresh failed: %r", e)
            await asyncio.sleep(STATS_REFRESH_S)

    # ---- internals -----------------------------------------------------------------------------
    async def _abort_on(self, rid: str, prefill: WorkerHandle | None, decode: WorkerHandle) -> None:
        calls = [w.abort(rid) for w in (prefill, decode) if w is not None and w.alive]
        for r in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(r, Exception) and not isinstance(r, WorkerDied):
                log.warning("abort of %s failed: %r", rid, r)

    def _first_is_last(self, req: GenerateRequest, token: int) -> bool:
        p = req.params
        return p.max_tokens == 1 or token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_ids)

    def _pick(self, workers: list[WorkerHandle], role: str, hashes: list[int]) -> WorkerHandle:
        alive = [w for w in workers if w.alive] or workers
        if self.policy == "round_robin":
            return alive[next(self._rr[role]) % len(alive)]

        def load(w: WorkerHandle) -> tuple[int, int]:
            s = self._stats.get(w.name)
            return (w.active + (s.queue_depth if s else 0), -(s.blocks_free if s else 0))

        if self.policy == "prefix":
            return min(alive, key=lambda w: (-self.prefix_index.matched_blocks(w.name, hashes), load(w)))
        return min(alive, key=load)

    def _why(self, w: WorkerHandle, hashes: list[int]) -> str:
        """The policy's reason for picking `w` (a trace's dispatch span shows it)."""
        if self.policy == "round_robin":
            return "round_robin: next in turn"
        s = self._stats.get(w.name)
        load = f"{w.active} active + {s.queue_depth if s else 0} queued, {s.blocks_free if s else '?'} blocks free"
        if self.policy == "prefix":
            return f"prefix: {self.prefix_index.matched_blocks(w.name, hashes)} cached blocks matched; {load}"
        return f"least_loaded: {load}"

    async def _sync_prefix_index(self) -> None:
        """Policy "prefix": poll every live worker's cache events into the index."""
        while not self._closed:
            await self._sync_workers(self.prefill + self.decode)
            await asyncio.sleep(self.cache_sync_s)

    async def _sync_workers(self, workers: list[WorkerHandle]) -> None:
        """Drain these workers' cache events into the index (a failed call is retried next poll)."""

        async def one(w: WorkerHandle) -> None:
            async with self._sync_locks.setdefault(w.name, asyncio.Lock()):
                r = await w.cache_events()
                self.prefix_index.apply(w.name, r)

        await asyncio.gather(*(one(w) for w in workers if w.alive), return_exceptions=True)

    async def _pump(self, worker: WorkerHandle) -> None:
        """Collect token events from one decode worker and route them to request queues."""
        while not self._closed:
            try:
                events = await worker.poll_events(0.05)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - a dead worker fails its requests, then is replaced
                log.error("decode worker %s failed: %r", worker.name, e)
                await self._handle_death(None, worker)
                return
            for ev in events:
                q = self._streams.get(ev.request_id)
                if q is not None:
                    q.put_nowait(ev)

    async def _handle_death(self, prefill: WorkerHandle | None, decode: WorkerHandle) -> None:
        """A request failed: whichever of its workers is really dead (pinged) is handled."""
        for w in (prefill, decode):
            if w is not None and (not w.alive or await self._is_dead(w)):
                await self._on_dead(w)

    async def _on_dead(self, w: WorkerHandle) -> None:
        """Fail the requests that still need `w` and start its replacement: once per death, however
        it was noticed (a request, a scrape, the event pump, the health check)."""
        pool = self.prefill if w.role == "prefill" else self.decode
        if w not in pool or w.name in self._replacing:
            return
        w.alive = False
        for rid, pair in list(self._assigned.items()):
            if w not in pair or rid not in self._streams:
                continue
            if w.role == "prefill" and pair[1] is not w and self._phase.get(rid) not in NEEDS_PREFILL:
                continue  # already decoding from its own copy of the KV
            self._streams[rid].put_nowait(
                StreamEvent(rid, "error", finished=True, finish_reason="error", error=f"{w.role} worker {w.name} died")
            )
        if self._replace is not None:
            log.warning("%s worker %s is dead; starting its replacement", w.role, w.name)
            self._replacing[w.name] = asyncio.create_task(self._replace_worker(w, pool))

    async def _health_loop(self) -> None:
        """Ping every worker each interval; a dead one (idle or not) is replaced without waiting
        for a request to trip over it."""
        while not self._closed:
            await asyncio.sleep(self._health_interval_s)
            workers = [w for w in (*self.prefill, *self.decode) if w.name not in self._replacing]
            dead = await asyncio.gather(*(self._is_dead(w) for w in workers))
            for w, d in zip(workers, dead):
                if d and not self._closed:
                    await self._on_dead(w)
            if self.rss_watch is not None and time.monotonic() - self._stats_read_t >= RSS_CHECK_S:
                try:  # nothing else read the stats lately (round robin, no scrape): read them for the watch
                    await self.stats()
                except Exception as e:  # noqa: BLE001 - a missed read only delays the check
                    log.debug("stats read for the RSS watch failed: %r", e)

    async def _replace_worker(self, dead: WorkerHandle, pool: list[WorkerHandle]) -> None:
        """Start a replacement, retrying with backoff until one starts or the router shuts down: a
        replacement fails while the dead worker's node is down (Ray can place it only on a node
        with the pool's resources), and serving must resume by itself once the node is back."""
        assert self._replace is not None  # only scheduled when there is one
        delay, attempts = 1.0, 0
        try:
            self.prefix_index.forget(dead.name)  # its cache died with it
            while not self._closed:
                attempts += 1
                new = await self._replace(dead)
                if new is not None and dead in pool:
                    pool[pool.index(dead)] = new
                    self.replacements += 1
                    log.warning(
                        "replaced dead %s worker %s with %s (attempt %d)", dead.role, dead.name, new.name, attempts
                    )
                    if new.role != "prefill":
                        self._pumps[new.name] = asyncio.create_task(self._pump(new))
                    return
                if new is not None or dead not in pool:
                    return
                await asyncio.sleep(delay)
                delay = min(delay * 2, REPLACE_BACKOFF_MAX_S)
        finally:
            self._replacing.pop(dead.name, None)

    async def _is_dead(self, w: WorkerHandle) -> bool:
        if not w.alive:
            return True
        try:
            await asyncio.wait_for(w.ping(), timeout=HEALTH_TIMEOUT_S)  # retries transient errors
            return False
        except Exception:  # noqa: BLE001
            return True

    # ---- timelines -----------------------------------------------------------------------------
    def _new_timeline(self, req: GenerateRequest) -> dict:
        tl = {
            "request_id": req.request_id,
            "mode": self.mode,
            "arrival": req.arrival,
            "prompt_tokens": len(req.prompt_ids),
            "output_tokens": 0,
            "token_ids": [],
            # each token's step end at its worker (ms after arrival): against the client's receive
            # time, the serving path's own cost per token (`bench serve`: "serving overhead")
            "token_ms": [],
        }
        self._timelines[req.request_id] = tl
        while len(self._timelines) > TIMELINES_KEPT:
            self._timelines.popitem(last=False)
        return tl

    def _track_gaps(self, tl: dict, ev: StreamEvent) -> None:
        """Auto: a stream's token gap counts against every local prompt prefilling beside it
        (the realized stall of a local decision: the longest gap its neighbours saw)."""
        rid = ev.request_id
        prev = self._last_token_t.get(rid)
        self._last_token_t[rid] = ev.t
        if prev is None:
            return
        pair = self._assigned.get(rid)
        if pair is None:
            return
        for other in self._local_open.get(pair[1].name, ()):
            otl = self._timelines.get(other)
            if other != rid and otl is not None and "first_token_ms" not in otl and ev.t > otl["arrival"]:
                gap = round((ev.t - max(prev, otl["arrival"])) * 1e3, 3)
                otl["local_max_gap_ms"] = max(otl.get("local_max_gap_ms", 0.0), gap)

    @staticmethod
    def _rel(tl: dict, t: float) -> float:
        return round((t - tl["arrival"]) * 1e3, 3)

    def _on_admitted(self, tl: dict, ev: StreamEvent) -> None:
        tl["decode_admitted_ms"] = self._rel(tl, ev.t)
        if ev.timings:  # the decode side's prefix-cache hit, and the blocks it pulled for the rest
            tl["decode_cached_tokens"] = int(ev.timings.get("cached_tokens", 0))
            tl["kv_blocks_pulled"] = int(ev.timings.get("blocks_pulled", 0))
        if ev.transfer is not None:
            s = ev.transfer
            self._transfer_bytes += s.bytes
            self._transfer_seconds += s.seconds
            tl["transfer"] = {
                "backend": s.backend,
                "bytes": s.bytes,
                "descriptors": s.descriptors,
                "ms": round(s.seconds * 1e3, 3),
                "gbytes_per_s": round(s.gbytes_per_s, 3),
                "link_ms": {k: round(v, 4) for k, v in s.link_ms.items()},
                "gbits_per_s": round(s.gbytes_per_s * 8, 3),
            }
            if self.link_gbps:  # the link this deployment runs on: measured beside nominal
                tl["transfer"].update(
                    link_gbits_per_s=self.link_gbps,
                    link_nominal_ms=round(s.bytes * 8 / (self.link_gbps * 1e9) * 1e3, 3),
                    rate_vs_link=round(s.gbytes_per_s * 8 / self.link_gbps, 3),
                )
            if self.dispatcher is not None:
                self.dispatcher.observe_transfer(s.bytes, s.seconds)
            if "prefill_end_ms" in tl:  # admission wait = time between prefill end and decode join, less the pull
                tl["decode_wait_ms"] = round(tl["decode_admitted_ms"] - tl["prefill_end_ms"] - s.seconds * 1e3, 3)

    def _on_token(self, tl: dict, ev: StreamEvent) -> None:
        t = self._rel(tl, ev.t)
        if self.dispatcher is not None or self.mode == "colocated":  # the stall beside local prefills
            self._track_gaps(tl, ev)
        if ev.index == 0:
            tl["first_token_ms"] = t
            pair = self._assigned.get(tl["request_id"])
            if pair is not None:  # prefilled: its neighbours' gaps no longer count against it
                self._local_open.get(pair[1].name, set()).discard(tl["request_id"])
            if ev.timings:  # colocated: the decode worker timed the prompt's queue and prefill
                tl.update({k: round(v, 3) for k, v in ev.timings.items()})
            if self.dispatcher is not None:
                pair = self._assigned.get(tl["request_id"])
                local = pair is not None and pair[0] is None
                ctxs = [s.context for s in self._streams_on(pair[1], ev.t)] if local and pair else []
                self.dispatcher.record_outcome(tl, streams=ctxs)
        tl["last_token_ms"] = t
        tl["output_tokens"] = ev.index + 1
        tl["token_ids"].append(ev.token_id)  # lets clients check greedy equality across modes
        tl["token_ms"].append(t)
        if ev.finished:
            tl["finish_reason"] = ev.finish_reason
