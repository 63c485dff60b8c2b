"""The router process: the OpenAI-compatible API and each request's life between the pools.

Packages: `http/` (the app and its routes), `openai/` (the wire format), `lifecycle/`
(orchestrator, placement, pools), `dispatch/` (`--mode auto`, `--kv-transfer`), `workers/`
(handles, health, the Ray actor host), `observe/` (timeline, metrics, traces, logs). Beside them:
`config.py`, `config_fields.py`, `config_checks.py` and `config_flags.py` (`ServeConfig`),
`launch.py`, `http_server.py`, `serve_cli.py`, `server_thread.py`, `shutdown.py`.

May import: `contracts`, `costmodel`, `transport` (its wire types), `engine` (no torch: never the
model, the runner, the core or the KV cache; pyproject.toml's import contracts check it).
"""
