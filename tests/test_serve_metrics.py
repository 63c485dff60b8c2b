"""`pdserve bench serve`: metric arithmetic against hand-computed values, seeded workloads, and the
client end to end against a scripted OpenAI-compatible SSE server (tests/fakes.py)."""

from __future__ import annotations

import asyncio
import json
import math
import time

import pytest

from benchmarks.client.bench_serve import BenchConfig, format_table, run_benchmark
from benchmarks.client.serve_client import ClientConfig
from cli import main as cli_main
from costmodel.serve_metrics import RequestRecord, compute_metrics, percentile
from costmodel.workloads import RequestSpec, WorkloadConfig, build_workload
from tests.fakes import completions_server_fixtures

approx = pytest.approx


def rec(
    rid: str,
    send: float | None,
    chunks: list[float],
    end: float | None = None,
    kind: str = "chat",
    completion_tokens: int | None = None,
    error: str | None = None,
) -> RequestRecord:
    return RequestRecord(
        rid,
        kind,
        prompt_len=10,
        max_tokens=8,
        scheduled_s=send or 0.0,
        send_s=send,
        chunk_times_s=chunks,
        end_s=end if end is not None else (chunks[-1] if chunks else send),
        completion_tokens=completion_tokens,
        error=error,
    )


# ----------------------------------------------------------------------------- metric arithmetic


def test_percentile_interpolates_like_numpy():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == approx(3.7)  # h = 2.7 -> 3 + 0.7 * 1
    assert percentile([5.0], 99) == 5.0
    assert percentile([], 50) is None


def test_serving_overhead_pairs_step_ends_with_chunks():
    """Serving overhead: each token's chunk at the client less its step's end at the worker; a
    record whose chunks do not pair one to one with its tokens contributes nothing."""
    a = rec("a", 0.0, [0.10, 0.15, 0.20])
    a.step_end_times_s = [0.098, 0.146, 0.199]
    b = rec("b", 0.0, [0.10, 0.30])
    b.step_end_times_s = [0.05, 0.1, 0.2]  # 3 tokens in 2 chunks: not paired
    assert a.serving_overheads_s == approx([0.002, 0.004, 0.001])
    assert b.serving_overheads_s == []
    m = compute_metrics([a, b])
    assert m.serving_overhead_ms.count == 3 and m.serving_overhead_ms.p50 == approx(2.0)
    assert compute_metrics([rec("c", 0.0, [0.1])]).serving_overhead_ms.count == 0


def _two_requests() -> list[RequestRecord]:
    return [
        # TTFT 100 ms, E2E 300 ms, 4 tokens: TPOT (300-100)/3 = 66.67 ms, ITL 50, 50, 100 ms
        rec("r1", 0.0, [0.10, 0.15, 0.20, 0.30], end=0.30),
        # TTFT 200 ms, E2E 300 ms, 2 tokens: TPOT 100 ms, ITL 100 ms
        rec("r2", 1.0, [1.2, 1.3], end=1.3),
        rec("r3", 0.5, [], end=0.5, error="HTTP 500: boom"),  # failed
        rec("r4", None, [], end=None),  # never sent
    ]


def test_request_metrics_hand_computed():
    m = compute_metrics(_two_requests())
    assert (m.num_requests, m.completed, m.failed, m.not_sent) == (4, 2, 1, 1)
    assert m.duration_s == approx(1.3)  # last end 1.3 - first send 0.0
    assert m.request_throughput == approx(2 / 1.3)
    assert m.total_output_tokens == 6
    assert m.output_throughput == approx(6 / 1.3)
    assert m.total_input_tokens == 20  # no usage: the workload's 10 + 10
    assert (m.ttft_ms.mean, m.ttft_ms.p50, m.ttft_ms.p90, m.ttft_ms.p99, m.ttft_ms.max) == (
        approx(150),
        approx(150),
        approx(190),
        approx(199),
        approx(200),
    )
    assert (m.tpot_ms.count, m.tpot_ms.mean, m.tpot_ms.p50) == (2, approx(250 / 3), approx(250 / 3))
    # ITL pools all gaps: 50, 50, 100, 100 ms
    assert (m.itl_ms.count, m.itl_ms.mean, m.itl_ms.p50, m.itl_ms.p90) == (4, approx(75), approx(75), approx(100))
    assert (m.e2e_ms.mean, m.e2e_ms.p99) == (approx(300), approx(300))
    assert m.goodput is None and m.slo_met is None


def test_goodput_counts_requests_meeting_both_slos():
    records = _two_requests()
    # r1 meets TTFT<=150 and TPOT<=80; r2 misses TTFT (200 ms)
    m = compute_metrics(records, slo_ttft_ms=150, slo_tpot_ms=80)
    assert m.slo_met == 1 and m.goodput == approx(1 / 1.3)
    # r2 now meets TTFT but misses TPOT (100 > 80)
    assert compute_metrics(records, slo_ttft_ms=250, slo_tpot_ms=80).slo_met == 1
    # TPOT only: both meet 120 ms
    m = compute_metrics(records, slo_tpot_ms=120)
    assert m.slo_met == 2 and m.goodput == approx(2 / 1.3)


def test_tpot_uses_usage_when_a_chunk_carries_several_tokens():
    r = rec("r", 0.0, [0.1, 0.2], end=0.2, completion_tokens=6)  # 2 chunks, 6 tokens
    m = compute_metrics([r])
    assert m.tpot_ms.mean == approx(100 / 5)  # (200 - 100) / (6 - 1)
    assert m.itl_ms.count == 1 and m.itl_ms.mean == approx(100)  # one gap per chunk
    assert m.total_output_tokens == 6


def _stall_scene() -> list[RequestRecord]:
    return [
        # A: steady 100 ms, then a 500 ms hole (0.4 -> 0.9) while the document prefills
        rec("A", 0.0, [0.1, 0.2, 0.3, 0.4, 0.9, 1.0, 1.1]),
        # B: steady 200 ms, then 400 ms (0.55 -> 0.95); its gap 0.35 -> 0.55 also overlaps
        rec("B", 0.0, [0.15, 0.35, 0.55, 0.95, 1.15]),
        rec("C", 0.0, [0.1, 0.2, 0.3]),  # finished before the document: not in flight
        rec("D", 0.5, [0.6, 0.7, 0.8, 0.9]),  # started after the document: not in flight
        rec("doc", 0.45, [0.85, 0.9], kind="document"),
    ]


def test_stall_and_tokens_lost_hand_computed():
    m = compute_metrics(_stall_scene())
    assert len(m.documents) == 1
    d = m.documents[0]
    assert d.ttft_s == approx(0.40)  # 0.85 - 0.45
    streams = {s.request_id: s for s in d.streams}
    assert set(streams) == {"A", "B"}
    assert streams["A"].gap_s == approx(0.5) and streams["A"].median_itl_s == approx(0.1)
    assert streams["A"].tokens_lost == approx(4.0)  # 0.5 / 0.1 - 1
    assert streams["B"].gap_s == approx(0.4) and streams["B"].median_itl_s == approx(0.2)
    assert streams["B"].tokens_lost == approx(1.0)  # 0.4 / 0.2 - 1
    assert d.stall_s == approx(0.5) and d.tokens_lost == approx(5.0)
    assert m.stall_ms.count == 1 and m.stall_ms.max == approx(500)
    assert m.tokens_lost.mean == approx(5.0)
    assert set(m.ttft_ms_by_kind) == {"chat", "document"}
    assert m.ttft_ms_by_kind["document"].mean == approx(400)


def test_document_without_streams_in_flight_has_no_stall():
    m = compute_metrics([rec("C", 0.0, [0.1, 0.2, 0.3]), rec("doc", 1.0, [1.5], kind="document")])
    assert m.documents[0].stall_s is None and m.documents[0].tokens_lost == 0
    assert m.stall_ms.count == 0 and m.stall_ms.mean is None


# ----------------------------------------------------------------------------- workloads


def test_workloads_are_deterministic_per_seed():
    for kind in ("random", "article"):
        cfg = WorkloadConfig(workload=kind, seed=7, request_rate=4.0, random_range_ratio=0.5, doc_rate=1.0)
        assert build_workload(cfg) == build_workload(cfg)
        other = build_workload(
            WorkloadConfig(workload=kind, seed=8, request_rate=4.0, random_range_ratio=0.5, doc_rate=1.0)
        )
        assert [s.prompt for s in other] != [s.prompt for s in build_workload(cfg)]


def test_random_workload_lengths_and_poisson_arrivals():
    specs = build_workload(
        WorkloadConfig(
            num_requests=50,
            request_rate=10.0,
            random_input_len=100,
            random_output_len=20,
            random_range_ratio=0.5,
            seed=1,
        )
    )
    assert len(specs) == 50 and specs[0].arrival_s == 0.0
    assert all(50 <= s.prompt_len <= 150 and len(s.prompt) == s.prompt_len for s in specs)
    assert all(10 <= s.max_tokens <= 30 for s in specs)
    times = [s.arrival_s for s in specs]
    assert times == sorted(times) and len(set(times)) == 50
    assert all(s.arrival_s == 0.0 for s in build_workload(WorkloadConfig(num_requests=5)))  # rate inf


def test_article_mix_shape_and_token_id_prompts():
    cfg = WorkloadConfig(
        workload="article",
        chat_streams=3,
        chat_prompt_len=16,
        chat_output_len=40,
        chat_stagger_s=0.5,
        doc_prompt_len=300,
        doc_output_len=4,
        doc_count=2,
        doc_start_s=2.0,
        doc_interval_s=1.5,
        prompt_token_ids=True,
    )
    specs = build_workload(cfg)
    chats = [s for s in specs if s.kind == "chat"]
    docs = [s for s in specs if s.kind == "document"]
    assert [s.arrival_s for s in chats] == [0.0, 0.5, 1.0]
    assert [s.arrival_s for s in docs] == [2.0, 3.5]
    assert all(len(s.prompt) == 300 and s.max_tokens == 4 for s in docs)
    assert all(isinstance(s.prompt, tuple) and all(32 <= t < 127 for t in s.prompt) for s in specs)
    poisson = build_workload(WorkloadConfig(workload="article", doc_count=3, doc_rate=2.0, doc_start_s=1.0))
    dtimes = [s.arrival_s for s in poisson if s.kind == "document"]
    assert len(dtimes) == 3 and dtimes == sorted(dtimes) and dtimes[0] > 1.0


def test_sharegpt_file_and_bad_input(tmp_path):
    data = [
        {"conversations": [{"from": "human", "value": "hello there"}, {"from": "gpt", "value": "hi!"}]},
        {"conversations": [{"from": "human", "value": "only one turn"}]},
        {"conversations": [{"from": "human", "value": "long"}, {"from": "gpt", "value": "x" * 1000}]},
    ]
    f = tmp_path / "sg.json"
    f.write_text(json.dumps(data))
    specs = build_workload(
        WorkloadConfig(workload="sharegpt", sharegpt_file=str(f), num_requests=4, sharegpt_max_output_len=100)
    )
    assert len(specs) == 4 and {s.prompt for s in specs} == {"hello there", "long"}
    assert {s.max_tokens for s in specs} == {3, 100}  # len("hi!") and the cap
    with pytest.raises(ValueError, match="needs --sharegpt-file"):
        build_workload(WorkloadConfig(workload="sharegpt"))
    with pytest.raises(ValueError, match="request-rate"):
        build_workload(WorkloadConfig(request_rate=0))


# ----------------------------------------------------------------------------- client end to end


server, script = completions_server_fixtures()


def _config(server, **workload) -> BenchConfig:
    return BenchConfig(
        WorkloadConfig(**workload),
        ClientConfig(base_url=server.base_url.removesuffix("/v1"), show_progress=False, duration_limit_s=10),
    )


def test_client_records_streams_against_sse_server(server, script):
    script.first_token_delay_s, script.itl_s = 0.05, 0.03
    cfg = _config(server, num_requests=3, random_input_len=8, random_output_len=5)
    result = asyncio.run(run_benchmark(cfg))
    assert result.model == "fake-model"  # discovered from /v1/models
    assert result.metrics.completed == 3
    for r in result.records:
        assert r.ok and len(r.chunk_times_s) == 5 and r.completion_tokens == 5 and r.prompt_tokens == 8
        assert r.finish_reason == "length" and r.text == "t0 t1 t2 t3 t4 "
        assert r.ttft_s >= 0.045  # server waits 50 ms
    assert 20 <= result.metrics.itl_ms.p50 <= 200  # server waits 30 ms between chunks
    body = script.received[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0 and body["ignore_eos"] is True and body["model"] == "fake-model"
    assert sorted(b["seed"] for b in script.received) == [0, 1, 2]
    assert "TTFT (ms)" in format_table(result)


def test_client_counts_usage_tokens_and_sends_token_ids(server, script):
    script.tokens_per_chunk, script.itl_s = 2, 0.01
    result = asyncio.run(
        run_benchmark(_config(server, num_requests=1, random_input_len=12, random_output_len=6, prompt_token_ids=True))
    )
    r = result.records[0]
    assert len(r.chunk_times_s) == 3 and r.n_out == 6  # 3 chunks of 2 tokens
    prompt = script.received[0]["prompt"]
    assert isinstance(prompt, list) and len(prompt) == 12 and all(isinstance(t, int) for t in prompt)


def test_client_records_errors_and_stops_at_duration_limit(server, script):
    script.fail_prompts, script.itl_s = ("FAIL",), 0.2
    specs = [
        RequestSpec("bad", "FAIL", 4, 4, 0.0, "random"),
        RequestSpec("slow", "abcd", 4, 50, 0.0, "random"),  # would stream for ~10 s
        RequestSpec("late", "abcd", 4, 4, 30.0, "random"),
    ]  # arrives after the limit
    cfg = BenchConfig(
        client=ClientConfig(base_url=server.base_url, model="fake-model", show_progress=False, duration_limit_s=0.6)
    )
    start = time.perf_counter()
    result = asyncio.run(run_benchmark(cfg, specs))
    assert time.perf_counter() - start < 3.0
    bad, slow, late = result.records
    assert bad.error.startswith("HTTP 500")
    assert "duration limit" in slow.error and 0 < len(slow.chunk_times_s) < 50
    assert late.send_s is None
    m = result.metrics
    assert (m.completed, m.failed, m.not_sent) == (0, 2, 1)


def test_cli_article_mix_writes_result_json(server, script, tmp_path, capsys):
    script.first_token_delay_s, script.itl_s = 0.02, 0.02
    rc = cli_main(
        [
            "bench",
            "serve",
            "--base-url",
            server.base_url,
            "--workload",
            "article",
            "--chat-streams",
            "2",
            "--chat-output-len",
            "20",
            "--doc-count",
            "1",
            "--doc-start-s",
            "0.1",
            "--doc-prompt-len",
            "32",
            "--doc-output-len",
            "2",
            "--slo-ttft-ms",
            "1000",
            "--slo-tpot-ms",
            "1000",
            "--no-progress",
            "--out",
            "t",
            "--results-dir",
            str(tmp_path),
        ]
    )
    assert rc == 0
    assert "Stall per document (ms)" in capsys.readouterr().out
    data = json.loads((tmp_path / "t.json").read_text())
    assert {"git_commit", "command", "machine", "date_utc"} <= set(data["provenance"])
    assert data["provenance"]["config"]["workload"]["request_rate"] == "inf"
    assert len(data["records"]) == 3 and data["metrics"]["completed"] == 3
    doc = data["metrics"]["documents"][0]
    assert doc["request_id"] == "doc-0" and {s["request_id"] for s in doc["streams"]} == {"chat-0", "chat-1"}
    assert data["metrics"]["slo_met"] == 3
    assert not math.isnan(doc["stall_s"])


def test_cli_rejects_bad_input(capsys):
    assert cli_main(["bench", "serve", "--workload", "sharegpt", "--no-progress"]) == 2
    assert "needs --sharegpt-file" in capsys.readouterr().err
