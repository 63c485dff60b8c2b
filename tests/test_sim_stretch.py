"""Decode-only stretches (`SimConfig.fast_forward`, costmodel/sim/workers.py): a worker's decode steps
between two changes to its batch run as one event. They must change nothing but the time the
simulator takes: every request's token times, the placements auto makes, a run cut at a horizon,
and a plan's every figure come out the same as step by step."""

from __future__ import annotations

import contextlib
import io
import json
import random
from dataclasses import replace

import pytest

from cli import main as cli_main
from costmodel.article import cost_model as cm
from costmodel.fit.step_fit import StepCostFit
from costmodel.sim import compare_predict as cp
from costmodel.sim.compare_predict import simulate_requests
from costmodel.sim.engine import Request, Sim, SimConfig, StepModel, Workload, simulate
from costmodel.sim.stretch import STRETCH_STEPS
from costmodel.workloads import RequestSpec

FIT = StepCostFit(0.01, 1e-3, 1e-7, 2e-3, samples=100, rms_rel_error=0.05)
FITTED = StepModel(cm.ModelSpec.resolve("tiny"), cm.HARDWARE["h100"], fit=FIT)
DATASHEET = StepModel(cm.ARTICLE_MODEL, cm.ARTICLE_HW)
LINK = cm.LINKS["ib-100g"]
CONFIGS = [
    SimConfig("colocated", workers=3),
    SimConfig("colocated", workers=2, max_batch=3, batch_wait_s=0.002),
    SimConfig("chunked", workers=2, chunk=128),
    SimConfig("disagg", prefill_workers=1, decode_workers=2, link=LINK),
    SimConfig("disagg", prefill_workers=2, decode_workers=1, link=LINK, kv_transfer="layerwise", admit_s=0.003),
    SimConfig("disagg", prefill_workers=1, decode_workers=1, link=LINK, prefill_slowdown=1.3),
    SimConfig("auto", prefill_workers=1, decode_workers=2, chunk=64, link=LINK, slo_ttft_s=0.3, slo_itl_s=0.05),
]


def _specs(seed: int, n: int = 40) -> list[RequestSpec]:
    """Poisson arrivals of chats and documents, some of them at the same instant (a burst)."""
    rng, t, out = random.Random(seed), 0.0, []
    for i in range(n):
        t += 0.0 if i % 7 == 3 else rng.expovariate(8.0)
        prompt = rng.choice([rng.randint(16, 300), rng.randint(1000, 2500)])
        out.append(RequestSpec(f"r{i}", (1,) * prompt, prompt, rng.randint(1, 90), t, "chat"))
    return out


def _tokens(cfg: SimConfig, steps: StepModel, specs: list[RequestSpec], fast: bool) -> list[list[float]]:
    return [r.token_times for r in simulate_requests(replace(cfg, fast_forward=fast), steps, specs)]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.label)
@pytest.mark.parametrize("steps", [FITTED, DATASHEET], ids=["fit", "datasheet"])
def test_stretches_change_no_token_time(cfg, steps):
    for seed in range(3):
        specs = _specs(seed)
        slow = _tokens(cfg, steps, specs, fast=False)
        assert sum(map(len, slow)) == sum(s.max_tokens for s in specs)
        assert _tokens(cfg, steps, specs, fast=True) == slow


def test_a_stretch_longer_than_one_event_carries_goes_on_in_the_next():
    long = [RequestSpec(f"l{i}", (1,), 40, STRETCH_STEPS * 2 + 7 * i, 0.01 * i, "chat") for i in range(3)]
    for cfg in (CONFIGS[0], CONFIGS[3]):
        assert _tokens(cfg, FITTED, long, fast=True) == _tokens(cfg, FITTED, long, fast=False)


def test_auto_places_every_request_as_step_by_step():
    placed = []
    for fast in (False, True):
        sim = Sim(replace(CONFIGS[-1], fast_forward=fast), FITTED, Workload(streams=0, chat_rate=0.0, doc_rate=0.0))
        for i, s in enumerate(_specs(5)):
            r = Request(i, "doc", s.arrival_s, s.prompt_len, s.max_tokens)
            sim.requests.append(r)
            sim.at(s.arrival_s, sim.dispatch, r)
        sim.run()
        placed.append(sim.placements)
    assert placed[0] == placed[1] and set(placed[0].values()) == {"local", "remote"}


def test_a_run_cut_at_its_horizon_hands_out_the_same_tokens():
    wl = Workload(streams=6, chat_prompt=(32, 256), chat_output=(16, 200), doc_rate=1.0, duration=4.0, seed=2)
    for cfg in (SimConfig("colocated"), SimConfig("chunked", chunk=300)):
        slow = simulate(replace(cfg, fast_forward=False), DATASHEET, wl, horizon=3.0)
        fast = simulate(cfg, DATASHEET, wl, horizon=3.0)
        assert [r.token_times for r in fast.requests] == [r.token_times for r in slow.requests]
        assert fast.decode[0].log[-1] == slow.decode[0].log[-1]  # the step in progress, as readers see it


def test_a_plan_is_the_same_figure_for_figure(tmp_path, monkeypatch):
    path = tmp_path / "synthetic.calibration.json"
    path.write_text(json.dumps(cm.Calibration(device="cpu", dtype="fp32", step_fit=FIT.to_dict()).to_dict()))
    argv = ["plan", "--calibration", str(path), "--model", "tiny", "--workers", "3", "--workload", "rag", "--json"]

    def plan() -> dict:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert cli_main(argv) == 0
        doc = json.loads(out.getvalue())
        doc.pop("seconds")
        return doc

    fast = plan()
    every_step = cp.sim_config
    monkeypatch.setattr(cp, "sim_config", lambda *a, **kw: replace(every_step(*a, **kw), fast_forward=False))
    assert plan() == fast
