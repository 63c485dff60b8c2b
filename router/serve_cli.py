"""`pdserve serve`: start the pools and the OpenAI-compatible router, and run until Ctrl-C.

The socket is bound first (a busy port fails in a second, not after the pools have started),
then uvicorn starts; the pools are built inside uvicorn's event loop (the app's lifespan), so the
orchestrator's tasks live in the loop that serves requests. `start_server_in_thread` runs the
same thing on a free loopback port in a background thread, for tests and `pdserve bench compare`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

from cli import CliError
from engine.config import PRESETS, resolve_model_config
from engine.model_registry import MODELS, PullError
from engine.model_registry import resolve as registry_resolve
from engine.tokenizer import load_tokenizer
from router.config import MODES, POLICIES, TRANSPORTS, WEIGHT_DTYPES, ConfigError, ServeConfig
from router.logs import LOG_FORMATS, JsonFormatter
from router.logs import setup as setup_logging
from router.shutdown import GracefulShutdown

log = logging.getLogger("pdserve.serve")
D = ServeConfig()  # defaults shown in --help


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = (
        "examples:\n"
        "  pdserve serve --mode disagg --model tiny                      # 1 prefill + 1 decode worker\n"
        "  pdserve serve --mode colocated --chunk-size 128 --decode 2\n"
        "  pdserve serve --config serve.yaml --port 9000                # flags override the YAML\n"
        "  pdserve serve --ray-address 198.18.K.1:6379 --prefill-resources '{\"node1\": 1}' \\\n"
        "      --decode-resources '{\"node2\": 1}' --link-gbps 1         # on a cluster (docs/cluster.md)\n"
    )
    # Every default is None here: a flag that was not given must not override the YAML file.
    g = p.add_argument_group("pools")
    g.add_argument(
        "--mode",
        choices=MODES,
        default=None,
        help="disagg: separate prefill and decode pools; colocated: decode workers also prefill; auto: both "
        "pools, and per request the router prefills locally (chunked, on the decode worker) or remotely, "
        f"whichever the calibrated cost model predicts is cheaper under the SLO pair (default {D.mode})",
    )
    g.add_argument(
        "--model",
        default=None,
        help=f"a registry model ({', '.join(MODELS)}; pulled on first use), a preset "
        f"({', '.join(PRESETS)}; random weights), a Hugging Face Llama checkpoint directory or a "
        f".gguf file (default {D.model})",
    )
    g.add_argument("--dtype", choices=WEIGHT_DTYPES, default=None, help=f"weight dtype (default {D.dtype})")
    g.add_argument(
        "--kv-dtype", choices=["fp8", "bf16", "fp32"], default=None, help=f"KV cache dtype (default {D.kv_dtype})"
    )
    g.add_argument("--device", default=None, help=f"cpu, cuda or cuda:N (default {D.device})")
    g.add_argument(
        "--prefill", type=int, default=None, metavar="N", help=f"prefill workers, disagg mode (default {D.prefill})"
    )
    g.add_argument(
        "--decode",
        type=int,
        default=None,
        metavar="M",
        help=f"decode workers (colocated workers in colocated mode) (default {D.decode})",
    )
    g.add_argument(
        "--chunk-size",
        type=int,
        default=None,
        metavar="TOKENS",
        help="prefill in chunks of this many tokens mixed into decode steps (default: whole prompts)",
    )
    g.add_argument("--policy", choices=POLICIES, default=None, help=f"dispatch policy (default {D.policy})")
    g.add_argument(
        "--gpus-per-worker",
        type=float,
        default=None,
        help=f"GPUs per Ray actor; 0 on CPU, 0.5 shares a GPU between two (default {D.gpus_per_worker})",
    )
    g.add_argument("--num-blocks", type=int, default=None, help=f"KV blocks per worker (default {D.num_blocks})")
    g.add_argument("--block-size", type=int, default=None, help=f"tokens per KV block (default {D.block_size})")
    g.add_argument(
        "--no-prefix-cache",
        dest="prefix_cache",
        action="store_const",
        const=False,
        default=None,
        help="do not keep and reuse full KV blocks of equal prefixes (automatic prefix caching is on by default)",
    )
    g.add_argument(
        "--max-num-seqs", type=int, default=None, help=f"sequences per decode batch (default {D.max_num_seqs})"
    )
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        default=None,
        help="on CUDA, run decode steps eagerly instead of replaying captured CUDA graphs (default: graphs)",
    )
    g.add_argument(
        "--gemm-row-buckets",
        type=int,
        default=None,
        metavar="N",
        help="CPU: run each oneDNN GEMM at one of N row counts per power of two (tiles of 256 rows above), "
        "padding with zero rows; outputs are bit-identical and the per-shape kernel caches stay bounded "
        f"(~27 shapes per weight). 0 = any row count: RSS then grows with every new prompt length "
        f"(default {D.gemm_row_buckets})",
    )
    g.add_argument(
        "--rss-growth-warn-mb",
        type=float,
        default=None,
        metavar="MB",
        help="log a warning when a worker's resident memory grows this much past its level after warm-up "
        f"(and at each further multiple); 0 = off (default {D.rss_growth_warn_mb:g})",
    )
    g.add_argument(
        "--rss-warmup-steps",
        type=int,
        default=None,
        metavar="N",
        help=f"engine steps a worker runs before its RSS baseline is taken (default {D.rss_warmup_steps})",
    )
    g.add_argument(
        "--transport", choices=TRANSPORTS, default=None, help=f"KV transport between pools (default {D.transport})"
    )
    g.add_argument(
        "--lease-s",
        type=float,
        default=None,
        help=f"seconds prefill keeps KV that decode has not pulled (default {D.lease_s:g})",
    )
    g.add_argument(
        "--transfer-timeout-s",
        type=float,
        default=None,
        help=f"seconds one KV pull may take before the request fails (default {D.transfer_timeout_s:g})",
    )
    g.add_argument(
        "--prefill-resources",
        default=None,
        metavar="JSON",
        help="Ray custom resources of each prefill worker, e.g. '{\"node1\": 1}' (every worker) or "
        '\'[{"node1": 1}, {"node2": 1}]\' (one per worker); pins the pool to labelled nodes',
    )
    g.add_argument(
        "--decode-resources", default=None, metavar="JSON", help="the same for each decode (or colocated) worker"
    )
    g.add_argument(
        "--link-gbps",
        type=float,
        default=None,
        metavar="G",
        help="nominal rate of the link between the pools in Gbit/s; each request's timeline then "
        "shows the measured KV pull rate beside it (e.g. the rate of `pdserve cluster up`)",
    )
    g.add_argument(
        "--verify-kv",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="checksum every KV block on both sides of a pull; a mismatch fails that request with a clear "
        f"error instead of decoding corrupt KV (default {'on' if D.verify_kv else 'off'}: on CPU it costs about "
        "as much as the transfer itself)",
    )
    g.add_argument(
        "--ray-address",
        default=None,
        help="an existing Ray cluster (e.g. auto or ray://host:10001); default: start a local one; "
        "'none' runs the workers in this process without Ray",
    )
    g = p.add_argument_group("auto mode (per-request dispatch)")
    g.add_argument(
        "--slo-ttft-ms",
        type=float,
        default=None,
        help=f"time-to-first-token SLO auto decides under (default {D.slo_ttft_ms:g})",
    )
    g.add_argument(
        "--slo-itl-ms",
        type=float,
        default=None,
        help="inter-token SLO of the streams in flight; a local prefill may not stretch a step past it "
        f"(default {D.slo_itl_ms:g})",
    )
    g.add_argument(
        "--calibration",
        default=None,
        metavar="FILE",
        help="cost-model calibration with a step_fit (`pdserve bench chunks` writes one); default: "
        "benchmarks/results/chunks-<model>-<device>.calibration.json",
    )
    g = p.add_argument_group("router")
    g.add_argument("--host", default=None, help=f"address to listen on (default {D.host})")
    g.add_argument("--port", type=int, default=None, help=f"port, 0 = any free port (default {D.port})")
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every endpoint but /health")
    g.add_argument(
        "--max-queue",
        type=int,
        default=None,
        help=f"requests in flight before new ones get 429 (default {D.max_queue})",
    )
    g.add_argument(
        "--max-tokens-limit",
        type=int,
        default=None,
        help=f"largest max_tokens a request may ask for (default {D.max_tokens_limit})",
    )
    g.add_argument(
        "--shutdown-timeout-s",
        type=float,
        default=None,
        help="on SIGTERM or SIGINT: refuse new requests (503), give open ones this long to finish, end the rest "
        f"with an error event, stop the pools and exit 0 (default {D.shutdown_timeout_s:g})",
    )
    g.add_argument("--served-model-name", default=None, help="the model name clients send (default: the model's)")
    g = p.add_argument_group("observability")
    g.add_argument(
        "--otlp-endpoint",
        default=None,
        metavar="URL",
        help="export one OpenTelemetry trace per request over OTLP/HTTP to this collector, e.g. "
        "http://127.0.0.1:4318 (/v1/traces is added to a URL without a path); the standard "
        "OTEL_EXPORTER_OTLP_ENDPOINT / OTEL_EXPORTER_OTLP_TRACES_ENDPOINT variables do the same (default: off)",
    )
    p.add_argument(
        "--config",
        default=None,
        metavar="YAML",
        help="settings file; keys are the flag names (max_queue or max-queue); flags win",
    )
    p.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        default="info",
        help="server log level (default info)",
    )
    p.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="text",
        help="text, or json: one JSON object per line with the request id (and trace id with tracing on) "
        "(default text)",
    )


_NOT_SETTINGS = {"config", "log_level", "log_format", "command", "bench_command", "_main"}


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    flags = {k: v for k, v in vars(args).items() if k not in _NOT_SETTINGS}
    for key in ("prefill_resources", "decode_resources"):
        if flags.get(key) is not None:
            try:
                flags[key] = json.loads(flags[key])
            except ValueError as e:
                raise CliError(f"--{key.replace('_', '-')} {flags[key]!r}: not valid JSON ({e})") from None
    try:
        return ServeConfig.build(flags, args.config)
    except ConfigError as e:
        raise CliError(str(e)) from None


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
    from router.app import create_app  # noqa: PLC0415

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


def ready_message(cfg: ServeConfig, url: str) -> str:
    pools = (
        f"{cfg.prefill} prefill + {cfg.decode} decode"
        + (f", SLO TTFT {cfg.slo_ttft_ms:g} ms / ITL {cfg.slo_itl_ms:g} ms" if cfg.mode == "auto" else "")
        if cfg.mode != "colocated"
        else f"{cfg.decode} colocated, " + (f"chunks of {cfg.chunk_size}" if cfg.chunk_size else "whole prompts")
    )
    auth = " -H 'Authorization: Bearer <your key>'" if cfg.api_key else ""
    body = f'{{"model": "{cfg.model_name}", "prompt": "Hello", "max_tokens": 16, "stream": true}}'
    return (
        f"pdserve: serving {cfg.model_name} ({cfg.mode}: {pools}) at {url}/v1  (Ctrl-C to stop)\n"
        f"  curl -N {url}/v1/completions -H 'Content-Type: application/json'{auth} -d '{body}'"
    )


def _uvicorn_server(cfg: ServeConfig, app: Any, log_level: str, own_logging: bool = False) -> Any:
    import uvicorn  # noqa: PLC0415

    # access_log off: a benchmark would print a line per request; /metrics has the counts.
    # own_logging: the root logger is configured (router/logs.py) and uvicorn's loggers propagate to
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


def main(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    json_logs = getattr(args, "log_format", "text") == "json"
    setup_logging(args.log_level, "json" if json_logs else "text")

    def say(msg: str) -> None:  # the banner: on stdout whatever the level; with JSON logs, a JSON line too
        if json_logs:
            msg = JsonFormatter().format(log.makeRecord(log.name, logging.INFO, __file__, 0, msg, (), None))
        print(msg, flush=True)

    sock = bind_socket(cfg.host, cfg.port)
    say(f"pdserve: starting {cfg.mode} pools for {cfg.model_name} (this can take a minute)...")
    try:
        asyncio.run(serve(cfg, sock, args.log_level, lambda url: say(ready_message(cfg, url)), own_logging=json_logs))
    except KeyboardInterrupt:  # uvicorn re-raises SIGINT after its graceful shutdown
        pass
    except RuntimeError as e:
        raise CliError(str(e)) from None
    finally:
        sock.close()
    say("pdserve: stopped")
    return 0


# ------------------------------------------------------------------------------ in-process servers
class ServerThread:
    """A pdserve server on a free 127.0.0.1 port in a background thread.

    with ServerThread(cfg) as srv:      # blocks until the pools are up
        client = OpenAI(base_url=srv.base_url, api_key=cfg.api_key or "none")
    """

    def __init__(self, cfg: ServeConfig, startup_timeout_s: float = 300.0, log_level: str = "warning"):
        self.cfg = replace(cfg, host="127.0.0.1", port=0)
        self.timeout, self.log_level = startup_timeout_s, log_level
        self._sock = bind_socket("127.0.0.1", 0)
        self.url = base_url("127.0.0.1", self._sock)  # root; the OpenAI API is under /v1
        self._server: list = []
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="pdserve-server", daemon=True)

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def _run(self) -> None:
        try:
            asyncio.run(serve(self.cfg, self._sock, self.log_level, lambda _url: self._ready.set(), self._server))
        except BaseException as e:  # noqa: BLE001 - reported to the thread that waits in start()
            self._error = e
        finally:
            self._ready.set()

    def start(self) -> ServerThread:
        self._thread.start()
        if not self._ready.wait(self.timeout):
            self.stop()
            raise RuntimeError(f"pdserve server did not start within {self.timeout:g} s")
        if self._error is not None or not self._thread.is_alive():
            self._sock.close()
            raise RuntimeError(f"pdserve server failed to start: {self._error}") from self._error
        return self

    def stop(self, timeout_s: float = 60.0) -> None:
        """Graceful: in-flight requests get a few seconds, then the pools shut down."""
        deadline = time.monotonic() + 10
        while not self._server and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._server:
            self._server[0].should_exit = True
        self._thread.join(timeout_s)
        self._sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_server_in_thread(cfg: ServeConfig, startup_timeout_s: float = 300.0) -> tuple[str, Callable[[], None]]:
    """Start a server on a free loopback port; returns (root url, stop function)."""
    srv = ServerThread(cfg, startup_timeout_s).start()
    return srv.url, srv.stop
