"""The persistent batch (engine/runner/input_batch.py): per-row state updated from diffs gives the same
step inputs as building them from scratch, through joins, leaves (compaction) and block
boundaries; and a seeded request samples the same tokens alone and inside a batch of 32."""

from __future__ import annotations

import random

import torch

from engine.config import PRESETS, CacheConfig
from engine.core.llm_engine import LLMEngine
from engine.runner.input_batch import InputBatch
from engine.runner.model_runner import ModelRunner
from engine.runner.sampler import sample
from engine.sequence import SamplingParams, Sequence
from tests.helpers import run_to_completion

BS = 4


def _expected(seq: Sequence) -> tuple[int, int, int, list[int]]:
    """(input id, position, slot, blocks) of a running sequence's next decode step, from scratch."""
    pos = seq.num_tokens - 1
    return seq.output_ids[-1], pos, seq.block_table[pos // BS] * BS + pos % BS, seq.block_table[: pos // BS + 1]


def test_rows_follow_joins_leaves_and_block_boundaries():
    rng = random.Random(0)
    batch = InputBatch(max_rows=8, max_blocks_per_row=16, block_size=BS, device=torch.device("cpu"))
    free = list(range(200))
    rng.shuffle(free)  # scattered, out-of-order block ids
    live: list[Sequence] = []
    for step in range(60):
        if len(live) < 8 and rng.random() < 0.3:  # a sequence joins with a prompt of any length
            prompt = [rng.randrange(300) for _ in range(rng.randrange(1, 11))]
            seq = Sequence(
                f"s{step}", prompt, output_ids=[rng.randrange(300)], block_table=[free.pop() for _ in range(12)]
            )
            batch.add(seq)
            live.append(seq)
        full = [s for s in live if s.num_tokens >= 12 * BS]  # its 12 blocks are used up
        if live and (full or rng.random() < 0.2):  # a row leaves: the last row fills its place
            gone = full[0] if full else live[rng.randrange(len(live))]
            live.remove(gone)
            batch.remove(gone)
            free.extend(gone.block_table)
        if not live:
            continue
        assert sorted(s.seq_id for s in batch.seqs) == sorted(s.seq_id for s in live)
        x = batch.prepare()
        for r, seq in enumerate(batch.seqs):
            tok, pos, slot, blocks = _expected(seq)
            assert (int(x.input_ids[r]), int(x.positions[r]), int(x.slots[r])) == (tok, pos, slot)
            assert x.block_tables[r, : len(blocks)].tolist() == blocks  # appended exactly at the boundary
            assert int(batch.num_blocks[r]) == len(blocks)
            assert int(x.context_lens[r]) == pos + 1
        sampled = torch.randint(0, 300, (len(batch),))
        batch.advance(sampled)
        for seq, tok in zip(batch.seqs, sampled.tolist()):
            seq.output_ids.append(tok)


def test_top_k_keeps_exactly_the_k_most_likely():
    logits = torch.tensor([[3.0, 2.9, 2.8, -1.0, 0.0]])
    drawn = {sample(logits, [SamplingParams(temperature=1.0, top_k=2, seed=s)], [0])[0] for s in range(200)}
    assert drawn == {0, 1}


def test_seeded_request_same_tokens_alone_and_in_a_batch_of_32():
    runner = ModelRunner(PRESETS["tiny"], CacheConfig(block_size=16, num_blocks=160, kv_dtype="fp8"), "fp8")
    probe = [
        SamplingParams(max_tokens=12, temperature=0.9, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=1.3, top_p=0.8, top_k=20, seed=12, ignore_eos=True),
    ]

    def run(params: list[SamplingParams], prompts: list[list[int]]) -> list[list[int]]:
        engine = LLMEngine(runner, max_num_seqs=64)
        return run_to_completion(engine, [Sequence(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))])

    g = torch.Generator().manual_seed(5)
    prompt = lambda n: torch.randint(0, 320, (n,), generator=g).tolist()  # noqa: E731
    probe_prompts = [prompt(21), prompt(7)]
    alone = [run([p], [q])[0] for p, q in zip(probe, probe_prompts)]
    # 30 other rows: greedy, unseeded random and other seeds, different lengths (so rows finish,
    # compact and the probes move rows) around the two probes
    others = [
        SamplingParams(
            max_tokens=3 + i % 9, temperature=(i % 3) * 0.7, seed=None if i % 2 else 100 + i, ignore_eos=True
        )
        for i in range(30)
    ]
    params = others[:13] + [probe[0]] + others[13:27] + [probe[1]] + others[27:]
    prompts = [prompt(3 + i % 17) for i in range(13)] + [probe_prompts[0]]
    prompts += [prompt(3 + i % 17) for i in range(14)] + [probe_prompts[1]] + [prompt(5) for _ in range(3)]
    batched = run(params, prompts)
    assert len(params) == 32
    assert [batched[13], batched[28]] == alone
    # and they sampled: not the greedy continuation
    greedy = run([SamplingParams(max_tokens=12, ignore_eos=True)], [probe_prompts[0]])[0]
    assert alone[0] != greedy


def test_rows_stay_in_sync_with_blocks_on_demand_preemption_and_prefix_sharing():
    """Rows take their block ids from the sequence at every (re)join: a row may join before its
    next token's block exists (blocks on demand; `prepare` appends it once the engine grew the
    table), a preempted sequence rejoins with a new table (partly shared from the prefix cache)."""
    runner = ModelRunner(PRESETS["tiny"], CacheConfig(block_size=BS, num_blocks=40, kv_dtype="fp8"), "fp8")
    g = torch.Generator().manual_seed(3)
    system = torch.randint(0, 256, (22,), generator=g).tolist()
    engine = LLMEngine(runner, chunk_size=5)
    seqs = [
        Sequence(
            f"r{i}",
            system + torch.randint(0, 256, (3 + 4 * i,), generator=g).tolist(),
            SamplingParams(max_tokens=30, ignore_eos=True),
        )
        for i in range(6)
    ]
    for s in seqs:
        engine.add_request(s)
    rejoined = 0
    while engine.has_work:
        engine.step()
        engine._grow_running()  # what the next step() does first (may preempt); idempotent there
        b = engine.batch
        x = b.prepare() if len(b) else None  # the next step's inputs
        for r, seq in enumerate(b.seqs):
            nb = int(b.num_blocks[r])
            assert b.block_tables[r, :nb].tolist() == seq.block_table[:nb]
            assert int(b.lens[r]) == seq.num_tokens - 1 and int(b.next_ids[r]) == seq.output_ids[-1]
            rejoined += seq.preemptions > 0
            if x is not None and nb * BS > seq.num_tokens - 1:
                pos = seq.num_tokens - 1
                assert int(x.slots[r]) == seq.block_table[pos // BS] * BS + pos % BS
        engine.blocks.check()
    assert engine.preemptions > 0 and rejoined > 0
    assert engine.blocks.check().in_use == 0


def test_batch_grows_past_max_rows_and_joins_without_the_next_block():
    batch = InputBatch(max_rows=2, max_blocks_per_row=8, block_size=BS, device=torch.device("cpu"))
    # 8 tokens cached (2 full blocks), the next token needs a 3rd block the table lacks yet
    seqs = [Sequence(f"s{i}", list(range(8)), output_ids=[7], block_table=[10 * i, 10 * i + 1]) for i in range(5)]
    for s in seqs:
        batch.add(s)
    assert batch.max_rows >= 5 and [s.seq_id for s in batch.seqs] == [s.seq_id for s in seqs]
    for i, s in enumerate(seqs):
        s.block_table.append(10 * i + 2)  # the engine grows the table before the step
    x = batch.prepare()
    assert x.slots.tolist() == [(10 * i + 2) * BS for i in range(5)]
    assert x.block_tables.tolist() == [[10 * i, 10 * i + 1, 10 * i + 2] for i in range(5)]
