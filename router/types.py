"""Typed messages between the router and the workers (the serving layer's contract).

Workers are plain classes (prefill_worker/worker.py, decode_worker/worker.py) that Ray wraps as
actors; the router only ever sees these dataclasses and `KVHandle`s, never tensors or blocks.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from engine.sequence import SamplingParams
from transport.wire import KVHandle, TransferStats


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.time)  # wall clock (time.time) at the router


@dataclass
class PrefillResult:
    request_id: str
    first_token: int
    handle: KVHandle
    timings: dict[str, float]  # queue_ms, prefill_ms, prefill_start (unix), prefill_end (unix)
    worker: str = ""


@dataclass
class StreamEvent:
    """One token (or a terminal/admin event) from a decode worker for one request."""

    request_id: str
    kind: str  # "token" | "admitted" | "error"
    token_id: int = -1
    index: int = -1  # 0 = first generated token
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    t: float = field(default_factory=time.time)
    transfer: TransferStats | None = None  # on "admitted" in disaggregated mode
    error: str | None = None
    timings: dict[str, float] | None = None  # colocated, on token 0: queue_ms, prefill_ms


@dataclass
class WorkerStats:
    name: str
    role: str  # "prefill" | "decode" | "colocated"
    queue_depth: int  # requests waiting for prefill (or for admission)
    running: int  # sequences decoding
    parked: int  # prefill: sequences holding KV under a lease
    blocks_total: int
    blocks_free: int
    steps: int = 0

    @property
    def blocks_used(self) -> int:
        return self.blocks_total - self.blocks_free

    def to_dict(self) -> dict:
        d = asdict(self)
        d["blocks_used"] = self.blocks_used
        return d


@dataclass
class WorkerConfig:
    """Everything a worker needs to build its engine. One per pool (prefill / decode)."""

    model: str = "tiny"  # preset or checkpoint directory
    dtype: str = "fp8"  # weights
    kv_dtype: str = "fp8"
    device: str = "cpu"
    block_size: int = 16
    num_blocks: int = 1024
    chunk_size: int | None = None  # prefill chunk (None = whole prompts)
    max_num_seqs: int = 64
    max_prefill_tokens: int = 8192
    lease_s: float = 30.0  # prefill blocks are freed if decode has not pulled them by then
    transport: str = "nixl"  # "nixl" | "local"
    transfer_timeout_s: float = 30.0
    seed: int = 0


class WorkerError(RuntimeError):
    """A worker failed a request (dead worker, transfer failure); the router answers 5xx/ends the stream."""
