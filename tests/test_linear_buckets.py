"""GEMM row buckets (engine/model/linear.py `RowBuckets`): a bounded set of oneDNN shapes, same bits.

The buckets exist to bound oneDNN's per-shape primitive caches (issue 22); they are only
acceptable because they change no output: a row of a oneDNN GEMM does not depend on how many
rows share the call. These tests hold that (and the bucket arithmetic) on the machine they run on.
"""

from __future__ import annotations

import pytest
import torch

from engine import torch_compat
from engine.model.linear import PackedWeight, RowBuckets, row_buckets, set_row_buckets

pytestmark = pytest.mark.skipif(
    not torch_compat.ONEDNN_LINEAR, reason="oneDNN's fused linear ops not available in this torch build"
)


@pytest.fixture
def buckets_off():
    saved = row_buckets()
    set_row_buckets(RowBuckets(per_octave=0))
    yield
    set_row_buckets(saved)


def test_bucket_sizes_are_few_and_cover_every_row_count():
    b = RowBuckets(per_octave=4, tile=256)
    sizes = b.sizes()
    assert len(sizes) == 27 and min(sizes) == 2 and max(sizes) == 256
    for n in range(2, 2100):
        calls = b.plan(n)
        assert sum(rows for _, rows, _ in calls) == n  # every row once, in order
        assert [s for s, _, _ in calls] == [sum(r for _, r, _ in calls[:i]) for i in range(len(calls))]
        for _, rows, run in calls:
            assert run in sizes and rows <= run
            assert run - rows < run / 4 or (rows, run) == (1, 2)  # padding < 1/per_octave of the call
    assert RowBuckets(per_octave=0).plan(1485) == [(0, 1485, 1485)]
    with pytest.raises(ValueError):
        RowBuckets(tile=100)


@pytest.mark.parametrize("post", ["none", "silu", "mul", "add"])
def test_bucketed_gemm_is_bit_identical_to_unbucketed(post, buckets_off):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(384, 128, generator=g)
    x = torch.randn(1100, 128, generator=g)
    other = torch.randn(1100, 384, generator=g)
    lengths = [2, 3, 9, 17, 100, 255, 256, 257, 300, 513, 1100]
    plain = PackedWeight()
    want = {n: plain.matmul(x[:n], w, lambda: w, post, other[:n] if post in ("mul", "add") else None) for n in lengths}
    set_row_buckets(RowBuckets(per_octave=4, tile=256))
    bucketed = PackedWeight()
    for n in lengths:
        got = bucketed.matmul(x[:n], w, lambda: w, post, other[:n] if post in ("mul", "add") else None)
        assert got.shape == want[n].shape
        assert torch.equal(got, want[n]), f"{n} rows, post {post}"


def test_model_logits_bit_identical_with_and_without_buckets(buckets_off):
    """A whole prefill of the tiny model, several lengths in one batch: same logits, bit for bit."""
    from engine.config import CacheConfig, resolve_model_config  # noqa: PLC0415
    from engine.runner.model_runner import ModelRunner, StepItem  # noqa: PLC0415

    runner = ModelRunner(resolve_model_config("tiny"), CacheConfig(block_size=16, num_blocks=256))
    g = torch.Generator().manual_seed(1)
    lens = [5, 37, 300]
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lens]

    def run() -> torch.Tensor:
        items, nxt = [], 1
        for p in prompts:
            nb = -(-len(p) // 16)
            items.append(StepItem(p, 0, list(range(nxt, nxt + nb))))
            nxt += nb
        return runner.forward(items)

    want = run()
    set_row_buckets(RowBuckets())
    assert torch.equal(run(), want)


@pytest.mark.skipif(not torch_compat.bf16_gemm_works(), reason="no bf16 oneDNN GEMM on this CPU")
@pytest.mark.parametrize("post", ["none", "silu", "add"])
def test_bf16_gemm_rows_do_not_depend_on_the_row_count(post):
    """`--cpu-gemm bf16`: a row's output is the same bits whether it runs alone (one row, padded to
    two), in a decode batch or in a long prefill, so chunked, batched and lone prompts agree (the
    serving equality tests rely on it), and it stays within bf16 rounding of the fp32 GEMM."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(384, 128, generator=g) * 0.05
    x = torch.randn(600, 128, generator=g)
    other = torch.randn(600, 384, generator=g)
    bf16, fp32 = PackedWeight(), PackedWeight()
    bf16.gemm_dtype = "bf16"
    full = bf16.matmul(x, w, lambda: w, post, other if post == "add" else None)
    for n in (1, 2, 3, 8, 17, 256, 300):
        got = bf16.matmul(x[:n], w, lambda: w, post, other[:n] if post == "add" else None)
        assert torch.equal(got, full[:n]), f"{n} rows, post {post}"
    ref = fp32.matmul(x, w, lambda: w, post, other if post == "add" else None)
    assert full.dtype == torch.float32
    assert (full - ref).abs().max() <= 2e-2 * ref.abs().max()


def test_warm_up_builds_every_gemm_shape_a_prompt_can_need(capfd):
    """A worker's warm-up runs every row bucket (tile remainders of 1-16 rows included, which
    a prompt of 256+r tokens meets): afterwards no prompt length makes oneDNN build a primitive,
    so the caches (and the worker's RSS) stop growing at start-up, not thousands of steps later."""
    from contracts.worker import WorkerConfig  # noqa: PLC0415
    from engine.sequence import SamplingParams, Sequence  # noqa: PLC0415
    from engine.worker_base import build_engine  # noqa: PLC0415

    engine = build_engine(WorkerConfig(model="tiny", transport="local", num_blocks=256), prefill_only=True)
    capfd.readouterr()
    with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
        for i, n in enumerate([257, 258, 261, 269, 300, 777, 1485, 17, 40]):
            seq = Sequence(f"r{i}", [3 + j % 50 for j in range(n)], SamplingParams(max_tokens=1))
            engine.add_request(seq)
            while engine.waiting:
                engine.step()
            engine.release(seq.seq_id)
    out = capfd.readouterr().out
    assert "primitive,exec" in out  # oneDNN ran (and would say so for any build)
    assert "cache_miss" not in out, [line for line in out.splitlines() if "cache_miss" in line][:3]
