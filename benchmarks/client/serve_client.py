"""Async OpenAI-API load generator: sends a workload, records what every stream did and when.

Talks `/v1/completions` with `stream=True` and `stream_options={"include_usage": True}` through
the official `openai` client, so it works against pdserve, vLLM, SGLang or any compatible
server. It only records events (send time, the arrival time of every chunk, usage, finish
reason, errors) into `RequestRecord`s; `serve_metrics` turns them into numbers.

Bounded: a run stops by itself after `duration_limit_s` (requests still open are cancelled and
recorded as failed, requests not yet sent as not sent), and each request has its own timeout.
The openai client's automatic retries are off: a retried request would report a fake latency.

Servers shape their streams differently (see "stream shapes" below); each record says how its
stream was shaped (`StreamRecord.stream_shape`) and `shape_warning` names the odd shapes of a run
in one line.
"""

from __future__ import annotations

import asyncio
import bisect
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
import openai
from openai import AsyncOpenAI, Timeout
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
        timeout=Timeout(timeout, connect=min(10.0, timeout)),  # openai's own Timeout class (its HTTP client's)
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


# ----------------------------------------------------------------------------- stream shapes
# pdserve sends one token per chunk, then a bare finish marker (empty text and finish_reason), then
# the usage chunk. vLLM puts finish_reason in the last token's own chunk, and a token that ends
# inside a UTF-8 character streams as empty text: its answer to max_tokens=1 is one chunk with
# empty text and finish_reason. Chat servers open with a role-only delta; some servers pack
# several tokens into a chunk or send no usage chunk. So a chunk's empty text does not say whether
# it carried a token: the client decides live (the probe reads chunk_times_s while streams run),
# then settles those chunks against usage.completion_tokens when the stream ends.

# Codes in StreamRecord.stream_shape, and what each means, in the words of the run's warning.
SHAPE_NOTES: dict[str, str] = {
    "several-tokens-per-chunk": "several tokens per chunk (ITL and stall are per chunk, not per token)",
    "more-chunks-than-tokens": "more chunks than tokens (some chunks carried no token)",
    "role-only-first-chunk": "a role-only first chunk (not a token: TTFT is taken at the first token)",
    "empty-chunks": "empty chunks that usage says carried no token (left out of TTFT and ITL)",
    "no-usage": "no usage chunk (token counts are chunk counts, prompt lengths the workload's)",
    "token-with-finish": "the last token in the chunk that carries finish_reason",
}
# token-with-finish is how vLLM ends every stream: recorded, never warned about
_INFO_ONLY = {"token-with-finish"}
# shapes that leave no per-token arrival times (the probe cannot work from them)
NOT_PER_TOKEN = ("several-tokens-per-chunk", "more-chunks-than-tokens")

# What one chunk's first choice carries:
# token / last-token: text (or token ids or logprobs), without / with finish_reason;
# empty: an empty text field: a token whose text is a partial UTF-8 character, or nothing;
# last-empty: finish_reason with no text: a bare finish marker, or vLLM's last token;
# role: a chat delta with a role and no content; none: nothing (a keep-alive).
ChunkKind = Literal["token", "last-token", "empty", "last-empty", "role", "none"]


def _names_tokens(choice: dict[str, Any]) -> bool:
    """The choice lists the tokens it carries (logprobs, or vLLM's token_ids) and there is one."""
    lp = choice.get("logprobs")
    listed = [choice.get("token_ids"), *((lp.get("tokens"), lp.get("content")) if isinstance(lp, dict) else ())]
    return any(isinstance(x, list) and len(x) > 0 for x in listed)


def classify_chunk(choice: dict[str, Any]) -> tuple[ChunkKind, str]:
    """(what a chunk's first choice carries, its text); completions (`text`) or chat (`delta`)."""
    raw_delta = choice.get("delta")
    delta: dict[str, Any] = raw_delta if isinstance(raw_delta, dict) else {}
    has_text = "text" in choice or "content" in delta
    text = (choice.get("text") if "text" in choice else delta.get("content")) or ""
    last = choice.get("finish_reason") is not None
    if text or _names_tokens(choice):
        return ("last-token" if last else "token"), text
    if last:
        return "last-empty", ""
    if "role" in delta:
        return "role", ""
    return ("empty" if has_text else "none"), ""


@dataclass
class _Unsure:
    """A chunk that may or may not have carried a token, until usage says."""

    t: float
    kind: ChunkKind
    counted: bool


@dataclass
class StreamTally:
    """One stream's chunks as they arrive: token arrival times into `rec.chunk_times_s` live, the
    unsure chunks settled against the token count when the stream has ended (`settle`)."""

    rec: RequestRecord
    unsure: list[_Unsure] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    notes: set[str] = field(default_factory=set)

    def add(self, t: float, chunk: dict[str, Any]) -> str:
        """Take one chunk (the raw JSON object) arriving at `t`; return the text it carried."""
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        choices = chunk.get("choices") or []
        if not choices:
            return ""
        choice = choices[0]
        if choice.get("finish_reason") is not None:
            self.rec.finish_reason = choice["finish_reason"]
        kind, text = classify_chunk(choice)
        times = self.rec.chunk_times_s
        # live guesses: an empty text is a partial character; a role delta is no token; a bare
        # finish marker is a token only where it is the stream's only chunk that could be one
        count = kind in ("token", "last-token", "empty") or (kind == "last-empty" and not times)
        if kind in ("empty", "last-empty", "role"):
            self.unsure.append(_Unsure(t, kind, count))
        if count:
            times.append(t)
        if kind == "last-token":
            self.notes.add("token-with-finish")
        return text

    def expected_tokens(self) -> int | None:
        """The stream's tokens: usage's count; without it, max_tokens where finish_reason says the
        stream reached it (or the context's end, which a server rarely lets a request run into)."""
        if self.usage is not None and self.usage.get("completion_tokens") is not None:
            return int(self.usage["completion_tokens"])
        return self.rec.max_tokens if self.rec.finish_reason == "length" else None

    def settle(self) -> None:
        """The stream ended: count unsure chunks in or out where that makes chunks match tokens, and
        name the shape. Only for a stream that ended by itself (a cancelled one has no usage)."""
        times, n = self.rec.chunk_times_s, self.expected_tokens()
        if self.usage is None:
            self.notes.add("no-usage")
        if n is None:
            return
        # Unsure chunks are recounted only where that makes chunks and tokens agree: one token
        # short with an uncounted finish marker is vLLM's last token; three short is several
        # tokens per chunk, and the marker stays a marker.
        short = n - len(times)
        add = sorted((u for u in self.unsure if not u.counted), key=lambda u: u.kind != "last-empty")
        if 0 < short <= len(add):  # the finish marker was the last token, then a role delta carried one
            for u in add[:short]:
                bisect.insort(times, u.t)
                u.counted = True
        drop = sorted((u for u in self.unsure if u.counted), key=lambda u: (u.kind == "last-empty", u.t))
        if 0 < -short <= len(drop):  # empty chunks carried nothing (a prelude, a keep-alive), then the marker
            for u in drop[:-short]:
                times.remove(u.t)
                u.counted = False
            self.notes.add("empty-chunks")
        if any(u.kind == "last-empty" and u.counted for u in self.unsure):
            self.notes.add("token-with-finish")
        if any(u.kind == "role" and not u.counted for u in self.unsure):
            self.notes.add("role-only-first-chunk")
        if len(times) < n and times:
            self.notes.add("several-tokens-per-chunk")
        elif len(times) > n:
            self.notes.add("more-chunks-than-tokens")

    @property
    def cached_tokens(self) -> int | None:
        details = (self.usage or {}).get("prompt_tokens_details") or {}
        return details.get("cached_tokens")


@dataclass
class StreamRecord(RequestRecord):
    """A RequestRecord with what only the client sees: how the server shaped the stream, and how
    much of the prompt it served from its cache."""

    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, where reported
    stream_shape: list[str] = field(default_factory=list)  # SHAPE_NOTES codes


def shape_of(rec: RequestRecord) -> list[str]:
    return rec.stream_shape if isinstance(rec, StreamRecord) else []


def shape_counts(records: Sequence[RequestRecord]) -> dict[str, int]:
    """{shape code: requests whose stream had it}, over a run."""
    return dict(sorted(Counter(code for r in records for code in shape_of(r)).items()))


def shape_warning(records: Sequence[RequestRecord]) -> str | None:
    """The run's odd stream shapes in one line (None: every stream was shaped as pdserve's)."""
    counts = {k: v for k, v in shape_counts(records).items() if k not in _INFO_ONLY}
    if not counts:
        return None
    parts = [f"in {v}/{len(records)} streams, {SHAPE_NOTES[k]}" for k, v in counts.items()]
    return "the server's streams: " + "; ".join(parts)


def tokens_in_chunks(rec: RequestRecord) -> str:
    """What a record's shape note is about, as "24 tokens in 6 chunks"."""
    n = rec.completion_tokens if rec.completion_tokens is not None else rec.max_tokens
    return f"{n} tokens in {len(rec.chunk_times_s)} chunks"


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
        tally = StreamTally(rec)
        async for chunk in stream:
            t = now()
            raw = chunk.model_dump(exclude_unset=True)  # which fields the server sent, not defaults
            parts.append(tally.add(t, raw))
            usage = raw.get("usage")
            if usage:
                tl = (raw.get("pdserve") or {}).get("timeline") or {}
                rec.dispatch = tl.get("dispatch")  # pdserve --mode auto only
                rec.worker_queue_ms, rec.worker_prefill_ms = tl.get("queue_ms"), tl.get("prefill_ms")
                rec.router_ttft_ms = tl.get("first_token_ms")
                rec.transfer = tl.get("transfer")  # pdserve disagg: the KV pull
                rec.decode_wait_ms = tl.get("decode_wait_ms")
                if tl.get("token_ms") and tl.get("arrival") is not None:  # step ends, on this clock
                    to_here = tl["arrival"] - (time.time() - now())  # the server's wall clock -> now()
                    rec.step_end_times_s = [to_here + ms / 1e3 for ms in tl["token_ms"]]
                rec.prompt_tokens = usage.get("prompt_tokens")
                rec.completion_tokens = usage.get("completion_tokens")
        tally.settle()
        if isinstance(rec, StreamRecord):
            rec.stream_shape, rec.cached_tokens = sorted(tally.notes), tally.cached_tokens
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
    records: list[RequestRecord] = [
        StreamRecord(s.request_id, s.kind, s.prompt_len, s.max_tokens, s.arrival_s) for s in specs
    ]
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
