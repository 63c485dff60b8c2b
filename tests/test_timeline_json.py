"""The request timeline's JSON, pinned: the keys (in order) and value types that clients read from
`pdserve.timeline` (responses, the SSE final chunk) and `GET /v1/requests/{id}/timeline`.

The API returns `Orchestrator.timeline(rid).to_dict()` through `json_safe`, so the orchestrator's view is
the API's. Driven over in-process workers (no Ray, no server) for each way a request is served:
colocated, disaggregated (prefix policy, a nominal link), and auto's local and remote placements.
A change here is a change of the API: clients (bench serve, bench compare, link_probe) parse it.
Readers of a timeline's JSON (tracing, the dispatcher's outcomes) read it back into the typed
`Timeline`, which must give them what the orchestrator's own copy does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json

import pytest

from contracts.worker import GenerateRequest, WorkerConfig
from costmodel.article.cost_model import Calibration, ModelSpec
from costmodel.fit.step_fit import StepCostFit
from decode_worker.worker import DecodeWorker
from engine.config import PRESETS
from engine.sequence import SamplingParams
from prefill_worker.worker import PrefillWorker
from router.dispatch.dispatcher import AutoDispatcher
from router.dispatch.kv_transfer_policy import KVTransferPolicy
from router.lifecycle.orchestrator import Orchestrator
from router.observe import trace_phases
from router.observe.timeline import KVTransfer, Timeline
from router.workers.handle import WorkerHandle

_names = itertools.count()
PROMPT = list(b"the quick brown fox jumps over")  # 30 tokens: 1 full block of 16 and a partial one

HEAD = ["request_id", "mode", "arrival", "prompt_tokens", "output_tokens", "token_ids", "token_ms"]
PLACED = ["decode_worker", "prefill_worker", "policy", "dispatch_reason", "dispatched_ms"]
REMOTE_PREFILL = ["queue_ms", "prefill_ms", "prefill_start_ms", "prefill_end_ms", "kv_blocks", "prefill_cached_tokens"]
PULLED = ["decode_admitted_ms", "decode_cached_tokens", "kv_blocks_pulled", "kv_transfer", "transfer", "decode_wait_ms"]
COLOCATED_KEYS = [*HEAD, *PLACED, "first_token_ms", "queue_ms", "prefill_ms", "cached_tokens", "last_token_ms"]
COLOCATED_KEYS += ["finish_reason"]
DISAGG_KEYS = [*HEAD, "routed_prefix_blocks", *PLACED, *REMOTE_PREFILL, "first_token_ms", "last_token_ms", *PULLED]
DISAGG_KEYS += ["finish_reason"]
AUTO_HEAD = [*HEAD, "max_tokens", "dispatch", "routed_prefix_blocks", *PLACED]
AUTO_LOCAL_KEYS = [*AUTO_HEAD, "first_token_ms", "queue_ms", "prefill_ms", "cached_tokens", "last_token_ms"]
AUTO_LOCAL_KEYS += ["finish_reason"]
AUTO_REMOTE_KEYS = [*AUTO_HEAD, *REMOTE_PREFILL, "first_token_ms", "last_token_ms", *PULLED, "finish_reason"]
TRANSFER_KEYS = ["backend", "bytes", "descriptors", "ms", "gbytes_per_s", "link_ms", "gbits_per_s"]
LINK_KEYS = ["link_gbits_per_s", "link_nominal_ms", "rate_vs_link"]  # with a nominal --link-gbps
PLACE_KEYS = ["mode", "groups", "start_ms", "overlap_ms", "exposed_ms"]  # bulk or layer-wise, when
# layer-wise only: when each group was announced (after prefill_cached_tokens), each pull (transfer's last)
_AFTER = {"prefill_cached_tokens": ["prefill_groups"], "kv_transfer": ["kv_stream_open_ms"]}  # layer-wise only
LAYERWISE_KEYS = [k for x in DISAGG_KEYS for k in [x, *_AFTER.get(x, [])]]
DISPATCH_KEYS = ["decision", "reason", "streams_in_flight", "prompt_tokens", "cached_tokens", "local", "remote"]

# the JSON type of every value (int and float apart: a client may format them differently)
TYPES = {
    "request_id": str,
    "mode": str,
    "arrival": float,
    "prompt_tokens": int,
    "output_tokens": int,
    "token_ids": list,
    "token_ms": list,
    "max_tokens": int,
    "dispatch": dict,
    "routed_prefix_blocks": dict,
    "decode_worker": str,
    "policy": str,
    "dispatch_reason": str,
    "dispatched_ms": float,
    "queue_ms": float,
    "prefill_ms": float,
    "prefill_start_ms": float,
    "prefill_end_ms": float,
    "kv_blocks": int,
    "prefill_cached_tokens": int,
    "prefill_groups": list,
    "cached_tokens": int,
    "first_token_ms": float,
    "last_token_ms": float,
    "decode_admitted_ms": float,
    "decode_cached_tokens": int,
    "kv_blocks_pulled": int,
    "kv_transfer": str,
    "kv_stream_open_ms": float,
    "transfer": dict,
    "decode_wait_ms": float,
    "finish_reason": str,
}


def _cfg(**kw) -> WorkerConfig:
    return WorkerConfig(**{"model": "tiny", "transport": "local", "num_blocks": 32, **kw})


def _req(rid: str, max_tokens: int = 4) -> GenerateRequest:
    return GenerateRequest(rid, list(PROMPT), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def _serve(orch: Orchestrator, rids: list[str]) -> list[dict]:
    """Each request to its end, one after the other; their timelines through a JSON round trip."""

    async def main() -> list[dict]:
        await orch.start()
        try:
            for rid in rids:
                [ev async for ev in orch.generate(_req(rid))]
            return [json.loads(json.dumps(orch.timeline(rid).to_dict())) for rid in rids]
        finally:
            await orch.shutdown()

    return asyncio.run(main())


def _check_types(tl: dict) -> None:
    for k, v in tl.items():
        if k == "prefill_worker":
            assert v is None or isinstance(v, str)
        else:
            assert type(v) is TYPES[k], (k, v)
    assert all(type(t) is int for t in tl["token_ids"]) and all(type(t) is float for t in tl["token_ms"])


def _check_transfer(tr: dict, link: bool, layerwise: bool = False) -> None:
    assert list(tr) == TRANSFER_KEYS + (LINK_KEYS if link else []) + PLACE_KEYS + (["group_spans"] if layerwise else [])
    assert type(tr["bytes"]) is int and type(tr["descriptors"]) is int and type(tr["backend"]) is str
    assert type(tr["mode"]) is str and type(tr["groups"]) is int
    assert all(type(tr[k]) is float for k in ("ms", "gbytes_per_s", "gbits_per_s", "start_ms", "exposed_ms"))
    assert type(tr["overlap_ms"]) is float
    assert tr["link_ms"] and all(type(v) is float for v in tr["link_ms"].values())


@pytest.fixture
def workers():
    made: list = []

    def make(kind: str, **kw):
        n = next(_names)
        w = (
            PrefillWorker(_cfg(**kw), f"tj-prefill-{n}")
            if kind == "prefill"
            else DecodeWorker(_cfg(**kw), f"tj-{kind}-{n}", colocated=kind == "colocated")
        )
        made.append(w)
        return w

    yield make
    for w in made:
        w.shutdown()


def _handles(role: str, ws: list) -> list[WorkerHandle]:
    return [WorkerHandle(w.name, role, w, is_ray=False) for w in ws]


def test_colocated_timeline_json(workers):
    d = workers("colocated")
    orch = Orchestrator("colocated", PRESETS["tiny"], [], _handles("decode", [d]))
    (tl,) = _serve(orch, ["c1"])
    assert list(tl) == COLOCATED_KEYS
    _check_types(tl)
    assert tl["mode"] == "colocated" and tl["prefill_worker"] is None and tl["finish_reason"] == "length"
    assert tl["output_tokens"] == len(tl["token_ids"]) == len(tl["token_ms"]) == 4


def test_disaggregated_timeline_json(workers):
    p, d = workers("prefill"), workers("decode")
    orch = Orchestrator(
        "disagg", PRESETS["tiny"], _handles("prefill", [p]), _handles("decode", [d]), "prefix", link_gbps=10.0
    )
    (tl,) = _serve(orch, ["d1"])
    assert list(tl) == DISAGG_KEYS
    _check_types(tl)
    _check_transfer(tl["transfer"], link=True)
    assert tl["routed_prefix_blocks"] == {"prefill": 0, "decode": 0}
    assert tl["prefill_worker"] == p.name and tl["decode_worker"] == d.name and tl["policy"] == "prefix"
    assert tl["kv_transfer"] == tl["transfer"]["mode"] == "bulk" and tl["transfer"]["overlap_ms"] == 0.0


def test_layerwise_timeline_json(workers):
    """A layer-wise request's timeline: the same keys and when each group was announced and pulled,
    its pulls started before the prefill ended (they overlap it) and what was exposed after it is
    at most the whole transfer."""
    p, d = workers("prefill"), workers("decode")
    policy = KVTransferPolicy("layerwise", 1, PRESETS["tiny"].num_layers, 1.0)
    orch = Orchestrator(
        "disagg", PRESETS["tiny"], _handles("prefill", [p]), _handles("decode", [d]), "prefix", kv_policy=policy
    )
    timelines = _serve(orch, ["l1", "l2", "l3"])
    for tl in timelines:
        assert list(tl) == LAYERWISE_KEYS
        _check_types(tl)
        tr = tl["transfer"]
        _check_transfer(tr, link=False, layerwise=True)
        assert len(tr["group_spans"]) == tr["groups"] and sum(g[4] for g in tr["group_spans"]) == tr["bytes"]
        assert all(type(a) is int and type(b) is int and type(t) is float for a, b, t in tl["prefill_groups"])
        assert tl["kv_transfer"] == tr["mode"] == "layerwise" and tr["groups"] == PRESETS["tiny"].num_layers
        assert tr["exposed_ms"] >= 0 and tl["decode_admitted_ms"] >= tl["prefill_end_ms"]
    # the tiny model's prefill takes a few ms, so on a loaded CI machine one request's first pull can
    # start just after it ended (19.5 against 18.4 ms once): of three, at least one overlaps
    assert any(t["transfer"]["start_ms"] < t["prefill_end_ms"] and t["transfer"]["overlap_ms"] > 0 for t in timelines)


@pytest.mark.parametrize("choice", ["local", "remote"])
def test_auto_timeline_json(workers, tmp_path, choice):
    fit = StepCostFit(0.004, 50e-6, 0.1e-6, 1e-3)
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(Calibration(device="cpu", dtype="fp32", step_fit=fit.to_dict()).to_dict()))
    dispatcher = AutoDispatcher(Calibration.load(path), ModelSpec.resolve("tiny"), "fp8", 16, 10.0, 1.0)
    # the other placement is made inadmissible: the dispatcher's own choice, forced
    other = dispatcher.predict_remote if choice == "local" else dispatcher.predict_local
    name = "predict_remote" if choice == "local" else "predict_local"
    setattr(dispatcher, name, lambda *a, **kw: dataclasses.replace(other(*a, **kw), admissible=False))
    p, d = workers("prefill"), workers("decode", chunk_size=16)
    orch = Orchestrator(
        "auto", PRESETS["tiny"], _handles("prefill", [p]), _handles("decode", [d]), dispatcher=dispatcher
    )
    (tl,) = _serve(orch, ["a1"])
    assert list(tl) == (AUTO_LOCAL_KEYS if choice == "local" else AUTO_REMOTE_KEYS)
    _check_types(tl)
    assert list(tl["dispatch"]) == [*DISPATCH_KEYS, "outcome"] and tl["dispatch"]["decision"] == choice
    assert "ttft_ms" in tl["dispatch"]["outcome"]
    if choice == "remote":
        _check_transfer(tl["transfer"], link=False)


def _stamped(remote: bool) -> Timeline:
    """A finished request's timeline with every stamp its path takes."""
    tl = Timeline("r1", "auto", 1000.0, 40, max_tokens=8, dispatch={"decision": "remote" if remote else "local"})
    tl.routed_prefix_blocks = {"prefill": 1, "decode": 0} if remote else {"decode": 0}
    tl.stamp_placed("decode-0", "prefill-0" if remote else None, "prefix", "why", 1000.001)
    if remote:
        tl.queue_ms, tl.prefill_ms, tl.prefill_start_ms, tl.prefill_end_ms = 1.0, 8.0, 2.0, 10.0
        tl.kv_blocks, tl.prefill_cached_tokens = 3, 16
        tl.decode_admitted_ms, tl.decode_cached_tokens, tl.kv_blocks_pulled = 15.0, 0, 3
        tl.transfer = KVTransfer("nixl", 4096, 1, 2.0, 2.0, {"nvlink": 0.01}, 16.0, 10.0, 3.3, 1.6)
        tl.decode_wait_ms = 3.0
    else:
        tl.local_max_gap_ms, tl.queue_ms, tl.prefill_ms, tl.prefill_cached_tokens = 7.5, 1.0, 8.0, 0
    tl.first_token_ms, tl.last_token_ms, tl.output_tokens = 11.0, 40.0, 2
    tl.token_ids, tl.token_ms = [5, 6], [11.0, 40.0]
    tl.preemptions, tl.finish_reason = 1, "length"
    return tl


@pytest.mark.parametrize("remote", [False, True])
def test_a_timeline_reads_back_from_its_json(remote):
    tl = _stamped(remote)
    d = tl.to_dict()
    assert ("prefill_cached_tokens" in d) == remote and ("cached_tokens" in d) != remote
    assert Timeline.from_dict(json.loads(json.dumps(d))) == tl
    assert list(d)[-2:] == ["preemptions", "finish_reason"]


@pytest.mark.parametrize("remote", [False, True])
def test_a_trace_is_the_same_from_the_timeline_or_its_json(remote):
    tl = _stamped(remote)
    t0, t1 = int(1000.0 * 1e9), int(1000.05 * 1e9)
    typed = trace_phases.build(tl, t0, t1, "ok", None, 16)
    assert typed == trace_phases.build(tl.to_dict(), t0, t1, "ok", None, 16)
    names = [p.name for p in typed.phases]
    assert ("kv_transfer" in names) == remote and names[-1] == "finish"
    assert typed.root["pdserve.request_id"] == "r1" and typed.root["gen_ai.usage.output_tokens"] == 2
