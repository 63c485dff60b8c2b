"""End to end through real parts: Ray actors, NIXL (host memory), uvicorn on 127.0.0.1 and the
official `openai` client.

The oracle is greedy equality: every mode (colocated whole, colocated chunked with chunk sizes
that do and do not divide the prompt, disaggregated 1P1D and 2P2D) must return exactly the
tokens the engine produces alone in this process.
"""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

pytest.importorskip("ray")  # the servers below run on Ray (conftest.ray_cluster)
from openai import APIStatusError, AsyncOpenAI, OpenAI  # noqa: E402

from engine.checkpoint.tokenizer import ByteTokenizer  # noqa: E402
from router.config import ServeConfig  # noqa: E402
from router.serve_cli import ServerThread  # noqa: E402
from tests.helpers import greedy_reference, samples, stream_completion, wait_until  # noqa: E402

# Ray actors behind a server
pytestmark = [pytest.mark.ray, pytest.mark.server]

PROMPTS = [
    "Hello, pdserve!",
    "The quick brown fox jumps over the lazy dog. " * 2,
    "A long document about disaggregated serving. " * 3,
]  # 15, 90 and 135 bytes
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def expected() -> dict[str, list[int]]:
    """Greedy tokens of the engine alone, no Ray, no transport: the reference for every mode."""
    return greedy_reference(PROMPTS, MAX_TOKENS)


def serve(**kw) -> ServerThread:
    cfg = ServeConfig(model="tiny", num_blocks=128, **kw)
    return ServerThread(cfg, startup_timeout_s=180)  # started by `with`


def complete(client: OpenAI, prompt: str, **kw):
    return client.completions.create(
        model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}, **kw
    )


def token_ids(resp) -> list[int]:
    return resp.model_extra["pdserve"]["timeline"]["token_ids"]


def blocks_used(url: str) -> float:
    """Sum of pdserve_kv_blocks_used over every worker, from /metrics."""
    return sum(v for _, v in samples(httpx.get(url + "/metrics", timeout=30).text, "pdserve_kv_blocks_used"))


def wait_blocks_free(url: str, timeout_s: float = 20.0) -> None:
    wait_until(lambda: blocks_used(url) == 0, timeout_s, "every KV block back in the pool (leaked?)", interval=0.2)


MODES = {
    "colocated": dict(mode="colocated"),
    "colocated-chunk7": dict(mode="colocated", chunk_size=7),
    "colocated-chunk16": dict(mode="colocated", chunk_size=16),
    "disagg-1p1d": dict(mode="disagg", prefill=1, decode=1),
    "disagg-2p2d": dict(mode="disagg", prefill=2, decode=2, policy="least_loaded"),
}


@pytest.mark.parametrize("name", list(MODES))
def test_greedy_tokens_identical_across_modes(ray_cluster, expected, name):
    """Cost: one real server per mode (2P2D: four Ray actors), since the mode is what differs."""
    with serve(**MODES[name]) as srv:
        client = OpenAI(base_url=srv.base_url, api_key="none", max_retries=0)
        for prompt in PROMPTS:
            resp = complete(client, prompt)
            assert token_ids(resp) == expected[prompt], f"{name}: {prompt!r}"
            assert resp.usage.completion_tokens == MAX_TOKENS
            assert resp.choices[0].finish_reason == "length"
        tl = resp.model_extra["pdserve"]["timeline"]
        assert tl["queue_ms"] >= 0 and tl["prefill_ms"] > 0 and tl["first_token_ms"] <= tl["last_token_ms"]
        if name.startswith("disagg"):
            assert tl["transfer"]["bytes"] > 0 and tl["transfer"]["descriptors"] >= 1
            assert set(tl["transfer"]["link_ms"]) == {"nvlink", "ib-400g", "ib-100g"}
        wait_blocks_free(srv.url)


@pytest.fixture(scope="module")
def disagg_server(ray_cluster):
    with serve(mode="disagg", prefill=1, decode=1, max_queue=64) as srv:
        yield srv


def test_streaming_delivers_every_token_in_order_with_usage(disagg_server, expected):
    client = OpenAI(base_url=disagg_server.base_url, api_key="none", max_retries=0)
    prompt = PROMPTS[1]
    chunks = list(complete(client, prompt, stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].finish_reason is None]
    assert len(texts) == MAX_TOKENS  # one chunk per token, then a chunk with the finish reason
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert "".join(texts) == ByteTokenizer().decode(expected[prompt])
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert chunks[-1].usage.prompt_tokens == len(prompt.encode())
    assert chunks[-1].model_extra["pdserve"]["timeline"]["token_ids"] == expected[prompt]


def test_sixteen_concurrent_streams_complete_with_correct_tokens(disagg_server, expected):
    async def one(client: AsyncOpenAI, prompt: str) -> list[int]:
        _, timeline = await stream_completion(client, prompt, MAX_TOKENS)
        return timeline["token_ids"]

    async def main():
        client = AsyncOpenAI(base_url=disagg_server.base_url, api_key="none", max_retries=0)
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(16)]
        return prompts, await asyncio.gather(*(one(client, p) for p in prompts))

    prompts, results = asyncio.run(main())
    for p, ids in zip(prompts, results):
        assert ids == expected[p]
    wait_blocks_free(disagg_server.url)


def test_aborted_stream_frees_blocks_on_both_pools(disagg_server):
    body = {
        "model": "tiny",
        "prompt": PROMPTS[2],
        "max_tokens": 1500,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", disagg_server.base_url + "/completions", json=body) as r:
            assert r.status_code == 200
            seen = 0
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    seen += 1
                if seen >= 5:
                    assert blocks_used(disagg_server.url) > 0  # the stream holds decode blocks
                    break  # disconnect mid-stream
    assert seen == 5
    wait_blocks_free(disagg_server.url)


BAD_REQUESTS = [
    ("malformed json", b"{not json", 400),
    ("wrong type", {"model": "tiny", "prompt": "hi", "max_tokens": "ten"}, 400),
    ("unknown model", {"model": "gpt-9", "prompt": "hi"}, 404),
    ("max_tokens < 1", {"model": "tiny", "prompt": "hi", "max_tokens": 0}, 400),
    ("max_tokens over limit", {"model": "tiny", "prompt": "hi", "max_tokens": 10**6}, 400),
    ("over context", {"model": "tiny", "prompt": "x" * 1500, "max_tokens": 1000}, 400),
    ("bad temperature", {"model": "tiny", "prompt": "hi", "temperature": -1}, 400),
    ("bad top_p", {"model": "tiny", "prompt": "hi", "top_p": 1.5}, 400),
    ("unsupported n", {"model": "tiny", "prompt": "hi", "n": 3}, 400),
]


def test_bad_input_gets_4xx_while_a_stream_completes(disagg_server, expected):
    client = OpenAI(base_url=disagg_server.base_url, api_key="none", max_retries=0)
    result: dict = {}

    def long_stream():
        chunks = list(
            client.completions.create(
                model="tiny",
                prompt=PROMPTS[0],
                max_tokens=200,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
        )
        result["ids"] = chunks[-1].model_extra["pdserve"]["timeline"]["token_ids"]

    t = threading.Thread(target=long_stream)
    t.start()
    with httpx.Client(timeout=30) as http:
        for name, body, status in BAD_REQUESTS:
            if isinstance(body, bytes):
                r = http.post(
                    disagg_server.base_url + "/completions", content=body, headers={"Content-Type": "application/json"}
                )
            else:
                r = http.post(disagg_server.base_url + "/completions", json=body)
            assert r.status_code == status, f"{name}: {r.status_code} {r.text}"
            err = r.json()["error"]
            assert err["message"] and err["type"], name
    t.join(timeout=120)
    assert len(result["ids"]) == 200 and result["ids"][:MAX_TOKENS] == expected[PROMPTS[0]]
    wait_blocks_free(disagg_server.url)


def test_openai_client_sees_clear_error_for_bad_request(disagg_server):
    client = OpenAI(base_url=disagg_server.base_url, api_key="none", max_retries=0)
    with pytest.raises(APIStatusError) as e:
        client.completions.create(model="tiny", prompt="hi", max_tokens=0)
    assert e.value.status_code == 400 and "max_tokens" in str(e.value)
