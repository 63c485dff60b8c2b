"""The C++ decode attention (engine/csrc/paged_decode.cpp) against the torch path and the reference.

tests/test_chunked_prefill.py checks every backend against dense attention on small shapes; here
the kernel meets SmolLM2's shapes (9 query heads on 3 KV heads, head_dim 64, 16-token blocks),
rows of very different lengths on shuffled blocks, and whole-model greedy decoding.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from engine import cpu_kernels
from engine.attention import AttentionMetadata, TorchReferenceAttention
from engine.config import CacheConfig, ModelConfig
from engine.cpu_attention import BatchedAttention
from engine.kv_cache import KVCache
from engine.kv_layout import KVLayout

HAS_TOOLCHAIN = shutil.which("g++") is not None or shutil.which("c++") is not None

SMOL_HEADS = ModelConfig(
    name="smol-heads",
    vocab_size=64,
    hidden_size=576,
    intermediate_size=64,
    num_layers=2,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    max_position_embeddings=2048,
)


def test_kernel_is_built_where_a_compiler_is():
    """A machine with a C++ compiler gets the kernel: a silent fallback would hide a build break."""
    if not HAS_TOOLCHAIN:
        pytest.skip("no C++ compiler here: the torch path runs (engine/cpu_kernels.py)")
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
