"""Invariants of the serving simulator, and its agreement with the closed-form cost model."""

from __future__ import annotations

import contextlib
import io
import json
import random

import pytest

from cli import main as cli_main
from costmodel.article import cost_model as cm
from costmodel.sim.capacity import capacity_special_case
from costmodel.sim.engine import Sim, SimConfig, StepModel, Workload, simulate
from costmodel.sim.summary import percentiles, summarize

M, HW = cm.ARTICLE_MODEL, cm.ARTICLE_HW
STEPS = StepModel(M, HW)
NO_SLO = {"ttft_ms": None, "tpot_ms": None, "itl_ms": None}
SMALL = Workload(
    streams=8,
    chat_prompt=(32, 256),
    chat_output=(16, 64),
    doc_rate=1.0,
    doc_prompt=(1024, 3000),
    doc_output=(1, 32),
    duration=6.0,
    seed=3,
)
CONFIGS = [
    SimConfig("colocated"),
    SimConfig("chunked", chunk=300),
    SimConfig("disagg", prefill_workers=2, decode_workers=2, link=cm.LINKS["ib-100g"]),
    SimConfig("colocated", workers=3, max_batch=4),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.label}-{c.gpus}")
def test_no_request_lost_and_tokens_conserved(cfg):
    sim = simulate(cfg, STEPS, SMALL)
    assert sim.requests and len(sim.finished) == len(sim.requests)
    assert len({r.rid for r in sim.finished}) == len(sim.requests)  # each finished once
    for r in sim.requests:
        assert len(r.token_times) == r.output and r.prefilled == r.prompt
        assert r.arrival <= r.token_times[0]
        assert all(a <= b for a, b in zip(r.token_times, r.token_times[1:]))
    # every token came from a logged step: one per prefill completion, one per decode slot
    decode_slots = sum(s.decode_tokens for w in sim.workers for s in w.log)
    assert decode_slots + len(sim.requests) == sum(len(r.token_times) for r in sim.requests)
    assert sum(s.prefill_tokens for w in sim.workers for s in w.log) == sum(r.prompt for r in sim.requests)
    for w in sim.workers:  # one step at a time
        assert all(a.end <= b.start + 1e-12 for a, b in zip(w.log, w.log[1:]))
        assert not w.queue and not w.running
    assert summarize(sim, 1.0, NO_SLO)["lost"] == 0


def _alone(cfg: SimConfig, prompt: int, output: int, steps: StepModel = STEPS):
    wl = Workload(streams=0, doc_rate=0, doc_prompt=(prompt, prompt), doc_output=(output, output), duration=1)
    sim = Sim(cfg, steps, wl)
    r = sim.new_request("doc", 0.5, random.Random(0))
    sim.run()
    return r


@pytest.mark.parametrize("mode", ["colocated", "chunked"])
def test_single_request_matches_closed_form(mode):
    p, o = 4096, 20
    r = _alone(SimConfig(mode, chunk=512), p, o)
    assert r.token_times[0] - 0.5 == pytest.approx(cm.prefill(M, HW, p).time_s, rel=1e-9)
    gaps = [b - a for a, b in zip(r.token_times, r.token_times[1:])]
    # the k-th decode step holds the prompt plus the k tokens generated so far
    want = [cm.decode_step_tokens(M, HW, 1, p + k).time_s for k in range(1, o)]
    assert gaps == pytest.approx(want, rel=1e-9)
    fixed = _alone(SimConfig(mode), p, 3, StepModel(M, HW, fixed_ctx=4096))
    assert round((fixed.token_times[1] - fixed.token_times[0]) * 1e3, 1) == 21.3  # decode table, batch 1


def test_single_request_disagg_pays_the_link():
    p, o = 4096, 5
    for link in cm.LINKS.values():
        r = _alone(SimConfig("disagg", link=link), p, o)
        assert r.token_times[0] - 0.5 == pytest.approx(cm.prefill(M, HW, p).time_s)
        want = cm.kv_transfer_seconds(M, p, link) + cm.decode_step_tokens(M, HW, 1, p + 1).time_s
        assert r.token_times[1] - r.token_times[0] == pytest.approx(want)
        # alone, the decode worker is idle: it admits the request the moment its KV has crossed
        assert r.transfer_s == pytest.approx(cm.kv_transfer_seconds(M, p, link))
        assert r.admitted == pytest.approx(r.token_times[0] + r.transfer_s)


def test_decode_admission_waits_for_the_link_and_the_step_in_flight():
    """Two documents back to back on 2 prefill workers, one decode worker behind one link: the
    second KV queues behind the first on the link, then joins at the next decode step's start."""
    cfg = SimConfig("disagg", prefill_workers=2, decode_workers=1, link=cm.LINKS["ib-100g"])
    sim = Sim(cfg, STEPS, Workload(streams=0, doc_rate=0, duration=1))
    a, b = (sim.new_request("doc", 0.0, random.Random(0)) for _ in range(2))
    for r in (a, b):
        r.prompt, r.output = 4096, 40
    sim.run()
    tx = cm.kv_transfer_seconds(M, 4096, cfg.link)
    assert a.transfer_s == b.transfer_s == pytest.approx(tx)
    assert a.token_times[0] == b.token_times[0]  # both prefilled at once
    b_kv_in = b.token_times[0] + 2 * tx  # behind a's pull
    # b joins at the first decode step boundary at or after its KV is in: a's steps
    boundaries = [t for t in a.token_times[1:] if t >= b_kv_in - 1e-12]
    assert b.admitted == pytest.approx(boundaries[0])
    assert b.admitted - b.token_times[0] - b.transfer_s >= tx - 1e-12  # its wait includes the link's queue


def test_more_decode_workers_never_lower_goodput():
    # 60 chats/s: one decode worker turns compute-bound (TPOT ~47 ms), two are back near the floor
    wl = Workload(
        streams=0,
        chat_rate=60.0,
        chat_prompt=(64, 512),
        chat_output=(64, 256),
        doc_rate=0.5,
        doc_output=(32, 64),
        duration=12.0,
        seed=1,
    )
    slo = {"ttft_ms": 3000.0, "tpot_ms": 30.0, "itl_ms": None}
    good = [
        summarize(simulate(SimConfig("disagg", prefill_workers=6, decode_workers=d), STEPS, wl), 2.0, slo)[
            "goodput_req_s"
        ]
        for d in (1, 2, 3, 4)
    ]
    assert all(a <= b for a, b in zip(good, good[1:])), good
    assert good[-1] > good[0]


def test_capacity_table_is_a_special_case():
    fixed = StepModel(M, HW, fixed_ctx=4096)
    for row in capacity_special_case(fixed, [0.25, 0.5, 1.0, 2.0], duration=200.0, warmup=10.0):
        assert row["gpu_share"] == pytest.approx(row["closed_form_gpu_share"], abs=0.02)
        assert row["decode_sequences"] == pytest.approx(row["closed_form_decode_sequences"], rel=0.03, abs=0.1)


def test_article_scenario_freeze_and_its_removal():
    wl = Workload(duration=25.0, seed=0)  # 32 streams, 4k documents at 0.25/s
    res = {
        c.mode: summarize(simulate(c, STEPS, wl), 3.0, NO_SLO)
        for c in (SimConfig("colocated"), SimConfig("chunked", chunk=512), SimConfig("disagg"))
    }
    freeze = cm.prefill(M, HW, 4096).time_s * 1e3
    assert res["colocated"]["documents"] >= 1
    assert res["colocated"]["max_stall_ms"] > freeze  # the whole prefill
    assert res["chunked"]["max_stall_ms"] < 0.25 * res["colocated"]["max_stall_ms"]  # spread out
    assert res["disagg"]["max_stall_ms"] < 40  # a decode step, no more


def test_percentiles():
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None}
    assert percentiles(list(range(101))) == {"p50": 50, "p90": 90, "p99": 99}
    assert percentiles([1.0, 2.0])["p50"] == 1.5


def test_bad_input():
    with pytest.raises(ValueError, match="mode"):
        SimConfig("pipelined")
    with pytest.raises(ValueError, match="chat_prompt"):
        Workload(chat_prompt=(10, 5))


def test_cli_json_and_png(tmp_path):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli_main(
            ["simulate", "--duration", "8", "--warmup", "1", "--doc-rate", "0.5", "--out-dir", str(tmp_path), "--json"]
        )
    assert rc == 0
    out = json.loads(buf.getvalue())
    assert out["simulated"] is True and [r["mode"] for r in out["results"]] == ["colocated", "chunked", "disagg"]
    for r in out["results"]:
        assert r["lost"] == 0
        for k in ("ttft_ms", "tpot_ms", "itl_ms"):
            assert set(r[k]) == {"p50", "p90", "p99"}
        assert {"max_stall_ms", "throughput_tok_s", "goodput_req_s"} <= set(r)
    saved = json.loads((tmp_path / "simulate.json").read_text())
    assert saved["provenance"]["git_commit"] and (tmp_path / "simulate.png").stat().st_size > 10_000
    assert cli_main(["simulate", "--link", "carrier-pigeon", "--out-dir", str(tmp_path)]) == 2


# ----------------------------------------------------------------------------- layer-wise KV streaming

DOCS = Workload(
    streams=0,
    chat_rate=8.0,
    chat_prompt=(32, 512),
    chat_output=(8, 32),
    doc_rate=1.0,
    doc_prompt=(1024, 8192),
    doc_output=(4, 16),
    duration=10.0,
    seed=2,
)  # open-loop: every request (and its rid) is the same whatever the KV transfer


# An RDMA-like fixed cost per pull and two-layer groups for the article's 70B on 100G IB (an
# assumption of these tests: the 3.3 ms default was measured over TCP on a CPU VM, where 80 pulls
# of a 70B document would cost more than they hide; the model says so, see the default's test).
RDMA = {"kv_group_overhead_s": 0.0005, "kv_stream_layers": 2}


def _by_kv_transfer(link: cm.Link, **kw) -> dict[str, dict[int, object]]:
    out = {}
    kw = {**RDMA, **kw}
    for kv in ("bulk", "layerwise"):
        cfg = SimConfig("disagg", prefill_workers=2, decode_workers=1, link=link, kv_transfer=kv, **kw)
        out[kv] = {r.rid: r for r in simulate(cfg, STEPS, DOCS).requests}
    return out


def test_single_request_layerwise_leaves_the_last_group():
    from costmodel.article.layerwise import layerwise_exposed_s

    p, link = 4096, cm.LINKS["ib-100g"]
    cfg = SimConfig("disagg", link=link, kv_transfer="layerwise", **RDMA)
    r = _alone(cfg, p, 5)
    prefill = cm.prefill(M, HW, p).time_s
    left = layerwise_exposed_s(p * cm.kv_bytes_per_token(M), prefill, 40, cm.stream_link(link, 0.0005))
    assert r.token_times[0] - 0.5 == pytest.approx(prefill)  # the first token is not delayed
    assert r.kv_transfer == "layerwise" and r.exposed_transfer_s == pytest.approx(left)
    assert r.token_times[1] - r.token_times[0] == pytest.approx(left + cm.decode_step_tokens(M, HW, 1, p + 1).time_s)
    assert r.decode_wait_s == pytest.approx(0.0, abs=1e-12)  # alone: admitted as the last group lands
    bulk = _alone(SimConfig("disagg", link=link), p, 5)
    assert bulk.kv_transfer == "bulk" and bulk.exposed_transfer_s == pytest.approx(bulk.transfer_s)
    assert left < bulk.exposed_transfer_s / 10  # 40 groups: about 1/40 of it, plus a pull's overhead


def test_layerwise_never_leaves_documents_more_than_bulk():
    runs = _by_kv_transfer(cm.LINKS["ib-100g"])
    bulk, lw = runs["bulk"], runs["layerwise"]
    docs = [rid for rid, r in bulk.items() if r.kind == "doc"]
    assert len(docs) >= 5 and bulk.keys() == lw.keys()
    for rid in docs:
        b, s = bulk[rid], lw[rid]
        assert s.token_times[0] == b.token_times[0]  # the prefill pool does not see the link
        assert s.exposed_transfer_s <= b.exposed_transfer_s
        assert s.token_times[1] <= b.token_times[1] + 1e-12  # time to second token
    saved = [bulk[rid].token_times[1] - lw[rid].token_times[1] for rid in docs]
    assert max(saved) > 0.03  # a 4k+ document's pull on 100G IB is 50+ ms, nearly all hidden
    summary = {kv: summarize(simulate(
        SimConfig("disagg", prefill_workers=2, link=cm.LINKS["ib-100g"], kv_transfer=kv, **RDMA), STEPS, DOCS
    ), 1.0, NO_SLO) for kv in ("bulk", "layerwise")}  # fmt: skip
    assert summary["layerwise"]["kv_exposed_ms"]["p99"] < summary["bulk"]["kv_exposed_ms"]["p99"]
    assert summary["layerwise"]["ttst_doc_ms"]["p50"] < summary["bulk"]["ttst_doc_ms"]["p50"]


def test_layerwise_equals_bulk_when_the_transfer_is_free():
    free = cm.Link("free", "free", 1e18)
    runs = _by_kv_transfer(free, kv_group_overhead_s=0.0)
    for rid, b in runs["bulk"].items():
        s = runs["layerwise"][rid]
        assert s.exposed_transfer_s == pytest.approx(0.0, abs=1e-9)
        assert s.token_times == pytest.approx(b.token_times, abs=1e-9)


def test_auto_streams_documents_not_chats_on_a_slow_link():
    cfg = SimConfig("disagg", prefill_workers=2, link=cm.LINKS["ib-100g"], kv_transfer="auto", **RDMA)
    reqs = [r for r in simulate(cfg, STEPS, DOCS).requests if r.kv_transfer is not None]
    assert {r.kv_transfer for r in reqs if r.kind == "doc"} == {"layerwise"}
    assert {r.kv_transfer for r in reqs if r.kind == "chat" and r.prompt < 100} == {"bulk"}
    with pytest.raises(ValueError, match="kv_transfer"):
        SimConfig("disagg", kv_transfer="telepathy")


def test_cli_kv_transfer_flags(tmp_path):
    buf = io.StringIO()
    argv = ["simulate", "--modes", "disagg", "--link", "ib-100g", "--duration", "4", "--warmup", "1"]
    argv += ["--kv-transfer", "layerwise", "--kv-stream-layers", "4", "--no-png", "--out-dir", str(tmp_path), "--json"]
    with contextlib.redirect_stdout(buf):
        assert cli_main(argv) == 0
    (r,) = json.loads(buf.getvalue())["results"]
    assert r["kv_transfer"] == "layerwise" and r["kv_stream_layers"] == 4 and r["label"].endswith("layerwise/4")
    assert r["kv_exposed_ms"]["p50"] is not None and set(r["ttst_doc_ms"]) == {"p50", "p90", "p99"}


def test_a_prompt_in_its_prefill_step_counts_in_its_workers_load():
    """The router counts a request against its worker from dispatch to its end: an arrival during a
    colocated worker's whole-prompt prefill goes to the idle worker, not behind that prefill."""
    from costmodel.fit.step_fit import StepCostFit
    from costmodel.sim.compare_predict import simulate_requests
    from costmodel.workloads import RequestSpec

    fit = StepCostFit(0.01, 1e-3, 0.0, 1e-3)  # a 1,000-token prompt: ~1 s; 100 tokens: ~0.1 s
    steps = StepModel(cm.ModelSpec.resolve("tiny"), cm.HARDWARE["h100"], fit=fit)
    specs = [
        RequestSpec("long", (1,) * 1000, 1000, 2, 0.0, "document"),
        RequestSpec("short", (1,) * 100, 100, 2, 0.1, "chat"),
    ]
    long, short = simulate_requests(SimConfig("colocated", workers=2), steps, specs)
    assert long.token_times[0] == pytest.approx(1.01, rel=0.01)
    assert short.token_times[0] - 0.1 == pytest.approx(0.11, rel=0.05)  # its own prefill, on the other worker
