"""Pool behaviour beyond the happy path: placement on labelled nodes of a two-node Ray cluster,
a worker that dies (its request fails clearly, the pool replaces it), and lease expiry freeing
prefill blocks that decode never pulled."""

from __future__ import annotations

import os
import tempfile

import pytest

ray = pytest.importorskip("ray")
from openai import APIError, APIStatusError, OpenAI  # noqa: E402

from contracts.worker import GenerateRequest, WorkerConfig  # noqa: E402
from engine.sequence import SamplingParams  # noqa: E402
from router.config import ServeConfig  # noqa: E402
from router.serve_cli import ServerThread  # noqa: E402
from router.workers.ray_cluster import ensure_local_token  # noqa: E402
from tests.helpers import wait_until  # noqa: E402
from tests.ray_session import fresh_ray, shared_ray  # noqa: E402

# Ray actors behind a server
pytestmark = [pytest.mark.ray, pytest.mark.server]


@pytest.fixture
def two_node_cluster():
    """Two Ray nodes on this machine, labelled with custom resources for each pool."""
    from ray.cluster_utils import Cluster  # noqa: PLC0415

    fresh_ray()  # conftest: this test needs a two-node cluster, not the session's shared one
    ensure_local_token()  # the token every node of this cluster and the driver share
    temp = tempfile.mkdtemp(prefix="pdcl", dir="/tmp")
    os.makedirs("/tmp/ray", exist_ok=True)  # Cluster records its address there, whatever temp_dir says
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "resources": {"prefill_node": 4},
            "object_store_memory": 96 * 1024**2,
            "temp_dir": temp,
            "include_dashboard": False,
            "node_ip_address": "127.0.0.1",
        },
    )
    cluster.add_node(
        num_cpus=2, resources={"decode_node": 4}, object_store_memory=96 * 1024**2, node_ip_address="127.0.0.1"
    )
    ray.init(address=cluster.address, _node_ip_address="127.0.0.1", log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_pools_placed_on_labelled_nodes_and_serve(two_node_cluster):
    """Cost: a two-node Ray cluster of its own (ray.cluster_utils): placement across labelled nodes is what
    is tested."""
    cfg = ServeConfig(
        mode="disagg",
        model="tiny",
        num_blocks=128,
        prefill_resources={"prefill_node": 1},
        decode_resources={"decode_node": 1},
    )
    nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    with ServerThread(cfg, startup_timeout_s=180) as srv:
        client = OpenAI(base_url=srv.base_url, api_key="none", max_retries=0)
        resp = client.completions.create(
            model="tiny", prompt="Hello cluster", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
        )
        assert resp.usage.completion_tokens == 8
        assert resp.model_extra["pdserve"]["timeline"]["transfer"]["bytes"] > 0
        # placement group table (GCS): which node each pool's bundle landed on
        placed = {}
        for pg in ray.util.placement_group_table().values():
            if pg["state"] == "CREATED" and pg["name"].startswith("pdserve-"):
                role = pg["name"].split("-")[1]
                placed[role] = set(pg["bundles_to_node_id"].values())
    assert len(placed["prefill"]) == 1 and len(placed["decode"]) == 1
    placed = {"PrefillWorker": placed["prefill"].pop(), "DecodeWorker": placed["decode"].pop()}
    assert "prefill_node" in nodes[placed["PrefillWorker"]]
    assert "decode_node" in nodes[placed["DecodeWorker"]]
    assert placed["PrefillWorker"] != placed["DecodeWorker"]


@pytest.fixture
def local_ray():
    shared_ray()  # conftest: the session's token-auth cluster
    yield


def test_dead_decode_worker_fails_its_request_and_is_replaced(local_ray):
    cfg = ServeConfig(mode="colocated", model="tiny", num_blocks=128)
    with ServerThread(cfg, startup_timeout_s=180) as srv:
        client = OpenAI(base_url=srv.base_url, api_key="none", max_retries=0)
        stream = client.completions.create(
            model="tiny", prompt="doomed", max_tokens=1500, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        next(iter(stream))  # the request is running on the worker
        (actor,) = [
            a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("pdserve-colocated")
        ]
        ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
        with pytest.raises(APIError) as failed:  # reported in-band: the stream had started
            for _ in stream:
                pass
        assert "decode worker colocated-0 died" in str(failed.value)

        def served():  # the pool replaces the worker; new requests succeed
            try:
                return client.completions.create(model="tiny", prompt="after", max_tokens=4, temperature=0)
            except APIStatusError:
                return None

        resp = wait_until(served, 120, "a request served after the dead worker's replacement", interval=1)
        assert resp.usage.completion_tokens >= 1


def test_lease_expiry_frees_prefill_blocks_never_pulled():
    """A prefill result whose KV nobody pulls: its blocks return to the free list at the lease's end."""
    from prefill_worker.worker import PrefillWorker  # noqa: PLC0415

    worker = PrefillWorker(WorkerConfig(model="tiny", num_blocks=32, lease_s=0.3, transport="local"), "lease-test")
    try:
        result = worker.prefill(GenerateRequest("r1", list(b"x" * 40), SamplingParams(max_tokens=4)))
        assert len(result.handle.block_ids) == 3  # 40 tokens in blocks of 16
        assert worker.stats().blocks_free == 32 - 3 and worker.stats().parked == 1
        wait_until(lambda: worker.stats().blocks_free == 32, 5, "the lease's blocks back in the free list")
        assert worker.stats().parked == 0
        assert worker.leases_expired == 1
    finally:
        worker.shutdown()
