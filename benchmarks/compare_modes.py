"""Running pdserve's own modes for `pdserve bench compare`: one fresh server per mode.

For each mode a pdserve server (Ray actors + uvicorn on a free loopback port,
`router.serve_cli.ServerThread`) is started and given:
1. a warm-up: requests of the workload's shapes with other random text (the next seed), all at
   once, so the first prefill of each shape is not timed and no timed prompt is in the prefix
   cache (the timed prompts are uncached, as the simulator assumes);
2. the timed run: the workload through `bench serve`'s client (arrivals on schedule, streamed,
   per-chunk timestamps) -> TTFT/ITL/TPOT/E2E, goodput, stall per document; with the process's
   objects frozen first (`benchmarks/gc_pauses.py`: client and router share this process, and a
   full collection of it paused both for up to 0.54 s), its collections recorded;
3. the equality pass (`benchmarks/compare_equality.py`), after the timed run so that its burst
   (and its prefix-cache hits) shape nothing that is timed, auto's online fits included.
The serving overhead per token (HTTP/SSE, router and Ray hops) is read off the warm-up.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from dataclasses import replace
from typing import Any

from benchmarks import demo_samples
from benchmarks.bench_serve import BenchConfig, run_benchmark
from benchmarks.compare_args import ModeSpec
from benchmarks.compare_equality import equality_pass
from benchmarks.compare_record import ModeRun
from benchmarks.gc_pauses import QuietGC
from costmodel.workloads import RequestSpec, build_workload
from engine.config import PRESETS
from router.ray_cluster import connect_ray, start_local_ray


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
) -> ModeRun:
    from router.config import ServeConfig  # noqa: PLC0415
    from router.serve_cli import ServerThread  # noqa: PLC0415

    cfg = ServeConfig(mode=spec.mode, chunk_size=spec.chunk_size, prefill=spec.prefill, decode=spec.decode, **cfg_kw)
    cfg.validate()
    t0 = time.perf_counter()
    with ServerThread(cfg, startup_timeout_s=timeout_s) as srv:
        startup = time.perf_counter() - t0
        client = replace(bench.client, base_url=srv.base_url, model=cfg.model_name)
        warm = warmup_specs(bench, specs)
        log(f"  up in {startup:.1f} s at {srv.base_url}; warm-up (the schedule again, other text)")
        warmup = asyncio.run(run_benchmark(replace(bench, client=client), warm))
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
        probes = None
        if probe:
            from benchmarks.link_probe import probe_documents  # noqa: PLC0415 - --link-gbps only

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
        serving_overhead=serving_overhead(warmup.records),
        gc=quiet.summary(),
    )


def warmup_specs(bench: BenchConfig, specs: list[RequestSpec]) -> list[RequestSpec]:
    """The workload's schedule and shapes with other random text (the next seed's prompts)."""
    other = {s.request_id: s for s in build_workload(replace(bench.workload, seed=bench.workload.seed + 1))}
    return [replace(s, prompt=other[s.request_id].prompt) if s.request_id in other else s for s in specs]


def serving_overhead(records: list[Any]) -> dict[str, float | None]:
    """What the warm-up's requests waited beyond their worker's own queue + prefill (client TTFT
    minus that: the HTTP/SSE, router and Ray hops), and beyond the router's TTFT; medians, ms."""
    import statistics  # noqa: PLC0415

    hop, client_extra = [], []
    for r in records:
        if not r.ok or r.send_s is None:
            continue
        ttft = (r.chunk_times_s[0] - r.send_s) * 1e3
        if r.worker_queue_ms is not None and r.worker_prefill_ms is not None:
            hop.append(ttft - r.worker_queue_ms - r.worker_prefill_ms)
        if r.router_ttft_ms is not None:
            client_extra.append(ttft - r.router_ttft_ms)
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    return {"hop_ms": med(hop), "client_beyond_router_ms": med(client_extra), "requests": len(hop)}


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
