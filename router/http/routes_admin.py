"""What operators and benchmarks read beside the OpenAI API: a request's timeline, the workers'
recent steps, Prometheus metrics (all behind the API key), and /health (never behind it: a load
balancer's probe carries no key)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from router.http.errors_auth import PROTECTED
from router.http.state import State
from router.openai import protocol as oa
from router.openai import responses as oar

router = APIRouter(dependencies=PROTECTED)
health_router = APIRouter()


@router.get("/v1/requests/{request_id}/timeline")
async def timeline(request_id: str, st: State) -> dict[str, Any]:
    tl = st.orch().timeline(request_id)
    if tl is None:
        raise oa.OpenAIError(
            404,
            f"No timeline for request '{request_id}' (unknown, or too old).",
            param="request_id",
            code="request_not_found",
        )
    return oar.json_safe(tl.to_dict())


@router.get("/v1/workers/steps")
async def worker_steps(st: State) -> dict[str, Any]:
    """Each worker's last steps (shape and seconds): what `bench compare` fits its step-cost
    model to, so a prediction is calibrated on the very server it predicts."""
    stats = await st.orch().stats()
    return {"object": "list", "data": [s.step_log() for s in stats]}


@router.get("/metrics")
async def metrics(st: State) -> Response:
    if st.orchestrator is not None:
        await st.metrics.refresh(st.orchestrator)
    data, ctype = st.metrics.render()
    return Response(data, media_type=ctype)


@health_router.get("/health")
async def health(st: State) -> JSONResponse:
    if st.orchestrator is None:
        return JSONResponse({"status": "starting"}, status_code=503)
    if st.draining:
        return JSONResponse({"status": "draining", "inflight": st.inflight}, status_code=503)
    pools = st.orchestrator.pool_status()
    degraded = any(p["live"] < p["configured"] for p in pools.values())
    return JSONResponse(
        {
            "status": "degraded" if degraded else "ok",
            "mode": st.orchestrator.mode,
            "model": st.cfg.model_name,
            "inflight": st.inflight,
            "pools": pools,
        },
        status_code=503 if degraded else 200,
    )
