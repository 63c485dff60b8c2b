"""A pdserve server in a background thread of this process, on a free loopback port: what the
serving tests and `pdserve bench compare` start (one process holds the client and the router).

Signals reach only the main thread, so such a server never installs the graceful-shutdown
handlers; its owner stops it with `stop()` (or by leaving the `with` block).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from router.config import ServeConfig
from router.http_server import base_url, bind_socket, serve


class ServerThread:
    """A pdserve server on a free 127.0.0.1 port in a background thread.

    with ServerThread(cfg) as srv:      # blocks until the pools are up
        client = OpenAI(base_url=srv.base_url, api_key=cfg.api_key or "none")
    """

    def __init__(self, cfg: ServeConfig, startup_timeout_s: float = 300.0, log_level: str = "warning"):
        self.cfg = replace(cfg, host="127.0.0.1", port=0)
        self.timeout, self.log_level = startup_timeout_s, log_level
        self._sock = bind_socket("127.0.0.1", 0)
        self.url = base_url("127.0.0.1", self._sock)  # root; the OpenAI API is under /v1
        self._server: list = []
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="pdserve-server", daemon=True)

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def _run(self) -> None:
        try:
            asyncio.run(serve(self.cfg, self._sock, self.log_level, lambda _url: self._ready.set(), self._server))
        except BaseException as e:  # noqa: BLE001 - reported to the thread that waits in start()
            self._error = e
        finally:
            self._ready.set()

    def start(self) -> ServerThread:
        self._thread.start()
        if not self._ready.wait(self.timeout):
            self.stop()
            raise RuntimeError(f"pdserve server did not start within {self.timeout:g} s")
        if self._error is not None or not self._thread.is_alive():
            self._sock.close()
            raise RuntimeError(f"pdserve server failed to start: {self._error}") from self._error
        return self

    def stop(self, timeout_s: float = 60.0) -> None:
        """Graceful: in-flight requests get a few seconds, then the pools shut down."""
        deadline = time.monotonic() + 10
        while not self._server and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._server:
            self._server[0].should_exit = True
        self._thread.join(timeout_s)
        self._sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_server_in_thread(cfg: ServeConfig, startup_timeout_s: float = 300.0) -> tuple[str, Callable[[], None]]:
    """Start a server on a free loopback port; returns (root url, stop function)."""
    srv = ServerThread(cfg, startup_timeout_s).start()
    return srv.url, srv.stop
