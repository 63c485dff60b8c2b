"""`pdserve serve`: start the pools and the OpenAI-compatible router, and run until Ctrl-C.

The settings flags are generated from ServeConfig's fields (router/config_flags.py); this module
adds the flags that are not settings (--config, logging), turns the parsed flags into a
ServeConfig and prints the banner. Serving itself is router/http_server.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from dataclasses import fields

from cli import CliError
from router.config import ConfigError, ServeConfig
from router.config_flags import add_flags, is_json
from router.http_server import bind_socket, serve
from router.observe.logs import LOG_FORMATS, JsonFormatter
from router.observe.logs import setup as setup_logging

# Where tests and benchmarks have always found the in-process server.
from router.server_thread import ServerThread, start_server_in_thread

__all__ = ["ServerThread", "add_arguments", "config_from_args", "main", "ready_message", "start_server_in_thread"]

log = logging.getLogger("pdserve.serve")


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
    add_flags(p, ServeConfig)
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


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    flags = {f.name: getattr(args, f.name, None) for f in fields(ServeConfig)}
    for f in fields(ServeConfig):
        value = flags[f.name]
        if value is not None and is_json(ServeConfig, f):
            try:
                flags[f.name] = json.loads(value)
            except ValueError as e:
                raise CliError(f"--{f.name.replace('_', '-')} {value!r}: not valid JSON ({e})") from None
    try:
        return ServeConfig.build(flags, args.config)
    except ConfigError as e:
        raise CliError(str(e)) from None


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
