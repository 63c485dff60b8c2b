"""The scheduler's one record per step: what it admits and chunks, in what order, and whom it
preempts, before the engine runs anything."""

from __future__ import annotations

import dataclasses

import pytest

from engine.config import PRESETS, CacheConfig
from engine.core.llm_engine import LLMEngine
from engine.core.scheduler import PrefillChunk, ScheduledBatch
from engine.runner.model_runner import ModelRunner
from engine.sequence import SamplingParams, Sequence, Status


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner(PRESETS["tiny"], CacheConfig(block_size=4, num_blocks=12, kv_dtype="fp8"), "fp8")


def _seq(i: int, n: int, max_tokens: int = 8) -> Sequence:
    return Sequence(
        f"q{i}", [(7 * i + j) % 256 for j in range(n)], SamplingParams(max_tokens=max_tokens, temperature=0.0)
    )


def test_record_is_frozen_and_chunks_fifo_within_the_budget(runner):
    engine = LLMEngine(runner, chunk_size=6, enable_prefix_caching=False)
    a, b = _seq(1, 4), _seq(2, 10)
    engine.add_request(a)
    engine.add_request(b)
    work = engine.scheduler.schedule()
    assert isinstance(work, ScheduledBatch) and not work.is_empty
    assert work.decode == () and work.preempted == ()
    assert work.prefill == (PrefillChunk(a, 0, 4), PrefillChunk(b, 0, 2))  # a whole, b gets the rest of 6
    assert work.prefill[0].completes and not work.prefill[1].completes and work.prefill_tokens == 6
    with pytest.raises(dataclasses.FrozenInstanceError):
        work.decode = ()  # type: ignore[misc]
    assert list(engine.waiting) == [a, b]  # scheduling moves nothing between queues


def test_record_names_the_preempted_and_the_engine_reports_them(runner):
    engine = LLMEngine(runner, chunk_size=None, enable_prefix_caching=False)
    seqs = [_seq(i, 16, max_tokens=20) for i in range(3)]  # 4 blocks each: the pool's 12 at once
    for s in seqs:
        engine.add_request(s)
    engine.step()  # all three prefill whole and sample their first token
    assert [s.status for s in seqs] == [Status.RUNNING] * 3 and engine.blocks.num_free == 0
    work = engine.scheduler.schedule()  # each needs a 5th block: the newest gives its 4 back
    assert work.preempted == ("q2",) and work.decode == (seqs[0], seqs[1]) and work.prefill == ()
    assert engine.preempted == ["q2"] and engine.preemptions == 1
    assert list(engine.waiting) == [seqs[2]] and seqs[2].status == Status.WAITING
