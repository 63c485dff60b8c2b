"""Graceful shutdown on SIGTERM and SIGINT (what systemd, Kubernetes, Docker and Ctrl-C send).

1. Stop admitting: new requests get 503 `shutting_down`, /health answers 503 `draining`.
2. Let the open requests finish, for up to `--shutdown-timeout-s` seconds.
3. End whatever is still open with an error (a stream gets an error event, then `data: [DONE]`).
4. Tell uvicorn to exit; the app's lifespan then shuts the pools and the embedded Ray down, and
   `pdserve serve` exits 0.

A second signal while draining skips the wait (step 3 at once).

Why the handlers are installed after the pools start: uvicorn installs its own at start-up, and
`ray.init()` (run inside the app's lifespan) then replaces SIGTERM's with Ray's, which kills the
process mid-stream. Installing ours last, through the event loop, puts both signals back under
this module's control. Signals reach only the main thread, so a server run in a background
thread (tests, benchmarks) is stopped by its owner instead.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from typing import Any

log = logging.getLogger("pdserve.shutdown")
FLUSH_S = 5.0  # after ending the open requests: time for their last events to reach the clients


class GracefulShutdown:
    def __init__(self, state: Any, server: Any, timeout_s: float):
        """`state`: the app's ServerState; `server`: the uvicorn.Server to stop at the end."""
        self.state, self.server, self.timeout_s = state, server, timeout_s
        self._task: asyncio.Task | None = None
        self._hurry = asyncio.Event()

    def install(self) -> bool:
        """Take over SIGTERM and SIGINT (main thread only). Returns whether it did."""
        if threading.current_thread() is not threading.main_thread():
            return False
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request, sig)
        return True

    def request(self, sig: int | None = None) -> None:
        """Start draining (first call), or stop waiting for open requests (any later call)."""
        name = signal.Signals(sig).name if sig else "shutdown"
        if self._task is not None:
            log.warning("%s again: ending the %d open requests now", name, self.state.inflight)
            self._hurry.set()
            return
        log.warning(
            "%s: no new requests; waiting up to %g s for %d open ones", name, self.timeout_s, self.state.inflight
        )
        self._task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        st = self.state
        st.draining = True
        deadline = time.monotonic() + self.timeout_s
        while st.inflight and time.monotonic() < deadline and not self._hurry.is_set():
            try:
                await asyncio.wait_for(self._hurry.wait(), 0.05)
            except asyncio.TimeoutError:
                pass
        if st.inflight:
            why = "a second signal" if self._hurry.is_set() else f"--shutdown-timeout-s {self.timeout_s:g} passed"
            n = st.end_open_runs(f"the server is shutting down ({why}); the request was stopped")
            log.warning("ended %d open requests (%s)", n, why)
            flush_until = time.monotonic() + FLUSH_S
            while st.inflight and time.monotonic() < flush_until:
                await asyncio.sleep(0.02)
        log.warning("open requests done; stopping the server and the pools")
        self.server.should_exit = True
