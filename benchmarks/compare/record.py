"""The record of a `pdserve bench compare` run: each mode's run in memory (`ModeRun`) and the
result JSON's payload built from them (`result_payload`; provenance is added by `write_result`).

The JSON is the single source for the table, the report and the plots (`--from-json` redraws
them), so everything those show must be in it. Per-token lists are packed one string per
request (`pack`/`unpack`): indented one number per line they would make the file ten times larger.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.compare.args import EndpointSpec, ModeSpec


@dataclass
class ModeRun:
    """One mode's run as measured, before it becomes JSON (`error` set: the mode failed)."""

    spec: ModeSpec | EndpointSpec
    serve_config: dict[str, Any]
    startup_s: float | None  # None: a server pdserve did not start
    token_ids: dict[str, list[int]]  # equality pass, by request id
    transfers: list[dict[str, Any]]  # disagg: the KV transfer of each request (timed run)
    bench: Any  # BenchResult of the timed run
    error: str | None = None
    load_average: list[float] | None = None  # 1/5/15-min load after the run: a busy machine shows here
    samples: list[dict[str, Any]] | None = None  # a real model's answers to a few questions (demo_samples)
    probes: list[dict[str, Any]] | None = None  # --link-gbps: each document alone (benchmarks/compare/link_probe.py)
    margins: dict[str, list[float | None]] | None = None  # equality pass: top-2 margin per token
    serving_overhead: dict[str, Any] | None = None  # measured in the warm-up (compare_modes.serving_overhead)
    gc: dict[str, Any] | None = None  # the garbage collector during the timed run (benchmarks/client/gc_pauses.py)
    greedy_texts: dict[str, str] | None = None  # equality pass: the text (compared for servers without token ids)
    endpoint: dict[str, Any] | None = None  # --endpoint rows: URL, model, calibration, the prediction's basis
    self_calibration: Any = None  # SelfCalibration: the server's own warm-up steps, fitted (compare_calibration)
    warmup: Any = None  # BenchResult of the warm-up (the calibration's choice is scored on it)
    prediction_basis: dict[str, Any] | None = None  # which calibration predicted this mode, and why
    probe_calibration: str | None = None  # --probe-calibration: the quick probe's calibration file
    machine_pace: dict[str, Any] | None = None  # the machine's pace before the server started (benchmarks/pace.py)
    at_server_pace: dict[str, Any] | None = None  # --transfer-from: re-priced at this server's pace (serving_pace.py)


def pack(times: list[float]) -> str:
    """Timestamps as one string of space-separated seconds, to 0.01 ms: with the JSON indented
    one number per line, per-token lists would make the file ten times larger."""
    return " ".join(f"{t:.5f}" for t in times)


def unpack(text: str | list, cast: type = float) -> list:
    """Inverse of the packing of `chunk_times_s` (float) and `token_ids` (cast=int) in the result JSON."""
    return [cast(x) for x in text.split()] if isinstance(text, str) else list(text)


def result_payload(
    args, device, wl, specs, runs, predictions, setup, setup_error, calibration, equality, slo=None, setups=None
) -> dict[str, Any]:
    """The result JSON without provenance: the workload, each mode's records and metrics, the
    prediction beside them, and the equality verdict."""
    from benchmarks.client.bench_serve import finite_json  # noqa: PLC0415
    from costmodel.sim import compare_predict as cp  # noqa: PLC0415

    slo = slo or {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms}
    modes = []
    for r in runs:
        entry: dict[str, Any] = {
            "label": r.spec.label,
            "spec": asdict(r.spec),
            "error": r.error,
            "serve_config": r.serve_config,
            "startup_s": r.startup_s,
            "load_average": r.load_average,
            "machine_pace": r.machine_pace,
            "samples": r.samples,
            "serving_overhead": r.serving_overhead,
            "gc_timed_run": r.gc,
            "self_calibration": r.self_calibration.to_dict() if r.self_calibration is not None else None,
            "prediction_basis": r.prediction_basis,
        }
        if setups and r.spec.label in setups:
            entry["prediction_setup"] = setups[r.spec.label].describe()
        if r.endpoint is not None:
            entry["endpoint"] = r.endpoint
        if r.bench is not None:
            entry["metrics"] = asdict(r.bench.metrics)
            entry["wall_s"] = r.bench.wall_s
            entry["records"] = [
                {k: (pack(v) if k == "chunk_times_s" else v) for k, v in asdict(x).items() if k != "text"}
                for x in r.bench.records
            ]
            entry["transfers"] = r.transfers
            if r.probes is not None:
                from benchmarks.compare.link_probe import summary  # noqa: PLC0415

                entry["link_probe"] = {
                    "link_gbps": args.link_gbps,
                    "documents": r.probes,
                    "summary": summary(
                        [x.get("measured", x) for x in r.probes],
                        [x["simulated"] for x in r.probes if "simulated" in x] or None,
                    ),
                }
            entry["token_ids"] = {rid: " ".join(map(str, ids)) for rid, ids in r.token_ids.items()}
            p = predictions.get(r.spec.label)
            if p is not None:
                entry["predicted"] = {
                    "metrics": asdict(p.metrics),
                    "compared": cp.compare_figures(r.bench.metrics, p.metrics),
                }
            if r.at_server_pace is not None:
                entry["predicted_at_server_pace"] = r.at_server_pace
            from benchmarks.compare import auto as ca  # noqa: PLC0415 - keeps this file short

            entry["per_request"] = ca.per_request(r.bench.records, p.records if p is not None else None)
            entry["headline"] = ca.headline(
                r.bench.records, r.bench.metrics, p.records if p is not None else None,
                p.metrics if p is not None else None, r.spec.mode == "auto",
                (r.serving_overhead or {}).get("client_beyond_router_ms"),
            )  # fmt: skip
            entry["accuracy"] = ca.accuracy_summary(entry["per_request"])
            entry["ttft_by_bucket"] = ca.ttft_by_bucket(r.bench.records)
            entry["dispatch"] = ca.dispatch_summary(entry["per_request"])
            if r.spec.mode == "auto" and setup is not None and None not in (slo["ttft_ms"], slo["tpot_ms"]):
                entry["boundary"] = ca.boundary(
                    calibration, args.model, r.spec.chunk_size, slo["ttft_ms"], slo["tpot_ms"],
                    wl.chat_prompt_len + wl.chat_output_len // 2, max(8, wl.chat_streams), 2 * wl.doc_prompt_len,
                    wl.chat_output_len,
                )  # fmt: skip
        modes.append(entry)
    return finite_json(
        {
            "model": args.model,
            "device": device,
            "workload": asdict(wl),
            "requests": [
                {
                    "request_id": s.request_id,
                    "kind": s.kind,
                    "prompt_len": s.prompt_len,
                    "max_tokens": s.max_tokens,
                    "arrival_s": s.arrival_s,
                }
                for s in specs
            ],
            "slo": slo,
            "prediction_setup": setup.describe() if setup else None,
            "prediction_error": setup_error,
            "prediction_reference": cp.reference_points(
                setup, calibration, wl.doc_prompt_len, wl.chat_streams, wl.chat_prompt_len + wl.chat_output_len // 2
            )
            if setup
            else None,
            "equality": equality,
            "modes": modes,
            "encoding": "records[].chunk_times_s and token_ids[] are space-separated numbers (one line per request)",
        }
    )
