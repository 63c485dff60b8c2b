"""The Ray clusters pdserve starts or joins: always with Ray's token authentication.

Ray runs arbitrary code for whoever reaches its GCS, raylet or worker ports, so every cluster
pdserve touches uses `RAY_AUTH_MODE=token` (Ray >= 2.52). pdserve never turns it off, and refuses
to run when the environment asks for another mode.

An embedded cluster (the one `pdserve serve` starts when no --ray-address is given) gets a fresh
random token, written to a 0600 file in a private 0700 directory and named to every Ray process
through RAY_AUTH_TOKEN_PATH (Ray's own default, ~/.ray/auth_token, is written world-readable).
One token per process: Ray caches the token it loaded, so a process that starts a second cluster
must present the same one.

Ray 2.60 given node IP 127.0.0.1 still listens on every interface (GCS, raylet, object manager,
each worker's gRPC port; the runtime-env agent on the machine's address). On Linux, a process
that may create network namespaces (root, CAP_SYS_ADMIN) therefore starts the embedded cluster
in a private network namespace that holds only a loopback interface: Ray's processes inherit it,
so none of their sockets exists on the host's network at all. The thread that starts Ray moves
into that namespace with them; sockets opened before (the API's listening socket) stay where they
were bound. Where that is not allowed, the cluster falls back to loopback node addresses and the
token guards the ports Ray opens anyway (docs/security.md lists them).
"""

from __future__ import annotations

import atexit
import ctypes
import fcntl
import logging
import os
import secrets
import shutil
import socket
import struct
import sys
import tempfile
from typing import Any

log = logging.getLogger("pdserve.ray")

AUTH_MODE_ENV = "RAY_AUTH_MODE"
TOKEN_ENV = "RAY_AUTH_TOKEN"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
_CLONE_NEWNET = 0x40000000  # <sched.h>
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1  # <linux/sockios.h>, <net/if.h>
_IFREQ = "16sH14x"  # struct ifreq: name, then ifr_flags in the union

_token_dir: str | None = None


class RayAuthError(RuntimeError):
    """The environment asks pdserve to run Ray without token authentication."""


def require_token_auth() -> None:
    """Set RAY_AUTH_MODE=token for this process and every Ray process it starts; refuse any other
    mode that the environment already set."""
    mode = os.environ.get(AUTH_MODE_ENV)
    if mode is not None and mode.strip().lower() != "token":
        raise RayAuthError(
            f"{AUTH_MODE_ENV}={mode}: pdserve runs Ray only with token authentication "
            f"(unset it or set {AUTH_MODE_ENV}=token; see docs/security.md)"
        )
    os.environ[AUTH_MODE_ENV] = "token"
    _refresh_ray_config()


def _refresh_ray_config() -> None:
    """Ray reads RAY_AUTH_MODE and the token once, when it is first imported: a process that
    imported it before the variables were set must have it read them again (what Ray itself
    does when it turns token auth on for a local cluster)."""
    if "ray._raylet" not in sys.modules:
        return
    # private-ok: Ray has no public way to re-read the auth token; this is what ray.init itself calls
    from ray._raylet import (  # type: ignore[attr-defined]  # noqa: PLC0415 - Ray is loaded already
        AuthenticationTokenLoader,
        Config,
    )

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def ensure_local_token() -> None:
    """A token for a cluster this process starts: the one the environment names (RAY_AUTH_TOKEN or
    RAY_AUTH_TOKEN_PATH) if any, else a fresh random one in a private file, made once per process."""
    global _token_dir
    require_token_auth()
    if os.environ.get(TOKEN_ENV) or os.environ.get(TOKEN_PATH_ENV):
        return
    _token_dir = tempfile.mkdtemp(prefix="pdserve-auth-")  # mode 0700
    path = os.path.join(_token_dir, "token")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    os.environ[TOKEN_PATH_ENV] = path
    _refresh_ray_config()
    atexit.register(shutil.rmtree, _token_dir, True)


def enter_private_network() -> bool:
    """Move the calling thread (and every process and thread it starts from now on) into a new
    network namespace with only `lo`, brought up. False where the kernel or privileges refuse."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        log.warning(
            "no private network namespace for the embedded Ray (%s); its ports are guarded by the "
            "token only (see docs/security.md)",
            os.strerror(err),
        )
        return False
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # a fresh namespace's lo is down
        flags = struct.unpack(_IFREQ, fcntl.ioctl(s, _SIOCGIFFLAGS, struct.pack(_IFREQ, b"lo", 0)))[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack(_IFREQ, b"lo", flags | _IFF_UP))
    return True


def start_local_ray(
    num_cpus: int,
    object_store_bytes: int,
    temp_dir: str | None = None,
    log_to_driver: bool = True,
    private_network: bool = False,
) -> dict[str, Any]:
    """Start an embedded single-node Ray with token authentication. `private_network`: first move
    this thread into a private network namespace (see the module docstring). Returns how it was
    confined: {"auth": "token", "private_network": bool}."""
    ensure_local_token()
    private = enter_private_network() if private_network else False
    import ray  # noqa: PLC0415 - Ray is loaded only where a cluster is started or joined

    ray.init(
        num_cpus=num_cpus,
        object_store_memory=object_store_bytes,
        include_dashboard=False,
        _temp_dir=temp_dir or tempfile.mkdtemp(prefix="pdray", dir="/tmp"),  # short: socket paths are length-limited
        log_to_driver=log_to_driver,
        _node_ip_address="127.0.0.1",
    )
    return {"auth": "token", "private_network": private}


def connect_ray(address: str, log_to_driver: bool = True) -> None:
    """Join an existing cluster. It must run with token auth; its token comes from the environment
    (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH) or ~/.ray/auth_token, as for any Ray driver."""
    require_token_auth()
    import ray  # noqa: PLC0415 - as above

    ray.init(address=address, log_to_driver=log_to_driver)
