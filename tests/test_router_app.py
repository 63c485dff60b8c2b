"""The FastAPI app over tests/fakes.FakeOrchestrator, for its own logic: responses and timelines,
SSE, stop strings that abort the rest, errors with OpenAI bodies, auth, worker failure, 429,
metrics, and aborts on client disconnect (through a real uvicorn). The pure protocol functions are
tested in tests/test_router_protocol.py; serving through real workers in the serving tests."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
import uvicorn

from engine.checkpoint.tokenizer import ByteTokenizer
from engine.config import PRESETS
from router.config import ServeConfig
from router.http.app import create_app
from tests.fakes import FakeOrchestrator
from tests.helpers import async_wait_until, value, wait_until

TOK = ByteTokenizer()


# ------------------------------------------------------------------------------ the app over a fake
def make_app(orch=None, **cfg):
    cfg = ServeConfig(**{"model": "tiny", "num_blocks": 64, "block_size": 16, **cfg})
    orch = orch or FakeOrchestrator(PRESETS["tiny"])
    return create_app(orch, TOK, cfg), orch


def run(coro):
    return asyncio.run(coro)


async def _post(app, path, body, headers=None, raw=None):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        if raw is not None:
            return await c.post(path, content=raw, headers=headers)
        return await c.post(path, json=body, headers=headers)


def sse_payloads(text: str) -> list:
    events = [e[len("data: ") :] for e in text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_app_completion_and_timeline():
    app, orch = make_app()
    r = run(_post(app, "/v1/completions", {"model": "tiny", "prompt": "ab", "max_tokens": 5, "temperature": 0}))
    assert r.status_code == 200
    body = r.json()
    assert body["choices"][0]["text"] == "ababa" and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7}
    assert body["id"] == r.headers["x-request-id"] == orch.requests[0].request_id
    assert body["pdserve"]["timeline"]["output_tokens"] == 5
    assert orch.requests[0].params.temperature == 0.0 and orch.aborted == []

    async def get(path):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.get(path)

    tl = run(get(f"/v1/requests/{body['id']}/timeline"))
    assert tl.status_code == 200 and tl.json()["request_id"] == body["id"]
    missing = run(get("/v1/requests/cmpl-nope/timeline"))
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "request_not_found"
    models = run(get("/v1/models")).json()
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 1024  # 64 blocks x 16


def test_app_stream_with_stop_string_aborts_the_rest():
    app, orch = make_app()
    r = run(
        _post(
            app,
            "/v1/completions",
            {
                "prompt": "abcd",
                "max_tokens": 20,
                "stop": "da",
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
    )
    chunks = sse_payloads(r.text)
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == "abc"
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    assert chunks[-1]["usage"]["completion_tokens"] == 5 and "timeline" in chunks[-1]["pdserve"]
    wait_until(lambda: orch.aborted, 5, "the abort, sent once the response has been written", interval=0.01)
    assert orch.aborted == [chunks[0]["id"]]  # the workers stop generating past the stop string


def test_app_chat_stream_and_eos():
    app, orch = make_app(FakeOrchestrator(PRESETS["tiny"], eos_id=257, script=lambda ids, n: [104, 105, 257, 120][:n]))
    r = run(_post(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True}))
    chunks = sse_payloads(r.text)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "hi"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop" and "pdserve" in chunks[-1]
    assert orch.aborted == []


def test_app_errors_have_openai_bodies():
    app, _ = make_app(api_key="secret")
    ok = {"Authorization": "Bearer secret"}
    cases = [
        ({"prompt": "x"}, None, None, 401),
        ({"prompt": "x"}, {"Authorization": "Bearer wrong"}, None, 401),
        (None, ok, b"{oops", 400),
        ({"prompt": "x", "model": "other"}, ok, None, 404),
        ({"prompt": "x", "max_tokens": 0}, ok, None, 400),
        ({"prompt": "x" * 1000, "max_tokens": 100}, ok, None, 400),
    ]
    for body, headers, raw, status in cases:
        r = run(_post(app, "/v1/completions", body, headers, raw))
        assert r.status_code == status, (body, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}

    async def get(path, headers=None):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.get(path, headers=headers)

    assert run(get("/health")).status_code == 200  # never behind the key
    assert run(get("/metrics")).status_code == 401 and run(get("/v1/models")).status_code == 401
    assert run(get("/v1/models", ok)).status_code == 200
    nf = run(get("/v1/nothing", ok))
    assert nf.status_code == 404 and "error" in nf.json()
    assert run(get("/v1/completions", ok)).status_code == 405


def test_app_worker_failure():
    app, _ = make_app(FakeOrchestrator(PRESETS["tiny"], fail_at=2))
    r = run(_post(app, "/v1/completions", {"prompt": "ab", "max_tokens": 5}))
    assert (
        r.status_code == 500 and r.json()["error"]["type"] == "server_error" and "died" in r.json()["error"]["message"]
    )
    r = run(_post(app, "/v1/completions", {"prompt": "ab", "max_tokens": 5, "stream": True}))
    payloads = sse_payloads(r.text)
    assert [p["choices"][0]["text"] for p in payloads[:2]] == ["a", "b"] and "died" in payloads[2]["error"]["message"]


def test_app_queue_full_429_and_bad_input_leave_the_inflight_request_alone():
    app, orch = make_app(FakeOrchestrator(PRESETS["tiny"], delay_s=0.02), max_queue=1)

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            first = asyncio.create_task(c.post("/v1/completions", json={"prompt": "ab", "max_tokens": 10}))
            await async_wait_until(lambda: orch.active, 5, "the first request running")
            full = await c.post("/v1/completions", json={"prompt": "ab", "max_tokens": 10})
            bad = await c.post("/v1/completions", content=b"not json")
            return await first, full, bad

    first, full, bad = run(scenario())
    assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full" and "retry-after" in full.headers
    assert bad.status_code == 400
    assert first.status_code == 200 and first.json()["choices"][0]["text"] == "ababababab"
    assert app.state.pd.inflight == 0


def test_app_metrics():
    app, _ = make_app()
    run(_post(app, "/v1/completions", {"prompt": "ab", "max_tokens": 4}))
    run(_post(app, "/v1/completions", {"prompt": "ab", "max_tokens": 0}))

    async def get():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.get("/metrics")

    text = run(get()).text
    for name, labels, want in [
        ("pdserve_requests_total", {"status": "ok"}, 1.0),
        ("pdserve_requests_total", {"status": "rejected"}, 1.0),
        ("pdserve_generation_tokens_total", {}, 4.0),
        ("pdserve_prompt_tokens_total", {}, 2.0),
        ("pdserve_time_to_first_token_seconds_count", {}, 1.0),
        ("pdserve_inter_token_latency_seconds_count", {}, 3.0),
        ("pdserve_time_per_output_token_seconds_count", {}, 1.0),
        ("pdserve_e2e_request_latency_seconds_count", {}, 1.0),
        ("pdserve_kv_transfer_bytes_total", {}, 4096.0),
        ("pdserve_router_queue_depth", {}, 0.0),
        ("pdserve_kv_blocks_free", {"role": "decode", "worker": "fake-decode-0"}, 64.0),
        ("pdserve_kv_blocks_used", {"role": "prefill", "worker": "fake-prefill-0"}, 0.0),
        ("pdserve_queue_depth", {"role": "decode", "worker": "fake-decode-0"}, 0.0),
    ]:
        assert value(text, name, **labels) == want, (name, labels)


# ------------------------------------------------------------------------------ disconnects (real uvicorn)
class _Uvicorn:
    def __init__(self, app):
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        wait_until(lambda: self.server.started, 10, "uvicorn to start", interval=0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)


def test_client_disconnect_mid_stream_aborts():
    app, orch = make_app(FakeOrchestrator(PRESETS["tiny"], delay_s=0.05))
    with _Uvicorn(app) as url:
        with httpx.stream(
            "POST", url + "/v1/completions", json={"prompt": "ab", "max_tokens": 500, "stream": True}, timeout=10
        ) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(3)]
            assert got[0].startswith("data: ")
            rid = json.loads(got[0][6:])["id"]
        wait_until(lambda: orch.aborted == [rid] and app.state.pd.inflight == 0, 5, "the abort", interval=0.01)
        wait_until(lambda: not orch.active, 5, "the orchestrator's stream closed as well", interval=0.01)
        assert value(httpx.get(url + "/metrics").text, "pdserve_requests_total", status="aborted") == 1.0


def test_client_disconnect_while_waiting_non_streaming_aborts():
    app, orch = make_app(FakeOrchestrator(PRESETS["tiny"], delay_s=0.05))
    with _Uvicorn(app) as url:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json={"prompt": "ab", "max_tokens": 500}, timeout=0.3)
        wait_until(
            lambda: len(orch.aborted) == 1 and app.state.pd.inflight == 0 and not orch.active,
            5,
            "the abort, and the orchestrator's stream closed",
            interval=0.01,
        )
