"""Layer-wise KV streaming, the decode side: pull each group of layers as soon as it is announced.

`DecodeWorker.open_stream` reserves a prompt's blocks and hands an `IncomingStream` to the
`StreamReceiver`. Its one thread reads the prefill worker's `StreamProgress` messages off the
transport (a counter of finished groups, in effect) and READs each announced slice straight into
the reserved blocks, while the prefill computes the next group. A stream is complete when every
layer of every block past the local prefix-cache hit has landed and the first token has come;
the receiver then tells the prefill side it may free its copy and hands the request to the engine
loop (`on_complete`). Failures (a READ error, a checksum mismatch, a "failed" message, no word
from the prefill side for `timeout_s`) end that request alone (`on_fail`), its blocks freed.

Blocks are freed on the engine-loop thread only, and never while a READ may still write them:
`cancel` of a stream whose READ is in flight leaves the freeing to this thread once it ends.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from contracts.worker import GenerateRequest
from transport.base import Transport
from transport.wire import KVHandle, PeerInfo, StreamProgress, TransferStats

log = logging.getLogger("pdserve.decode")
# Between polls of the transport while streams are open (none open: the thread waits for one).
# The wait doubles while nothing comes, from POLL_MIN_S to POLL_MAX_S, and falls back at each
# message: the receiver shares the cores with the prefill it waits for (on a 2-core host a fixed
# 0.5 ms poll cost the prefill up to a few percent), and a group is announced once per layer.
POLL_MIN_S = 0.0002
POLL_MAX_S = 0.002
ORPHAN_FACTOR = 10  # a stream that never heard from its prefill worker lives this many timeouts


@dataclass
class IncomingStream:
    """One request whose KV is on its way, group by group."""

    req: GenerateRequest
    source: PeerInfo
    blocks: list[int]  # local blocks for the whole prompt
    hashes: list[int]  # hashes of the leading blocks the local prefix cache had (not pulled)
    num_layers: int
    last_heard: float = field(default_factory=time.monotonic)
    heard: bool = False  # a first message came (until then the prompt may still be queued for prefill)
    pulled: list[int] = field(default_factory=list)  # per layer: blocks [0, pulled[l]) are here
    first_token: int | None = None
    lease_deadline: float = 0.0
    busy: bool = False  # a READ into its blocks is in flight
    cancelled: bool = False
    # the transfer, as the timeline reports it
    nbytes: int = 0
    descriptors: int = 0
    seconds: float = 0.0
    verify_s: float = 0.0
    groups: int = 0
    start_unix: float = 0.0
    end_unix: float = 0.0
    group_spans: list[tuple[int, int, float, float, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.pulled:
            self.pulled = [len(self.hashes)] * self.num_layers

    @property
    def request_id(self) -> str:
        return self.req.request_id

    @property
    def complete(self) -> bool:
        return self.first_token is not None and min(self.pulled) >= len(self.blocks)

    def stats(self, backend: str) -> TransferStats:
        s = TransferStats.build(self.request_id, backend, self.nbytes, self.descriptors, self.seconds)
        s.verify_s, s.mode, s.groups = self.verify_s, "layerwise", self.groups
        s.start_unix, s.end_unix = self.start_unix, self.end_unix or time.time()
        s.group_spans = list(self.group_spans)
        return s


class StreamReceiver:
    def __init__(
        self,
        transport: Transport,
        name: str,
        timeout_s: float,
        on_complete: Callable[[IncomingStream], None],
        on_fail: Callable[[IncomingStream, str | None], None],
    ):
        """`on_complete(stream)` and `on_fail(stream, message)` run on this receiver's thread and
        must hand their work to the engine loop; message None: cancelled (free it silently)."""
        self.transport, self.name, self.timeout_s = transport, name, timeout_s
        self._on_complete, self._on_fail = on_complete, on_fail
        self._streams: dict[str, IncomingStream] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __len__(self) -> int:
        with self._lock:
            return len(self._streams)

    def open(self, stream: IncomingStream) -> None:
        with self._lock:
            self._streams[stream.request_id] = stream
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"{self.name}-kvstream", daemon=True)
                self._thread.start()
        self._wake.set()

    def cancel(self, request_id: str) -> list[int] | None:
        """Stop pulling `request_id`. Returns its blocks for the caller to free now, [] when a
        READ into them is in flight (this thread frees them through on_fail once it ends), or
        None when no stream is open for it."""
        with self._lock:
            s = self._streams.get(request_id)
            if s is None:
                return None
            s.cancelled = True
            if s.busy:
                return []
            del self._streams[request_id]
            return s.blocks

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._streams)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    # ---- the receiver thread ---------------------------------------------------------------
    def _run(self) -> None:
        pause = POLL_MIN_S
        while not self._stop.is_set():
            with self._lock:
                idle = not self._streams
            if idle:
                self._wake.wait(0.5)
                self._wake.clear()
                pause = POLL_MIN_S
                continue
            try:
                messages = self.transport.poll_progress()
            except Exception as e:  # noqa: BLE001 - the transport is closed: the worker is ending
                if not self._stop.is_set():
                    log.warning("%s: layer-wise receiver stopped: %r", self.name, e)
                return
            for m in messages:
                self._handle(m)
            if messages:
                pause = POLL_MIN_S
            else:
                self._expire_silent()
                time.sleep(pause)
                pause = min(POLL_MAX_S, pause * 2)

    def _handle(self, m: StreamProgress) -> None:
        with self._lock:
            s = self._streams.get(m.request_id)
            if s is None:  # cancelled, failed or finished already: nothing to do
                return
            s.last_heard, s.heard = time.monotonic(), True
            if m.kind == "group":
                s.busy = True
        if m.kind == "done":
            s.first_token, s.lease_deadline = m.first_token, m.lease_deadline
        elif m.kind == "failed":
            self._finish(s, f"KV stream failed on {s.source.agent}: {m.error}")
            return
        elif m.kind == "group":
            error = self._pull(s, m)
            with self._lock:
                s.busy = False
            if s.cancelled:
                self._finish(s, None)
                return
            if error is not None:
                self._finish(s, error)
                return
        if s.complete:
            self._finish(s, "")

    def _pull(self, s: IncomingStream, m: StreamProgress) -> str | None:
        """READ one announced group's slice of the blocks past the local cache hit; None if it
        landed, else why not."""
        first, last = m.layers
        start = max(m.first_block, len(s.hashes))  # blocks before the hit are here already
        end = m.first_block + len(m.block_ids)
        if any(s.pulled[layer] < m.first_block for layer in range(first, last)):
            return f"KV stream from {s.source.agent}: layers {first}-{last - 1} skipped blocks before {m.first_block}"
        if end <= start:
            return None
        k = start - m.first_block
        handle = KVHandle(
            s.request_id,
            s.source,
            tuple(m.block_ids[k:]),
            (end - start) * s.source.layout.block_size,
            s.source.layout.compat_hash,
            float("inf"),  # the prefill side holds the blocks until this request is complete
            tuple(m.checksums[k:]) if m.checksums else (),
            layers=(first, last),
        )
        t0 = time.time()
        try:
            stats = self.transport.read(handle, s.blocks[start:end], self.timeout_s)
        except Exception as e:  # noqa: BLE001 - this request's error, not the worker's
            return f"KV transfer failed: {e}"
        t1 = time.time()
        s.start_unix = s.start_unix or t0
        s.end_unix = t1
        s.nbytes += stats.bytes
        s.descriptors += stats.descriptors
        s.seconds += stats.seconds
        s.verify_s += stats.verify_s
        s.groups += 1
        s.group_spans.append((first, last, t0, t1, stats.bytes))
        for layer in range(first, last):
            s.pulled[layer] = max(s.pulled[layer], end)
        return None

    def _finish(self, s: IncomingStream, error: str | None) -> None:
        """Complete (error ""), fail (a message) or drop (None: cancelled) stream `s`."""
        with self._lock:
            if self._streams.get(s.request_id) is not s:
                return  # cancel() took it (and its blocks) meanwhile
            del self._streams[s.request_id]
        if error == "":
            try:  # the prefill side may free its copy now
                self.transport.notify(s.source.agent, s.request_id)
            except Exception as e:  # noqa: BLE001 - its lease frees them anyway
                log.warning("%s: could not tell %s that %s landed: %r", self.name, s.source.agent, s.request_id, e)
            self._on_complete(s)
        else:
            self._on_fail(s, None if s.cancelled else error)

    def _expire_silent(self) -> None:
        """Streams whose prefill side went silent fail, so their blocks come back: `timeout_s`
        after its last message (it died, or its messages are lost; groups come a layer's compute
        apart), or ORPHAN_FACTOR x `timeout_s` with no message at all (the prompt may wait that
        long in the prefill queue; a prefill that fails before its first group is the router's to
        abort, so this only catches a stream whose router went away)."""
        now = time.monotonic()

        def silent_for(s: IncomingStream) -> float:
            return self.timeout_s if s.heard else ORPHAN_FACTOR * self.timeout_s

        with self._lock:
            late = [s for s in self._streams.values() if not s.busy and now - s.last_heard > silent_for(s)]
        for s in late:
            self._finish(
                s,
                f"KV transfer failed: no progress from {s.source.agent} for {silent_for(s):g} s "
                "(prefill worker dead or unreachable?)",
            )
