"""One live request as the router tracks it: where it was placed, how far it got, and where its
decode worker's events go. The orchestrator holds one per request in flight, beside its timeline
(router/observe/timeline.py), which outlives it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Literal

from contracts.worker import GenerateRequest, StreamEvent
from router.observe.timeline import Timeline
from router.workers.handle import WorkerHandle

# Where a disaggregated request's KV is: on its prefill worker being computed ("prefill"), being
# pulled by its decode worker ("pull"), or on the decode worker ("decode").
Phase = Literal["prefill", "pull", "decode"]
# What a prefill worker's death can still break. Past the pull the KV lives on the decode worker
# and the stream needs nothing more from the prefill side.
NEEDS_PREFILL: tuple[Phase, ...] = ("prefill", "pull")


@dataclass(eq=False)  # one per request, compared (and hashed) by identity
class RequestState:
    """A request the router is serving: where it was placed, how far it got, and the queue its
    decode worker's events are routed to."""

    request: GenerateRequest
    timeline: Timeline
    decode: WorkerHandle
    prefill: WorkerHandle | None  # None: the decode worker prefills it (colocated, auto's local choice)
    events: asyncio.Queue[StreamEvent] = field(default_factory=asyncio.Queue)
    phase: Phase | None = None  # with a prefill worker: where its KV is
    last_token_t: float | None = None  # unix time of its latest token (the gaps its neighbours see)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def needs(self, w: WorkerHandle) -> bool:
        """Whether worker `w`'s death fails this request."""
        if w is not self.decode and w is not self.prefill:
            return False
        return not (w.role == "prefill" and self.decode is not w and self.phase not in NEEDS_PREFILL)
