"""Orchestrator: the router's request lifecycle over prefill and decode pools.

Disaggregated:  pick (prefill, decode) -> prefill.prefill(req) -> stream the first token (TTFT)
                -> decode.submit_prefilled(req, result) -> decode pulls KV, streams the rest.
  layer-wise:   pick (prefill, decode) -> decode.open_stream(req) reserves its blocks ->
                prefill.prefill(req, stream) announces each group of layers to the decode
                worker, which pulls it at once -> stream the first token -> the decode worker
                admits the request when the last group lands (router/dispatch/kv_transfer_policy.py says
                which requests stream).
Colocated:      pick decode -> decode.submit_prompt(req) -> stream every token.
Auto:           both pools; router/dispatch/dispatcher.py decides per request which of the two above runs.

Tokens come back through one pump task per decode worker (`poll_events` long-poll) and are routed
to each request's queue (router/lifecycle/request_state.py). Every phase is stamped into the request's
timeline (router/observe/timeline.py). Which worker serves a request is router/lifecycle/placement.py's call; the
workers' pumps, stats and health are router/lifecycle/worker_pools.py's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable

from contracts.worker import GenerateRequest, PrefillResult, StreamEvent, WorkerError, WorkerStats
from engine.config import ModelConfig
from router.dispatch.dispatcher import AutoDispatcher
from router.dispatch.kv_transfer_policy import KVTransferPolicy
from router.lifecycle.decode_streams import DecodeStreams
from router.lifecycle.placement import Placement
from router.lifecycle.request_state import RequestState
from router.lifecycle.worker_pools import STATS_REFRESH_S, WorkerPools
from router.observe.timeline import Timeline
from router.workers.handle import WorkerDied, WorkerHandle
from router.workers.health import HEALTH_INTERVAL_S, ReplaceFn
from router.workers.rss_watch import RSS_CHECK_S, RssWatch

__all__ = ["HEALTH_INTERVAL_S", "STATS_REFRESH_S", "TIMELINES_KEPT", "Orchestrator", "ReplaceFn"]

log = logging.getLogger("pdserve.router")
TIMELINES_KEPT = 2048


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
        kv_policy: KVTransferPolicy | None = None,
    ):
        if mode not in ("disagg", "colocated", "auto"):
            raise ValueError(f"mode must be disagg, colocated or auto, got {mode!r}")
        if (mode == "auto") != (dispatcher is not None):
            raise ValueError("auto mode needs a dispatcher (and only auto mode takes one)")
        self.placement = Placement(policy, block_size, hashes_wanted=dispatcher is not None)
        if not decode or (mode != "colocated" and not prefill):
            raise ValueError("need at least one decode worker (and one prefill worker in disagg/auto mode)")
        self.mode, self.model_config, self.policy = mode, model_config, policy
        self.eos_ids = set(eos_ids) | ({model_config.eos_token_id} if model_config.eos_token_id is not None else set())
        self._on_shutdown = on_shutdown
        self.link_gbps = link_gbps  # nominal Gbit/s between the pools, shown beside each measured pull
        self.dispatcher = dispatcher
        self.block_size = block_size
        self.kv_policy = kv_policy  # None: every remote prefill is pulled whole (bulk)
        if dispatcher is not None:  # auto prices a remote prefill's transfer the way it will move
            dispatcher.kv_policy = kv_policy
        self._live: dict[str, RequestState] = {}  # the requests in flight, by id
        self._timelines: OrderedDict[str, Timeline] = OrderedDict()  # the last TIMELINES_KEPT, by id
        self._decode_streams = DecodeStreams(self._live)
        self._transfer_bytes, self._transfer_seconds = 0, 0.0
        self._cleanup: set[asyncio.Task] = set()
        # rss_watch warns when a worker's RSS keeps growing. RSS_CHECK_S is read from this module
        # when an orchestrator is built, so a test may shorten it beforehand.
        self.pools = WorkerPools(
            mode,
            prefill,
            decode,
            self.placement,
            dispatcher,
            route=self._route,
            fail_requests=self._fail_requests,
            replace=replace,
            health_interval_s=health_interval_s,
            cache_sync_s=cache_sync_s,
            rss_watch=rss_watch,
            rss_check_s=RSS_CHECK_S,
        )

    @property
    def prefill(self) -> list[WorkerHandle]:
        return self.pools.prefill

    @property
    def decode(self) -> list[WorkerHandle]:
        return self.pools.decode

    @property
    def replacements(self) -> int:
        """Workers replaced since start (each death once)."""
        return self.pools.health.replacements

    # ---- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        await self.pools.start()

    async def shutdown(self) -> None:
        self.pools.close()
        if self._cleanup:  # aborts of requests that ended early still reach the workers
            await asyncio.wait(list(self._cleanup), timeout=10)
        await self.pools.stop()
        if self._on_shutdown is not None:
            await self._on_shutdown(self.prefill + self.decode)

    # ---- public API (used by the HTTP layer) ---------------------------------------------------
    def queue_depth(self) -> int:
        return len(self._live)

    def pool_status(self) -> dict[str, dict[str, int]]:
        """Per pool: the configured size and how many workers are alive and not being replaced."""
        return self.pools.status()

    def transfer_totals(self) -> tuple[int, float]:
        return self._transfer_bytes, self._transfer_seconds

    def timeline(self, request_id: str) -> Timeline | None:
        """The request's timeline, typed: metrics and traces read its fields, and the API turns it
        into its JSON (`pdserve.timeline`) only at the wire."""
        return self._timelines.get(request_id)

    async def stats(self) -> list[WorkerStats]:
        """Every worker's stats, read now (a dead worker found this way is replaced)."""
        return await self.pools.stats()

    async def generate(self, req: GenerateRequest) -> AsyncIterator[StreamEvent]:
        state = self._place(req)
        rid, tl, prefill, decode = req.request_id, state.timeline, state.prefill, state.decode
        finished = False
        try:
            if prefill is not None:
                state.phase = "prefill"
                stream = None
                if self.kv_policy is not None and self.kv_policy.streams(len(req.prompt_ids), req.kv_transfer):
                    t_open = time.time()
                    source = await prefill.peer_info()
                    stream = await decode.open_stream(req, source, self.kv_policy.layers_per_group)
                    tl.kv_stream_open_ms = round((time.time() - t_open) * 1e3, 3)
                tl.kv_transfer = "layerwise" if stream is not None else "bulk"
                result: PrefillResult = await prefill.prefill(req, stream)
                if self.kv_policy is not None:
                    self.kv_policy.observe_prefill(len(req.prompt_ids), result.timings["prefill_ms"] / 1e3)
                first = StreamEvent(
                    rid,
                    "token",
                    result.first_token,
                    0,
                    t=time.time(),
                    logprob=result.first_logprob,
                    prompt_logprobs=result.prompt_logprobs,
                )
                tl.stamp_prefilled(result)
                if self._first_is_last(req, result.first_token):
                    await prefill.release(rid)
                    first.finished = True
                    first.finish_reason = "length" if req.params.max_tokens == 1 else "stop"
                self._on_token(state, first)
                yield first
                if first.finished:
                    finished = True
                    return
                state.phase = "pull"
                if not result.streamed:  # streamed: the decode worker admits it once the last group lands
                    await decode.submit_prefilled(req, result)
            else:
                await decode.submit_prompt(req)
            while True:
                ev = await state.events.get()
                if ev.kind == "error":
                    raise WorkerError(ev.error or "worker error")
                if ev.kind == "admitted":
                    state.phase = "decode"  # the KV is on the decode worker now
                    self._on_admitted(tl, ev)
                    continue
                if ev.kind == "preempted":  # KV taken back under memory pressure; recomputed, not re-sent
                    tl.preemptions += 1
                    continue
                self._on_token(state, ev)
                if ev.finished and self.policy == "prefix":
                    # Read-your-writes for the next turn: a client that sends turn 2 once turn 1
                    # ended must find turn 1's blocks in the index, not wait for the next poll
                    # (under load a poll round can take longer than the client's reply).
                    await self.placement.sync([w for w in (prefill, decode) if w is not None])
                yield ev
                if ev.finished:
                    finished = True
                    return
        except WorkerError as e:
            tl.finish_reason = "error"
            # Not only WorkerDied: a worker whose engine loop died still answers Ray calls but
            # fails every request, and a failed KV pull often means the prefill side is gone.
            # handle_death pings both and replaces whichever is really dead.
            await self.pools.health.handle_death(prefill, decode)
            raise WorkerError(str(e)) from None
        finally:
            self._live.pop(rid, None)
            self._decode_streams.prefilled(state)
            if self.dispatcher is not None:
                self.dispatcher.forget(rid)  # no-op once its first token came
            for w in (prefill, decode):
                if w is not None:
                    w.active -= 1
            if not finished:
                if tl.finish_reason is None:
                    tl.finish_reason = "abort"
                # A task, not an await: when the caller was cancelled (client disconnect), an
                # await here would be cancelled too and the workers would keep the request.
                task = asyncio.get_running_loop().create_task(self._abort_on(rid, prefill, decode))
                self._cleanup.add(task)
                task.add_done_callback(self._cleanup.discard)

    async def abort(self, request_id: str) -> None:
        state = self._live.get(request_id)
        if state is not None:
            await self._abort_on(request_id, state.prefill, state.decode)

    def _place(self, req: GenerateRequest) -> RequestState:
        """Pick the request's workers (auto: and where it prefills), stamp why, and track it."""
        tl = self._new_timeline(req)
        hashes = self.placement.hashes(req.prompt_ids)
        decode = self.placement.pick(self.decode, "decode", hashes)
        prefill = self.placement.pick(self.prefill, "prefill", hashes) if self.mode != "colocated" else None
        if self.dispatcher is not None:
            assert prefill is not None  # auto has both pools
            prefill = self._dispatch(req, tl, prefill, decode, hashes)
        if hashes:  # what the router expected each side to hold (its index may lag by one poll)
            tl.routed_prefix_blocks = {
                w.role: self.placement.matched_blocks(w, hashes) for w in (prefill, decode) if w is not None
            }
        state = self._live[req.request_id] = RequestState(req, tl, decode, prefill)
        for w in (prefill, decode):
            if w is not None:
                w.active += 1
        why = self.placement.why
        reason = "; ".join(f"{w.role} {w.name}: {why(w, hashes)}" for w in (prefill, decode) if w is not None)
        tl.stamp_placed(decode.name, prefill.name if prefill else None, self.policy, reason, time.time())
        if prefill is None:  # colocated, or auto's local choice: the decode worker prefills it
            self._decode_streams.prefilling(state)
        return state

    # ---- auto mode -----------------------------------------------------------------------------
    def dispatch_summary(self) -> dict | None:
        return self.dispatcher.summary() if self.dispatcher is not None else None

    def _dispatch(
        self, req: GenerateRequest, tl: Timeline, prefill: WorkerHandle, decode: WorkerHandle, hashes: list[int]
    ) -> WorkerHandle | None:
        """Ask the dispatcher; returns the prefill worker for remote, None for local."""
        assert self.dispatcher is not None
        now = time.time()
        tl.max_tokens = req.params.max_tokens
        streams = self._decode_streams.streams_on(decode, now)
        n = len(req.prompt_ids)
        bs = self.block_size
        cached = [min(n - 1, self.placement.matched_blocks(w, hashes) * bs) for w in (decode, prefill)]
        decision = self.dispatcher.decide(
            n, cached[0], cached[1], streams, now, decode.name, prefill.name, request_id=req.request_id
        )
        tl.dispatch = decision.to_dict()
        return None if decision.choice == "local" else prefill

    # ---- internals -----------------------------------------------------------------------------
    async def _abort_on(self, rid: str, prefill: WorkerHandle | None, decode: WorkerHandle) -> None:
        calls = [w.abort(rid) for w in (prefill, decode) if w is not None and w.alive]
        for r in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(r, Exception) and not isinstance(r, WorkerDied):
                log.warning("abort of %s failed: %r", rid, r)

    def _first_is_last(self, req: GenerateRequest, token: int) -> bool:
        p = req.params
        return p.max_tokens == 1 or token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_ids)

    def _fail_requests(self, w: WorkerHandle) -> None:
        """`w` died: every request that still needs it ends with an error."""
        for s in list(self._live.values()):
            if s.needs(w):
                error = f"{w.role} worker {w.name} died"
                s.events.put_nowait(
                    StreamEvent(s.request_id, "error", finished=True, finish_reason="error", error=error)
                )

    def _route(self, ev: StreamEvent) -> None:
        """A decode worker's event, to its request (one that ended meanwhile drops it)."""
        s = self._live.get(ev.request_id)
        if s is not None:
            s.events.put_nowait(ev)

    # ---- timelines -----------------------------------------------------------------------------
    def _new_timeline(self, req: GenerateRequest) -> Timeline:
        tl = self._timelines[req.request_id] = Timeline(req.request_id, self.mode, req.arrival, len(req.prompt_ids))
        while len(self._timelines) > TIMELINES_KEPT:
            self._timelines.popitem(last=False)
        return tl

    def _on_admitted(self, tl: Timeline, ev: StreamEvent) -> None:
        tl.stamp_admitted(ev, self.link_gbps)
        if ev.transfer is not None:
            s = ev.transfer
            self._transfer_bytes += s.bytes
            self._transfer_seconds += s.seconds
            if self.kv_policy is not None:
                self.kv_policy.observe_pull(s.bytes, s.seconds)
            if self.dispatcher is not None:
                self.dispatcher.observe_transfer(s.bytes, s.seconds)

    def _on_token(self, state: RequestState, ev: StreamEvent) -> None:
        tl = state.timeline
        if self.dispatcher is not None or self.mode == "colocated":  # the stall beside local prefills
            self._decode_streams.on_token(state, ev)
        if ev.index == 0:
            tl.stamp_first_token(ev)
            self._decode_streams.prefilled(state)
            if self.dispatcher is not None:
                # before the token's own stamps: the streams beside a local prompt, as it joins them
                local = state.prefill is None
                ctxs = [s.context for s in self._decode_streams.streams_on(state.decode, ev.t)] if local else []
                self.dispatcher.record_outcome(tl, streams=ctxs)
        tl.stamp_token(ev)
