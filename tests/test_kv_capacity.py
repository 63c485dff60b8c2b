"""The article's KV accounting applied to a pool (costmodel/article/kv_capacity.py), and the capacity
benchmark's reserved policy against it: reserving prompt + max_tokens must hold exactly the
whole-block arithmetic's number of sequences while requests wait."""

from __future__ import annotations

import math

import pytest

from benchmarks.engine.kvcache import CapacityConfig, draw_requests, predicted_pool, run_capacity
from costmodel.article import cost_model as cm
from costmodel.article import kv_capacity as kv
from engine.config import PRESETS


def test_mean_held_context_weighs_each_running_step():
    # outputs of 1 and 3 tokens after a 10-token prompt: steps hold 11 | 11, 12, 13 tokens
    assert kv.mean_held_context(10, [1, 3]) == pytest.approx((11 + 11 + 12 + 13) / 4)
    # in blocks of 8: 2 | 2, 2, 2
    assert kv.mean_held_blocks(10, [1, 3], 8) == pytest.approx(2.0)


def test_pool_capacity_reserved_vs_on_demand():
    tiny = cm.ModelSpec.from_config(PRESETS["tiny"])
    pool = kv.pool_capacity(tiny, num_blocks=512, block_size=16, prompt_len=64, max_tokens=1024, output_lens=[200])
    assert pool.kv_bytes_per_token == cm.kv_bytes_per_token(tiny, "fp8")
    assert pool.pool_tokens == 8192 and pool.pool_bytes == 8192 * pool.kv_bytes_per_token
    assert pool.reserved_context == 1088 and pool.reserved_sequences == pytest.approx(8192 / 1088)
    assert pool.reserved_sequences_blocks == 512 // 68 == 7
    assert pool.on_demand_context == pytest.approx(64 + 201 / 2)
    assert pool.ratio == pytest.approx(1088 / (64 + 100.5))


def test_article_batch_kv_is_the_articles_671_mb_per_sequence():
    b = kv.article_batch_kv(cm.ARTICLE_MODEL, cm.ARTICLE_HW, batch=32, ctx=4096)
    assert b.kv_bytes_per_sequence == 160 * 1024 * 4096  # 160 KiB per token (the article)
    assert b.batch_kv_bytes == 32 * b.kv_bytes_per_sequence


def test_reserved_capacity_run_holds_exactly_the_whole_block_arithmetic():
    cfg = CapacityConfig(num_blocks=30, requests=16, prompt_len=16, max_tokens=64, output_min=8, output_max=16)
    run = run_capacity(cfg, reserve=True)
    pool = predicted_pool(cfg)
    assert pool.reserved_sequences_blocks == 30 // math.ceil(80 / 16) == 6
    assert run["peak_running"] == 6 and run["mean_running_saturated"] == pytest.approx(6.0)
    assert run["tokens_emitted"] == sum(n for _, n in draw_requests(cfg)) and run["preemptions"] == 0
