"""DecodeWorker: continuous-batching decode; in colocated mode it also prefills.

Disaggregated admission: reserve local blocks (loop thread) -> pull the prompt's KV through the
transport (a transfer thread, so running streams keep decoding meanwhile) -> notify the prefill
worker it may free its copy -> join the running batch (loop thread). Tokens are buffered as
StreamEvents that the router collects with `poll_events()` (one long-poll per worker, not one
call per token).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from engine.block_manager import NoFreeBlocks
from engine.sequence import Sequence
from engine.worker_base import EngineLoop, build_engine, log
from router.types import GenerateRequest, PrefillResult, StreamEvent, WorkerConfig, WorkerStats
from transport import make_transport


class DecodeWorker(EngineLoop):
    def __init__(self, cfg: WorkerConfig, name: str = "decode-0", colocated: bool = False):
        super().__init__(name)
        self.cfg, self.colocated = cfg, colocated
        self.engine = build_engine(cfg, prefill_only=False)
        runner = self.engine.runner
        self.transport = None
        if not colocated:
            # A NIXL puller without the busy-polling progress thread pulls ~2x faster (measured by
            # `pdserve bench transfer`); prefill keeps it so peers' reads progress while it computes.
            options = {"progress_thread": False} if cfg.transport == "nixl" else {}
            self.transport = make_transport(cfg.transport, name, **options)
            self.transport.register(runner.cache.raw, runner.layout)
        self._events: list[StreamEvent] = []
        self._events_cv = threading.Condition()
        self._admissions: deque[tuple[GenerateRequest, PrefillResult]] = deque()  # waiting for blocks
        self._in_transfer: dict[str, list[int]] = {}  # request id -> reserved local blocks
        self._aborted: set[str] = set()
        self._xfer = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-xfer")
        self.start()

    # ---- called from other threads (Ray actor methods) -------------------------------------
    def submit_prompt(self, req: GenerateRequest) -> None:
        """Colocated: admit a raw prompt (prefilled here, whole or in chunks)."""
        self.call(lambda: self.engine.add_request(Sequence(req.request_id, list(req.prompt_ids), req.params)))

    def submit_prefilled(self, req: GenerateRequest, result: PrefillResult) -> None:
        """Disaggregated: admit a request whose prompt KV waits on a prefill worker."""
        self.engine.check_fits(len(req.prompt_ids), req.params.max_tokens)
        self.call(lambda: self._admissions.append((req, result)))

    def abort(self, request_id: str) -> bool:
        def do() -> bool:
            self._aborted.add(request_id)
            before = len(self._admissions)
            kept = [a for a in self._admissions if a[0].request_id != request_id]
            self._admissions = deque(kept)
            return self.engine.abort(request_id) or len(kept) != before or request_id in self._in_transfer

        return self.call(do)

    def poll_events(self, timeout_s: float = 0.05) -> list[StreamEvent]:
        with self._events_cv:
            if not self._events:
                self._events_cv.wait(timeout_s)
            out, self._events = self._events, []
        return out

    def stats(self) -> WorkerStats:
        e = self.engine
        return WorkerStats(self.name, "colocated" if self.colocated else "decode",
                           queue_depth=len(e.waiting) + len(self._admissions) + len(self._in_transfer),
                           running=len(e.running), parked=0, blocks_total=e.blocks.num_blocks,
                           blocks_free=e.blocks.num_free, steps=self.steps)

    def ping(self) -> str:
        return self.name

    def shutdown(self) -> None:
        self.close()
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

    def _start_transfers(self) -> None:
        while self._admissions:
            req, result = self._admissions[0]
            try:
                blocks = self.engine.reserve(len(req.prompt_ids), req.params.max_tokens)
            except NoFreeBlocks:
                return  # retried next tick, once running sequences free blocks
            self._admissions.popleft()
            self._in_transfer[req.request_id] = blocks
            self._xfer.submit(self._transfer, req, result, blocks)

    def _transfer(self, req: GenerateRequest, result: PrefillResult, blocks: list[int]) -> None:
        """Transfer thread: pull, notify, then hand the sequence to the loop thread."""
        handle = result.handle
        try:
            self.transport.connect(handle.source)
            stats = self.transport.read(handle, blocks[: len(handle.block_ids)], self.cfg.transfer_timeout_s)
            self.transport.notify(handle.agent, req.request_id)
        except Exception as e:  # noqa: BLE001 - reported to the router as this request's error
            log.warning("KV pull for %s failed: %s", req.request_id, e)
            self.call(lambda: self._fail_admission(req.request_id, blocks, f"KV transfer failed: {e}"), None)
            return
        self.call(lambda: self._admit(req, result, blocks, stats), None)

    def _fail_admission(self, request_id: str, blocks: list[int], message: str) -> None:
        self._in_transfer.pop(request_id, None)
        self.engine.blocks.free(blocks)
        self._emit([StreamEvent(request_id, "error", finished=True, finish_reason="error", error=message)])

    def _admit(self, req: GenerateRequest, result: PrefillResult, blocks: list[int], stats) -> None:
        self._in_transfer.pop(req.request_id, None)
        if req.request_id in self._aborted:
            self._aborted.discard(req.request_id)
            self.engine.blocks.free(blocks)
            return
        seq = Sequence(req.request_id, list(req.prompt_ids), req.params, output_ids=[result.first_token],
                       block_table=blocks)
        self.engine.add_prefilled(seq)
        self._emit([StreamEvent(req.request_id, "admitted", transfer=stats,
                                finished=seq.finish_reason is not None, finish_reason=seq.finish_reason)])

    def tick(self) -> None:
        self._start_transfers()
        if not self.engine.has_work:
            return
        events = self.engine.step()
        t = time.time()
        self._emit([StreamEvent(ev.seq_id, "token", ev.token_id, ev.index, ev.finished, ev.finish_reason, t)
                    for ev in events])
        # forget abort marks of requests that can no longer appear
        if self._aborted and not self._in_transfer:
            self._aborted.clear()
