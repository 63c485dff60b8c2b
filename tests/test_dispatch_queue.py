"""The auto dispatcher's queue model and shared-core factors (router/dispatch/dispatcher.py,
router/dispatch/shared_cores.py), on hand-made step fits and worker stats: the arithmetic, not a server."""

import pytest

from contracts.worker import WorkerStats
from costmodel.article.cost_model import Calibration, ModelSpec
from costmodel.fit.step_fit import OnlineStepFit, StepCostFit, StepShape
from router.dispatch.dispatcher import AutoDispatcher, Job, Slowdown, Stream, WorkerQueue
from router.dispatch.shared_cores import SharedCores

FIT = StepCostFit(0.004, 50e-6, 0.1e-6, 1e-3)  # 4 ms a step, 50 us a token, 1 ms a decode sequence


def test_local_replay_packs_waiting_prompts_into_the_chunk_budget():
    q = WorkerQueue(chunk=128)
    q.add(Job("a", 0.0, 0, 64))
    q.add(Job("b", 0.0, 0, 64))
    # both wait at the first step: one step of 128 tokens ends both, as the engine schedules them
    r = q.replay(FIT, [], Job("b", 0.0, 0, 64), 0.0)
    assert r.finish == pytest.approx(FIT.seconds(StepShape.of((), [(0, 64), (0, 64)])))
    # a third arriving during that step waits for its end and decodes beside the two finished ones
    r3 = q.replay(FIT, [], Job("c", 0.001, 0, 64), 0.001)
    first = FIT.seconds(StepShape.of((), [(0, 64), (0, 64)]))
    assert r3.started == pytest.approx(first)
    assert r3.finish == pytest.approx(first + FIT.seconds(StepShape.of([65, 65], [(0, 64)])))


def test_remote_replay_waits_for_the_step_in_progress_and_batches_the_waiting():
    q = WorkerQueue(chunk=None)
    q.add(Job("a", 0.0, 0, 2048))
    one = FIT.prefill_seconds(2048)
    q.add(Job("b", 0.1, 0, 2048))
    r = q.replay(FIT, [], Job("c", 0.2, 0, 2048), 0.2)
    # b and c both arrived during a's step: they run together in the next one
    assert r.started == pytest.approx(one)
    assert r.finish == pytest.approx(one + FIT.seconds(StepShape.of((), [(0, 2048), (0, 2048)])))
    # a's first token came late: the model restarts from there, b still queued whole
    q.realized("a", 2 * one, FIT, [])
    assert [j.rid for j in q.jobs] == ["b"] and q.anchor == 2 * one


def test_a_queue_anchored_long_ago_replays_in_a_few_steps_and_the_same_schedule():
    # a prompt sent an hour ago is still queued (no first token seen), 8 streams decode: the replay
    # starts at the anchor and crosses the hour of decode-only steps in one jump, not ~300k steps
    # (it used to hit MAX_REPLAY_STEPS and predict a first token never)
    q = WorkerQueue(chunk=128)
    q.add(Job("old", 0.0, 0, 64))
    streams = [300] * 8
    slow = Slowdown(2.0, until=1800.0)  # the prefill worker busy for the first half hour
    r = q.replay(FIT, streams, Job("new", 3600.0, 0, 64), 3600.0, slow)
    assert r.steps <= 5
    # the same schedule as stepping one decode step at a time (the engine's): "old" prefills first,
    # then decode steps (2x slower until 1800 s) until "new" arrives, which waits for the step in
    # progress
    t = FIT.seconds(StepShape.of(streams, [(0, 64)])) * 2.0
    ctxs = streams + [65]
    while t < 3600.0:
        t += FIT.decode_seconds(ctxs) * slow.at(t)
    assert r.started == pytest.approx(t, abs=1e-6)
    assert r.finish == pytest.approx(t + FIT.seconds(StepShape.of(ctxs, [(0, 64)])), abs=1e-6)


def test_a_decision_on_stale_queues_costs_few_replay_steps(tmp_path):
    d = _dispatcher(tmp_path)
    d.decide(2048, 0, 0, [], 0.0, request_id="doc-0")  # remote or local: a queue anchored at 0
    d.decide(2048, 0, 0, [], 0.0, request_id="doc-1")  # the other one too
    streams = [Stream(300, 100, 1.0, 400)] * 8
    dec = d.decide(64, 0, 0, streams, 3600.0, request_id="chat")  # an hour later, neither realized
    assert dec.local.ttft_s < 1.0 and dec.remote.ttft_s < 1.0  # both queues ran dry long ago
    # each replay: at most the prompts' chunks (16 + 1 locally) plus a jump per idle stretch
    assert d.cost["decide"].max_steps <= 3 * (2048 // 128 + 4)
    assert d.summary()["event_loop_cost"]["decide"]["calls"] == 3


def _dispatcher(tmp_path, slo_ttft_ms=1000.0, slo_itl_ms=50.0):
    p = tmp_path / "cal.json"
    p.write_text(__import__("json").dumps(Calibration(device="cpu", dtype="fp32", step_fit=FIT.to_dict()).to_dict()))
    return AutoDispatcher(
        Calibration.load(p), ModelSpec.resolve("tiny"), "fp8", 128, slo_ttft_ms / 1e3, slo_itl_ms / 1e3
    )


def test_queueing_is_predicted_and_never_learned_as_overhead(tmp_path):
    d = _dispatcher(tmp_path)
    first = [d.decide(2048, 0, 0, [], 100.0, request_id=f"doc-{i}") for i in range(2)]
    assert sorted(x.choice for x in first) == ["local", "remote"]  # the second goes where nothing waits
    third = d.decide(2048, 0, 0, [], 100.0, request_id="doc-2")
    # whichever way the third went, its prediction holds the wait for the one ahead of it there
    chosen = third.local if third.choice == "local" else third.remote
    assert chosen.queue_s > 0.3
    # it waited 900 ms: sent to a busy worker, its outcome teaches no hop (the wait is the replay's)
    tl = {"request_id": "doc-2", "arrival": 100.0, "dispatch": third.to_dict(), "first_token_ms": 1000.0,
          "prefill_end_ms": 998.0, "queue_ms": 900.0, "prefill_ms": 95.0}  # fmt: skip
    d.record_outcome(tl)
    assert d.hop_in_s == {"local": 0.0, "remote": 0.0} and d.hop_out_s == {"local": 0.0, "remote": 0.0}
    # one sent to an idle worker: the hops are what its worker's own stamps do not cover
    idle = next(x for x in first if x.choice == third.choice)
    rid = f"doc-{first.index(idle)}"
    tl = {"request_id": rid, "arrival": 100.0, "dispatch": idle.to_dict(), "first_token_ms": 600.0,
          "prefill_end_ms": 598.0, "queue_ms": 0.5, "prefill_ms": 594.5}  # fmt: skip
    d.record_outcome(tl)
    assert d.hop_in_s[idle.choice] == pytest.approx(0.2 * 0.003)
    assert d.hop_out_s[idle.choice] == pytest.approx(0.2 * 0.002)


def test_a_stream_that_keeps_its_tpot_slo_admits_a_local_prefill(tmp_path):
    d = _dispatcher(tmp_path, slo_itl_ms=20.0)
    step = FIT.decode_seconds([300] * 8)
    half = [Stream(300, 200, 200 * step, 400)] * 8  # halfway through 400 tokens at ~12 ms a token
    dec = d.decide(512, 0, 0, half, 0.0)
    # the chunk steps are longer than 20 ms, but spread over 400 tokens the stall keeps TPOT < 20 ms
    assert dec.local.itl_s > 0.020 and dec.local.stream_itl_s < 0.020 and dec.local.admissible
    unknown = [Stream(300)] * 8  # lengths unknown: the longest gap must meet the SLO
    assert not d.decide(512, 0, 0, unknown, 0.0).local.admissible


def _stats(name, role, steps, idle=False):
    return WorkerStats(name, role, queue_depth=0 if idle else 1, running=0, parked=0, blocks_total=1,
                       blocks_free=1, recent_steps=steps)  # fmt: skip


def test_steps_beside_the_other_pool_set_its_factor_and_alone_refine_the_fit():
    fits = {"decode": OnlineStepFit(FIT), "prefill": OnlineStepFit(FIT)}
    cores = SharedCores(fits)
    d_step = FIT.decode_seconds([100] * 4)
    shape = StepShape.of([100] * 4)
    # decode steps: two alone (before the prefill), two beside a 1-second prefill, twice as slow
    pairs = int(shape.attention_pairs)
    # (step, prompt tokens, pairs, decode rows, seconds, end, threads, decode rows' pairs, prompt items, reads)
    dec = [(1, 0, pairs, 4, d_step, 1.0, 1, pairs, 0, 0), (2, 0, pairs, 4, d_step, 1.1, 1, pairs, 0, 0),
           (3, 0, pairs, 4, 2 * d_step, 2.5, 1, pairs, 0, 0),
           (4, 0, pairs, 4, 2 * d_step, 2.6, 1, pairs, 0, 0)]  # fmt: skip
    pre = [(1, 2048, 2048 * 2048, 0, 1.0, 3.0, 1, 0, 1, 2048)]
    cores.observe([_stats("d", "decode", dec), _stats("p", "prefill", pre, idle=True)], now=3.5)
    assert cores.pools["decode"].alone == 2 and cores.pools["decode"].beside == 2
    assert cores.factor("decode") == pytest.approx(2.0, rel=0.05)
    # a decode step after the prefill's logged end waits until the prefill worker's activity is known
    cores.observe([_stats("d", "decode", dec + [(5, 0, pairs, 4, d_step, 9.0, 1, pairs, 0, 0)])], now=9.0)
    assert len(cores.pools["decode"].pending) == 1
