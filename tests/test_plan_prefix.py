"""Shared prompt prefixes in the planner: the workload that shares them, the simulator's prefix
cache (whole blocks, as the engine's), the decode side pulling only what it lacks, the prefix
policy candidates deploy with, and the verification's prompts that share them for real."""

from __future__ import annotations

import json
from dataclasses import replace

from benchmarks.plan_verify import fresh_prompts, to_verify
from cli import main as cli_main
from costmodel.article import cost_model as cm
from costmodel.fit.step_fit import StepCostFit
from costmodel.plan.candidates import enumerate_candidates
from costmodel.plan.trace import read_trace
from costmodel.sim import compare_predict as cp
from costmodel.sim.model import StepModel
from costmodel.workloads import RequestSpec, WorkloadConfig, build_workload

# 5 ms a step, 1 ms a prompt token, 1 ms a decode sequence
FIT = StepCostFit(0.005, 1e-3, 0.0, 1e-3, samples=100, rms_rel_error=0.1)


def _steps() -> StepModel:
    return StepModel(cm.ModelSpec.resolve("tiny"), cm.HARDWARE["h100"], fit=FIT)


def _spec(i: int, t: float, prompt: int = 400, prefix: str | None = "sys", shared: int = 300) -> RequestSpec:
    return RequestSpec(f"r{i}", (1,) * prompt, prompt, 4, t, "chat", prefix, shared if prefix else 0)


def _run(cfg, specs):
    return cp.simulate_requests(cfg, _steps(), specs)


def test_a_random_workload_shares_its_prefixes_token_for_token():
    wl = WorkloadConfig(
        num_requests=6, random_input_len=100, random_range_ratio=0.2, prefix_share=0.5, prefix_count=2,
        prompt_token_ids=True,
    )  # fmt: skip
    specs = build_workload(wl)
    plain = build_workload(replace(wl, prefix_share=0.0))
    assert [s.prompt_len for s in specs] == [s.prompt_len for s in plain]  # same lengths and times, shared or not
    assert [s.arrival_s for s in specs] == [s.arrival_s for s in plain]
    by_id: dict[str, list[RequestSpec]] = {}
    for s in specs:
        assert s.prefix_id in ("prefix-0", "prefix-1") and s.prefix_len == 50
        by_id.setdefault(s.prefix_id, []).append(s)
    for group in by_id.values():
        assert len(group) == 3 and len({s.prompt[:50] for s in group}) == 1  # the same 50 ids
        assert len({s.prompt[50:] for s in group}) == 3  # each its own rest
    assert by_id["prefix-0"][0].prompt[:50] != by_id["prefix-1"][0].prompt[:50]


def test_a_cached_prefix_is_computed_once_per_worker_in_whole_blocks():
    specs = [_spec(0, 0.0), _spec(1, 5.0), _spec(2, 10.0, prefix=None)]
    first, second, unshared = _run(cp.sim_config("colocated", None, 0, 1, 8, cm.LINKS["nvlink"]), specs)
    assert (first.cached, second.cached, unshared.cached) == (0, 288, 0)  # 300 shared: 18 whole 16-token blocks
    ttft = [r.token_times[0] - r.arrival for r in (first, second, unshared)]
    assert abs(ttft[0] - ttft[2]) < 1e-9  # nothing to reuse: the same prefill
    assert ttft[1] < ttft[0] - 0.25  # 288 fewer prompt tokens at 1 ms each
    # chunked: the first chunk starts past the cached blocks
    _, chunked, _ = _run(cp.sim_config("colocated", 64, 0, 1, 8, cm.LINKS["nvlink"]), specs)
    assert chunked.cached == 288


def test_the_prefix_policy_sends_a_prefix_to_the_worker_that_holds_it():
    specs = [_spec(0, 0.0), _spec(1, 5.0), _spec(2, 10.0)]
    spread = _run(cp.sim_config("colocated", None, 0, 2, 8, cm.LINKS["nvlink"]), specs)
    routed = _run(cp.sim_config("colocated", None, 0, 2, 8, cm.LINKS["nvlink"], prefix_policy=True), specs)
    assert [r.cached for r in routed] == [0, 288, 288]
    assert sum(r.cached > 0 for r in spread) <= 2  # least loaded alone can land on a worker without it


def test_a_decode_worker_pulls_only_the_blocks_it_lacks():
    link = cm.LINKS["ib-100g"]
    specs = [_spec(0, 0.0), _spec(1, 5.0)]
    first, second = _run(cp.sim_config("disagg", None, 1, 1, 8, link), specs)
    assert second.cached == 288  # the prefill worker reused the prefix
    full = _steps().transfer(400, link)
    assert abs(first.transfer_s - full) < 1e-12
    assert abs(second.transfer_s - _steps().transfer(400 - 288, link)) < 1e-12  # 300 shared: 18 blocks held


def test_candidates_route_by_prefix_only_where_a_pool_has_several_workers():
    cands = {c.label: c for c in enumerate_candidates(3, [64], 400, shared_prefixes=True)}
    assert not cands["colocated"].prefix_policy and not cands["disagg 1P1D"].prefix_policy
    assert cands["colocated x2"].serve_args()[-2:] == ["--policy", "prefix"]
    assert cands["disagg 1P2D"].serve_args()[-2:] == ["--policy", "prefix"]
    assert not any(c.prefix_policy for c in enumerate_candidates(3, [64], 400))


def test_verification_prompts_share_the_prefix_and_change_every_pass():
    specs = [_spec(0, 0.0), _spec(1, 1.0, prompt=350), _spec(2, 2.0, prefix=None), _spec(3, 3.0, prefix="b", shared=20)]
    warm, timed = fresh_prompts(specs, 1), fresh_prompts(specs, 2)
    for run in (warm, timed):
        assert [len(s.prompt) for s in run] == [400, 350, 400, 400]
        assert run[0].prompt[:300] == run[1].prompt[:300] and run[0].prompt[300:] != run[1].prompt[300:]
        assert run[2].prompt[:300] != run[0].prompt[:300] and run[3].prompt[:20] != run[0].prompt[:20]
    assert warm[0].prompt[:300] != timed[0].prompt[:300]  # each pass starts with nothing cached


def test_the_fixed_baseline_is_found_under_the_prefix_policy():
    from costmodel.plan.score import Slos, rank, score

    setup = cp.PredictionSetup(_steps(), cm.LINKS["nvlink"], "test")
    specs = [_spec(i, i * 0.5) for i in range(4)]
    ranked = rank([score(c, setup, specs, Slos(), 8) for c in enumerate_candidates(2, [64], 400, True)])
    labels = [s.candidate.label for s in to_verify(ranked, 1, 2)]
    assert len(labels) == 2 and labels[1] in ("colocated x2", "disagg 1P1D")


def test_a_trace_prefix_is_modelled_with_its_length_and_noted_without(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    rows = [
        {"arrival_s": i * 0.5, "prompt_tokens": 400, "output_tokens": 8, "prefix_id": "sys", "prefix_tokens": 300}
        for i in range(4)
    ]
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    specs, unmodelled = read_trace(trace)
    assert unmodelled == 0 and {(s.prefix_id, s.prefix_len) for s in specs} == {("sys", 300)}
    cal = tmp_path / "c.calibration.json"
    cal.write_text(json.dumps(cm.Calibration(device="cpu", dtype="fp32", step_fit=FIT.to_dict()).to_dict()))
    argv = ["plan", "--calibration", str(cal), "--model", "tiny", "--trace", str(trace), "--json"]
    assert cli_main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["workload"]["note"] is None
    rows[1]["prefix_tokens"] = 401
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert cli_main(argv[:-1]) == 2
    assert f"{trace}:2: prefix_tokens must be 0 to prompt_tokens (400)" in capsys.readouterr().err


def test_the_prefix_share_flag_shortens_predicted_prefills(tmp_path, capsys):
    cal = tmp_path / "c.calibration.json"
    cal.write_text(json.dumps(cm.Calibration(device="cpu", dtype="fp32", step_fit=FIT.to_dict()).to_dict()))
    argv = ["plan", "--calibration", str(cal), "--model", "tiny", "--workload", "chat", "--num-requests", "12"]
    argv += ["--rate", "2", "--isl", "512", "--osl", "8", "--workers", "1", "--json"]

    def ttft(*extra: str) -> float:
        assert cli_main([*argv, *extra]) == 0
        doc = json.loads(capsys.readouterr().out)
        return next(c for c in doc["candidates"] if c["label"] == "colocated")["predicted"]["ttft_p90_ms"]

    assert ttft("--prefix-share", "0.75") < 0.6 * ttft()
    assert cli_main([*argv, "--prefix-share", "1.5"]) == 2
    assert "--prefix-share in [0, 1)" in capsys.readouterr().err
    article = ["plan", "--calibration", str(cal), "--model", "tiny", "--workload", "article"]
    assert cli_main([*article, "--prefixes", "2"]) == 2
    assert "--prefixes does not apply to --workload article" in capsys.readouterr().err
