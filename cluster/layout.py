"""ClusterLayout: every name and address `cluster up` creates, so `down` can remove exactly those.

Names carry the prefix `pds` and the cluster's name, so several engineers (and a test next to a
benchmark) can each run their own cluster on one machine without touching each other's:

    namespace  pds-<name>-n<i>      node i
    bridge     pds<name>-br         the switch every node hangs off (host side, address .254)
    veth       pds<name>-v<i>       node i's cable, host end (the node end is `eth0` in its namespace)
    subnet     198.18.<k>.0/24      k chosen per cluster; node i is .<i+1>
    state dir  /tmp/pds-<name>/     layout.json, the Ray auth token, each node's Ray temp dir, logs

Linux caps interface names at 15 bytes, which is why the cluster name is at most 4 characters.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

NAME_RE = re.compile(r"^[a-z0-9]{1,4}$")
MAX_NODES = 64
RAY_PORT = 6379
STATE_ROOT = Path("/tmp")


@dataclass(frozen=True)
class NodeLayout:
    index: int
    namespace: str
    address: str  # the node's own IPv4 address
    veth: str  # host end of the node's veth pair
    resource: str  # Ray custom resource naming this node ("node0", ...)


@dataclass
class ClusterLayout:
    name: str
    subnet_index: int  # k in 198.18.k.0/24
    link_gbps: float  # every node's link, each direction
    cpus_per_node: int
    nodes: list[NodeLayout] = field(default_factory=list)
    ucx_tls: str = "tcp,self"  # what the NIXL/UCX of every node may use (see docs/cluster.md)

    # ---- names --------------------------------------------------------------------------------
    @staticmethod
    def namespace_prefix(name: str) -> str:
        return f"pds-{name}-n"

    @staticmethod
    def bridge_name(name: str) -> str:
        return f"pds{name}-br"

    @staticmethod
    def veth_prefix(name: str) -> str:
        return f"pds{name}-v"

    @staticmethod
    def state_dir_for(name: str) -> Path:
        return STATE_ROOT / f"pds-{name}"

    @property
    def bridge(self) -> str:
        return self.bridge_name(self.name)

    @property
    def state_dir(self) -> Path:
        return self.state_dir_for(self.name)

    @property
    def token_path(self) -> Path:
        return self.state_dir / "auth_token"

    @property
    def host_address(self) -> str:
        """The bridge's address: where the operator's shell (and the tests) reach the nodes from."""
        return f"198.18.{self.subnet_index}.254"

    @property
    def prefix_len(self) -> int:
        return 24

    @property
    def head_address(self) -> str:
        return f"{self.nodes[0].address}:{RAY_PORT}"

    def node(self, i: int) -> NodeLayout:
        if not 0 <= i < len(self.nodes):
            raise IndexError(f"node {i}: this cluster has nodes 0..{len(self.nodes) - 1}")
        return self.nodes[i]

    def ray_temp_dir(self, i: int) -> Path:
        return self.state_dir / f"ray{i}"  # short: Ray's unix socket paths must fit in 107 bytes

    def log_path(self, i: int) -> Path:
        return self.state_dir / f"node{i}.log"

    def node_env(self) -> dict[str, str]:
        """The environment every process on a node starts with: what a real host would have in its
        profile. Token auth on (the token file is shared the way a real cluster shares a secret);
        UCX restricted to TCP, because between namespaces of one host it would otherwise pick a
        shared-memory transport (cma/sysv/posix) and the KV would never touch the shaped link."""
        return {
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(self.token_path),
            "UCX_TLS": self.ucx_tls,
            "UCX_NET_DEVICES": "eth0",
            # A killed node is declared dead in ~3 s instead of ~15 s (node-loss rehearsal).
            "RAY_health_check_period_ms": "1000",
            "RAY_health_check_failure_threshold": "3",
            "RAY_USAGE_STATS_ENABLED": "0",
            "PYTHONUNBUFFERED": "1",
        }

    # ---- build / persist ----------------------------------------------------------------------
    @classmethod
    def build(
        cls, name: str, nodes: int, link_gbps: float, cpus_per_node: int, subnet_index: int, ucx_tls: str = "tcp,self"
    ) -> ClusterLayout:
        lay = cls(name, subnet_index, link_gbps, cpus_per_node, ucx_tls=ucx_tls)
        lay.nodes = [
            NodeLayout(
                i,
                f"{cls.namespace_prefix(name)}{i}",
                f"198.18.{subnet_index}.{i + 1}",
                f"{cls.veth_prefix(name)}{i}",
                f"node{i}",
            )
            for i in range(nodes)
        ]
        return lay

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            head_address=self.head_address,
            bridge=self.bridge,
            host_address=self.host_address,
            state_dir=str(self.state_dir),
            token_path=str(self.token_path),
            subnet=f"198.18.{self.subnet_index}.0/{self.prefix_len}",
        )
        return d

    def save(self) -> None:
        path = self.state_dir / "layout.json"
        path.write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, name: str) -> ClusterLayout | None:
        path = cls.state_dir_for(name) / "layout.json"
        try:
            d = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        lay = cls(
            d["name"], d["subnet_index"], d["link_gbps"], d["cpus_per_node"], ucx_tls=d.get("ucx_tls", "tcp,self")
        )
        lay.nodes = [NodeLayout(**n) for n in d["nodes"]]
        return lay
