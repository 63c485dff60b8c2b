"""SIGTERM with streams in flight, against a real `pdserve serve` (embedded Ray, disagg, NIXL):
new requests get 503 and /health says draining; streams that can finish within
--shutdown-timeout-s complete with their full text; the one that cannot ends with an error event
and then `data: [DONE]`; the process exits 0 and leaves no Ray process behind."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from tests.helpers import wait_until
from tests.serve_process import ServeProcess

# Ray actors behind a server
pytestmark = [pytest.mark.ray, pytest.mark.server, pytest.mark.timeout(300)]
SHORT, LONG = 48, 3500  # tokens: the short streams finish within the timeout, the long one cannot (1,500 once
# finished inside the 4 s drain: the tiny model decodes a lone stream at ~2-3 ms a token)


def _stream(url: str, prompt: str, max_tokens: int, out: dict, started: threading.Event) -> None:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    lines = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        out[prompt + ":status"] = r.status_code
        for line in r.iter_lines():
            if line:
                lines.append(line)
                started.set()
    out[prompt] = lines


def _payloads(lines: list[str]) -> list[dict]:
    assert lines[-1] == "data: [DONE]", lines[-3:]
    return [json.loads(x[len("data: ") :]) for x in lines[:-1]]


def test_sigterm_drains_streams_then_exits_0(tmp_path):
    """Cost: a real `pdserve serve` child process with its own embedded Ray (the process is what is tested:
    signals, exit status, no process left), plus the 4 s drain."""
    srv = ServeProcess(
        ["--mode", "disagg", "--model", "tiny", "--num-blocks", "256", "--shutdown-timeout-s", "4"],
        tmp_path / "serve.log",
    )
    out: dict = {}
    prompts = {"short one": SHORT, "short two": SHORT, "long one": LONG}
    started = {p: threading.Event() for p in prompts}
    threads = [threading.Thread(target=_stream, args=(srv.url, p, n, out, started[p])) for p, n in prompts.items()]
    try:
        for t in threads:
            t.start()
        for p in prompts:
            assert started[p].wait(60), f"stream {p!r} did not start"
        t_signal = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)

        def refusing() -> httpx.Response | None:
            r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
            return r if r.status_code == 503 else None

        # the signal handler runs on the server's event loop
        refused = wait_until(refusing, 10, "a new request refused with 503")
        assert refused.json()["error"]["code"] == "shutting_down"
        health = httpx.get(srv.url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "draining"
        for t in threads:
            t.join(60)
        rc = srv.proc.wait(60)
        took = time.monotonic() - t_signal
    finally:
        srv.stop(signal.SIGKILL)
    assert rc == 0, srv.log()[-2000:]
    assert took < 4 + 15, f"exit took {took:.1f} s"
    for p in ("short one", "short two"):
        chunks = _payloads(out[p])  # every token, the finish reason, then the usage chunk
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["usage"]["completion_tokens"] == SHORT
    long_chunks = _payloads(out["long one"])
    assert "error" in long_chunks[-1] and "shutting down" in long_chunks[-1]["error"]["message"]
    assert len(long_chunks) < LONG
    # Ray's daemons exit just after the router does
    wait_until(lambda: srv.session_pids() == [], 10, "Ray's processes to exit after the server", interval=0.1)
    assert "Traceback" not in srv.log()
