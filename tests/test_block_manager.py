"""BlockManager invariants under seeded random workloads, and LLMEngine never leaking blocks
(requests that finish, and aborts of waiting, mid-prefill, running and parked sequences)."""

from __future__ import annotations

import random

import pytest
import torch

from engine.config import PRESETS, CacheConfig
from engine.core.llm_engine import LLMEngine
from engine.kv.block_manager import BlockManager, NoFreeBlocks
from engine.runner.model_runner import ModelRunner
from engine.sequence import SamplingParams, Sequence, Status


def _check(bm: BlockManager, owners: dict[int, list[int]]) -> None:
    """The manager's state equals what the owners hold."""
    held: dict[int, int] = {}
    for blocks in owners.values():
        assert len(set(blocks)) == len(blocks)  # no block twice in one table
        for b in blocks:
            held[b] = held.get(b, 0) + 1
    for b in range(bm.num_blocks):
        assert bm.ref_count(b) == held.get(b, 0), f"block {b}"
    # free list == blocks with ref count 0, each exactly once
    assert bm.num_free == sum(1 for b in range(bm.num_blocks) if bm.ref_count(b) == 0)
    assert bm.num_free + bm.num_used == bm.num_blocks


@pytest.mark.parametrize("seed", range(5))
def test_random_allocate_grow_share_free(seed):
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=rng.choice([7, 32, 100]), block_size=rng.choice([1, 4, 16]))
    owners: dict[int, list[int]] = {}
    next_id = 0
    for _ in range(400):
        op = rng.random()
        if op < 0.35:  # allocate
            n = rng.randint(1, 6)
            before = bm.num_free
            if n > before:
                with pytest.raises(NoFreeBlocks):
                    bm.allocate(n)
                assert bm.num_free == before  # a failed allocation changes nothing
            else:
                got = bm.allocate(n)
                assert all(b not in blocks for blocks in owners.values() for b in got)  # never owned twice
                owners[next_id] = got
                next_id += 1
        elif op < 0.5 and owners:  # grow a table to hold more tokens
            k = rng.choice(list(owners))
            tokens = len(owners[k]) * bm.block_size + rng.randint(1, 2 * bm.block_size)
            if bm.can_allocate(bm.blocks_for(tokens) - len(owners[k])):
                bm.grow(owners[k], tokens)
                assert len(owners[k]) == bm.blocks_for(tokens)
        elif op < 0.6 and owners:  # share (e.g. a fork or a parked prefill): incref
            k = rng.choice(list(owners))
            bm.incref(owners[k])
            owners[next_id] = list(owners[k])
            next_id += 1
        elif owners:  # free one owner
            bm.free(owners.pop(rng.choice(list(owners))))
        _check(bm, owners)
    for k in list(owners):
        bm.free(owners.pop(k))
    _check(bm, owners)
    assert bm.num_free == bm.num_blocks


def test_errors_double_free_and_incref_of_free():
    bm = BlockManager(4, 16)
    blocks = bm.allocate(2)
    bm.free(blocks)
    with pytest.raises(ValueError, match="double free"):
        bm.free(blocks)
    with pytest.raises(ValueError, match="free block"):
        bm.incref(blocks)
    with pytest.raises(NoFreeBlocks):
        bm.allocate(5)
    assert bm.num_free == 4
    assert bm.allocate(4) == [2, 3, 0, 1]  # freed blocks go to the back (in order): fresh ones are used first


# ---- LLMEngine leaves every block free ---------------------------------------------------------


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner(PRESETS["tiny"], CacheConfig(block_size=4, num_blocks=40, kv_dtype="fp8"), "fp8")


def _seq(i: int, n: int, max_tokens: int = 6) -> Sequence:
    g = torch.Generator().manual_seed(i)
    return Sequence(
        f"q{i}",
        torch.randint(0, 256, (n,), generator=g).tolist(),
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )


def _drain(engine: LLMEngine, limit: int = 500) -> None:
    for _ in range(limit):
        if not engine.has_work:
            return
        engine.step()
    raise AssertionError("engine did not finish")


@pytest.mark.parametrize("chunk_size", [None, 5])
def test_engine_frees_all_blocks_when_requests_finish(runner, chunk_size):
    # 6 requests grow to 270 tokens in all, 40 blocks of 4 (160 tokens) in the pool: blocks are
    # given on demand, and sequences are preempted (recomputed) when a step needs one and none is free
    engine = LLMEngine(runner, chunk_size=chunk_size)
    shapes = [(20, 4), (60, 50), (30, 45), (3, 20), (17, 3), (9, 9)]
    seqs = [_seq(i, n, max_tokens=m) for i, (n, m) in enumerate(shapes)]
    for s in seqs:
        engine.add_request(s)
    while engine.has_work:
        engine.step()
        engine.blocks.check()
    assert engine.preemptions > 0 and engine.blocks.check().in_use == 0
    assert all(s.status == Status.FINISHED and s.finish_reason == "length" and not s.block_table for s in seqs)
    assert [len(s.output_ids) for s in seqs] == [m for _, m in shapes]


def test_engine_aborts_free_blocks(runner):
    engine = LLMEngine(runner, chunk_size=4)
    a, b, c, d = _seq(1, 12), _seq(2, 30), _seq(3, 8, max_tokens=30), _seq(4, 5)
    for s in (a, b, c, d):
        engine.add_request(s)
    engine.step()  # a's first chunk (4 of 12 tokens): a is waiting, with the blocks of that chunk
    assert a.status == Status.WAITING and len(a.block_table) == 1 and engine.blocks.num_used == 1
    assert engine.abort("q1")  # waiting, mid-prefill
    assert engine.abort("q4")  # waiting, never scheduled
    assert engine.blocks.num_used == 0
    while c.status != Status.RUNNING:
        engine.step()
    assert engine.abort("q3")  # running (decoding)
    assert not engine.abort("q3") and not engine.abort("nope")  # unknown ids: False, nothing freed twice
    _drain(engine)
    assert b.finish_reason == "length" and engine.blocks.check().in_use == 0
    assert [s.finish_reason for s in (a, c, d)] == ["abort"] * 3


def test_prefill_only_engine_parks_then_releases(runner):
    engine = LLMEngine(runner, chunk_size=8, prefill_only=True)
    seqs = [_seq(10 + i, n) for i, n in enumerate((21, 4, 9))]
    for s in seqs:
        engine.add_request(s)
    _drain(engine)
    # parked: first token sampled, the prompt's KV held until release (decode caches the first token)
    assert sorted(engine.parked) == ["q10", "q11", "q12"] and all(len(s.output_ids) == 1 for s in seqs)
    assert engine.blocks.num_used == sum(engine.blocks.blocks_for(len(s.prompt_ids)) for s in seqs)
    assert engine.release("q10")
    assert engine.abort("q11")  # abort reaches parked sequences too
    assert not engine.release("q10")
    assert engine.release("q12")
    assert engine.blocks.check().in_use == 0 and not engine.parked


def test_request_larger_than_pool_is_rejected_not_queued(runner):
    engine = LLMEngine(runner)
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request(_seq(0, 150, max_tokens=20))  # 43 blocks of 4 > 40
    assert not engine.has_work and engine.blocks.num_free == engine.blocks.num_blocks
