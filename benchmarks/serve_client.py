"""Async OpenAI-API load generator: sends a workload, records what every stream did and when.

Talks `/v1/completions` with `stream=True` and `stream_options={"include_usage": True}` through
the official `openai` client, so it works against pdserve, vLLM, SGLang or any compatible
server. It only records events (send time, the arrival time of every chunk, usage, finish
reason, errors) into `RequestRecord`s; `serve_metrics` turns them into numbers.

Bounded: a run stops by itself after `duration_limit_s` (requests still open are cancelled and
recorded as failed, requests not yet sent as not sent), and each request has its own timeout.
The openai client's automatic retries are off: a retried request would report a fake latency.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import openai
from openai import AsyncOpenAI
from tqdm import tqdm

from costmodel.serve_metrics import RequestRecord
from costmodel.workloads import RequestSpec


class ClientError(Exception):
    """The server cannot be used (unreachable, no model): a user-facing, one-line message."""


@dataclass(frozen=True)
class ClientConfig:
    base_url: str = "http://127.0.0.1:8000/v1"
    api_key: str = "EMPTY"
    model: str | None = None  # None: the first model listed by /v1/models
    temperature: float = 0.0
    seed: int = 0  # request i is sent with seed + i
    max_concurrency: int | None = None  # None: no client-side limit
    duration_limit_s: float = 300.0
    request_timeout_s: float | None = None  # None: the duration limit
    ignore_eos: bool = True  # vLLM/SGLang/pdserve extension: keep output lengths exact
    show_progress: bool = True

    def validate(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("--max-concurrency must be >= 1")
        if self.duration_limit_s <= 0:
            raise ValueError("--duration-limit-s must be > 0")
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ValueError("--request-timeout-s must be > 0")
        if self.temperature < 0:
            raise ValueError("--temperature must be >= 0")


def normalize_base_url(url: str) -> str:
    """Accept http://host:port as well as http://host:port/v1 (what the openai client wants)."""
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--base-url must start with http:// or https://, got {url!r}")
    return url if url.endswith("/v1") else url + "/v1"


def make_client(cfg: ClientConfig) -> AsyncOpenAI:
    timeout = cfg.request_timeout_s or cfg.duration_limit_s
    return AsyncOpenAI(
        base_url=normalize_base_url(cfg.base_url),
        api_key=cfg.api_key,
        max_retries=0,
        timeout=httpx.Timeout(timeout, connect=min(10.0, timeout)),
    )


async def discover_model(client: AsyncOpenAI) -> str:
    """The first model the server lists at /v1/models."""
    try:
        page = await client.models.list()
    except openai.APIConnectionError as e:
        raise ClientError(f"cannot reach {client.base_url}: {e}") from None
    except openai.APIStatusError as e:
        raise ClientError(f"{client.base_url}models answered {e.status_code}: {e.message}") from None
    ids = [m.id for m in page.data]
    if not ids:
        raise ClientError(f"{client.base_url}models lists no model; pass --model")
    return ids[0]


def _prompt(spec: RequestSpec) -> str | list[int]:
    return list(spec.prompt) if isinstance(spec.prompt, tuple) else spec.prompt


async def send_one(
    client: AsyncOpenAI, model: str, spec: RequestSpec, index: int, cfg: ClientConfig, rec: RequestRecord, t0: float
) -> None:
    """Send `spec`, stream the answer, fill `rec` in place (errors go to rec.error, not raised)."""
    now = lambda: time.perf_counter() - t0  # noqa: E731
    extra: dict[str, Any] = {"ignore_eos": True} if cfg.ignore_eos else {}
    parts: list[str] = []
    rec.send_s = now()
    try:
        stream = await client.completions.create(
            model=model,
            prompt=_prompt(spec),
            max_tokens=spec.max_tokens,
            temperature=cfg.temperature,
            seed=cfg.seed + index,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra or None,
        )
        async for chunk in stream:
            t = now()
            if chunk.choices:
                choice = chunk.choices[0]
                # Every chunk that carries output is a token arrival. A token whose text is still
                # empty (a partial UTF-8 byte) counts too; a bare finish marker does not.
                if choice.text or choice.finish_reason is None:
                    rec.chunk_times_s.append(t)
                    parts.append(choice.text or "")
                if choice.finish_reason is not None:
                    rec.finish_reason = choice.finish_reason
            if chunk.usage is not None:
                tl = ((chunk.model_extra or {}).get("pdserve") or {}).get("timeline") or {}
                rec.dispatch = tl.get("dispatch")  # pdserve --mode auto only
                rec.worker_queue_ms, rec.worker_prefill_ms = tl.get("queue_ms"), tl.get("prefill_ms")
                rec.router_ttft_ms = tl.get("first_token_ms")
                rec.transfer = tl.get("transfer")  # pdserve disagg: the KV pull
                if tl.get("token_ms") and tl.get("arrival") is not None:  # step ends, on this clock
                    to_here = tl["arrival"] - (time.time() - now())  # the server's wall clock -> now()
                    rec.step_end_times_s = [to_here + ms / 1e3 for ms in tl["token_ms"]]
                rec.prompt_tokens = chunk.usage.prompt_tokens
                rec.completion_tokens = chunk.usage.completion_tokens
        rec.end_s = now()
        if not rec.chunk_times_s:
            rec.error = "stream ended without any output"
    except openai.APIStatusError as e:
        rec.error = f"HTTP {e.status_code}: {e.message}"
    except (openai.APIError, httpx.HTTPError, OSError, ValueError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    except asyncio.CancelledError:
        rec.error = f"cancelled at the duration limit ({cfg.duration_limit_s:g} s)"
        raise
    finally:
        rec.text = "".join(parts)
        if rec.end_s is None:
            rec.end_s = now()


async def run_requests(specs: Sequence[RequestSpec], cfg: ClientConfig) -> tuple[str, list[RequestRecord]]:
    """Send every spec at its arrival offset; return (model name, one record per spec, in order)."""
    cfg.validate()
    client = make_client(cfg)
    records = [RequestRecord(s.request_id, s.kind, s.prompt_len, s.max_tokens, s.arrival_s) for s in specs]
    bar = tqdm(
        total=len(specs),
        file=sys.stderr,
        disable=not cfg.show_progress,
        unit="req",
        desc="bench serve",
        dynamic_ncols=True,
    )
    try:
        model = cfg.model or await discover_model(client)
        sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        t0 = time.perf_counter()

        async def one(i: int) -> None:
            delay = specs[i].arrival_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is None:
                await send_one(client, model, specs[i], i, cfg, records[i], t0)
            else:
                async with sem:
                    await send_one(client, model, specs[i], i, cfg, records[i], t0)
            bar.update(1)

        tasks = [asyncio.create_task(one(i)) for i in range(len(specs))]
        _, pending = await asyncio.wait(tasks, timeout=cfg.duration_limit_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        return model, records
    finally:
        bar.close()
        await client.close()
