"""`pdserve plan` (costmodel/plan/, costmodel/plan_cli.py): candidates, ranking, output, errors.

The device model is a synthetic calibration (a step fit) whose prefill is expensive beside cheap
decode steps: a long prompt run whole stalls the streams for seconds, so a stall SLO separates
the candidates the way the article says it should.
"""

from __future__ import annotations

import json
import math

import pytest

from cli import main as cli_main
from costmodel.article import cost_model as cm
from costmodel.fit.step_fit import StepCostFit
from costmodel.plan.candidates import Candidate, enumerate_candidates

# 5 ms a step, 1 ms a prompt token, 1 ms a decode sequence: a 2048-token prompt is ~2 s of prefill
FIT = StepCostFit(0.005, 1e-3, 0.0, 1e-3, samples=100, rms_rel_error=0.1)


def _plan_json(capsys, *args: str) -> dict:
    """`pdserve plan ARGS --json`: exit 0 and exactly one JSON document on stdout."""
    assert cli_main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture
def calibration(tmp_path):
    p = tmp_path / "synthetic.calibration.json"
    p.write_text(json.dumps(cm.Calibration(device="cpu", dtype="fp32", step_fit=FIT.to_dict()).to_dict()))
    return str(p)


def test_candidates_cover_the_budget():
    cands = enumerate_candidates(3, [64, 128, 4096], longest_prompt=2048)
    assert [c.label for c in cands] == [
        "colocated",
        "chunked 64",
        "chunked 128",  # 4096: no prompt fills it, the same as whole prompts
        "colocated x2",
        "chunked 64 x2",
        "chunked 128 x2",
        "disagg 1P1D",
        "disagg 1P1D layerwise",
        "colocated x3",
        "chunked 64 x3",
        "chunked 128 x3",
        "disagg 1P2D",
        "disagg 1P2D layerwise",
        "disagg 2P1D",
        "disagg 2P1D layerwise",
    ]
    assert Candidate("chunked", 2, chunk=128).serve_args() == [
        "--mode",
        "colocated",
        "--decode",
        "2",
        "--chunk-size",
        "128",
        *("--policy", "least_loaded"),  # several workers in a pool: as the simulator dispatches
    ]
    assert Candidate("disagg", 3, prefill=1).serve_args() == [
        *("--mode", "disagg", "--prefill", "1", "--decode", "3", "--kv-transfer", "bulk", "--policy", "least_loaded")
    ]
    assert Candidate("disagg", 1, prefill=1).serve_args()[-1] == "bulk"
    assert "--policy" not in Candidate("colocated", 1).serve_args()
    assert len(enumerate_candidates(16, [64, 128, 256, 512, 1024], 2048)) == 16 * 6 + 2 * (15 * 16 // 2)
    with pytest.raises(ValueError):
        enumerate_candidates(0, [], 10)


def test_a_stall_slo_rules_out_whole_prompts_and_the_plan_says_why(calibration, capsys):
    doc = _plan_json(capsys, "--calibration", calibration, "--model", "tiny", "--workers", "2", "--slo-stall-ms", "500")
    assert doc["predicted"] is True
    by_label = {c["label"]: c for c in doc["candidates"]}
    # 1-2 workers: whole and chunks of 64-1024 at each; 1P1D bulk, layer-wise, and auto with each chunk
    assert len(by_label) == 2 * 6 + 2 + 5 and "disagg 1P1D layerwise" in by_label and "chunked 64" in by_label
    assert "auto 1P1D chunks 64" in by_label
    whole = by_label["colocated x2"]["predicted"]
    assert whole["stall_p90_ms"] > 1500 and not whole["meets_slos"]  # a 2048-token prompt whole: ~2 s
    winner = doc["candidates"][0]
    assert winner["label"] == doc["winner"] and winner["predicted"]["meets_slos"]
    assert winner["predicted"]["stall_p90_ms"] <= 500
    assert doc["serve_command"] == "pdserve serve --model tiny " + " ".join(winner["serve_args"])
    assert "prefill tax" in doc["why"] and doc["winner"] in doc["why"]
    # ranked: every candidate that meets the SLOs before any that does not, by goodput per worker
    meets = [c["predicted"]["meets_slos"] for c in doc["candidates"]]
    assert meets == sorted(meets, reverse=True)


def test_the_table_says_predicted_and_names_the_command(calibration, capsys):
    assert (
        cli_main(["plan", "--calibration", calibration, "--model", "tiny", "--workload", "rag", "--workers", "3"]) == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("predicted (simulated), not measured")
    assert (
        "disagg 2P1D" in out
        and "colocated x3" in out
        and "plan: " in out
        and "pdserve serve --model tiny --mode" in out
    )
    assert "none measured" in out


def test_datasheet_planning_for_the_articles_setting(capsys):
    argv = ["plan", "--gpu", "h100", "--model", "llama-3.1-70b", "--workers", "4", "--slo-stall-ms", "1000", "--json"]
    assert cli_main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["device_model"]["kind"] == "datasheet" and "h100-sxm datasheet" in doc["device_model"]["source"]
    # 1-4 workers: whole and chunks of 64-1024 (2048 is the document) at each, 0+1+2+3 splits x bulk/layerwise
    assert len(doc["candidates"]) == 4 * 6 + 2 * 6


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([], "give one device model"),
        (["--gpu", "h100", "--calibration", "x.json"], "give one device model"),
        (["--gpu", "tpu-v9"], "--gpu tpu-v9: unknown"),
        (["--calibration", "/nonexistent.json"], "no such file"),
        (["--gpu", "h100", "--num-requests", "5"], "--num-requests does not apply to --workload article"),
        (["--gpu", "h100", "--workers", "0"], "--workers must be 1-64"),
        (["--gpu", "h100", "--link", "carrier-pigeon"], "--link carrier-pigeon: unknown"),
        (["--gpu", "h100", "--max-num-seqs", "0"], "--max-num-seqs must be > 0"),
        (["--gpu", "h100", "--slo-stall-ms", "-5"], "--slo-stall-ms must be > 0"),
        (["--gpu", "h100", "--chunk-sizes", "64,big"], "--chunk-sizes/--workers"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(extra, message, capsys):
    assert cli_main(["plan", "--model", "tiny", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_the_top_candidates_carry_an_interval_from_the_fits_own_error(calibration, capsys):
    doc = _plan_json(capsys, "--calibration", calibration, "--model", "tiny", "--workers", "2", "--slo-stall-ms", "500")
    assert doc["device_model"]["fit_error"] == pytest.approx(0.1)
    top = [c["predicted"] for c in doc["candidates"][:5]]
    assert all(p["interval"] is not None for p in top) and doc["candidates"][5]["predicted"]["interval"] is None
    for p in top:
        lo, hi = p["interval"]["stall_p90_ms"]
        assert lo <= p["stall_p90_ms"] <= hi and lo < hi  # cheaper steps, shorter stalls
        g_lo, g_hi = sorted(p["interval"]["goodput_per_worker"])
        assert g_lo <= p["goodput_per_worker"] <= g_hi
        assert p["price_error"] == pytest.approx(math.hypot(0.1, 0.1))  # its fit's error and the machine's drift
    assert "priced 14% lower or higher" in doc["why"]
    no_drift = _plan_json(capsys, "--calibration", calibration, "--model", "tiny", "--price-drift", "0")
    assert "priced 10% lower or higher" in no_drift["why"]


def test_a_trace_is_planned_as_given_and_its_errors_name_the_line(calibration, tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    rows = [{"arrival_s": i * 0.2, "prompt_tokens": 64, "output_tokens": 32, "prefix_id": "sys"} for i in range(6)]
    rows.append({"arrival_s": 0.5, "prompt_tokens": 2048, "output_tokens": 4})  # a document, by its length
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    argv = ["plan", "--calibration", calibration, "--model", "tiny", "--trace", str(trace), "--json"]
    assert cli_main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["workload"]["requests"] == 7 and doc["workload"]["preset"] is None
    assert "6 requests carry a prefix_id" in doc["workload"]["note"]
    whole = next(c for c in doc["candidates"] if c["label"] == "colocated x2")["predicted"]
    assert whole["stall_p90_ms"] is not None  # the 2048-token prompt counted as a document
    trace.write_text('{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 1}\n{"arrival_s": 1}\n')
    assert cli_main(argv[:-1]) == 2
    assert f"{trace}:2: want {{arrival_s, prompt_tokens, output_tokens}}" in capsys.readouterr().err
    assert cli_main([*argv[:-1], "--rate", "3"]) == 2
    assert "--trace gives the requests" in capsys.readouterr().err


def test_a_compare_result_prices_each_candidate_by_the_fit_to_the_server_of_its_kind(tmp_path, capsys):
    """--calibration <bench compare result>: its colocated server's fit prices whole-prompt
    candidates, its chunked server's the chunked ones; a dearer chunked fit shows in every chunked row."""
    from benchmarks.compare.calibrate.calibration import PoolFit, SelfCalibration

    def mode(label: str, chunk: int | None, fit: StepCostFit) -> dict:
        cal = SelfCalibration({"colocated": PoolFit("colocated", fit, 100, 0, 1)}, 10.0, 4, None, longest_prompt=300)
        spec = {"mode": "colocated", "chunk_size": chunk}
        return {"label": label, "spec": spec, "self_calibration": cal.to_dict(), "serving_overhead": {"hop_ms": 10.0}}

    dear = StepCostFit(0.005, 3e-3, 0.0, 1e-3, samples=100, rms_rel_error=0.1)  # prompt tokens at 3x
    doc = {
        "provenance": {"config": {"bench_command": "compare", "model": "tiny"}},
        "modes": [mode("colocated", None, FIT), mode("chunked-128", 128, dear)],
    }
    path = tmp_path / "compare-x.json"
    path.write_text(json.dumps(doc))
    args = ("--model", "tiny", "--workers", "1", "--slo-stall-ms", "500")
    by_kind = _plan_json(capsys, "--calibration", str(path), *args)
    assert set(by_kind["device_model"]["by_kind"]) == {"colocated", "chunked", "chunked 128"}
    # the article's 2048-token documents, a fit that saw 300-token prompts: said, not hidden
    assert "reach 2048 tokens" in by_kind["workload"]["note"] and "extrapolated" in by_kind["workload"]["note"]
    short = _plan_json(capsys, "--calibration", str(path), *args[:4], "--workload", "chat", "--isl", "128")
    assert "the calibration's prompts reach 300 tokens, the workload's" in short["workload"]["note"]
    one = tmp_path / "one.calibration.json"
    one.write_text(json.dumps(cm.Calibration(device="cpu", dtype="fp32", step_fit=FIT.to_dict()).to_dict()))
    flat = _plan_json(capsys, "--calibration", str(one), *args)
    stall = lambda d, label: next(c for c in d["candidates"] if c["label"] == label)["predicted"]["stall_p90_ms"]  # noqa: E731
    assert stall(by_kind, "colocated") == pytest.approx(stall(flat, "colocated"))  # the same fit
    assert stall(by_kind, "chunked 128") > 1.5 * stall(flat, "chunked 128")  # the chunked server's dearer fit


def test_a_chunked_candidate_is_priced_by_the_fit_to_its_own_chunk_size_else_the_nearest_run():
    """Several chunk sizes run (bench compare --chunk-sizes 128,512): each candidate is priced by
    its own size's fit, else the nearest by ratio (the smaller on a tie), per worker count."""
    from benchmarks.compare.calibrate.transfer import Transferred, by_kind
    from costmodel.plan.pricing import setup_for

    def t(name: str, kind: str, workers: int = 1, chunk: int | None = None) -> Transferred:
        return Transferred(name, 0.0, {}, kind, workers, chunk)  # type: ignore[arg-type]

    found = [t("C", "colocated"), t("K512", "chunked", 1, 512), t("K128", "chunked", 1, 128)]
    found += [t("K128x2", "chunked", 2, 128)]
    kinds = by_kind({x.setup: x for x in found})  # type: ignore[misc]
    assert kinds["chunked"] == "K128" and kinds["chunked x2"] == "K128x2" and kinds["chunked 512"] == "K512"
    price = lambda c: setup_for(c, kinds, "default")  # type: ignore[arg-type]  # noqa: E731
    assert price(Candidate("chunked", 1, chunk=512)) == "K512" and price(Candidate("chunked", 1, chunk=1024)) == "K512"
    assert price(Candidate("chunked", 1, chunk=256)) == "K128"  # a tie: the smaller size's
    assert price(Candidate("chunked", 1, chunk=64)) == "K128" and price(Candidate("chunked", 2, chunk=512)) == "K128x2"
    assert price(Candidate("colocated", 2)) == "C" and price(Candidate("chunked", 3, chunk=64)) == "K128"


def test_several_compare_results_price_each_worker_count_by_its_own_server(tmp_path, capsys):
    """--calibration A,B: a run of 1-worker servers and one of `--decode 2`; candidates with two
    workers on the host are priced by the two-worker server's fit, and without one the plan says so."""
    from benchmarks.compare.calibrate.calibration import PoolFit, SelfCalibration

    def result(name: str, decode: int, fit: StepCostFit):
        cal = SelfCalibration({"colocated": PoolFit("colocated", fit, 100, 0, 1)}, 10.0, 4, None, longest_prompt=3000)
        mode = {"label": "colocated", "spec": {"mode": "colocated", "chunk_size": None, "decode": decode}}
        mode |= {"self_calibration": cal.to_dict(), "serving_overhead": {"hop_ms": 10.0}}
        doc = {"provenance": {"config": {"bench_command": "compare", "model": "tiny"}}, "modes": [mode]}
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(doc))
        return str(path)

    contended = StepCostFit(0.01, 2e-3, 0.0, 2e-3, samples=100, rms_rel_error=0.1)  # two workers: 2x dearer
    one, two = result("one", 1, FIT), result("two", 2, contended)
    args = ("--model", "tiny", "--workers", "2", "--workload", "chat", "--num-requests", "8", "--isl", "256")
    both = _plan_json(capsys, "--calibration", f"{one},{two}", *args)
    alone = _plan_json(capsys, "--calibration", one, *args)
    assert set(both["device_model"]["by_kind"]) == {"colocated", "colocated x2"}
    tpot = lambda d, label: next(c for c in d["candidates"] if c["label"] == label)["predicted"]["tpot_p90_ms"]  # noqa: E731
    assert tpot(both, "colocated") == pytest.approx(tpot(alone, "colocated"))
    assert tpot(both, "colocated x2") > 1.5 * tpot(alone, "colocated x2")
    # the chunked x2 candidates had no chunked server at all: noted both times; colocated x2 only alone
    assert "; 3 candidates with several workers on one host" in both["workload"]["note"]
    assert "; 4 candidates" in alone["workload"]["note"]
    assert both["workload"]["note"].startswith("the calibration's prompts reach 3000 tokens, the workload's")
    assert "priced from servers with fewer" in alone["workload"]["note"]
    assert cli_main(["plan", "--calibration", f"{one},{tmp_path / 'missing.json'}", *args]) == 2
    assert "must each be a `bench compare` result" in capsys.readouterr().err


def test_a_winner_decoding_more_at_once_than_its_calibration_did_is_noted(tmp_path, capsys):
    from benchmarks.compare.calibrate.calibration import PoolFit, SelfCalibration

    cal = SelfCalibration({"colocated": PoolFit("colocated", FIT, 100, 0, 1)}, 10.0, 4, None, longest_prompt=3000)
    cal.largest_batch = 2
    mode = {"label": "colocated", "spec": {"mode": "colocated", "chunk_size": None, "decode": 1}}
    mode |= {"self_calibration": cal.to_dict(), "serving_overhead": {"hop_ms": 10.0}}
    path = tmp_path / "narrow.json"
    doc = {"provenance": {"config": {"bench_command": "compare", "model": "tiny"}}, "modes": [mode]}
    path.write_text(json.dumps(doc))
    args = ("--calibration", str(path), "--model", "tiny", "--workers", "1", "--workload", "chat")
    wide = _plan_json(capsys, *args, "--num-requests", "16", "--rate", "50", "--osl", "64")
    assert wide["candidates"][0]["label"] == wide["winner"]
    assert "requests at once on a worker, its calibration's steps at most 2" in wide["workload"]["note"]
    lone = _plan_json(capsys, *args, "--num-requests", "2", "--rate", "0.1", "--osl", "4")
    assert "requests at once" not in lone["workload"]["note"]  # (its 3000-token calibration is noted)


def test_a_probes_largest_batch_is_kept_and_a_winner_past_it_noted(tmp_path, capsys):
    """A probe's calibration records its largest decode batch; a plan whose winner decodes more at
    once says its step prices there are extrapolated. A bad value is refused with one line."""
    cal = cm.Calibration(device="cpu", dtype="fp32", step_fit=FIT.to_dict(), largest_batch=2)
    path = tmp_path / "probe.calibration.json"
    path.write_text(json.dumps(cal.to_dict()))
    args = ("--calibration", str(path), "--model", "tiny", "--workers", "1", "--workload", "chat")
    wide = _plan_json(capsys, *args, "--num-requests", "16", "--rate", "50", "--osl", "64")
    assert "requests at once on a worker, its calibration's steps at most 2" in wide["workload"]["note"]
    path.write_text(json.dumps({**cal.to_dict(), "largest_batch": 0}))
    assert cli_main(["plan", *args]) == 2
    assert "largest_batch must be a positive integer" in capsys.readouterr().err
