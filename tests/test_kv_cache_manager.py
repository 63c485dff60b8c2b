"""The KV cache manager: blocks on demand, recompute preemption, automatic prefix caching.

Oracles: greedy tokens equal a roomy pool without caching (in one pool and across a prefill and
a decode pool, whatever was cached or preempted); the block ledger (every block free, cached or
in use, exactly once) after every finish, abort and preemption, with nothing left in use.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.config import PRESETS, CacheConfig
from engine.core.llm_engine import LLMEngine
from engine.kv.block_manager import BlockManager, NoFreeBlocks
from engine.kv.prefix_cache import block_hashes
from engine.runner.model_runner import ModelRunner
from engine.sequence import SamplingParams, Sequence, Status

BS = 4


def _ids(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def roomy() -> ModelRunner:
    return ModelRunner(PRESETS["tiny"], CacheConfig(block_size=BS, num_blocks=400, kv_dtype="fp8"), "fp8")


@pytest.fixture(scope="module")
def small() -> ModelRunner:
    # 40 blocks of 4 = 160 tokens: the workload below needs ~300 at once
    return ModelRunner(PRESETS["tiny"], CacheConfig(block_size=BS, num_blocks=40, kv_dtype="fp8"), "fp8")


SYSTEM = _ids(99, 22)  # a shared "system prompt" (5 full blocks + 2 tokens)
# (prompt, max_tokens): shared prefixes, one prompt that is a prefix of another, a block-aligned one
WORKLOAD = [
    (SYSTEM + _ids(1, 9), 30),
    (SYSTEM + _ids(2, 3), 25),
    (_ids(3, 40), 20),
    (SYSTEM + _ids(1, 9) + _ids(4, 6), 28),
    (_ids(5, 16), 30),
    (SYSTEM + _ids(2, 3), 12),
]


def _run(runner: ModelRunner, caching: bool, chunk: int | None, workload=WORKLOAD, ledger_each_step=True):
    engine = LLMEngine(runner, chunk_size=chunk, enable_prefix_caching=caching)
    seqs = [
        Sequence(f"r{i}", list(p), SamplingParams(max_tokens=m, ignore_eos=True)) for i, (p, m) in enumerate(workload)
    ]
    for s in seqs:
        engine.add_request(s)
    emitted: dict[str, list[int]] = {s.seq_id: [] for s in seqs}
    for _ in range(2000):
        if not engine.has_work:
            break
        for ev in engine.step():
            assert ev.index == len(emitted[ev.seq_id])  # never a token twice, never a gap
            emitted[ev.seq_id].append(ev.token_id)
        if ledger_each_step:
            engine.blocks.check()
    assert not engine.has_work
    ledger = engine.blocks.check()
    assert ledger.in_use == 0, ledger
    assert [emitted[s.seq_id] for s in seqs] == [s.output_ids for s in seqs]
    return engine, seqs


@pytest.fixture(scope="module")
def reference(roomy) -> list[list[int]]:
    _, seqs = _run(roomy, caching=False, chunk=None)
    return [s.output_ids for s in seqs]


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("chunk", [None, 5])
def test_greedy_tokens_equal_under_preemption_and_caching(small, roomy, reference, caching, chunk):
    engine, seqs = _run(small, caching, chunk)
    assert engine.preemptions > 0  # the small pool forced some
    assert [s.output_ids for s in seqs] == reference
    _, roomy_seqs = _run(roomy, caching, chunk)
    assert [s.output_ids for s in roomy_seqs] == reference


def test_prefix_cache_hits_skip_compute(roomy, reference):
    engine = LLMEngine(roomy)
    first = Sequence("a", list(WORKLOAD[0][0]), SamplingParams(max_tokens=30, ignore_eos=True))
    engine.add_request(first)
    while engine.has_work:
        engine.step()
    assert first.output_ids == reference[0] and first.cached_tokens == 0
    # the same prompt again: every full block but the one holding the last prompt token is reused
    # (31 tokens, 7 full blocks; the prompt's and the generated tokens' blocks were cached)
    again = Sequence("b", list(WORKLOAD[0][0]), SamplingParams(max_tokens=30, ignore_eos=True))
    engine.add_request(again)
    engine.step()
    assert again.cached_tokens == 28 and engine.last_step is not None and engine.last_step.prefill_tokens == 3
    while engine.has_work:
        engine.step()
    assert again.output_ids == reference[0]
    # the conversation's next turn: prompt + reply + more, reuses the prompt and the reply
    turn2 = list(WORKLOAD[0][0]) + reference[0] + _ids(7, 5)
    nxt = Sequence("c", turn2, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.add_request(nxt)
    while engine.has_work:
        engine.step()
    assert nxt.cached_tokens == (31 + 29) // BS * BS  # the last reply token was never cached
    assert engine.blocks.check().in_use == 0 and engine.blocks.num_cached > 0


def test_no_prefix_cache_keeps_nothing(roomy):
    engine, seqs = _run(roomy, caching=False, chunk=None)
    assert engine.blocks.num_cached == 0 and all(s.cached_tokens == 0 for s in seqs)
    assert engine.blocks.drain_events() == ([], False)


def test_aborts_everywhere_leave_no_block_in_use(small):
    engine = LLMEngine(small, chunk_size=4)
    seqs = [
        Sequence(f"x{i}", list(p), SamplingParams(max_tokens=m, ignore_eos=True)) for i, (p, m) in enumerate(WORKLOAD)
    ]
    for s in seqs:
        engine.add_request(s)
    aborted = set()
    for step in range(400):
        if not engine.has_work:
            break
        engine.step()
        engine.blocks.check()
        if step % 7 == 3:  # abort whatever is where: running, mid-prefill, waiting after preemption
            victims = [s for s in seqs if s.status != Status.FINISHED and s.seq_id not in aborted]
            if victims:
                v = victims[step % len(victims)]
                assert engine.abort(v.seq_id)
                aborted.add(v.seq_id)
    while engine.has_work:
        engine.step()
    assert aborted and engine.blocks.check().in_use == 0


def test_prefill_pool_computes_only_the_uncached_suffix_and_decode_pulls_only_missing_blocks(small, roomy, reference):
    """Disaggregation at engine level with caching on both sides: the prefill engine reuses its
    cache, the decode engine reuses its own and copies only the blocks it lacks (as the transport
    pull would), and the tokens equal the colocated reference."""
    decode_runner = ModelRunner(PRESETS["tiny"], CacheConfig(block_size=BS, num_blocks=60, kv_dtype="fp8"), "fp8")
    prefill = LLMEngine(roomy, chunk_size=8, prefill_only=True)
    decode = LLMEngine(decode_runner)
    copied, computed = 0, 0
    outputs = []
    for i, (prompt, m) in enumerate(WORKLOAD):
        s = Sequence(f"p{i}", list(prompt), SamplingParams(max_tokens=m, ignore_eos=True))
        prefill.add_request(s)
        while prefill.has_work:
            prefill.step()
            computed += prefill.last_step.prefill_tokens if prefill.last_step else 0
        src = s.block_table[: -(-len(prompt) // BS)]
        dst, hit, hashes = decode.reserve_cached(list(prompt))
        missing = len(src) - len(hit)
        decode_runner.cache.raw[dst[len(hit) :]] = roomy.cache.raw[src[len(hit) :]]
        copied += missing
        moved = Sequence(s.seq_id, list(prompt), s.params, output_ids=list(s.output_ids), block_table=dst)
        moved.block_hashes = hashes
        assert prefill.release(s.seq_id)
        decode.add_prefilled(moved)
        while decode.has_work:
            decode.step()
        outputs.append(moved.output_ids)
        decode.blocks.check()
        prefill.blocks.check()
    assert outputs == reference
    total_prompt = sum(len(p) for p, _ in WORKLOAD)
    total_blocks = sum(-(-len(p) // BS) for p, _ in WORKLOAD)
    assert computed < total_prompt and copied < total_blocks  # repeated prefixes computed and moved once
    assert prefill.blocks.check().in_use == 0 and decode.blocks.check().in_use == 0


# ---- BlockManager alone -------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_block_manager_ledger_under_random_caching_workload(seed):
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=rng.choice([8, 24]), block_size=2)
    owners: dict[int, list[int]] = {}
    texts = [[rng.randrange(3) for _ in range(12)] for _ in range(5)]
    stored: set[int] = set()
    assert bm.drain_events() == ([], False)  # a reader's first drain: events are kept from here on
    for step in range(500):
        op = rng.random()
        if op < 0.5:  # a "sequence": reuse its cached prefix, allocate the rest, commit full blocks
            text = rng.choice(texts)[: rng.randint(1, 12)]
            hashes = block_hashes(text, 2)
            hit = bm.match(hashes)
            need = bm.blocks_for(len(text)) - len(hit)
            if not bm.can_allocate(need + bm.evictable(hit)):
                with pytest.raises(NoFreeBlocks):
                    bm.allocate(bm.num_free + 1)
                continue
            bm.acquire(hit)
            table = hit + bm.allocate(need)
            for b, h in zip(table, hashes):
                bm.commit(b, h)
            owners[step] = table
        elif owners:
            bm.free(owners.pop(rng.choice(list(owners))))
        for stored_now, h in bm.drain_events()[0]:
            (stored.add if stored_now else stored.discard)(h)
        assert stored == set(bm.cached_hashes())  # the events replay to the cache's contents
        ledger = bm.check()
        assert ledger.in_use == len({b for t in owners.values() for b in t})
    for k in list(owners):
        bm.free(owners.pop(k))
    assert bm.check().in_use == 0


def test_cache_events_are_kept_only_once_a_reader_drains():
    bm = BlockManager(num_blocks=8, block_size=2)
    table = bm.allocate(2)
    bm.commit(table[0], 11)
    assert not bm.events  # nobody has read them: nothing is kept (a worker without a reader stays flat)
    events, dropped = bm.drain_events()
    assert events == [] and dropped  # the first reader is told to start from the snapshot
    assert bm.cached_hashes() == [11]
    bm.commit(table[1], 12)
    bm.free(table)
    assert bm.drain_events() == ([(True, 12)], False)
