"""`pdserve bench compare` as a pipeline: one `CompareRun` handed from stage to stage.

Each stage reads what the stages before it filled in and adds its own part, in this order
(`benchmarks/compare/command.py` runs them):

1. `plan`: the modes and endpoints the flags name, the device, the workload, the calibration
   file's device model (if there is one);
2. `measure`: each endpoint, then each of pdserve's modes on a fresh server: warm-up, timed run,
   equality pass (`modes.py`, `endpoints.py`);
3. `calibrate`: the device model each mode is predicted with, its own warm-up steps or the
   file's (`prediction.choose`);
4. `set_slos`: the SLOs goodput is counted under, given or derived from that model;
5. `predict`: the simulator on the workload as each server saw it;
6. `check`: greedy equality across pdserve's modes (and beside it, the endpoints');
7. `payload`: the result JSON (`record.result_payload`), which the report is drawn from.

No stage calls back into the command; each is a function of the `CompareRun` alone.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.client.bench_serve import BenchConfig
from benchmarks.client.serve_client import ClientConfig
from benchmarks.compare import prediction as pc
from benchmarks.compare.args import EndpointSpec, ModeSpec, build_modes, parse_endpoints, workload_from_args
from benchmarks.compare.endpoints import prediction_setup, run_endpoint
from benchmarks.compare.equality import check_endpoints, check_equality
from benchmarks.compare.modes import default_device, ensure_ray, gpu_count, log, run_mode
from benchmarks.compare.record import ModeRun, result_payload
from costmodel.workloads import RequestSpec, WorkloadConfig, workload_specs

if TYPE_CHECKING:
    from benchmarks.compare.calibrate.transfer import Transferred
    from costmodel.sim.compare_predict import PredictionSetup


@dataclass
class CompareRun:
    """One `bench compare` run, filled in stage by stage (the comment on each group names the
    stage that fills it)."""

    args: argparse.Namespace
    # plan
    modes: list[ModeSpec]
    endpoints: list[EndpointSpec]
    device: str
    workload: WorkloadConfig
    specs: list[RequestSpec]
    out_dir: Path
    bench: BenchConfig
    calibration_path: Path | None = None  # the calibration file (found or given), if modes run
    file_setup: Any = None  # its device model (compare_predict.Setup), None if absent or unusable
    file_error: str | None = None  # why there is no file_setup
    # --transfer-from: mode label -> the earlier run's device model (benchmarks/compare/calibrate/transfer.py)
    transfer: dict[str, Any] = field(default_factory=dict)
    transfer_missing: dict[str, str] = field(default_factory=dict)
    # measure
    runs: list[ModeRun] = field(default_factory=list)
    # calibrate
    setups: dict[str, Any] = field(default_factory=dict)  # mode label -> the device model predicting it
    # set_slos
    slo: dict[str, Any] = field(default_factory=dict)
    # predict
    predictions: dict[str, Any] = field(default_factory=dict)
    # check
    equality: dict[str, Any] = field(default_factory=dict)

    @property
    def reference(self) -> Any:
        """The device model the SLOs and the report's reference points come from: the first mode's."""
        return next(iter(self.setups.values()), None)

    @property
    def ours(self) -> list[ModeRun]:
        return [r for r in self.runs if isinstance(r.spec, ModeSpec)]


def plan(args: argparse.Namespace) -> CompareRun:
    """What to run: the modes and endpoints, the device, the workload, the calibration file."""
    from cli import CliError  # noqa: PLC0415
    from costmodel.provenance import RESULTS_DIR  # noqa: PLC0415

    modes = build_modes(args.modes, args.chunk_sizes, args.prefill, args.decode)
    endpoints = parse_endpoints(args.endpoint, args.endpoint_calibration, {m.label for m in modes})
    if not modes and not endpoints:
        raise CliError("--modes none: nothing to measure without --endpoint NAME=URL")
    wl = workload_from_args(args)
    specs = workload_specs(wl)
    client = ClientConfig(duration_limit_s=args.duration_limit_s, seed=args.seed, show_progress=not args.no_progress)
    run = CompareRun(
        args,
        modes,
        endpoints,
        args.device or default_device(),
        wl,
        specs,
        Path(args.out_dir) if args.out_dir else RESULTS_DIR,
        BenchConfig(wl, client, args.slo_ttft_ms, args.slo_tpot_ms),
    )
    if modes:
        _read_calibration_file(run)
    if args.transfer_from:
        from benchmarks.compare.calibrate import transfer  # noqa: PLC0415

        if args.calibration:
            raise CliError("--transfer-from and --calibration each choose the device model: give one")
        try:
            run.transfer, run.transfer_missing = transfer.load(Path(args.transfer_from), args.model)
        except ValueError as e:
            raise CliError(str(e)) from e
        if not run.transfer:
            raise CliError(f"--transfer-from {args.transfer_from}: no mode of it can be predicted from")
    return run


def measure(run: CompareRun) -> None:
    """Every endpoint, then every mode on its own fresh server. Endpoints first: starting the
    embedded Ray may move this thread into a private network namespace
    (router/workers/ray_cluster.py), from where no outside server can be reached."""
    n = len(run.endpoints)
    run.runs = [_measure_endpoint(run, ep, i, n) for i, ep in enumerate(run.endpoints, 1)]
    if run.modes:
        run.runs = _measure_modes(run) + run.runs


def calibrate(run: CompareRun) -> None:
    """Each pdserve mode's device model: its own warm-up steps or the file's (prediction.choose)."""
    args = run.args
    for r in run.ours:
        if r.bench is None or r.spec.mode == "auto":
            continue  # the simulator has no auto mode: the router's own predictions stand
        if args.transfer_from:
            t = run.transfer.get(r.spec.label)
            why = run.transfer_missing.get(r.spec.label, f"{args.transfer_from} did not run {r.spec.label}")
            r.prediction_basis = t.basis if t else {"used": None, "why": why, "self_error": why}
            if t is not None:
                run.setups[r.spec.label] = _with_link(args, t.setup)
            log(f"{r.spec.label}: predicted from {pc.describe_basis(r.prediction_basis)}")
            continue
        choice = pc.choose(
            args.model,
            r,
            run.file_setup,
            run.file_error,
            bool(args.calibration),
            run.specs,
            args.max_num_seqs,
            kv_transfer=args.kv_transfer,
            kv_stream_layers=args.kv_stream_layers,
        )
        r.prediction_basis = choice.basis
        if choice.setup is not None:
            run.setups[r.spec.label] = _with_link(args, choice.setup)
        log(f"{r.spec.label}: predicted from {pc.describe_basis(choice.basis)}")


def set_slos(run: CompareRun) -> None:
    """The SLOs goodput is counted under: the flags, else derived from the reference device model;
    each run's goodput is then counted under them."""
    args = run.args
    ttft, tpot, how = args.slo_ttft_ms, args.slo_tpot_ms, "given (--slo-ttft-ms, --slo-tpot-ms)"
    if (ttft is None or tpot is None) and run.reference is not None:
        hop = next((pc.hop_s(r) * 1e3 for r in run.runs if r.serving_overhead), 0.0)
        d_ttft, d_tpot, how = pc.derive_slos(run.reference, run.workload, hop)
        ttft, tpot = ttft or d_ttft, tpot or d_tpot
    elif ttft is None or tpot is None:
        how = "none: no calibration to derive them from, and no --slo-ttft-ms/--slo-tpot-ms"
    log(f"SLOs: TTFT <= {_ms(ttft)}, TPOT <= {_ms(tpot)} ({how})")
    run.slo = {"ttft_ms": ttft, "tpot_ms": tpot, "how": how}
    pc.apply_slos(run.runs, ttft, tpot)


def predict(run: CompareRun) -> None:
    """The simulator on the workload as each server saw it: pdserve's modes on their chosen device
    model, each endpoint on its own calibration (its row's `endpoint.prediction` says on which)."""
    from costmodel.sim import compare_predict as cp  # noqa: PLC0415

    args, slo = run.args, run.slo
    for r in run.runs:
        if r.bench is None:
            continue
        sim_specs = pc.served_prompt_lengths(run.specs, r.bench.records)
        if isinstance(r.spec, EndpointSpec):
            if r.endpoint is None:
                continue
            ep_setup, sim, r.endpoint["prediction"] = prediction_setup(r.spec, r.bench.model, args.model)
            if ep_setup is not None and sim is not None:
                sc = cp.sim_config(*sim, args.max_num_seqs, ep_setup.link)
                run.predictions[r.spec.label] = cp.predict(
                    r.spec.label, sc, ep_setup, sim_specs, slo["ttft_ms"], slo["tpot_ms"]
                )
            continue
        setup = run.setups.get(r.spec.label)
        if setup is None:
            continue
        sc = pc.sim_config_of(r.spec, args.max_num_seqs, setup, args.kv_transfer, args.kv_stream_layers)
        moved = run.transfer.get(r.spec.label)
        hop = moved.hop_s if moved is not None else pc.hop_s(r)  # transfer: nothing of this run's
        run.predictions[r.spec.label] = cp.predict(
            r.spec.label, sc, setup, sim_specs, slo["ttft_ms"], slo["tpot_ms"], hop
        )
        if moved is not None:
            r.at_server_pace = _at_server_pace(run, r, moved, setup, sim_specs, hop)
        if r.probes is not None:
            from benchmarks.compare.link_probe import predict_documents  # noqa: PLC0415

            r.probes = [
                {"measured": m, "simulated": p}
                for m, p in zip(r.probes, predict_documents(setup, sc, sim_specs, args.link_gbps, r.probes))
            ]


def _at_server_pace(
    run: CompareRun, r: ModeRun, moved: Transferred, setup: PredictionSetup, sim_specs: list[RequestSpec], hop: float
) -> dict[str, Any] | None:
    """A transferred prediction again at this server's pace against the source's, read from the
    side prompts both warm-ups timed (calibrate/serving_pace.py); None where too few matched."""
    from benchmarks.compare.calibrate.serving_pace import pace_ratio  # noqa: PLC0415
    from costmodel.plan.score import priced_at  # noqa: PLC0415
    from costmodel.sim import compare_predict as cp  # noqa: PLC0415

    here = r.self_calibration.logged if r.self_calibration is not None else []
    found = pace_ratio(moved.source_steps, here)
    if found is None or r.bench is None or not isinstance(r.spec, ModeSpec):
        return None
    k, matched = found
    args, slo = run.args, run.slo
    at = priced_at(setup, k)
    sc = pc.sim_config_of(r.spec, args.max_num_seqs, at, args.kv_transfer, args.kv_stream_layers)
    p = cp.predict(r.spec.label, sc, at, sim_specs, slo["ttft_ms"], slo["tpot_ms"], hop)
    return {
        "ratio": k,
        "matched_steps": matched,
        "how": "every step priced at the median ratio of this server's lone prompt steps to the source run's "
        "of the same shape (the side prompts both warm-ups sent)",
        "compared": cp.compare_figures(r.bench.metrics, p.metrics),
    }


def check(run: CompareRun) -> None:
    """Greedy equality across pdserve's modes; the endpoints beside, never in, that verdict
    (another server may differ and pass)."""
    run.equality = check_equality(run.ours)
    if run.endpoints:
        first = next((r for r in run.ours if r.error is None), None)
        outside = [r for r in run.runs if isinstance(r.spec, EndpointSpec)]
        run.equality["endpoints"] = check_endpoints(first, outside)


def payload(run: CompareRun) -> dict[str, Any]:
    """The result JSON without provenance."""
    setup_error = None if run.setups else (run.file_error or "no pdserve mode ran (--modes none)")
    return result_payload(
        run.args,
        run.device,
        run.workload,
        run.specs,
        run.runs,
        run.predictions,
        run.reference,
        setup_error,
        run.calibration_path,
        run.equality,
        run.slo,
        run.setups,
    )


# ---- the stages' parts ------------------------------------------------------------------------


def find_calibration(given: str | None, out_dir: Path, model: str, device_kind: str) -> Path:
    """--calibration, else `bench chunks`' file for this model and device in --out-dir, else in
    benchmarks/results/local/, else the committed one in benchmarks/results/ (a path that may
    not exist)."""
    from costmodel.provenance import REFERENCE_RESULTS_DIR, RESULTS_DIR  # noqa: PLC0415
    from costmodel.sim import compare_predict as cp  # noqa: PLC0415

    if given:
        return Path(given)
    candidates = [
        cp.default_calibration_path(d, Path(model).name, device_kind)
        for d in (out_dir, RESULTS_DIR, REFERENCE_RESULTS_DIR)
    ]
    return next((c for c in candidates if c.is_file()), candidates[-1])


def _read_calibration_file(run: CompareRun) -> None:
    """The calibration file's device model: what every mode is predicted with under
    --calibration, else the candidate beside each server's self-calibration."""
    from cli import CliError  # noqa: PLC0415
    from costmodel.sim import compare_predict as cp  # noqa: PLC0415

    args = run.args
    cal = find_calibration(args.calibration, run.out_dir, args.model, run.device.split(":")[0])
    if args.calibration and not cal.is_file():
        raise CliError(f"--calibration {args.calibration}: no such file")
    if cal.is_file():
        try:
            run.file_setup = _with_link(args, cp.setup_from_calibration(args.model, cal))
        except ValueError as e:
            run.file_error = str(e)
    else:
        run.file_error = f"no calibration file at {cal} (`pdserve bench chunks --model {args.model}` makes one)"
    run.calibration_path = cal
    if run.file_setup is not None and run.file_setup.warning:
        log(f"warning: {run.file_setup.warning}")


def _with_link(args: argparse.Namespace, setup: Any) -> Any:
    """--link-gbps: the KV link priced at the rehearsal's shaped rate, whatever the calibration."""
    if setup is None or not args.link_gbps:
        return setup
    from benchmarks.compare.link_probe import rehearsal_link  # noqa: PLC0415 - --link-gbps only

    return replace(setup, link=rehearsal_link(args.link_gbps))


def _measure_endpoint(run: CompareRun, ep: EndpointSpec, i: int, n: int) -> ModeRun:
    log(f"[endpoint {i}/{n}] {ep.label}: {ep.url} (a server pdserve did not start)")
    try:
        return run_endpoint(ep, run.bench, run.specs)
    except Exception as e:  # noqa: BLE001 - one failed endpoint is reported; the others still run
        log(f"  FAILED: {type(e).__name__}: {e}")
        info = {"url": ep.url, "model": ep.model, "calibration": ep.calibration}
        return ModeRun(ep, {}, None, {}, [], None, f"{type(e).__name__}: {e}", endpoint=info)


def _measure_modes(run: CompareRun) -> list[ModeRun]:
    """Each of pdserve's modes on a fresh server, one after another, on one Ray."""
    from benchmarks.compare.link_probe import cluster_kwargs  # noqa: PLC0415 - --link-gbps only

    args = run.args
    gpus = 0.0 if run.device == "cpu" else None
    cfg_kw = dict(model=args.model, device=run.device, num_blocks=args.num_blocks, max_num_seqs=args.max_num_seqs)
    if args.no_prefix_cache:
        cfg_kw["prefix_cache"] = False
    cfg_kw.update(cluster_kwargs(args))
    started_ray = ensure_ray(args.ray_address)
    runs: list[ModeRun] = []
    try:
        for i, m in enumerate(run.modes, 1):
            log(f"[{i}/{len(run.modes)}] {m.label}: starting a fresh pdserve server")
            workers = m.decode if m.mode == "colocated" else m.prefill + m.decode
            kw = dict(cfg_kw, gpus_per_worker=gpus if gpus is not None else min(1.0, gpu_count() / workers))
            if m.mode != "colocated":  # the KV crosses pools only there
                kw.update(kv_transfer=args.kv_transfer, kv_stream_layers=args.kv_stream_layers)
            if m.mode == "auto":  # decides under the benchmark's SLO pair, with the calibration file
                kw.update(_auto_settings(run))
            try:
                probe_dir = run.out_dir if args.probe_calibration else None
                runs.append(
                    run_mode(m, kw, run.bench, run.specs, args.startup_timeout_s, bool(args.link_gbps), probe_dir)
                )
            except Exception as e:  # noqa: BLE001 - one failed mode is reported; the others still run
                log(f"  FAILED: {type(e).__name__}: {e}")
                runs.append(ModeRun(m, {}, 0.0, {}, [], None, f"{type(e).__name__}: {e}"))
    finally:
        if started_ray:
            import ray  # noqa: PLC0415

            ray.shutdown()
    return runs


def _auto_settings(run: CompareRun) -> dict[str, Any]:
    """`--mode auto`'s serve settings: it decides before any step ran, so under the benchmark's SLO
    pair (derived from the calibration file where not given) and with that file."""
    ttft, tpot = run.args.slo_ttft_ms, run.args.slo_tpot_ms
    if (ttft is None or tpot is None) and run.file_setup is not None:
        d_ttft, d_tpot, _ = pc.derive_slos(run.file_setup, run.bench.workload, 0.0)
        ttft, tpot = ttft or d_ttft, tpot or d_tpot
    kw: dict[str, Any] = {"calibration": str(run.calibration_path)}
    kw.update({k: v for k, v in (("slo_ttft_ms", ttft), ("slo_itl_ms", tpot)) if v is not None})
    return kw


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f} ms"
