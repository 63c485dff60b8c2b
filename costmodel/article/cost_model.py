"""The article's arithmetic as pure functions of (model, hardware, workload). Imports no torch.

Every function follows the article's accounting so its tables come out exactly:

- decode step  = max(memory floor, FLOP time); memory = weights + batch * ctx * KV bytes/token,
  FLOPs = 2 * N * batch (attention FLOPs of decode are ignored, as in the article);
- prefill      = (2 * N * T + 4 * L * H * d_head * T^2) / (MFU * peak): the attention term counts
  the full T x T score matrix (no causal halving), again as the article does;
- a chunk [p, p + c) of a prompt costs prefill(p + c) - prefill(p), so chunks sum to the whole.

The KV transfer is the article's bytes over the link's rate; streamed layer by layer (pdserve's
`--kv-transfer layerwise`) the arithmetic of what is left after the prefill is
`costmodel/article/layerwise.py`'s, fed here with this model's bytes, layers and prefill time.

N is the parameter count of the config (Llama-3.1-70B: 70,553,706,496). The article's script
rounds it to 70.55e9; the tables it prints need the exact count (reads at batch 64: 113.4997 GB
with 70.55e9, 113.503 GB with the config; the article prints 114).

The figures it reads live beside it: the datasheets (GPUs, links, model shapes, the article's
setting) in `costmodel/datasheets.py`, and the calibration file that replaces them with measured
ones in `costmodel/fit/calibration.py`. Their names are re-exported here, so `cm.ModelSpec`,
`cm.Calibration`, `cm.LINKS` read as one vocabulary wherever the cost model is used.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from costmodel import datasheets
from costmodel.article.layerwise import (
    DEFAULT_GROUP_OVERHEAD_S,
    LinkSpec,
    groups_of,
    layerwise_exposed_s,
    layerwise_threshold_tokens,
)
from costmodel.datasheets import *  # noqa: F403 - re-exported whole (its __all__), one vocabulary
from costmodel.datasheets import ARTICLE_MFU, HardwareSpec, Link, ModelSpec
from costmodel.fit.calibration import Calibration
from engine.config import KV_DTYPE_BYTES

DTYPE_BYTES = {"fp8": 1, "bf16": 2, "fp16": 2, "fp32": 4, **KV_DTYPE_BYTES}


def _bytes(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


def kv_bytes_per_token(m: ModelSpec, kv_dtype: str = "fp8") -> int:
    """K and V, every layer, every KV head (FP8 scales not counted, as in the article)."""
    return 2 * m.num_layers * m.num_kv_heads * m.head_dim * _bytes(kv_dtype)


def weight_bytes(m: ModelSpec, weight_dtype: str = "fp8") -> float:
    return m.params * _bytes(weight_dtype)


@dataclass(frozen=True)
class DecodeStep:
    batch: int
    ctx: float
    read_bytes: float
    memory_s: float
    flop_s: float
    time_s: float
    per_seq_tok_s: float
    tok_s: float


def decode_step(
    m: ModelSpec,
    hw: HardwareSpec,
    batch: int,
    ctx: float,
    mfu: float = ARTICLE_MFU,
    weight_dtype: str = "fp8",
    kv_dtype: str = "fp8",
) -> DecodeStep:
    """One decode step of `batch` sequences at mean context `ctx`."""
    return decode_step_tokens(m, hw, batch, batch * ctx, mfu, weight_dtype, kv_dtype)


def decode_step_tokens(
    m: ModelSpec,
    hw: HardwareSpec,
    batch: int,
    kv_tokens: float,
    mfu: float = ARTICLE_MFU,
    weight_dtype: str = "fp8",
    kv_dtype: str = "fp8",
) -> DecodeStep:
    """One decode step whose sequences hold `kv_tokens` cached tokens in total (the simulator's form)."""
    if batch < 1:
        raise ValueError("batch must be >= 1")
    read = weight_bytes(m, weight_dtype) + kv_tokens * kv_bytes_per_token(m, kv_dtype)
    mem_s = read / hw.mem_bw
    flop_s = 2 * m.params * batch / (mfu * hw.peak(weight_dtype))
    t = max(mem_s, flop_s) + hw.step_overhead_s
    return DecodeStep(batch, kv_tokens / batch, read, mem_s, flop_s, t, 1 / t, batch / t)


def prefill_flops(m: ModelSpec, tokens: float) -> tuple[float, float]:
    """(linear, attention) FLOPs of a `tokens`-long prompt."""
    linear = 2 * m.params * tokens
    attention = 4 * m.num_layers * m.num_heads * m.head_dim * tokens * tokens
    return linear, attention


@dataclass(frozen=True)
class Prefill:
    tokens: int
    linear_flops: float
    attention_flops: float
    attention_share: float
    time_s: float


def prefill(
    m: ModelSpec, hw: HardwareSpec, tokens: int, mfu: float = ARTICLE_MFU, weight_dtype: str = "fp8"
) -> Prefill:
    lin, att = prefill_flops(m, tokens)
    t = (lin + att) / (mfu * hw.peak(weight_dtype)) + hw.prefill_overhead_s
    return Prefill(tokens, lin, att, att / (lin + att), t)


def prefill_chunk_seconds(
    m: ModelSpec, hw: HardwareSpec, start: int, chunk: int, mfu: float = ARTICLE_MFU, weight_dtype: str = "fp8"
) -> float:
    """Prompt tokens [start, start + chunk) after `start` are cached: prefill(end) - prefill(start)."""
    a, b = sum(prefill_flops(m, start)), sum(prefill_flops(m, start + chunk))
    return (b - a) / (mfu * hw.peak(weight_dtype)) + hw.prefill_overhead_s


def crossover_batch(
    m: ModelSpec,
    hw: HardwareSpec,
    ctx: float,
    mfu: float = ARTICLE_MFU,
    weight_dtype: str = "fp8",
    kv_dtype: str = "fp8",
) -> float:
    """Batch where the decode step turns compute-bound at context `ctx`; inf if it never does."""
    w_s = weight_bytes(m, weight_dtype) / hw.mem_bw
    per_seq_mem = ctx * kv_bytes_per_token(m, kv_dtype) / hw.mem_bw
    per_seq_flop = 2 * m.params / (mfu * hw.peak(weight_dtype))
    return math.inf if per_seq_flop <= per_seq_mem else w_s / (per_seq_flop - per_seq_mem)


def break_even_chunk(
    m: ModelSpec,
    hw: HardwareSpec,
    batch: int = 1,
    ctx: float = 4096,
    mfu: float = ARTICLE_MFU,
    weight_dtype: str = "fp8",
    kv_dtype: str = "fp8",
) -> float:
    """Chunk length whose prefill takes exactly one decode step (batch 1 by default, as the article).

    Solves 2 N c + 4 L H d c^2 = step * MFU * peak; the article drops the (0.2%) quadratic term.
    """
    step = decode_step(m, hw, batch, ctx, mfu, weight_dtype, kv_dtype).time_s - hw.prefill_overhead_s
    budget = max(step, 0.0) * mfu * hw.peak(weight_dtype)
    a = 4 * m.num_layers * m.num_heads * m.head_dim
    b = 2 * m.params
    return (-b + math.sqrt(b * b + 4 * a * budget)) / (2 * a)


def prefill_equivalent_tokens(
    m: ModelSpec,
    hw: HardwareSpec,
    tokens: int,
    batch: int = 32,
    ctx: float = 4096,
    mfu: float = ARTICLE_MFU,
    weight_dtype: str = "fp8",
    kv_dtype: str = "fp8",
) -> float:
    """A `tokens` prompt's prefill time, in generated tokens of a batch-`batch` decode."""
    step = decode_step(m, hw, batch, ctx, mfu, weight_dtype, kv_dtype).time_s
    return prefill(m, hw, tokens, mfu, weight_dtype).time_s / step * batch


@dataclass(frozen=True)
class ChunkRow:
    chunk: int
    time_s: float
    decode_steps: float


def chunk_row(
    m: ModelSpec,
    hw: HardwareSpec,
    chunk: int,
    batch: int = 1,
    ctx: float = 4096,
    mfu: float = ARTICLE_MFU,
    weight_dtype: str = "fp8",
    kv_dtype: str = "fp8",
) -> ChunkRow:
    """A first chunk of `chunk` tokens, in decode steps at `batch` (1 in the article's table)."""
    t = prefill(m, hw, chunk, mfu, weight_dtype).time_s
    return ChunkRow(chunk, t, t / decode_step(m, hw, batch, ctx, mfu, weight_dtype, kv_dtype).time_s)


@dataclass(frozen=True)
class CapacityRow:
    prefills_per_s: float
    gpu_share: float
    decode_sequences: float
    per_seq_tok_s: float


def capacity_table(
    m: ModelSpec,
    hw: HardwareSpec,
    rates: Iterable[float],
    prompt: int = 4096,
    batch: int = 32,
    ctx: float = 4096,
    mfu: float = ARTICLE_MFU,
    weight_dtype: str = "fp8",
    kv_dtype: str = "fp8",
) -> list[CapacityRow]:
    """One GPU-second per second: prefills take their share, decode at `batch` gets the rest.

    The sequences that still fit are the decode tokens/s left, divided by the per-sequence speed
    of a batch-`batch` step, i.e. batch * (1 - share).
    """
    p = prefill(m, hw, prompt, mfu, weight_dtype).time_s
    step = decode_step(m, hw, batch, ctx, mfu, weight_dtype, kv_dtype)
    rows = []
    for r in rates:
        share = min(1.0, r * p)
        seqs = (1 - share) / (step.time_s / batch) / step.per_seq_tok_s
        rows.append(CapacityRow(r, share, seqs, step.per_seq_tok_s))
    return rows


def transfer_seconds(nbytes: float, link: Link) -> float:
    return nbytes / link.bw


def kv_transfer_seconds(m: ModelSpec, tokens: int, link: Link, kv_dtype: str = "fp8") -> float:
    return transfer_seconds(tokens * kv_bytes_per_token(m, kv_dtype), link)


def stream_link(link: Link, group_overhead_s: float = DEFAULT_GROUP_OVERHEAD_S) -> LinkSpec:
    """`link` as costmodel/article/layerwise.py prices it: its rate, and a fixed cost per pulled group."""
    return LinkSpec(link.bw, group_overhead_s)


# The longest prompt the `auto` threshold is searched up to; past it a link "never" gains.
STREAM_THRESHOLD_MAX_TOKENS = 1 << 20


def layerwise_kv_exposed_seconds(
    m: ModelSpec,
    hw: HardwareSpec,
    tokens: int,
    link: Link,
    layers_per_group: int = 1,
    mfu: float = ARTICLE_MFU,
    weight_dtype: str = "fp8",
    kv_dtype: str = "fp8",
    group_overhead_s: float = DEFAULT_GROUP_OVERHEAD_S,
) -> float:
    """A `tokens` prompt's KV transfer left after its prefill when streamed `layers_per_group`
    layers at a time, its prefill priced by this cost model."""
    return layerwise_exposed_s(
        tokens * kv_bytes_per_token(m, kv_dtype),
        prefill(m, hw, tokens, mfu, weight_dtype).time_s,
        groups_of(m.num_layers, layers_per_group),
        stream_link(link, group_overhead_s),
    )


def layerwise_threshold(
    m: ModelSpec,
    hw: HardwareSpec,
    link: Link,
    layers_per_group: int = 1,
    at_tokens: int = 4096,
    mfu: float = ARTICLE_MFU,
    weight_dtype: str = "fp8",
    kv_dtype: str = "fp8",
    group_overhead_s: float = DEFAULT_GROUP_OVERHEAD_S,
) -> int | None:
    """The shortest prompt `--kv-transfer auto` streams on `link`; None when none up to
    STREAM_THRESHOLD_MAX_TOKENS gains. The prefill's time per token is taken at `at_tokens`, as
    the router measures it: an average over the prompts it has served."""
    per_token = prefill(m, hw, at_tokens, mfu, weight_dtype).time_s / at_tokens
    n = layerwise_threshold_tokens(
        kv_bytes_per_token(m, kv_dtype),
        per_token,
        groups_of(m.num_layers, layers_per_group),
        stream_link(link, group_overhead_s),
        max_tokens=STREAM_THRESHOLD_MAX_TOKENS,
    )
    return None if n >= STREAM_THRESHOLD_MAX_TOKENS else n


__all__ = [
    *datasheets.__all__,
    "Calibration",
    "kv_bytes_per_token",
    "weight_bytes",
    "DecodeStep",
    "decode_step",
    "decode_step_tokens",
    "prefill_flops",
    "Prefill",
    "prefill",
    "prefill_chunk_seconds",
    "crossover_batch",
    "break_even_chunk",
    "prefill_equivalent_tokens",
    "ChunkRow",
    "chunk_row",
    "CapacityRow",
    "capacity_table",
    "transfer_seconds",
    "kv_transfer_seconds",
    "stream_link",
    "STREAM_THRESHOLD_MAX_TOKENS",
    "layerwise_kv_exposed_seconds",
    "layerwise_threshold",
]
