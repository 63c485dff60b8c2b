"""Fakes for tests about a caller's own logic. The project's single home for fakes.

FakeCompletionsServer: a minimal OpenAI-compatible completions server (FastAPI + uvicorn on
127.0.0.1, a free port) that streams a scripted answer with known delays. It exists to test the
benchmark client's timing and parsing, not serving; serving is tested against the real router.
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


@dataclass
class FakeScript:
    """What the fake streams: max_tokens tokens named t0, t1, ..., `tokens_per_chunk` per chunk."""

    first_token_delay_s: float = 0.05
    itl_s: float = 0.02                    # delay before every chunk after the first
    tokens_per_chunk: int = 1
    report_usage: bool = True
    fail_prompts: tuple[str, ...] = ()     # prompts answered with HTTP 500
    model: str = "fake-model"
    received: list[dict[str, Any]] = field(default_factory=list)  # request bodies, in order


def _chunk(rid: str, model: str, text: str, finish: str | None) -> str:
    body = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}
    return f"data: {json.dumps(body)}\n\n"


def build_app(script: FakeScript) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": script.model, "object": "model", "created": 0,
                                            "owned_by": "fake"}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await request.json()
        script.received.append(body)
        prompt = body["prompt"]
        if prompt in script.fail_prompts:
            return JSONResponse({"error": {"message": "scripted failure", "type": "server_error"}}, 500)
        n = int(body.get("max_tokens") or 16)
        rid = f"cmpl-{len(script.received)}"
        usage = bool((body.get("stream_options") or {}).get("include_usage")) and script.report_usage

        async def events() -> AsyncIterator[str]:
            await asyncio.sleep(script.first_token_delay_s)
            for start in range(0, n, script.tokens_per_chunk):
                if start:
                    await asyncio.sleep(script.itl_s)
                text = "".join(f"t{i} " for i in range(start, min(n, start + script.tokens_per_chunk)))
                yield _chunk(rid, script.model, text, None)
            yield _chunk(rid, script.model, "", "length")
            if usage:
                n_in = len(prompt) if isinstance(prompt, (str, list)) else 0
                u = {"id": rid, "object": "text_completion", "created": int(time.time()),
                     "model": script.model, "choices": [],
                     "usage": {"prompt_tokens": n_in, "completion_tokens": n, "total_tokens": n_in + n}}
                yield f"data: {json.dumps(u)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


class FakeCompletionsServer:
    """`with FakeCompletionsServer(FakeScript()) as srv:` then point a client at srv.base_url."""

    def __init__(self, script: FakeScript | None = None) -> None:
        self.script = script or FakeScript()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        config = uvicorn.Config(build_app(self.script), log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> "FakeCompletionsServer":
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("fake completions server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()
