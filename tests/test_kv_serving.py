"""The KV cache manager end to end (Ray, NIXL on host memory, uvicorn, the openai client): a pool
too small for every stream at once forces preemptions, repeated prefixes hit the caches, and the
greedy tokens still equal the engine alone; no block stays in use afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray")  # the servers below run on Ray (conftest.ray_cluster)
from openai import AsyncOpenAI  # noqa: E402

from benchmarks.client import bench_serve  # noqa: E402
from engine.checkpoint.tokenizer import ByteTokenizer  # noqa: E402
from engine.config import PRESETS, CacheConfig  # noqa: E402
from engine.kv.layout import KVLayout  # noqa: E402
from router.config import ServeConfig  # noqa: E402
from router.serve_cli import ServerThread  # noqa: E402
from tests.helpers import greedy_reference, samples, stream_completion, wait_until  # noqa: E402

# Ray actors behind a server
pytestmark = [pytest.mark.ray, pytest.mark.server]

SYSTEM = "You are a helpful assistant for pdserve. Answer briefly. "  # 57 bytes: 3 full blocks of 16
PROMPTS = [SYSTEM + q for q in ("What is KV?", "Why disaggregate?", "What is a lease?", "Hi")] * 2
MAX_TOKENS = 40
NUM_BLOCKS = 20  # 320 tokens per worker: 8 streams of up to ~115 tokens need ~900 at once


@pytest.fixture(scope="module")
def expected() -> dict[str, list[int]]:
    return greedy_reference(PROMPTS, MAX_TOKENS, enable_prefix_caching=False)


def _per_worker(url: str, name: str) -> dict[str, float]:
    return {labels["worker"]: v for labels, v in samples(httpx.get(url + "/metrics", timeout=30).text, name)}


def _metric(url: str, name: str) -> float:
    return sum(_per_worker(url, name).values())


async def _stream(client: AsyncOpenAI, prompt: str | list[int]) -> dict:
    text, timeline = await stream_completion(client, prompt, MAX_TOKENS)
    return {"text": text, **timeline}


def _run_all(url: str, prompts: list[str] | list[list[int]]) -> list[dict]:
    async def main():
        client = AsyncOpenAI(base_url=url, api_key="none", max_retries=0)
        return await asyncio.gather(*(_stream(client, p) for p in prompts))

    return asyncio.run(main())


def _wait_in_use_zero(url: str) -> None:
    wait_until(lambda: _metric(url, "pdserve_kv_blocks_used") == 0, 20, "no KV block left in use", interval=0.2)


MODES = {
    "colocated": dict(mode="colocated", chunk_size=16),
    "disagg": dict(mode="disagg", prefill=1, decode=1),
    "disagg-no-prefix-cache": dict(mode="disagg", prefill=1, decode=1, prefix_cache=False),
    # room for every stream: no preemption, so the second turn finds its first turn's blocks
    "disagg-2p2d-prefix": dict(mode="disagg", prefill=2, decode=2, policy="prefix", num_blocks=64),
    # prefix routing and caching under forced preemption: 4 streams per decode worker need ~23
    # blocks (3 shared), its pool has 14, so any 3 of them decoding at once preempt (with 20, only
    # all 4 at once did: requests admitted as soon as their KV lands overlapped too little to be sure)
    "disagg-2p2d-prefix-preempt": dict(mode="disagg", prefill=2, decode=2, policy="prefix", num_blocks=14),
}
NO_PREEMPTION = {"disagg-2p2d-prefix"}  # room for every stream


@pytest.mark.parametrize("name", list(MODES))
def test_forced_preemption_and_caching_keep_greedy_tokens(ray_cluster, expected, name):
    """Cost: one server per mode (2P2D: four Ray actors), with a pool small enough to force preemptions."""
    cfg = ServeConfig(model="tiny", **{"num_blocks": NUM_BLOCKS, "max_queue": 64, **MODES[name]})
    with ServerThread(cfg, startup_timeout_s=180) as srv:
        timelines = _run_all(srv.base_url, PROMPTS)
        for prompt, tl in zip(PROMPTS, timelines):
            assert tl["token_ids"] == expected[prompt], prompt
            assert tl["text"] == ByteTokenizer().decode(expected[prompt])  # streamed once each, in order
        preempted = sum(tl.get("preemptions", 0) for tl in timelines)
        assert _metric(srv.url, "pdserve_preemptions_total") == preempted
        assert (preempted > 0) == (name not in NO_PREEMPTION)
        # a second turn of one conversation: its prompt is the first turn's tokens, the reply's and
        # a new message, as token ids (the tiny model's reply bytes are not valid UTF-8, so as text
        # they would not re-encode to the reply's tokens and only the prompt's blocks would match)
        tok = ByteTokenizer()
        turn2 = tok.encode(PROMPTS[0]) + expected[PROMPTS[0]] + tok.encode(" And V?")
        # no settle wait: under policy prefix the router syncs a request's workers' cache events
        # before it sends the last token, so turn 2 finds turn 1 in the index (read-your-writes)
        tl2 = _run_all(srv.base_url, [turn2])[0]
        caching = cfg.prefix_cache
        cached = tl2.get("prefill_cached_tokens" if name.startswith("disagg") else "cached_tokens", 0)
        assert (cached >= len(PROMPTS[0]) // 16 * 16) if caching else cached == 0
        if cfg.policy == "prefix":  # routed to workers holding turn 1's prompt (4 full blocks each side)
            assert tl2["routed_prefix_blocks"]["decode"] >= 4 and tl2["routed_prefix_blocks"]["prefill"] >= 4
            # what the router routed on is what the worker found: its index is not behind
            assert tl2["decode_cached_tokens"] >= tl2["routed_prefix_blocks"]["decode"] * 16 - 16
            if cfg.num_blocks > NUM_BLOCKS:
                # Nothing evicted: only turn 1's decode worker also holds blocks of its reply. (Not
                # under preemption, where those may be gone and "What is a lease?", on the other
                # worker, shares the same 4 blocks: a tie broken by load. Nor on the prefill side,
                # which never sees replies: the same tie.)
                firsts = [tl for p, tl in zip(PROMPTS, timelines) if p == PROMPTS[0]]
                assert tl2["decode_worker"] in {tl["decode_worker"] for tl in firsts}
        if name.startswith("disagg"):
            blocks = -(-tl2["prompt_tokens"] // 16)
            assert tl2["kv_blocks_pulled"] == (blocks - tl2["decode_cached_tokens"] // 16)
            assert (tl2["kv_blocks_pulled"] < blocks) == caching
            block_bytes = KVLayout.build(PRESETS["tiny"], CacheConfig(num_blocks=NUM_BLOCKS)).block_bytes
            assert tl2["transfer"]["bytes"] == tl2["kv_blocks_pulled"] * block_bytes  # only the missing blocks
        _wait_in_use_zero(srv.url)
        # the ledger each worker reports: every block free (cached blocks count as free), none lost
        free = _per_worker(srv.url, "pdserve_kv_blocks_free")
        assert len(free) == cfg.decode + (cfg.prefill if cfg.mode == "disagg" else 0)
        assert set(free.values()) == {cfg.num_blocks}, free
        assert (_metric(srv.url, "pdserve_kv_blocks_cached") > 0) == caching


def test_bench_serve_multiturn_reports_hits_and_fewer_bytes_from_turn_2(ray_cluster, tmp_path, capsys):
    """`pdserve bench serve --workload multiturn` against a real server with caching + prefix
    routing: turn 2 finds turn 1 (prompt and reply) in both caches and pulls only the rest.

    Cost: a 2P2D server (four Ray actors) and two turns of multi-turn chat through `bench serve`.
    """
    cfg = ServeConfig(model="tiny", mode="disagg", prefill=1, decode=1, policy="prefix", num_blocks=64)
    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    words = "--conversations 2 --turns 2 --system-len 48 --user-len 8 --reply-len 24 --json --out-dir"
    with ServerThread(cfg, startup_timeout_s=180) as srv:
        args = parser.parse_args(["--base-url", srv.url, "--workload", "multiturn", *words.split(), str(tmp_path)])
        assert bench_serve.main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests"] == 4
    assert out["prefill_hit_rate"] > 0 and out["decode_hit_rate"] > 0
    t1, t2 = out["by_turn"]["1"], out["by_turn"]["2"]
    block_bytes = KVLayout.build(PRESETS["tiny"], CacheConfig(num_blocks=64)).block_bytes
    # turn 2: 88 tokens, 6 blocks; turn 1's 56 + 24 left 4 full blocks on the decode worker
    assert t2["bytes_per_request"] == 2 * block_bytes < t1["bytes_per_request"]
    records = json.loads(Path(out["result_file"]).read_text())["records"]
    assert [r["turn"] for r in records] == [1, 2, 1, 2]
