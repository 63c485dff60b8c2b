"""Colocated whole candidates priced with their prompt steps' threads (costmodel/plan/pricing.py
`threaded_whole`, benchmarks/prompt_threads.py).

pdserve's colocated server without chunks gives its prompt steps the core it leaves to the router
(router/workers/threads.py); a probe of a chunked server prices every step at the worker's own
threads. The probe measures the ratio on this host and the plan prices the candidates that get
those threads with it, and only those.
"""

from __future__ import annotations

import json

import pytest

from benchmarks import prompt_threads
from benchmarks.prompt_threads import host_threads
from cli import main as cli_main
from costmodel.article import cost_model as cm
from costmodel.fit.step_fit import StepCostFit
from costmodel.plan.candidates import Candidate
from costmodel.plan.pricing import computed_prompt_tokens, setup_for, speedup_at, threaded_whole
from costmodel.sim.compare_predict import setup_from_calibration
from costmodel.workloads import RequestSpec

# 5 ms a step, 1 ms a prompt token, 1 ms a decode sequence (tests/test_plan.py's synthetic fit)
FIT = StepCostFit(0.005, 1e-3, 0.0, 1e-3, samples=100, rms_rel_error=0.1)
SPEEDUP = {"from_threads": 1, "to_threads": 2, "speedup_by_prompt_tokens": {"256": 1.6, "1024": 2.0}}
PROBE = "pdserve bench probe --base-url http://127.0.0.1:8000 (black box)"


def _calibration(tmp_path, speedup=SPEEDUP, **kw):
    p = tmp_path / "probe.calibration.json"
    cal = cm.Calibration(device="cpu", dtype="fp32", step_fit=FIT.to_dict(), source=PROBE, **kw)
    p.write_text(json.dumps({**cal.to_dict(), "prompt_thread_speedup": speedup}))
    return p


def _plan(capsys, cal, *args: str) -> dict:
    assert cli_main(["plan", "--calibration", str(cal), "--model", "tiny", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_ratio_is_read_at_the_workloads_prompt_length():
    assert speedup_at(SPEEDUP, 100) == 1.6  # below the lengths measured: the nearest one's
    assert speedup_at(SPEEDUP, 512) == pytest.approx(1.8)  # halfway in log(tokens)
    assert speedup_at(SPEEDUP, 8192) == 2.0


def test_the_ratio_is_read_at_the_prompt_a_step_computes():
    def spec(i, n, prefix=None, shared=0):
        return RequestSpec(str(i), (1,) * n, n, 8, float(i), "random", prefix, shared)

    # a shared 192-token prefix is computed by its first request only; 64 or 40 fresh tokens are a
    # decode-thread step (under PROMPT_STEP_TOKENS, 256)
    specs = [spec(0, 300, "a", 192), spec(1, 256, "a", 192), spec(2, 232, "a", 192), spec(3, 1000)]
    assert computed_prompt_tokens(specs) == pytest.approx((300 + 1000) / 2)
    assert computed_prompt_tokens([spec(0, 32)]) == 0.0  # no step on the prompt threads


def test_only_the_candidates_deployed_on_more_threads_are_priced_faster(tmp_path):
    setup = setup_from_calibration("tiny", _calibration(tmp_path))
    # one worker on a 2-core host: decode on 1 thread, whole prompts on 2; two workers: 1 and 1
    whole = threaded_whole(setup, {1: (1, 2), 2: (1, 1)}, prompt_tokens=1024)
    assert whole is not None and whole.workers == {1} and whole.speedup == 2.0
    one, two, chunked = Candidate("colocated", 1), Candidate("colocated", 2), Candidate("chunked", 1, chunk=256)
    assert setup_for(one, None, setup, whole) is whole.setup
    assert setup_for(two, None, setup, whole) is setup and setup_for(chunked, None, setup, whole) is setup
    priced = whole.setup.steps
    assert priced.prefill(1024) == pytest.approx(setup.steps.prefill(1024) / 2)  # a prompt step: on 2 threads
    assert priced.decode([]) == setup.steps.decode([])  # decode steps keep the worker's thread
    # the calibration's steps ran on 2 threads already, or no deployment here runs 1 -> 2: nothing to price
    on_two = setup_from_calibration("tiny", _calibration(tmp_path, torch_threads=2))
    assert threaded_whole(on_two, {1: (1, 2)}, 1024) is None
    assert threaded_whole(setup, {1: (3, 4)}, 1024) is None and threaded_whole(setup, None, 1024) is None


def test_host_threads_are_what_serve_would_choose(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert host_threads(2) == {1: (1, 2), 2: (1, 1)}  # one core left to the router; one worker borrows it
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # an explicit choice: every step on one thread
    assert host_threads(2) == {1: (1, 1), 2: (1, 1)}


def test_a_plan_prices_colocated_whole_faster_on_a_host_that_gives_it_two_threads(tmp_path, capsys, monkeypatch):
    cal = _calibration(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # every step on one thread, as the probed server's
    as_probed = {c["label"]: c for c in _plan(capsys, cal, "--workers", "2", "--workload", "rag")["candidates"]}
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    doc = _plan(capsys, cal, "--workers", "2", "--workload", "rag")
    threaded = {c["label"]: c for c in doc["candidates"]}
    ttft = lambda d, label: d[label]["predicted"]["ttft_p90_ms"]  # noqa: E731
    assert ttft(threaded, "colocated") < 0.75 * ttft(as_probed, "colocated")
    for label in ("colocated x2", "chunked 256", "disagg 1P1D"):  # deployed on the worker's own threads
        assert ttft(threaded, label) == ttft(as_probed, label)
    assert doc["device_model"]["whole_prompt_threads"]["workers"] == [1]
    assert "runs its prompt steps on 2 threads here" in doc["workload"]["note"]


def test_a_probe_without_the_ratio_says_whole_prompts_are_priced_pessimistically(tmp_path, capsys):
    doc = _plan(capsys, _calibration(tmp_path, speedup=None), "--workers", "1")
    assert "--prompt-threads auto" in doc["workload"]["note"] and "pessimistic" in doc["workload"]["note"]


def test_a_bad_ratio_is_refused(tmp_path, capsys):
    bad = _calibration(tmp_path, speedup={"from_threads": 1, "to_threads": 2, "speedup_by_prompt_tokens": {"x": 0}})
    assert cli_main(["plan", "--calibration", str(bad), "--model", "tiny"]) == 2
    assert "speedup_by_prompt_tokens" in capsys.readouterr().err


def test_the_probe_measures_the_ratio_only_for_a_server_on_this_host(monkeypatch):
    said: list[str] = []
    assert prompt_threads.for_probe("http://10.1.2.3:8000", "tiny", said.append) is None
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # a server here would run whole prompts on 1 thread too
    assert prompt_threads.for_probe("http://127.0.0.1:8000", "tiny", said.append) is None
    assert "another host" in said[0] and "1 thread(s)" in said[1]


def test_the_ratio_is_measured_on_the_models_forward():
    """Cost: the tiny model's forward at two lengths, 1 and 2 threads, four times each (~2-5 s)."""
    m = prompt_threads.measure_in_child("tiny", 1, 2, tokens=(64, 128))
    assert m is not None and m["from_threads"] == 1 and m["to_threads"] == 2
    assert set(m["speedup_by_prompt_tokens"]) == {"64", "128"}
    for n, seconds in m["forward_seconds"].items():
        assert seconds["1"] > 0 and seconds["2"] > 0
        assert m["speedup_by_prompt_tokens"][n] == pytest.approx(seconds["1"] / seconds["2"])
