"""`pdserve bench compare`: colocated vs chunked vs disaggregated pdserve on the same workload,
and beside them any OpenAI-compatible server pdserve did not start (`--endpoint`).

This file is the command: it reads the flags, runs every mode on its own fresh server (then each
endpoint), puts the simulator's prediction beside each measurement, checks greedy equality across
modes, and writes the result JSON, the report and the table. Each of those jobs lives in its own file:
- `compare_args.py`: the flags, the workload they set, the modes they name;
- `compare_modes.py`: one pdserve server per mode (warm-up, timed run, equality pass);
- `compare_endpoints.py`: the same for servers pdserve did not start (`--endpoint NAME=URL`);
- `compare_equality.py`: the equality pass and the check across modes;
- `compare_calibration.py`: each server's own steps, fitted (the self-calibration);
- `compare_calibration_file.py`: where a calibration file is found;
- `compare_prediction.py`: which calibration predicts each mode, and the SLOs;
- `compare_record.py`: the result JSON's payload;
- `compare_table.py`, `compare_markdown.py`, `compare_plots.py`: the report.
Predictions come from the simulator on a calibrated device model (`costmodel/sim/compare_predict.py`)
and are labelled "simulated".
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.client.bench_serve import BenchConfig
from benchmarks.client.serve_client import ClientConfig
from benchmarks.compare import markdown as compare_markdown
from benchmarks.compare import prediction as pc
from benchmarks.compare import table as compare_table
from benchmarks.compare.args import (
    EndpointSpec,
    ModeSpec,
    add_arguments,
    build_modes,
    parse_endpoints,
    workload_from_args,
)
from benchmarks.compare.calibration_file import find_calibration
from benchmarks.compare.endpoints import prediction_setup, run_endpoint
from benchmarks.compare.equality import check_endpoints, check_equality
from benchmarks.compare.modes import default_device, ensure_ray, gpu_count, log, run_mode
from benchmarks.compare.record import ModeRun, result_payload
from cli.output import emit_json
from costmodel.workloads import RequestSpec, build_workload

__all__ = ["add_arguments", "main"]


def run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Run every mode and endpoint, predict, check equality; the JSON payload (without provenance)."""
    from cli import CliError  # noqa: PLC0415
    from costmodel.provenance import RESULTS_DIR  # noqa: PLC0415

    modes = build_modes(args.modes, args.chunk_sizes, args.prefill, args.decode)
    endpoints = parse_endpoints(args.endpoint, args.endpoint_calibration, {m.label for m in modes})
    if not modes and not endpoints:
        raise CliError("--modes none: nothing to measure without --endpoint NAME=URL")
    device = args.device or default_device()
    wl = workload_from_args(args)
    try:
        wl.validate()
        specs = build_workload(wl)
    except ValueError as e:
        raise CliError(str(e)) from None
    out_dir = Path(args.out_dir) if args.out_dir else RESULTS_DIR
    file_setup, file_error, cal = _file_setup(args, out_dir, device) if modes else (None, None, None)
    if file_setup is not None and file_setup.warning:
        log(f"warning: {file_setup.warning}")
    bench = BenchConfig(
        wl,
        ClientConfig(duration_limit_s=args.duration_limit_s, seed=args.seed, show_progress=not args.no_progress),
        args.slo_ttft_ms,
        args.slo_tpot_ms,
    )
    # Endpoints first: starting the embedded Ray may move this thread into a private network
    # namespace (router/workers/ray_cluster.py), from where no outside server can be reached.
    outside = [_run_endpoint(ep, i, len(endpoints), bench, specs) for i, ep in enumerate(endpoints, 1)]
    runs = (_run_modes(args, modes, device, cal, file_setup, bench, specs) if modes else []) + outside
    setups = _choose_setups(args, runs, file_setup, file_error, specs)
    reference = next(iter(setups.values()), None)  # the SLOs and the report's reference points
    slo = _slos(args, wl, reference, runs)
    pc.apply_slos(runs, slo["ttft_ms"], slo["tpot_ms"])
    predictions = _predict(args, runs, setups, specs, slo)
    ours = [r for r in runs if isinstance(r.spec, ModeSpec)]
    equality = check_equality(ours)
    if endpoints:  # beside, never in, the verdict on pdserve's modes: another server may differ and pass
        first = next((r for r in ours if r.error is None), None)
        equality["endpoints"] = check_endpoints(first, [r for r in runs if isinstance(r.spec, EndpointSpec)])
    setup_error = None if setups else (file_error or "no pdserve mode ran (--modes none)")
    return result_payload(
        args, device, wl, specs, runs, predictions, reference, setup_error, cal, equality, slo, setups
    )


def _out_dir(args: argparse.Namespace) -> Path:
    from costmodel.provenance import RESULTS_DIR  # noqa: PLC0415

    return Path(args.out_dir) if args.out_dir else RESULTS_DIR


def _run_endpoint(ep: EndpointSpec, i: int, n: int, bench: BenchConfig, specs: list[RequestSpec]) -> ModeRun:
    log(f"[endpoint {i}/{n}] {ep.label}: {ep.url} (a server pdserve did not start)")
    try:
        return run_endpoint(ep, bench, specs)
    except Exception as e:  # noqa: BLE001 - one failed endpoint is reported; the others still run
        log(f"  FAILED: {type(e).__name__}: {e}")
        info = {"url": ep.url, "model": ep.model, "calibration": ep.calibration}
        return ModeRun(ep, {}, None, {}, [], None, f"{type(e).__name__}: {e}", endpoint=info)


def _file_setup(args: argparse.Namespace, out_dir: Path, device: str) -> tuple[Any, str | None, Path]:
    """The calibration file's device model: what every mode is predicted with under
    --calibration, else the candidate beside each server's self-calibration."""
    from cli import CliError  # noqa: PLC0415
    from costmodel.sim import compare_predict as cp  # noqa: PLC0415

    setup, setup_error = None, None
    cal = find_calibration(args.calibration, out_dir, args.model, device.split(":")[0])
    if args.calibration and not cal.is_file():
        raise CliError(f"--calibration {args.calibration}: no such file")
    if cal.is_file():
        try:
            setup = cp.setup_from_calibration(args.model, cal)
        except ValueError as e:
            setup_error = str(e)
    else:
        setup_error = f"no calibration file at {cal} (`pdserve bench chunks --model {args.model}` makes one)"
    return _with_link(args, setup), setup_error, cal


def _with_link(args: argparse.Namespace, setup: Any) -> Any:
    """--link-gbps: the KV link priced at the rehearsal's shaped rate, whatever the calibration."""
    if setup is None or not args.link_gbps:
        return setup
    from benchmarks.compare.link_probe import rehearsal_link  # noqa: PLC0415 - --link-gbps only

    return replace(setup, link=rehearsal_link(args.link_gbps))


def _run_modes(
    args: argparse.Namespace,
    modes: list[ModeSpec],
    device: str,
    cal: Path | None,
    file_setup: Any,
    bench: BenchConfig,
    specs: list,
) -> list[ModeRun]:
    """Each of pdserve's modes on a fresh server, one after another, on one Ray."""
    from benchmarks.compare.link_probe import cluster_kwargs  # noqa: PLC0415 - keeps this file short

    gpus = 0.0 if device == "cpu" else None
    cfg_kw = dict(model=args.model, device=device, num_blocks=args.num_blocks, max_num_seqs=args.max_num_seqs)
    if args.no_prefix_cache:
        cfg_kw["prefix_cache"] = False
    cfg_kw.update(cluster_kwargs(args))
    started_ray = ensure_ray(args.ray_address)
    runs: list[ModeRun] = []
    try:
        for i, m in enumerate(modes, 1):
            log(f"[{i}/{len(modes)}] {m.label}: starting a fresh pdserve server")
            workers = m.decode if m.mode == "colocated" else m.prefill + m.decode
            kw = dict(cfg_kw, gpus_per_worker=gpus if gpus is not None else min(1.0, gpu_count() / workers))
            if m.mode != "colocated":  # the KV crosses pools only there
                kw.update(kv_transfer=args.kv_transfer, kv_stream_layers=args.kv_stream_layers)
            if m.mode == "auto":  # decides under the benchmark's SLO pair, with the calibration file
                ttft, tpot = args.slo_ttft_ms, args.slo_tpot_ms
                if (ttft is None or tpot is None) and file_setup is not None:  # it must decide before any step ran
                    d_ttft, d_tpot, _ = pc.derive_slos(file_setup, bench.workload, 0.0)
                    ttft, tpot = ttft or d_ttft, tpot or d_tpot
                kw.update(calibration=str(cal))
                kw.update({k: v for k, v in (("slo_ttft_ms", ttft), ("slo_itl_ms", tpot)) if v is not None})
            try:
                probe_dir = _out_dir(args) if args.probe_calibration else None
                runs.append(run_mode(m, kw, bench, specs, args.startup_timeout_s, bool(args.link_gbps), probe_dir))
            except Exception as e:  # noqa: BLE001 - one failed mode is reported; the others still run
                log(f"  FAILED: {type(e).__name__}: {e}")
                runs.append(ModeRun(m, {}, 0.0, {}, [], None, f"{type(e).__name__}: {e}"))
    finally:
        if started_ray:
            import ray  # noqa: PLC0415

            ray.shutdown()
    return runs


def _choose_setups(
    args: argparse.Namespace, runs: list[ModeRun], file_setup: Any, file_error: str | None, specs: list[RequestSpec]
) -> dict[str, Any]:
    """Each pdserve mode's device model (self-calibrated or the file's, see compare_prediction)."""
    setups = {}
    for r in runs:
        if not isinstance(r.spec, ModeSpec) or r.bench is None or r.spec.mode == "auto":
            continue  # the simulator has no auto mode: the router's own predictions stand
        choice = pc.choose(
            args.model,
            r,
            file_setup,
            file_error,
            bool(args.calibration),
            specs,
            args.max_num_seqs,
            kv_transfer=args.kv_transfer,
            kv_stream_layers=args.kv_stream_layers,
        )
        r.prediction_basis = choice.basis
        if choice.setup is not None:
            setups[r.spec.label] = _with_link(args, choice.setup)
        log(f"{r.spec.label}: predicted from {pc.describe_basis(choice.basis)}")
    return setups


def _slos(args: argparse.Namespace, wl: Any, reference: Any, runs: list[ModeRun]) -> dict[str, Any]:
    """The SLOs goodput is counted under: the flags, else derived from the first mode's calibration."""
    ttft, tpot, how = args.slo_ttft_ms, args.slo_tpot_ms, "given (--slo-ttft-ms, --slo-tpot-ms)"
    if (ttft is None or tpot is None) and reference is not None:
        hop = next((pc.hop_s(r) * 1e3 for r in runs if r.serving_overhead), 0.0)
        d_ttft, d_tpot, how = pc.derive_slos(reference, wl, hop)
        ttft, tpot = ttft or d_ttft, tpot or d_tpot
    elif ttft is None or tpot is None:
        how = "none: no calibration to derive them from, and no --slo-ttft-ms/--slo-tpot-ms"
    log(f"SLOs: TTFT <= {_ms(ttft)}, TPOT <= {_ms(tpot)} ({how})")
    return {"ttft_ms": ttft, "tpot_ms": tpot, "how": how}


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f} ms"


def _predict(
    args: argparse.Namespace, runs: list[ModeRun], setups: dict[str, Any], specs: list[RequestSpec], slo: dict
) -> dict:
    """The simulator on the workload as each server saw it: pdserve's modes on their chosen device
    model, each endpoint on its own calibration (its row's `endpoint.prediction` says on which)."""
    from costmodel.sim import compare_predict as cp  # noqa: PLC0415

    predictions = {}
    for r in runs:
        if r.bench is None:
            continue
        sim_specs = pc.served_prompt_lengths(specs, r.bench.records)
        if isinstance(r.spec, EndpointSpec):
            if r.endpoint is None:
                continue
            ep_setup, sim, r.endpoint["prediction"] = prediction_setup(r.spec, r.bench.model, args.model)
            if ep_setup is not None and sim is not None:
                sc = cp.sim_config(*sim, args.max_num_seqs, ep_setup.link)
                predictions[r.spec.label] = cp.predict(
                    r.spec.label, sc, ep_setup, sim_specs, slo["ttft_ms"], slo["tpot_ms"]
                )
            continue
        setup = setups.get(r.spec.label)
        if setup is None:
            continue
        sc = pc.sim_config_of(r.spec, args.max_num_seqs, setup, args.kv_transfer, args.kv_stream_layers)
        predictions[r.spec.label] = cp.predict(
            r.spec.label, sc, setup, sim_specs, slo["ttft_ms"], slo["tpot_ms"], pc.hop_s(r)
        )
        if r.probes is not None:
            from benchmarks.compare.link_probe import predict_documents  # noqa: PLC0415

            r.probes = [
                {"measured": m, "simulated": p}
                for m, p in zip(r.probes, predict_documents(setup, sc, sim_specs, args.link_gbps, r.probes))
            ]
    return predictions


def served_prompt_lengths(specs: list[RequestSpec], run: ModeRun) -> list[RequestSpec]:
    """The workload as the server saw it (compare_prediction.served_prompt_lengths) for one run."""
    return pc.served_prompt_lengths(specs, run.bench.records if run.bench else None)


def main(args: argparse.Namespace) -> int:
    import json  # noqa: PLC0415

    from cli import CliError  # noqa: PLC0415
    from costmodel.provenance import RESULTS_DIR, write_result  # noqa: PLC0415

    out_dir = Path(args.out_dir) if args.out_dir else RESULTS_DIR
    if args.from_json:
        try:
            result = json.loads(Path(args.from_json).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CliError(f"--from-json {args.from_json}: {e}") from None
        name = args.out or Path(args.from_json).stem
        path = Path(args.from_json)
    else:
        payload = run_from_args(args)
        if any(not m.get("endpoint") for m in payload["modes"]):
            name = args.out or f"compare-{Path(args.model).name}-{payload['device'].split(':')[0]}"
        else:  # --modes none: the servers measured are the endpoints
            name = args.out or "compare-" + "-".join(m["label"] for m in payload["modes"])
        config = {k: v for k, v in vars(args).items() if not k.startswith("_") and k != "from_json"}
        path = write_result(name, payload, config, out_dir)
        result = json.loads(path.read_text())
    files = compare_markdown.write_report(result, out_dir, name, result_path=path)
    table = compare_table.format_table(result)
    if args.json:
        emit_json(
            {
                "result_file": str(path),
                "report": str(files.markdown),
                "plots": [str(p) for p in files.plots],
                "equality": result["equality"],
                "summary": compare_table.summary_rows(result),
            }
        )
    else:
        print(table)
        from benchmarks.compare.link_probe import format_table  # noqa: PLC0415

        link_table = format_table(result)
        if link_table:
            print("\nEach document alone on the link (mean over documents):\n" + link_table)
        print(f"result: {path}\nreport: {files.markdown}\nplots:  " + ", ".join(str(p) for p in files.plots))
    eq = result["equality"]
    if eq.get("identical") is False and eq.get("only_near_ties"):
        print(compare_table.near_tie_note(eq), file=sys.stderr)
    elif eq.get("identical") is False:
        print(compare_table.mismatch_banner(eq), file=sys.stderr)
        return 1
    if any(m.get("error") for m in result["modes"]):
        print(
            "pdserve bench compare: some modes failed: "
            + "; ".join(f"{m['label']}: {m['error']}" for m in result["modes"] if m.get("error")),
            file=sys.stderr,
        )
        return 1
    return 0
