"""Llama, top to bottom: RMSNorm, RoPE (with llama3 scaling), grouped-query attention, SwiGLU.

Shapes use T for the flat batch of new tokens in this step (all sequences concatenated),
Hq/Hkv for query/KV heads and D for head_dim. Projections are fused (qkv, gate_up) and built by
`make_linear`, so `--dtype fp8` swaps in Fp8Linear without touching this file.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig, RopeScaling
from engine.kv.cache import KVCache
from engine.model.attention import AttentionBackend, AttentionMetadata
from engine.model.linear import (
    FP8_KERNEL_MAX_ROWS,
    DenseLinear,
    Fp8Linear,
    PackedWeight,
    RowBuckets,
    host_gemm_itemsize,
    make_linear,
)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight).to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies [D/2]; llama3 scaling stretches the low frequencies by `factor`
    and blends smoothly between high_freq_factor and low_freq_factor wavelengths."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if scaling is None:
        return inv_freq
    old_ctx = scaling.original_max_position_embeddings
    low_wavelen = old_ctx / scaling.low_freq_factor
    high_wavelen = old_ctx / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_ctx / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


class Rotary(nn.Module):
    inv_freq: torch.Tensor  # [D/2] (buffer)

    def __init__(self, cfg: ModelConfig, device=None):
        super().__init__()
        inv = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("inv_freq", inv.to(device), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, 1, D] fp32: computed once per step, shared by every layer."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos()[:, None, :], emb.sin()[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by the step's cos/sin (half-split convention)."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, weight_dtype: str, device=None):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.qkv_proj = make_linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, weight_dtype, device)
        self.o_proj = make_linear(cfg.q_size, cfg.hidden_size, weight_dtype, device)
        self.scale = cfg.head_dim**-0.5

    def forward(
        self,
        x,
        rope: tuple[torch.Tensor, torch.Tensor],
        backend: AttentionBackend,
        cache: KVCache,
        meta,
        residual: torch.Tensor,
    ):
        """residual + attention(x): the residual add rides on the o_proj GEMM (engine/model/linear.py)."""
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        # q and k rotate as one [T, Hq + Hkv, D] tensor: one pass of RoPE's elementwise ops instead
        # of two (on CPU each op's dispatch, not its arithmetic, is what a decode step pays)
        qk = apply_rotary(qkv[:, : self.q_size + self.kv_size].view(T, -1, self.head_dim), *rope)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        if q.is_cuda:  # the GPU kernels take dense q/k
            q, k = q.contiguous(), k.contiguous()
        v = qkv[:, self.q_size + self.kv_size :].view(T, self.num_kv_heads, self.head_dim)
        o = backend.forward(self.layer, q, k, v, cache, meta, self.scale)  # [T, Hq, D]
        return self.o_proj(o.reshape(T, self.q_size), "add", residual)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, weight_dtype: str, device=None):
        super().__init__()
        self.gate_up_proj = make_linear(cfg.hidden_size, 2 * cfg.intermediate_size, weight_dtype, device)
        self.down_proj = make_linear(cfg.intermediate_size, cfg.hidden_size, weight_dtype, device)

    def forward(self, x, residual: torch.Tensor):
        """residual + down(silu(gate(x)) * up(x)), the activation, product and add fused into the
        GEMMs on CPU fp32 (engine/model/linear.py)."""
        return self.down_proj(self.gate_up_proj.swiglu(x), "add", residual)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, weight_dtype: str, device=None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device)
        self.self_attn = Attention(cfg, layer, weight_dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device)
        self.mlp = MLP(cfg, weight_dtype, device)

    def forward(self, x, rope, backend, cache, meta):
        x = self.self_attn(self.input_layernorm(x), rope, backend, cache, meta, residual=x)
        return self.mlp(self.post_attention_layernorm(x), residual=x)


class LlamaModel(nn.Module):
    """Embedding -> N decoder layers -> final norm -> lm_head (dense, or tied to the embedding)."""

    def __init__(
        self,
        cfg: ModelConfig,
        weight_dtype: str = "fp8",
        act_dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        super().__init__()
        self.cfg, self.weight_dtype, self.act_dtype = cfg, weight_dtype, act_dtype
        self.embed_tokens = nn.Parameter(
            torch.zeros(cfg.vocab_size, cfg.hidden_size, dtype=act_dtype, device=device), requires_grad=False
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, weight_dtype, device) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device)
        self.rotary = Rotary(cfg, device)
        # lm_head stays in the activation dtype: quantizing it costs accuracy for little speed.
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nn.Parameter(
                torch.zeros(cfg.vocab_size, cfg.hidden_size, dtype=act_dtype, device=device), requires_grad=False
            )
        )

        self._head = PackedWeight()  # the lm_head GEMM (CPU: its oneDNN-packed / transposed copies)
        self._cpu_gemm = "fp32"  # the projections' CPU GEMM dtype (set_cpu_gemm)

    def set_cpu_gemm(self, dtype: str) -> None:
        """The dtype every CPU GEMM of this model multiplies in (engine/model/linear.py HOST_GEMM_DTYPES)."""
        for m in self.modules():
            if isinstance(m, (Fp8Linear, DenseLinear)):
                m.set_cpu_gemm(dtype)
        self._cpu_gemm = dtype
        # the lm_head stays fp32: its output is the logits, and a bf16 output (8 mantissa bits)
        # would round logprobs and near-tie greedy choices; it is a fifth of SmolLM2's weight bytes

    @property
    def cpu_gemm(self) -> str:
        """The projections' CPU GEMM dtype (the lm_head's is always fp32)."""
        return self._cpu_gemm

    def layer(self, i: int) -> DecoderLayer:
        """Decoder layer i, typed (a type checker sees nn.ModuleList items as plain Modules)."""
        return cast(DecoderLayer, self.layers[i])

    def decode_weight_bytes(self) -> int:
        """Bytes of weights a decode step reads, each once, in the layout its GEMMs multiply:
        every projection, the lm_head (the tied embedding, if tied) and the norms. At small
        batches the step is memory-bound, so this over the memory bandwidth is its floor."""
        dev = self.embed_tokens.device
        linears = [m for m in self.modules() if isinstance(m, (Fp8Linear, DenseLinear))]
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        norms = [m.weight for m in self.modules() if isinstance(m, RMSNorm)]
        head_bytes = head.numel() * (
            host_gemm_itemsize(self._head.gemm_dtype, self.act_dtype) if dev.type == "cpu" else head.element_size()
        )
        return (
            sum(m.gemm_weight_bytes(dev, self.act_dtype) for m in linears) + head_bytes + sum(w.nbytes for w in norms)
        )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
        cache: KVCache,
        meta: AttentionMetadata,
        on_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden]. `on_layer(i)` runs after
        layer i has written its KV (layer-wise KV streaming announces finished layers from it)."""
        # per-step work, once for all layers: RoPE tables for the step's positions, attention state
        rope = self.rotary.cos_sin(positions)
        backend.prepare(meta, cache)
        x = F.embedding(input_ids, self.embed_tokens)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, backend, cache, meta)
            if on_layer is not None:
                on_layer(i)
        return self.norm(x)

    @torch.inference_mode()
    def warm_gemm_shapes(self, buckets: RowBuckets) -> None:
        """Run one layer's projections, each with its epilogue, and the lm_head at every row count
        the CPU GEMMs can run at (`buckets`): every oneDNN primitive a step can need is built now.

        Why: each bucket's primitives take ~3 MB in oneDNN's caches (tiny model). Built on first
        use, the rare ones (a prompt batch's remainder of 1-16 rows after its 256-row tiles) came
        one by one over thousands of steps, so a prefill worker's RSS crept ~5 MB a load of 180
        varied prompts long after its warm-up (issue 40). Layers share their shapes, so one layer
        covers them all. A projection of 16 rows or fewer takes the FP8 kernel, not oneDNN, so a
        small bucket is warmed as a tile's remainder, the way a prompt meets it."""
        layer = self.layer(0)
        attn, mlp = layer.self_attn, layer.mlp
        hidden = mlp.down_proj.out_features
        for m in buckets.sizes():
            rows = m + buckets.tile if m <= FP8_KERNEL_MAX_ROWS else m
            x = torch.zeros(rows, hidden, dtype=self.act_dtype)
            attn.qkv_proj(x)
            attn.o_proj(torch.zeros(rows, attn.q_size, dtype=self.act_dtype), "add", x)
            mlp.down_proj(mlp.gate_up_proj.swiglu(x), "add", x)
            self.compute_logits(x[:m])

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, hidden] -> fp32 logits [B, vocab]."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return self._head.matmul(hidden, head, lambda: head).float()
