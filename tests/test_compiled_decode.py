"""The compiled CPU decode step (engine/compiled_decode.py) against the eager one.

Cost: torch.compile of the tiny model's step, two graphs (~10-20 s on the 2-core VM, less when
inductor's cache under /tmp is warm).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from engine.compiled_decode import CompiledDecode, attach_compiled_decode
from engine.config import PRESETS, CacheConfig
from engine.llm_engine import LLMEngine
from engine.model_runner import ModelRunner
from engine.sequence import SamplingParams, Sequence

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None, reason="no C++ compiler: no kernel, no inductor"
)


def _greedy(runner: ModelRunner, prompts: list[list[int]], n: int) -> list[list[int]]:
    engine = LLMEngine(runner, max_num_seqs=len(prompts))
    seqs = [Sequence(f"s{i}", p, SamplingParams(max_tokens=n, ignore_eos=True)) for i, p in enumerate(prompts)]
    for s in seqs:
        engine.add_request(s)
    while engine.has_work:
        engine.step()
    assert engine.blocks.num_free == engine.blocks.num_blocks
    return [s.output_ids for s in seqs]


def test_compiled_decode_equals_eager_with_two_graphs():
    cfg = PRESETS["tiny"]
    runner = ModelRunner(cfg, CacheConfig(block_size=16, num_blocks=64, kv_dtype="fp8"), "fp8", seed=3)
    g = torch.Generator().manual_seed(0)
    # batch 1, then 3 rows of different lengths (tables of 1 to 4 blocks: widths vary per step)
    cases = [
        [torch.randint(0, cfg.vocab_size, (5,), generator=g).tolist()],
        [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (3, 20, 40)],
    ]
    eager = [_greedy(runner, prompts, 24) for prompts in cases]
    graphs = attach_compiled_decode(runner, "default")
    assert isinstance(graphs, CompiledDecode) and graphs.compiles == 2  # batch 1 and batch >= 2, at start
    assert graphs.compile_s > 0
    compiled = [_greedy(runner, prompts, 24) for prompts in cases]
    assert compiled == eager
    assert runner.graph_steps > 0
    assert graphs.compiles == 2  # no recompile for new batch sizes or table widths
    graphs.close()


def test_compiled_decode_refuses_what_it_cannot_run():
    cfg = PRESETS["tiny"]
    fp32_kv = ModelRunner(cfg, CacheConfig(block_size=16, num_blocks=8, kv_dtype="fp32"), "fp32")
    with pytest.raises(ValueError, match="FP8 KV"):
        CompiledDecode(fp32_kv)
    with pytest.raises(ValueError, match="compile mode"):
        CompiledDecode(fp32_kv, "fast")
    assert attach_compiled_decode(fp32_kv, "off") is None and fp32_kv.graphs is None
