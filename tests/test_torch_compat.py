"""engine/torch_compat.py: each guard says no where torch lacks what it guards, and each fallback
gives what the private op gives (so a torch release that drops one costs speed, not answers)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine import torch_compat
from engine.model.linear import DenseLinear, Fp8Linear

POSTS = ("none", "silu", "mul", "add")


def test_torch_version_parses_local_builds(monkeypatch):
    for text, want in (("2.13.0+cpu", (2, 13)), ("2.6.0", (2, 6)), ("2.8.0a0+git1234", (2, 8)), ("3", (3, 0))):
        monkeypatch.setattr(torch, "__version__", text)
        assert torch_compat.torch_version() == want


def test_onednn_guard_says_no_without_the_ops(monkeypatch):
    assert torch_compat.onednn_ops_work() == torch_compat.ONEDNN_LINEAR
    monkeypatch.setattr(torch_compat, "torch_version", lambda: (1, 13))
    assert not torch_compat.onednn_ops_work()
    monkeypatch.undo()
    monkeypatch.setattr(torch, "ops", SimpleNamespace(mkldnn=SimpleNamespace()))  # a release that renamed them
    assert not torch_compat.onednn_ops_work()


def _broken(*args, **kwargs):
    raise RuntimeError("unknown argument")


def test_onednn_guard_says_no_when_the_ops_changed_arguments(monkeypatch):
    ops = SimpleNamespace(_reorder_linear_weight=_broken, _linear_pointwise=_broken)
    monkeypatch.setattr(torch, "ops", SimpleNamespace(mkldnn=ops))
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: True)
    assert not torch_compat.onednn_ops_work()


@pytest.mark.parametrize("onednn", [True, False])
@pytest.mark.parametrize("post", POSTS)
def test_fused_linear_equals_plain_gemm_and_epilogue(monkeypatch, onednn, post):
    if onednn and not torch_compat.ONEDNN_LINEAR:
        pytest.skip("this torch has no oneDNN fused linear ops")
    monkeypatch.setattr(torch_compat, "ONEDNN_LINEAR", onednn)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 24, generator=g), torch.randn(16, 24, generator=g)
    other = torch.randn(5, 16, generator=g) if post in ("mul", "add") else None
    y = torch_compat.linear_fused(x, torch_compat.pack_linear_weight(w), post, other)
    assert torch.allclose(y, torch_compat.epilogue(x @ w.t(), post, other), atol=1e-5)


@pytest.mark.parametrize("layer", ["fp8", "fp32"])
def test_layers_answer_the_same_without_onednn(monkeypatch, layer):
    g = torch.Generator().manual_seed(1)
    lin = Fp8Linear(32, 48) if layer == "fp8" else DenseLinear(32, 48, torch.float32)
    lin.load(torch.randn(48, 32, generator=g) / 6)
    x, res = torch.randn(7, 32, generator=g), torch.randn(7, 48, generator=g)
    with torch.no_grad():
        fast = [lin(x), lin(x, "add", res), lin.swiglu(x), lin(x[:1])]
        monkeypatch.setattr(torch_compat, "ONEDNN_LINEAR", False)
        plain = [lin(x), lin(x, "add", res), lin.swiglu(x), lin(x[:1])]
    for a, b in zip(fast, plain):
        assert torch.allclose(a, b, atol=1e-4)


def test_scaled_mm_fallback_is_the_dequantized_product(monkeypatch):
    monkeypatch.setattr(torch_compat, "SCALED_MM", False)
    g = torch.Generator().manual_seed(2)
    a32, b32 = torch.randn(4, 32, generator=g), torch.randn(32, 8, generator=g)
    a, b = a32.to(torch.float8_e4m3fn), b32.t().contiguous().to(torch.float8_e4m3fn).t()  # b column-major
    sa, sb = torch.rand(4, 1, generator=g) + 0.5, torch.rand(1, 8, generator=g) + 0.5
    y = torch_compat.scaled_mm(a, b, sa, sb, torch.float32)
    want = (a.float() * sa) @ (b.float() * sb)
    assert y.dtype == torch.float32 and torch.allclose(y, want)


def test_tensor_version_counts_in_place_writes():
    t = torch.zeros(3)
    v = torch_compat.tensor_version(t)
    t.add_(1)
    assert torch_compat.tensor_version(t) == v + 1
    with torch.inference_mode():
        assert torch_compat.tensor_version(torch.zeros(3)) == -1
