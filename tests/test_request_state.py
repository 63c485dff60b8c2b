"""A live request's bookkeeping, without workers: which worker deaths fail it (RequestState.needs)
and what each decode worker's batch looks like to the router (DecodeStreams: the stall a local
prefill causes, the streams auto prices a decision against)."""

from __future__ import annotations

from contracts.worker import GenerateRequest, StreamEvent
from engine.sequence import SamplingParams
from router.lifecycle.decode_streams import DecodeStreams
from router.lifecycle.request_state import RequestState
from router.observe.timeline import Timeline
from router.workers.handle import WorkerHandle

PREFILL = WorkerHandle("prefill-0", "prefill", object(), is_ray=False)
DECODE = WorkerHandle("decode-0", "decode", object(), is_ray=False)
OTHER = WorkerHandle("decode-1", "decode", object(), is_ray=False)


def _state(rid: str, prefill: WorkerHandle | None, arrival: float = 100.0, max_tokens: int = 8) -> RequestState:
    req = GenerateRequest(rid, [1] * 20, SamplingParams(max_tokens=max_tokens), arrival=arrival)
    tl = Timeline(rid, "auto", arrival, 20, max_tokens=max_tokens)
    return RequestState(req, tl, DECODE, prefill)


def _token(rid: str, index: int, t: float) -> StreamEvent:
    return StreamEvent(rid, "token", 7, index, t=t)


def test_a_prefill_workers_death_fails_a_request_only_until_its_kv_is_pulled():
    s = _state("r", PREFILL)
    assert s.needs(DECODE) and not s.needs(OTHER)
    for phase, needed in ((None, False), ("prefill", True), ("pull", True), ("decode", False)):
        s.phase = phase
        assert s.needs(PREFILL) is needed, phase
        assert s.needs(DECODE)  # the stream itself is on the decode worker, whatever the phase
    assert not _state("local", None).needs(PREFILL)


def test_a_local_prefill_is_charged_the_longest_gap_its_neighbours_saw():
    live: dict[str, RequestState] = {}
    streams = DecodeStreams(live)
    chat, doc = _state("chat", None, arrival=100.0), _state("doc", None, arrival=101.0)
    live.update(chat=chat, doc=doc)
    streams.prefilling(doc)
    streams.on_token(chat, _token("chat", 0, 100.5))  # its first token: no gap yet
    streams.on_token(chat, _token("chat", 1, 101.25))  # counted from the doc's arrival: 250 ms
    streams.on_token(chat, _token("chat", 2, 101.35))
    assert doc.timeline.local_max_gap_ms == 250.0
    doc.timeline.first_token_ms = 500.0
    streams.prefilled(doc)  # its first token came: later gaps are not its doing
    streams.on_token(chat, _token("chat", 3, 102.35))
    assert doc.timeline.local_max_gap_ms == 250.0 and chat.timeline.local_max_gap_ms is None


def test_the_streams_on_a_decode_worker_are_those_decoding_there():
    live: dict[str, RequestState] = {}
    local, remote, waiting = _state("local", None), _state("remote", PREFILL), _state("waiting", None)
    elsewhere = _state("elsewhere", None)
    elsewhere.decode = OTHER
    for s in (local, remote, waiting, elsewhere):
        live[s.request_id] = s
    for s in (local, remote, elsewhere):
        s.timeline.first_token_ms, s.timeline.output_tokens = 1000.0, 3
    streams = DecodeStreams(live)
    assert [x.context for x in streams.streams_on(DECODE, 102.0)] == [23]  # remote: its KV not pulled yet
    remote.timeline.decode_admitted_ms = 1005.0
    got = streams.streams_on(DECODE, 102.0)
    assert [(x.context, x.decoded, x.max_tokens) for x in got] == [(23, 3, 8), (23, 3, 8)]
    assert got[0].decode_s == 1.0  # since its first token, 1 s after arrival
