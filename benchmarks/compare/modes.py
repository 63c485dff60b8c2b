"""Running pdserve's own modes for `pdserve bench compare`: one fresh server per mode.

For each mode a pdserve server (Ray actors + uvicorn on a free loopback port,
`router.serve_cli.ServerThread`) is started and given:
1. a warm-up: the workload's schedule and shapes with other random text (other seeds), twice,
   so the first prefill of each shape is not timed and no timed prompt is in the prefix cache
   (the timed prompts are uncached, as the simulator assumes);
2. the timed run: the workload through `bench serve`'s client (arrivals on schedule, streamed,
   per-chunk timestamps) -> TTFT/ITL/TPOT/E2E, goodput, stall per document; with the process's
   objects frozen first (`benchmarks/client/gc_pauses.py`: client and router share this process, and a
   full collection of it paused both for up to 0.54 s), its collections recorded;
3. the equality pass (`benchmarks/compare/equality.py`), after the timed run so that its burst
   (and its prefix-cache hits) shape nothing that is timed, auto's online fits included.
Through the warm-up (and a few warm requests after it, which time the serving overhead: HTTP/SSE,
router and Ray hops) the server's own step log is recorded: the mode is predicted from steps that
very server ran (`benchmarks/compare/calibrate/calibration.py`).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.client.bench_serve import BenchConfig, run_benchmark
from benchmarks.client.gc_pauses import QuietGC
from benchmarks.client.step_log import StepLogRecorder
from benchmarks.compare import demo_samples
from benchmarks.compare.args import ModeSpec
from benchmarks.compare.calibrate.calibration import build as build_self_calibration
from benchmarks.compare.calibrate.calibration import hop_ms
from benchmarks.compare.calibrate.side_requests import hop_specs, prefix_specs, shape_specs
from benchmarks.compare.equality import equality_pass
from benchmarks.compare.record import ModeRun
from benchmarks.pace import describe as describe_pace
from benchmarks.pace import machine_pace
from costmodel.article import cost_model as cm
from costmodel.workloads import RequestSpec, build_workload
from engine.config import PRESETS
from router.workers.ray_cluster import connect_ray, start_local_ray


def ensure_ray(address: str | None = None) -> bool:
    """Start one local Ray for every server of this run (servers reuse it), or connect to the
    cluster at `address`. True if started (or connected) here."""
    import ray  # noqa: PLC0415

    if ray.is_initialized():
        return False
    if address:  # the cluster's token comes from the environment, as for any Ray driver
        connect_ray(address, log_to_driver=False)
        return True
    # token auth; a private network namespace where Linux allows (the servers and their clients
    # in this process then meet on its loopback)
    start_local_ray(num_cpus=8, object_store_bytes=128 * 1024**2, log_to_driver=False, private_network=True)
    return True


def run_mode(
    spec: ModeSpec,
    cfg_kw: dict[str, Any],
    bench: BenchConfig,
    specs: list[RequestSpec],
    timeout_s: float,
    probe: bool = False,
    probe_dir: Path | None = None,
) -> ModeRun:
    """`probe_dir`: also calibrate the server with a `bench probe --quick` (its files go there),
    a third candidate for the prediction beside the step log and the calibration file."""
    from router.config import ServeConfig  # noqa: PLC0415
    from router.serve_cli import ServerThread  # noqa: PLC0415

    cfg = ServeConfig(mode=spec.mode, chunk_size=spec.chunk_size, prefill=spec.prefill, decode=spec.decode, **cfg_kw)
    cfg.validate()
    pace = machine_pace()
    log(f"  {describe_pace(pace)}")
    t0 = time.perf_counter()
    with ServerThread(cfg, startup_timeout_s=timeout_s) as srv:
        startup = time.perf_counter() - t0
        client = replace(bench.client, base_url=srv.base_url, model=cfg.model_name)
        log(f"  up in {startup:.1f} s at {srv.base_url}; warm-up (the schedule again, other text, twice)")
        # A fresh server's first step of each shape runs cold (oneDNN layouts, allocator growth):
        # a lone 35-token prefill took 1.27 s, a first batch-1 decode step 1.78 s (0.14 and 0.07 s
        # warm). So the first pass, and single requests (the batch-1 shapes a pass may never
        # reach), meet the shapes; the second pass, with other text again (no prefix-cache hit),
        # is recorded and fitted (the server's own steps are its calibration), and the single
        # requests again time the serving hop.
        first, warm = warmup_specs(bench, specs, 2), warmup_specs(bench, specs)
        asyncio.run(run_benchmark(replace(bench, client=client), first))
        asyncio.run(run_benchmark(replace(bench, client=client), hop_specs(first)))  # its text: cached already
        with StepLogRecorder(srv.url, cfg.api_key) as steps:
            warmup = asyncio.run(run_benchmark(replace(bench, client=client), warm))
            log("  serving overhead (a few warm requests, one at a time)")
            hops = asyncio.run(run_benchmark(replace(bench, client=client), hop_specs(warm)))
            log("  prompt lengths (shorter documents alone, new text: a per-token cost apart from attention)")
            for one in shape_specs(warmup_specs(bench, specs, 3)):
                asyncio.run(run_benchmark(replace(bench, client=client), [one]))
            log("  prompts past a cached prefix (alone, then several at once: a prompt item's own cost)")
            for group in prefix_specs(warmup_specs(bench, specs, 4)):
                asyncio.run(run_benchmark(replace(bench, client=client), group))
        kv_bytes = cm.kv_bytes_per_token(cm.ModelSpec.resolve(cfg.model), cfg.kv_dtype)
        calibration = build_self_calibration(steps.steps, warmup.records, hops.records, kv_bytes, steps.error)
        log(f"  self-calibration: {calibration.summary()}")
        log("  timed run (arrivals on schedule, streamed)")
        with QuietGC() as quiet:  # no full collection of the whole process mid-run
            result = asyncio.run(run_benchmark(replace(bench, client=client), specs))
        log(f"  equality pass ({len(specs)} requests at once)")
        greedy = asyncio.run(equality_pass(srv.base_url, cfg.model_name, specs))
        transfers = [{"request_id": r.request_id, **r.transfer} for r in result.records if r.transfer]
        samples = None
        if cfg.model not in PRESETS:  # a real model: a few answers a person can read
            log("  real outputs (a few chat questions)")
            samples = demo_samples.ask(srv.base_url, cfg.model_name)
        probe_cal = quick_probe(srv.base_url, cfg.model_name, probe_dir, spec.label) if probe_dir else None
        probes = None
        if probe:
            from benchmarks.compare.link_probe import probe_documents  # noqa: PLC0415 - --link-gbps only

            log("  link probe (each document alone)")
            probes = probe_documents(srv.url, cfg.model_name, specs)
    return ModeRun(
        spec,
        cfg.to_dict(),
        startup,
        greedy.token_ids,
        transfers,
        result,
        load_average=load_average(),
        samples=samples,
        probes=probes,
        margins=greedy.margins,
        greedy_texts=greedy.texts,
        serving_overhead=serving_overhead(warmup.records, hops.records),
        gc=quiet.summary(),
        self_calibration=calibration,
        warmup=warmup,
        probe_calibration=probe_cal,
        machine_pace=pace,
    )


def quick_probe(base_url: str, model: str, out_dir: Path, label: str) -> str | None:
    """`pdserve bench probe --quick` of a running server (after its timed run: the probe's
    prompts then shape nothing that is timed); the calibration file's path, or None if it failed."""
    import argparse  # noqa: PLC0415
    import contextlib  # noqa: PLC0415

    from benchmarks.probe import command as bench_probe  # noqa: PLC0415 - only with --probe-calibration

    log("  quick probe of the same server (a third calibration candidate)")
    parser = argparse.ArgumentParser()
    bench_probe.add_arguments(parser)
    name = f"probe-{label}"
    argv = ["--base-url", base_url, "--model", model, "--quick", "--out", name, "--out-dir", str(out_dir)]
    try:
        with contextlib.redirect_stdout(sys.stderr):  # the probe's table is progress here, not output
            bench_probe.main(parser.parse_args([*argv, "--no-plot"]))
    except Exception as e:  # noqa: BLE001 - the mode is still predicted from its other candidates
        log(f"  quick probe failed: {type(e).__name__}: {e}")
        return None
    return str(out_dir / f"{name}.calibration.json")


def warmup_specs(bench: BenchConfig, specs: list[RequestSpec], seed_offset: int = 1) -> list[RequestSpec]:
    """The workload's schedule and shapes with other random text (another seed's prompts)."""
    seed = bench.workload.seed + seed_offset
    other = {s.request_id: s for s in build_workload(replace(bench.workload, seed=seed))}
    return [replace(s, prompt=other[s.request_id].prompt) if s.request_id in other else s for s in specs]


def serving_overhead(warmup: list[Any], warm: list[Any]) -> dict[str, float | None]:
    """What warm requests (sent one at a time after the warm-up) waited beyond their worker's own
    queue + prefill (client TTFT minus that: the HTTP/SSE, router and Ray hops), and what the
    warm-up's requests waited beyond the router's TTFT; medians, ms. The hop is not read off the
    warm-up itself: its first request of each shape ran cold."""
    import statistics  # noqa: PLC0415

    hop, n = hop_ms(warm)
    client_extra = []
    for r in warmup:
        if r.ok and r.send_s is not None and r.router_ttft_ms is not None:
            client_extra.append((r.chunk_times_s[0] - r.send_s) * 1e3 - r.router_ttft_ms)
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    return {"hop_ms": hop, "client_beyond_router_ms": med(client_extra), "requests": n}


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def default_device() -> str:
    try:
        import torch  # noqa: PLC0415

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


def gpu_count() -> int:
    import torch  # noqa: PLC0415

    return max(1, torch.cuda.device_count())
