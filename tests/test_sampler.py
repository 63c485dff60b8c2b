"""Sampler: greedy, temperature and top-p with per-request seeds (step k of a seeded request
draws from a generator seeded by (seed, k), whatever batch it is sampled in)."""

from __future__ import annotations

import pytest
import torch

from engine.config import PRESETS, CacheConfig
from engine.core.llm_engine import LLMEngine
from engine.runner.model_runner import ModelRunner
from engine.runner.sampler import sample
from engine.sequence import SamplingParams, Sequence


def _logits(rows: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 2


def test_temperature_zero_is_argmax():
    logits = _logits(8)
    assert sample(logits, [SamplingParams()] * 8, list(range(8))) == logits.argmax(-1).tolist()


def test_seeded_sampling_is_reproducible_and_batch_independent():
    logits = _logits(6)
    params = [SamplingParams(temperature=0.9, top_p=0.8, seed=s) for s in (1, 2, 3, 4, 5, 6)]
    steps = [0, 3, 1, 7, 2, 5]
    first = sample(logits, params, steps)
    assert sample(logits, params, steps) == first
    # each row alone, and the batch reversed: same tokens
    assert [sample(logits[i : i + 1], [params[i]], [steps[i]])[0] for i in range(6)] == first
    assert sample(logits.flip(0), params[::-1], steps[::-1]) == first[::-1]


def test_seed_and_step_both_change_the_draw():
    row = torch.zeros(1, 100)  # uniform over 100 tokens: a repeated draw is a 1% event
    by_step = [sample(row, [SamplingParams(temperature=1.0, seed=7)], [k])[0] for k in range(20)]
    by_seed = [sample(row, [SamplingParams(temperature=1.0, seed=s)], [0])[0] for s in range(20)]
    assert len(set(by_step)) > 10 and len(set(by_seed)) > 10


def test_tiny_top_p_is_greedy():
    logits = _logits(32, seed=1)
    params = [SamplingParams(temperature=1.5, top_p=1e-6, seed=i) for i in range(32)]
    assert sample(logits, params, [0] * 32) == logits.argmax(-1).tolist()


def test_top_p_keeps_exactly_the_nucleus():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = probs.log()[None]
    # cumulative mass before each token: 0, .4, .7, .9 -> with top_p .6 tokens 0 and 1 remain
    drawn = {sample(logits, [SamplingParams(temperature=1.0, top_p=0.6, seed=s)], [0])[0] for s in range(200)}
    assert drawn == {0, 1}


def test_temperature_sampling_follows_the_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    n, t = 4000, 0.7
    counts = torch.zeros(4)
    for s in range(n):
        counts[sample(logits, [SamplingParams(temperature=t, seed=s)], [0])[0]] += 1
    expected = torch.softmax(logits[0] / t, dim=-1)
    # 4 standard errors of a binomial proportion: a seeded, deterministic check of the law
    se = (expected * (1 - expected) / n).sqrt()
    assert ((counts / n - expected).abs() <= 4 * se + 1e-9).all(), (counts / n, expected)


@pytest.mark.parametrize("temperature,top_p", [(0.8, 1.0), (1.2, 0.9)])
def test_seeded_request_same_tokens_alone_or_batched(temperature, top_p):
    runner = ModelRunner(PRESETS["tiny"], CacheConfig(block_size=16, num_blocks=32, kv_dtype="fp8"), "fp8")

    def run(prompts: list[list[int]], seeds: list[int]) -> list[list[int]]:
        engine = LLMEngine(runner)
        seqs = [
            Sequence(
                f"s{i}",
                p,
                SamplingParams(max_tokens=10, temperature=temperature, top_p=top_p, seed=seed, ignore_eos=True),
            )
            for i, (p, seed) in enumerate(zip(prompts, seeds))
        ]
        for s in seqs:
            engine.add_request(s)
        while engine.has_work:
            engine.step()
        return [s.output_ids for s in seqs]

    prompts = [[5, 6, 7], list(range(40, 80)), [200] * 9]
    seeds = [100, 101, 102]
    batched = run(prompts, seeds)
    assert batched == [run([p], [seed])[0] for p, seed in zip(prompts, seeds)]
    assert batched == run(prompts, seeds)  # and again
    # sampling, not greedy: a 10-token run differs from the argmax run somewhere
    greedy_engine = LLMEngine(runner)
    g = Sequence("g", prompts[1], SamplingParams(max_tokens=10, ignore_eos=True))
    greedy_engine.add_request(g)
    while greedy_engine.has_work:
        greedy_engine.step()
    assert g.output_ids != batched[1]
