"""`pdserve serve` as a child process of a benchmark: started on 127.0.0.1, waited for, stopped.

    with ServeProcess(["--model", "tiny", "--mode", "disagg"]) as server:
        httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {server.api_key}"})

The server gets a free port (or the one given) and, unless told otherwise, an API key generated for
this run. It is up once its /health answers 200: all pools at full size (that endpoint never asks
for the key). Its stdout and stderr go to one log file, the caller's or a temporary one removed once
the server is stopped; when it dies or is not up in time, the error carries the end of that log.

Stopping sends SIGTERM to the server's main process only: its own graceful drain and shutdown
(router/shutdown.py), which stops its Ray workers. Only when that takes longer than
`stop_timeout_s` does SIGKILL follow, to the whole session when the server has one of its own
(`new_session`: Ray's daemons and workers with it), else to the main process.

(tests/serve_process.py is the tests' own, which parses the URL from the banner instead.)
"""

from __future__ import annotations

import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import IO

import httpx

HOST = "127.0.0.1"
POLL_S = 0.5  # between two /health probes while the server starts
LOG_TAIL_CHARS = 2000  # of the server's log, in a start error


class ServeStartError(RuntimeError):
    """The server exited, or was not up in time, before it answered /health with 200."""


def free_port() -> int:
    """A port nothing on 127.0.0.1 listens on right now (the server binds it a moment later)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


class ServeProcess:
    """One `python -m cli serve` child; a context manager that starts it and stops it."""

    def __init__(
        self,
        serve_args: Sequence[str],
        *,
        port: int | None = None,
        with_api_key: bool = True,
        log_path: Path | None = None,
        new_session: bool = False,
        start_timeout_s: float = 300.0,
        stop_timeout_s: float = 90.0,
    ) -> None:
        """`serve_args`: the `pdserve serve` flags; --host, --port and --api-key are this class's
        (added after them, so they win). `port`: None for a free one. `log_path`: None for a
        temporary file. `new_session`: the server leads a session of its own, so its processes
        can be told apart (os.getsid) and killed together."""
        self.serve_args = list(serve_args)
        self.port = port if port is not None else free_port()
        self.api_key = secrets.token_urlsafe(16) if with_api_key else None
        self.url = f"http://{HOST}:{self.port}"
        self.new_session = new_session
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self._owns_log = log_path is None  # a temporary file, made by start() and removed by stop()
        self.log_path = log_path
        self._log: IO[str] | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        if self._proc is None:
            raise RuntimeError("the server has not been started")
        return self._proc

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        """The server's exit status once it has ended (None before)."""
        return self._proc.returncode if self._proc is not None else None

    def command(self) -> list[str]:
        key = ["--api-key", self.api_key] if self.api_key else []
        return [sys.executable, "-m", "cli", "serve", *self.serve_args, "--host", HOST, "--port", str(self.port), *key]

    def start(self) -> ServeProcess:
        """Starts the server and waits until it is up; stops it again and raises ServeStartError
        if it is not. A second call does nothing."""
        if self._proc is not None:
            return self
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="pdserve-serve-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self._proc = subprocess.Popen(
            self.command(), stdout=self._log, stderr=subprocess.STDOUT, start_new_session=self.new_session
        )
        try:
            self._wait_until_up()
        except ServeStartError:
            self.stop()
            raise
        return self

    def _wait_until_up(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while not self._healthy():
            if self.proc.poll() is not None:
                raise ServeStartError(self._failure(f"exited with status {self.proc.returncode}"))
            if time.monotonic() > deadline:
                raise ServeStartError(self._failure(f"was not up in {self.start_timeout_s:.0f} s"))
            time.sleep(POLL_S)

    def _healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:  # not listening yet, or busy starting its pools
            return False

    def _failure(self, what: str) -> str:
        # the serve flags without the key: this message is printed
        assert self.log_path is not None  # start() made it
        where = f" (its log: {self.log_path})" if not self._owns_log else ""
        tail = self.log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
        return f"pdserve serve {shlex.join(self.serve_args)} {what}{where}; the end of its log:\n{tail}"

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after `stop_timeout_s` (see the module's docstring); the exit status."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                if self.new_session:
                    os.killpg(self._proc.pid, signal.SIGKILL)
                else:
                    self._proc.kill()
                self._proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._owns_log and self.log_path is not None:
            self.log_path.unlink(missing_ok=True)
            self.log_path = None
        return self.returncode

    def __enter__(self) -> ServeProcess:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
