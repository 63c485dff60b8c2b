"""`pdserve bench compare` end to end on the tiny model (real Ray, NIXL, uvicorn, openai client),
plus its equality checker and predictions on their own.

The end-to-end run is the CI-sized `--quick` workload: three chat streams and one 512-token
document, in colocated, chunked (64) and disaggregated (1P1D) mode, each on a fresh server.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from benchmarks.client.bench_serve import BenchConfig, BenchResult
from benchmarks.compare.args import ModeSpec, build_modes
from benchmarks.compare.equality import check_equality
from benchmarks.compare.prediction import served_prompt_lengths
from benchmarks.compare.record import ModeRun, unpack
from benchmarks.compare.table import near_tie_note
from cli import main as cli_main
from costmodel.serve_metrics import compute_metrics
from costmodel.sim import compare_predict as cp
from costmodel.workloads import WorkloadConfig, build_workload

# Ray actors behind a server
pytestmark = [pytest.mark.ray, pytest.mark.server]

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CALIBRATION = Path(__file__).resolve().parent.parent / "benchmarks/results/chunks-tiny-cpu.calibration.json"


@pytest.mark.timeout(240)
def test_bench_compare_end_to_end(tmp_path, capsys):
    """Cost: the demo's own command, end to end: three real servers one after another, each driven by the
    seeded mix, then the equality pass and the report."""
    pytest.importorskip("ray")
    # In a thread of its own: `bench compare` moves the thread that starts the embedded Ray into a
    # private network namespace (where Linux allows), and pytest's main thread must stay on the
    # host's network for the tests that follow (the cluster rehearsal reads /sys/class/net).
    argv = [
        "bench",
        "compare",
        "--quick",
        "--model",
        "tiny",
        "--device",
        "cpu",
        "--modes",
        "colocated,chunked,disagg",
        "--chunk-sizes",
        "64",
        # chats long enough to be decoding when the document arrives, in the run and in the
        # simulation, however fast this device's calibrated decode step is
        "--chat-output-len",
        "192",
        "--out-dir",
        str(tmp_path),
        "--out",
        "cmp",
        "--no-progress",
        "--calibration",
        str(CALIBRATION),
    ]
    with ThreadPoolExecutor(1) as pool:
        rc = pool.submit(cli_main, argv).result()
    out = capsys.readouterr().out
    assert rc == 0, out
    result = json.loads((tmp_path / "cmp.json").read_text())
    assert result["provenance"]["git_commit"] and result["provenance"]["date_utc"]
    modes = {m["label"]: m for m in result["modes"]}
    assert list(modes) == ["colocated", "chunked-64", "disagg-1P1D"]
    specs = {r["request_id"]: r for r in result["requests"]}

    # Greedy equality: the disaggregated and colocated servers gave the same tokens per request.
    ids_of = lambda label: {rid: unpack(v, int) for rid, v in modes[label]["token_ids"].items()}  # noqa: E731
    col, dis, chunked = ids_of("colocated"), ids_of("disagg-1P1D"), ids_of("chunked-64")
    assert set(col) == set(specs) == set(dis)
    for rid, ids in col.items():
        assert len(ids) == specs[rid]["max_tokens"]
        assert dis[rid] == ids, rid
        assert chunked[rid] == ids, rid
    assert result["equality"]["identical"] is True and result["equality"]["compared"] == 2 * len(specs)

    for label, m in modes.items():
        assert m["error"] is None, label
        assert m["metrics"]["completed"] == len(specs), label
        assert m["metrics"]["documents"], label
        # the simulated figures sit beside the measured ones
        assert m["predicted"]["compared"]["stall_max_ms"]["predicted"] is not None, label
    # The document's KV crossed the transport in disaggregated mode: its prompt's worth of bytes.
    doc_tx = [t for t in modes["disagg-1P1D"]["transfers"] if t["request_id"].startswith("doc")]
    assert doc_tx and doc_tx[0]["bytes"] > 0

    report = (tmp_path / "cmp.md").read_text()
    assert "## Measured" in report and "simulated" in report and "Identical" in report
    for plot in ("cmp-timeline.png", "cmp-latency.png", "cmp-predicted.png"):
        assert (tmp_path / plot).read_bytes()[:8] == PNG_MAGIC, plot
        assert f"]({plot})" in report
    # the one table names every mode and the files
    for label in modes:
        assert label in out
    assert "report:" in out and "IDENTICAL" in out

    # The report can be redrawn from the JSON alone.
    (tmp_path / "cmp.md").unlink()
    assert cli_main(["bench", "compare", "--from-json", str(tmp_path / "cmp.json"), "--out-dir", str(tmp_path)]) == 0
    assert (tmp_path / "cmp.md").is_file()


def _run(label: str, ids: dict[str, list[int]]) -> ModeRun:
    return ModeRun(
        ModeSpec(label, "colocated"),
        {},
        0.0,
        ids,
        [],
        BenchResult(BenchConfig(), "tiny", [], compute_metrics([]), 0.0),
    )


def test_equality_check_reports_the_first_differing_token():
    ref = _run("colocated", {"a": [1, 2, 3], "b": [4, 5]})
    same = _run("disagg-1P1D", {"a": [1, 2, 3], "b": [4, 5]})
    bad = _run("chunked-7", {"a": [1, 9, 3], "b": [4]})
    eq = check_equality([ref, same, bad])
    assert eq["identical"] is False and eq["compared"] == 4
    assert {(m["mode"], m["request_id"], m["first_difference"]) for m in eq["mismatches"]} == {
        ("chunked-7", "a", 1),
        ("chunked-7", "b", 1),
    }
    assert check_equality([ref, same])["identical"] is True


def test_equality_check_tells_near_ties_from_real_differences():
    """A real model's greedy runs may part where the reference's top-2 choice was a near-tie; a
    difference where the reference was sure stays a mismatch."""
    ref = _run("colocated", {"a": [1, 2, 3], "b": [4, 5, 6]})
    ref.margins = {"a": [3.0, 0.02, 2.0], "b": [5.0, 4.0, 1.0]}
    tie = _run("disagg-1P1D", {"a": [1, 7, 8], "b": [4, 5, 6]})
    eq = check_equality([ref, tie])
    assert eq["identical"] is False and eq["only_near_ties"] is True
    assert eq["mismatches"][0]["reference_margin"] == 0.02 and "near-tie" in near_tie_note(eq)
    sure = _run("chunked-128", {"a": [1, 2, 3], "b": [9, 5, 6]})
    eq = check_equality([ref, tie, sure])
    assert eq["only_near_ties"] is False and [m["near_tie"] for m in eq["mismatches"]] == [True, False]


def test_mode_list_parsing_and_errors():
    from cli import CliError

    modes = build_modes("colocated,chunked,disagg", "32,128", 2, 1)
    assert [(m.label, m.mode, m.chunk_size, m.prefill, m.decode) for m in modes] == [
        ("colocated", "colocated", None, 1, 1),
        ("chunked-32", "colocated", 32, 1, 1),
        ("chunked-128", "colocated", 128, 1, 1),
        ("disagg-2P1D", "disagg", None, 2, 1),
    ]
    for bad in (("colocated,fast", "32"), ("chunked", "0"), ("chunked", "a,b")):
        with pytest.raises(CliError):
            build_modes(*bad, 1, 1)


def test_prediction_of_the_freeze_on_the_calibrated_device():
    """On the calibrated CPU, whole-prompt colocated serving must be predicted to stall the
    streams for about one document prefill; chunked and disaggregated for about one step."""
    setup = cp.setup_from_calibration("tiny", CALIBRATION)
    specs = build_workload(
        WorkloadConfig(
            workload="article", chat_streams=4, chat_output_len=60, doc_prompt_len=1024, doc_count=1, doc_start_s=0.3
        )
    )
    prefill_ms = setup.steps.prefill(1024) * 1e3
    step_ms = setup.steps.decode([cp.Request(0, "chat", 0.0, 64, 60)] * 4) * 1e3

    def stall(mode: str, chunk: int | None = None) -> float:
        p = cp.predict(mode, cp.sim_config(mode, chunk, 1, 1, 64, setup.link), setup, specs, None, None)
        return p.metrics.stall_ms.max

    assert prefill_ms <= stall("colocated") <= prefill_ms + 2 * step_ms
    assert stall("colocated", 64) < stall("colocated") / 2
    assert stall("disagg") <= 1.5 * step_ms


def test_predictions_price_the_served_tokens_and_the_link():
    """A real tokenizer makes a 1024-word document ~600 tokens: the simulator is fed the server's
    usage.prompt_tokens. The link probe's simulated pull is the cost model's KV bytes at G Gbit/s,
    and a document alone is admitted by an idle decode worker at once (simulated wait 0)."""
    from benchmarks.compare.link_probe import predict_documents, rehearsal_link, summary  # noqa: PLC0415
    from costmodel.article import cost_model as cm  # noqa: PLC0415
    from costmodel.serve_metrics import RequestRecord  # noqa: PLC0415

    specs = build_workload(WorkloadConfig(workload="article", chat_streams=2, doc_prompt_len=1024, doc_count=1))
    served = {s.request_id: (600 if s.kind == "document" else 40) for s in specs}
    records = [
        RequestRecord(s.request_id, s.kind, s.prompt_len, s.max_tokens, 0.0, prompt_tokens=served[s.request_id])
        for s in specs
    ]
    run = ModeRun(build_modes("disagg", "", 1, 1)[0], {}, 0.0, {}, [], BenchResult(None, "tiny", records, None, 0.0))
    sim_specs = served_prompt_lengths(specs, run.bench.records)
    assert [s.prompt_len for s in sim_specs] == [served[s.request_id] for s in specs]

    setup = cp.setup_from_calibration("tiny", CALIBRATION)
    link = rehearsal_link(1.0)
    sc = cp.sim_config("disagg", None, 1, 1, 64, link)
    doc = next(s for s in sim_specs if s.kind == "document")
    measured = [
        {"request_id": doc.request_id, "ttft_ms": 1.0, "ttst_ms": 2.0, "decode_wait_ms": 3.0, "transfer_ms": 1.0}
    ]
    (p,) = predict_documents(setup, sc, sim_specs, 1.0, measured)
    want_bytes = 600 * cm.kv_bytes_per_token(setup.steps.model, setup.steps.kv_dtype)
    assert p["transfer_bytes"] == want_bytes
    assert p["transfer_ms"] == pytest.approx(want_bytes * 8 / 1e9 * 1e3)
    assert p["decode_wait_ms"] == 0.0 and p["ttst_ms"] > p["ttft_ms"] + p["transfer_ms"]
    s = summary(measured, [p])
    assert {k: s[k]["simulated"] is not None for k in ("ttft_ms", "ttst_ms", "decode_wait_ms", "transfer_ms")} == {
        "ttft_ms": True,
        "ttst_ms": True,
        "decode_wait_ms": True,
        "transfer_ms": True,
    }


@pytest.mark.timeout(240)
def test_bench_compare_endpoint_beside_a_mode(ray_cluster, tmp_path, capsys):
    """Cost: two tiny servers (one started here, as a server pdserve's compare did not start; one
    colocated mode) through the quick workload. The endpoint's row is measured like the mode's,
    its greedy tokens compared by id (a pdserve endpoint returns them), its prediction made on
    the calibration given for it; an unreachable endpoint fails its own row only (exit 1)."""
    import socket

    from router.config import ServeConfig
    from router.serve_cli import ServerThread

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    with ServerThread(ServeConfig(model="tiny", num_blocks=512), startup_timeout_s=180) as srv:
        rc = cli_main(
            [
                "bench", "compare", "--quick", "--model", "tiny", "--device", "cpu", "--modes", "colocated",
                "--endpoint", f"ext={srv.url},model=tiny", "--endpoint-calibration", f"ext={CALIBRATION}",
                "--endpoint", f"down=http://127.0.0.1:{closed}", "--calibration", str(CALIBRATION),
                "--out-dir", str(tmp_path), "--out", "ep", "--no-progress",
            ]
        )  # fmt: skip
    out, err = capsys.readouterr()
    assert rc == 1, out + err  # the unreachable endpoint's row failed
    result = json.loads((tmp_path / "ep.json").read_text())
    rows = {m["label"]: m for m in result["modes"]}
    assert list(rows) == ["colocated", "ext", "down"]
    ext, n = rows["ext"], len(result["requests"])
    assert ext["error"] is None and ext["spec"]["mode"] == "endpoint"
    assert ext["endpoint"]["url"] == srv.base_url and ext["endpoint"]["model"] == "tiny"
    assert ext["metrics"]["completed"] == n and ext["metrics"]["ttft_ms"]["p50"] > 0
    assert ext["predicted"]["compared"]["ttft_chat_p50_ms"]["predicted"] is not None
    assert ext["endpoint"]["prediction"]["simulated_as"] == "colocated"
    eq = result["equality"]["endpoints"]["ext"]
    assert eq["identical"] is True and eq["compared"] == n and "token ids" in eq["how"], eq
    assert "cannot reach" in rows["down"]["error"] and "metrics" not in rows["down"]
    assert result["equality"]["endpoints"]["down"]["identical"] is None
    assert rows["colocated"]["error"] is None and rows["colocated"]["metrics"]["completed"] == n
    assert "ext = " in out and "down" in err
    assert "## Servers pdserve did not start" in (tmp_path / "ep.md").read_text()
