"""The GPU path, checked two ways.

On any machine: the Triton paged-decode kernel and CudaAttention run under the Triton
interpreter (TRITON_INTERPRET=1, in a subprocess, because the variable must be set before triton
is first imported) against TorchReferenceAttention: FP8 and fp32 pages, GQA, partial blocks,
shuffled (non-contiguous) block tables, several splits, and a mixed prefill/chunk/decode batch.

With CUDA: the same kernel natively, `_scaled_mm` against the dequantized weight, CUDA-graph
replay against the eager step, and green-context disaggregation against colocated greedy tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from engine.config import PRESETS, CacheConfig
from engine.kv.cache import KVCache
from engine.kv.layout import KVLayout
from engine.model.attention import AttentionMetadata, TorchReferenceAttention
from tests.helpers import attention_shapes

GQA_CFG = attention_shapes("gqa", hidden=256, heads=8, kv_heads=2, head_dim=32)
CONTEXTS = [1, 15, 16, 17, 70]  # one token, partial block, exact block, one past, several blocks
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def decode_case(kv_dtype: str, device: str, dtype: torch.dtype, seed: int = 0):
    """A pool with history for each context length, block tables drawn from a shuffled pool,
    and the step's new q/k/v. Returns (cache, q, k, v, meta)."""
    g = torch.Generator().manual_seed(seed)
    bs, nb = 16, 48
    cache = KVCache(KVLayout.build(GQA_CFG, CacheConfig(block_size=bs, num_blocks=nb, kv_dtype=kv_dtype)), device)
    perm = torch.randperm(nb, generator=g).tolist()
    tables, used = [], 0
    for c in CONTEXTS:
        n = -(-c // bs)
        tables.append(perm[used : used + n])
        used += n
    bt = torch.zeros(len(CONTEXTS), max(map(len, tables)), dtype=torch.long)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t)
    H, D = GQA_CFG.num_kv_heads, GQA_CFG.head_dim
    for layer in range(GQA_CFG.num_layers):
        for i, c in enumerate(CONTEXTS):
            if c > 1:
                slots = torch.tensor([tables[i][p // bs] * bs + p % bs for p in range(c - 1)], device=device)
                cache.write(
                    layer,
                    slots,
                    torch.randn(c - 1, H, D, generator=g).to(device, dtype),
                    torch.randn(c - 1, H, D, generator=g).to(device, dtype),
                )
    B = len(CONTEXTS)
    q = torch.randn(B, GQA_CFG.num_heads, D, generator=g).to(device, dtype)
    k = torch.randn(B, H, D, generator=g).to(device, dtype)
    v = torch.randn(B, H, D, generator=g).to(device, dtype)
    slots = torch.tensor([tables[i][(c - 1) // bs] * bs + (c - 1) % bs for i, c in enumerate(CONTEXTS)], device=device)
    meta = AttentionMetadata(
        slots, [1] * B, list(CONTEXTS), bt.to(device), torch.tensor(CONTEXTS, dtype=torch.int32, device=device)
    )
    return cache, q, k, v, meta


def _interpreter_checks() -> dict:
    """Runs inside the TRITON_INTERPRET=1 subprocess; returns max abs errors."""
    from engine.gpu.attention import CudaAttention  # noqa: PLC0415
    from engine.gpu.paged_decode import paged_decode  # noqa: PLC0415
    from engine.runner.model_runner import ModelRunner, StepItem  # noqa: PLC0415

    errors: dict = {}
    scale = GQA_CFG.head_dim**-0.5
    for kv_dtype in ("fp8", "fp32"):
        cache, q, k, v, meta = decode_case(kv_dtype, "cpu", torch.float32)
        ref = TorchReferenceAttention().forward(1, q, k, v, cache, meta, scale)
        for splits in (1, 3):
            out = paged_decode(q, cache, 1, meta.block_tables, meta.context_lens_t, scale, num_splits=splits)
            errors[f"decode_{kv_dtype}_splits{splits}"] = (out - ref).abs().max().item()
    # a whole model: prefill + chunked prefill in one batch, then mixed chunk + decode, then decode
    cfg, cc = PRESETS["tiny"], CacheConfig(block_size=16, num_blocks=32)
    runners = [ModelRunner(cfg, cc, backend=TorchReferenceAttention()), ModelRunner(cfg, cc, backend=CudaAttention())]
    p1, p2 = [(7 * i + 3) % 256 for i in range(37)], [(5 * i + 1) % 256 for i in range(50)]
    t1, t2 = [9, 2, 30, 4], [11, 0, 17, 25]  # shuffled block ids
    steps = [
        [StepItem(p1, 0, t1), StepItem(p2[:20], 0, t2, want_logits=False)],
        [StepItem([5], 37, t1), StepItem(p2[20:], 20, t2)],
        [StepItem([7], 38, t1), StepItem([9], 50, t2)],
    ]
    logits = [[r.forward(s) for s in steps[:1]] for r in runners]
    errors["pool_bytes_equal_after_prefill"] = bool(torch.equal(runners[0].cache.raw, runners[1].cache.raw))
    for r, out in zip(runners, logits):
        out += [r.forward(s) for s in steps[1:]]
    errors["model_steps"] = [(a - b).abs().max().item() for a, b in zip(*logits)]
    return errors


@pytest.mark.slow  # child processes (NIXL peers, a benchmark run): seconds each
def test_paged_decode_and_backend_under_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.test_gpu_kernels", "--interpret"],  # from the repository root: tests.helpers
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    errors = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in ("decode_fp8_splits1", "decode_fp8_splits3", "decode_fp32_splits1", "decode_fp32_splits3"):
        assert errors[name] < 1e-5, errors
    assert errors["pool_bytes_equal_after_prefill"], "CudaAttention wrote different KV bytes than the reference"
    assert errors["model_steps"][0] < 1e-5  # prefill paths: SDPA on read-back K/V, same math
    assert max(errors["model_steps"]) < 1e-3, errors  # decode: online softmax, different rounding order


@cuda
@pytest.mark.parametrize("kv_dtype", ["fp8", "bf16"])
def test_paged_decode_cuda(kv_dtype):
    from engine.gpu.paged_decode import paged_decode  # noqa: PLC0415

    cache, q, k, v, meta = decode_case(kv_dtype, "cuda", torch.bfloat16)
    scale = GQA_CFG.head_dim**-0.5
    ref = TorchReferenceAttention().forward(1, q.float(), k.float(), v.float(), cache, meta, scale)
    for splits in (None, 1, 4):
        out = paged_decode(q, cache, 1, meta.block_tables, meta.context_lens_t, scale, num_splits=splits)
        assert (out.float() - ref).abs().max().item() < 3e-2


@cuda
def test_fp8_linear_scaled_mm_matches_dequantized():
    from engine.model.linear import Fp8Linear  # noqa: PLC0415

    lin = Fp8Linear(512, 384, device="cuda")
    lin.load(torch.randn(384, 512, device="cuda") / 512**0.5)
    x = torch.randn(48, 512, device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ lin.dequantized().t()
    out = lin(x).float()
    assert ((out - ref).norm() / ref.norm()).item() < 0.05  # activation quantized to e4m3: ~2-3% error


@cuda
def test_cuda_graph_decode_matches_eager():
    from engine.gpu.attention import CudaAttention  # noqa: PLC0415
    from engine.gpu.cuda_graphs import DecodeGraphRunner  # noqa: PLC0415
    from engine.runner.model_runner import ModelRunner, StepItem  # noqa: PLC0415

    cc = CacheConfig(block_size=16, num_blocks=64)
    runner = ModelRunner(PRESETS["tiny"], cc, device="cuda", backend=CudaAttention())
    graphs = DecodeGraphRunner(runner, max_context=256, pad_block=63, batch_sizes=(1, 2, 4))
    graphs.capture()
    tables = [[0, 1, 2], [5, 3], [8]]
    prompts = [list(range(40)), list(range(20)), list(range(9))]
    runner.forward([StepItem(p, 0, t) for p, t in zip(prompts, tables)])
    step = [StepItem([p[-1]], len(p), t) for p, t in zip(prompts, tables)]
    before = runner.cache.raw.clone()
    eager = runner.forward(step)
    runner.cache.raw.copy_(before)
    graphed = graphs.forward(step)  # batch 3 replays the batch-4 graph with one padding row
    assert (eager - graphed).abs().max().item() < 1e-2
    assert torch.equal(eager.argmax(-1), graphed.argmax(-1))


@cuda
def test_green_context_disagg_gives_colocated_tokens():
    from engine.core.llm_engine import LLMEngine  # noqa: PLC0415
    from engine.gpu.green_contexts import SingleGpuDisagg, SmPartition, green_contexts_supported, share_model  # noqa: PLC0415,E501
    from engine.runner.model_runner import ModelRunner  # noqa: PLC0415
    from engine.sequence import SamplingParams, Sequence  # noqa: PLC0415

    if not green_contexts_supported():
        pytest.skip("this torch build has no green-context support")
    cc = CacheConfig(block_size=16, num_blocks=64)
    runner = ModelRunner(PRESETS["tiny"], cc, device="cuda")
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    prompts = [list(range(i, i + 30 + 7 * i)) for i in range(4)]
    colo = LLMEngine(share_model(runner, cc))
    for i, p in enumerate(prompts):
        colo.add_request(Sequence(str(i), p, params))
    want: dict[str, list[int]] = {}
    while colo.has_work:
        for ev in colo.step():
            want.setdefault(ev.seq_id, []).append(ev.token_id)
    got: dict[str, list[int]] = {}
    part = SmPartition.create(decode_sms=32)
    d = SingleGpuDisagg(
        LLMEngine(share_model(runner, cc), prefill_only=True),
        LLMEngine(share_model(runner, cc)),
        part,
        on_token=lambda ev: got.setdefault(ev.seq_id, []).append(ev.token_id),
    )
    d.start()
    for i, p in enumerate(prompts):
        d.submit(Sequence(str(i), p, params))
    from tests.helpers import wait_until  # noqa: PLC0415

    try:
        wait_until(lambda: sum(map(len, got.values())) >= 4 * 8, 60, "8 tokens of each stream", interval=0.01)
    finally:
        d.stop()
    assert got == want


if __name__ == "__main__" and sys.argv[1:] == ["--interpret"]:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    print(json.dumps(_interpreter_checks()))


@cuda
def test_serving_engine_replays_decode_graphs_with_eager_tokens():
    """The serving path: an engine with graphs attached (as every decoding worker builds it) gives
    the --enforce-eager engine's greedy tokens, and its decode-only steps replayed graphs."""
    from engine.core.llm_engine import LLMEngine  # noqa: PLC0415
    from engine.gpu.attention import CudaAttention  # noqa: PLC0415
    from engine.gpu.cuda_graphs import attach_decode_graphs  # noqa: PLC0415
    from engine.runner.model_runner import ModelRunner  # noqa: PLC0415
    from engine.sequence import SamplingParams, Sequence  # noqa: PLC0415

    def run(graphs: bool) -> tuple[list[list[int]], int]:
        cc = CacheConfig(block_size=16, num_blocks=128)
        runner = ModelRunner(PRESETS["tiny"], cc, device="cuda", backend=CudaAttention())
        engine = LLMEngine(runner, max_num_seqs=8)
        if graphs:
            attach_decode_graphs(engine)
        seqs = [
            Sequence(f"r{i}", list(range(3 + 7 * i)), SamplingParams(max_tokens=6 + 5 * i, ignore_eos=True))
            for i in range(5)
        ]
        for s in seqs:
            engine.add_request(s)
        while engine.has_work:
            engine.step()
        return [s.output_ids for s in seqs], runner.graph_steps

    eager, eager_replays = run(graphs=False)
    graphed, replays = run(graphs=True)
    assert graphed == eager
    assert eager_replays == 0 and replays > 0


@cuda
def test_device_sampler_seeded_rows_are_batch_independent_on_cuda():
    """Sampling on the GPU: a seeded row draws the same token alone and among 32 rows, and only
    the ids come back."""
    from engine.runner.sampler import Sampler, SamplingRows  # noqa: PLC0415
    from engine.sequence import SamplingParams  # noqa: PLC0415

    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(32, 1000, device="cuda", generator=g) * 3
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=50 * (i % 3), seed=i) for i in range(32)]
    sampler = Sampler("cuda")
    batch = sampler(logits, SamplingRows.build(params, [3] * 32, logits.device))
    assert batch.is_cuda and batch.shape == (32,)
    alone = [int(sampler(logits[i : i + 1], SamplingRows.build([params[i]], [3], logits.device))[0]) for i in range(32)]
    assert batch.tolist() == alone
