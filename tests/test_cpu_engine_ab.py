"""`benchmarks/cpu_engine_ab_summary.py`: the CPU engine A/B's rows read from what each server run
left (the bench's metrics, the worker step log, the start record), and new/old ratios per mode."""

from __future__ import annotations

import json

import pytest

from benchmarks.cpu_engine_ab_summary import main, ratios, run_row


def _run(d, label, tok_s, itl, step_s, threads=None, gemm=None):
    metrics = {
        "output_throughput": tok_s,
        "itl_ms": {"p50": itl, "p90": itl * 1.2},
        "ttft_ms": {"p50": 1000.0},
        "completed": 32,
    }
    (d / f"{label}.json").write_text(json.dumps({"metrics": metrics}))
    steps = [
        {"prefill_tokens": 512, "decode_seqs": 0, "seconds": 0.5},
        *({"prefill_tokens": 0, "decode_seqs": 8, "seconds": step_s} for _ in range(5)),
    ]
    worker = {"worker": "colocated-0", "role": "colocated", "steps": steps}
    if threads:
        worker.update(torch_threads=threads, cpu_gemm=gemm)
    (d / f"{label}.steps.json").write_text(json.dumps({"data": [worker]}))
    (d / f"{label}.start.json").write_text(json.dumps({"ready_s": 12.0, "load_at_start": 0.3}))


def test_rows_and_ratios_come_from_the_runs_of_one_ab(tmp_path, capsys):
    _run(tmp_path, "old-colocated-1", 40.0, 100.0, 0.1)
    _run(tmp_path, "new-colocated-1", 50.0, 90.0, 0.09, threads=1, gemm="bf16")
    _run(tmp_path, "new-colocated-2", 60.0, 90.0, 0.09, threads=1, gemm="bf16")
    old = run_row(tmp_path, "old-colocated-1")
    assert old is not None and old["decode_cpu_gemm"] == "fp32" and old["decode_torch_threads"] is None
    assert old["decode8_step_p50_ms"] == pytest.approx(100.0)
    assert old["prefill_us_per_token"] == pytest.approx(0.5 / 512 * 1e6)
    assert run_row(tmp_path, "old-colocated-9") is None  # a server that never started
    rows = [run_row(tmp_path, lb) for lb in ("old-colocated-1", "new-colocated-1", "new-colocated-2")]
    r = ratios([x for x in rows if x is not None])["colocated"]
    assert r["output_tok_s"] == pytest.approx(55.0 / 40.0) and r["itl_p50_ms"] == pytest.approx(0.9)
    out = tmp_path / "sum" / "ab.json"
    assert main([str(tmp_path), str(tmp_path), "--out", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert saved["provenance"]["date_utc"] and len(saved["rows"]) == 3
    assert "colocated: new/old output_tok_s 1.38x" in capsys.readouterr().out
