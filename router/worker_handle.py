"""WorkerHandle: call a worker's methods the same way whether it is a Ray actor or a plain
object in this process (benchmarks on a GPU box without Ray, single-process tests)."""
from __future__ import annotations

import asyncio
import functools
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from router.types import WorkerError

log = logging.getLogger("pdserve.router")


class WorkerDied(WorkerError):
    """The worker process is gone (Ray actor died)."""


class WorkerHandle:
    _local_executor = ThreadPoolExecutor(max_workers=64, thread_name_prefix="pdserve-local-call")

    def __init__(self, name: str, role: str, target: Any, is_ray: bool, bundle: int = 0):
        self.name, self.role, self.target, self.is_ray, self.bundle = name, role, target, is_ray, bundle
        self.alive = True
        self.active = 0  # requests the router has assigned and not yet finished

    async def call(self, method: str, *args: Any) -> Any:
        if not self.alive:
            raise WorkerDied(f"{self.role} worker {self.name} is dead")
        if not self.is_ray:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._local_executor,
                                              functools.partial(getattr(self.target, method), *args))
        import ray  # noqa: PLC0415

        try:
            return await getattr(self.target, method).remote(*args)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError) as e:
            self.alive = False
            cause = next((ln.strip() for ln in reversed(str(e).splitlines()) if "Error" in ln), type(e).__name__)
            raise WorkerDied(f"{self.role} worker {self.name} died: {cause}") from None
        except ray.exceptions.RayTaskError as e:
            # Re-raise the worker's own exception: str() of Ray's wrapper is the whole remote
            # traceback, which would reach the client as the error message.
            log.debug("%s.%s failed on the worker:\n%s", self.name, method, e)
            cause = getattr(e, "cause", None)
            raise (cause if isinstance(cause, Exception) else e.as_instanceof_cause()) from None

    def __repr__(self) -> str:
        return f"WorkerHandle({self.name}, {self.role}, {'ray' if self.is_ray else 'local'})"
