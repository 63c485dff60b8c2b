"""The app's surface, pinned: which routes exist (paths, methods, OpenAPI operation ids), which sit
behind the API key, and what a shutdown does to the requests still open. The routes live in one
module per endpoint group (router/routes_*.py); these tests hold the assembled app to the surface
it had as one module. Behaviour per endpoint is tested in tests/test_router_app.py."""

from __future__ import annotations

import asyncio
import json
import re

import httpx

from engine.checkpoint.tokenizer import ByteTokenizer
from engine.config import PRESETS
from router.config import ServeConfig
from router.http.app import create_app
from tests.fakes import FakeOrchestrator
from tests.helpers import async_wait_until

# path -> (method, endpoint name, behind the API key)
ROUTES = {
    "/v1/completions": ("POST", "completions", True),
    "/v1/chat/completions": ("POST", "chat_completions", True),
    "/v1/models": ("GET", "models", True),
    "/v1/requests/{request_id}/timeline": ("GET", "timeline", True),
    "/v1/workers/steps": ("GET", "worker_steps", True),
    "/metrics": ("GET", "metrics", True),
    "/health": ("GET", "health", False),
}


def make_app(orch=None, **cfg):
    cfg = ServeConfig(**{"model": "tiny", "num_blocks": 64, "block_size": 16, **cfg})
    orch = orch or FakeOrchestrator(PRESETS["tiny"])
    return create_app(orch, ByteTokenizer(), cfg), orch


async def _call(app, method, path, **kw):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        return await c.request(method, path, **kw)


def test_routes_keep_their_order_methods_and_operation_ids():
    app, _ = make_app()
    paths = app.openapi()["paths"]  # every route, in matching order (app.routes nests included routers)
    assert list(paths) == list(ROUTES)
    for path, (method, name, _) in ROUTES.items():
        assert list(paths[path]) == [method.lower()], path
        op = paths[path][method.lower()]
        assert op["operationId"] == re.sub(r"\W", "_", name + path) + "_" + method.lower()  # FastAPI's default
    assert [p["name"] for p in paths["/v1/requests/{request_id}/timeline"]["get"]["parameters"]] == ["request_id"]
    for path in ("/v1/completions", "/v1/models", "/health"):  # the state reaches a route unseen by clients
        assert "parameters" not in paths[path][ROUTES[path][0].lower()]


def test_every_route_but_health_needs_the_key():
    app, _ = make_app(api_key="secret")
    for path, (method, _, protected) in ROUTES.items():
        path = path.replace("{request_id}", "cmpl-x")
        body = {"json": {"prompt": "x"}} if method == "POST" else {}
        r = asyncio.run(_call(app, method, path, **body))
        if protected:
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
        else:
            assert r.status_code == 200, path
    ok = asyncio.run(_call(app, "GET", "/v1/models", headers={"Authorization": "Bearer secret"}))
    assert ok.status_code == 200


def test_shutdown_ends_open_streams_with_an_error_event():
    app, orch = make_app(FakeOrchestrator(PRESETS["tiny"], delay_s=0.05))
    st = app.state.pd

    async def scenario():
        body = {"prompt": "ab", "max_tokens": 500, "stream": True}
        stream = asyncio.create_task(_call(app, "POST", "/v1/completions", json=body))
        await async_wait_until(lambda: orch.active, 5, "the stream running")
        ended = st.end_open_runs("the server is shutting down (test)")
        return ended, await stream

    ended, r = asyncio.run(scenario())
    events = [e[len("data: ") :] for e in r.text.split("\n\n") if e]
    assert ended == 1 and events[-1] == "[DONE]"
    assert "shutting down (test)" in json.loads(events[-2])["error"]["message"]
    assert orch.aborted == [orch.requests[0].request_id] and st.inflight == 0 and not st.runs
