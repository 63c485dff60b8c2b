"""`pdserve cluster up|down|exec|kill`: a multi-node cluster rehearsed in network namespaces.

    pdserve cluster up --nodes 3 --link-gbps 1          # namespaces, bridge, tbf, Ray head + workers
    pdserve cluster exec 0 -- pdserve serve --ray-address 198.18.K.1:6379 \\
        --prefill-resources '{"node1": 1}' --decode-resources '{"node2": 1}' --link-gbps 1
    pdserve cluster kill 2                                # node loss: every process of node 2 dies
    pdserve cluster up --node 2                           # node 2 comes back (same address, resource)
    pdserve cluster down                                  # removes everything `up` made; idempotent

Needs root and Linux network namespaces; without them it says so in one line (exit status 2).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import zlib

from cli import CliError
from cli.output import emit_json
from cluster.layout import MAX_NODES, NAME_RE, ClusterLayout, NodeLayout
from cluster.netns import (
    ClusterError,
    check_privileges,
    create_bridge,
    create_node,
    kill_node_processes,
    leftovers,
    remove_cluster,
    subnet_in_use,
)
from cluster.ray_nodes import start_node, wait_joined, write_token


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = __doc__.split("\n\n", 1)[1]
    sub = p.add_subparsers(dest="cluster_command", metavar="ACTION", required=True)

    def named(q: argparse.ArgumentParser) -> argparse.ArgumentParser:
        q.add_argument(
            "--name",
            default="a",
            help="cluster name, 1-4 of [a-z0-9]; names every namespace, link and dir it owns (default a)",
        )
        return q

    up = named(sub.add_parser("up", help="create the nodes, links and Ray cluster (or restart one node)"))
    up.add_argument("--nodes", type=int, default=3, help="number of nodes (default 3)")
    up.add_argument(
        "--link-gbps",
        type=float,
        default=10.0,
        help="every node's link rate in Gbit/s, each direction, shaped by tc tbf (default 10)",
    )
    up.add_argument("--cpus-per-node", type=int, default=4, help="CPUs each Ray node advertises (default 4)")
    up.add_argument(
        "--ucx-tls",
        default="tcp,self",
        help="UCX transports the nodes' NIXL may use (default tcp,self: over the shaped link)",
    )
    up.add_argument(
        "--node",
        type=int,
        default=None,
        metavar="I",
        help="(re)start only node I of the existing cluster, e.g. after `cluster kill I`",
    )
    up.add_argument("--json", action="store_true", help="print the whole layout as one JSON document")
    down = named(sub.add_parser("down", help="remove every namespace, link, process and dir of the cluster"))
    down.add_argument("--json", action="store_true", help="print what was removed as one JSON document")
    ex = named(sub.add_parser("exec", help="run a command on node I (inside its namespace, with its environment)"))
    ex.add_argument("node", type=int, metavar="I")
    ex.add_argument(
        "--timeout", type=float, default=None, metavar="S", help="kill the command after S seconds (exit 124)"
    )
    ex.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- CMD", help="the command and its arguments")
    kill = named(sub.add_parser("kill", help="node loss: SIGKILL every process of node I"))
    kill.add_argument("node", type=int, metavar="I")


def main(args: argparse.Namespace) -> int:
    if not NAME_RE.match(args.name):
        raise CliError(f"--name {args.name!r}: 1-4 characters of [a-z0-9] (interface names are short)")
    try:
        check_privileges()
        return {"up": _up, "down": _down, "exec": _exec, "kill": _kill}[args.cluster_command](args)
    except ClusterError as e:
        raise CliError(str(e)) from None


def _load(name: str) -> ClusterLayout:
    lay = ClusterLayout.load(name)
    if lay is None:
        raise CliError(f"no cluster named {name!r} is up (`pdserve cluster up --name {name}`)")
    return lay


def _node(lay: ClusterLayout, index: int, what: str) -> NodeLayout:
    """Node `index` of the cluster, or a one-line error led by `what` (the flag or subcommand)."""
    try:
        return lay.node(index)
    except IndexError as e:
        raise CliError(f"{what}: {e}") from None


def _pick_subnet(name: str) -> int:
    k = 1 + zlib.crc32(name.encode()) % 200
    for _ in range(250):
        if not subnet_in_use(k):
            return k
        k = k % 250 + 1
    raise CliError("every 198.18.K.0/24 subnet is in use on this host")


def _up(args: argparse.Namespace) -> int:
    if args.node is not None:
        return _restart_node(args)
    if not 1 <= args.nodes <= MAX_NODES:
        raise CliError(f"--nodes {args.nodes}: must be in 1..{MAX_NODES}")
    if not 0 < args.link_gbps <= 400:
        raise CliError(f"--link-gbps {args.link_gbps:g}: must be in (0, 400]")
    if args.cpus_per_node < 1:
        raise CliError(f"--cpus-per-node {args.cpus_per_node}: must be >= 1")
    if leftovers(args.name):
        raise CliError(f"cluster {args.name!r} already exists; `pdserve cluster down --name {args.name}` first")
    t0 = time.monotonic()
    lay = ClusterLayout.build(
        args.name, args.nodes, args.link_gbps, args.cpus_per_node, _pick_subnet(args.name), args.ucx_tls
    )
    try:
        lay.state_dir.mkdir(mode=0o700, parents=True)
        write_token(lay)
        lay.save()
        create_bridge(lay)
        for node in lay.nodes:
            create_node(lay, node)
        for node in lay.nodes:  # head first: the workers join it
            start_node(lay, node)
        wait_joined(lay, [n.resource for n in lay.nodes])
    except BaseException:
        remove_cluster(args.name)  # never leave half a cluster behind
        raise
    if args.json:
        emit_json({**lay.to_dict(), "up_seconds": round(time.monotonic() - t0, 2)})
    else:
        print(
            f"pdserve cluster {lay.name}: {len(lay.nodes)} nodes up in {time.monotonic() - t0:.1f} s, "
            f"links {lay.link_gbps:g} Gbit/s (tbf), Ray token auth on\n"
            f"  head: {lay.head_address}   nodes: "
            + ", ".join(f"{n.index}={n.address}" for n in lay.nodes)
            + f"\n  pdserve cluster exec 0 -- pdserve serve --ray-address {lay.head_address} ..."
        )
    return 0


def _restart_node(args: argparse.Namespace) -> int:
    lay = _load(args.name)
    node = _node(lay, args.node, "--node")
    t0 = time.monotonic()
    kill_node_processes(node.namespace)  # whatever is left of the old incarnation
    start_node(lay, node)
    wait_joined(lay, [node.resource])
    if args.json:
        emit_json({**lay.to_dict(), "restarted_node": node.index, "up_seconds": round(time.monotonic() - t0, 2)})
    else:
        print(f"pdserve cluster {lay.name}: node {node.index} ({node.address}) back in {time.monotonic() - t0:.1f} s")
    return 0


def _down(args: argparse.Namespace) -> int:
    removed = remove_cluster(args.name)
    left = leftovers(args.name)
    if left:
        raise CliError(f"cluster {args.name!r}: could not remove {', '.join(left)}")
    if args.json:
        emit_json({"name": args.name, "removed": removed})
    else:
        n = len(removed["namespaces"])
        print(
            f"pdserve cluster {args.name}: down ({n} namespaces, {len(removed['links'])} links, "
            f"{len(removed['processes'])} processes removed)"
            if n or removed["links"] or removed["dirs"]
            else f"pdserve cluster {args.name}: nothing to remove"
        )
    return 0


def _exec(args: argparse.Namespace) -> int:
    from cluster.ray_nodes import in_node  # noqa: PLC0415

    argv = list(args.argv)
    if "--" in argv:  # options written after I (`exec 1 --name b -- cmd`) land in REMAINDER too
        cut = argv.index("--")
        opts = argparse.ArgumentParser(prog="pdserve cluster exec", add_help=False)
        opts.add_argument("--name", default=args.name)
        opts.add_argument("--timeout", type=float, default=args.timeout)
        known, rest = opts.parse_known_args(argv[:cut])
        if rest:
            raise CliError(f"exec: unexpected {' '.join(rest)!r} before `--`")
        args.name, args.timeout, argv = known.name, known.timeout, argv[cut + 1 :]
        if not NAME_RE.match(args.name):
            raise CliError(f"--name {args.name!r}: 1-4 characters of [a-z0-9]")
    lay = _load(args.name)
    if not argv:
        raise CliError("exec: give the command after `--`, e.g. pdserve cluster exec 0 -- hostname -I")
    node = _node(lay, args.node, "exec")
    full = in_node(lay, node, argv)
    if args.timeout is None:
        sys.stdout.flush()
        os.execvp(full[0], full)  # the command's exit status and signals are the caller's
    try:
        return subprocess.run(full, timeout=args.timeout).returncode
    except subprocess.TimeoutExpired:
        print(f"pdserve cluster exec: command killed after {args.timeout:g} s", file=sys.stderr)
        return 124


def _kill(args: argparse.Namespace) -> int:
    lay = _load(args.name)
    node = _node(lay, args.node, "kill")
    n = kill_node_processes(node.namespace)
    print(f"pdserve cluster {lay.name}: node {node.index} lost ({n} processes killed)")
    return 0
