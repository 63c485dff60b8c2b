"""What every endpoint shares at the door: the API-key check, and errors answered as OpenAI error
bodies (`{"error": {"message", "type", "param", "code"}}`) whatever raised them."""

from __future__ import annotations

import hmac
import logging

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from router.http.state import server_state
from router.openai import protocol as oa

log = logging.getLogger("pdserve.app")


async def require_api_key(request: Request) -> None:
    """With --api-key: 401 unless the request sends 'Authorization: Bearer <key>'."""
    api_key = server_state(request).cfg.api_key
    if api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    # compare_digest: the time taken must not tell how much of a guessed key was right.
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise oa.OpenAIError(
            401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.", code="invalid_api_key"
        )


# Every router but the one of /health (a load balancer's probe carries no key).
PROTECTED = [Depends(require_api_key)]


async def _openai_error(request: Request, e: oa.OpenAIError) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.status == 429 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


async def _validation(request: Request, e: RequestValidationError) -> JSONResponse:
    err = (e.errors() or [{}])[0]
    param = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or None
    return JSONResponse(oa.error_body(f"Invalid request: {err.get('msg', e)}", param=param), status_code=400)


async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    return JSONResponse(oa.error_body(str(e.detail), kind), status_code=e.status_code, headers=e.headers)


async def _unexpected(request: Request, e: Exception) -> JSONResponse:
    log.exception("unexpected error on %s %s", request.method, request.url.path)
    return JSONResponse(oa.error_body(f"Internal server error: {type(e).__name__}", "server_error"), status_code=500)


def install_error_handlers(app: FastAPI) -> None:
    """Our errors (OpenAIError), a body FastAPI could not validate (400), Starlette's own HTTP
    errors (404 for an unknown path, 405) and anything unexpected (500, logged with its traceback)."""
    app.exception_handler(oa.OpenAIError)(_openai_error)
    app.exception_handler(RequestValidationError)(_validation)
    app.exception_handler(StarletteHTTPException)(_http)
    app.exception_handler(Exception)(_unexpected)
