"""Equalities the serving system leans on: chunked == whole-prompt prefill, batched == alone,
paged attention == dense attention. The model is the `tiny` preset with its seeded random
weights (scaled for clear greedy margins) on the serving path: FP8 weights and FP8 KV.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import torch_compat
from engine.config import PRESETS, CacheConfig
from engine.core.llm_engine import LLMEngine
from engine.kv.cache import FP8_AS_FP16_SCALE, KVCache, fp8_as_float16, quantize_fp8
from engine.kv.layout import KVLayout
from engine.model.attention import AttentionMetadata, TorchReferenceAttention
from engine.model.cpu_attention import BatchedAttention
from engine.runner.model_runner import ModelRunner, StepItem
from engine.sequence import SamplingParams, Sequence

CFG = PRESETS["tiny"]
PROMPT_LEN = 100
# Chunked vs whole differ only by matmul summation order (and an occasional FP8 KV rounding
# flip that it causes): measured max |diff| <= 1.3e-5 on logits of std ~4 (3e-6 std).
TIGHT = 1e-4
BF16_BOUND = 2e-2  # bf16 GEMMs: measured max |diff| 5.2e-3 of the logits' std (chunks of 1 and 7)


def _ids(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def fp8_runner() -> ModelRunner:
    # fp32 GEMMs: the summation-order bound below is fp32's (bf16 GEMMs: their own test below)
    return ModelRunner(CFG, CacheConfig(block_size=16, num_blocks=96, kv_dtype="fp8"), "fp8", cpu_gemm="fp32")


@pytest.fixture(scope="module")
def fp32_runner() -> ModelRunner:
    return ModelRunner(CFG, CacheConfig(block_size=16, num_blocks=96, kv_dtype="fp32"), "fp32")


def _chunked_logits(runner: ModelRunner, prompt: list[int], chunk: int, table: list[int]) -> torch.Tensor:
    out = None
    for start in range(0, len(prompt), chunk):
        last = start + chunk >= len(prompt)
        out = runner.forward([StepItem(prompt[start : start + chunk], start, table, want_logits=last)])
        assert out.shape[0] == (1 if last else 0)  # non-final chunks return no logits
    return out[0]


@pytest.mark.parametrize("kv", ["fp8", "fp32"])
def test_chunked_prefill_logits_equal_whole_prompt(kv, fp8_runner, fp32_runner):
    runner = fp8_runner if kv == "fp8" else fp32_runner
    prompt = _ids(0, PROMPT_LEN)
    whole = runner.forward([StepItem(prompt, 0, list(range(7)))])[0]
    scale = whole.std().item()
    for i, chunk in enumerate((1, 7, 16, 33, 64)):  # 7 and 33 do not divide 100
        table = list(range(80 - 7 * i, 87 - 7 * i))[::-1]  # a different, reversed run each time
        got = _chunked_logits(runner, prompt, chunk, table)
        assert (got - whole).abs().max().item() <= TIGHT * scale, f"chunk {chunk}"
        assert got.argmax().item() == whole.argmax().item()


@pytest.mark.slow  # bf16 GEMM layouts for every shape: ~5 s, out of the inner loop
@pytest.mark.skipif(not torch_compat.bf16_gemm_works(), reason="no bf16 oneDNN GEMM on this CPU")
def test_chunked_prefill_with_bf16_gemms_stays_within_bf16_rounding():
    """`--cpu-gemm bf16` (the default on CPUs with native bf16): a GEMM row is the same bits in any
    batch (tests/test_linear_buckets.py), but the fp32 summation-order differences of attention
    can flip a projection's bf16-rounded output by one unit (2^-8 relative), so chunked and whole
    prompts agree to bf16 rounding rather than fp32's, and on the greedy token."""
    runner = ModelRunner(CFG, CacheConfig(block_size=16, num_blocks=96, kv_dtype="fp8"), "fp8", cpu_gemm="bf16")
    assert runner.model.cpu_gemm == "bf16"
    prompt = _ids(0, PROMPT_LEN)
    whole = runner.forward([StepItem(prompt, 0, list(range(7)))])[0]
    scale = whole.std().item()
    for i, chunk in enumerate((1, 7, 33)):
        table = list(range(80 - 7 * i, 87 - 7 * i))[::-1]
        got = _chunked_logits(runner, prompt, chunk, table)
        assert (got - whole).abs().max().item() <= BF16_BOUND * scale, f"chunk {chunk}"
        assert got.argmax().item() == whole.argmax().item()


def _generate(
    runner: ModelRunner,
    prompts: list[list[int]],
    chunk_size: int | None = None,
    max_tokens: int = 8,
    arrivals: list[int] | None = None,
) -> list[list[int]]:
    """Greedy outputs through LLMEngine; prompt i is added before step arrivals[i] (default 0)."""
    engine = LLMEngine(runner, chunk_size=chunk_size)
    arrivals = arrivals or [0] * len(prompts)
    seqs = [Sequence(f"r{i}", p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for i, p in enumerate(prompts)]
    step = 0
    while engine.has_work or step <= max(arrivals):
        for s, t in zip(seqs, arrivals):
            if t == step:
                engine.add_request(s)
        engine.step()
        step += 1
    assert engine.blocks.num_free == engine.blocks.num_blocks
    assert all(len(s.output_ids) == max_tokens for s in seqs)
    return [s.output_ids for s in seqs]


def test_chunked_prefill_greedy_tokens_equal_whole_prompt(fp8_runner):
    prompt = _ids(1, PROMPT_LEN)
    whole = _generate(fp8_runner, [prompt])
    for chunk in (1, 7, 16, 33, 64):
        assert _generate(fp8_runner, [prompt], chunk_size=chunk) == whole, f"chunk {chunk}"


def test_mixed_length_batch_equals_each_alone(fp8_runner):
    prompts = [_ids(10 + i, n) for i, n in enumerate((3, 17, 100, 40, 64))]
    alone = [_generate(fp8_runner, [p])[0] for p in prompts]
    assert _generate(fp8_runner, prompts) == alone  # whole prompts batched in one prefill step
    assert _generate(fp8_runner, prompts, chunk_size=16) == alone  # chunks mixed with decodes
    # staggered arrivals: new prompts are prefilled in the same steps as others' decodes
    assert _generate(fp8_runner, prompts, chunk_size=33, arrivals=[0, 1, 1, 4, 6]) == alone


# ---- paged attention == dense attention -------------------------------------------------------

H_Q, H_KV, D, BS = 4, 2, 8, 4


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain causal SDPA over the full K/V: q [qlen, Hq, D] are the LAST qlen positions of k/v [ctx, Hkv, D]."""
    qlen, ctx = q.shape[0], k.shape[0]
    kf = k.transpose(0, 1).repeat_interleave(H_Q // H_KV, dim=0)
    vf = v.transpose(0, 1).repeat_interleave(H_Q // H_KV, dim=0)
    mask = torch.ones(qlen, ctx, dtype=torch.bool).tril(diagonal=ctx - qlen)
    return F.scaled_dot_product_attention(q.transpose(0, 1), kf, vf, attn_mask=mask, scale=scale).transpose(0, 1)


BACKENDS = {
    "reference": TorchReferenceAttention,
    "batched": BatchedAttention,  # decode rows over FP8 pages in the C++ kernel, where built
    "batched-torch": lambda: BatchedAttention(kernel=False),  # the same backend in torch ops only
    "batched-groups-of-2": lambda: BatchedAttention(rows_per_group=2),  # several row groups, the last partial
}


@pytest.mark.parametrize("backend_name", list(BACKENDS))
@pytest.mark.parametrize("kv_dtype", ["fp32", "fp8", "bf16"])
@pytest.mark.parametrize("query_lens", [(1, 1, 1), (1, 5, 3), (4, 1, 1)], ids=["decode", "decode+chunks", "mixed"])
def test_paged_attention_equals_dense(backend_name, kv_dtype, query_lens):
    layout = KVLayout(
        num_layers=2,
        num_kv_heads=H_KV,
        head_dim=D,
        block_size=BS,
        dtype=kv_dtype,
        scale_layout="per_token_head_fp32" if kv_dtype == "fp8" else "none",
        num_blocks=32,
    )
    cache, backend = KVCache(layout), BACKENDS[backend_name]()
    g = torch.Generator().manual_seed(3)
    ctx_lens = [5, 16, 37]
    perm = torch.randperm(32, generator=g).tolist()  # non-contiguous, out-of-order block tables
    tables, used = [], 0
    for n in ctx_lens:
        tables.append(perm[used : used + -(-n // BS)])
        used += len(tables[-1])
    layer, scale = 1, D**-0.5
    full_k = [torch.randn(n, H_KV, D, generator=g) for n in ctx_lens]
    full_v = [torch.randn(n, H_KV, D, generator=g) for n in ctx_lens]
    slots = lambda table, lo, hi: torch.tensor([table[p // BS] * BS + p % BS for p in range(lo, hi)])  # noqa: E731
    # the cached part of each context, written as earlier steps would have
    for t, n, q_n, k, v in zip(tables, ctx_lens, query_lens, full_k, full_v):
        cache.write(layer, slots(t, 0, n - q_n), k[: n - q_n], v[: n - q_n])
    # this step: query_lens[i] new tokens per sequence, flat
    q = torch.randn(sum(query_lens), H_Q, D, generator=g)
    new_k = torch.cat([k[n - q_n :] for k, n, q_n in zip(full_k, ctx_lens, query_lens)])
    new_v = torch.cat([v[n - q_n :] for v, n, q_n in zip(full_v, ctx_lens, query_lens)])
    width = max(map(len, tables))
    meta = AttentionMetadata(
        slot_mapping=torch.cat([slots(t, n - q_n, n) for t, n, q_n in zip(tables, ctx_lens, query_lens)]),
        query_lens=list(query_lens),
        context_lens=ctx_lens,
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        context_lens_t=torch.tensor(ctx_lens, dtype=torch.int32),
    )
    out = backend.forward(layer, q, new_k, new_v, cache, meta, scale)
    start = 0
    for k, v, q_n in zip(full_k, full_v, query_lens):
        if kv_dtype == "fp8":  # dense reference on what FP8 pages can represent
            (kq, ks), (vq, vs) = quantize_fp8(k), quantize_fp8(v)
            k, v = kq.float() * ks[..., None], vq.float() * vs[..., None]
        elif kv_dtype == "bf16":
            k, v = k.bfloat16().float(), v.bfloat16().float()
        ref = _dense(q[start : start + q_n], k, v, scale)
        torch.testing.assert_close(out[start : start + q_n], ref, atol=1e-5, rtol=1e-5)
        start += q_n
    # nothing was written to another layer
    assert cache.data[:, 0].float().abs().sum() == 0


def test_prefill_on_one_pool_decode_on_another_equals_colocated(fp8_runner):
    """The disaggregation contract at engine level: a prefill_only engine parks the prompt's KV,
    its blocks' bytes are copied into blocks reserved on a second pool (as the transport will
    do), and the decode engine continues to the same greedy tokens as the colocated engine."""
    prompts = [_ids(20, 45), _ids(21, 7)]
    colocated = _generate(fp8_runner, prompts)
    decode_runner = ModelRunner(CFG, CacheConfig(block_size=16, num_blocks=32, kv_dtype="fp8"), "fp8")
    prefill = LLMEngine(fp8_runner, chunk_size=16, prefill_only=True)
    decode = LLMEngine(decode_runner)
    seqs = [Sequence(f"d{i}", p, SamplingParams(max_tokens=8, ignore_eos=True)) for i, p in enumerate(prompts)]
    for s in seqs:
        prefill.add_request(s)
    while prefill.has_work:
        prefill.step()
    moved = []
    for s in seqs:
        src = s.block_table[: -(-len(s.prompt_ids) // 16)]
        dst = decode.reserve(len(s.prompt_ids), s.params.max_tokens)
        decode_runner.cache.raw[dst[: len(src)]] = fp8_runner.cache.raw[src]
        moved.append(Sequence(s.seq_id, s.prompt_ids, s.params, output_ids=list(s.output_ids), block_table=dst))
        assert prefill.release(s.seq_id)
        decode.add_prefilled(moved[-1])
    while decode.has_work:
        decode.step()
    assert [s.output_ids for s in moved] == colocated
    assert prefill.blocks.num_free == prefill.blocks.num_blocks and decode.blocks.num_free == decode.blocks.num_blocks


def test_fp8_widening_is_bit_exact():
    """fp8_as_float16 (the batched backend's fast path) times its power-of-two scale equals torch's
    conversion on every finite e4m3 value, subnormals and both zeros included, also when it
    writes into a permuted output."""
    x = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    finite = ~x.float().isnan()
    got, want = (fp8_as_float16(x).float() * FP8_AS_FP16_SCALE)[finite], x.float()[finite]
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    x2 = x.view(16, 16)
    bits = torch.empty(16, 16, dtype=torch.int16)
    fp8_as_float16(x2, out=bits.t())
    assert torch.equal(bits.t().view(torch.float16), fp8_as_float16(x2))


def test_gather_widens_fp8_pages_bit_exactly():
    """A chunk's context (`KVCache.gather`, the chunked-prefill path) widens through the two-byte
    trick on CPU; the dequantized K and V equal torch's float8 conversion times the scales, bit for
    bit, over random values and every e4m3 byte (subnormals included)."""
    layout = KVLayout.build(CFG, CacheConfig(block_size=16, num_blocks=40, kv_dtype="fp8"))
    cache = KVCache(layout)
    H, D = layout.num_kv_heads, layout.head_dim
    n = 40 * 16
    k = torch.randn(n, H, D) * torch.logspace(-4, 2, n)[:, None, None]
    cache.write(0, torch.arange(n), k, -k)
    every_byte = torch.arange(256, dtype=torch.uint8).repeat(16 * H * D // 256 + 1)[: 16 * H * D]
    every_byte[(every_byte & 0x7F) == 0x7F] = 0  # e4m3's NaNs: the pool never holds them (writes clamp)
    cache.data[3, 0, 0] = every_byte.view(torch.float8_e4m3fn).view(16, H, D)
    table = torch.randperm(40)
    for length in (1, 37, 300, n):
        got_k, got_v = cache.gather(0, table, length)
        blocks = table[: -(-length // 16)]
        raw = cache.data[blocks, 0].transpose(0, 1).reshape(2, -1, H, D)[:, :length].float()
        s = cache.scales[blocks, 0].transpose(0, 1).reshape(2, -1, H)[:, :length].unsqueeze(-1)
        want = raw * s
        assert torch.equal(got_k, want[0]) and torch.equal(got_v, want[1]), length


@pytest.mark.parametrize("kv_dtype", ["fp8", "bf16", "fp32"])
def test_write_at_stores_the_bytes_write_does(kv_dtype):
    """The batched backend's write (slot indices once per step, K and V quantized together)
    leaves the pool byte-identical to the per-layer `write`, scales included."""
    layout = KVLayout.build(CFG, CacheConfig(block_size=16, num_blocks=6, kv_dtype=kv_dtype))
    a, b = KVCache(layout), KVCache(layout)
    slots = torch.tensor([0, 17, 18, 95, 40])
    where = b.slot_index(slots)
    gen = torch.Generator().manual_seed(3)
    for layer in range(CFG.num_layers):
        k, v = (torch.randn(5, CFG.num_kv_heads, CFG.head_dim, generator=gen) for _ in range(2))
        a.write(layer, slots, k, v)
        b.write_at(layer, where, k, v)
    assert torch.equal(a.raw, b.raw)


def test_batched_decode_equals_reference_on_the_model(fp8_runner):
    """A decode step of many sequences at different contexts: the batched backend's logits equal
    the per-sequence reference's (same pool, same step) within float rounding."""
    ref = ModelRunner(
        CFG, CacheConfig(block_size=16, num_blocks=96, kv_dtype="fp8"), "fp8", backend=TorchReferenceAttention()
    )
    ref.cache, ref.model = fp8_runner.cache, fp8_runner.model
    lens = [3, 16, 17, 40, 1, 64, 33, 9]
    tables = [list(range(5 * i, 5 * i + 5)) for i in range(len(lens))]
    fp8_runner.forward([StepItem(_ids(40 + i, n), 0, t) for i, (n, t) in enumerate(zip(lens, tables))])
    step = [StepItem([7 + i], n, t) for i, (n, t) in enumerate(zip(lens, tables))]
    want = ref.forward(step)  # writes the same K/V as the batched step below, at the same slots
    got = fp8_runner.forward(step)
    assert (got - want).abs().max().item() <= TIGHT * want.std().item()
    assert torch.equal(got.argmax(-1), want.argmax(-1))
