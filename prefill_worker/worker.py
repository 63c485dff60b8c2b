"""PrefillWorker: batches prompts, runs prefill, hands back the first token and a KVHandle.

The prompt's blocks stay pinned under a lease until the decode worker says it has pulled them
(a transport notification) or the lease expires; either way they return to the free list.
With a `StreamTarget` (layer-wise KV transfer) each group of layers is announced to the decode
worker as it is written, so the pull runs while the prompt is still prefilling
(prefill_worker/kv_stream.py).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent.futures import Future

from contracts.worker import CacheEvents, GenerateRequest, PrefillResult, WorkerConfig, WorkerError, WorkerStats
from engine.sequence import Sequence
from engine.worker_base import EngineLoop, build_engine
from prefill_worker.kv_stream import StreamSender
from transport import make_transport
from transport.base import TransportError
from transport.wire import PeerInfo, StreamTarget

log = logging.getLogger("pdserve.prefill")
# How long an abort is remembered. A prefill() call can wait in Ray's queue while the worker's
# "prefill" concurrency group is busy (router/workers/host.py); one the router aborted meanwhile is
# refused when it arrives instead of prefilled for nobody and held under a lease.
ABORT_MEMORY_S = 120.0


class PrefillWorker(EngineLoop):
    error_type = WorkerError

    def __init__(self, cfg: WorkerConfig, name: str = "prefill-0"):
        super().__init__(name, cfg.torch_threads, cfg.batch_wait_s, cfg.batch_wait_max_s)
        self.cfg = cfg
        self.engine = build_engine(cfg, prefill_only=True)
        runner = self.engine.runner
        self.transport = make_transport(cfg.transport, name)
        self.transport.register(runner.cache.raw, runner.layout)
        self.peer_info: PeerInfo = self.transport.describe()
        self.streams = StreamSender(
            self.transport, runner.layout.num_layers, runner.layout.block_size, verify=cfg.verify_kv
        )
        # request id -> (future, enqueue time, sequence, start time of its first prefill step)
        self._pending: dict[str, tuple[Future, float, Sequence, list[float]]] = {}
        # request id -> when its blocks are freed if decode has not pulled them, on this process's
        # monotonic clock: enforcement never depends on other nodes' clocks or on wall-clock jumps
        # (the handle's wall-clock lease_deadline only lets decode skip a pull that is surely late)
        self._leases: dict[str, float] = {}
        self.leases_expired = 0
        self._aborted: OrderedDict[str, float] = OrderedDict()  # request id -> when aborted (monotonic)
        self.start()

    # ---- called from other threads (Ray actor methods) -------------------------------------
    def prefill(self, req: GenerateRequest, stream: StreamTarget | None = None) -> PrefillResult:
        """Blocks until the prompt is prefilled. Raises ValueError for a request that can never fit.
        With `stream`, its KV is announced to that decode worker group by group as it is written
        (`PrefillResult.streamed` says whether all of it was)."""
        fut: Future = Future()
        if stream is not None:
            try:
                self.transport.connect(stream.peer)  # here, not on the loop thread: a handshake
            except TransportError as e:
                log.warning(
                    "%s: cannot stream %s to %s (%s); it will be pulled whole",
                    self.name,
                    req.request_id,
                    stream.peer.agent,
                    e,
                )
                stream = None

        arrived = time.time()  # its queue counts from here: one sent mid-step waits for the step's end

        def admit() -> None:
            if req.request_id in self._aborted:
                raise WorkerError(f"request {req.request_id} was aborted before {self.name} took it")
            seq = Sequence(req.request_id, list(req.prompt_ids), req.params)
            self.engine.add_request(seq)
            self._pending[req.request_id] = (fut, arrived, seq, [])
            if stream is not None:
                self.streams.open(stream)

        self.call(admit)
        return fut.result()

    def release(self, request_id: str) -> bool:
        """Free a prompt's blocks now (the router gave up on it, or decode failed to pull)."""
        return self.call(lambda: self._release(request_id))

    def abort(self, request_id: str) -> bool:
        def do() -> bool:
            now = time.monotonic()
            self._aborted[request_id] = now
            self._aborted.move_to_end(request_id)
            while next(iter(self._aborted.values())) < now - ABORT_MEMORY_S:
                self._aborted.popitem(last=False)
            entry = self._pending.pop(request_id, None)
            if entry is not None and not entry[0].done():
                entry[0].set_exception(WorkerError(f"request {request_id} aborted"))
            found = self.engine.abort(request_id)
            self._leases.pop(request_id, None)
            self.streams.fail(request_id, f"request {request_id} was aborted on {self.name}")
            return found

        return self.call(do)

    def describe(self) -> PeerInfo:
        return self.peer_info

    def stats(self) -> WorkerStats:
        e = self.engine
        return WorkerStats(
            self.name,
            "prefill",
            queue_depth=len(e.waiting),
            running=0,
            parked=len(e.parked),
            **self.stats_fields(),
        )

    def cache_events(self) -> CacheEvents:
        return CacheEvents(*self.drain_cache_events())

    def shutdown(self) -> None:
        self.close()
        self.transport.close()

    # ---- loop thread -------------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.engine.has_work

    def _release(self, request_id: str) -> bool:
        self._leases.pop(request_id, None)
        return self.engine.release(request_id)

    def on_exit(self) -> None:
        error = self._ended_error()
        self.streams.fail_all(str(error))
        for fut, *_ in self._pending.values():
            if not fut.done():
                fut.set_exception(error)
        self._pending.clear()

    def _fail_step(self, error: Exception) -> None:
        """An engine step raised: fail the prompts that were in it (those already given blocks),
        free their blocks, and keep serving the others and the parked KV. A failure no prompt can
        be blamed for (nothing was scheduled) is the engine's own: it ends the loop, and the pool
        replaces the worker."""
        batch = [s for s in self.engine.waiting if s.block_table]
        if not batch:
            raise error
        log.exception("%s: an engine step failed; failing the prompts in it", self.name)
        for seq in batch:
            entry = self._pending.pop(seq.seq_id, None)
            self.engine.abort(seq.seq_id)
            self.streams.fail(seq.seq_id, f"prefill step failed on {self.name}: {error!r}")
            if entry is not None and not entry[0].done():
                entry[0].set_exception(WorkerError(f"prefill step failed: {error!r}"))

    def tick(self) -> bool:
        for request_id in self.transport.poll_notifications():
            self._release(request_id)
        now = time.monotonic()
        for request_id in [r for r, deadline in self._leases.items() if deadline < now]:
            self.leases_expired += 1
            self._release(request_id)
        if not self.engine.has_work:
            return False
        t_start = time.time()
        try:
            events = self.engine.step(self.streams.on_layer if self.streams.active else None)
        except Exception as e:  # noqa: BLE001 - one failed step fails its own prompts, not the worker
            self._fail_step(e)
            return True
        self.log_step(self.engine)
        t_end = time.time()
        if self.engine.last_step is None:  # every waiting prompt lacks blocks (parked KV holds them)
            return False
        for entry in self._pending.values():
            if entry[2].num_cached and not entry[3]:
                entry[3].append(t_start)
        for ev in events:
            fut, t_enq, seq, started = self._pending.pop(ev.seq_id)
            deadline = time.time() + self.cfg.lease_s
            # first: the decode worker admits a streamed request once this lands, router or not
            streamed, announced = self.streams.done(ev.seq_id, ev.token_id, deadline)
            handle = self.transport.make_handle(
                ev.seq_id,
                seq.block_table,
                len(seq.prompt_ids),
                self.cfg.lease_s,
                checksum=self.cfg.verify_kv and not streamed,  # a streamed request's groups carried theirs
            )
            self._leases[ev.seq_id] = time.monotonic() + self.cfg.lease_s
            t_first = started[0] if started else t_start
            fut.set_result(
                PrefillResult(
                    request_id=ev.seq_id,
                    first_token=ev.token_id,
                    handle=handle,
                    worker=self.name,
                    streamed=streamed,
                    stream_groups=announced,
                    first_logprob=ev.logprob,
                    prompt_logprobs=seq.prompt_logprobs if seq.params.prompt_logprobs is not None else None,
                    timings={
                        "queue_ms": (t_first - t_enq) * 1e3,
                        "prefill_ms": (t_end - t_first) * 1e3,
                        "prefill_start": t_first,
                        "prefill_end": t_end,
                        "cached_tokens": seq.cached_tokens,
                    },
                )
            )
        return True
