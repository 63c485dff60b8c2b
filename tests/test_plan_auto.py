"""`--mode auto` as a plan candidate: the simulator's auto mode (costmodel/sim/auto.py) decides each
request as the router's rule does, loses nothing, and the plan offers it with the command that
deploys it (the serve flags parse into a valid ServeConfig).

The device model is a synthetic step fit: 10 ms a step and 1 ms a prompt token, so a 1,000-token
prompt is ~1.01 s whole on a prefill worker and ~1.1 s in ten 100-token chunks on a decode worker.
"""

from __future__ import annotations

import argparse
import json

import pytest

from cli import main as cli_main
from costmodel.article import cost_model as cm
from costmodel.fit.step_fit import StepCostFit
from costmodel.plan.candidates import AUTO_SLO_ITL_MS, AUTO_SLO_TTFT_MS, enumerate_candidates
from costmodel.sim.compare_predict import simulate_requests
from costmodel.sim.engine import Request, Sim, SimConfig, StepModel, Workload, simulate
from costmodel.workloads import RequestSpec
from router import serve_cli
from router.config import ServeConfig

FIT = StepCostFit(0.01, 1e-3, 0.0, 1e-3, samples=100, rms_rel_error=0.05)
STEPS = StepModel(cm.ModelSpec.resolve("tiny"), cm.HARDWARE["h100"], fit=FIT)


def _auto(ttft_s: float | None, itl_s: float | None) -> SimConfig:
    return SimConfig("auto", prefill_workers=1, decode_workers=1, chunk=100, slo_ttft_s=ttft_s, slo_itl_s=itl_s)


def _spec(rid: str, prompt: int, out: int, at: float) -> RequestSpec:
    return RequestSpec(rid, (1,) * prompt, prompt, out, at, "document" if prompt >= 1000 else "chat")


def _placements(cfg: SimConfig, specs: list[RequestSpec]) -> list[str]:
    """Where auto prefilled each of `specs` (the simulator run as the plan runs it)."""
    sim = Sim(cfg, STEPS, Workload(streams=0, chat_rate=0.0, doc_rate=0.0, duration=1.0))
    reqs = []
    for i, s in enumerate(specs):
        r = Request(i, "doc", s.arrival_s, s.prompt_len, s.max_tokens)
        sim.requests.append(r)
        sim.at(s.arrival_s, sim.dispatch, r)
        reqs.append(r)
    sim.run()
    assert all(r.done for r in reqs)  # nothing lost, whichever side prefilled it
    return [sim.placements[r.rid] for r in reqs]


@pytest.fixture
def calibration(tmp_path):
    p = tmp_path / "synthetic.calibration.json"
    p.write_text(json.dumps(cm.Calibration(device="cpu", dtype="fp32", step_fit=FIT.to_dict()).to_dict()))
    return str(p)


def test_the_plans_auto_defaults_are_the_routers():
    assert ServeConfig().slo_ttft_ms == AUTO_SLO_TTFT_MS and ServeConfig().slo_itl_ms == AUTO_SLO_ITL_MS


def test_an_idle_system_prefills_remotely_where_it_is_cheaper():
    # whole on the prefill worker: 1.01 s + a small pull; ten chunk steps locally: 1.1 s
    assert _placements(_auto(5.0, 1.0), [_spec("a", 1000, 4, 0.0)]) == ["remote"]


def test_a_busy_prefill_worker_sends_the_next_prompt_local_under_the_ttft_slo():
    # the second prompt would wait ~0.9 s behind the first on the prefill worker: 1.9 s > 1.5 s
    specs = [_spec("a", 1000, 4, 0.0), _spec("b", 1000, 4, 0.1)]
    assert _placements(_auto(1.5, 1.0), specs) == ["remote", "local"]
    # without a TTFT SLO both sides are admissible and the cheaper in user-seconds wins: local
    # (its 1.1 s beats the remote 1.9 s)
    assert _placements(_auto(None, None), specs) == ["remote", "local"]


def test_an_itl_slo_keeps_chunks_away_from_decoding_streams():
    # a stream decodes on the decode worker when a prompt arrives with the prefill worker busy for
    # ~1.8 s more: locally its ten chunk steps (~110 ms each) cost the stream ~1 s, cheaper than the
    # remote wait (2.1 against 2.8 user-seconds), but they lift its mean inter-token latency past
    # 20 ms: under that SLO it waits for the prefill worker
    specs = [_spec("chat", 20, 100, 0.0), _spec("busy", 2000, 2, 0.05), _spec("doc", 1000, 2, 0.3)]
    loose, tight = _placements(_auto(10.0, 1.0), specs), _placements(_auto(10.0, 0.02), specs)
    assert loose[1:] == ["remote", "local"] and tight[1:] == ["remote", "remote"]


def test_auto_loses_no_request_and_counts_every_token():
    wl = Workload(streams=6, chat_prompt=(32, 256), chat_output=(8, 48), doc_rate=1.5, doc_prompt=(800, 2000),
                  doc_output=(1, 16), duration=6.0, seed=5)  # fmt: skip
    sim = simulate(SimConfig("auto", prefill_workers=1, decode_workers=2, chunk=128, slo_ttft_s=1.0), STEPS, wl)
    done = [r for r in sim.requests if r.done]
    assert done and all(len(r.token_times) == r.output for r in done)
    assert {sim.placements[r.rid] for r in sim.requests if r.kind == "doc"} <= {"local", "remote"}
    assert not any(w.inflight for w in sim.decode)  # every remote prompt's KV landed where it was bound


def test_auto_candidates_come_with_the_command_that_deploys_them(calibration):
    cands = enumerate_candidates(2, [64, 128], 1024, auto_slos=(800.0, None), auto_calibration=calibration)
    auto = [c for c in cands if c.mode == "auto"]
    assert [c.label for c in auto] == ["auto 1P1D chunks 64", "auto 1P1D chunks 128"]
    args = auto[1].serve_args()
    assert args[:2] == ["--mode", "auto"] and args[args.index("--slo-ttft-ms") + 1] == "800"
    assert args[args.index("--slo-itl-ms") + 1] == f"{AUTO_SLO_ITL_MS:g}"  # no TPOT SLO: the router's default
    # the flags parse into the config `pdserve serve` would run
    p = argparse.ArgumentParser()
    serve_cli.add_arguments(p)
    cfg = serve_cli.config_from_args(p.parse_args(["--model", "tiny", *args]))
    assert (cfg.mode, cfg.prefill, cfg.decode, cfg.chunk_size, cfg.slo_ttft_ms) == ("auto", 1, 1, 128, 800.0)
    assert cfg.calibration == calibration and cfg.kv_transfer == "bulk"
    assert not [c for c in enumerate_candidates(2, [64], 1024) if c.mode == "auto"]  # asked for only


def test_a_plan_from_a_calibration_file_ranks_auto_beside_the_rest(calibration, capsys):
    argv = ["plan", "--calibration", calibration, "--model", "tiny", "--workers", "2", "--workload", "rag"]
    assert cli_main([*argv, "--slo-ttft-ms", "3000", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    auto = [c for c in doc["candidates"] if c["label"].startswith("auto 1P1D")]
    assert auto and all("--calibration" in c["serve_args"] and "--mode" in c["serve_args"] for c in auto)
    assert all(c["predicted"]["goodput_per_worker"] > 0 for c in auto)
    # a datasheet has no step fit for the router to start from: no auto candidate
    assert cli_main(["plan", "--gpu", "h100", "--model", "tiny", "--workers", "2", "--json"]) == 0
    assert not [c for c in json.loads(capsys.readouterr().out)["candidates"] if c["label"].startswith("auto")]


def test_simulate_requests_runs_auto_as_the_plan_does():
    recs = simulate_requests(_auto(2.0, 0.5), STEPS, [_spec("a", 300, 3, 0.0), _spec("b", 40, 3, 0.0)])
    assert all(len(r.token_times) == 3 for r in recs)
