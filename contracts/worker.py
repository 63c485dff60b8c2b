"""The contract between the router and the workers: wire types and the worker interfaces.

Both sides import this module and nothing of each other. Workers are plain classes
(prefill_worker/worker.py, decode_worker/worker.py) that Ray wraps as actors; the router calls
them through `router.workers.handle.WorkerHandle`, whose methods mirror `PrefillWorkerAPI` and
`DecodeWorkerAPI` below, and only ever sees these dataclasses and `KVHandle`s, never tensors or
blocks. Importing this module does not import torch (the router process never does).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Protocol

from engine.sequence import SamplingParams, TokenLogprob
from transport.wire import KVHandle, PeerInfo, StreamTarget, TransferStats


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.time)  # wall clock (time.time) at the router
    kv_transfer: str | None = None  # "bulk" | "layerwise" | "auto": this request's, over the server's


@dataclass
class PrefillResult:
    request_id: str
    first_token: int
    handle: KVHandle
    timings: dict[str, float]  # queue_ms, prefill_ms, prefill_start (unix), prefill_end (unix)
    worker: str = ""
    # layer-wise: every group of layers and the first token reached the decode worker named in the
    # request's StreamTarget, which admits the request by itself (False: pull `handle` whole)
    streamed: bool = False
    # layer-wise: when each group of layers was written and announced (first layer, last + 1, unix)
    stream_groups: list[tuple[int, int, float]] = field(default_factory=list)
    first_logprob: TokenLogprob | None = None  # when the request asked for logprobs
    prompt_logprobs: list[TokenLogprob | None] | None = None  # when it asked for prompt logprobs (echo)


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
    logprob: TokenLogprob | None = None  # on "token", when the request asked for logprobs
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on token 0, when it asked for prompt logprobs


@dataclass
class WorkerStats:
    name: str
    role: str  # "prefill" | "decode" | "colocated"
    queue_depth: int  # requests waiting for prefill (or for admission)
    running: int  # sequences decoding
    parked: int  # prefill: sequences holding KV under a lease
    blocks_total: int
    blocks_free: int  # free or cached: what an allocation can take now
    steps: int = 0
    # the last steps this worker ran, oldest first: (step number, prefill tokens, attention pairs,
    # decode sequences, seconds, end as unix s, intra-op threads it ran with, the attention pairs of
    # decode rows, prompt items, the context tokens those items read); the router refines its
    # step-cost fit from them and, from the ends, sees which steps ran while the other pool's did
    # (--mode auto)
    recent_steps: list[tuple[int, int, int, int, float, float, int, int, int, int]] = field(default_factory=list)
    blocks_cached: int = 0  # unreferenced blocks kept by the prefix cache (evicted LRU)
    preemptions: int = 0  # sequences preempted by recompute so far (cumulative)
    prefix_hit_blocks: int = 0  # full blocks found in the prefix cache (cumulative)
    prefix_lookup_blocks: int = 0  # full blocks looked up in the prefix cache (cumulative)
    blocks_evicted: int = 0  # cached blocks evicted for new ones (cumulative)
    rss_bytes: int = 0  # the worker process's resident memory (0: not measurable on this OS)
    heap_in_use_bytes: int = 0  # its C heap (glibc mallinfo2): bytes malloc'd and not freed (0: not measurable)
    heap_free_bytes: int = 0  # ... and freed bytes the heap keeps (fragmentation; malloc_trim returns some)
    cuda_reserved_bytes: int = 0  # CUDA workers: torch's caching allocator, reserved from the driver
    cuda_allocated_bytes: int = 0  # ... and in use by tensors (both 0 on CPU)
    torch_threads: int = 0  # intra-op threads its engine steps run with (0: not reported)
    prompt_threads: int = 0  # ... and its steps that carry a prompt (WorkerConfig.prompt_threads; 0: not reported)
    cpu_gemm: str = ""  # the dtype its CPU GEMMs multiply in ("fp32", "bf16"; "" on CUDA or not reported)
    compiled_graphs: int = 0  # decode-step graphs torch.compile built in this worker (--compile; 0: eager)

    @property
    def blocks_used(self) -> int:
        """Blocks in use (held by a sequence, a parked prefill or a pull)."""
        return self.blocks_total - self.blocks_free

    def to_dict(self) -> dict:
        d = asdict(self)
        d["blocks_used"] = self.blocks_used
        return d

    def step_log(self) -> dict:
        """The recent steps as named fields (the JSON of `GET /v1/workers/steps`). Each step names
        the threads it ran with, so a fit made from a log knows what it measured."""
        keys = (
            "step",
            "prefill_tokens",
            "attention_pairs",
            "decode_seqs",
            "seconds",
            "end_unix_s",
            "torch_threads",
            "decode_pairs",
            "prefill_seqs",
            "prefill_reads",
        )
        return {
            "worker": self.name,
            "role": self.role,
            "torch_threads": self.torch_threads,
            "prompt_threads": self.prompt_threads or self.torch_threads,
            "cpu_gemm": self.cpu_gemm,
            "steps": [{**dict(zip(keys, s)), "cpu_gemm": self.cpu_gemm} for s in self.recent_steps],
        }


@dataclass
class CacheEvents:
    """A worker's prefix-cache changes since the router last asked: chained block hashes
    (engine/kv/prefix_cache.py) stored or evicted, in order. `snapshot` is every hash the worker
    holds, sent instead of trusting the events when some were lost (the router resynchronises)."""

    events: list[tuple[bool, int]]  # (True: stored, False: evicted, hash)
    snapshot: list[int] | None = None


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
    verify_kv: bool = False  # checksum every pulled block on both sides (transport/integrity.py)
    seed: int = 0
    enable_prefix_caching: bool = True  # reuse cached full blocks of equal prefixes (--no-prefix-cache)
    enforce_eager: bool = False  # CUDA: no decode graphs (vLLM's flag name)
    # CPU oneDNN GEMMs run at a fixed set of row counts, this many per power of two (0 = any row
    # count): oneDNN keeps a primitive per shape, so any-row-count GEMMs grow a worker's memory
    # with every new prompt length (engine/model/linear.py RowBuckets)
    gemm_row_buckets: int = 4
    # CPU: the dtype GEMMs multiply in: auto, fp32 or bf16 (engine/model/linear.py resolve_host_gemm)
    cpu_gemm: str = "fp32"
    # CPU: the decode step compiled by torch.compile at start: off, default or max-autotune; auto
    # (serve's default): default for a checkpoint where it applies, else eager
    # (engine/runner/compiled_decode.py)
    compile: str = "off"
    # intra-op torch threads (torch.set_num_threads at worker start, before the engine is built);
    # None leaves torch's own default (OMP_NUM_THREADS, or Ray's num_cpus). `pdserve serve` always
    # sets it: --threads-per-worker, or its auto rule (router/workers/threads.py)
    torch_threads: int | None = None
    # intra-op threads of a step that carries a prompt of some length (None: as torch_threads;
    # engine/config.py PROMPT_STEP_TOKENS). A colocated worker's prompt steps can take
    # the core left to the router: no token streams while a whole prompt runs
    # (router/workers/threads.py has the rule)
    prompt_threads: int | None = None
    # the fewest prompt tokens a step carries to run on prompt_threads (None: the engine's default,
    # engine/config.py PROMPT_STEP_TOKENS)
    prompt_threads_min_tokens: int | None = None
    # an idle engine loop gathers requests until none has come for batch_wait_s, at most
    # batch_wait_max_s after the first, before its step (None: the engine's defaults,
    # engine/config.py BATCH_WAIT_S and BATCH_WAIT_MAX_S)
    batch_wait_s: float | None = None
    batch_wait_max_s: float | None = None


class WorkerError(RuntimeError):
    """A worker failed a request (dead worker, transfer failure); the router answers 5xx/ends the stream."""


class Worker(Protocol):
    """What every worker answers, whatever its role. Methods block the calling thread (a Ray
    actor thread, or an executor thread for an in-process worker), never the engine loop."""

    name: str

    def abort(self, request_id: str) -> bool:
        """Forget the request wherever it is; True if the worker still held it."""

    def stats(self) -> WorkerStats: ...

    def ping(self) -> str:
        """The worker's name; raises if its engine loop is gone (the router then replaces it)."""

    def cache_events(self) -> CacheEvents:
        """Prefix-cache changes since the last call (for the router's prefix index)."""

    def shutdown(self) -> None: ...


class PrefillWorkerAPI(Worker, Protocol):
    def prefill(self, req: GenerateRequest, stream: StreamTarget | None = None) -> PrefillResult:
        """Run the prompt; return the first token and a KVHandle whose blocks stay leased until
        the decode side pulls them, `release` is called, or the lease expires. With `stream`
        (layer-wise), each group of layers is announced to that decode worker as it is written."""

    def release(self, request_id: str) -> bool:
        """Free a prefilled prompt's leased blocks now."""

    def describe(self) -> PeerInfo: ...


class DecodeWorkerAPI(Worker, Protocol):
    def submit_prompt(self, req: GenerateRequest) -> None:
        """Colocated: admit a raw prompt (prefilled here, whole or in chunks)."""

    def submit_prefilled(self, req: GenerateRequest, result: PrefillResult) -> None:
        """Disaggregated: admit a request whose KV waits on the prefill worker named in `result`
        (a stream opened for it that did not complete is closed first)."""

    def open_stream(self, req: GenerateRequest, source: PeerInfo, layers_per_group: int) -> StreamTarget | None:
        """Layer-wise: reserve the prompt's blocks now and pull each group of layers as `source`
        announces it; the request joins the batch once all of it and its first token landed.
        None when the blocks are not free now (the router then uses a bulk pull)."""

    def describe(self) -> PeerInfo:
        """This worker's transport endpoint (disaggregated decode workers only)."""

    def poll_events(self, timeout_s: float = 0.05) -> list[StreamEvent]:
        """Token (and admission/error) events since the last poll; waits up to `timeout_s` for one."""
