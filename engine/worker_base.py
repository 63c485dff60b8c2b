"""EngineLoop: one thread owns an LLMEngine; other threads talk to it through an inbox.

Workers (prefill and decode) are plain classes built on this, so the same code runs under a
Ray actor (threaded, its calls in concurrency groups: router/workers/host.py), in a benchmark process
without Ray, or in a test.
The engine, its block manager and its KV pool are touched only by the loop thread.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Protocol

import torch

from engine.config import (
    BATCH_WAIT_MAX_S,
    BATCH_WAIT_S,
    CacheConfig,
    is_checkpoint_dir,
    read_generation_eos,
    resolve_model_config,
)
from engine.core.llm_engine import LLMEngine
from engine.heap_trim import HeapTrimmer
from engine.model.linear import RowBuckets
from engine.runner.model_runner import ModelRunner
from engine.worker_figures import compiled_graphs_of, cpu_gemm_of, kv_figures, memory_figures

log = logging.getLogger("pdserve.worker")
STEP_LOG_KEPT = 256  # recent steps a worker reports in stats()


class EngineSettings(Protocol):
    """The fields of a worker's configuration that build its engine (`contracts.worker.WorkerConfig`
    has them; stated here structurally so engine/ imports nothing above it)."""

    model: str  # preset or checkpoint directory
    dtype: str
    kv_dtype: str
    device: str
    block_size: int
    num_blocks: int
    chunk_size: int | None
    max_num_seqs: int
    max_prefill_tokens: int
    seed: int
    enable_prefix_caching: bool
    enforce_eager: bool  # CUDA: never replay decode graphs (every step eager)
    gemm_row_buckets: int  # CPU oneDNN GEMM row counts per power of two (0 = off; engine/model/linear.py)
    cpu_gemm: str  # CPU GEMM dtype: auto, fp32 or bf16 (engine/model/linear.py)
    compile: str  # CPU decode step: auto, off, default or max-autotune (engine/runner/compiled_decode.py)
    prompt_threads: int | None  # CPU: intra-op threads of steps carrying a prompt (None: the worker's)
    prompt_threads_min_tokens: int | None  # ... from this many prompt tokens (None: PROMPT_STEP_TOKENS)


def build_engine(cfg: EngineSettings, prefill_only: bool) -> LLMEngine:
    """LLMEngine from a worker's configuration."""
    model_cfg = resolve_model_config(cfg.model)
    ckpt = cfg.model if is_checkpoint_dir(cfg.model) else None
    cache = CacheConfig(block_size=cfg.block_size, num_blocks=cfg.num_blocks, kv_dtype=cfg.kv_dtype)
    runner = ModelRunner(
        model_cfg,
        cache,
        cfg.dtype,
        cfg.device,
        ckpt,
        seed=cfg.seed,
        row_buckets=RowBuckets(cfg.gemm_row_buckets),
        cpu_gemm=cfg.cpu_gemm,
    )
    runner.prompt_threads = cfg.prompt_threads
    if cfg.prompt_threads_min_tokens is not None:
        runner.prompt_min_tokens = cfg.prompt_threads_min_tokens
    # before the worker reports ready: a fresh server's first request costs what its tenth does
    warm_s = runner.warm_up()
    log.info("%s: warm-up %.2f s (CPU GEMMs %s)", cfg.model, warm_s, runner.model.cpu_gemm)
    eos = tuple(read_generation_eos(cfg.model)) if ckpt else ()
    engine = LLMEngine(
        runner,
        chunk_size=cfg.chunk_size,
        max_num_seqs=cfg.max_num_seqs,
        max_prefill_tokens=cfg.max_prefill_tokens,
        prefill_only=prefill_only,
        eos_ids=eos,
        enable_prefix_caching=cfg.enable_prefix_caching,
    )
    # CUDA: decode-only steps replay captured graphs (prefill steps, and prefill workers, are eager)
    if runner.device.type == "cuda" and not prefill_only and not cfg.enforce_eager:
        from engine.gpu.cuda_graphs import attach_decode_graphs  # noqa: PLC0415 (CUDA only)

        attach_decode_graphs(engine)
    # CPU: the decode step compiled now, before the worker reports ready (a prefill worker never decodes)
    # (--compile auto leaves random-weight presets eager: they are for tests and mechanics, whose
    # ~1 ms steps never repay 10-40 s of compiling)
    compile_mode = "off" if cfg.compile == "auto" and ckpt is None else cfg.compile
    if runner.device.type == "cpu" and not prefill_only and compile_mode != "off":
        from engine.runner.compiled_decode import attach_compiled_decode  # noqa: PLC0415 (imports torch's compiler)

        attach_compiled_decode(runner, compile_mode)
    return engine


def use_threads(threads: int | None, name: str) -> int:
    """Set this process's intra-op thread count (None: keep torch's) and return it; call it before
    the engine is built. Ray only exports OMP_NUM_THREADS from the actor's num_cpus when the
    environment has none (the test suite exports 1), and torch reads it once at import: setting it
    here makes the worker's configuration the one figure that counts."""
    if threads is not None:
        torch.set_num_threads(threads)
    got = torch.get_num_threads()
    # (a Ray actor's process shows INFO only where logging is configured; the router logs the
    # count it chose, and the stats and step log carry this one)
    level = logging.WARNING if threads is not None and got != threads else logging.INFO
    log.log(
        level,
        "worker %s: %d intra-op torch threads (%s)",
        name,
        got,
        f"asked {threads}" if threads else "torch's default",
    )
    return got


class EngineLoop:
    """Runs `tick()` (subclass hook: one engine step and its bookkeeping) until closed.

    `call(fn)` runs `fn()` on the loop thread before the next step and returns its result: the
    only way other threads mutate engine state.

    When the loop ends (it died, or `close()`), nothing is left waiting forever: `on_exit()` (a
    subclass hook, on the loop thread) fails the work the subclass holds, every queued `call`
    fails, and later calls and `check_running()` raise `error_type`."""

    engine: LLMEngine  # built by each worker subclass before start()
    idle_wait_s = 0.002  # how long an idle loop sleeps between inbox/notification polls
    # an idle loop woken by work gathers more until the inbox has been quiet this long, at most
    # batch_wait_max_s from the first (engine/config.py)
    batch_wait_s = BATCH_WAIT_S
    batch_wait_max_s = BATCH_WAIT_MAX_S
    error_type: type[Exception] = RuntimeError  # what callers get from a dead or closed loop

    def __init__(
        self,
        name: str,
        torch_threads: int | None = None,
        batch_wait_s: float | None = None,
        batch_wait_max_s: float | None = None,
    ):
        self.name = name
        if batch_wait_s is not None:
            self.batch_wait_s = batch_wait_s
        if batch_wait_max_s is not None:
            self.batch_wait_max_s = batch_wait_max_s
        # set before the subclass builds its engine (weights load on this thread, steps on the loop's)
        self.torch_threads = use_threads(torch_threads, name)
        self._inbox: queue.Queue[tuple[Callable[[], Any], Future]] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{name}-loop", daemon=True)
        self._exited = False  # set by the loop thread once it will never read the inbox again
        self.steps = 0  # forward passes run
        # recent steps: contracts/worker.py `WorkerStats.recent_steps` names the fields
        self.step_log: deque[tuple[int, int, int, int, float, float, int, int, int, int]] = deque(maxlen=STEP_LOG_KEPT)
        self.fatal: BaseException | None = None
        self.heap = HeapTrimmer(enabled=os.environ.get("PDSERVE_HEAP_TRIM", "1") != "0")

    def start(self) -> None:
        self._thread.start()

    def check_running(self) -> None:
        """Raise `error_type` if the loop has died or been closed."""
        if self.fatal is not None or self._stop.is_set() or self._exited:
            raise self._ended_error()

    def call(self, fn: Callable[[], Any], timeout: float | None = 60.0) -> Any:
        self.check_running()
        fut: Future = Future()
        self._inbox.put((fn, fut))
        if self._exited:  # the loop ended between the check and the put: nobody else will answer
            self._fail_inbox()
        try:
            return fut.result(timeout)
        except FutureTimeout:
            if fut.done():  # fn itself raised a TimeoutError
                raise
            raise self.error_type(
                f"worker {self.name} did not answer within {timeout:g} s (its engine loop is stuck or overloaded)"
            ) from None

    def post(self, fn: Callable[[], Any]) -> None:
        """Run `fn` on the loop thread at its next inbox drain without waiting for it: for a
        thread whose next job must not wait a whole engine step (a `call` from the KV transfer
        thread held each pull until the step after the previous one's admission, so requests
        prefilled together joined the decode batch one per step). `fn` reports its own errors;
        one that escapes is logged."""
        self.check_running()
        fut: Future = Future()
        fut.add_done_callback(self._log_escaped)
        self._inbox.put((fn, fut))
        if self._exited:
            self._fail_inbox()

    def _log_escaped(self, fut: Future) -> None:
        """A posted job's escaped error: nobody waits on its future, so it is logged here (not
        the loop's end: `on_exit` has failed that work already)."""
        e = fut.exception()
        if e is not None and not self._exited:
            log.warning("worker %s: posted job failed on the loop thread: %r", self.name, e)

    def _ended_error(self) -> Exception:
        if self.fatal is not None:
            return self.error_type(
                f"worker {self.name}: its engine loop died ({self.fatal!r}); the worker must be restarted"
            )
        return self.error_type(f"worker {self.name} is shut down")

    def _fail_inbox(self) -> None:
        while True:
            try:
                _, fut = self._inbox.get_nowait()
            except queue.Empty:
                return
            fut.set_exception(self._ended_error())

    def _drain_inbox(self, block: bool) -> None:
        try:
            fn, fut = self._inbox.get(timeout=self.idle_wait_s) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            _answer(fn, fut)
            try:
                fn, fut = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _gather(self) -> None:
        """Run what reaches the inbox until it has been quiet for `batch_wait_s`, or until
        `batch_wait_max_s` from now: requests sent together (a burst of chats), which the router
        hands on one after another, share the first step instead of racing its start. Any job
        restarts the quiet wait (an abort or a landed KV pull too: the cap bounds it)."""
        cap = time.monotonic() + max(self.batch_wait_max_s, self.batch_wait_s)
        deadline = min(time.monotonic() + self.batch_wait_s, cap)
        while (left := deadline - time.monotonic()) > 0:
            try:
                fn, fut = self._inbox.get(timeout=left)
            except queue.Empty:
                return
            _answer(fn, fut)
            deadline = min(time.monotonic() + self.batch_wait_s, cap)

    def _run(self) -> None:
        # Block on the inbox (a short idle wait) unless the last tick ran a forward pass and work
        # remains: a loop whose work is all blocked (prompts waiting for KV blocks that only a
        # lease expiry or a pull will free) must not spin a core, nor count empty steps.
        progressed = False
        # OpenMP keeps a thread count per thread: report the one this loop's steps run with
        self.torch_threads = torch.get_num_threads()
        try:
            while not self._stop.is_set():
                idle = not self.has_work()
                self._drain_inbox(block=not (progressed and self.has_work()))
                if idle and self.batch_wait_s > 0 and self.has_work():
                    self._gather()
                progressed = bool(self.tick())
                if progressed:
                    self.steps += 1
                    self.heap.worked()
                elif not self.has_work():
                    self.heap.idle()  # free pages back to the OS while nothing runs
        except BaseException as e:  # noqa: BLE001
            log.exception("worker %s loop died", self.name)
            self.fatal = e
        finally:
            self._exited = True
            try:
                self.on_exit()
            except Exception:  # noqa: BLE001
                log.exception("worker %s: failing its pending work failed", self.name)
            self._fail_inbox()

    def ping(self) -> str:
        """Raises if the engine loop is gone, so the router reports and replaces the worker."""
        self.check_running()
        return self.name

    def stats_fields(self) -> dict[str, Any]:
        """The WorkerStats fields every worker reports alike (its role's queue counts aside)."""
        e = self.engine
        return dict(
            steps=self.steps,
            recent_steps=list(self.step_log),
            torch_threads=self.torch_threads,
            prompt_threads=self.engine.runner.prompt_threads or self.torch_threads,
            cpu_gemm=cpu_gemm_of(e),
            compiled_graphs=compiled_graphs_of(e),
            **kv_figures(e),
            **memory_figures(e),
        )

    def log_step(self, engine: LLMEngine) -> None:
        """Loop thread: remember the shape, time and end (unix s) of the step `engine` just ran."""
        st = engine.last_step
        if st is not None:
            shape = (st.prefill_tokens, st.attention_pairs, st.decode_tokens)
            threads = st.threads or self.torch_threads
            entry = (self.steps + 1, *shape, st.seconds, time.time(), threads, st.decode_pairs)
            self.step_log.append((*entry, st.prefill_seqs, st.prefill_reads))

    def drain_cache_events(self) -> tuple[list[tuple[bool, int]], list[int] | None]:
        """(prefix-cache events since the last call, every cached hash if events were lost)."""
        engine = self.engine

        def do() -> tuple[list[tuple[bool, int]], list[int] | None]:
            events, dropped = engine.blocks.drain_events()
            return events, engine.blocks.cached_hashes() if dropped else None

        return self.call(do)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)

    # subclass hooks
    def has_work(self) -> bool:
        raise NotImplementedError

    def tick(self) -> bool:
        """One step of the loop; True if it ran a forward pass."""
        raise NotImplementedError

    def on_exit(self) -> None:
        """Loop thread, once, as the loop ends: fail every request still held (nothing may wait
        forever on a loop that is gone)."""


def _answer(fn: Callable[[], Any], fut: Future) -> None:
    """Run one inbox job on the loop thread and answer its caller (an error is re-raised there)."""
    try:
        fut.set_result(fn())
    except BaseException as e:  # noqa: BLE001 - the caller re-raises it
        fut.set_exception(e)


def now() -> float:
    return time.time()
