"""A request's timeline: every phase stamped as it happens, typed.

The orchestrator stamps it (router/lifecycle/orchestrator.py) and keeps the last few thousand after their
requests end (`GET /v1/requests/{id}/timeline`). Readers use the typed fields: tracing
(router/observe/trace_phases.py) and the auto dispatcher's outcomes (router/dispatch/dispatcher.py).
`Timeline.to_dict()` is the JSON clients see as `pdserve.timeline`; its keys, their order and their
types are part of the API (pinned by tests/test_timeline_json.py), and a stamp not taken (yet, or
ever) is left out of it, not sent as null.

Times: `arrival` is unix seconds at the router; every `*_ms` stamp is milliseconds after it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from contracts.worker import PrefillResult, StreamEvent
from transport.wire import TransferStats


@dataclass
class KVTransfer:
    """The KV pull of a disaggregated request (the timeline's `transfer`)."""

    backend: str
    bytes: int
    descriptors: int
    ms: float
    gbytes_per_s: float  # inf for a pull too fast to time (json_safe sends null)
    link_ms: dict[str, float]  # the same bytes over the article's links
    gbits_per_s: float
    # with a nominal link rate (--link-gbps): that link, the pull's time on it, measured / nominal
    link_gbits_per_s: float | None = None
    link_nominal_ms: float | None = None
    rate_vs_link: float | None = None
    # how it moved: "bulk" (one pull after the prefill) or "layerwise" (`groups` pulls, while the
    # prefill ran); when it started (ms after arrival), how much of it overlapped the remote
    # prefill, and what was left once the prefill had ended (the exposed transfer: end of the
    # last pull minus the prefill's end, waits before a bulk pull included)
    mode: str = "bulk"
    groups: int = 1
    start_ms: float | None = None
    overlap_ms: float | None = None
    exposed_ms: float | None = None
    # layer-wise: each pull as (first layer, last layer + 1, start ms, end ms, bytes), in order
    group_spans: list[tuple[int, int, float, float, int]] = field(default_factory=list)

    @classmethod
    def measured(cls, s: TransferStats, link_gbps: float | None) -> KVTransfer:
        t = cls(
            s.backend,
            s.bytes,
            s.descriptors,
            round(s.seconds * 1e3, 3),
            round(s.gbytes_per_s, 3),
            {k: round(v, 4) for k, v in s.link_ms.items()},
            round(s.gbytes_per_s * 8, 3),
        )
        if link_gbps:
            t.link_gbits_per_s = link_gbps
            t.link_nominal_ms = round(s.bytes * 8 / (link_gbps * 1e9) * 1e3, 3)
            t.rate_vs_link = round(s.gbytes_per_s * 8 / link_gbps, 3)
        t.mode, t.groups = s.mode, s.groups
        return t

    def place(self, s: TransferStats, tl: Timeline) -> None:
        """Its start, overlap with the remote prefill and exposed part, and its pulls, on `tl`'s clock."""
        self.group_spans = [(a, b, tl.rel(t0), tl.rel(t1), n) for a, b, t0, t1, n in s.group_spans]
        if not s.start_unix or not s.end_unix:
            return
        start, end = tl.rel(s.start_unix), tl.rel(s.end_unix)
        self.start_ms = start
        if tl.prefill_start_ms is not None and tl.prefill_end_ms is not None:
            self.overlap_ms = round(max(0.0, min(end, tl.prefill_end_ms) - max(start, tl.prefill_start_ms)), 3)
            self.exposed_ms = round(max(0.0, end - tl.prefill_end_ms), 3)

    def to_dict(self) -> dict[str, Any]:
        d = _fields(self, "backend", "bytes", "descriptors", "ms", "gbytes_per_s", "link_ms", "gbits_per_s")
        if self.link_gbits_per_s is not None:
            d.update(_fields(self, "link_gbits_per_s", "link_nominal_ms", "rate_vs_link"))
        d.update(_fields(self, "mode", "groups"))
        _put_stamps(d, self, "start_ms", "overlap_ms", "exposed_ms")
        if self.group_spans:
            d["group_spans"] = [list(g) for g in self.group_spans]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> KVTransfer:
        return cls(
            str(d.get("backend", "")),
            int(d.get("bytes", 0)),
            int(d.get("descriptors", 0)),
            float(d["ms"]),
            float(d.get("gbytes_per_s", 0.0)),
            dict(d.get("link_ms") or {}),
            float(d.get("gbits_per_s", 0.0)),
            d.get("link_gbits_per_s"),
            d.get("link_nominal_ms"),
            d.get("rate_vs_link"),
            str(d.get("mode", "bulk")),
            int(d.get("groups", 1)),
            d.get("start_ms"),
            d.get("overlap_ms"),
            d.get("exposed_ms"),
            [(int(a), int(b), float(t0), float(t1), int(n)) for a, b, t0, t1, n in d.get("group_spans") or []],
        )


@dataclass
class Timeline:
    """Every phase of one request, stamped as it happens. None: not stamped (yet, or ever)."""

    request_id: str
    mode: str  # the server's: "colocated" | "disagg" | "auto"
    arrival: float  # unix seconds at the router
    prompt_tokens: int
    output_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)  # lets clients check greedy equality across modes
    # each token's step end at its worker: against the client's receive time, the serving path's
    # own cost per token (`bench serve`: "serving overhead")
    token_ms: list[float] = field(default_factory=list)
    # ---- placement
    max_tokens: int | None = None  # auto: the length limit the dispatcher prices a stream by
    dispatch: dict[str, Any] | None = None  # auto: the dispatcher's decision (Decision.to_dict), later its "outcome"
    routed_prefix_blocks: dict[str, int] | None = None  # prefix policy, auto: cached blocks expected per role
    decode_worker: str | None = None
    prefill_worker: str | None = None  # None: the decode worker prefills (colocated, auto's local choice)
    policy: str | None = None
    dispatch_reason: str | None = None
    dispatched_ms: float | None = None  # the five above are stamped together, once placed
    # ---- prefill, timed by the worker that ran it (a prefill worker, or the decode worker)
    queue_ms: float | None = None
    prefill_ms: float | None = None
    prefill_start_ms: float | None = None  # these three: on a prefill worker only
    prefill_end_ms: float | None = None
    kv_blocks: int | None = None
    # that worker's prefix-cache hit; JSON "prefill_cached_tokens" from a prefill worker and
    # "cached_tokens" from the decode worker (the names clients already parse)
    prefill_cached_tokens: int | None = None
    # layer-wise, on a prefill worker: each group of layers as it was written and announced to the
    # decode worker (first layer, last layer + 1, ms), in order, one per group per prefill chunk
    prefill_groups: list[tuple[int, int, float]] = field(default_factory=list)
    local_max_gap_ms: float | None = None  # a local prefill: the longest gap the streams beside it saw
    # ---- tokens and the KV pull
    first_token_ms: float | None = None
    last_token_ms: float | None = None
    decode_admitted_ms: float | None = None
    decode_cached_tokens: int | None = None  # the decode side's prefix-cache hit (not pulled)
    kv_blocks_pulled: int | None = None
    kv_transfer: str | None = None  # remote prefills: "bulk" or "layerwise" (--kv-transfer)
    kv_stream_open_ms: float | None = None  # layer-wise: the router's open_stream call (before the prefill)
    transfer: KVTransfer | None = None
    decode_wait_ms: float | None = None  # prefill end to decode join, less the pull
    preemptions: int = 0  # KV taken back under memory pressure (recomputed, not re-sent)
    finish_reason: str | None = None  # "stop" | "length" | "error" | "abort"

    @property
    def prefilled_remotely(self) -> bool:
        return self.prefill_end_ms is not None

    def rel(self, t: float) -> float:
        """Unix time `t` as a stamp: ms after arrival."""
        return round((t - self.arrival) * 1e3, 3)

    # ---- stamping, in the order a request meets them
    def stamp_placed(self, decode: str, prefill: str | None, policy: str, reason: str, t: float) -> None:
        self.decode_worker, self.prefill_worker = decode, prefill
        self.policy, self.dispatch_reason, self.dispatched_ms = policy, reason, self.rel(t)

    def stamp_prefilled(self, result: PrefillResult) -> None:
        """A prefill worker's result: its own timings (unix stamps made relative)."""
        t = result.timings
        self.queue_ms, self.prefill_ms = t["queue_ms"], t["prefill_ms"]
        self.prefill_start_ms = self.rel(t.get("prefill_start", t["prefill_end"]))
        self.prefill_end_ms = self.rel(t["prefill_end"])
        self.kv_blocks = len(result.handle.block_ids)
        self.prefill_cached_tokens = int(t.get("cached_tokens", 0))
        self.prefill_groups = [(a, b, self.rel(at)) for a, b, at in result.stream_groups]

    def stamp_first_token(self, ev: StreamEvent) -> None:
        self.first_token_ms = self.rel(ev.t)
        if ev.timings:  # the decode worker prefilled: it timed the prompt's queue and prefill
            self.queue_ms = round(ev.timings["queue_ms"], 3)
            self.prefill_ms = round(ev.timings["prefill_ms"], 3)
            self.prefill_cached_tokens = int(ev.timings.get("cached_tokens", 0))

    def stamp_token(self, ev: StreamEvent) -> None:
        t = self.rel(ev.t)
        self.last_token_ms = t
        self.output_tokens = ev.index + 1
        self.token_ids.append(ev.token_id)
        self.token_ms.append(t)
        if ev.finished:
            self.finish_reason = ev.finish_reason

    def stamp_admitted(self, ev: StreamEvent, link_gbps: float | None) -> None:
        """The decode worker holds the KV: its own prefix hit, the blocks it pulled and the pull."""
        self.decode_admitted_ms = self.rel(ev.t)
        if ev.timings:
            self.decode_cached_tokens = int(ev.timings.get("cached_tokens", 0))
            self.kv_blocks_pulled = int(ev.timings.get("blocks_pulled", 0))
        if ev.transfer is not None:
            self.transfer = KVTransfer.measured(ev.transfer, link_gbps)
            self.transfer.place(ev.transfer, self)
            if self.prefill_end_ms is not None:
                if self.transfer.exposed_ms is not None and ev.transfer.mode == "layerwise":
                    # the pulls overlapped the prefill: the wait is what followed the last one
                    wait = self.decode_admitted_ms - self.prefill_end_ms - self.transfer.exposed_ms
                else:
                    wait = self.decode_admitted_ms - self.prefill_end_ms - ev.transfer.seconds * 1e3
                self.decode_wait_ms = round(wait, 3)

    # ---- JSON
    def to_dict(self) -> dict[str, Any]:
        """The API's `pdserve.timeline`: the stamps taken, in the order a request takes them."""
        d = _fields(self, "request_id", "mode", "arrival", "prompt_tokens", "output_tokens", "token_ids", "token_ms")
        _put_stamps(d, self, "max_tokens", "dispatch", "routed_prefix_blocks")
        if self.dispatched_ms is not None:
            d.update(_fields(self, "decode_worker", "prefill_worker", "policy", "dispatch_reason", "dispatched_ms"))
        remote = self.prefilled_remotely
        if remote:  # stamped when the prefill worker answered, before the first token
            _put_stamps(d, self, "queue_ms", "prefill_ms", "prefill_start_ms", "prefill_end_ms")
            _put_stamps(d, self, "kv_blocks", "prefill_cached_tokens")
            if self.prefill_groups:
                d["prefill_groups"] = [list(g) for g in self.prefill_groups]
        _put_stamps(d, self, "local_max_gap_ms", "first_token_ms")
        if not remote:  # the decode worker's figures arrive with the first token
            _put_stamps(d, self, "queue_ms", "prefill_ms")
            _put(d, "cached_tokens", self.prefill_cached_tokens)
        _put_stamps(d, self, "last_token_ms", "decode_admitted_ms", "decode_cached_tokens")
        _put_stamps(d, self, "kv_blocks_pulled", "kv_transfer", "kv_stream_open_ms")
        _put(d, "transfer", self.transfer.to_dict() if self.transfer is not None else None)
        _put(d, "decode_wait_ms", self.decode_wait_ms)
        if self.preemptions:
            d["preemptions"] = self.preemptions
        _put(d, "finish_reason", self.finish_reason)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Timeline:
        """A timeline from its JSON (to_dict's, or a hand-written one with only some stamps).
        `dispatch` stays the same dict: an outcome stamped into it lands in `d` too."""
        tr = d.get("transfer")
        return cls(
            request_id=str(d.get("request_id", "")),
            mode=str(d.get("mode", "")),
            arrival=float(d["arrival"]),
            prompt_tokens=int(d.get("prompt_tokens", 0)),
            output_tokens=int(d.get("output_tokens", 0)),
            token_ids=list(d.get("token_ids", [])),
            token_ms=list(d.get("token_ms", [])),
            max_tokens=d.get("max_tokens"),
            dispatch=d.get("dispatch"),
            routed_prefix_blocks=d.get("routed_prefix_blocks"),
            decode_worker=d.get("decode_worker"),
            prefill_worker=d.get("prefill_worker"),
            policy=d.get("policy"),
            dispatch_reason=d.get("dispatch_reason"),
            dispatched_ms=d.get("dispatched_ms"),
            queue_ms=d.get("queue_ms"),
            prefill_ms=d.get("prefill_ms"),
            prefill_start_ms=d.get("prefill_start_ms"),
            prefill_end_ms=d.get("prefill_end_ms"),
            kv_blocks=d.get("kv_blocks"),
            prefill_cached_tokens=d.get("prefill_cached_tokens", d.get("cached_tokens")),
            prefill_groups=[(int(a), int(b), float(at)) for a, b, at in d.get("prefill_groups") or []],
            local_max_gap_ms=d.get("local_max_gap_ms"),
            first_token_ms=d.get("first_token_ms"),
            last_token_ms=d.get("last_token_ms"),
            decode_admitted_ms=d.get("decode_admitted_ms"),
            decode_cached_tokens=d.get("decode_cached_tokens"),
            kv_blocks_pulled=d.get("kv_blocks_pulled"),
            kv_transfer=d.get("kv_transfer"),
            kv_stream_open_ms=d.get("kv_stream_open_ms"),
            transfer=KVTransfer.from_dict(tr) if tr and "ms" in tr else None,
            decode_wait_ms=d.get("decode_wait_ms"),
            preemptions=int(d.get("preemptions", 0)),
            finish_reason=d.get("finish_reason"),
        )


def _put(d: dict[str, Any], key: str, value: Any) -> None:
    """A stamp goes into the JSON once taken; one not taken is left out, not sent as null."""
    if value is not None:
        d[key] = value


def _put_stamps(d: dict[str, Any], obj: object, *names: str) -> None:
    """`_put` of each attribute `names` of `obj`, under its own name, in that order (the JSON's)."""
    for name in names:
        _put(d, name, getattr(obj, name))


def _fields(obj: object, *names: str) -> dict[str, Any]:
    """The attributes `names` of `obj` as JSON entries sent whatever their value, in that order; a
    list or dict is copied, so the JSON does not change with the live timeline."""
    return {name: _copied(getattr(obj, name)) for name in names}


def _copied(value: Any) -> Any:
    return list(value) if isinstance(value, list) else dict(value) if isinstance(value, dict) else value
