"""The app under uvicorn: bind the socket, build the pools inside the serving loop, report ready.

The socket is bound first (a busy port fails in a second, not after the pools have started),
then uvicorn starts; the pools are built inside uvicorn's event loop (the app's lifespan), so the
orchestrator's tasks live in the loop that serves requests. `pdserve serve` (router/serve_cli.py)
runs `serve` in the main thread; router/server_thread.py runs it in a background thread.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

from cli import CliError
from engine.checkpoint.registry import MODELS, PullError
from engine.checkpoint.registry import resolve as registry_resolve
from engine.checkpoint.tokenizer import load_tokenizer
from engine.config import resolve_model_config
from router.config import ServeConfig
from router.shutdown import GracefulShutdown


def resolve_model(cfg: ServeConfig) -> ServeConfig:
    """A registry model name becomes its cache directory (pulled on first use, with progress on
    stderr); clients keep sending the registry name."""
    if cfg.model not in MODELS:
        return cfg
    try:
        path = registry_resolve(cfg.model)
    except PullError as e:
        raise CliError(str(e)) from None
    return replace(cfg, model=path, served_model_name=cfg.served_model_name or cfg.model)


def make_app(
    cfg: ServeConfig,
    startup_error: list[BaseException] | None = None,
    on_started: Callable[[Any], None] | None = None,
) -> Any:
    """The app whose lifespan builds the orchestrator (and shuts it down on exit). `on_started`
    gets the app's ServerState once the pools are up."""
    from router.http.app import create_app  # noqa: PLC0415 - FastAPI loads when serving, not for --help

    mc = resolve_model_config(cfg.model)
    tokenizer = load_tokenizer(cfg.model, mc.bos_token_id, mc.eos_token_id)

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        from router.launch import build_orchestrator  # noqa: PLC0415 - imports Ray

        st = app.state.pd
        try:
            st.orchestrator = await build_orchestrator(cfg)
        except BaseException as e:
            if startup_error is not None:
                startup_error.append(e)
            raise
        if on_started is not None:
            on_started(st)
        try:
            yield
        finally:
            orch, st.orchestrator = st.orchestrator, None
            await orch.shutdown()
            if st.tracing is not None:  # the last requests' spans, within the exporter's timeout
                await asyncio.to_thread(st.tracing.shutdown)

    return create_app(None, tokenizer, cfg, lifespan=lifespan)


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise CliError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from None
    return sock


def base_url(host: str, sock: socket.socket) -> str:
    port = sock.getsockname()[1]
    shown = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"http://[{shown}]:{port}" if ":" in shown else f"http://{shown}:{port}"


def _uvicorn_server(cfg: ServeConfig, app: Any, log_level: str, own_logging: bool = False) -> Any:
    import uvicorn  # noqa: PLC0415

    # access_log off: a benchmark would print a line per request; /metrics has the counts.
    # own_logging: the root logger is configured (router/observe/logs.py) and uvicorn's loggers propagate to
    # it, instead of uvicorn installing its own text handlers.
    extra: dict[str, Any] = {"log_config": None} if own_logging else {}
    return uvicorn.Server(
        uvicorn.Config(app, lifespan="on", log_level=log_level, access_log=False, timeout_graceful_shutdown=5, **extra)
    )


async def serve(
    cfg: ServeConfig,
    sock: socket.socket,
    log_level: str = "info",
    on_ready: Callable[[str], None] | None = None,
    server_box: list | None = None,
    own_logging: bool = False,
) -> None:
    """Run until the server is told to exit; `on_ready(url)` once it accepts requests."""
    cfg = resolve_model(cfg)
    errors: list[BaseException] = []
    box: list[Any] = []

    def take_signals(state: Any) -> None:  # after ray.init() has installed its own (router/shutdown.py)
        GracefulShutdown(state, box[0], cfg.shutdown_timeout_s).install()

    server = _uvicorn_server(cfg, make_app(cfg, errors, take_signals), log_level, own_logging)
    box.append(server)
    if server_box is not None:
        server_box.append(server)

    async def announce() -> None:
        while not server.started:
            await asyncio.sleep(0.05)
        if on_ready is not None:
            on_ready(base_url(cfg.host, sock))

    # serve() is awaited here, not in a task: uvicorn reports a failed startup with SystemExit,
    # which a task would re-raise straight out of the event loop.
    watcher = asyncio.ensure_future(announce())
    try:
        await server.serve(sockets=[sock])
    except SystemExit:
        if errors:
            raise RuntimeError(f"the pools failed to start: {type(errors[0]).__name__}: {errors[0]}") from errors[0]
        raise RuntimeError("the server failed to start") from None
    finally:
        watcher.cancel()
