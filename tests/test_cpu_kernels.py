"""pdserve's C++ kernels: the decode attention (engine/model/csrc/paged_decode.cpp) against the torch
path and the reference, and the FP8 few-row GEMM (engine/model/csrc/fp8_linear.cpp) against the
dequantized product.

tests/test_chunked_prefill.py checks every backend against dense attention on small shapes; here
the kernel meets SmolLM2's shapes (9 query heads on 3 KV heads, head_dim 64, 16-token blocks),
rows of very different lengths on shuffled blocks, and whole-model greedy decoding.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from engine.config import CacheConfig
from engine.kv.cache import FP8, KVCache
from engine.kv.layout import KVLayout
from engine.model import cpu_kernels
from engine.model.attention import AttentionMetadata, TorchReferenceAttention
from engine.model.cpu_attention import BatchedAttention
from engine.model.linear import FP8_KERNEL_MAX_ROWS, Fp8Linear
from tests.helpers import attention_shapes

HAS_TOOLCHAIN = shutil.which("g++") is not None or shutil.which("c++") is not None

SMOL_HEADS = attention_shapes("smol-heads", hidden=576, heads=9, kv_heads=3, head_dim=64, vocab=64, inter=64, ctx=2048)


def test_kernel_is_built_where_a_compiler_is():
    """A machine with a C++ compiler gets the kernel: a silent fallback would hide a build break."""
    if not HAS_TOOLCHAIN:
        pytest.skip("no C++ compiler here: the torch path runs (engine/model/cpu_kernels.py)")
    assert cpu_kernels.paged_decode_op() is not None, cpu_kernels.unavailable_reason()


def _filled_cache(ctx_lens: list[int], seed: int = 0) -> tuple[KVCache, torch.Tensor]:
    layout = KVLayout.build(SMOL_HEADS, CacheConfig(block_size=16, num_blocks=96, kv_dtype="fp8"))
    cache = KVCache(layout)
    g = torch.Generator().manual_seed(seed)
    width = max(-(-n // 16) for n in ctx_lens)
    perm = torch.randperm(95, generator=g) + 1  # shuffled blocks, never block 0
    tables, used = [], 0
    for n in ctx_lens:
        nb = -(-n // 16)
        tables.append(perm[used : used + nb].tolist() + [0] * (width - nb))
        used += nb
    H, D = SMOL_HEADS.num_kv_heads, SMOL_HEADS.head_dim
    for layer in range(SMOL_HEADS.num_layers):
        for t, n in zip(tables, ctx_lens):
            slots = torch.tensor([t[p // 16] * 16 + p % 16 for p in range(n - 1)], dtype=torch.long)
            if n > 1:  # large values too: FP8 scales far from 1
                cache.write(
                    layer, slots, torch.randn(n - 1, H, D, generator=g) * 40, torch.randn(n - 1, H, D, generator=g)
                )
    return cache, torch.tensor(tables)


@pytest.mark.skipif(not HAS_TOOLCHAIN, reason="no C++ compiler: no kernel to check")
def test_kernel_equals_torch_path_and_reference_on_smollm2_heads():
    ctx_lens = [1, 2, 15, 16, 17, 100, 333, 64]
    cache, tables = _filled_cache(ctx_lens)
    n, Hq, H, D = len(ctx_lens), SMOL_HEADS.num_heads, SMOL_HEADS.num_kv_heads, SMOL_HEADS.head_dim
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(n, h, D, generator=g) for h in (Hq, H, H))
    slots = torch.tensor([int(tables[i, (c - 1) // 16]) * 16 + (c - 1) % 16 for i, c in enumerate(ctx_lens)])
    outs = {}
    for name, backend in (
        ("kernel", BatchedAttention()),
        ("torch", BatchedAttention(kernel=False)),
        ("reference", TorchReferenceAttention()),
    ):
        meta = AttentionMetadata(slots, [1] * n, ctx_lens, tables, torch.tensor(ctx_lens, dtype=torch.int32))
        outs[name] = backend.forward(1, q, k, v, cache, meta, D**-0.5)
    assert BatchedAttention().kernel is not None
    torch.testing.assert_close(outs["kernel"], outs["reference"], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(outs["kernel"], outs["torch"], atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(not HAS_TOOLCHAIN, reason="no C++ compiler: no kernel to check")
def test_kernel_refuses_a_context_past_its_block_table():
    cache, tables = _filled_cache([20, 5])
    op = cpu_kernels.paged_decode_op()
    assert op is not None
    q = torch.zeros(2, SMOL_HEADS.num_heads, SMOL_HEADS.head_dim)
    lens = torch.tensor([20, 5 + 16 * tables.shape[1]], dtype=torch.int32)  # row 1 runs off its table
    with pytest.raises(RuntimeError, match="outside the block table"):
        op(q, cache.data[:, 0].view(torch.uint8), cache.scales[:, 0], tables, lens, 0.125)


# ---- the FP8 few-row GEMM (engine/model/csrc/fp8_linear.cpp) ------------------------------------------


def _fp8_layer(n_out: int, n_in: int, seed: int = 0) -> Fp8Linear:
    layer = Fp8Linear(n_in, n_out)
    g = torch.Generator().manual_seed(seed)
    layer.load(torch.randn(n_out, n_in, generator=g) * torch.logspace(-3, 0, n_in)[None, :])  # subnormals too
    return layer


@pytest.mark.skipif(not HAS_TOOLCHAIN, reason="no C++ compiler: no kernel to check")
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (7, 37)])  # SmolLM2's; ragged N and K
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 16])
def test_fp8_linear_equals_the_dequantized_product(shape, rows):
    op = cpu_kernels.fp8_linear_op()
    assert op is not None, cpu_kernels.unavailable_reason()
    layer = _fp8_layer(*shape)
    g = torch.Generator().manual_seed(rows)
    x, res = torch.randn(rows, shape[1], generator=g), torch.randn(rows, shape[0], generator=g)
    want = (x.double() @ layer.dequantized().double().t()).float()
    w = layer.weight.view(torch.uint8)
    torch.testing.assert_close(op(x, w, layer.weight_scale, None, 0), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(op(x, w, layer.weight_scale, res, 1), want + res, atol=1e-5, rtol=1e-5)
    if shape[0] % 2 == 0:
        gate, up = want.chunk(2, dim=-1)
        swiglu = torch.nn.functional.silu(gate) * up
        torch.testing.assert_close(op(x, w, layer.weight_scale, None, 2), swiglu, atol=5e-5, rtol=2e-4)


@pytest.mark.skipif(not HAS_TOOLCHAIN, reason="no C++ compiler: no kernel to check")
def test_fp8_linear_widens_every_fp8_value_exactly():
    """Every e4m3 byte but NaN's two, as one weight column: x = 1 reads each value back, times its scale."""
    op = cpu_kernels.fp8_linear_op()
    assert op is not None
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    scale = torch.full((codes.numel(),), 0.5)
    got = op(torch.ones(1, 1), codes[:, None].contiguous(), scale, None, 0)[0]
    assert torch.equal(got, codes.view(FP8).float() * 0.5)


@pytest.mark.skipif(not HAS_TOOLCHAIN, reason="no C++ compiler: no kernel to check")
def test_fp8_linear_rows_do_not_depend_on_their_batch():
    """A row's output is bit-identical alone and in a batch of any size (one dot product per output)."""
    op = cpu_kernels.fp8_linear_op()
    assert op is not None
    layer = _fp8_layer(576, 576)
    x = torch.randn(9, 576, generator=torch.Generator().manual_seed(3))
    w, s = layer.weight.view(torch.uint8), layer.weight_scale
    batch = op(x, w, s, None, 0)
    for i in (0, 4, 8):
        assert torch.equal(batch[i : i + 1], op(x[i : i + 1].clone(), w, s, None, 0))


@pytest.mark.skipif(not HAS_TOOLCHAIN, reason="no C++ compiler: no kernel to check")
def test_fp8_layers_send_few_rows_to_the_kernel_and_prompts_to_onednn():
    layer = _fp8_layer(3072, 576)
    g = torch.Generator().manual_seed(4)
    for rows in (1, FP8_KERNEL_MAX_ROWS, FP8_KERNEL_MAX_ROWS + 1, 64):
        x = torch.randn(rows, 576, generator=g)
        want = (x.double() @ layer.dequantized().double().t()).float()
        torch.testing.assert_close(layer(x), want, atol=5e-5, rtol=1e-4)
        gate, up = want.chunk(2, dim=-1)
        torch.testing.assert_close(layer.swiglu(x), torch.nn.functional.silu(gate) * up, atol=5e-5, rtol=1e-4)
    # the fp32 copies are made only for the prompt-sized batches
    fresh = _fp8_layer(576, 576)
    fresh(torch.randn(FP8_KERNEL_MAX_ROWS, 576))
    assert fresh.gemm_weight_bytes(torch.device("cpu"), torch.float32) == 576 * (576 + 4)


@pytest.mark.skipif(not HAS_TOOLCHAIN, reason="no C++ compiler: no kernel to check")
def test_fp8_linear_refuses_bad_shapes():
    op = cpu_kernels.fp8_linear_op()
    assert op is not None
    w, s = torch.zeros(4, 8, dtype=torch.uint8), torch.ones(4)
    with pytest.raises(RuntimeError, match="disagree on K"):
        op(torch.zeros(2, 7), w, s, None, 0)
    with pytest.raises(RuntimeError, match="other"):
        op(torch.zeros(2, 8), w, s, None, 1)
    with pytest.raises(RuntimeError, match="post must be"):
        op(torch.zeros(2, 8), w, s, None, 5)


def test_a_build_lock_left_by_a_stopped_process_is_removed_and_a_fresh_one_waited_for(tmp_path, monkeypatch):
    """torch's extension builder waits forever on a lock a process killed mid-build left; a lock
    older than BUILD_LOCK_STALE_S is removed, a younger one waited on until its build ends."""
    import os
    import threading
    import time

    stale = tmp_path / "py311_cpu" / cpu_kernels.NAME / "lock"
    stale.parent.mkdir(parents=True)
    stale.touch()
    old = time.time() - cpu_kernels.BUILD_LOCK_STALE_S - 60
    os.utime(stale, (old, old))
    cpu_kernels.clear_stale_build_lock(tmp_path)
    assert not stale.exists()

    stale.touch()  # a build under way: its process removes the lock when it ends
    threading.Timer(1.5, stale.unlink).start()
    t0 = time.monotonic()
    cpu_kernels.clear_stale_build_lock(tmp_path)
    assert 1.0 < time.monotonic() - t0 < 10.0 and not stale.exists()
