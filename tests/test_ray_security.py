"""The Ray that pdserve starts is locked down: token authentication always, and `pdserve serve`'s
embedded cluster opens no listening socket on the host's network (a private network namespace on
Linux where the process may create one, loopback addresses otherwise)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.serve_process import ServeProcess

# Ray actors behind a server
pytestmark = [pytest.mark.ray, pytest.mark.server]

ROOT = Path(__file__).resolve().parent.parent


def _may_unshare_net() -> bool:
    code = "import sys; from router.workers.ray_cluster import enter_private_network as e; sys.exit(0 if e() else 1)"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True).returncode == 0


def _listening_in_this_netns() -> dict[int, tuple[str, int]]:
    """{socket inode: (address, port)} of every TCP socket listening in this network namespace."""
    out = {}
    for name in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/self/net/{name}").read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            f = line.split()
            if f[3] != "0A":  # TCP_LISTEN
                continue
            hexaddr, hexport = f[1].split(":")
            raw = bytes.fromhex(hexaddr)
            if name == "tcp":
                addr = ".".join(str(b) for b in raw[::-1])
            else:  # four little-endian 32-bit words
                words = [raw[i : i + 4][::-1] for i in range(0, 16, 4)]
                addr = b"".join(words).hex()
                if addr.startswith("00000000000000000000ffff"):
                    addr = ".".join(str(b) for b in bytes.fromhex(addr[24:]))
                elif addr == "0" * 32:
                    addr = "::"
                elif addr == "0" * 31 + "1":
                    addr = "::1"
            out[int(f[9])] = (addr, int(hexport, 16))
    return out


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            m = re.fullmatch(r"socket:\[(\d+)\]", target)
            if m:
                inodes.add(int(m.group(1)))
    except OSError:
        pass
    return inodes


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_pdserve_serve_opens_no_socket_on_the_network(tmp_path):
    """`pdserve serve --mode disagg` with its embedded Ray: after a request went through prefill,
    NIXL and decode, every socket the server's processes listen on in the host's network namespace
    is on loopback, and with a private namespace the API's port is the only one.

    Cost: a real `pdserve serve --mode disagg` child process with its own embedded Ray: its
    processes' sockets are what is tested.
    """
    srv = ServeProcess(["--mode", "disagg", "--model", "tiny", "--num-blocks", "64"], tmp_path / "serve.log")
    try:
        r = httpx.post(
            srv.url + "/v1/completions",
            json={"model": "tiny", "prompt": "Hello", "max_tokens": 4, "ignore_eos": True},
            timeout=60,
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        api_port = int(srv.url.rsplit(":", 1)[1])
        listening = _listening_in_this_netns()
        pids = srv.session_pids()
        assert len(pids) >= 4  # the router, GCS, raylet, two workers...
        ours = [(listening[i], pid) for pid in pids for i in _socket_inodes(pid) if i in listening]
        exposed = [(a, pid) for a, pid in ours if a[0] not in ("127.0.0.1", "::1")]
        assert exposed == [], f"listening on the network: {exposed}"
        if _may_unshare_net():  # Ray and NIXL live in the private namespace: only the API is here
            assert {a for a, _ in ours} == {("127.0.0.1", api_port)}, ours
    finally:
        srv.stop()


def test_auth_mode_other_than_token_is_refused(monkeypatch):
    from router.workers.ray_cluster import RayAuthError, require_token_auth

    monkeypatch.setenv("RAY_AUTH_MODE", "off")
    with pytest.raises(RayAuthError, match="only with token authentication"):
        require_token_auth()


def test_embedded_token_is_private(monkeypatch):
    """The embedded cluster's token: random, in a 0600 file in a 0700 directory, named to Ray's
    processes through RAY_AUTH_TOKEN_PATH."""
    import router.workers.ray_cluster as rc

    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    rc.ensure_local_token()
    path = Path(os.environ["RAY_AUTH_TOKEN_PATH"])
    assert os.environ["RAY_AUTH_MODE"] == "token"
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    assert re.fullmatch(r"[0-9a-f]{64}", path.read_text())
