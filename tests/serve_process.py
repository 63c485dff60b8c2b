"""`pdserve serve` as a real child process (its own session), for tests about the process itself:
signals, exit status, sockets, Ray's processes. In-process servers are router.serve_cli.ServerThread."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from tests.helpers import wait_until

ROOT = Path(__file__).resolve().parent.parent


class ServeProcess:
    def __init__(self, args: list[str], log_path: Path, startup_timeout_s: float = 180.0):
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_TOKEN")}  # its own token
        self.log_path = log_path
        self._log = open(log_path, "w+")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cli", "serve", "--port", "0", *args],
            cwd=ROOT,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

        def url() -> str:
            if self.proc.poll() is not None:
                raise RuntimeError("exited")
            m = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", self.log())
            return m.group(1) if m else ""

        try:
            self.url = wait_until(url, startup_timeout_s, "pdserve serve to print its URL", interval=0.3)
        except (AssertionError, RuntimeError):
            self.stop()
            raise RuntimeError(f"pdserve serve did not start:\n{self.log()[-3000:]}") from None

    def log(self) -> str:
        return self.log_path.read_text()

    def session_pids(self) -> list[int]:
        """Every live process of the server's session: the router, Ray's daemons and workers."""
        pids = []
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    zombie = Path(f"/proc/{d.name}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
                    if os.getsid(int(d.name)) == self.proc.pid and not zombie:
                        pids.append(int(d.name))
                except (OSError, IndexError):
                    pass
        return pids

    def stop(self, sig: int = signal.SIGINT, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        return self.proc.returncode
