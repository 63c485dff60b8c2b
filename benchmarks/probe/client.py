"""How `pdserve bench probe` talks to a server: fresh prompts of exact lengths, one stream at a time
or many, every failure a one-line `ProbeError`.

Prompts go as lists of token ids when the server takes them (pdserve, vLLM and SGLang do), so a
T-token prompt is T tokens on any tokenizer. A server that refuses ids gets text instead: words
drawn at random, their count scaled by the tokens per word the server's own `usage.prompt_tokens`
reported, and every measurement keyed by the count the server reported, not the one asked for.

Every prompt is fresh (a seeded counter picks its tokens), so a server with prefix caching never
serves one measurement from another's cache; only the prefix-caching check repeats a prompt.

Streams go through benchmarks/client/serve_client.py's `send_one` (the same client `bench serve` uses).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Literal

from openai import AsyncOpenAI

from benchmarks.client.serve_client import (
    NOT_PER_TOKEN,
    SHAPE_NOTES,
    ClientConfig,
    ClientError,
    StreamRecord,
    discover_model,
    make_client,
    send_one,
    shape_of,
    tokens_in_chunks,
)
from costmodel.serve_metrics import RequestRecord
from costmodel.workloads import RequestSpec, WorkloadConfig

PromptMode = Literal["auto", "ids", "text"]

# Common English words: one BPE token each on most vocabularies, so a text prompt's length is
# predictable before the server's usage confirms it.
_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have an "
    "they you were her she there one all we their been has when who will more no if out so said what up its "
    "about into than them can only other new some could time these two may then do first any my now such like"
).split()


class ProbeError(Exception):
    """The probe cannot go on (unreachable server, refused prompts, a server that died): one line."""


@dataclass
class ProbeClient:
    base_url: str
    model: str | None = None
    api_key: str = "EMPTY"
    prompts: PromptMode = "auto"
    # bench serve's default id range (costmodel/workloads.py): printable bytes, ordinary tokens in
    # byte and BPE vocabularies alike
    token_id_range: tuple[int, int] = (WorkloadConfig.token_id_low, WorkloadConfig.token_id_high)
    request_timeout_s: float = 60.0
    seed: int = 0
    mode: Literal["ids", "text"] = "ids"  # what `start()` settled on
    tokens_per_word: float = 1.0  # text mode: what the server's usage said
    _client: AsyncOpenAI | None = None
    _rng: random.Random = field(default_factory=random.Random)
    _count: int = 0
    t0: float = field(default_factory=time.perf_counter)

    @property
    def cfg(self) -> ClientConfig:
        return ClientConfig(
            base_url=self.base_url,
            api_key=self.api_key,
            model=self.model,
            duration_limit_s=self.request_timeout_s,
            request_timeout_s=self.request_timeout_s,
            show_progress=False,
        )

    @property
    def client(self) -> AsyncOpenAI:
        assert self._client is not None, "start() first"
        return self._client

    async def start(self) -> None:
        """Connect, find the model, settle how prompts are sent."""
        self._rng.seed(self.seed)
        try:
            self._client = make_client(self.cfg)
        except ValueError as e:
            raise ProbeError(str(e)) from None
        try:
            self.model = self.model or await discover_model(self.client)
        except ClientError as e:
            raise ProbeError(str(e)) from None
        if self.prompts in ("auto", "ids"):
            rec = await self.send(8, 1, check=False)
            if rec.ok:
                self.mode = "ids"
                return
            if self.prompts == "ids" or not rec.error or not rec.error.startswith(("HTTP 400", "HTTP 422")):
                raise ProbeError(f"a prompt of 8 token ids failed: {rec.error}")
        self.mode = "text"
        rec = await self.send(200, 1, check=False)
        if not rec.ok:
            raise ProbeError(f"a 200-word text prompt failed: {rec.error}")
        if not rec.prompt_tokens:
            raise ProbeError(
                "the server refuses token-id prompts and reports no usage.prompt_tokens in the stream "
                "(stream_options.include_usage): text prompts of known length are impossible"
            )
        self.tokens_per_word = rec.prompt_tokens / 200

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()

    def prompt(self, tokens: int) -> tuple[str | tuple[int, ...], int]:
        """A fresh prompt of about `tokens` tokens; (prompt, intended length)."""
        self._count += 1
        if self.mode == "ids":
            lo, hi = self.token_id_range
            return tuple(self._rng.randrange(lo, hi) for _ in range(tokens)), tokens
        words = max(1, round(tokens / self.tokens_per_word))
        return " ".join(self._rng.choice(_WORDS) for _ in range(words)), tokens

    def spec(self, tokens: int, max_tokens: int, kind: str, prompt: str | tuple[int, ...] | None = None) -> RequestSpec:
        p, n = (prompt, tokens) if prompt is not None else self.prompt(tokens)
        return RequestSpec(f"probe-{self._count}", p, n, max_tokens, 0.0, kind)  # type: ignore[arg-type]

    @staticmethod
    def record(spec: RequestSpec) -> RequestRecord:
        # a StreamRecord: `checked` reads how the server shaped the stream
        return StreamRecord(spec.request_id, spec.kind, spec.prompt_len, spec.max_tokens, 0.0)

    async def run(self, spec: RequestSpec, rec: RequestRecord | None = None) -> RequestRecord:
        """Send one request and stream it to the end (bounded by the request timeout), filling `rec`."""
        rec = rec if rec is not None else self.record(spec)
        try:
            await asyncio.wait_for(
                send_one(self.client, self.model or "", spec, self._count, self.cfg, rec, self.t0),
                self.request_timeout_s + 5,
            )
        except asyncio.TimeoutError:
            rec.error = f"no answer within {self.request_timeout_s:g} s"
        return rec

    async def send(self, tokens: int, max_tokens: int, kind: str = "probe", check: bool = True) -> RequestRecord:
        rec = await self.run(self.spec(tokens, max_tokens, kind))
        if check:
            checked(rec)
        return rec

    def now(self) -> float:
        return time.perf_counter() - self.t0


def checked(rec: RequestRecord) -> RequestRecord:
    """The record, or a ProbeError saying why the request failed (a server that died mid-probe),
    or why its stream cannot be timed token by token (the probe's decode step and stall are gaps
    between tokens, taken as gaps between chunks)."""
    if not rec.ok:
        why = f"request {rec.request_id} ({rec.prompt_len}-token prompt) failed: {rec.error}"
        if "time" in (rec.error or "").lower():  # the client's timeout, or ours
            # the longest wait is a stream at the largest batch and the long context: its first token
            # comes after every prompt of the batch (on the 2-core VM 16 of 1,024 tokens took over 60 s)
            why += " (a batch of long prompts can take longer than --request-timeout-s: raise it, or lower --max-batch)"
        raise ProbeError(why)
    for code in NOT_PER_TOKEN:
        if code in shape_of(rec):
            raise ProbeError(
                f"request {rec.request_id} streamed {tokens_in_chunks(rec)}: {SHAPE_NOTES[code]}; the probe "
                "times each token by its own chunk and cannot measure this server"
            )
    return rec
