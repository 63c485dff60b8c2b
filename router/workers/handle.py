"""WorkerHandle: call a worker's methods the same way whether it is a Ray actor or a plain
object in this process (benchmarks on a GPU box without Ray, single-process tests).

Its async methods mirror `contracts.worker.PrefillWorkerAPI` / `DecodeWorkerAPI` one for one, so
the orchestrator calls typed methods, never method names."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar, cast

from contracts.worker import (
    CacheEvents,
    DecodeWorkerAPI,
    GenerateRequest,
    PrefillResult,
    PrefillWorkerAPI,
    StreamEvent,
    Worker,
    WorkerError,
    WorkerStats,
)
from transport.wire import PeerInfo, StreamTarget

log = logging.getLogger("pdserve.router")
P = ParamSpec("P")
R = TypeVar("R")


class WorkerDied(WorkerError):
    """The worker process is gone (Ray actor died)."""


class WorkerUnavailable(WorkerError):
    """Ray could not reach the worker for a while (ActorUnavailableError), which is not death:
    the health check decides that, by pinging it."""


# Transient unreachability (a busy node, a network blip) is retried this many times, with these
# pauses, before a call gives up; only calls that are safe to repeat are retried.
RETRY_PAUSES_S = (0.1, 0.3, 1.0)


class WorkerHandle:
    _local_executor = ThreadPoolExecutor(max_workers=64, thread_name_prefix="pdserve-local-call")

    def __init__(self, name: str, role: str, target: Any, is_ray: bool, bundle: int = 0):
        # target: a Ray ActorHandle of a worker class, or the worker object itself
        self.name, self.role, self.target, self.is_ray, self.bundle = name, role, target, is_ray, bundle
        self.alive = True
        self.active = 0  # requests the router has assigned and not yet finished
        self._peer: PeerInfo | None = None  # its transport endpoint, asked once (layer-wise streams)

    # ---- the worker contract, as coroutines ----------------------------------------------------
    # A Ray ActorHandle has the worker class's methods as attributes (ActorMethods), so the casts
    # below let the type checker hold each call to the contract's signature in both cases.
    @property
    def _worker(self) -> Worker:
        return cast(Worker, self.target)

    @property
    def _prefill(self) -> PrefillWorkerAPI:
        return cast(PrefillWorkerAPI, self.target)

    @property
    def _decode(self) -> DecodeWorkerAPI:
        return cast(DecodeWorkerAPI, self.target)

    async def prefill(self, req: GenerateRequest, stream: StreamTarget | None = None) -> PrefillResult:
        return await self._call(self._prefill.prefill, req, stream)

    async def peer_info(self) -> PeerInfo:
        """The worker's transport endpoint; fixed for its lifetime (a replacement is a new handle)."""
        if self._peer is None:
            self._peer = await self._retrying(self._prefill.describe)
        return self._peer

    async def open_stream(self, req: GenerateRequest, source: PeerInfo, layers_per_group: int) -> StreamTarget | None:
        return await self._call(self._decode.open_stream, req, source, layers_per_group)

    async def release(self, request_id: str) -> bool:
        return await self._retrying(self._prefill.release, request_id)

    async def submit_prompt(self, req: GenerateRequest) -> None:
        return await self._call(self._decode.submit_prompt, req)

    async def submit_prefilled(self, req: GenerateRequest, result: PrefillResult) -> None:
        return await self._call(self._decode.submit_prefilled, req, result)

    async def poll_events(self, timeout_s: float) -> list[StreamEvent]:
        return await self._retrying(self._decode.poll_events, timeout_s)

    async def abort(self, request_id: str) -> bool:
        return await self._retrying(self._worker.abort, request_id)

    async def stats(self) -> WorkerStats:
        return await self._retrying(self._worker.stats)

    async def ping(self) -> str:
        return await self._retrying(self._worker.ping)

    async def cache_events(self) -> CacheEvents:
        return await self._call(self._worker.cache_events)

    async def shutdown(self) -> None:
        return await self._call(self._worker.shutdown)

    # ---- transport of one call -----------------------------------------------------------------
    async def _retrying(self, method: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """_call, repeated while the worker is only unavailable (idempotent calls only)."""
        for pause in RETRY_PAUSES_S:
            try:
                return await self._call(method, *args, **kwargs)
            except WorkerUnavailable as e:
                log.warning("%s; retrying in %g s", e, pause)
                await asyncio.sleep(pause)
        return await self._call(method, *args, **kwargs)

    async def _call(self, method: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        if not self.alive:
            raise WorkerDied(f"{self.role} worker {self.name} is dead")
        if not self.is_ray:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._local_executor, functools.partial(method, *args, **kwargs))
        import ray  # noqa: PLC0415

        try:
            return await method.remote(*args, **kwargs)  # type: ignore[attr-defined]  # an ActorMethod
        except ray.exceptions.ActorUnavailableError as e:  # a subclass of RayActorError, yet not death
            raise WorkerUnavailable(f"{self.role} worker {self.name} is unreachable: {type(e).__name__}") from None
        except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError) as e:
            self.alive = False
            reason = next((ln.strip() for ln in reversed(str(e).splitlines()) if "Error" in ln), type(e).__name__)
            raise WorkerDied(f"{self.role} worker {self.name} died: {reason}") from None
        except ray.exceptions.RayTaskError as e:
            # Re-raise the worker's own exception: str() of Ray's wrapper is the whole remote
            # traceback, which would reach the client as the error message.
            log.debug("%s.%s failed on the worker:\n%s", self.name, getattr(method, "__name__", method), e)
            cause = getattr(e, "cause", None)
            raise (cause if isinstance(cause, Exception) else e.as_instanceof_cause()) from None

    def __repr__(self) -> str:
        return f"WorkerHandle({self.name}, {self.role}, {'ray' if self.is_ray else 'local'})"
