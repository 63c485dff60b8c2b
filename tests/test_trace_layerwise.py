"""A layer-wise request's trace (issue 39 item 5): the prefill worker's forward pass per group of
layers under the prefill span, each group's pull under the request's span (overlapping the
prefill), and the decode admission after the last pull, from the stamps the workers sent back
(`PrefillResult.stream_groups`, `TransferStats.group_spans`) through the timeline and its JSON.

In-process: a timeline stamped by hand through the orchestrator's stamping methods, the tracer
with an in-memory exporter, and one request over in-process workers (no Ray, no server)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from contracts.worker import GenerateRequest, PrefillResult, StreamEvent, WorkerConfig
from decode_worker.worker import DecodeWorker
from engine.config import PRESETS
from engine.sequence import SamplingParams
from prefill_worker.worker import PrefillWorker
from router.dispatch.kv_transfer_policy import KVTransferPolicy
from router.lifecycle.orchestrator import Orchestrator
from router.observe import trace_phases
from router.observe.timeline import Timeline
from router.observe.tracing import Tracing
from router.workers.handle import WorkerHandle
from transport.wire import TransferStats

T0 = 1000.0  # the request's arrival, unix seconds
LAYERWISE_PHASES = [
    "validate",
    "dispatch",
    "queue",
    "prefill",
    "kv_transfer_exposed",
    "decode_admission",
    "decode",
    "finish",
]
BULK_PHASES = ["validate", "dispatch", "queue", "prefill", "decode_admission", "kv_transfer", "decode", "finish"]
# 4 layers in groups of 2, a prompt prefilled in 2 chunks: (first layer, last + 1, ms after arrival)
ANNOUNCED = [(0, 2, 3.0), (2, 4, 4.5), (0, 2, 7.0), (2, 4, 9.0)]
# each group's pull on the decode worker: (first layer, last + 1, start ms, end ms, bytes)
PULLS = [(0, 2, 3.1, 3.6, 1024), (2, 4, 4.6, 5.2, 1024), (0, 2, 7.1, 7.5, 1024), (2, 4, 9.1, 10.8, 1024)]


def _unix(ms: float) -> float:
    return T0 + ms / 1e3


def _layerwise(pulls: list[tuple[int, int, float, float, int]] = PULLS) -> Timeline:
    """A finished layer-wise request, stamped as the orchestrator stamps it."""
    tl = Timeline("lw1", "disagg", T0, 40)
    tl.stamp_placed("decode-0", "prefill-0", "round_robin", "next", _unix(0.5))
    tl.kv_transfer = "layerwise"
    handle: Any = SimpleNamespace(block_ids=(1, 2, 3))  # the stamp reads its block count only
    timings = {"queue_ms": 1.0, "prefill_ms": 8.0, "prefill_start": _unix(2.0), "prefill_end": _unix(10.0)}
    groups = [(a, b, _unix(ms)) for a, b, ms in ANNOUNCED]
    tl.stamp_prefilled(PrefillResult("lw1", 7, handle, timings, "prefill-0", True, groups))
    stats = TransferStats.build("lw1", "local", sum(p[4] for p in pulls), len(pulls), 3.2e-3)
    stats.mode, stats.groups = "layerwise", len(pulls)
    stats.start_unix, stats.end_unix = _unix(pulls[0][2]), _unix(pulls[-1][3])
    stats.group_spans = [(a, b, _unix(s), _unix(e), n) for a, b, s, e, n in pulls]
    ev = StreamEvent("lw1", "admitted", t=_unix(11.5), timings={"cached_tokens": 0, "blocks_pulled": 3}, transfer=stats)
    tl.stamp_admitted(ev, 10.0)
    tl.first_token_ms, tl.last_token_ms, tl.output_tokens = 11.7, 40.0, 2
    tl.token_ids, tl.token_ms, tl.finish_reason = [5, 6], [11.7, 40.0], "length"
    return tl


def _build(tl: Timeline | dict, status: str = "ok", error: str | None = None) -> trace_phases.RequestTrace:
    return trace_phases.build(tl, int(T0 * 1e9), int(_unix(45.0) * 1e9), status, error, 16)


def _ns(ms: float) -> int:
    return int(round(_unix(ms) * 1e9))


def test_the_layerwise_stamps_read_back_from_the_timeline_json():
    tl = _layerwise()
    assert tl.prefill_groups == ANNOUNCED
    assert tl.transfer is not None and tl.transfer.group_spans == PULLS
    assert tl.transfer.exposed_ms == 0.8 and tl.transfer.overlap_ms == 6.9
    d = tl.to_dict()
    keys = list(d)
    assert keys[keys.index("prefill_cached_tokens") + 1] == "prefill_groups"
    assert list(d["transfer"])[-1] == "group_spans"
    assert Timeline.from_dict(json.loads(json.dumps(d))) == tl


def test_a_layerwise_trace_is_the_same_from_the_timeline_or_its_json():
    tl = _layerwise()
    assert _build(tl) == _build(json.loads(json.dumps(tl.to_dict())))


def test_top_level_phases_still_partition_the_request():
    rt = _build(_layerwise())
    assert [p.name for p in rt.phases] == LAYERWISE_PHASES
    assert rt.phases[0].start_ns == int(T0 * 1e9) and rt.phases[-1].end_ns == int(_unix(45.0) * 1e9)
    assert all(a.end_ns == b.start_ns for a, b in zip(rt.phases, rt.phases[1:]))
    assert all(p.duration_ns >= 0 for p in rt.phases)
    by = {p.name: p for p in rt.phases}
    exposed = by["kv_transfer_exposed"]
    assert exposed.start_ns == _ns(10.0) and exposed.end_ns == _ns(10.8)  # prefill end -> last pull end
    a = exposed.attributes
    assert a["pdserve.kv.mode"] == "layerwise" and a["pdserve.kv.groups"] == 4 and a["pdserve.kv.bytes"] == 4096
    assert a["pdserve.kv.exposed_ms"] == 0.8 and a["pdserve.kv.overlap_ms"] == 6.9
    assert a["pdserve.kv.link_gbits_per_s"] == 10.0 and a["pdserve.kv.backend"] == "local"


def test_prefill_groups_tile_the_prefill():
    rt = _build(_layerwise())
    prefill = next(p for p in rt.phases if p.name == "prefill")
    kids = prefill.children
    names = ["prefill.layers 0-1", "prefill.layers 2-3"] * 2 + ["prefill.lm_head"]
    assert [c.name for c in kids] == names
    assert kids[0].start_ns == prefill.start_ns == _ns(2.0) and kids[-1].end_ns == prefill.end_ns == _ns(10.0)
    assert all(a.end_ns == b.start_ns for a, b in zip(kids, kids[1:]))
    assert [c.end_ns for c in kids[:-1]] == [_ns(ms) for _, _, ms in ANNOUNCED]
    assert [c.attributes["pdserve.chunk"] for c in kids[:-1]] == [0, 0, 1, 1]
    assert [(c.attributes["pdserve.first_layer"], c.attributes["pdserve.last_layer"]) for c in kids[:2]] == [
        (0, 1),
        (2, 3),
    ]
    assert all(c.attributes["pdserve.worker"] == "prefill-0" for c in kids)
    assert all(not p.children for p in rt.phases if p is not prefill)


def test_pulls_overlap_the_prefill_and_admission_follows_the_last():
    rt = _build(_layerwise())
    by = {p.name: p for p in rt.phases}
    pulls = rt.overlapping
    assert [p.name for p in pulls] == ["kv_transfer.layers 0-1", "kv_transfer.layers 2-3"] * 2
    assert [(p.start_ns, p.end_ns) for p in pulls] == [(_ns(s), _ns(e)) for _, _, s, e, _ in PULLS]
    assert sum(p.start_ns < by["prefill"].end_ns for p in pulls) == 4  # the overlap a viewer sees
    assert by["decode_admission"].start_ns == max(p.end_ns for p in pulls)
    assert by["decode_admission"].end_ns == _ns(11.5)
    a = pulls[0].attributes
    assert a["pdserve.kv.bytes"] == 1024 and a["pdserve.kv.backend"] == "local" and a["pdserve.kv.mode"] == "layerwise"
    assert a["pdserve.kv.src"] == "prefill-0" and a["pdserve.kv.dst"] == "decode-0" and a["pdserve.kv.ms"] == 0.5
    assert a["pdserve.kv.link_gbits_per_s"] == 10.0
    assert a["pdserve.kv.link_nominal_ms"] == pytest.approx(1024 * 8 / 10e9 * 1e3, abs=1e-4)
    assert a["pdserve.kv.link_ms.ib-100g"] == pytest.approx(1024 / 12.5e9 * 1e3, abs=1e-4)
    assert [p.attributes["pdserve.chunk"] for p in pulls] == [0, 0, 1, 1]


def test_a_skewed_decode_clock_is_clamped_into_the_request():
    # the decode worker's clock far behind and far ahead: pulls stay inside the request, phases partition it
    skewed = [(0, 2, -50.0, -49.0, 2048), (2, 4, 60.0, 70.0, 2048)]
    rt = _build(_layerwise(skewed))
    t0, t1 = int(T0 * 1e9), int(_unix(45.0) * 1e9)
    assert all(t0 <= p.start_ns <= p.end_ns <= t1 for p in rt.overlapping)
    assert sum(p.duration_ns for p in rt.phases) == t1 - t0 and all(p.duration_ns >= 0 for p in rt.phases)


def test_a_bulk_trace_has_no_group_spans():
    tl = _layerwise()
    assert tl.transfer is not None
    tl.kv_transfer, tl.prefill_groups = "bulk", []
    tl.transfer.mode, tl.transfer.groups, tl.transfer.group_spans = "bulk", 1, []
    d = tl.to_dict()
    assert "prefill_groups" not in d and "group_spans" not in d["transfer"]
    rt = _build(tl)
    assert [p.name for p in rt.phases] == BULK_PHASES
    assert rt.overlapping == [] and all(not p.children for p in rt.phases)


def _export(tl: Timeline | dict, status: str = "ok", error: str | None = None, t0: int = 0, t1: int = 0) -> list:
    """The spans the tracer hands its exporter for one request received at t0 (ns) and closed at t1."""
    exporter = InMemorySpanExporter()
    tracing = Tracing(None, chunk_size=16, exporter=exporter)
    t0, t1 = t0 or int(T0 * 1e9), t1 or int(_unix(45.0) * 1e9)
    try:
        root = tracing.start({}, "POST /v1/completions", t0, {})
        tracing.finish(root, tl, t0, t1, status, error)
        tracing.provider.force_flush()
        return list(exporter.get_finished_spans())
    finally:
        tracing.shutdown()


def test_spans_reach_the_exporter_under_their_parents():
    spans = _export(_layerwise())
    root = next(s for s in spans if s.name == "POST /v1/completions")
    by = {s.name: s for s in spans}
    assert len(spans) == 1 + len(LAYERWISE_PHASES) + 1 + (len(ANNOUNCED) + 1) + len(PULLS)  # root, phases, stream
    prefill = by["prefill"]
    assert all(s.parent.span_id == prefill.context.span_id for s in spans if s.name.startswith("prefill."))
    pulls = [s for s in spans if s.name.startswith("kv_transfer.layers")]
    assert len(pulls) == 4 and all(s.parent.span_id == root.context.span_id for s in pulls)
    assert all(by[n].parent.span_id == root.context.span_id for n in LAYERWISE_PHASES)
    assert min(s.start_time for s in pulls) < prefill.end_time  # the transfer overlaps the prefill
    assert pulls[0].attributes["pdserve.kv.bytes"] == 1024
    assert by["decode_admission"].start_time == max(s.end_time for s in pulls)


def test_a_failed_layerwise_request_marks_only_the_phase_it_ended_in():
    tl = _layerwise()
    tl.last_token_ms = tl.first_token_ms = None
    spans = _export(tl, "error", "decode worker decode-0 died")
    failed = [s.name for s in spans if s.status.status_code.name == "ERROR"]
    assert sorted(failed) == ["POST /v1/completions", "finish"]


# ------------------------------------------------------------------ one request over in-process workers
def _served_timeline() -> dict:
    cfg = WorkerConfig(model="tiny", transport="local", num_blocks=32)
    p, d = PrefillWorker(cfg, "tlw-prefill-0"), DecodeWorker(cfg, "tlw-decode-0", colocated=False)
    policy = KVTransferPolicy("layerwise", 1, PRESETS["tiny"].num_layers, 1.0)
    orch = Orchestrator(
        "disagg",
        PRESETS["tiny"],
        [WorkerHandle(p.name, "prefill", p, is_ray=False)],
        [WorkerHandle(d.name, "decode", d, is_ray=False)],
        kv_policy=policy,
    )
    prompt = list(b"the quick brown fox jumps over")
    req = GenerateRequest("lw-served", prompt, SamplingParams(max_tokens=3, ignore_eos=True))

    async def main() -> dict:
        await orch.start()
        try:
            [ev async for ev in orch.generate(req)]
            return json.loads(json.dumps(orch.timeline("lw-served").to_dict()))
        finally:
            await orch.shutdown()

    try:
        return asyncio.run(main())
    finally:
        p.shutdown()
        d.shutdown()


def test_a_served_layerwise_request_traces_its_groups():
    tl = _served_timeline()
    layers = PRESETS["tiny"].num_layers
    assert tl["kv_transfer"] == "layerwise" and len(tl["prefill_groups"]) == layers
    t0 = int(tl["arrival"] * 1e9)
    t1 = t0 + int((tl["last_token_ms"] + 1.0) * 1e6)
    rt = trace_phases.build(tl, t0, t1, "ok", None, None)
    assert rt == trace_phases.build(Timeline.from_dict(tl), t0, t1, "ok", None, None)
    assert [p.name for p in rt.phases] == LAYERWISE_PHASES
    assert all(a.end_ns == b.start_ns for a, b in zip(rt.phases, rt.phases[1:]))
    prefill = next(p for p in rt.phases if p.name == "prefill")
    kids = prefill.children
    assert len(kids) == layers + 1 and kids[0].start_ns == prefill.start_ns and kids[-1].end_ns == prefill.end_ns
    assert all(a.end_ns == b.start_ns for a, b in zip(kids, kids[1:]))
    assert len(rt.overlapping) == tl["transfer"]["groups"] == layers
    assert sum(p.attributes["pdserve.kv.bytes"] for p in rt.overlapping) == tl["transfer"]["bytes"]
    # the first pull began with the prefill still running: on the tiny model the last group and the
    # logits take under a millisecond, and two shared cores can hold the pull's start that long
    # (0.74 ms after the prefill's end in two CI runs, 2026-12-06): a few ms of slack, far under a bulk pull's wait
    assert rt.overlapping[0].start_ns < prefill.end_ns + 5_000_000
    spans = _export(tl, t0=t0, t1=t1)
    assert sum(s.name.startswith("kv_transfer.layers") for s in spans) == layers
