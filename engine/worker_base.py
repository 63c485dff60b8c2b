"""EngineLoop: one thread owns an LLMEngine; other threads talk to it through an inbox.

Workers (prefill and decode) are plain classes built on this, so the same code runs under a
Ray actor (threaded, `max_concurrency` > 1), in a benchmark process without Ray, or in a test.
The engine, its block manager and its KV pool are touched only by the loop thread.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

from engine.config import CacheConfig, resolve_model_config
from engine.llm_engine import LLMEngine
from engine.model_runner import ModelRunner
from engine.weights import is_checkpoint_dir, read_generation_eos

log = logging.getLogger("pdserve.worker")


def build_engine(cfg: Any, prefill_only: bool) -> LLMEngine:
    """LLMEngine from a router.types.WorkerConfig (duck-typed to keep engine/ free of router/)."""
    model_cfg = resolve_model_config(cfg.model)
    ckpt = cfg.model if is_checkpoint_dir(cfg.model) else None
    cache = CacheConfig(block_size=cfg.block_size, num_blocks=cfg.num_blocks, kv_dtype=cfg.kv_dtype)
    runner = ModelRunner(model_cfg, cache, cfg.dtype, cfg.device, ckpt, seed=cfg.seed)
    eos = tuple(read_generation_eos(cfg.model)) if ckpt else ()
    return LLMEngine(runner, chunk_size=cfg.chunk_size, max_num_seqs=cfg.max_num_seqs,
                     max_prefill_tokens=cfg.max_prefill_tokens, prefill_only=prefill_only, eos_ids=eos)


class EngineLoop:
    """Runs `tick()` (subclass hook: one engine step and its bookkeeping) until closed.

    `call(fn)` runs `fn()` on the loop thread before the next step and returns its result: the
    only way other threads mutate engine state."""

    idle_wait_s = 0.002  # how long an idle loop sleeps between inbox/notification polls

    def __init__(self, name: str):
        self.name = name
        self._inbox: queue.Queue[tuple[Callable[[], Any], Future]] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{name}-loop", daemon=True)
        self.steps = 0
        self.fatal: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def call(self, fn: Callable[[], Any], timeout: float | None = 60.0) -> Any:
        if self.fatal is not None:
            raise RuntimeError(f"worker {self.name} loop died: {self.fatal!r}")
        fut: Future = Future()
        self._inbox.put((fn, fut))
        return fut.result(timeout)

    def _drain_inbox(self, block: bool) -> None:
        try:
            fn, fut = self._inbox.get(timeout=self.idle_wait_s) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - the caller re-raises it
                fut.set_exception(e)
            try:
                fn, fut = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                busy = self.has_work()
                self._drain_inbox(block=not busy)
                self.tick()
                if busy:
                    self.steps += 1
        except BaseException as e:  # noqa: BLE001
            log.exception("worker %s loop died", self.name)
            self.fatal = e

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)

    # subclass hooks
    def has_work(self) -> bool:
        raise NotImplementedError

    def tick(self) -> None:
        raise NotImplementedError


def now() -> float:
    return time.time()
