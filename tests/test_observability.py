"""Observability end to end: `pdserve serve --log-format json --otlp-endpoint URL` as a real process
(disaggregated, tiny model) against a real OTLP/HTTP receiver on loopback that decodes the
protobuf export requests; the Grafana dashboard's queries against that server's /metrics; and the
trace builder and exporter on their own (phases, errors, a collector that is down)."""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import yaml
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.helpers import exported_names, samples, wait_until
from tests.serve_process import ROOT, ServeProcess

# `pdserve serve` child processes beside an OTLP receiver, on Ray
pytestmark = [pytest.mark.ray, pytest.mark.server]

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
PHASES = ["validate", "dispatch", "queue", "prefill", "decode_admission", "kv_transfer", "decode", "finish"]


class OTLPReceiver:
    """An OTLP/HTTP trace receiver (POST /v1/traces, protobuf) on a free 127.0.0.1 port."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                with receiver.lock:
                    for rs in req.resource_spans:
                        service = {a.key: a.value.string_value for a in rs.resource.attributes}.get("service.name")
                        for ss in rs.scope_spans:
                            receiver.spans.extend(_span_dict(s, service) for s in ss.spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def trace(self, trace_id: str, root_name_prefix: str = "POST", timeout_s: float = 30.0) -> list[dict]:
        """The spans of one trace, once its root span (ended last) has arrived."""

        def rooted() -> bool:
            with self.lock:
                return any(s["trace_id"] == trace_id and s["name"].startswith(root_name_prefix) for s in self.spans)

        wait_until(rooted, timeout_s, lambda: f"trace {trace_id}'s root span ({len(self.spans)} spans here)", 0.1)
        time.sleep(0.6)  # children were queued first; let the batch that holds them land
        with self.lock:
            return [s for s in self.spans if s["trace_id"] == trace_id]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def _span_dict(s, service) -> dict:
    return {
        "service": service,
        "name": s.name,
        "trace_id": s.trace_id.hex(),
        "span_id": s.span_id.hex(),
        "parent": s.parent_span_id.hex(),
        "start": s.start_time_unix_nano,
        "end": s.end_time_unix_nano,
        "attrs": {a.key: _value(a.value) for a in s.attributes},
        "events": [(e.name, {a.key: _value(a.value) for a in e.attributes}) for e in s.events],
        "status": s.status.code,  # 0 unset, 1 ok, 2 error
        "status_message": s.status.message,
    }


@pytest.fixture(scope="module")
def receiver():
    r = OTLPReceiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def server(receiver, tmp_path_factory):
    # bulk pulls: these traces pin the bulk phases (layer-wise ones: tests/test_trace_layerwise.py)
    args = [
        "--model",
        "tiny",
        "--mode",
        "disagg",
        "--num-blocks",
        "128",
        "--log-format",
        "json",
        "--kv-transfer",
        "bulk",
    ]
    args += ["--log-level", "debug", "--otlp-endpoint", receiver.url]
    proc = ServeProcess(args, tmp_path_factory.mktemp("obs") / "serve.log")
    _stream(proc.url, {**BODY, "max_tokens": 2, "stream": True})  # warm: the first request pays for imports
    yield proc
    proc.stop()


_CLIENT = httpx.Client(timeout=60)  # one client, its connection kept: the timing is the request's only


def _stream(url: str, body: dict, headers: dict | None = None) -> tuple[str, float, list[dict]]:
    """POST a streaming completion; returns (request id, seconds from send to [DONE], payloads)."""
    payloads = []
    t0 = time.perf_counter()
    with _CLIENT.stream("POST", url + "/v1/completions", json=body, headers=headers or {}) as r:
        assert r.status_code == 200, r.read()
        rid = r.headers["x-request-id"]
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                payloads.append(json.loads(line[6:]))
    return rid, time.perf_counter() - t0, payloads


BODY = {"model": "tiny", "prompt": "observability " * 8, "max_tokens": 48, "temperature": 0, "ignore_eos": True}


def test_trace_of_a_disaggregated_request(server, receiver):
    tp = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}
    body = {**BODY, "prompt": "a prompt no other test sends, so its KV is pulled " * 2, "stream": True}
    rid, client_s, _ = _stream(server.url, body, tp)
    spans = receiver.trace(CLIENT_TRACE)
    roots = [s for s in spans if s["parent"] == CLIENT_SPAN]
    assert len(roots) == 1, spans  # the client's traceparent is the root's parent
    root = roots[0]
    assert root["name"] == "POST /v1/completions" and root["service"] == "pdserve" and root["status"] != 2
    assert root["attrs"]["pdserve.request_id"] == rid
    children = [s for s in spans if s is not root]
    assert all(s["parent"] == root["span_id"] for s in children)
    phases = sorted((s for s in children if "pdserve.phase" in s["attrs"]), key=lambda s: s["attrs"]["pdserve.phase"])
    assert [s["name"] for s in phases] == PHASES
    assert {s["name"] for s in children} == {*PHASES, "stream"}
    # consecutive, and together exactly the root: its end-to-end time
    assert phases[0]["start"] == root["start"] and phases[-1]["end"] == root["end"]
    assert all(a["end"] == b["start"] for a, b in zip(phases, phases[1:]))
    root_s = (root["end"] - root["start"]) / 1e9
    assert sum(s["end"] - s["start"] for s in phases) / 1e9 == pytest.approx(root_s, rel=0.02)
    # ...and the root is what the client saw, less the client's own side of the socket (on an idle
    # machine within 2%; the bound is loose because a loaded one delays the client process too)
    assert 0.8 * client_s <= root_s <= client_s + 0.001
    tl = httpx.get(f"{server.url}/v1/requests/{rid}/timeline", timeout=10).json()
    by = {s["name"]: s for s in children}
    kv = by["kv_transfer"]["attrs"]
    assert kv["pdserve.kv.bytes"] == tl["transfer"]["bytes"] > 0
    assert kv["pdserve.kv.backend"] == tl["transfer"]["backend"]
    assert {"pdserve.kv.link_ms.nvlink", "pdserve.kv.link_ms.ib-400g", "pdserve.kv.link_ms.ib-100g"} <= set(kv)
    assert (by["kv_transfer"]["end"] - by["kv_transfer"]["start"]) / 1e6 == pytest.approx(
        tl["transfer"]["ms"], abs=0.01
    )
    assert by["prefill"]["attrs"]["pdserve.prompt_tokens"] == tl["prompt_tokens"]
    assert by["decode"]["attrs"]["pdserve.output_tokens"] == 48
    assert "round_robin" in by["dispatch"]["attrs"]["pdserve.reason"]
    assert by["dispatch"]["attrs"]["pdserve.prefill_worker"] == tl["prefill_worker"]
    assert any(name == "first_token" for name, _ in root["events"])


def test_aborted_request_trace_carries_the_error(server, receiver):
    tid = "0af7651916cd43dd8448eb211c80319c"
    tp = {"traceparent": f"00-{tid}-b7ad6b7169203331-01"}
    body = {**BODY, "max_tokens": 400, "stream": True}
    with _CLIENT.stream("POST", server.url + "/v1/completions", json=body, headers=tp) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # leave after the first token
    spans = receiver.trace(tid)
    root = next(s for s in spans if s["parent"] == "b7ad6b7169203331")
    assert root["status"] == 2 and root["attrs"]["pdserve.status"] == "aborted"
    assert any(name == "aborted" for name, _ in root["events"])
    assert any(s["status"] == 2 for s in spans if s is not root)  # the phase it ended in


def test_json_logs_carry_request_and_trace_ids(server, receiver):
    tid = "5b8efff798038103d269b633813fc60c"
    rid, _, _ = _stream(
        server.url, {**BODY, "max_tokens": 4, "stream": True}, {"traceparent": f"00-{tid}-eee19b7ec3c1b174-01"}
    )

    def request_line() -> dict | None:
        records = [json.loads(x) for x in server.log().splitlines() if x.startswith("{")]
        return next((r for r in records if r.get("request_id") == rid and r["message"].startswith("request ")), None)

    line = wait_until(request_line, 20, lambda: "the request's log line in " + server.log()[-3000:], interval=0.1)
    assert line["trace_id"] == tid and line["status"] == "ok" and line["completion_tokens"] == 4
    assert {"ts", "level", "logger", "message"} <= set(line)
    # every line the router process logged is JSON; Ray's own lines keep Ray's format: its workers'
    # forwarded output ("(WorkerHost pid=...)", maybe coloured), its C++ core ("[2026-..."), its
    # Python logger at ray.init ("2026-... 12:00:00,123\tINFO worker.py:...")
    ray_line = re.compile(r"^(\x1b\[\d+m)?\(|^\[|^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\t")
    lines = [x for x in server.log().splitlines() if x.strip() and not ray_line.match(x)]
    assert len(lines) > 3
    for x in lines:
        json.loads(x)


def _dashboard_queries(d: dict) -> list[str]:
    exprs = []
    for p in d["panels"]:
        for sub in [p, *p.get("panels", [])]:
            exprs += [t["expr"] for t in sub.get("targets", [])]
    for v in d["templating"]["list"]:
        if v["type"] == "query":
            exprs.append(v["query"]["query"] if isinstance(v["query"], dict) else v["query"])
    return exprs


def test_every_dashboard_query_names_an_exported_metric(server):
    _stream(server.url, {**BODY, "max_tokens": 4, "stream": True})  # a request: the transfer histograms get series
    text = httpx.get(server.url + "/metrics", timeout=30).text
    exported = exported_names(text)
    dash = json.loads((ROOT / "deploy/grafana/pdserve.json").read_text())
    exprs = _dashboard_queries(dash)
    assert len(exprs) > 20
    for e in exprs:
        names = re.findall(r"\bpdserve_[a-zA-Z0-9_]+", e)
        assert names, e
        for n in names:
            assert n in exported, f"dashboard query {e!r} names {n}, which /metrics does not export"
    for must in ("pdserve_kv_transfer_duration_seconds_bucket", "pdserve_kv_transfer_size_bytes_bucket"):
        assert any(labels for labels, _ in samples(text, must)), must  # with samples, by link
    prom = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    assert prom["scrape_configs"][0]["metrics_path"] == "/metrics"


# ------------------------------------------------------------------------------ the builder on its own
def _tl(**kw) -> dict:
    base = {
        "request_id": "cmpl-x",
        "mode": "disagg",
        "arrival": 1000.0,
        "prompt_tokens": 40,
        "output_tokens": 5,
        "prefill_worker": "prefill-0",
        "decode_worker": "decode-0",
        "policy": "round_robin",
        "dispatch_reason": "next",
        "dispatched_ms": 0.5,
        "queue_ms": 1.0,
        "prefill_start_ms": 2.0,
        "prefill_ms": 8.0,
        "prefill_end_ms": 10.0,
        "first_token_ms": 11.0,
        "decode_admitted_ms": 15.0,
        "transfer": {"backend": "nixl", "bytes": 4096, "descriptors": 1, "ms": 2.0, "gbytes_per_s": 2.0, "link_ms": {}},
        "last_token_ms": 40.0,
        "finish_reason": "length",
    }
    base.update(kw)
    return base


def test_phases_partition_the_request_and_clamp_skewed_clocks():
    from router.observe import trace_phases

    t0, t1 = int(999.999e9), int(1000.045e9)
    rt = trace_phases.build(_tl(), t0, t1, "ok", None, chunk_size=16)
    assert [p.name for p in rt.phases] == PHASES
    assert rt.phases[0].start_ns == t0 and rt.phases[-1].end_ns == t1
    assert sum(p.duration_ns for p in rt.phases) == t1 - t0
    kv = next(p for p in rt.phases if p.name == "kv_transfer")
    assert kv.duration_ns == pytest.approx(2e6, abs=1e3) and kv.attributes["pdserve.kv.bytes"] == 4096
    assert next(p for p in rt.phases if p.name == "prefill").attributes["pdserve.chunks"] == 3  # 40 tokens / 16
    # a worker clock ahead of the router's: the phase shrinks to 0, never negative, still a partition
    rt = trace_phases.build(_tl(prefill_start_ms=-5.0, prefill_end_ms=200.0), t0, t1, "ok", None, None)
    assert all(p.duration_ns >= 0 for p in rt.phases) and sum(p.duration_ns for p in rt.phases) == t1 - t0
    # colocated, failed before its first token: no transfer, no decode; the error is on the last phase
    tl = _tl(prefill_worker=None, mode="colocated", transfer=None)
    for k in ("prefill_start_ms", "prefill_end_ms", "first_token_ms", "decode_admitted_ms", "last_token_ms"):
        tl.pop(k)
    rt = trace_phases.build(tl, t0, t1, "error", "decode worker decode-0 died", None)
    assert [p.name for p in rt.phases] == ["validate", "dispatch", "finish"]
    assert rt.error == "decode worker decode-0 died" and rt.stream is None


def test_collector_down_costs_only_dropped_spans(monkeypatch):
    from router.observe.tracing import Tracing

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "1")
    tr = Tracing("http://127.0.0.1:9", max_queue=16)  # nothing listens on port 9
    t = time.time_ns()
    start = time.perf_counter()
    for i in range(5):
        root = tr.start({}, "POST /v1/completions", t, {})
        tr.finish(root, _tl(request_id=f"r{i}", arrival=t / 1e9), t, t + 45_000_000, "ok", None)
    assert time.perf_counter() - start < 0.5  # the request path never waits on the collector
    tr.shutdown()
    exported, dropped = tr.counts()
    # 8 phases + stream + root per request; a full queue's count may race its export thread by one
    assert exported == 0 and abs(dropped - 5 * 10) <= 1


def test_tracing_is_off_unless_configured():
    from router.observe.tracing import enabled, traces_url

    assert not enabled(None, {})
    assert enabled("http://c:4318", {}) and enabled(None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"})
    assert not enabled("http://c:4318", {"OTEL_SDK_DISABLED": "true"})
    assert traces_url("http://c:4318") == "http://c:4318/v1/traces"
    assert traces_url("http://c:4318/custom/path") == "http://c:4318/custom/path"


def test_json_formatter_line():
    import logging

    from router.observe import logs

    rec = logging.LogRecord("pdserve.app", logging.ERROR, __file__, 1, "request %s failed", ("r1",), None)
    token = logs.request_id.set("r1")
    try:
        logs.ContextFilter().filter(rec)
    finally:
        logs.request_id.reset(token)
    rec.status = "error"
    out = json.loads(logs.JsonFormatter().format(rec))
    assert out["message"] == "request r1 failed" and out["request_id"] == "r1" and out["status"] == "error"
    assert out["level"] == "error" and out["ts"].endswith("Z") and "trace_id" not in out


def test_dashboard_json_is_well_formed():
    d = json.loads(Path(ROOT / "deploy/grafana/pdserve.json").read_text())
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)) and d["uid"] == "pdserve"


# ------------------------------------------------------------------------------ colocated: the stall
def test_colocated_stall_metric_and_trace(receiver):
    """A long prompt prefilled on the decode worker beside two streams: /metrics has its stall (the
    streams' longest gap) per worker, and its trace has the colocated phases (no KV transfer)."""
    from concurrent.futures import ThreadPoolExecutor

    from router.config import ServeConfig
    from router.serve_cli import ServerThread

    cfg = ServeConfig(model="tiny", mode="colocated", num_blocks=256, otlp_endpoint=receiver.url)
    with ServerThread(cfg, startup_timeout_s=180) as srv, ThreadPoolExecutor(3) as pool:
        client = httpx.Client(timeout=60)
        streams = [
            pool.submit(_stream, srv.url, {**BODY, "prompt": f"stream {i}", "max_tokens": 120, "stream": True})
            for i in range(2)
        ]

        def streams_running() -> bool:
            running = samples(client.get(srv.url + "/metrics").text, "pdserve_running_sequences")
            return any(labels and v in (1.0, 2.0) for labels, v in running)

        wait_until(streams_running, 30, "the streams to start")
        tid = "1f0e5bd1a0c34d2e9a7b6c5d4e3f2a10"
        doc = {**BODY, "prompt": "document " * 200, "max_tokens": 2, "stream": True}
        _stream(srv.url, doc, {"traceparent": f"00-{tid}-1111111111111111-01"})
        for f in streams:
            f.result()
        text = client.get(srv.url + "/metrics").text
    counts = samples(text, "pdserve_stall_seconds_count")
    assert counts and sum(v for _, v in counts) >= 1, text
    spans = receiver.trace(tid)
    phases = sorted((s for s in spans if "pdserve.phase" in s["attrs"]), key=lambda s: s["attrs"]["pdserve.phase"])
    assert [s["name"] for s in phases] == ["validate", "dispatch", "queue", "prefill", "decode", "finish"]
    prefill = next(s for s in phases if s["name"] == "prefill")
    assert prefill["attrs"]["pdserve.prompt_tokens"] > 200 and prefill["attrs"]["pdserve.chunks"] == 1
