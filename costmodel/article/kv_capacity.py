"""The article's KV arithmetic applied to one KV pool: how many sequences it holds (arithmetic,
not a measurement; `pdserve bench kvcache --part capacity` puts the measured figure beside it).

The article charges every sequence its *real* context: a decode step at batch b reads
b * KV * ctx bytes (KV = 2 * L * KVH * HD bytes per token in FP8), and the 32 decode sequences of
its capacity table each hold ctx = 4,096 tokens. By that accounting a pool of P tokens holds
P / context sequences. What differs between the two admission policies is the context charged:

- reserved up front (the policy on-demand blocks are measured against): the budget, prompt +
  max_tokens, from the first step;
- on demand: what a running sequence really holds, prompt + the tokens generated so far. Averaged
  over running time, a sequence of n output tokens holds prompt + (n + 1) / 2 on average and runs
  n steps, so longer outputs weigh more (`mean_held_context`).

Both are given in tokens (the article has no blocks) and in whole blocks of the pool (a sequence
holds ceil(tokens / block_size) blocks), the granularity pdserve allocates in.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from costmodel.article.cost_model import HardwareSpec, ModelSpec, kv_bytes_per_token, weight_bytes


def mean_held_context(prompt_len: int, output_lens: Sequence[int]) -> float:
    """Mean tokens of KV a running sequence holds, over every step any sequence runs: the step
    that emits a sequence's k-th token (k = 1..n) holds prompt + k tokens."""
    steps = sum(output_lens)
    held = sum(n * prompt_len + n * (n + 1) / 2 for n in output_lens)
    return held / steps


def mean_held_blocks(prompt_len: int, output_lens: Sequence[int], block_size: int) -> float:
    """As `mean_held_context`, in whole blocks: ceil((prompt + k) / block_size) at its k-th token."""
    steps = sum(output_lens)
    held = sum(math.ceil((prompt_len + k) / block_size) for n in output_lens for k in range(1, n + 1))
    return held / steps


@dataclass(frozen=True)
class PoolCapacity:
    """Sequences one pool holds by the article's accounting, reserved vs on demand."""

    kv_bytes_per_token: int
    pool_tokens: int
    pool_bytes: int
    reserved_context: int  # tokens charged per sequence: prompt + max_tokens
    on_demand_context: float  # tokens really held, mean over running steps
    reserved_sequences: float  # pool_tokens / reserved_context
    on_demand_sequences: float  # pool_tokens / on_demand_context
    reserved_sequences_blocks: int  # whole sequences whose whole-block budgets fit the pool
    on_demand_sequences_blocks: float  # num_blocks / mean blocks held

    @property
    def ratio(self) -> float:
        return self.on_demand_sequences / self.reserved_sequences

    @property
    def ratio_blocks(self) -> float:
        return self.on_demand_sequences_blocks / max(1, self.reserved_sequences_blocks)


def pool_capacity(
    model: ModelSpec,
    num_blocks: int,
    block_size: int,
    prompt_len: int,
    max_tokens: int,
    output_lens: Sequence[int],
    kv_dtype: str = "fp8",
) -> PoolCapacity:
    kvb = kv_bytes_per_token(model, kv_dtype)
    tokens = num_blocks * block_size
    budget = prompt_len + max_tokens
    held = mean_held_context(prompt_len, output_lens)
    return PoolCapacity(
        kv_bytes_per_token=kvb,
        pool_tokens=tokens,
        pool_bytes=tokens * kvb,
        reserved_context=budget,
        on_demand_context=held,
        reserved_sequences=tokens / budget,
        on_demand_sequences=tokens / held,
        reserved_sequences_blocks=num_blocks // math.ceil(budget / block_size),
        on_demand_sequences_blocks=num_blocks / mean_held_blocks(prompt_len, output_lens, block_size),
    )


@dataclass(frozen=True)
class ArticleBatchKV:
    """The KV behind the article's capacity table: `batch` decode sequences of `ctx` real tokens."""

    kv_bytes_per_sequence: int
    batch_kv_bytes: int
    weight_bytes: float
    hbm_bytes: float

    @property
    def fits_one_gpu(self) -> bool:
        return self.weight_bytes + self.batch_kv_bytes <= self.hbm_bytes


def article_batch_kv(
    model: ModelSpec, hw: HardwareSpec, batch: int = 32, ctx: int = 4096, kv_dtype: str = "fp8"
) -> ArticleBatchKV:
    per_seq = kv_bytes_per_token(model, kv_dtype) * ctx
    return ArticleBatchKV(per_seq, per_seq * batch, weight_bytes(model, "fp8"), hw.mem_bytes)
