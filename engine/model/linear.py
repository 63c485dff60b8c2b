"""Linear layers, swapped by `--dtype`: Fp8Linear (fp8 e4m3 weights + per-output-channel scales)
or DenseLinear (bf16/fp32 weights). Both take activations [T, in] and return [T, out].

On CUDA, Fp8Linear quantizes activations per token on the fly and calls `torch._scaled_mm`
(the FP8 tensor-core GEMM). On CPU it multiplies by the dequantized weight in fp32 (bf16/fp8
matmuls crawl on CPU). torch's private ops (that one, oneDNN's below) are reached only through
engine/torch_compat.py, which guards each and falls back where a torch lacks it.

CPU fp32 GEMMs go through `PackedWeight`, which keeps the weight in the layout each GEMM wants,
made once from the stored weight (FP8 dequantized, bf16 widened) and never per step:
- several rows: oneDNN's pre-blocked copy. Measured on the 2-core dev VM (1 thread, SmolLM2-135M
  shapes): 1.3-1.5x faster than `x @ w.t()` for the decode step's 16 rows and ~2x for the
  49k-row lm_head, and no slower for prefill;
- one row (batch-1 decode): the transposed copy [in, out], so the GEMV runs `x @ wt` down its
  rows (MKL's axpy-style kernel, no per-output reduction). Measured over every GEMM of a
  SmolLM2 step (538 MB, cold, alternating in one process): 42.7 ms against 51.1 ms for the
  oneDNN copy, and ~1.6x faster than `F.linear` on the plain weight (batch 1's path before).
The plain fp32 copy is not kept: an FP8 layer holds its e4m3 bytes plus the layouts the batches
it has seen use (4 bytes per weight each; a server that prefills and decodes one stream holds
both, as many copies as the plain + packed pair before).

FP8 layers on the fp32 path send a decode step's few rows (`FP8_KERNEL_MAX_ROWS`) to pdserve's
own kernel instead (engine/model/csrc/fp8_linear.cpp): it reads the e4m3 bytes, a quarter of the fp32
copy's, and widens them in registers. Such a step is bound by the weight bytes it reads: over
SmolLM2's 120 projections (cold, 1 thread, dev VM) 18 ms against oneDNN's 30 ms at 1 row and
38 against 49 at 8; at 16 rows they are even, and prompts keep the packed copy. Each row's
result is one fp32 dot product per output whatever the batch (row-count independent).

A GEMM can carry its elementwise epilogue (`post`): "silu", "mul" by a tensor or "add" a
tensor (the residual). On the oneDNN path it is fused into the GEMM's output pass instead of a
second pass over [T, out] in memory; elsewhere it is the same torch op after the GEMM. `swiglu`
runs a fused [gate; up] weight as two fused GEMMs, silu(x @ gate.t()) * (x @ up.t()): measured
17% faster for SmolLM2's MLP on a 2048-token prefill, outputs within 2e-6 of the unfused path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine import torch_compat
from engine.kv.cache import FP8, FP8_MAX, quantize_fp8
from engine.model.cpu_kernels import fp8_linear_op
from engine.torch_compat import Epilogue as Post


def quantize_weight_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (fp8 [out, in], fp32 scale [out]): one scale per output channel."""
    return quantize_fp8(w)


FP8_KERNEL_MAX_ROWS = 16  # rows up to which an FP8 layer's fp32 CPU GEMM runs the FP8 kernel
_KERNEL_POST = {"none": 0, "add": 1}  # the epilogues the kernel fuses (and SwiGLU, 2)
apply_post = torch_compat.epilogue  # the unfused epilogue: what the oneDNN path computes inside the GEMM


@dataclass(frozen=True)
class RowBuckets:
    """The row counts (M) the oneDNN GEMMs run at, so a process sees a small, fixed set of shapes.

    Why: oneDNN builds (JIT-compiles) a primitive per GEMM shape and post-op, and two caches keep
    every one: ideep's computation cache (`LRU_CACHE_CAPACITY`, 1,024 entries) and oneDNN's
    primitive cache (`ONEDNN_PRIMITIVE_CACHE_CAPACITY`, 1,024). Each primitive held ~0.6-2 MB
    (measured, 1 thread, tiny and SmolLM2 shapes), and every distinct prompt length (or decode
    batch size) makes ~6 of them, so a worker's RSS climbed by ~2.5 MB per new length until both
    caches were full (~1 GB; issue 22). Here a GEMM of n rows runs as full tiles of `tile` rows
    plus a remainder padded up to one of `per_octave` sizes per power of two (zero rows, cut off
    after): at most ~`per_octave` * log2(tile) shapes per weight, whatever the traffic.

    Outputs are unchanged, bit for bit: oneDNN's rows do not depend on how many rows share the
    call (any M >= 2; tests/test_linear_buckets.py checks it). One row keeps MKL's GEMV (not
    oneDNN), so it is never padded. `per_octave=0` turns bucketing off (today's behaviour)."""

    per_octave: int = 4  # remainder sizes per power of two: padding < 1/per_octave of the rows run
    tile: int = 256  # rows per GEMM call above this (a power of two)

    def __post_init__(self) -> None:
        if self.per_octave < 0:
            raise ValueError("per_octave must be >= 0 (0 = off)")
        if self.tile < 2 or self.tile & (self.tile - 1):
            raise ValueError(f"tile must be a power of two >= 2, got {self.tile}")

    @property
    def enabled(self) -> bool:
        return self.per_octave > 0

    def padded(self, r: int) -> int:
        """The bucket a remainder of 1 <= r <= tile rows runs at (>= 2: oneDNN's path)."""
        p = 1 << max(1, (r - 1).bit_length())  # next power of two >= max(r, 2)
        step = max(1, p // (2 * self.per_octave))
        return max(2, -(-r // step) * step)

    def plan(self, n: int) -> list[tuple[int, int, int]]:
        """(first row, rows, rows run) of each GEMM call for n >= 2 rows."""
        if not self.enabled:
            return [(0, n, n)]
        calls = [(s, self.tile, self.tile) for s in range(0, n - n % self.tile, self.tile)]
        if n % self.tile:
            r = n % self.tile
            calls.append((n - r, r, self.padded(r)))
        return calls

    def sizes(self) -> list[int]:
        """Every row count a GEMM can run at (what the caches hold per weight and post-op)."""
        if not self.enabled:
            return []
        return sorted({self.padded(r) for r in range(1, self.tile + 1)})


_row_buckets = RowBuckets()

# The dtype the CPU's oneDNN GEMMs multiply in (`--cpu-gemm`; each PackedWeight's `gemm_dtype`,
# set for a whole model by `LlamaModel.set_cpu_gemm`). "bf16": the weights are packed as bf16 and
# each GEMM's input is rounded to bf16; oneDNN accumulates in fp32, and the output is widened to
# fp32 before its epilogue, so the residual stream, norms, attention and logits' softmax stay fp32.
# Why it pays: a decode step reads every weight once (half the bytes), and a prefill is
# compute-bound, where CPUs with native bf16 dot products (AVX512-BF16, AMX) run twice the fp32
# rate. Measured on the 2-core dev VM (AMD EPYC with AVX512-BF16, 1 thread, SmolLM2-135M): the
# step's GEMMs took 31 ms against 60 ms at batch 8 (torch profiler, one step). Why it is safe for
# FP8 weights: their e4m3 values carry 3 mantissa bits (~6% steps); bf16's 8 (~0.4%) add little,
# and the CUDA path already rounds activations to FP8. `--dtype fp32` never uses it. A row's
# result does not depend on how many rows share the GEMM (checked: tests/test_linear_buckets.py),
# but it is not the default: the prefill's attention differs in fp32 summation order between a
# whole prompt, a chunk and a prefix-cache hit's tail, and bf16 rounding of the next projection's
# input turns those 1e-7 differences into whole bf16 steps. Measured: in a 30-minute soak (tiny
# 2P2D, real-shaped chats sharing prefixes, `--cpu-gemm auto` = bf16 on the dev VM) 31 of 9,204
# repeated prompts answered with other greedy tokens than their first time; fp32's differences
# stay below the greedy margins (0 in earlier soaks). Opt in where speed matters more than that.
HOST_GEMM_DTYPES = ("fp32", "bf16")


def resolve_host_gemm(choice: str, weight_dtype: str, device: str | torch.device) -> str:
    """`--cpu-gemm` to a dtype: "auto" is bf16 for FP8/bf16 weights on a CPU whose oneDNN has
    native bf16 dot products, fp32 otherwise (fp32 weights: the user asked for fp32 arithmetic; a
    CPU without native bf16 would emulate it, slower than fp32)."""
    if choice not in ("auto", *HOST_GEMM_DTYPES):
        raise ValueError(f"--cpu-gemm must be auto, fp32 or bf16, got {choice!r}")
    if choice == "bf16" and torch.device(device).type == "cpu" and not torch_compat.bf16_gemm_works():
        raise ValueError("--cpu-gemm bf16: this torch's oneDNN cannot multiply bf16 on this CPU; use fp32 or auto")
    if choice != "auto":
        return choice
    cpu = torch.device(device).type == "cpu"
    return "bf16" if cpu and weight_dtype in ("fp8", "bf16") and torch_compat.native_bf16_gemm() else "fp32"


def set_row_buckets(buckets: RowBuckets) -> None:
    """Set the process's GEMM row buckets (process-wide, as the oneDNN caches they bound are)."""
    global _row_buckets
    _row_buckets = buckets


def row_buckets() -> RowBuckets:
    return _row_buckets


class PackedWeight:
    """The CPU fp32 layouts of one weight [out, in]: `matmul(x, stored, make)` multiplies by the
    weight `make()` returns, made from `stored` (the layer's parameter: FP8 bytes, or the dense
    weight itself) only when a layout is first needed or `stored` has changed in place (tracked
    by its version counter; inference tensors have none, and are re-made only if their storage
    changes, or on `reset`). Off the oneDNN path (another device or dtype): a plain GEMM with the
    epilogue after it."""

    def __init__(self) -> None:
        self._layouts: dict[str, torch.Tensor] = {}  # "packed" (oneDNN), "t" (one-row), "plain"
        self._key: tuple[int, int] | None = None
        self.gemm_dtype = "fp32"  # what the CPU GEMM multiplies in (HOST_GEMM_DTYPES)

    def matmul(
        self,
        x: torch.Tensor,
        stored: torch.Tensor,
        make: Callable[[], torch.Tensor],
        post: Post = "none",
        other: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [..., in] @ w.t() -> [..., out], then `post` (with `other` [..., out] for mul/add)."""
        key = (stored.data_ptr(), torch_compat.tensor_version(stored))
        if self._key != key:
            self._layouts, self._key = {}, key
        if not (torch_compat.ONEDNN_LINEAR and x.device.type == "cpu" and x.dtype == torch.float32):
            return apply_post(x @ self._layout("plain", make).t(), post, other)
        bf16 = self.gemm_dtype == "bf16"
        if x.numel() == x.shape[-1] and not bf16:  # one row: the GEMV down the transposed copy's rows
            return apply_post(x @ self._layout("t", make), post, other)
        packed = self._layout("packed_bf16" if bf16 else "packed", make)
        x2 = x.reshape(-1, x.shape[-1])
        out_features = packed.shape[0]
        other2 = None
        if post in ("mul", "add"):
            assert other is not None
            other2 = other.reshape(-1, out_features).contiguous()
        calls = _row_buckets.plan(x2.shape[0])
        if len(calls) == 1:  # one call (a decode step, a short prompt): padded if needed, cut as a view
            _, rows, run = calls[0]
            if run > rows:
                x2 = F.pad(x2, (0, 0, 0, run - rows))
                other2 = None if other2 is None else F.pad(other2, (0, 0, 0, run - rows))
            out = self._call(x2, other2, packed, post)[:rows]
        else:
            out = torch.empty(x2.shape[0], out_features, dtype=x.dtype)
            for start, rows, run in calls:
                xs = x2[start : start + rows]
                os_ = None if other2 is None else other2[start : start + rows]
                if run > rows:  # zero rows up to the bucket, cut off below
                    xs = F.pad(xs, (0, 0, 0, run - rows))
                    os_ = None if os_ is None else F.pad(os_, (0, 0, 0, run - rows))
                out[start : start + rows] = self._call(xs, os_, packed, post)[:rows]
        return out.reshape(*x.shape[:-1], out_features)

    def _layout(self, name: str, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        if name not in self._layouts:
            w = make()
            if name == "packed":
                w = torch_compat.pack_linear_weight(w)
            elif name == "packed_bf16":
                w = torch_compat.pack_linear_weight(w, torch.bfloat16)
            elif name == "t":
                w = w.float().t().contiguous()
            self._layouts[name] = w
        return self._layouts[name]

    @staticmethod
    def _call(x2: torch.Tensor, other2: torch.Tensor | None, packed: torch.Tensor, post: Post) -> torch.Tensor:
        """One oneDNN GEMM of x2 [m, in] (m >= 2) with the packed weight and its fused epilogue."""
        if packed.dtype == torch.bfloat16:
            # bf16 inputs, fp32 accumulation inside oneDNN; the bf16 output is widened before the
            # epilogue, so the residual stream and the SwiGLU product stay fp32
            return apply_post(torch_compat.linear_fused(x2.to(torch.bfloat16), packed).float(), post, other2)
        return torch_compat.linear_fused(x2, packed, post, other2)

    def reset(self) -> None:
        self._layouts, self._key = {}, None


class _Linear(nn.Module):
    """What both layers share: the epilogue-carrying forward and the SwiGLU of a [gate; up]
    weight. On the host path a layer gives its stored weight and how to make the weight to
    multiply by from it (`_host_weight`), or None where it has a GEMM of its own (`_own_matmul`:
    FP8 on CUDA)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self._packed = PackedWeight()
        self._halves = (PackedWeight(), PackedWeight())  # swiglu: the gate and up halves

    def _host_weight(self, x: torch.Tensor) -> tuple[torch.Tensor, Callable[[], torch.Tensor]] | None:
        raise NotImplementedError

    def _own_matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _fp8_rows(self, x: torch.Tensor, post: int, other: torch.Tensor | None) -> torch.Tensor | None:
        """The FP8 kernel's product (post 0 none, 1 add `other`, 2 SwiGLU), or None where it
        does not apply: only FP8 layers have one."""
        return None

    def gemm_weight_bytes(self, device: torch.device, act_dtype: torch.dtype) -> int:
        """Bytes of weight one forward's GEMM reads on `device` with `act_dtype` activations, in
        the layout it multiplies (the floor of a memory-bound decode step; `bench step`)."""
        raise NotImplementedError

    def _reset_packed(self) -> None:
        for p in (self._packed, *self._halves):
            p.reset()

    def set_cpu_gemm(self, dtype: str) -> None:
        """The dtype this layer's CPU GEMMs multiply in (a layout in another dtype is dropped)."""
        for p in (self._packed, *self._halves):
            if p.gemm_dtype != dtype:
                p.gemm_dtype = dtype
                p.reset()

    @property
    def cpu_gemm(self) -> str:
        return self._packed.gemm_dtype

    def forward(self, x: torch.Tensor, post: Post = "none", other: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, in] -> post(x @ W.t()) [T, out]; e.g. post="add", other=residual."""
        if post in _KERNEL_POST and (y := self._fp8_rows(x, _KERNEL_POST[post], other)) is not None:
            return y
        host = self._host_weight(x)
        if host is None:
            return apply_post(self._own_matmul(x), post, other)
        return self._packed.matmul(x, *host, post, other)

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for this layer's [gate; up] output halves: x [T, in] -> [T, out / 2]."""
        if (y := self._fp8_rows(x, 2, None)) is not None:
            return y
        host = self._host_weight(x)
        if host is None or x.numel() == x.shape[-1]:  # own GEMM, or one row: one GEMV of [gate; up]
            y = self._own_matmul(x) if host is None else self._packed.matmul(x, *host)
            gate, up = y.chunk(2, dim=-1)
            return F.silu(gate) * up
        stored, make = host
        half = self.out_features // 2
        gate = self._halves[0].matmul(x, stored, lambda: make()[:half], "silu")
        return self._halves[1].matmul(x, stored, lambda: make()[half:], "mul", gate)


class Fp8Linear(_Linear):
    weight: torch.Tensor  # [out, in] float8_e4m3fn (buffer)
    weight_scale: torch.Tensor  # [out] float32 (buffer)

    def __init__(self, in_features: int, out_features: int, device: torch.device | str = "cpu"):
        super().__init__(in_features, out_features)
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=FP8, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32, device=device))

    def load(self, w: torch.Tensor) -> None:
        """Quantize a full-precision weight [out, in] into this layer."""
        q, s = quantize_weight_fp8(w.to(self.weight.device))
        self.weight.copy_(q)
        self.weight_scale.copy_(s)
        self._reset_packed()

    def dequantized(self) -> torch.Tensor:
        return self.weight.float() * self.weight_scale[:, None]

    def _host_weight(self, x: torch.Tensor) -> tuple[torch.Tensor, Callable[[], torch.Tensor]] | None:
        return None if x.is_cuda else (self.weight, self.dequantized)

    def _fp8_rows(self, x: torch.Tensor, post: int, other: torch.Tensor | None) -> torch.Tensor | None:
        rows = x.numel() // x.shape[-1]
        if (
            rows > FP8_KERNEL_MAX_ROWS
            or x.device.type != "cpu"
            or x.dtype != torch.float32
            or self.cpu_gemm != "fp32"
            or (kernel := fp8_linear_op()) is None
        ):
            return None
        other2 = None if other is None else other.reshape(rows, -1)
        y = kernel(x.reshape(rows, -1), self.weight.view(torch.uint8), self.weight_scale, other2, post)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def gemm_weight_bytes(self, device: torch.device, act_dtype: torch.dtype) -> int:
        if device.type == "cuda" or (
            self.cpu_gemm == "fp32" and act_dtype == torch.float32 and fp8_linear_op() is not None
        ):  # the e4m3 bytes and the scales (torch._scaled_mm on CUDA, the FP8 kernel on CPU)
            return self.out_features * (self.in_features + 4)
        return self.out_features * self.in_features * host_gemm_itemsize(self.cpu_gemm, act_dtype)  # the copy

    def _own_matmul(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        # dynamic per-token activation scale: [T, 1]
        x_scale = (x2.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
        xq = (x2.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        out = torch_compat.scaled_mm(xq, self.weight.t(), x_scale, self.weight_scale[None, :], x.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)


class DenseLinear(_Linear):
    weight: torch.Tensor  # [out, in] (buffer)

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        super().__init__(in_features, out_features)
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=dtype, device=device))

    def load(self, w: torch.Tensor) -> None:
        self.weight.copy_(w.to(self.weight.dtype))
        self._reset_packed()

    def _host_weight(self, x: torch.Tensor) -> tuple[torch.Tensor, Callable[[], torch.Tensor]]:
        # bf16 weights under fp32 activations (CPU) are widened once, into the GEMM's layouts:
        # `self.weight.to(x.dtype)` in every forward wrote and read the weights twice per step
        return self.weight, lambda: self.weight.to(x.dtype)

    def gemm_weight_bytes(self, device: torch.device, act_dtype: torch.dtype) -> int:
        if device.type == "cpu":
            return self.out_features * self.in_features * host_gemm_itemsize(self.cpu_gemm, act_dtype)
        return self.out_features * self.in_features * act_dtype.itemsize


def host_gemm_itemsize(gemm_dtype: str, act_dtype: torch.dtype) -> int:
    """Bytes per weight a CPU GEMM reads: its packed copy's (bf16 under `--cpu-gemm bf16`)."""
    return 2 if gemm_dtype == "bf16" and act_dtype == torch.float32 else act_dtype.itemsize


WEIGHT_DTYPES = ("fp8", "bf16", "fp32")


def make_linear(
    in_features: int, out_features: int, weight_dtype: str, device: torch.device | str = "cpu"
) -> Fp8Linear | DenseLinear:
    if weight_dtype == "fp8":
        return Fp8Linear(in_features, out_features, device)
    if weight_dtype == "bf16":
        return DenseLinear(in_features, out_features, torch.bfloat16, device)
    if weight_dtype == "fp32":
        return DenseLinear(in_features, out_features, torch.float32, device)
    raise ValueError(f"weight dtype must be one of {WEIGHT_DTYPES}, got {weight_dtype!r}")
