"""Smoke tests of `pdserve bench chunks` and `pdserve bench article` on the tiny model with tiny
sweeps: the result files exist, carry provenance, and every measured figure is positive.
No timing assertions: the numbers depend on the machine."""

from __future__ import annotations

import json

import pytest

from cli import main
from engine import torch_compat
from engine.model import cpu_kernels
from tests.helpers import flags

COMMON = ["--model", "tiny", "--device", "cpu", "--no-progress", "--threads", "1"]


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and x > 0


@pytest.mark.slow  # child processes (NIXL peers, a benchmark run): seconds each
def test_bench_chunks_writes_result_plot_and_calibration(tmp_path, capsys):
    argv = flags(decode_batch=2, context=32, prompt_len=128, chunks="32,128", repeats=1, decode_repeats=2)
    rc = main(["bench", "chunks", *COMMON, *argv, *flags(out_dir=tmp_path, out="c", json=True)])
    assert rc == 0
    printed = json.loads(capsys.readouterr().out)
    r = json.loads((tmp_path / "c.json").read_text())
    assert printed["result"] == str(tmp_path / "c.json")
    prov = r["provenance"]
    assert prov["git_commit"] and prov["date_utc"] and prov["device"]["kind"] == "cpu"
    assert prov["config"]["decode_batch"] == 2
    assert [p["chunk"] for p in r["points"]] == [32, 128]
    assert [p["num_chunks"] for p in r["points"]] == [4, 1]
    for p in r["points"]:
        for k in (
            "prefill_s",
            "prefill_tok_s",
            "chunk_ms",
            "achieved_tflops",
            "mfu",
            "mixed_mean_ms",
            "mixed_max_ms",
            "itl_ratio",
        ):
            assert _positive(p[k]), (k, p[k])
        assert p["mixed_max_ms"] >= p["mixed_p50_ms"]
    assert _positive(r["decode_only_ms"]["median"])
    be = r["break_even_chunk"]
    # 0 is a legitimate calibrated answer: the fixed per-chunk cost alone exceeds a decode step
    assert _positive(be["predicted_spec"]) and be["predicted_calibrated"] >= 0
    assert r["spec"]["source_kind"] == "measured"  # a CPU has no datasheet
    assert _positive(r["probe"]["copy_gbps"]) and _positive(r["probe"]["gemm_tflops"])
    assert (tmp_path / "c.png").stat().st_size > 0
    # the calibration file is in the cost model's schema and loads back
    from costmodel.article.cost_model import Calibration

    cal = Calibration.load(tmp_path / "c.calibration.json")
    assert cal.dtype == "fp32" and _positive(cal.achieved_tflops)


@pytest.mark.slow  # child processes (NIXL peers, a benchmark run): seconds each
def test_bench_article_writes_tables_beside_predictions(tmp_path, capsys):
    argv = flags(kv_fill="random", batches="1,4", ctx=32, contexts="32,64", decode_repeats=2, prefill_repeats=1)
    rc = main(["bench", "article", *COMMON, *argv, *flags(out_dir=tmp_path, out="a")])
    assert rc == 0
    table = capsys.readouterr().out
    assert "decode step @ 32 ctx" in table and "predicted ms" in table
    r = json.loads((tmp_path / "a.json").read_text())
    assert r["provenance"]["config"]["batches"] == "1,4"
    rows = r["rows"]
    assert [(x["kind"], x["batch"], x["ctx"]) for x in rows] == [
        ("decode", 1, 32),
        ("decode", 4, 32),
        ("prefill", 1, 32),
        ("prefill", 1, 64),
    ]
    for x in rows:
        assert _positive(x["measured_ms"]) and _positive(x["predicted_ms"]) and _positive(x["achieved"])
        assert x["error_pct"] == pytest.approx(100 * (x["predicted_ms"] - x["measured_ms"]) / x["measured_ms"])
    assert (tmp_path / "a.png").stat().st_size > 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "chunks", "--chunks", "64,x"], "--chunks must be comma-separated integers"),
        (["bench", "chunks", "--prompt-len", "64", "--chunks", "128"], "longer than --prompt-len"),
        (["bench", "article", "--model", "nope"], "not a preset"),
        (["bench", "article", "--ctx", "5000"], "exceed tiny's context"),
    ],
)
def test_bad_input_is_one_line_error(argv, message, capsys, tmp_path):
    assert main([*argv, "--device", "cpu", "--no-progress", "--out-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_bench_step_splits_every_step_and_compares_backends(tmp_path, capsys):
    """`bench step` on tiny: one row per (backend, batch), each decode step split into host parts
    and forward, beside its weight-read floor (weights / the copy bandwidth of that row), the
    backend ratio of the same run recorded."""
    rc = main(
        ["bench", "step", *COMMON, "--batches", "1,3", "--prompt-len", "20", "--new-tokens", "5",
         "--attention", "batched,reference", "--out-dir", str(tmp_path), "--out", "s", "--json"]
    )  # fmt: skip
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    assert json.loads((tmp_path / "s.json").read_text())["provenance"]["date_utc"]
    assert [(x["attention"], x["batch"]) for x in r["rows"]] == [
        ("batched", 1),
        ("batched", 3),
        ("reference", 1),
        ("reference", 3),
    ]
    for x in r["rows"]:
        assert x["decode_steps"] == 4  # 5 tokens: the first comes from the prefill step
        for k in ("forward_ms", "schedule_ms", "sample_ms", "output_ms", "host_ms", "e2e_s"):
            assert _positive(x[k]), (k, x)
        assert x["weight_bytes_per_step"] > 0 and x["torch_stack_ms"] > 0 and x["prefill_tokens_per_s"] > 0
        assert x["floor_ms"] == pytest.approx(x["weight_bytes_per_step"] / (x["copy_GBps"] * 1e9) * 1e3)
        assert x["decode_step_over_floor"] == pytest.approx(x["decode_step_ms"] / x["floor_ms"])
        assert x["kv_bytes_per_step"] > 0 and _positive(x["decode_step_vs_first_batch"])
    assert [x["decode_step_vs_first_batch"] for x in r["rows"] if x["batch"] == 1] == [1.0, 1.0]
    assert set(r["decode_step_ratio_vs_reference"]) == {"batched@1", "batched@3"}


@pytest.mark.skipif(not torch_compat.bf16_gemm_works(), reason="no bf16 oneDNN GEMM on this CPU")
def test_bench_step_side_by_side_gemm_dtypes_and_threads(tmp_path, capsys):
    """`--cpu-gemm fp32,bf16 --threads 1,2`: one row per (dtype, threads, batch) in one run, each
    with its own floor (a bf16 GEMM reads half the weight bytes) and its ratio to the first."""
    rc = main(
        ["bench", "step", *COMMON, "--batches", "2", "--prompt-len", "20", "--new-tokens", "4",
         "--cpu-gemm", "fp32,bf16", "--threads", "1,2", "--out-dir", str(tmp_path), "--out", "v", "--json"]
    )  # fmt: skip
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    assert [(x["cpu_gemm"], x["threads"]) for x in r["rows"]] == [("fp32", 1), ("fp32", 2), ("bf16", 1), ("bf16", 2)]
    fp32, bf16 = r["rows"][0], r["rows"][2]
    # tiny's projections are most of its weight bytes: under fp32 a decode step's projections read
    # their FP8 bytes (the FP8 kernel, where it is built) or fp32 copies; bf16 reads 2-byte copies
    ratio = bf16["weight_bytes_per_step"] / fp32["weight_bytes_per_step"]
    assert (1.3 < ratio < 2.0) if cpu_kernels.fp8_linear_op() is not None else (0.45 < ratio < 0.55), ratio
    assert r["decode_step_vs_first_variant"]["auto fp32 x1@2"] == 1.0
    assert len(r["decode_step_vs_first_variant"]) == 4
    assert main(["bench", "step", *COMMON, "--cpu-gemm", "fp16", "--out-dir", str(tmp_path)]) == 2
    assert "--cpu-gemm must be auto, fp32 or bf16" in capsys.readouterr().err
