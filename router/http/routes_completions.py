"""POST /v1/completions: OpenAI's text completions (a prompt in, text out; SSE with stream=true)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from router.http.errors_auth import PROTECTED
from router.http.generation import generate

router = APIRouter(dependencies=PROTECTED)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await generate(request, "completion")
