"""`pdserve plan --verify` (benchmarks/plan_verify.py, verify_rows.py, verify_steps.py): the top
candidates deployed and measured (real Ray, uvicorn, the openai client), their steps read against the
plan's prices, rounds combined; and `--reprice` (benchmarks/plan_reprice.py), a verification's rows
predicted again without deploying anything.

The device model is the synthetic calibration of tests/test_plan.py (a step fit).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli import main as cli_main
from costmodel.article import cost_model as cm
from costmodel.fit.step_fit import StepCostFit
from costmodel.plan.candidates import Candidate

FIT = StepCostFit(0.005, 1e-3, 0.0, 1e-3, samples=100, rms_rel_error=0.1)


@pytest.fixture
def calibration(tmp_path):
    p = tmp_path / "synthetic.calibration.json"
    p.write_text(json.dumps(cm.Calibration(device="cpu", dtype="fp32", step_fit=FIT.to_dict()).to_dict()))
    return str(p)


def test_verify_deploys_the_winner_and_the_baseline_and_puts_measured_beside_predicted(
    ray_cluster, calibration, tmp_path, capsys
):
    argv = ["plan", "--calibration", calibration, "--model", "tiny", "--workers", "2", "--workload", "chat"]
    argv += ["--num-requests", "6", "--rate", "20", "--isl", "32", "--osl", "8", "--slo-ttft-ms", "5000"]
    argv += ["--verify", "1", "--settle-s", "0", "--out-dir", str(tmp_path), "--json"]
    assert cli_main(argv) == 0
    doc = json.loads(capsys.readouterr().out)  # one document: progress went to stderr
    v = doc["verification"]
    labels = [r["label"] for r in v["rows"]]
    assert labels[0] == doc["winner"] and len(labels) in (1, 2)
    assert set(labels[1:]) <= {"colocated x2", "disagg 1P1D"}  # the fixed baseline, unless it won
    for r in v["rows"]:
        assert r["error"] is None and r["measured_metrics"]["completed"] == 6
        assert r["machine_pace_at_start"]["gemm_gflops_1thread"] > 0 and r["machine_pace_at_start"]["copy_gbps"] > 0
        # the workers' own steps of the timed pass, against the prices the plan gave them
        for pool in r["step_prices"].values():
            assert pool["steps"] >= 1 and 0 < pool["ratio_p50"] <= pool["ratio_p90"]
        # the serving pace: where a worker prefills and decodes, prompts computed beside the burst's decoding
        pace = [dict(zip(r["pace_steps"]["columns"], x, strict=True)) for x in r["pace_steps"]["rows"]]
        assert r["label"].startswith("disagg") or any(x["prefill_tokens"] and x["decode_seqs"] >= 2 for x in pace)
        m = r["measured"]
        assert 0.0 <= m["attainment"]["ttft"] <= 1.0 and m["attainment"]["tpot"] is None  # no TPOT SLO asked
        assert m["goodput_per_worker"] > 0 and r["predicted"]["goodput_per_worker"] > 0
    assert v["regret"] is not None and 0.0 <= v["regret"] < 1.0 and v["best_measured"] in labels
    saved = json.loads((tmp_path / "plan-verify-chat.json").read_text())
    assert saved["provenance"] and saved["verification"]["rows"] == v["rows"]
    # --reprice: the same rows predicted again, nothing deployed; read from another folder, the result
    # finds its calibration beside it
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    config = {**saved["provenance"]["config"], "calibration": "/gone/synthetic.calibration.json"}
    elsewhere = {**saved, "provenance": {**saved["provenance"], "config": config}}
    (moved / "plan-verify-chat.json").write_text(json.dumps(elsewhere))
    (moved / "synthetic.calibration.json").write_text(open(calibration).read())
    assert cli_main(["plan", "--reprice", str(moved / "plan-verify-chat.json"), "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert [r["label"] for r in again["rounds"]] == labels
    for r, kept in zip(again["rounds"], v["rows"], strict=True):
        assert r["measured"] == kept["measured"] and r["kept"] == kept["predicted"]
        # the p90s beside the attainments, measured and predicted: an edge candidate's miss is read there
        mm = kept["measured_metrics"]
        assert r["p90_ms"]["measured"] == {k: mm[k] for k in ("ttft_p90_ms", "tpot_p90_ms", "stall_p90_ms")}
        assert r["p90_ms"]["plain"]["tpot_p90_ms"] > 0
        assert r["plain"]["goodput_per_worker"] == pytest.approx(kept["predicted"]["goodput_per_worker"])
        # the plan's interval now is the one the verification judged its measured goodput against
        interval = kept["plan_goodput_interval"]
        assert r["goodput_interval"] == (pytest.approx(interval) if interval else None)
        if kept["predicted_at_this_pace"] and kept["pace_basis"] == "serving":  # the same code, the same steps
            assert r["at_pace"]["goodput_per_worker"] == pytest.approx(
                kept["predicted_at_this_pace"]["goodput_per_worker"], rel=1e-3
            )
        if kept["predicted_at_run_pace"]:  # (a kept step's time is rounded to the microsecond)
            assert r["at_run"]["goodput_per_worker"] == pytest.approx(
                kept["predicted_at_run_pace"]["goodput_per_worker"], rel=1e-3
            )
    assert again["summary"]["rounds"] == len(labels)
    # the folder: every result in it re-priced at its own flags, the accuracy ledger over them
    (moved / "not-a-result.json").write_text(json.dumps({"provenance": {}}))  # passed over
    assert cli_main(["plan", "--reprice", str(moved), "--json"]) == 0
    folder = json.loads(capsys.readouterr().out)
    assert [Path(r["result"]).name for r in folder["results"]] == ["plan-verify-chat.json"]
    assert folder["results"][0]["rounds"] == again["rounds"]  # the same rows as the file alone
    total = folder["ledger"]["all"]
    assert total["rounds"] == sum(folder["ledger"][c]["rounds"] for c in ("off_edge", "on_edge", "not_judged"))
    assert total["rounds"] <= len(labels) and 0 <= total["both"] <= total["rounds"]
    assert total["plain_misses_within_at_run_pace"] <= total["plain_misses_with_run_pace"] <= total["rounds"]
    inside = [lo <= r["measured"]["goodput_per_worker"] <= hi for r in again["rounds"] if r["goodput_interval"]
              for lo, hi in [r["goodput_interval"]]]  # fmt: skip
    assert (total["goodput_inside_interval"], total["rounds_with_interval"]) == (sum(inside), len(inside))
    assert 0 <= total["pace_alone_past_targets"] <= total["pace_alone_rounds"] <= total["rounds_with_run_pace"]
    # another calibration judged on the same measured runs: every step priced twice as dear
    dear = tmp_path / "dear.calibration.json"
    dear_fit = StepCostFit(0.010, 2e-3, 0.0, 2e-3, samples=100, rms_rel_error=0.1)
    dear.write_text(json.dumps(cm.Calibration(device="cpu", dtype="fp32", step_fit=dear_fit.to_dict()).to_dict()))
    argv = ["plan", "--reprice", str(moved / "plan-verify-chat.json"), "--calibration", str(dear), "--json"]
    assert cli_main(argv) == 0
    other = json.loads(capsys.readouterr().out)
    assert other["calibration"] == str(dear)
    for r, kept in zip(other["rounds"], v["rows"], strict=True):
        assert r["kept"] == kept["predicted"]  # the result's own, whatever re-prices it
        assert r["plain"]["goodput_per_worker"] < kept["predicted"]["goodput_per_worker"]


def test_verify_takes_a_small_count(calibration, capsys):
    assert cli_main(["plan", "--calibration", calibration, "--model", "tiny", "--verify", "20"]) == 2
    assert "--verify must be 0-8" in capsys.readouterr().err


def test_step_prices_read_each_pools_steps_against_the_plans_price():
    from benchmarks.client.logged_step import LoggedStep
    from benchmarks.verify_steps import step_prices
    from costmodel.fit.step_fit import StepShape
    from costmodel.sim.compare_predict import setup_from_steps

    setup = setup_from_steps("tiny", FIT, StepCostFit(0.0, 2e-3, 0.0, 0.0), None, "t", 1)
    decode = [StepShape.of([100] * b) for b in (1, 4, 8, 8)]
    steps = [LoggedStep("d-0", "decode", sh, FIT.seconds(sh) * k) for sh, k in zip(decode, (1.0, 1.2, 1.4, 1.6))]
    steps.append(LoggedStep("p-0", "prefill", StepShape.of((), [(0, 500)]), 2.0))  # 2x its 1 s price
    got = step_prices(steps, setup)
    assert got["decode"]["steps"] == 4 and got["decode"]["largest_batch"] == 8
    assert got["decode"]["ratio_p50"] == pytest.approx(1.4) and got["decode"]["ratio_p90"] == pytest.approx(1.6)
    assert got["prefill"]["ratio_p50"] == pytest.approx(2.0)  # priced by the prefill pool's own fit
    assert "prompt_steps" not in got["prefill"] and "prompt_steps" not in got["decode"]  # one kind of step each
    mixed = StepShape.of([100], [(0, 300)])
    steps.append(LoggedStep("d-0", "decode", mixed, FIT.seconds(mixed) * 3.0))  # a chunk beside a decode row
    got = step_prices(steps, setup)["decode"]
    assert got["prompt_steps"]["steps"] == 1 and got["prompt_steps"]["time_ratio"] == pytest.approx(3.0)


def test_a_verification_reprices_at_the_pace_it_measured(tmp_path):
    """A `bench compare` result records the machine's pace per mode; a verified candidate is
    predicted again with its steps priced at the pace measured before its server."""
    from benchmarks.compare.calibrate import transfer
    from benchmarks.compare.calibrate.calibration import PoolFit, SelfCalibration
    from benchmarks.verify_rows import VerifyRow, format_verification, summarize
    from costmodel.plan.score import Judged, Slos, priced_at, score
    from costmodel.workloads import RequestSpec

    cal = SelfCalibration({"colocated": PoolFit("colocated", FIT, 100, 0, 1)}, 10.0, 4, None, longest_prompt=300)
    mode = {"label": "colocated", "spec": {"mode": "colocated", "chunk_size": None, "decode": 1}}
    mode |= {"self_calibration": cal.to_dict(), "serving_overhead": {"hop_ms": 10.0}}
    mode |= {"machine_pace": {"gemm_gflops_1thread": 140.0, "copy_gbps": 10.0}}
    path = tmp_path / "paced.json"
    path.write_text(
        json.dumps({"provenance": {"config": {"bench_command": "compare", "model": "tiny"}}, "modes": [mode]})
    )
    setup = transfer.by_kind(transfer.load(path, "tiny")[0])["colocated"]
    assert setup.pace_gflops == 140.0
    specs = [RequestSpec(f"r{i}", (1,) * 200, 200, 32, i * 0.05, "chat") for i in range(12)]
    cand = Candidate("colocated", 1)
    slow = score(cand, priced_at(setup, 1.4), specs, Slos(), 64)  # the machine at 100 GFLOP/s: steps 1.4x
    fast = score(cand, setup, specs, Slos(), 64)
    assert slow.metrics.tpot_ms.p50 > 1.35 * fast.metrics.tpot_ms.p50  # (and the queue grows with it)
    row = VerifyRow(cand, 1, Judged({}, True, 1.0), Judged({}, True, 0.8), {}, pace_ratio=1.4)
    row.pace_adjusted = Judged({}, True, 0.82)
    summary = summarize([row], "colocated")
    assert summary["goodput_error_max"] == pytest.approx(0.25) and summary[
        "goodput_error_max_at_pace"
    ] == pytest.approx(0.025)
    assert "0.820/s" in format_verification([row], summary)


def test_repeated_rounds_give_each_candidate_its_mean_and_the_spread_between_rounds():
    """--repeats R: a row is the mean of its rounds, SLOs met only where every round met them; the
    summary gives the spread between rounds and the regret within each round alone."""
    from benchmarks.verify_rows import VerifyRow, combine, format_verification, summarize
    from costmodel.plan.score import Judged

    def rounds(cand: Candidate, pred: float, got: list[tuple[float, float, bool]]) -> VerifyRow:
        p = Judged({"ttft": 1.0, "tpot": 1.0, "stall": None}, True, pred)
        return combine([
            VerifyRow(cand, 1, p, Judged({"ttft": 1.0, "tpot": tpot, "stall": None}, meets, g), {})
            for g, tpot, meets in got
        ])  # fmt: skip

    a = rounds(Candidate("colocated", 2), 1.0, [(0.9, 0.9, True), (1.1, 0.8, False)])
    b = rounds(Candidate("chunked", 2, chunk=256), 0.9, [(1.0, 1.0, True), (0.8, 1.0, True)])
    assert a.measured is not None and a.measured.goodput_per_worker == pytest.approx(1.0)
    assert a.measured.attainment["tpot"] == pytest.approx(0.85) and a.measured.attainment["stall"] is None
    assert not a.measured.meets and b.measured is not None and b.measured.meets
    assert a.goodput_range == (0.9, 1.1) and len(a.to_dict()["rounds"]) == 2
    summary = summarize([a, b], a.candidate.label)
    assert summary["regret"] == 0.0 and summary["regret_per_round"] == pytest.approx([0.1, 0.0])
    assert summary["goodput_spread_max"] == pytest.approx(0.2 / 0.9)  # b: 0.8-1.0 around 0.9
    table = format_verification([a, b], summary)
    assert "0.900-1.100" in table and "each round alone: 10.0%, 0.0%" in table


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--verify", "1", "--repeats", "9"], "--repeats must be 1-4"),
        (["--repeats", "2"], "give --verify too"),
        (["--max-risk", "1.5"], "--max-risk must be 0-1"),
        (["--max-loss", "-0.1"], "--max-loss must be 0-1"),
        (["--price-drift", "2"], "--price-drift must be 0-1"),
    ],
)
def test_repeats_and_risk_limits_are_checked(calibration, capsys, extra, message):
    assert cli_main(["plan", "--calibration", calibration, "--model", "tiny", *extra]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--reprice", "/no/such/result.json"], "--reprice /no/such/result.json:"),
        (["--reprice", "RESULT", "--verify", "1"], "give it without --verify"),
        (["--reprice", "RESULT", "--slo-stall-ms", "500"], "not a stall's"),
        (["--reprice", "DIR"], "no `pdserve plan --verify` results in this folder"),
        (["--reprice", "DIR", "--slo-tpot-ms", "100"], "at its own calibration and SLOs"),
    ],
)
def test_reprice_errors_are_one_line(tmp_path, capsys, extra, message):
    extra = [str(tmp_path / "r.json") if x == "RESULT" else str(tmp_path) if x == "DIR" else x for x in extra]
    assert cli_main(["plan", *extra]) == 2
    assert message in capsys.readouterr().err


def test_reprice_refuses_a_result_without_verified_rows(calibration, tmp_path, capsys):
    path = tmp_path / "plan-only.json"
    path.write_text(json.dumps({"provenance": {"config": {"calibration": calibration, "model": "tiny"}}}))
    assert cli_main(["plan", "--reprice", str(path)]) == 2
    assert "no verified rows" in capsys.readouterr().err


def test_reprice_judges_measured_requests_again_at_other_slos():
    """`--reprice` with other TTFT/TPOT SLOs: a round's kept requests judged at them; its duration
    (per worker) read back from the goodput it measured at the SLOs it ran with."""
    from benchmarks.plan_reprice import rejudged
    from costmodel.plan.score import Slos

    reqs = [{"ttft_ms": [None, t], "tpot_ms": [None, p]} for t, p in ((100, 50), (200, 150), (300, 250), (400, None))]
    # ran at TTFT 450 / TPOT 200: requests 1, 2 and 4 met them (4 decoded one token), 3 per second per worker
    rnd = {"requests": reqs, "measured": {"goodput_per_worker": 3.0}}
    ran = Slos(450.0, 200.0)
    loose = rejudged(rnd, ran, Slos(1000.0, 1000.0))
    assert loose is not None and loose.goodput_per_worker == pytest.approx(4.0) and loose.meets
    assert loose.attainment == {"ttft": 1.0, "tpot": 1.0, "stall": None}
    tight = rejudged(rnd, ran, Slos(None, 100.0))  # TPOT only: request 1, and 4 with no TPOT
    assert tight is not None and tight.goodput_per_worker == pytest.approx(2.0) and not tight.meets
    assert tight.attainment["ttft"] is None and tight.attainment["tpot"] == pytest.approx(1 / 3)
    assert rejudged({"requests": reqs, "measured": {"goodput_per_worker": 0.0}}, ran, Slos(1000.0)) is None
