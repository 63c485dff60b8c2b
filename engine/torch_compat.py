"""torch's private APIs, in one place: each behind a guard, each with a fallback.

pdserve leans on three things torch does not promise to keep:
- oneDNN's fused linear ops (`torch.ops.mkldnn._reorder_linear_weight`, `_linear_pointwise`),
  the CPU GEMMs with a pre-blocked weight and a fused epilogue (engine/model/linear.py says what they
  are worth). They are what inductor's CPU path calls, present since torch 2.0, but private:
  a release may rename them or change their arguments. `ONEDNN_LINEAR` says whether this torch
  has them and they answer a tiny GEMM correctly (checked once, at import); where it is False,
  the same functions run the plain matmul and epilogue, and engine/model/linear.py takes its plain path.
- `torch._scaled_mm`, the FP8 tensor-core GEMM (CUDA). Without it, `scaled_mm` dequantizes and
  multiplies: the same product, at the speed of a widened GEMM.
- a tensor's version counter (`Tensor._version`), bumped by every in-place write: how a packed
  copy of a weight knows it went stale. Without it, `tensor_version` says -1 (as for inference
  tensors, which have none), and a layer's `load` re-packs, as it does anyway.

Nothing else in pdserve names a private torch attribute (`tools/private_names.py`, run by
`make lint`, checks it); `tests/test_torch_compat.py` checks each guard and each fallback.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F

ONEDNN_MIN_TORCH = (2, 0)  # the fused linear ops' first release (inductor's CPU backend)
Epilogue = Literal["none", "silu", "mul", "add"]
_ONEDNN_UNARY = {"none": "none", "silu": "swish"}  # oneDNN's "swish" (alpha 1) is silu


def torch_version() -> tuple[int, int]:
    """(major, minor) of the torch in this process ("2.13.0+cpu" -> (2, 13))."""
    major, minor = (torch.__version__.split("+")[0].split(".") + ["0"])[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def onednn_ops_work() -> bool:
    """The fused ops exist here and give x @ w.t() (plain, silu, add) on a 2x4 @ 4x3 GEMM."""
    if torch_version() < ONEDNN_MIN_TORCH or not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    try:
        with torch.no_grad():
            x = torch.linspace(-1.0, 1.0, 8).reshape(2, 4)
            w = torch.linspace(0.5, -0.5, 12).reshape(3, 4)
            want = x @ w.t()
            packed = ops._reorder_linear_weight(w, None)  # private-ok: the adapter's guarded probe
            plain = ops._linear_pointwise(x, packed, None, "none", [], "")  # private-ok: as above
            silu = ops._linear_pointwise(x, packed, None, "swish", [], "")  # private-ok: as above
            add = ops._linear_pointwise.binary(x, want, packed, None, "add")  # private-ok: as above
    except (AttributeError, RuntimeError, TypeError):
        return False
    return all(torch.allclose(a, b, atol=1e-5) for a, b in ((plain, want), (silu, F.silu(want)), (add, 2 * want)))


ONEDNN_LINEAR: bool = onednn_ops_work()


def epilogue(y: torch.Tensor, post: Epilogue, other: torch.Tensor | None) -> torch.Tensor:
    """The elementwise op after a GEMM, unfused: what the oneDNN path computes inside it."""
    if post == "silu":
        return F.silu(y)
    if post == "mul":
        assert other is not None
        return y * other
    if post == "add":
        assert other is not None
        return y + other
    return y


def pack_linear_weight(w: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w [out, in] in the layout `linear_fused` multiplies by: oneDNN's pre-blocked copy in `dtype`
    (fp32, or bf16 for bf16 inputs), or (no oneDNN) the weight itself in `dtype`."""
    if ONEDNN_LINEAR:
        return torch.ops.mkldnn._reorder_linear_weight(w.to(dtype), None)  # private-ok: guarded (ONEDNN_LINEAR)
    return w.to(dtype).contiguous()


def linear_fused(
    x: torch.Tensor, packed: torch.Tensor, post: Epilogue = "none", other: torch.Tensor | None = None
) -> torch.Tensor:
    """post(x [m, in] @ w.t()) [m, out] with `packed` from `pack_linear_weight`; the epilogue inside
    oneDNN's GEMM (m >= 2 rows), or after a plain one."""
    if not ONEDNN_LINEAR:
        return epilogue(x @ packed.t(), post, other)
    ops = torch.ops.mkldnn
    if post in ("mul", "add"):
        assert other is not None
        return ops._linear_pointwise.binary(x, other, packed, None, post)  # private-ok: guarded
    return ops._linear_pointwise(x, packed, None, _ONEDNN_UNARY[post], [], "")  # private-ok: guarded


SCALED_MM: bool = hasattr(torch, "_scaled_mm")  # private-ok: the guard itself


def scaled_mm(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """(a * scale_a) @ (b * scale_b) in `out_dtype`: FP8 a [m, k] (row-major) and b [k, n]
    (column-major), fp32 scales per tensor ([]), per row of a ([m, 1]) or per column of b ([1, n]).
    torch's FP8 GEMM where there is one; else the dequantized product."""
    if SCALED_MM:
        return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)  # private-ok: guarded
    return ((a.float() * scale_a) @ (b.float() * scale_b)).to(out_dtype)


@functools.cache
def bf16_gemm_works() -> bool:
    """oneDNN's fused linear takes bf16 here (some CPUs' builds refuse it: AVX2-only machines) and
    gives x @ w.t() to bf16 rounding on a 2x4 @ 4x3 GEMM."""
    if not ONEDNN_LINEAR:
        return False
    try:
        with torch.no_grad():
            x = torch.linspace(-1.0, 1.0, 8).reshape(2, 4)
            w = torch.linspace(0.5, -0.5, 12).reshape(3, 4)
            packed = pack_linear_weight(w, torch.bfloat16)
            got = linear_fused(x.to(torch.bfloat16), packed).float()
    except (AttributeError, RuntimeError, TypeError):
        return False
    return torch.allclose(got, x @ w.t(), atol=2e-2)


@functools.cache
def native_bf16_gemm() -> bool:
    """True where oneDNN's fused linear runs bf16 on native bf16 dot-product instructions
    (AVX512-BF16 or AMX, read from /proc/cpuinfo): elsewhere bf16 is emulated, slower than fp32."""
    if not bf16_gemm_works():
        return False
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def tensor_version(t: torch.Tensor) -> int:
    """t's in-place write counter (-1: an inference tensor, or a torch without the counter)."""
    if t.is_inference():
        return -1
    return int(getattr(t, "_version", -1))  # private-ok: guarded, with a fallback


def counting_inductor(mode: str, on_compile: Callable[[], None]) -> Callable[..., Any]:
    """A torch.compile backend: inductor with `mode`'s options ("default", "max-autotune"),
    calling `on_compile()` once per graph it compiles (how pdserve counts compiles). inductor's
    `compile` and `list_mode_options` are importable but underscored (torch._inductor)."""
    from torch import _inductor  # noqa: PLC0415  # private-ok: the compile backend's entry points

    options = {} if mode == "default" else dict(_inductor.list_mode_options(mode))  # private-ok: as above

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        on_compile()
        return _inductor.compile(gm, example_inputs, options=options)  # private-ok: as above

    return backend
