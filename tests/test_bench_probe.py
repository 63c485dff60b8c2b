"""`pdserve bench probe` over real HTTP: a real pdserve server (`--model tiny`) stands in for "any
OpenAI-compatible server", and the scripted fake (tests/fakes.py) for servers that misbehave.

The oracle for the fit is the server's own account of the same work: the prefill time its
timeline reports for the probe's prompts, and the decode pace its timeline reports for a stream.
On a shared 2-core machine the tolerance is a factor, not a percentage.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

pytest.importorskip("ray")  # the real server runs on Ray (conftest.ray_cluster)
from openai import OpenAI  # noqa: E402

from cli import main as pdserve  # noqa: E402
from router.config import ServeConfig  # noqa: E402
from router.serve_cli import ServerThread  # noqa: E402
from tests.fakes import FakeCompletionsServer, FakeScript  # noqa: E402

# Ray actors behind a server
pytestmark = [pytest.mark.ray, pytest.mark.server]


@pytest.fixture(scope="module")
def server(ray_cluster):
    # bulk pulls: the probe's prefix-cache check compares two ~0.2 s TTFTs, and auto streaming one of
    # them (its opening call) but not the other would move one by its own few ms
    with ServerThread(ServeConfig(model="tiny", num_blocks=512, kv_transfer="bulk"), startup_timeout_s=180) as srv:
        yield srv


def _probe(capsys, *args: str) -> tuple[int, dict | None, str]:
    rc = pdserve(["bench", "probe", *args])
    out, err = capsys.readouterr()
    return rc, (json.loads(out) if rc == 0 and "--json" in args else None), err


@pytest.mark.timeout(240)
def test_quick_probe_of_pdserve_agrees_with_the_servers_own_timeline(server, capsys, tmp_path):
    """Cost: one quick probe of the tiny model up to 1024 tokens (~10-30 s on 2 shared cores) plus a
    32-token stream."""
    t0 = time.monotonic()
    rc, d, err = _probe(
        capsys, "--base-url", server.base_url, "--quick", "--max-context", "1024", "--out-dir", str(tmp_path), "--json"
    )
    assert rc == 0, err
    assert time.monotonic() - t0 < 90, "a quick probe must stay well under a minute on an idle machine"
    assert d is not None and d["prompts"] == "ids" and d["model"] == "tiny"
    # a pdserve server on this host: its own steps kept beside the fit (plan --verify paces against them)
    assert d["server_steps"]["columns"][:2] == ["worker", "role"] and len(d["server_steps"]["rows"]) > 20
    df, fp = d["decode_fit"], d["prefill_fit"]
    step1 = df["fixed_s"] + df["per_sequence_s"] + df["per_context_token_s"] * 16
    assert step1 > 0
    prefill = fp["fixed_s"] + fp["linear_s"] * 1024 + fp["quadratic_s"] * 1024**2
    assert prefill > 0
    # prefill: the server's timeline says how long its worker spent on the probe's 1024-token prompts
    server_ms = next(p["server_prefill_ms"] for p in d["prefill"] if p["tokens"] == 1024)
    assert server_ms is not None and 1 / 3 < prefill * 1e3 / server_ms < 3, (prefill, server_ms)
    # decode: a batch-1 stream's pace by the server's own clock (first to last token event)
    client = OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
    resp = client.completions.create(model="tiny", prompt=[65] * 16, max_tokens=32, extra_body={"ignore_eos": True})
    tl = resp.model_extra["pdserve"]["timeline"]
    server_step = (tl["last_token_ms"] - tl["first_token_ms"]) / (tl["output_tokens"] - 1) / 1e3
    assert 1 / 4 < step1 / server_step < 4, (step1, server_step)  # 3.3x seen once in CI, under load
    # the four files, and a calibration `bench compare` and `simulate` accept
    files = d["files"]
    for key in ("result", "markdown", "calibration", "plot"):
        assert (tmp_path / files[key].rsplit("/", 1)[-1]).is_file(), key
    from costmodel.article.cost_model import Calibration
    from costmodel.sim.compare_predict import setup_from_calibration

    cal = Calibration.load(files["calibration"])
    assert cal.fitted_steps() is not None and cal.peak_tflops  # tiny is known to pdserve: TFLOP/s derived
    assert cal.pace_gflops and cal.pace_gflops > 0  # a server on this host: the machine's pace beside it
    assert cal.prompt_thread_speedup is None  # OMP_NUM_THREADS=1 (conftest): no server here borrows a core
    # the decode steps' scatter, each step's longest gap over its streams less their pace, in ms: a
    # predicted stall is drawn with it (costmodel/sim/stall_jitter.py)
    residuals = [x for p in d["decode"] for x in p["step_residuals_s"]]
    assert cal.step_scatter_ms and len(cal.step_scatter_ms) == min(len(residuals), 512)
    setup = setup_from_calibration("tiny", files["calibration"])
    assert setup.step_scatter_s == pytest.approx([v / 1e3 for v in cal.step_scatter_ms])
    assert d["chunking"]["verdict"] in ("whole", "chunked", "disaggregated", "no interference", "unknown")
    # pdserve caches prefixes by default and says so in usage.prompt_tokens_details.cached_tokens:
    # the probe takes the server's word over timing (two ~0.2 s TTFTs on shared cores can tie); the
    # second request computed only the prompt's last partial block
    assert d["prefix"]["cached"] is True, d["prefix"]
    assert d["prefix"]["reported_cached_tokens"] >= 1024 - 16, d["prefix"]
    # with the prefix cache seen, a chunk at an offset: fresh tokens after a prefix it had just cached
    assert [(k["start"], k["tokens"]) for k in d["cached_chunks"]] == [(256, 64), (512, 64)]
    assert all(k["ttft_s"] > 0 for k in d["cached_chunks"])
    md = (tmp_path / files["markdown"].rsplit("/", 1)[-1]).read_text()
    assert "The article's arithmetic" in md and "A chunk at an offset" in md


@pytest.mark.timeout(120)
def test_decode_points_run_in_passes_back_and_forth_and_pool_every_run(server):
    """Each decode point once per pass, every other pass reversed, so the machine's drift lands on
    every point alike; a point's step is the median pace over every stream of every run."""
    import asyncio
    from statistics import median

    from benchmarks.probe import measure as pm
    from benchmarks.probe.client import ProbeClient

    order: list[tuple[int, int, int]] = []

    async def run() -> list[pm.DecodeSample]:
        c = ProbeClient(server.base_url, "tiny", "none", "ids", seed=7)
        try:
            await c.start()
            return await pm.decode_passes(
                c, [(1, 16), (2, 16), (1, 64)], 8, 3, lambda k, b, x, _: order.append((k, b, x))
            )
        finally:
            await c.close()

    samples = asyncio.run(run())
    fwd = [(1, 16), (2, 16), (1, 64)]
    assert [(b, x) for _, b, x in order] == fwd + fwd[::-1] + fwd
    assert [k for k, _, _ in order] == [0] * 3 + [1] * 3 + [2] * 3
    assert [(s.batch, s.prompt_tokens) for s in samples] == fwd
    for s in samples:
        assert len(s.run_paces_s) == 3 and all(p > 0 for p in s.run_paces_s)
    # a lone stream: one pace per run, so the point is their median
    lone = samples[0]
    assert lone.point.step_s == pytest.approx(median(lone.run_paces_s))


def test_instance_spread_times_lone_and_batched_streams_by_the_servers_timeline(server):
    """benchmarks/instance_spread.py's measurement on one server (the module's; the tool's own loop
    starts fresh ones): a pace per run for each shape, by the server's clock, and its summary."""
    from benchmarks.instance_spread import Instance, measure, render, summary

    client = OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
    lone, batch = measure(client, "tiny", runs=2, batch=3)
    assert len(lone) == 2 and len(batch) == 2 and all(x > 0 for x in lone + batch)
    a, b = Instance(0, 100.0, lone, batch), Instance(1, None, [2 * x for x in lone], batch)
    s = summary([a, b])
    assert s["lone"]["max_over_min"] == pytest.approx(2.0) and s["batch"]["max_over_min"] == pytest.approx(1.0)
    assert "lone 2.00x" in render([a, b], 3)


def _one_line(err: str) -> str:
    lines = [x for x in err.splitlines() if x.strip() and not x.startswith("probe:")]
    assert len(lines) == 1, err
    return lines[0]


def test_unreachable_server_is_one_line_and_exit_2(capsys):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc, _, err = _probe(capsys, "--base-url", f"http://127.0.0.1:{port}", "--quick")
    assert rc == 2 and "cannot reach" in _one_line(err)
    rc, _, err = _probe(capsys, "--base-url", "localhost:8000", "--quick")
    assert rc == 2 and "http://" in _one_line(err)


def test_a_server_that_refuses_token_ids_is_probed_with_text(capsys, tmp_path):
    script = FakeScript(refuse_token_ids=True, first_token_delay_s=0.02, itl_s=0.01)
    with FakeCompletionsServer(script) as srv:
        args = ["--base-url", srv.base_url, "--quick", "--max-context", "256", "--out-dir", str(tmp_path)]
        rc, d, err = _probe(capsys, *args, "--no-plot", "--mix-streams", "3", "--json")
    assert rc == 0, err
    assert d is not None and d["prompts"] == "text"
    assert d["tables"]["article_mix"]["chat_streams"] == 3
    assert isinstance(script.received[0]["prompt"], list)  # tried first, refused
    assert all(isinstance(b["prompt"], str) for b in script.received[1:])
    # without usage in the stream, text prompts have no known length: refused in one line
    with FakeCompletionsServer(FakeScript(refuse_token_ids=True, report_usage=False)) as srv:
        rc, _, err = _probe(capsys, "--base-url", srv.base_url, "--quick", "--out-dir", str(tmp_path))
    assert rc == 2 and "usage" in _one_line(err)
    # --prompts ids on such a server: refused in one line, no fallback
    with FakeCompletionsServer(FakeScript(refuse_token_ids=True)) as srv:
        rc, _, err = _probe(
            capsys, "--base-url", srv.base_url, "--quick", "--prompts", "ids", "--out-dir", str(tmp_path)
        )
    assert rc == 2 and "HTTP 400" in _one_line(err)


@pytest.mark.timeout(60)
def test_a_server_that_dies_mid_probe_is_one_line_and_exit_2(capsys, tmp_path):
    srv = FakeCompletionsServer(FakeScript(first_token_delay_s=0.02, itl_s=0.02)).__enter__()
    killer = threading.Timer(1.0, srv.__exit__)
    killer.start()
    t0 = time.monotonic()
    try:
        rc, _, err = _probe(
            capsys, "--base-url", srv.base_url, "--quick", "--request-timeout-s", "10", "--out-dir", str(tmp_path)
        )
    finally:
        killer.join()
    assert rc == 2 and "failed" in _one_line(err)
    assert time.monotonic() - t0 < 30


def test_plan_verify_on_a_server_the_user_restarts(server, tmp_path, capsys, monkeypatch):
    """`pdserve plan --verify --base-url`: each candidate's serve command is printed and the plan
    waits for the user (here: Enter at once, this module's server standing in for every
    candidate), then measures it."""
    from costmodel.article import cost_model as cm
    from costmodel.fit.step_fit import StepCostFit

    cal = tmp_path / "c.calibration.json"
    fit = StepCostFit(0.005, 1e-3, 0.0, 1e-3, samples=100, rms_rel_error=0.1)
    cal.write_text(json.dumps(cm.Calibration(device="cpu", dtype="fp32", step_fit=fit.to_dict()).to_dict()))
    argv = ["plan", "--calibration", str(cal), "--model", "tiny", "--workers", "2", "--workload", "chat"]
    argv += ["--num-requests", "4", "--rate", "20", "--isl", "32", "--osl", "4", "--slo-ttft-ms", "5000"]
    argv += ["--verify", "1", "--settle-s", "0", "--out-dir", str(tmp_path), "--json"]
    assert pdserve([*argv, "--base-url", "http://127.0.0.1:9/v1"]) == 2  # pytest's stdin is no terminal
    assert "run it in a terminal" in capsys.readouterr().err
    assert pdserve(["plan", "--calibration", str(cal), "--model", "tiny", "--base-url", "http://x"]) == 2
    assert "give --verify too" in capsys.readouterr().err
    prompts: list[str] = []
    monkeypatch.setattr("sys.stdin.isatty", lambda: True)
    monkeypatch.setattr("builtins.input", lambda prompt="": prompts.append(prompt) or "")
    assert pdserve([*argv, "--base-url", server.base_url]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = doc["verification"]["rows"]
    assert len(prompts) == len(rows) >= 1  # one wait per candidate
    for r in rows:
        assert r["error"] is None and r["measured_metrics"]["completed"] == 4
        assert r["step_prices"]  # a pdserve server: its steps were read too


def test_plan_verify_reads_a_servers_pace_from_requests_of_the_workloads_shapes(server):
    """`plan --verify`'s serving pace (benchmarks/plan_calibration.py; its reading rules in
    tests/test_serving_pace.py) against this module's real (disaggregated) server and its step log: a
    burst decoding together, and beside it a prompt of each length the workload computes, one at a
    time; priced by a fit to the server's own steps, each kind reads near 1. (Beside the decoding
    batch on a colocated server: tests/test_plan.py's --verify.)"""
    from benchmarks.client.bench_serve import BenchConfig
    from benchmarks.client.serve_client import ClientConfig
    from benchmarks.plan_calibration import PACE_BURST_TOKENS, pace_lengths, serving_pace
    from benchmarks.verify_steps import step_pace
    from costmodel.fit.step_fit import fit
    from costmodel.sim.compare_predict import setup_from_steps
    from costmodel.workloads import RequestSpec

    bench = BenchConfig(client=ClientConfig(base_url=server.base_url, model="tiny", show_progress=False))
    specs = [RequestSpec(f"r{i}", (), n, 8, float(i), "chat") for i, n in enumerate((24, 48, 48, 72))]
    steps = serving_pace(bench, server.url, None, specs, streams=4, seed=5)
    lone = sorted(s.shape.prefill_tokens for s in steps if s.shape.prefill_tokens and not s.shape.decode_seqs)
    # each length computed whole on the prefill worker, once: read from the burst decoding on, so the
    # burst's own four prompts, computed before, are left out
    assert lone == pace_lengths(specs) == [24, 48, 48, 48, 72]
    assert sum(s.shape.decode_seqs == 4 and not s.shape.prefill_tokens for s in steps) >= PACE_BURST_TOKENS // 2
    own = setup_from_steps("tiny", fit([(s.shape, s.seconds) for s in steps]), None, None, "its own steps", len(steps))
    found = step_pace(steps, own)
    assert found is not None and found.prompt_steps >= 3 and found.decode_steps >= PACE_BURST_TOKENS // 2
    # A scale check, not an accuracy one: the tiny model's steps take a millisecond or two, and the
    # prompt fit is shared with the burst's mixed steps, so four lone prompts read 0.48 on a CI run
    # (the decode side, 30-odd steps, 1.17). A pricing or unit slip reads 10x or 1000x off.
    assert 0.25 < found.prompt < 4.0 and 0.5 < found.decode < 2.0
