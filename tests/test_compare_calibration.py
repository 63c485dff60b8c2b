"""bench compare's self-calibration: the step log a server reports, fitted per pool; calibration
files that say where they were measured."""

from __future__ import annotations

import json
import random

import pytest

from benchmarks.client.logged_step import LoggedStep
from benchmarks.client.step_log import StepLogRecorder
from benchmarks.compare.calibrate.calibration import (
    PoolFit,
    SelfCalibration,
    fit_pools,
    fit_steps,
    link_rate,
    prediction_setup,
    trimmed_fit,
)
from benchmarks.compare.calibrate.calibration import build as build_self_calibration
from costmodel.article import cost_model as cm
from costmodel.fit.step_fit import StepCostFit, StepShape
from costmodel.machine import calibration_mismatch, cpu_model, git
from costmodel.provenance import save_calibration
from costmodel.serve_metrics import RequestRecord
from costmodel.sim.compare_predict import predict, setup_from_steps, sim_config
from costmodel.workloads import RequestSpec
from engine.config import BATCH_WAIT_S

TRUE = StepCostFit(fixed_s=0.030, per_token_s=0.0004, attention_s=2e-9, per_sequence_s=0.004)


def _steps(n: int, rng: random.Random) -> list[tuple[StepShape, float]]:
    """Decode steps of 1-8 streams, some with a prompt chunk, priced by TRUE with 3% noise."""
    out = []
    for _ in range(n):
        ctxs = [rng.randint(64, 600) for _ in range(rng.randint(1, 8))]
        chunks = [(rng.choice((0, 128, 256)), rng.choice((64, 128, 512)))] if rng.random() < 0.3 else []
        shape = StepShape.of(ctxs, chunks)
        out.append((shape, TRUE.seconds(shape) * rng.uniform(0.97, 1.03)))
    return out


def test_trimmed_fit_drops_cold_steps_and_recovers_the_step_prices():
    rng = random.Random(0)
    samples = _steps(120, rng)
    # the first step of a few shapes ran cold: 5x its price
    for i in (0, 7, 19):
        samples[i] = (samples[i][0], samples[i][1] * 5)
    f, trimmed = trimmed_fit(samples)
    assert trimmed >= 3
    for shape in (StepShape.of([300] * 8), StepShape.of([100]), StepShape.of([200] * 4, [(0, 512)])):
        assert f.seconds(shape) == pytest.approx(TRUE.seconds(shape), rel=0.05)


def test_fit_pools_fits_each_role_apart():
    rng = random.Random(1)
    slow_prefill = StepCostFit(0.05, 0.001, 4e-9, 0.0)
    steps = [LoggedStep("decode-0", "decode", s, y) for s, y in _steps(40, rng) if s.prefill_tokens == 0]
    for n in (64, 128, 256, 512, 1024) * 3:
        shape = StepShape.of((), [(0, n)])
        steps.append(LoggedStep("prefill-0", "prefill", shape, slow_prefill.seconds(shape)))
    pools = fit_pools(steps)
    assert set(pools) == {"prefill", "decode"}
    p = StepShape.of((), [(0, 700)])
    assert pools["prefill"].fit.seconds(p) == pytest.approx(slow_prefill.seconds(p), rel=0.02)
    assert pools["decode"].fit.decode_seconds([300] * 6) == pytest.approx(TRUE.decode_seconds([300] * 6), rel=0.05)
    assert fit_pools(steps[:3]) == {}  # too few steps: no fit is trusted


def test_prompt_steps_on_their_own_threads_are_fitted_apart_and_priced_by_that_fit():
    """A colocated worker runs prompt steps on 2 threads and the rest on 1 (--prompt-threads):
    one fit of both would price neither; the prompt steps get their own, and the simulator uses it
    for a step carrying PROMPT_STEP_TOKENS prompt tokens or more."""
    from costmodel.sim.model import Request

    rng = random.Random(2)
    two_threads = StepCostFit(0.020, 0.0002, 1e-9, 0.004)
    steps = [LoggedStep("c-0", "colocated", s, y, torch_threads=1) for s, y in _steps(60, rng) if s.prefill_tokens == 0]
    for n in (300, 500, 700, 900, 1100, 1300):
        shape = StepShape.of([200] * rng.randint(0, 4), [(0, n)])
        steps.append(LoggedStep("c-0", "colocated", shape, two_threads.seconds(shape), torch_threads=2))
    pool = fit_pools(steps)["colocated"]
    assert (pool.torch_threads, pool.prompt_threads, pool.prompt_steps) == (1, 2, 6)
    assert pool.prompt_fit is not None and pool.to_dict()["prompt_threads"] == 2
    cal = build_self_calibration(steps, [], [], 1000)
    assert "6 prompt steps on 2 threads" in cal.summary()
    setup, why = prediction_setup("tiny", "colocated", cal)
    assert why is None and setup is not None and setup.describe()["prompt_threads"] == 2
    batch = [Request(i, "chat", 0.0, 200, 8) for i in range(3)]
    want = two_threads.seconds(StepShape.of([200] * 3, [(0, 800)]))
    assert setup.steps.step(batch, [(0, 800)]) == pytest.approx(want, rel=0.03)
    # a step below PROMPT_STEP_TOKENS and a decode step are the 1-thread fit's
    assert setup.steps.step(batch, [(0, 10)]) == pytest.approx(pool.fit.seconds(StepShape.of([200] * 3, [(0, 10)])))
    assert setup.steps.decode(batch) == pytest.approx(TRUE.decode_seconds([200] * 3), rel=0.05)
    # two such steps (a warm-up's documents) still price a prompt step of another length
    few = [s for s in steps if s.torch_threads == 1] + [s for s in steps if s.torch_threads == 2][1:5:3]
    two = fit_pools(few)["colocated"]
    assert two.prompt_steps == 2 and two.prompt_fit is not None
    assert two.prompt_fit.seconds(StepShape.of([200] * 2, [(0, 600)])) == pytest.approx(
        two_threads.seconds(StepShape.of([200] * 2, [(0, 600)])), rel=0.1
    )
    # no step on other threads: one fit, as before
    assert fit_pools([s for s in steps if s.torch_threads == 1])["colocated"].prompt_fit is None


def test_recorder_keeps_each_step_once():
    rec = StepLogRecorder("http://127.0.0.1:1")
    row = {"step": 5, "prefill_tokens": 0, "attention_pairs": 100.0, "decode_seqs": 2, "seconds": 0.1}
    later = dict(row, step=6, seconds=0.2)
    rec.add([{"worker": "w0", "role": "colocated", "steps": [row]}])
    rec.add([{"worker": "w0", "role": "colocated", "steps": [row, later]}])
    rec.add([{"worker": "w1", "role": "colocated", "steps": [row]}])
    assert sorted((s.worker, s.seconds) for s in rec.steps) == [("w0", 0.1), ("w0", 0.2), ("w1", 0.1)]


def test_recorder_leaves_out_the_steps_before_it_started():
    """The step log's last 256 steps include an earlier (cold) pass: only what ran once the
    recording began is fitted."""
    rec = StepLogRecorder("http://127.0.0.1:1")
    cold = {"step": 5, "prefill_tokens": 64, "attention_pairs": 100.0, "decode_seqs": 0, "seconds": 1.5}
    warm = dict(cold, step=6, seconds=0.1)
    rec.mark_start(
        [{"worker": "w0", "role": "prefill", "steps": [cold]}, {"worker": "w1", "role": "decode", "steps": []}]
    )
    rec.add(
        [
            {"worker": "w0", "role": "prefill", "steps": [cold, warm]},
            {"worker": "w1", "role": "decode", "steps": [cold]},
        ]
    )
    assert sorted((s.worker, s.seconds) for s in rec.steps) == [("w0", 0.1), ("w1", 1.5)]


def test_link_rate_prices_the_models_kv_bytes():
    per_token = 1000
    recs = [
        RequestRecord("d0", "document", 512, 4, 0.0, prompt_tokens=500, transfer={"ms": 5.0}),
        RequestRecord("d1", "document", 512, 4, 0.0, prompt_tokens=500, transfer={"ms": 10.0}),
        RequestRecord("d2", "document", 512, 4, 0.0, prompt_tokens=500, transfer={"ms": 15.0}),
        RequestRecord("c0", "chat", 64, 4, 0.0),
    ]
    assert link_rate(recs, per_token) == pytest.approx(500 * 1000 / 0.010 / 1e9)
    assert link_rate(recs[3:], per_token) is None


def test_a_self_calibrated_disagg_prediction_prices_prefill_with_the_prefill_pools_fit():
    slow_prefill = StepCostFit(0.0, 0.002, 0.0, 0.0)  # 2 ms/token
    setup = setup_from_steps("tiny", TRUE, slow_prefill, 5.0, "test", 100)
    doc = RequestSpec("doc-0", "x", 500, 2, 0.0, "document")
    p = predict("disagg", sim_config("disagg", None, 1, 1, 64, setup.link), setup, [doc], None, None)
    assert p.records[0].ttft_s == pytest.approx(1.0)  # 500 tokens x 2 ms, not TRUE's price
    assert setup.describe()["kind"] == "self"


def test_calibration_files_carry_provenance_and_warn_when_foreign(tmp_path):
    path = save_calibration(cm.Calibration(device="cpu", peak_tflops=1.0), tmp_path / "c.calibration.json")
    cal = cm.Calibration.load(path)
    assert cal.provenance["cpu"] == cpu_model() and cal.provenance["cores"] >= 1
    assert "date_utc" in cal.provenance and "load_average" in cal.provenance
    assert cal.origin_warning(path) is None  # measured here, at this commit

    foreign = dict(cal.provenance, cpu="Some Other CPU 9000")
    warning = calibration_mismatch("c.json", foreign)
    assert warning and "Some Other CPU 9000" in warning and "\n" not in warning
    if git("rev-parse", "HEAD"):
        assert "commit 0000000000" in calibration_mismatch("c.json", dict(cal.provenance, git_commit="0" * 40))

    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"schema": cm.Calibration.SCHEMA, "peak_tflops": 1.0}))
    assert "no provenance" in cm.Calibration.load(bare).origin_warning(bare)


def _mode_run(label: str, mode: str, warm_fit: StepCostFit, steps_fit: StepCostFit):
    """A finished run whose warm-up was served at `warm_fit`'s prices and whose step log fitted to
    `steps_fit`: what `compare_prediction.choose` sees after a real mode ran."""
    from benchmarks.client.bench_serve import BenchConfig, BenchResult
    from benchmarks.compare.args import ModeSpec
    from benchmarks.compare.calibrate.calibration import PoolFit, SelfCalibration
    from benchmarks.compare.record import ModeRun
    from costmodel.serve_metrics import compute_metrics
    from costmodel.sim.compare_predict import simulate_specs

    specs = [RequestSpec(f"chat-{i}", "x", 64, 32, 0.0, "chat") for i in range(4)]
    specs.append(RequestSpec("doc-0", "x", 512, 4, 0.05, "document"))
    truth = setup_from_steps("tiny", warm_fit, None, None, "truth", 100)
    # served as pdserve's engine serves: an idle loop gathers the chats sent together
    served = sim_config(mode, None, 1, 1, 64, truth.link, batch_wait_s=BATCH_WAIT_S)
    records = simulate_specs(served, truth.steps, specs)
    warm = BenchResult(BenchConfig(), "tiny", records, compute_metrics(records, None, None), 1.0)
    cal = SelfCalibration({mode: PoolFit(mode, steps_fit, 90, 3)}, 0.0, 4, None)
    run = ModeRun(ModeSpec(label, mode), {}, 1.0, {}, [], warm, self_calibration=cal, warmup=warm)
    return run, specs


def test_the_calibration_that_predicts_the_warm_up_better_predicts_the_run():
    from benchmarks.compare.prediction import choose, describe_basis

    stale = setup_from_steps("tiny", StepCostFit(0.09, 0.0012, 6e-9, 0.012), None, None, "file", None)
    run, specs = _mode_run("colocated", "colocated", TRUE, TRUE)
    picked = choose("tiny", run, stale, None, False, specs, 64)
    assert picked.basis["used"] == "self" and picked.setup is not None and picked.setup.kind == "self"
    assert picked.basis["warmup_scores"]["self"] < 0.05 < picked.basis["warmup_scores"]["file"]
    assert "self, 90 steps" in describe_basis(picked.basis)
    # a server whose step log misfits (here: fitted 3x too slow) loses to a file that prices it right
    run, specs = _mode_run("colocated", "colocated", TRUE, StepCostFit(0.09, 0.0012, 6e-9, 0.012))
    right = setup_from_steps("tiny", TRUE, None, None, "file", None)
    assert choose("tiny", run, right, None, False, specs, 64).basis["used"] == "file"
    # --calibration FILE wins without a contest
    forced = choose("tiny", run, stale, None, True, specs, 64).basis
    assert (forced["used"], forced["why"], forced["source"]) == ("file", "--calibration given", "file")
    assert "warmup_scores" not in forced


def test_a_mode_without_enough_steps_says_why_it_has_no_self_calibration():
    from benchmarks.compare.prediction import choose, describe_basis

    run, specs = _mode_run("disagg-1P1D", "disagg", TRUE, TRUE)  # a decode pool only: no prefill fit
    picked = choose("tiny", run, None, "no calibration file", False, specs, 64)
    assert picked.setup is None and picked.basis["used"] is None
    assert "too few warm-up steps" in picked.basis["self_error"]
    assert describe_basis(picked.basis).startswith("no prediction: too few warm-up steps")


def test_slos_derived_from_the_calibration_scale_with_its_step_prices():
    from benchmarks.compare.prediction import TPOT_SLO_FACTOR, TTFT_SLO_FACTOR, derive_slos
    from costmodel.workloads import WorkloadConfig

    wl = WorkloadConfig(chat_streams=4, chat_prompt_len=64, chat_output_len=48, doc_prompt_len=512)
    fast = setup_from_steps("tiny", TRUE, None, None, "t", 1)
    slow = setup_from_steps("tiny", StepCostFit(0.09, 0.0012, 6e-9, 0.012), None, None, "t", 1)
    ttft, tpot, how = derive_slos(fast, wl, 10.0)
    assert tpot == pytest.approx(TPOT_SLO_FACTOR * TRUE.decode_seconds([88] * 4) * 1e3)
    assert ttft == pytest.approx(TTFT_SLO_FACTOR * TRUE.prefill_seconds(512) * 1e3 + 10.0)
    assert "4-stream decode step" in how
    assert derive_slos(slow, wl, 10.0)[1] > 2 * tpot


def test_decode_steps_beside_a_prefill_are_priced_apart():
    from benchmarks.compare.calibrate.calibration import beside_prefill_slowdown, overlap

    decode_shape = StepShape.of([200] * 4)
    price = TRUE.seconds(decode_shape)
    steps, t = [], 100.0
    for i in range(40):  # decode steps back to back; every 4th runs beside a prefill step at 2x
        beside = i % 4 == 0
        secs = price * (2.0 if beside else 1.0)
        t += secs
        steps.append(LoggedStep("decode-0", "decode", decode_shape, secs, t))
        if beside:
            steps.append(LoggedStep("prefill-0", "prefill", StepShape.of((), [(0, 512)]), secs, t))
    assert overlap(steps[0], [steps[1]]) == pytest.approx(1.0)
    pools = fit_pools(steps)
    assert pools["decode"].fit.seconds(decode_shape) == pytest.approx(price, rel=0.02)  # fitted on steps alone
    assert beside_prefill_slowdown(steps, pools["decode"].fit) == pytest.approx(2.0, rel=0.02)
    alone = [s for s in steps if s.role == "decode"]
    assert beside_prefill_slowdown(alone, pools["decode"].fit) == 1.0  # separate devices: no prefill steps
    # every prefill step ran beside decoding: its own slowdown cannot be read, so the calibration borrows
    # the decode pool's (the same two workers on the same cores) and prices the prefill at lone prices
    assert pools["prefill"].beside_slowdown is None
    pools, k = fit_steps(steps)
    prefill = pools["prefill"]
    assert prefill.beside_borrowed and prefill.beside_slowdown == pytest.approx(k) == pytest.approx(2.0, rel=0.02)
    assert prefill.fit.seconds(StepShape.of((), [(0, 512)])) == pytest.approx(price, rel=0.05)  # 2x price, halved
    cal = SelfCalibration(pools, None, 0, None, decode_slowdown_beside_prefill=k)
    assert cal.prefill_slowdown_beside_decode == prefill.beside_slowdown and "(the decode pool's)" in cal.summary()
    assert PoolFit.from_dict(prefill.to_dict()) == prefill


def test_prefill_steps_beside_decoding_are_priced_at_lone_prices_and_a_slowdown():
    """A disaggregated prefill pool on the decode pool's cores: the fit prices a lone prefill step,
    and the slowdown beside decoding is read from the steps that ran beside it."""
    lone_fit = StepCostFit(0.01, 0.002, 0.0, 0.0)
    steps, t = [], 100.0
    for i, n in enumerate([64, 128, 256, 512, 1024, 2048, 96, 384, 768, 1536]):
        beside = i % 2 == 0  # every other prompt runs while the decode worker decodes, at 1.4x
        secs = lone_fit.seconds(StepShape.of((), [(0, n)])) * (1.4 if beside else 1.0)
        steps.append(LoggedStep("prefill-0", "prefill", StepShape.of((), [(0, n)]), secs, t + secs))
        if beside:  # decode steps covering the whole prefill step
            for j in range(1, 11):
                steps.append(LoggedStep("decode-0", "decode", StepShape.of([100]), secs / 10, t + j * secs / 10))
        t += secs + 1.0
    for j in range(10):  # and decode steps alone
        steps.append(LoggedStep("decode-0", "decode", StepShape.of([100]), 0.03, t + j * 0.05))
    pool = fit_pools(steps)["prefill"]
    assert pool.beside_slowdown == pytest.approx(1.4, rel=0.02)
    assert pool.fit.seconds(StepShape.of((), [(0, 1000)])) == pytest.approx(2.01, rel=0.02)  # the lone price
    assert PoolFit.from_dict(pool.to_dict()).beside_slowdown == pool.beside_slowdown
    # the simulator charges it for the share of a prefill step the decode worker is decoding
    setup = setup_from_steps("tiny", TRUE, lone_fit, 5.0, "t", 1)
    chats = [RequestSpec(f"chat-{i}", "x", 64, 400, 0.0, "chat") for i in range(2)]
    doc = RequestSpec("doc-0", "x", 1000, 2, 0.5, "document")

    def doc_prefill(**kw) -> float:
        p = predict("d", sim_config("disagg", None, 1, 1, 64, setup.link, **kw), setup, [*chats, doc], None, None)
        r = p.records[2]
        return r.worker_prefill_ms

    assert doc_prefill(prefill_slowdown=1.4) == pytest.approx(1.4 * doc_prefill(), rel=0.01)  # chats decoding all along


def test_the_simulator_slows_decode_steps_beside_a_prefill_and_admits_late():
    setup = setup_from_steps("tiny", TRUE, StepCostFit(0.0, 0.002, 0.0, 0.0), 5.0, "t", 1)
    chats = [RequestSpec(f"chat-{i}", "x", 64, 40, 0.0, "chat") for i in range(2)]
    doc = RequestSpec("doc-0", "x", 500, 2, 0.3, "document")

    def max_gap(**kw) -> float:
        p = predict("d", sim_config("disagg", None, 1, 1, 64, setup.link, **kw), setup, [*chats, doc], None, None)
        return max(b - a for r in p.records[:2] for a, b in zip(r.chunk_times_s[1:], r.chunk_times_s[2:]))

    base = max_gap()
    assert 1.7 * base < max_gap(decode_slowdown=2.0) <= 2 * base  # steps during the prefill, at 2x
    first = predict("d", sim_config("disagg", None, 1, 1, 64, setup.link, admit_s=0.2), setup, chats, None, None)
    plain = predict("d", sim_config("disagg", None, 1, 1, 64, setup.link), setup, chats, None, None)
    gap = lambda p: p.records[0].chunk_times_s[1] - p.records[0].chunk_times_s[0]  # noqa: E731
    assert gap(first) == pytest.approx(gap(plain) + 0.2, abs=0.01)


def test_a_layerwise_server_is_predicted_with_its_kv_streamed():
    """bench compare passes the server's --kv-transfer and --kv-stream-layers to the simulator:
    a layer-wise disaggregated server's document reaches its second token sooner, a colocated
    one has no link to stream over."""
    from benchmarks.compare.args import ModeSpec
    from benchmarks.compare.prediction import sim_config_of
    from costmodel.sim.compare_predict import simulate_requests

    # a link slow enough that the document's bulk pull is a sizeable share of its prefill
    setup = setup_from_steps("tiny", TRUE, TRUE, 0.002, "test", 100)
    specs = [RequestSpec("doc-0", "x", 512, 4, 0.0, "document")]
    spec = ModeSpec("disagg-1P1D", "disagg")
    assert sim_config_of(spec, 64, setup).kv_transfer == "bulk"  # today's prediction by default
    streamed = sim_config_of(spec, 64, setup, kv_transfer="layerwise", kv_stream_layers=1)
    assert (streamed.kv_transfer, streamed.kv_stream_layers) == ("layerwise", 1)
    (bulk,) = simulate_requests(sim_config_of(spec, 64, setup), setup.steps, specs)
    (lw,) = simulate_requests(streamed, setup.steps, specs)
    assert lw.token_times[0] == bulk.token_times[0]
    assert lw.exposed_transfer_s is not None and bulk.exposed_transfer_s is not None
    assert lw.exposed_transfer_s < bulk.exposed_transfer_s and lw.token_times[1] < bulk.token_times[1]
    colocated = sim_config("colocated", None, 1, 1, 64, setup.link, kv_transfer="layerwise")
    assert colocated.kv_transfer == "bulk"


def test_a_calibration_with_a_step_fit_and_no_peak_still_predicts(tmp_path):
    """A probe of a server whose model pdserve does not know has no peak FLOP/s, but its step
    fit prices every step: the prediction is made from that, not refused."""
    from costmodel.sim.compare_predict import setup_from_calibration  # noqa: PLC0415

    path = tmp_path / "probe.calibration.json"
    path.write_text(json.dumps(cm.Calibration(device="cpu", dtype="fp32", step_fit=TRUE.to_dict()).to_dict()))
    setup = setup_from_calibration("tiny", path)
    doc = RequestSpec("doc-0", "x", 500, 2, 0.0, "document")
    p = predict("colocated", sim_config("colocated", None, 0, 1, 64, setup.link), setup, [doc], None, None)
    assert p.records[0].ttft_s == pytest.approx(TRUE.seconds(StepShape.of((), [(0, 500)])), rel=0.05)
    bare = tmp_path / "bare.calibration.json"
    bare.write_text(json.dumps(cm.Calibration(device="cpu", dtype="fp32").to_dict()))
    with pytest.raises(ValueError, match="neither peak_tflops nor a step fit"):
        setup_from_calibration("tiny", bare)


def test_transfer_from_an_earlier_result_rebuilds_each_modes_device_model(tmp_path):
    """--transfer-from: the earlier run's fits per pool (prompt steps apart), its decode admission
    and serving hop; a file of another model or another command is refused."""
    from benchmarks.compare.calibrate import transfer

    rng = random.Random(3)
    steps = [LoggedStep("c-0", "colocated", s, y, torch_threads=1) for s, y in _steps(40, rng)]
    steps += [
        LoggedStep("c-0", "colocated", StepShape.of([], [(0, n)]), 0.001 * n, torch_threads=2) for n in (300, 700)
    ]
    cal = build_self_calibration(steps, [], [], 1000)
    mode = {
        "label": "colocated",
        "spec": {"mode": "colocated"},
        "self_calibration": json.loads(json.dumps(cal.to_dict())),
        "prediction_basis": {"decode_admission_ms": 0.0},
        "serving_overhead": {"hop_ms": 12.0},
    }
    chunked = dict(mode, label="chunked-128", spec={"mode": "chunked"}, self_calibration=None)
    doc = {"provenance": {"config": {"bench_command": "compare", "model": "tiny"}}, "modes": [mode, chunked]}
    path = tmp_path / "compare-a.json"
    path.write_text(json.dumps(doc))
    found, missing = transfer.load(path, "tiny")
    assert set(found) == {"colocated"} and "chunked-128" in missing
    t = found["colocated"]
    assert t.setup.kind == "transfer" and t.hop_s == pytest.approx(0.012) and t.basis["used"] == "transfer"
    assert t.setup.prompt_threads == 2 and t.setup.steps.prompt_fit is not None
    assert len(t.source_steps) == len(cal.logged) > 0  # the source's steps, for this run's pace against them
    shape = StepShape.of([200] * 3)
    assert t.setup.steps.fit is not None and t.setup.steps.fit.seconds(shape) == pytest.approx(
        cal.decode_fit.seconds(shape)
    )
    with pytest.raises(ValueError, match="this run serves"):
        transfer.load(path, "smollm2-135m-instruct")
    path.write_text(json.dumps({"provenance": {"config": {"bench_command": "probe"}}}))
    with pytest.raises(ValueError, match="not a `pdserve bench compare` result"):
        transfer.load(path, "tiny")
