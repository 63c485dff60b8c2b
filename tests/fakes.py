"""Fakes for tests about a caller's own logic. The project's single home for fakes.

FakeCompletionsServer: a minimal OpenAI-compatible completions server (FastAPI + uvicorn on
127.0.0.1, a free port) that streams a scripted answer with known delays, shaped as pdserve's
streams or as other servers shape theirs (FakeScript's stream-shape fields). It exists to test the
benchmark client's timing and parsing, not serving; serving is tested against the real router.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tests.helpers import wait_until


@dataclass
class FakeScript:
    """What the fake streams: max_tokens tokens named t0, t1, ..., `tokens_per_chunk` per chunk."""

    first_token_delay_s: float = 0.05
    itl_s: float = 0.02  # delay before every chunk after the first
    tokens_per_chunk: int = 1
    report_usage: bool = True
    fail_prompts: tuple[str, ...] = ()  # prompts answered with HTTP 500
    refuse_token_ids: bool = False  # answer prompts given as token-id lists with HTTP 400 (text only)
    # stream shapes of other servers (benchmarks/client/serve_client.py, "stream shapes"):
    finish_in_last_token: bool = False  # vLLM: finish_reason in the last token's chunk, no bare marker
    empty_text_tokens: tuple[int, ...] = ()  # tokens streamed with empty text (a partial UTF-8 character)
    first_chunk: str | None = None  # before the first token: "role" (a chat role-only delta) or "empty" text
    cached_tokens: int | None = None  # reported as usage.prompt_tokens_details.cached_tokens
    model: str = "fake-model"
    received: list[dict[str, Any]] = field(default_factory=list)  # request bodies, in order


def _chunk(rid: str, model: str, text: str, finish: str | None, choice: dict[str, Any] | None = None) -> str:
    body = {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice or {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
    }
    return f"data: {json.dumps(body)}\n\n"


def build_app(script: FakeScript) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": script.model, "object": "model", "created": 0, "owned_by": "fake"}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await request.json()
        script.received.append(body)
        prompt = body["prompt"]
        if prompt in script.fail_prompts:
            return JSONResponse({"error": {"message": "scripted failure", "type": "server_error"}}, 500)
        if script.refuse_token_ids and isinstance(prompt, list):
            return JSONResponse({"error": {"message": "prompt must be a string", "type": "invalid_request_error"}}, 400)
        n = int(body.get("max_tokens") or 16)
        rid = f"cmpl-{len(script.received)}"
        usage = bool((body.get("stream_options") or {}).get("include_usage")) and script.report_usage

        async def events() -> AsyncIterator[str]:
            if script.first_chunk == "role":  # at once: the first token comes first_token_delay_s later
                yield _chunk(rid, script.model, "", None, {"index": 0, "delta": {"role": "assistant"}})
            elif script.first_chunk == "empty":
                yield _chunk(rid, script.model, "", None)
            await asyncio.sleep(script.first_token_delay_s)
            for start in range(0, n, script.tokens_per_chunk):
                if start:
                    await asyncio.sleep(script.itl_s)
                ids = range(start, min(n, start + script.tokens_per_chunk))
                text = "".join("" if i in script.empty_text_tokens else f"t{i} " for i in ids)
                last = script.finish_in_last_token and ids[-1] == n - 1
                yield _chunk(rid, script.model, text, "length" if last else None)
            if not script.finish_in_last_token:
                yield _chunk(rid, script.model, "", "length")
            if usage:
                n_in = len(prompt) if isinstance(prompt, (str, list)) else 0
                use: dict[str, Any] = {"prompt_tokens": n_in, "completion_tokens": n, "total_tokens": n_in + n}
                if script.cached_tokens is not None:
                    use["prompt_tokens_details"] = {"cached_tokens": script.cached_tokens}
                u = {
                    "id": rid,
                    "object": "text_completion",
                    "created": int(time.time()),
                    "model": script.model,
                    "choices": [],
                    "usage": use,
                }
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

    def reset(self, **fields: object) -> FakeScript:
        """Put a fresh script (with `fields` set) in place of the running server's, in place: a
        module-scoped server serves each test as if new."""
        fresh = FakeScript(**fields)  # type: ignore[arg-type]
        for name in fresh.__dataclass_fields__:
            setattr(self.script, name, getattr(fresh, name))
        return self.script

    def __enter__(self) -> FakeCompletionsServer:
        self._thread.start()

        def started() -> bool:
            if not self._thread.is_alive():
                raise RuntimeError("fake completions server did not start: its thread ended")
            return self._server.started

        wait_until(started, 10, "the fake completions server to start", interval=0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()


def completions_server_fixtures(**script_fields: object) -> tuple[Any, Any]:
    """The two fixtures of a module that tests a client against the fake, declared as
    `server, script = completions_server_fixtures(...)`: `server`, one FakeCompletionsServer for the
    whole module (it starts once), and `script`, its script reset to `FakeScript(**script_fields)`
    before each test that asks for it (so no test sees what an earlier one set)."""

    @pytest.fixture(scope="module")
    def server() -> Iterator[FakeCompletionsServer]:
        with FakeCompletionsServer(FakeScript()) as srv:
            yield srv

    @pytest.fixture
    def script(server: FakeCompletionsServer) -> FakeScript:
        return server.reset(**script_fields)

    return server, script


# ----------------------------------------------------------------------------- FakeOrchestrator
# A scripted stand-in for router.lifecycle.orchestrator.Orchestrator, for tests of the HTTP layer's own
# logic (validation, SSE shaping, stop strings, aborts, 429, metrics). Serving itself is tested
# against the real orchestrator and workers.

from contracts.worker import GenerateRequest, StreamEvent, WorkerError, WorkerStats  # noqa: E402
from engine.config import PRESETS, ModelConfig  # noqa: E402
from router.observe.timeline import Timeline  # noqa: E402


def echo_script(prompt_ids: list[int], max_tokens: int) -> list[int]:
    """The prompt repeated: a byte prompt "ab" yields the text "ababab..." (easy to predict)."""
    return [prompt_ids[i % len(prompt_ids)] for i in range(max_tokens)]


class FakeOrchestrator:
    """Yields `script(prompt_ids, max_tokens)` as token events, `delay_s` apart; a token equal to
    `eos_id` ends the stream with "stop". Records aborts; `fail_at` raises WorkerError there."""

    def __init__(
        self,
        model_config: ModelConfig | None = None,
        delay_s: float = 0.0,
        script: Any = echo_script,
        eos_id: int | None = None,
        fail_at: int | None = None,
        mode: str = "disagg",
    ):
        self.model_config = model_config or PRESETS["tiny"]
        self.mode, self.delay_s, self.script, self.eos_id, self.fail_at = mode, delay_s, script, eos_id, fail_at
        self.active: set[str] = set()
        self.aborted: list[str] = []
        self.requests: list[GenerateRequest] = []
        self.timelines: dict[str, dict] = {}
        self.shut_down = False
        self.pools = {"prefill": {"configured": 1, "live": 1}, "decode": {"configured": 1, "live": 1}}

    def pool_status(self) -> dict[str, dict[str, int]]:
        return self.pools

    async def generate(self, req: GenerateRequest) -> AsyncIterator[StreamEvent]:
        self.requests.append(req)
        self.active.add(req.request_id)
        tl = self.timelines[req.request_id] = {
            "request_id": req.request_id,
            "mode": self.mode,
            "prompt_tokens": len(req.prompt_ids),
            "output_tokens": 0,
            "transfer": {"bytes": 4096, "gbytes_per_s": float("inf")},
        }
        tokens = self.script(req.prompt_ids, req.params.max_tokens)[: req.params.max_tokens]
        try:
            for i, tok in enumerate(tokens):
                await asyncio.sleep(self.delay_s)
                if i == self.fail_at:
                    raise WorkerError("decode worker fake-decode-0 died")
                stop = tok == self.eos_id and not req.params.ignore_eos
                last = stop or i == len(tokens) - 1
                tl["output_tokens"] = i + 1
                yield StreamEvent(
                    req.request_id,
                    "token",
                    tok,
                    i,
                    finished=last,
                    finish_reason=("stop" if stop else "length") if last else None,
                )
                if last:
                    return
        finally:
            self.active.discard(req.request_id)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def timeline(self, request_id: str) -> Timeline | None:
        d = self.timelines.get(request_id)
        return Timeline.from_dict({"arrival": 0.0, **d}) if d is not None else None  # its arrival: unstamped

    async def stats(self) -> list[WorkerStats]:
        n = len(self.active)
        return [
            WorkerStats(
                "fake-prefill-0", "prefill", queue_depth=0, running=0, parked=0, blocks_total=64, blocks_free=64
            ),
            WorkerStats(
                "fake-decode-0", "decode", queue_depth=0, running=n, parked=0, blocks_total=64, blocks_free=64 - n
            ),
        ]

    def transfer_totals(self) -> tuple[int, float]:
        return 4096 * len(self.timelines), 0.001 * len(self.timelines)

    def queue_depth(self) -> int:
        return len(self.active)

    async def shutdown(self) -> None:
        self.shut_down = True


class FakeActorTarget:
    """Stands in for a Ray actor handle where a test replaces the call transport itself (only the
    methods' names matter): tests/test_worker_handle_retry.py."""

    def ping(self) -> str: ...

    def submit_prompt(self, req: Any) -> None: ...
