"""bench compare's per-request accuracy and auto report (benchmarks/compare/auto.py), on records
built by hand: the arithmetic, not a server."""

import json

import pytest

from benchmarks.compare import auto as ca
from costmodel.article.cost_model import Calibration
from costmodel.fit.step_fit import StepCostFit
from costmodel.serve_metrics import RequestRecord


def rec(rid, prompt, times, send=0.0, dispatch=None):
    return RequestRecord(rid, "chat" if prompt < 256 else "document", prompt, len(times), 0.0, send_s=send,
                         chunk_times_s=times, end_s=times[-1], dispatch=dispatch)  # fmt: skip


def test_per_request_errors_and_shares():
    measured = [rec("a", 32, [0.10, 0.12, 0.14]), rec("b", 2048, [0.50, 0.60])]
    predicted = [rec("a", 32, [0.11, 0.13, 0.15]), rec("b", 2048, [0.25, 0.35])]
    rows = ca.per_request(measured, predicted)
    assert rows[0]["ttft_ms"]["error"] == pytest.approx(0.1)
    assert rows[1]["ttft_ms"]["error"] == pytest.approx(-0.5)
    assert rows[0]["itl_p50_ms"]["measured"] == pytest.approx(20.0)
    acc = ca.accuracy_summary(rows)
    assert acc["ttft_ms"]["within_15pct"] == 0.5 and acc["ttft_ms"]["n"] == 2
    buckets = ca.ttft_by_bucket(measured)
    assert [b["bucket"] for b in buckets] == ["1-64", "1025-4096"]


def test_dispatch_summary_counts_and_errors():
    d = lambda choice, pred, real: {  # noqa: E731
        "decision": choice, "streams_in_flight": 1, choice: {"ttft_ms": pred},
        "outcome": {"ttft_ms": real, "ttft_error": (pred - real) / real},
    }  # fmt: skip
    a = rec("a", 32, [0.1, 0.2], dispatch=d("local", 100.0, 95.0))
    b = rec("b", 900, [0.5, 0.6], dispatch=d("remote", 300.0, 500.0))
    rows = ca.per_request([a, b], None)
    s = ca.dispatch_summary(rows)
    assert s["decisions"] == {"local": 1, "remote": 1}
    assert s["ttft_within_15pct_router"] == 0.5
    assert ca.dispatch_summary(ca.per_request([rec("c", 32, [0.1])], None)) is None


def test_boundary_moves_left_as_streams_grow(tmp_path):
    fit = StepCostFit(0.006, 60e-6, 0.1e-6, 1.5e-3)
    p = tmp_path / "cal.json"
    p.write_text(json.dumps(Calibration(device="cpu", dtype="fp32", peak_tflops=0.1, step_fit=fit.to_dict()).to_dict()))
    b = ca.boundary(p, "tiny", 128, 1000.0, 50.0, ctx=300, max_streams=8, max_prompt=4096)
    cuts = [x["remote_from_prompt"] for x in b]
    # short prompts stay local (no transfer); the more streams a local prefill would stall, the
    # shorter the prompt that already goes remote
    assert all(c is not None for c in cuts)
    assert all(a >= b for a, b in zip(cuts, cuts[1:])) and cuts[-1] < cuts[0]
