"""Layer-wise KV streaming (issue 39 item 6) through one server end to end (Ray, NIXL, uvicorn,
the openai client): per-request `kv_transfer`, the timeline's mode and overlap, a 400 for an
unknown mode, no block left in use. The in-process tests: tests/test_layerwise.py and
tests/test_layerwise_faults.py.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.helpers import wait_until
from tests.layerwise_workers import BLOCK_BYTES, LAYERS

pytestmark = pytest.mark.timeout(180)

E2E_PROMPTS = [
    "Layer-wise streaming: " + "the KV of each group of layers crosses while the prompt prefills. " * 4,
    "A second, shorter prompt about disaggregated serving and its KV transfer.",
    "Prefill computes, decode generates; between them the KV moves, " * 3,
]


@pytest.mark.ray
@pytest.mark.server
def test_server_serves_bulk_and_layerwise_per_request(ray_cluster):
    """`pdserve serve --mode disagg --kv-transfer layerwise --kv-stream-layers 1` (tiny, chunked
    prefill, --verify-kv, no prefix cache so that both modes move every block): each prompt asked
    with kv_transfer "bulk", then "layerwise", decodes the same tokens; the timelines say which
    mode ran; the streamed pulls overlap the prefill; "fast" is a 400; no block stays in use.

    Cost: one 1P1D server (two Ray actors)."""
    import argparse

    import httpx
    from openai import AsyncOpenAI

    from router.serve_cli import ServerThread, add_arguments, config_from_args
    from tests.helpers import samples

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = "--mode disagg --model tiny --prefill 1 --decode 1 --kv-transfer layerwise --kv-stream-layers 1"
    flags += " --chunk-size 32 --verify-kv --no-prefix-cache --num-blocks 64"
    cfg = config_from_args(parser.parse_args(flags.split()))
    assert (cfg.kv_transfer, cfg.kv_stream_layers, cfg.transport) == ("layerwise", 1, "nixl")

    async def ask(client: AsyncOpenAI, prompt: str, mode: str | None) -> dict:
        body = {"ignore_eos": True} | ({"kv_transfer": mode} if mode else {})
        r = await client.completions.create(
            model="tiny", prompt=prompt, max_tokens=8, temperature=0, extra_body=body
        )  # fmt: skip
        return r.model_extra["pdserve"]["timeline"]

    async def run_all(url: str, mode: str | None) -> list[dict]:
        client = AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
        return await asyncio.gather(*(ask(client, p, mode) for p in E2E_PROMPTS))

    def used(url: str) -> dict[str, float]:
        text = httpx.get(url + "/metrics", timeout=30).text
        return {labels["worker"]: v for labels, v in samples(text, "pdserve_kv_blocks_used")}

    with ServerThread(cfg, startup_timeout_s=180) as srv:
        bulk = asyncio.run(run_all(srv.base_url, "bulk"))
        layerwise = asyncio.run(run_all(srv.base_url, "layerwise"))
        default = asyncio.run(run_all(srv.base_url, None))  # the server's own: layer-wise
        for b, lw, df in zip(bulk, layerwise, default):
            assert b["token_ids"] == lw["token_ids"] == df["token_ids"] and len(b["token_ids"]) == 8
            assert (b["kv_transfer"], b["transfer"]["mode"], b["transfer"]["overlap_ms"]) == ("bulk", "bulk", 0.0)
            for tl in (lw, df):
                tr = tl["transfer"]
                # a short prompt's few chunks may all be pulled after its prefill on a loaded machine
                assert (tl["kv_transfer"], tr["mode"]) == ("layerwise", "layerwise") and tr["overlap_ms"] >= 0
                assert tr["bytes"] == b["transfer"]["bytes"] == tl["kv_blocks"] * BLOCK_BYTES
                assert tr["groups"] == len(tr["group_spans"]) >= LAYERS
        # ...but the pulls overlapped the prefill of at least one of them
        assert any(tl["transfer"]["overlap_ms"] > 0 for tl in layerwise + default)
        bad = httpx.post(
            srv.base_url + "/completions",
            json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "kv_transfer": "fast"},
            timeout=30,
        )
        assert bad.status_code == 400, bad.text
        assert bad.json()["error"]["param"] == "kv_transfer", bad.json()
        wait_until(lambda: set(used(srv.url).values()) == {0.0}, 20, lambda: f"no block in use: {used(srv.url)}")
        assert len(used(srv.url)) == 2
