"""The network of a rehearsal cluster: namespaces, veth pairs, one bridge, `tc tbf` on every link.

Every call to `ip`/`tc` is bounded (`CMD_TIMEOUT_S`), and every removal tolerates what is already
gone, so `down` can run any number of times, after a half-finished `up` too.

Shaping: a node's link is shaped in both directions, like a NIC on a switch port: egress of the
node's `eth0` (what it sends) and egress of the host end of its veth (what it receives). A KV pull
from node A to node B therefore crosses two G Gbit/s shapers in series, which is one G link.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

from cluster.layout import ClusterLayout, NodeLayout

CMD_TIMEOUT_S = 10.0


class ClusterError(RuntimeError):
    """Something the operator must fix; the CLI prints it as one line (exit status 2)."""


def sh(*args: str, timeout: float = CMD_TIMEOUT_S, check: bool = True) -> subprocess.CompletedProcess:
    try:
        r = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise ClusterError(f"`{args[0]}` not found (install iproute2)") from None
    except subprocess.TimeoutExpired:
        raise ClusterError(f"`{' '.join(args)}` did not finish within {timeout:g} s") from None
    if check and r.returncode != 0:
        raise ClusterError(f"`{' '.join(args)}` failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
    return r


def check_privileges() -> None:
    """Root, `ip netns`, and `tc` are all needed; say which is missing in one line."""
    if os.geteuid() != 0:
        raise ClusterError("needs root (it creates network namespaces, a bridge and tc qdiscs); run it with sudo")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise ClusterError(f"`{tool}` not found (install iproute2)")
    r = sh("ip", "netns", "list", check=False)
    if r.returncode != 0:
        raise ClusterError(f"network namespaces are not available here: {r.stderr.strip()}")


def namespaces(prefix: str) -> list[str]:
    out = sh("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.split() and line.split()[0].startswith(prefix)]


def links(prefix: str) -> list[str]:
    out = sh("ip", "-o", "link", "show", check=False).stdout
    names = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if line.count(":") >= 2]
    return [n for n in names if n.startswith(prefix)]


def subnet_in_use(k: int) -> bool:
    return bool(sh("ip", "-4", "route", "show", f"198.18.{k}.0/24", check=False).stdout.strip())


def tbf_args(gbps: float) -> list[str]:
    # burst: at least 1 ms of traffic and at least a few 64 KiB GSO segments, so the shaper
    # neither drops whole segments nor lets a long burst through; latency bounds the queue.
    rate_bytes = gbps * 1e9 / 8
    burst = int(max(256 * 1024, rate_bytes * 1e-3))
    return ["tbf", "rate", f"{int(gbps * 1e6)}kbit", "burst", str(burst), "latency", "100ms"]


# ---- create ---------------------------------------------------------------------------------------
def create_bridge(lay: ClusterLayout) -> None:
    sh("ip", "link", "add", lay.bridge, "type", "bridge")
    sh("ip", "addr", "add", f"{lay.host_address}/{lay.prefix_len}", "dev", lay.bridge)
    sh("ip", "link", "set", lay.bridge, "up")


def create_node(lay: ClusterLayout, node: NodeLayout) -> None:
    ns = node.namespace
    sh("ip", "netns", "add", ns)
    sh("ip", "link", "add", node.veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
    sh("ip", "link", "set", node.veth, "master", lay.bridge, "up")
    sh("ip", "-n", ns, "addr", "add", f"{node.address}/{lay.prefix_len}", "dev", "eth0")
    sh("ip", "-n", ns, "link", "set", "eth0", "up")
    sh("ip", "-n", ns, "link", "set", "lo", "up")
    # No default route: a node reaches the other nodes and the bridge, and nothing else.
    sh("tc", "qdisc", "replace", "dev", node.veth, "root", *tbf_args(lay.link_gbps))
    sh("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", "eth0", "root", *tbf_args(lay.link_gbps))


def veth_tx_bytes(node: NodeLayout) -> int:
    """Bytes the host end of the node's veth has sent, i.e. bytes the node has received."""
    with open(f"/sys/class/net/{node.veth}/statistics/tx_bytes") as f:
        return int(f.read())


# ---- processes ------------------------------------------------------------------------------------
def node_pids(ns: str) -> list[int]:
    r = sh("ip", "netns", "pids", ns, check=False)
    return [int(p) for p in r.stdout.split() if p.isdigit() and int(p) != os.getpid()]


def kill_node_processes(ns: str, timeout_s: float = 10.0) -> int:
    """SIGKILL every process in the namespace until none is left (a raylet may still be forking
    workers while we kill). Returns how many were killed; raises if some survive the bound."""
    killed, deadline = 0, time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = node_pids(ns)
        if not pids:
            return killed
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    left = node_pids(ns)
    if left:
        raise ClusterError(f"{ns}: processes {left} survived SIGKILL for {timeout_s:g} s")
    return killed


def processes_mentioning(text: str) -> list[int]:
    """Processes whose command line names `text` (the state dir): a node process that outlived its
    namespace still shows up here."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    pids.append(int(entry))
        except OSError:
            continue
    return pids


# ---- remove (idempotent) --------------------------------------------------------------------------
def remove_cluster(name: str) -> dict[str, list[str]]:
    """Everything named after this cluster, found by prefix (not only what layout.json lists, so a
    crashed `up` is cleaned too): processes, namespaces, veths, the bridge, the state dir."""
    removed: dict[str, list[str]] = {"namespaces": [], "links": [], "processes": [], "dirs": []}
    for ns in namespaces(ClusterLayout.namespace_prefix(name)):
        removed["processes"] += [str(p) for p in node_pids(ns)]
        kill_node_processes(ns)
        sh("ip", "netns", "del", ns, check=False)
        removed["namespaces"].append(ns)
    for link in links(ClusterLayout.veth_prefix(name)) + links(ClusterLayout.bridge_name(name)):
        sh("ip", "link", "del", link, check=False)
        removed["links"].append(link)
    state = ClusterLayout.state_dir_for(name)
    for pid in processes_mentioning(str(state) + "/"):
        try:
            os.kill(pid, signal.SIGKILL)
            removed["processes"].append(str(pid))
        except ProcessLookupError:
            pass
    if state.exists():
        shutil.rmtree(state, ignore_errors=True)
        removed["dirs"].append(str(state))
    return removed


def leftovers(name: str) -> list[str]:
    """What of this cluster still exists (empty after a clean `down`)."""
    out = namespaces(ClusterLayout.namespace_prefix(name))
    out += links(ClusterLayout.veth_prefix(name)) + links(ClusterLayout.bridge_name(name))
    state = ClusterLayout.state_dir_for(name)
    out += [f"pid {p}" for p in processes_mentioning(str(state) + "/")]
    if state.exists():
        out.append(str(state))
    return out
