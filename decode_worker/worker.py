"""DecodeWorker: continuous-batching decode; in colocated mode it also prefills.

Disaggregated admission: reserve local blocks (loop thread) -> pull the prompt's KV through the
transport within the prefill worker's lease (a transfer thread, so running streams keep decoding
meanwhile; decode_worker/kv_pull.py) -> notify the prefill worker it may free its copy -> join the
running batch (loop thread). Tokens are buffered as StreamEvents that the router collects with
`poll_events()` (one long-poll per worker, not one call per token).

Layer-wise admission (`open_stream`): the blocks are reserved before the prompt is prefilled, and
the receiver thread pulls each group of layers as the prefill worker announces it
(decode_worker/kv_stream.py); the request joins the batch once all of it has landed.

Colocated, the worker prefills its own prompts; decode_worker/prefill_clock.py times them for the
request's timeline.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from contracts.worker import (
    CacheEvents,
    GenerateRequest,
    PrefillResult,
    StreamEvent,
    WorkerConfig,
    WorkerError,
    WorkerStats,
)
from decode_worker.abort_memory import AbortMemory
from decode_worker.kv_pull import pull_within_lease
from decode_worker.kv_stream import IncomingStream, StreamReceiver
from decode_worker.prefill_clock import PrefillClock
from engine.kv.block_manager import NoFreeBlocks
from engine.sequence import Sequence
from engine.worker_base import (
    EngineLoop,
    build_engine,
    log,
)
from transport import make_transport
from transport.base import TransportError
from transport.wire import PeerInfo, StreamTarget, TransferStats


class DecodeWorker(EngineLoop):
    error_type = WorkerError

    def __init__(self, cfg: WorkerConfig, name: str = "decode-0", colocated: bool = False):
        super().__init__(name, cfg.torch_threads, cfg.batch_wait_s, cfg.batch_wait_max_s)
        self.cfg, self.colocated = cfg, colocated
        self.engine = build_engine(cfg, prefill_only=False)
        runner = self.engine.runner
        self.transport = None
        self.receiver: StreamReceiver | None = None
        if not colocated:
            # A NIXL puller without the busy-polling progress thread pulls ~2x faster (measured by
            # `pdserve bench transfer`); prefill keeps it so peers' reads progress while it computes.
            options = {"progress_thread": False} if cfg.transport == "nixl" else {}
            self.transport = make_transport(cfg.transport, name, **options)
            self.transport.register(runner.cache.raw, runner.layout)
            self.receiver = StreamReceiver(
                self.transport, name, cfg.transfer_timeout_s, self._stream_landed, self._stream_failed
            )
        self._events: list[StreamEvent] = []
        self._events_cv = threading.Condition()
        self._admissions: deque[tuple[GenerateRequest, PrefillResult]] = deque()  # waiting for blocks
        self._in_transfer: dict[str, list[int]] = {}  # request id -> reserved local blocks
        self._aborted = AbortMemory()  # refuses a submit that arrives after its own abort
        self._prefill_clock = PrefillClock()  # colocated: each prompt's queue and prefill times
        self._xfer = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-xfer")
        self.start()

    # ---- called from other threads (Ray actor methods) -------------------------------------
    def submit_prompt(self, req: GenerateRequest) -> None:
        """Colocated: admit a raw prompt (prefilled here, whole or in chunks)."""
        arrived = time.time()  # its queue counts from here: one sent mid-step waits for the step's end

        def admit() -> None:
            if not self._refuse_aborted(req.request_id):
                seq = Sequence(req.request_id, list(req.prompt_ids), req.params)
                self.engine.add_request(seq)
                self._prefill_clock.admitted(seq, arrived)

        self.call(admit)

    def submit_prefilled(self, req: GenerateRequest, result: PrefillResult) -> None:
        """Disaggregated: admit a request whose prompt KV waits on a prefill worker (pulled whole:
        a layer-wise stream opened for it that did not complete is closed first)."""
        self.engine.check_fits(len(req.prompt_ids), req.params.max_tokens)

        def admit() -> None:
            self._close_stream(req.request_id)
            if not self._refuse_aborted(req.request_id):
                self._admissions.append((req, result))

        self.call(admit)

    def describe(self) -> PeerInfo:
        if self.transport is None:
            raise WorkerError(f"{self.name} is colocated: it has no KV transport")
        return self.transport.describe()

    def open_stream(self, req: GenerateRequest, source: PeerInfo, layers_per_group: int) -> StreamTarget | None:
        """Layer-wise: reserve the prompt's blocks now (its local prefix-cache hit included) and
        pull each group of layers as `source` announces it. None when the blocks are not free now
        (the router pulls it whole later instead)."""
        if self.transport is None or self.receiver is None:
            raise WorkerError(f"{self.name} is colocated: it has no KV transport")
        self.engine.check_fits(len(req.prompt_ids), req.params.max_tokens)
        try:
            self.transport.connect(source)  # here, not on the loop thread: a handshake
        except TransportError as e:  # the router fails the request and checks both workers' health
            raise WorkerError(f"KV transfer failed: {self.name} cannot reach {source.agent}: {e}") from None

        def reserve() -> tuple[list[int], list[int]] | None:
            if self._refuse_aborted(req.request_id):
                return None
            try:
                blocks, hit, hashes = self.engine.reserve_cached(list(req.prompt_ids))
            except NoFreeBlocks:
                return None
            self._in_transfer[req.request_id] = blocks
            return blocks, hashes

        got = self.call(reserve)
        if got is None:
            return None
        blocks, hashes = got
        assert self.receiver is not None
        self.receiver.open(IncomingStream(req, source, blocks, hashes, self.engine.runner.layout.num_layers))
        return StreamTarget(req.request_id, self.transport.describe(), layers_per_group, len(hashes))

    def abort(self, request_id: str) -> bool:
        def do() -> bool:
            self._aborted.add(request_id)
            before = len(self._admissions)
            kept = [a for a in self._admissions if a[0].request_id != request_id]
            self._admissions = deque(kept)
            streaming = self._close_stream(request_id)
            found = self.engine.abort(request_id) or len(kept) != before or request_id in self._in_transfer
            return found or streaming

        return self.call(do)

    def poll_events(self, timeout_s: float = 0.05) -> list[StreamEvent]:
        """Buffered events; once the loop is gone and they are drained, raises (the router then
        reports the worker dead and replaces it)."""
        with self._events_cv:
            if not self._events:
                self._events_cv.wait(timeout_s)
            out, self._events = self._events, []
        if not out and self._exited:
            raise self._ended_error()
        return out

    def stats(self) -> WorkerStats:
        e = self.engine
        return WorkerStats(
            self.name,
            "colocated" if self.colocated else "decode",
            queue_depth=len(e.waiting) + len(self._admissions) + len(self._in_transfer),
            running=len(e.running),
            parked=0,
            **self.stats_fields(),
        )

    def cache_events(self) -> CacheEvents:
        return CacheEvents(*self.drain_cache_events())

    def shutdown(self) -> None:
        self.close()
        if self.receiver is not None:
            self.receiver.close()
        self._xfer.shutdown(wait=True)
        if self.transport is not None:
            self.transport.close()

    # ---- loop thread -------------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.engine.has_work or bool(self._admissions)

    def _emit(self, events: list[StreamEvent]) -> None:
        if events:
            with self._events_cv:
                self._events.extend(events)
                self._events_cv.notify_all()

    def _refuse_aborted(self, request_id: str) -> bool:
        """A submit that arrives after its own abort: drop it (and end the stream, if any)."""
        if request_id not in self._aborted:
            return False
        self._emit(
            [
                StreamEvent(
                    request_id, "error", finished=True, finish_reason="abort", error=f"request {request_id} was aborted"
                )
            ]
        )
        return True

    def _fail_expired_admissions(self) -> None:
        """Queued admissions whose prefill lease ran out while they waited for blocks: the KV is
        gone (or reused), so fail them now rather than pull garbage later."""
        now = time.time()
        if not any(r.handle.lease_deadline <= now for _, r in self._admissions):
            return
        kept: deque[tuple[GenerateRequest, PrefillResult]] = deque()
        for req, result in self._admissions:
            if result.handle.lease_deadline > now:
                kept.append((req, result))
                continue
            waited = now - result.timings.get("prefill_end", now)
            self._fail_admission(
                req.request_id,
                [],
                (
                    f"KV transfer failed: the KV lease on {result.handle.agent} expired while the request "
                    f"waited {waited:.1f} s for free KV blocks on {self.name}; raise --lease-s or add decode capacity"
                ),
            )
        self._admissions = kept

    def _start_transfers(self) -> None:
        if self._admissions:
            self._fail_expired_admissions()
        while self._admissions:
            req, result = self._admissions[0]
            try:
                blocks, hit, hashes = self.engine.reserve_cached(list(req.prompt_ids))
            except NoFreeBlocks:
                return  # retried next tick, once running sequences free blocks
            self._admissions.popleft()
            self._in_transfer[req.request_id] = blocks
            self._xfer.submit(self._transfer, req, result, blocks, hashes)

    def _transfer(self, req: GenerateRequest, result: PrefillResult, blocks: list[int], hashes: list[int]) -> None:
        """Transfer thread: pull the blocks the local prefix cache lacks (the first len(hashes)
        are already here), notify, then hand the sequence to the loop thread."""
        hit = len(hashes)
        # the checksums follow their blocks (an unsliced list failed every prefix-hit pull under --verify-kv)
        handle = dataclasses.replace(
            result.handle, block_ids=result.handle.block_ids[hit:], checksums=result.handle.checksums[hit:]
        )
        transport = self.transport
        assert transport is not None  # disaggregated decode workers always have one
        try:
            stats = pull_within_lease(transport, req.request_id, handle, blocks[hit:], self.cfg.transfer_timeout_s)
        except Exception as e:  # noqa: BLE001 - reported to the router as this request's error
            log.warning("KV pull for %s failed: %s", req.request_id, e)
            message = f"KV transfer failed: {e}"  # `e` is unbound once the except block ends
            self._post_or_drop(lambda: self._fail_admission(req.request_id, blocks, message))
            return
        # posted, not called: the next pull starts now, not after this admission's step boundary
        self._post_or_drop(lambda: self._admit(req, result.first_token, blocks, hashes, stats))

    def _post_or_drop(self, fn: Callable[[], None]) -> None:
        """Hand `fn` to the loop thread; once the loop has ended, `on_exit` has already failed
        every request in transfer, so there is nothing left to do."""
        try:
            self.post(fn)
        except self.error_type:
            pass

    def _fail_admission(self, request_id: str, blocks: list[int], message: str) -> None:
        self._in_transfer.pop(request_id, None)
        self.engine.blocks.free(blocks)
        if request_id not in self._aborted:  # an aborted request's stream is gone: nothing after abort
            self._emit([StreamEvent(request_id, "error", finished=True, finish_reason="error", error=message)])

    # ---- layer-wise streams (decode_worker/kv_stream.py) -----------------------------------
    def _stream_landed(self, s: IncomingStream) -> None:
        """Receiver thread: every group and the first token are here; join the batch."""
        assert self.transport is not None
        stats = s.stats(self.transport.backend)
        first = s.first_token if s.first_token is not None else -1
        self._post_or_drop(lambda: self._admit(s.req, first, s.blocks, s.hashes, stats))

    def _stream_failed(self, s: IncomingStream, message: str | None) -> None:
        """Receiver thread: the stream failed (message) or was cancelled (None) while a READ ran."""
        if message is None:
            self._post_or_drop(lambda: self._free_stream_blocks(s.request_id, s.blocks))
        else:
            log.warning("layer-wise KV stream of %s failed: %s", s.request_id, message)
            self._post_or_drop(lambda: self._fail_admission(s.request_id, s.blocks, message))

    def _close_stream(self, request_id: str) -> bool:
        """Loop thread: stop pulling `request_id` and free its blocks (now, or once its READ ends)."""
        blocks = self.receiver.cancel(request_id) if self.receiver is not None else None
        if blocks:
            self._free_stream_blocks(request_id, blocks)
        return blocks is not None

    def _free_stream_blocks(self, request_id: str, blocks: list[int]) -> None:
        if self._in_transfer.get(request_id) is blocks:
            del self._in_transfer[request_id]
        self.engine.blocks.free(blocks)

    def _admit(
        self, req: GenerateRequest, first_token: int, blocks: list[int], hashes: list[int], stats: TransferStats
    ) -> None:
        self._in_transfer.pop(req.request_id, None)
        if req.request_id in self._aborted:
            self.engine.blocks.free(blocks)
            return
        seq = Sequence(
            req.request_id,
            list(req.prompt_ids),
            req.params,
            output_ids=[first_token],
            block_table=blocks,
            block_hashes=list(hashes),
        )
        self.engine.add_prefilled(seq)
        bs = self.engine.blocks.block_size
        self._emit(
            [
                StreamEvent(
                    req.request_id,
                    "admitted",
                    transfer=stats,
                    finished=seq.finish_reason is not None,
                    finish_reason=seq.finish_reason,
                    timings={"cached_tokens": len(hashes) * bs, "blocks_pulled": len(blocks) - len(hashes)},
                )
            ]
        )

    def on_exit(self) -> None:
        e = self.engine
        held = [s.seq_id for s in (*e.waiting, *e.running)] + [r.request_id for r, _ in self._admissions]
        held += list(self._in_transfer)
        error = str(self._ended_error())
        self._emit(
            [
                StreamEvent(rid, "error", finished=True, finish_reason="error", error=error)
                for rid in held
                if rid not in self._aborted
            ]
        )

    def _fail_step(self, error: Exception) -> None:
        """An engine step raised: end the sequences that were in it (every running one, and every
        waiting one already given blocks, i.e. prefilling) with an error and free their blocks;
        queued prompts and KV pulls go on, and so does the worker. Which sequence of a batch
        caused it is not known here, so the whole step's batch fails. A failure no sequence can be
        blamed for (nothing was scheduled) is the engine's own: it ends the loop, and the pool
        replaces the worker."""
        e = self.engine
        batch = [s.seq_id for s in e.running] + [s.seq_id for s in e.waiting if s.block_table]
        if not batch:
            raise error
        log.exception("%s: an engine step failed; failing the requests in it", self.name)
        for rid in batch:
            e.abort(rid)
            self._prefill_clock.forget(rid)
        self._emit(
            [
                StreamEvent(rid, "error", finished=True, finish_reason="error", error=f"engine step failed: {error!r}")
                for rid in batch
                if rid not in self._aborted
            ]
        )

    def tick(self) -> bool:
        self._start_transfers()
        self._aborted.forget_old(self._in_transfer)
        if not self.engine.has_work:
            return False
        t_start = time.time()
        try:
            events = self.engine.step()
        except Exception as e:  # noqa: BLE001 - one failed step fails its own sequences, not the worker
            self._fail_step(e)
            return True
        self.log_step(self.engine)
        t = time.time()
        out = [
            StreamEvent(ev.seq_id, "token", ev.token_id, ev.index, ev.finished, ev.finish_reason, t, logprob=ev.logprob)
            for ev in events
        ]
        if self.colocated:
            self._prefill_clock.attach_prompt_logprobs(out)
        self._prefill_clock.stamp(out, t_start)
        if self.engine.preempted:  # shown in each request's timeline (their streams just pause)
            out += [StreamEvent(rid, "preempted", t=t) for rid in self.engine.preempted]
        self._emit(out)
        return self.engine.last_step is not None
