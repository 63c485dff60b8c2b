"""GET /v1/models: the one model this server serves, under the name clients send."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from router.http.errors_auth import PROTECTED
from router.http.state import State

router = APIRouter(dependencies=PROTECTED)


@router.get("/v1/models")
async def models(st: State) -> dict[str, Any]:
    lim = st.limits()
    return {
        "object": "list",
        "data": [
            {
                "id": st.cfg.model_name,
                "object": "model",
                "created": st.started,
                "owned_by": "pdserve",
                "max_model_len": lim.context_len,
            }
        ],
    }
