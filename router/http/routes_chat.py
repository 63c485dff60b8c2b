"""POST /v1/chat/completions: OpenAI's chat completions (messages rendered through the model's
chat template; SSE with stream=true)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from router.http.errors_auth import PROTECTED
from router.http.generation import generate

router = APIRouter(dependencies=PROTECTED)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await generate(request, "chat")
