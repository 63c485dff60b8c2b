"""`ServerState`: what every endpoint of the app shares (the orchestrator, the tokenizer, the
settings, metrics, tracing, the admitted requests), kept on `app.state.pd` and handed to a route by
the `server_state` dependency."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import Annotated, Any, Protocol

from fastapi import Depends, Request

from engine.checkpoint.tokenizer import Tokenizer
from router.config import ServeConfig
from router.observe.metrics import ServeMetrics
from router.observe.tracing import Tracing
from router.observe.tracing import enabled as tracing_enabled
from router.openai import protocol as oa

log = logging.getLogger("pdserve.app")


class OpenRequest(Protocol):
    """An admitted request that has not ended (router/http/admitted_request.py)."""

    def fail(self, message: str) -> None:
        """End it with `message` as its error and stop it on the workers."""


class ServerState:
    """What every endpoint shares. `orchestrator` is None until the lifespan has built it."""

    def __init__(self, orchestrator: Any, tokenizer: Tokenizer, cfg: ServeConfig):
        self.orchestrator, self.tokenizer, self.cfg = orchestrator, tokenizer, cfg
        self.metrics = ServeMetrics()
        self.tracing = Tracing(cfg.otlp_endpoint, cfg.chunk_size) if tracing_enabled(cfg.otlp_endpoint) else None
        if self.tracing is not None:
            self.metrics.span_counts = self.tracing.counts
        self.inflight = 0  # admitted and not closed; counted here so admission is atomic
        self.runs: set[OpenRequest] = set()  # the admitted requests still open
        self.draining = False  # shutting down: new requests get 503, open ones may finish
        self.started = int(time.time())
        self._tasks: set[asyncio.Task] = set()

    def orch(self) -> Any:
        if self.orchestrator is None:
            raise oa.OpenAIError(
                503, "The server is starting; try again shortly.", type="server_error", code="not_ready"
            )
        return self.orchestrator

    def limits(self) -> oa.Limits:
        mc = self.orch().model_config
        # A request that cannot fit one worker's KV pool would wait for blocks forever.
        kv_tokens = self.cfg.num_blocks * self.cfg.block_size
        return oa.Limits(
            self.cfg.model_name,
            frozenset(self.cfg.accepted_model_names()),
            min(mc.max_position_embeddings, kv_tokens),
            mc.vocab_size,
            self.cfg.max_tokens_limit,
        )

    def end_open_runs(self, message: str) -> int:
        """End every open request with `message` as its error (streams: an error event, then
        [DONE]) and stop it on the workers. Returns how many were open."""
        runs = list(self.runs)
        for run in runs:
            run.fail(message)
        return len(runs)

    def spawn(self, coro: Awaitable[Any], what: str) -> None:
        """Fire and forget (but keep a reference and log failures): cleanup that must outlive a
        cancelled request task."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)

        def done(t: asyncio.Task) -> None:
            self._tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.warning("%s failed: %r", what, t.exception())

        task.add_done_callback(done)


def server_state(request: Request) -> ServerState:
    """The route dependency: the state of the app that received `request`."""
    state: ServerState = request.app.state.pd
    return state


# A route parameter of this type receives the app's ServerState.
State = Annotated[ServerState, Depends(server_state)]
