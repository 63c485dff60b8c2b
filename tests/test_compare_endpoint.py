"""`pdserve bench compare --endpoint`: the spec parser's one-line errors, the endpoint's equality
and prediction basis on their own, and a whole endpoint-only run against the scripted fake
server (tests/fakes.py) and a port nothing listens on. No Ray, no pdserve server: the run against
a real pdserve endpoint is in test_bench_compare.py."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from benchmarks.compare.args import EndpointSpec, ModeSpec, build_modes, parse_endpoints
from benchmarks.compare.endpoints import simulated_mode
from benchmarks.compare.equality import check_endpoints
from benchmarks.compare.record import ModeRun
from cli import CliError
from cli import main as cli_main
from tests.fakes import FakeCompletionsServer, FakeScript

CALIBRATION = Path(__file__).resolve().parent.parent / "benchmarks/results/chunks-tiny-cpu.calibration.json"


def test_endpoint_specs_parse():
    eps = parse_endpoints(
        ["vllm=http://gpu1:8000,model=meta-llama/Llama-3.1-8B-Instruct", "sg=https://gpu2:30000/v1/"],
        [f"sg={CALIBRATION}"],
        {"colocated"},
    )
    assert eps == [
        EndpointSpec("vllm", "http://gpu1:8000/v1", "meta-llama/Llama-3.1-8B-Instruct"),
        EndpointSpec("sg", "https://gpu2:30000/v1", None, str(CALIBRATION)),
    ]
    assert parse_endpoints(None, None, set()) == []
    assert build_modes("none", "32", 1, 1) == [] and build_modes("", "32", 1, 1) == []


@pytest.mark.parametrize(
    "endpoints, calibrations, message",
    [
        (["vllm"], [], "expected NAME=URL"),
        (["vllm="], [], "expected NAME=URL"),
        (["=http://h:8000"], [], "expected NAME=URL"),
        (["a b=http://h:8000"], [], "expected NAME=URL"),
        (["vllm=h:8000"], [], "must start with http://"),
        (["vllm=http://h:8000,mdl=x"], [], "only one model=M"),
        (["vllm=http://h:8000,model="], [], "only one model=M"),
        (["vllm=http://h:8000,model=a,model=b"], [], "only one model=M"),
        (["a=http://h:1", "a=http://h:2"], [], "already a row"),
        (["colocated=http://h:1"], [], "already a row"),
        (["a=http://h:1"], ["b=x.json"], "no --endpoint is named 'b'"),
        (["a=http://h:1"], ["a"], "expected NAME=FILE"),
        (["a=http://h:1"], ["a=/no/such/calibration.json"], "no such file"),
    ],
)
def test_bad_endpoint_specs_are_one_line_errors(endpoints, calibrations, message):
    with pytest.raises(CliError, match=message) as e:
        parse_endpoints(endpoints, calibrations, {"colocated"})
    assert "\n" not in str(e.value)


def test_modes_none_needs_an_endpoint(capsys):
    assert cli_main(["bench", "compare", "--modes", "none"]) == 2
    assert "nothing to measure without --endpoint" in capsys.readouterr().err


def _run(spec, ids=None, texts=None, error=None) -> ModeRun:
    return ModeRun(spec, {}, None, ids or {}, [], None, error, greedy_texts=texts, endpoint={} if error is None else {})


def test_endpoint_equality_by_ids_then_by_text_and_never_a_verdict_without_a_reference():
    ref = _run(ModeSpec("colocated", "colocated"), {"a": [1, 2], "b": [3]}, {"a": "xy", "b": "z"})
    by_ids = _run(EndpointSpec("pd", "http://h/v1"), {"a": [1, 2], "b": [4]}, {"a": "xy", "b": "z"})
    by_text = _run(EndpointSpec("vllm", "http://h/v1"), None, {"a": "xy", "b": "z"})
    down = _run(EndpointSpec("down", "http://h/v1"), error="ClientError: cannot reach")
    eq = check_endpoints(ref, [by_ids, by_text, down])
    assert eq["pd"]["identical"] is False and eq["pd"]["examples"] == ["b"] and "token ids" in eq["pd"]["how"]
    assert eq["vllm"]["identical"] is True and eq["vllm"]["compared"] == 2 and "text" in eq["vllm"]["how"]
    assert eq["down"]["identical"] is None and eq["down"]["note"] == "the endpoint failed"
    assert check_endpoints(None, [by_text])["vllm"]["identical"] is None


def test_the_simulated_mode_is_the_one_the_probe_inferred(tmp_path):
    cal = tmp_path / "probe-x.calibration.json"
    cal.write_text(json.dumps({"schema": "pdserve.calibration/1"}))
    assert simulated_mode(cal)[0] == ("colocated", None, 1, 1)
    for verdict, chunk, want in (
        ("chunked", 127.6, ("colocated", 128, 1, 1)),
        ("disaggregated", None, ("disagg", None, 1, 1)),
        ("whole", None, ("colocated", None, 1, 1)),
    ):
        (tmp_path / "probe-x.json").write_text(json.dumps({"chunking": {"verdict": verdict, "chunk_tokens": chunk}}))
        mode, basis = simulated_mode(cal)
        assert mode == want and verdict in basis
    (tmp_path / "probe-x.json").write_text(json.dumps({"chunking": {"verdict": "unknown", "chunk_tokens": None}}))
    assert simulated_mode(cal) == (
        None,
        f"no prediction: the probe inferred 'unknown' ({tmp_path / 'probe-x.json'}), so no serving mode to simulate",
    )


@pytest.mark.timeout(60)
def test_endpoint_only_run_against_a_fake_server_and_a_closed_port(tmp_path, capsys):
    """Cost: the quick workload (4 requests, 16 tokens) four times against the scripted fake (~3 s).
    The fake streams but cannot answer the non-streamed equality pass: that row still stands."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    with FakeCompletionsServer(FakeScript(first_token_delay_s=0.01, itl_s=0.005)) as srv:
        argv = ["bench", "compare", "--quick", "--modes", "none", "--chat-output-len", "16", "--no-progress",
                "--endpoint", f"fake={srv.base_url}", "--endpoint", f"down=http://127.0.0.1:{closed}",
                "--endpoint", f"cal={srv.base_url},model=fake-model", "--endpoint-calibration", f"cal={CALIBRATION}",
                "--out-dir", str(tmp_path), "--out", "ep"]  # fmt: skip
        assert cli_main(argv) == 1  # the closed port's row failed
    out, err = capsys.readouterr()
    result = json.loads((tmp_path / "ep.json").read_text())
    fake, down, cal = result["modes"]
    assert fake["label"] == "fake" and fake["error"] is None and fake["metrics"]["completed"] == len(result["requests"])
    assert fake["endpoint"]["model"] == "fake-model" and "equality_pass_error" in fake["endpoint"]
    assert fake["endpoint"]["prediction"]["error"].startswith("no calibration: run `pdserve bench probe --base-url")
    assert "predicted" not in fake
    assert down["label"] == "down" and "cannot reach" in down["error"]
    # with a calibration: predicted beside the measurement, on --model's shapes (pdserve does not know fake-model)
    assert cal["predicted"]["compared"]["ttft_chat_p50_ms"]["predicted"] is not None
    assert cal["endpoint"]["prediction"]["model_shapes"].startswith("tiny")
    assert "fake = " in out and "no calibration" in out and "down: ClientError" in err
