"""The benchmark client against the stream shapes of servers other than pdserve, each served over
real HTTP by tests/fakes.py's completions server (uvicorn in a thread: it starts in milliseconds,
so this module stays in `make test-fast`, like test_serve_metrics.py):

- vLLM: finish_reason in the last token's chunk, a token with empty text (a partial UTF-8
  character): a max_tokens=1 answer is one chunk carrying both;
- a role-only (or empty) first chunk before the first token;
- several tokens per chunk; no usage chunk;
- usage.prompt_tokens_details.cached_tokens, and fresh prompts on every `bench serve` run.

Each case checks the tokens counted, the TTFT, and the shape the record names."""

from __future__ import annotations

import asyncio
import json

import pytest

from benchmarks.client.bench_serve import BenchConfig, cached_documents_warning, run_benchmark
from benchmarks.client.serve_client import ClientConfig, StreamRecord, classify_chunk, shape_warning
from benchmarks.probe.client import ProbeClient
from cli import main as cli_main
from costmodel.workloads import RequestSpec
from tests.fakes import completions_server_fixtures

FIRST_TOKEN_S = 0.05  # the fake's delay before the first token (a role/empty first chunk comes at once)


server, script = completions_server_fixtures(first_token_delay_s=FIRST_TOKEN_S, itl_s=0.01)


def stream(server, max_tokens: int, n: int = 1, kind: str = "chat") -> list[StreamRecord]:
    """`n` requests of `max_tokens` through bench serve's client; their records."""
    specs = [RequestSpec(f"r{i}", f"prompt {i}", 8, max_tokens, 0.0, kind) for i in range(n)]  # type: ignore[arg-type]
    cfg = BenchConfig(client=ClientConfig(base_url=server.base_url, show_progress=False, duration_limit_s=10))
    records = asyncio.run(run_benchmark(cfg, specs)).records
    assert all(isinstance(r, StreamRecord) for r in records)
    return records  # type: ignore[return-value]


def assert_counted(r: StreamRecord, chunks: int, tokens: int | None) -> None:
    assert r.ok, r.error
    assert len(r.chunk_times_s) == chunks and r.completion_tokens == tokens
    assert r.ttft_s >= FIRST_TOKEN_S * 0.9  # the first token's chunk, not an earlier one


def test_pdserve_shape_one_token_per_chunk_then_a_bare_finish_marker(server, script):
    (r,) = stream(server, 5)
    assert_counted(r, 5, 5)
    assert r.stream_shape == [] and r.finish_reason == "length" and r.text == "t0 t1 t2 t3 t4 "
    assert shape_warning([r]) is None


def test_the_only_token_in_the_chunk_with_finish_reason_and_empty_text(server, script):
    """The issue's vLLM case: was 'stream ended without any output'."""
    script.finish_in_last_token, script.empty_text_tokens = True, (0,)
    (r,) = stream(server, 1)
    assert_counted(r, 1, 1)
    assert r.stream_shape == ["token-with-finish"] and r.finish_reason == "length" and r.text == ""
    assert shape_warning([r]) is None  # how vLLM ends every stream: recorded, not warned about


def test_a_last_token_with_empty_text_is_counted_by_usage(server, script):
    script.finish_in_last_token, script.empty_text_tokens = True, (3,)
    (r,) = stream(server, 4)
    assert_counted(r, 4, 4)
    assert r.stream_shape == ["token-with-finish"]


def test_role_only_first_chunk_is_no_token_and_not_the_ttft(server, script):
    script.first_chunk = "role"
    (r,) = stream(server, 3)
    assert_counted(r, 3, 3)
    assert r.stream_shape == ["role-only-first-chunk"]
    assert "role-only first chunk" in (shape_warning([r]) or "")


def test_empty_first_chunk_is_dropped_once_usage_says_it_carried_no_token(server, script):
    script.first_chunk = "empty"
    (r,) = stream(server, 3)
    assert_counted(r, 3, 3)
    assert r.stream_shape == ["empty-chunks"]


def test_several_tokens_per_chunk(server, script):
    script.tokens_per_chunk = 4
    records = stream(server, 4, n=2)
    for r in records:
        assert_counted(r, 1, 4)  # usage says 4, one chunk
        assert r.stream_shape == ["several-tokens-per-chunk"] and r.n_out == 4
    warning = shape_warning(records)
    assert warning is not None and "\n" not in warning
    assert warning.startswith("the server's streams: in 2/2 streams, several tokens per chunk (ITL and stall")


def test_no_usage_chunk(server, script):
    script.report_usage = False
    (r,) = stream(server, 3)
    assert_counted(r, 3, None)
    assert r.stream_shape == ["no-usage"] and r.n_out == 3


def test_no_usage_vllm_single_chunk_still_counts(server, script):
    script.report_usage, script.finish_in_last_token, script.empty_text_tokens = False, True, (0,)
    (r,) = stream(server, 1)
    assert_counted(r, 1, None)
    assert r.stream_shape == ["no-usage", "token-with-finish"]


def test_no_usage_several_tokens_per_chunk_seen_from_finish_length(server, script):
    """Without usage, finish_reason "length" says the stream reached max_tokens."""
    script.report_usage, script.tokens_per_chunk = False, 3
    (r,) = stream(server, 6)
    assert_counted(r, 2, None)
    assert r.stream_shape == ["no-usage", "several-tokens-per-chunk"]


@pytest.mark.parametrize(
    "choice, kind",
    [
        ({"text": "a", "finish_reason": None}, "token"),
        ({"text": "", "finish_reason": None}, "empty"),
        ({"text": "", "finish_reason": "length"}, "last-empty"),
        ({"text": "", "finish_reason": "stop", "token_ids": [7]}, "last-token"),
        ({"text": "", "logprobs": {"tokens": ["\\xe2"]}, "finish_reason": None}, "token"),
        ({"delta": {"role": "assistant", "content": ""}, "finish_reason": None}, "role"),
        ({"delta": {"content": "hi"}, "finish_reason": None}, "token"),
        ({"delta": {}, "finish_reason": None}, "none"),
    ],
)
def test_classify_chunk(choice, kind):
    assert classify_chunk(choice)[0] == kind


# ----------------------------------------------------------------------------- cached prompt tokens


def test_cached_prompt_tokens_recorded_and_a_cached_document_warned(server, script):
    script.cached_tokens = 6
    docs = stream(server, 2, n=2, kind="document")
    assert [r.cached_tokens for r in docs] == [6, 6]
    warning = cached_documents_warning(docs)  # type: ignore[arg-type]
    assert warning is not None and warning.startswith("2/2 documents") and "6/" in warning
    script.cached_tokens = 0
    assert cached_documents_warning(stream(server, 2, kind="document")) is None  # type: ignore[arg-type]


def _article(server, tmp_path, name: str, *extra: str) -> list[str]:
    args = ["bench", "serve", "--base-url", server.base_url, "--workload", "article", "--chat-streams", "1"]
    args += ["--chat-output-len", "4", "--doc-count", "1", "--doc-start-s", "0", "--doc-prompt-len", "16"]
    args += ["--doc-output-len", "1", "--no-progress", "--out", name, "--results-dir", str(tmp_path), *extra]
    assert cli_main(args) == 0
    return args


def test_bench_serve_documents_fresh_unless_seed_pins_them(server, script, tmp_path, capsys):
    script.first_token_delay_s = 0.005
    prompts = []
    for i, seed in enumerate([None, None, "7", "7"]):
        script.received.clear()
        _article(server, tmp_path, f"run{i}", *(("--seed", seed) if seed else ()))
        prompts.append(sorted(b["prompt"] for b in script.received))
        config = json.loads((tmp_path / f"run{i}.json").read_text())["provenance"]["config"]
        assert config["seed_drawn"] is (seed is None)
        if seed:
            assert config["workload"]["seed"] == config["client"]["seed"] == 7
    assert prompts[0] != prompts[1] and prompts[2] == prompts[3]
    assert "warning" not in capsys.readouterr().err


def test_bench_serve_warns_once_per_run_and_writes_the_shapes(server, script, tmp_path, capsys):
    script.first_token_delay_s, script.tokens_per_chunk, script.cached_tokens = 0.005, 2, 4
    _article(server, tmp_path, "shaped")
    err = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(err) == 2  # one line for the stream shape, one for the cached document
    assert "in 1/2 streams, several tokens per chunk" in err[0]  # the chat (4 tokens); the document has 1
    assert "1/1 documents were served partly from the server's prefix cache" in err[1]
    data = json.loads((tmp_path / "shaped.json").read_text())
    assert data["stream_shape"] == {"several-tokens-per-chunk": 1}
    assert {r["request_id"]: r["cached_tokens"] for r in data["records"]} == {"chat-0": 4, "doc-0": 4}


# ----------------------------------------------------------------------------- the probe


def test_probe_sends_a_1_token_prompt_to_a_vllm_shaped_server(server, script):
    script.finish_in_last_token, script.empty_text_tokens, script.first_token_delay_s = True, (0,), 0.005

    async def run() -> StreamRecord:
        c = ProbeClient(server.base_url)
        try:
            await c.start()
            return await c.send(256, 1)  # type: ignore[return-value]
        finally:
            await c.close()

    r = asyncio.run(run())
    assert r.ok and len(r.chunk_times_s) == 1 and r.stream_shape == ["token-with-finish"]


def test_probe_exits_2_in_one_line_when_a_server_sends_several_tokens_per_chunk(server, script, tmp_path, capsys):
    script.first_token_delay_s, script.itl_s, script.tokens_per_chunk = 0.005, 0.002, 4
    args = ["bench", "probe", "--base-url", server.base_url, "--quick", "--max-context", "256", "--no-plot"]
    assert cli_main([*args, "--out-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert all(line.startswith("probe: ") for line in err[:-1])  # its progress, then one line, no traceback
    assert err[-1].startswith("pdserve bench: error: request probe-")
    assert "24 tokens in 6 chunks: several tokens per chunk" in err[-1]
    assert not list(tmp_path.iterdir())
