"""Each decode worker's batch as the router sees it: the streams decoding on it, and the prompts it
prefills itself beside them (colocated mode, auto's local choice).

A local prefill stalls the streams beside it; its realized stall is the longest token gap those
streams saw while it prefilled (`local_max_gap_ms`, the stall histogram of /metrics, and auto's
outcome for a local decision). Auto's dispatcher prices each decision against the streams in
flight on the decode worker (`streams_on`).
"""

from __future__ import annotations

from collections.abc import Mapping

from contracts.worker import StreamEvent
from router.dispatch.dispatcher import Stream
from router.lifecycle.request_state import RequestState
from router.workers.handle import WorkerHandle


class DecodeStreams:
    def __init__(self, live: Mapping[str, RequestState]):
        self._live = live  # the orchestrator's requests in flight (read, never written here)
        self._prefilling: dict[str, set[RequestState]] = {}  # decode worker name -> its local prompts

    def prefilling(self, state: RequestState) -> None:
        """`state`'s prompt is prefilled on its decode worker: its neighbours' gaps count against it."""
        self._prefilling.setdefault(state.decode.name, set()).add(state)

    def prefilled(self, state: RequestState) -> None:
        """Its first token came (or it ended): its neighbours' gaps no longer count against it."""
        self._prefilling.get(state.decode.name, set()).discard(state)

    def on_token(self, state: RequestState, ev: StreamEvent) -> None:
        """A stream's token gap counts against every local prompt prefilling beside it."""
        prev, state.last_token_t = state.last_token_t, ev.t
        if prev is None:
            return
        for other in self._prefilling.get(state.decode.name, ()):
            otl = other.timeline
            if other is not state and otl.first_token_ms is None and ev.t > otl.arrival:
                gap = round((ev.t - max(prev, otl.arrival)) * 1e3, 3)
                otl.local_max_gap_ms = max(otl.local_max_gap_ms or 0.0, gap)

    def streams_on(self, decode: WorkerHandle, now: float) -> list[Stream]:
        """The sequences decoding on `decode`: local ones past their first token, remote ones
        admitted (their KV pulled)."""
        out = []
        for s in self._live.values():
            tl = s.timeline
            if s.decode is not decode or tl.first_token_ms is None:
                continue
            if s.prefill is None or tl.decode_admitted_ms is not None:
                decode_s = max(0.0, now - tl.arrival - tl.first_token_ms / 1e3)
                out.append(Stream(tl.prompt_tokens + tl.output_tokens, tl.output_tokens, decode_s, tl.max_tokens or 0))
        return out
