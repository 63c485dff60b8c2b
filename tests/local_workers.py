"""Prefill and decode workers in this process over the "local" transport, as the lifecycle tests
build them (tests/test_worker_lifecycle.py: the workers alone; tests/test_orchestrator_lifecycle.py:
the orchestrator over them): a small config, a request, a pair of workers shut down after the
test, and the check that every KV block came back.
"""

from __future__ import annotations

import itertools

import pytest

from contracts.worker import GenerateRequest, WorkerConfig, WorkerError
from decode_worker.worker import DecodeWorker
from engine.sequence import SamplingParams
from prefill_worker.worker import PrefillWorker

# One counter for every module: the local transport registers each worker by name, process-wide.
NAMES = itertools.count()
PROMPT = list(b"the quick brown fox jumps over")  # 30 tokens: 2 blocks of 16
LONG = list(b"0123456789" * 6)  # 60 tokens: 4 blocks of 16, with room for 4 generated


def worker_cfg(**kw) -> WorkerConfig:
    return WorkerConfig(**{"model": "tiny", "transport": "local", "num_blocks": 32, **kw})


def make_request(rid: str, max_tokens: int = 8, prompt: list[int] = PROMPT) -> GenerateRequest:
    return GenerateRequest(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def all_free(*workers) -> bool:
    """No block in use on any of `workers`, and each one's ledger holds (free/cached/in use)."""
    for w in workers:
        try:
            w.call(w.engine.blocks.check)  # on the loop thread: the only one that touches blocks
        except WorkerError:
            w.engine.blocks.check()  # the loop is gone: nothing else touches them now
    return all(w.stats().blocks_free == w.stats().blocks_total for w in workers)


def worker_pair_fixture():
    """The `make_pair` fixture of a module, declared as `make_pair = worker_pair_fixture()`:
    make_pair(prefill_kw, decode_kw) -> (PrefillWorker, DecodeWorker); shut down after the test."""

    @pytest.fixture
    def make_pair():
        made = []

        def make(prefill_kw: dict | None = None, decode_kw: dict | None = None):
            n = next(NAMES)
            p = PrefillWorker(worker_cfg(**(prefill_kw or {})), f"lc-prefill-{n}")
            d = DecodeWorker(worker_cfg(**(decode_kw or {})), f"lc-decode-{n}")
            made.append((p, d))
            return p, d

        yield make
        for p, d in made:
            d.shutdown()
            p.shutdown()

    return make_pair
