"""The HTTP face of pdserve: an OpenAI-compatible FastAPI app over an Orchestrator.

Endpoints, one module per group:
  POST /v1/completions                     router/http/routes_completions.py
  POST /v1/chat/completions (SSE or JSON)  router/http/routes_chat.py
  GET  /v1/models                          router/http/routes_models.py
  GET  /v1/requests/{id}/timeline, /v1/workers/steps, /metrics (Prometheus),
       /health (never behind the API key)  router/http/routes_admin.py

Shared by all of them: the state (router/http/state.py), the API-key check and the OpenAI error
bodies (router/http/errors_auth.py). A generation request is admitted and answered in
router/http/generation.py and lives as an AdmittedRequest (router/http/admitted_request.py) until it closes.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from engine.checkpoint.tokenizer import Tokenizer
from router.config import ServeConfig
from router.http import routes_admin, routes_chat, routes_completions, routes_models
from router.http.errors_auth import install_error_handlers
from router.http.state import ServerState


def create_app(orchestrator: Any, tokenizer: Tokenizer, cfg: ServeConfig, *, lifespan: Any = None) -> FastAPI:
    """The app over a ready `orchestrator`, or over None with a `lifespan` that sets
    `app.state.pd.orchestrator` once the pools are up (what `pdserve serve` does)."""
    app = FastAPI(title="pdserve", version="0.1.0", lifespan=lifespan)
    app.state.pd = ServerState(orchestrator, tokenizer, cfg)
    install_error_handlers(app)
    for router in (
        routes_completions.router,
        routes_chat.router,
        routes_models.router,
        routes_admin.router,
        routes_admin.health_router,
    ):
        app.include_router(router)
    return app
