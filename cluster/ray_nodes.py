"""Ray on the rehearsal nodes: `ray start` inside each namespace, exactly as on a real host.

Head on node 0 (GCS at <node0>:6379), a worker node on every other node. Each node advertises
its own address, its own temp dir and a custom resource `node<i>` so pools can be pinned to it.
Token authentication is on: every node (and every driver run by `cluster exec`) reads the same
token file through RAY_AUTH_TOKEN_PATH, which is how Ray shares one token across hosts.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

from cluster.layout import RAY_PORT, ClusterLayout, NodeLayout
from cluster.netns import ClusterError

RAY_START_TIMEOUT_S = 90.0
JOIN_TIMEOUT_S = 90.0
OBJECT_STORE_BYTES = 100 * 1024**2  # KV travels through NIXL, not the object store
NODE_RESOURCE_UNITS = 1000  # `node<i>` is a label: any number of workers may ask for 1 unit


def ray_bin() -> str:
    return str(Path(sys.executable).with_name("ray"))


def write_token(lay: ClusterLayout) -> None:
    """A fresh random token, readable only by its owner (the cluster's shared secret)."""
    fd = os.open(lay.token_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))


def in_node(lay: ClusterLayout, node: NodeLayout, argv: list[str]) -> list[str]:
    """argv run inside the node's namespace with the node's environment. The caller's own RAY_* and
    UCX_* settings do not leak in (a test's loopback-only Ray flags would break a multi-node start):
    a node's Ray and UCX are configured by the node, as on a real host."""
    env = lay.node_env()
    unset = [a for k in os.environ if k.startswith(("RAY_", "UCX_")) and k not in env for a in ("-u", k)]
    return ["ip", "netns", "exec", node.namespace, "env", *unset, *(f"{k}={v}" for k, v in env.items()), *argv]


def start_node(lay: ClusterLayout, node: NodeLayout) -> None:
    argv = [
        ray_bin(),
        "start",
        "--node-ip-address",
        node.address,
        "--num-cpus",
        str(lay.cpus_per_node),
        "--resources",
        json.dumps({node.resource: NODE_RESOURCE_UNITS}),
        "--temp-dir",
        str(lay.ray_temp_dir(node.index)),
        "--object-store-memory",
        str(OBJECT_STORE_BYTES),
        "--disable-usage-stats",
    ]
    if node.index == 0:
        argv += ["--head", "--port", str(RAY_PORT), "--include-dashboard", "false"]
    else:
        argv += ["--address", lay.head_address]
    # Output to a file, not a pipe: the daemons `ray start` leaves behind inherit it and would
    # hold a pipe open past the command's end.
    with open(lay.log_path(node.index), "ab") as log:
        try:
            r = subprocess.run(
                in_node(lay, node, argv), stdout=log, stderr=subprocess.STDOUT, timeout=RAY_START_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            raise ClusterError(
                f"node {node.index}: `ray start` did not finish within {RAY_START_TIMEOUT_S:g} s "
                f"(log: {lay.log_path(node.index)})"
            ) from None
    if r.returncode != 0:  # the log goes with the state dir when `up` cleans up: quote it
        tail = [ln for ln in lay.log_path(node.index).read_text(errors="replace").splitlines() if ln.strip()][-3:]
        raise ClusterError(f"node {node.index}: `ray start` failed (exit {r.returncode}): {' | '.join(tail)}")


_WAIT_SNIPPET = """
import json, sys, time, ray
want, deadline = set(json.loads(sys.argv[2])), time.monotonic() + float(sys.argv[3])
ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")
while True:
    have = {r for n in ray.nodes() if n["Alive"] for r in n["Resources"]}
    if want <= have or time.monotonic() > deadline:
        break
    time.sleep(0.3)
missing = sorted(want - have)
print(json.dumps(missing))
sys.exit(1 if missing else 0)
"""


def wait_joined(lay: ClusterLayout, resources: list[str], timeout_s: float = JOIN_TIMEOUT_S) -> None:
    """Block until a live Ray node carries each of `resources` (asked from a driver on node 0)."""
    argv = [sys.executable, "-c", _WAIT_SNIPPET, lay.head_address, json.dumps(resources), str(timeout_s)]
    try:
        r = subprocess.run(in_node(lay, lay.nodes[0], argv), capture_output=True, text=True, timeout=timeout_s + 30)
    except subprocess.TimeoutExpired:
        raise ClusterError(f"the Ray cluster did not answer within {timeout_s + 30:g} s") from None
    if r.returncode != 0:
        tail = (r.stdout.strip().splitlines() or r.stderr.strip().splitlines() or ["?"])[-1]
        raise ClusterError(f"nodes did not join within {timeout_s:g} s: missing {tail}")
