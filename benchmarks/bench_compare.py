"""`pdserve bench compare`: colocated vs chunked vs disaggregated pdserve on the same workload.

For each mode, in turn, a fresh pdserve server (Ray actors + uvicorn on a free loopback port,
`router.serve_cli.ServerThread`) is started and given:
1. a warm-up: requests of the workload's shapes with other random text (the next seed), all at
   once, so the first prefill of each shape is not timed and no timed prompt is in the prefix
   cache (the timed prompts are uncached, as the simulator assumes);
2. the timed run: the workload through `bench serve`'s client (arrivals on schedule, streamed,
   per-chunk timestamps) -> TTFT/ITL/TPOT/E2E, goodput, stall per document; with the process's
   objects frozen first (`benchmarks/gc_pauses.py`: client and router share this process, and a
   full collection of it paused both for up to 0.54 s), its collections recorded;
3. the equality pass: every request of the workload at once, non-streamed, greedy; the token ids
   come back in `pdserve.timeline.token_ids`. Token ids must be identical in every mode: a
   mismatch is printed loudly and the command exits 1. It runs after the timed run so that its
   burst (and its prefix-cache hits) shape nothing that is timed, auto's online fits included.
Beside each measured figure: the simulator's prediction on a calibrated device model
(`costmodel/compare_predict.py`), labelled "simulated". Results: one JSON with provenance, a
Markdown report and PNG plots (`benchmarks/compare_report.py`), and one table on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks import demo_samples
from benchmarks.bench_serve import BenchConfig, run_benchmark
from benchmarks.compare_report import pack
from benchmarks.gc_pauses import QuietGC
from benchmarks.serve_client import ClientConfig
from cli.output import emit_json
from costmodel.provenance import OUT_DIR_HELP
from costmodel.workloads import RequestSpec, WorkloadConfig, build_workload
from engine.config import PRESETS
from router.ray_cluster import connect_ray, start_local_ray

# The CPU-sized default: 8 chats decoding 400 tokens while three 2048-token documents arrive.
# On the 2-core dev machine with the tiny model a 2048-token prefill takes ~0.6 s and a decode
# step of 8 streams ~10-20 ms, so the colocated freeze stands out, and the chats (~4-6 s) are
# still decoding when the last document arrives in every mode. About a minute for all modes.
DEFAULT_WORKLOAD = dict(
    chat_streams=8,
    chat_prompt_len=64,
    chat_output_len=400,
    doc_prompt_len=2048,
    doc_output_len=8,
    doc_count=3,
    doc_start_s=1.0,
    doc_interval_s=1.2,
)
QUICK_WORKLOAD = dict(
    chat_streams=3,
    chat_prompt_len=32,
    chat_output_len=40,
    doc_prompt_len=512,
    doc_output_len=4,
    doc_count=1,
    doc_start_s=0.4,
    doc_interval_s=1.0,
)


@dataclass(frozen=True)
class ModeSpec:
    """One server configuration to measure."""

    label: str  # "colocated", "chunked-128", "disagg-1P1D"
    mode: str  # ServeConfig.mode
    chunk_size: int | None = None
    prefill: int = 1
    decode: int = 1


@dataclass
class ModeRun:
    spec: ModeSpec
    serve_config: dict[str, Any]
    startup_s: float
    token_ids: dict[str, list[int]]  # equality pass, by request id
    transfers: list[dict[str, Any]]  # disagg: the KV transfer of each request (timed run)
    bench: Any  # BenchResult of the timed run
    error: str | None = None
    load_average: list[float] | None = None  # 1/5/15-min load after the run: a busy machine shows here
    samples: list[dict[str, Any]] | None = None  # a real model's answers to a few questions (demo_samples)
    probes: list[dict[str, Any]] | None = None  # --link-gbps: each document alone (benchmarks/link_probe.py)
    margins: dict[str, list[float | None]] | None = None  # equality pass: top-2 margin per token
    serving_overhead: dict[str, Any] | None = None  # measured in the warm-up (see serving_overhead)
    gc: dict[str, Any] | None = None  # the garbage collector during the timed run (benchmarks/gc_pauses.py)


# ----------------------------------------------------------------------------- arguments


def _ints(text: str, flag: str) -> list[int]:
    from cli import CliError  # noqa: PLC0415

    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CliError(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise CliError(f"{flag}: expected positive integers, got {text!r}")
    return vals


def build_modes(modes: str, chunk_sizes: str, prefill: int, decode: int) -> list[ModeSpec]:
    from cli import CliError  # noqa: PLC0415

    names = [m.strip() for m in modes.split(",") if m.strip()]
    bad = [m for m in names if m not in ("colocated", "chunked", "disagg", "auto")]
    if bad or not names:
        raise CliError(f"--modes: expected a comma-separated subset of colocated,chunked,disagg,auto, got {modes!r}")
    if prefill < 1 or decode < 1:
        raise CliError("--prefill and --decode must be >= 1")
    out: list[ModeSpec] = []
    for m in dict.fromkeys(names):
        if m == "colocated":
            out.append(ModeSpec("colocated", "colocated", decode=decode))
        elif m == "chunked":
            out += [
                ModeSpec(f"chunked-{c}", "colocated", c, decode=decode)
                for c in dict.fromkeys(_ints(chunk_sizes, "--chunk-sizes"))
            ]
        elif m == "auto":  # both pools; local prefills in chunks of the largest --chunk-sizes
            chunk = max(_ints(chunk_sizes, "--chunk-sizes"))
            out.append(ModeSpec(f"auto-{prefill}P{decode}D", "auto", chunk, prefill, decode))
        else:
            out.append(ModeSpec(f"disagg-{prefill}P{decode}D", "disagg", None, prefill, decode))
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = (
        "examples:\n"
        "  pdserve bench compare                          # CPU-sized default, a few minutes\n"
        "  pdserve bench compare --quick                  # CI-sized\n"
        "  pdserve bench compare --modes colocated,disagg --prefill 2 --decode 2\n"
        "  pdserve bench compare --from-json benchmarks/results/compare-tiny-cpu.json  # redraw\n"
    )
    g = p.add_argument_group("servers")
    g.add_argument("--modes", default="colocated,chunked,disagg", help="comma-separated: colocated,chunked,disagg")
    g.add_argument("--chunk-sizes", default="32,128", help="one chunked run per size (tokens)")
    g.add_argument("--prefill", type=int, default=1, metavar="N", help="disagg prefill workers")
    g.add_argument("--decode", type=int, default=1, metavar="M", help="decode (and colocated) workers")
    g.add_argument(
        "--model",
        default="tiny",
        help="preset, registry model (e.g. smollm2-135m-instruct: pulled on first use; the report then "
        "shows its answers to a few questions), checkpoint directory or .gguf file",
    )
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    g.add_argument("--num-blocks", type=int, default=1024, help="KV blocks per worker")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="turn automatic prefix caching off in every pool (the simulator has no cache: with it on, "
        "a document sent again is neither prefilled nor pulled in full)",
    )
    g.add_argument("--startup-timeout-s", type=float, default=300.0)
    w = p.add_argument_group("workload (the article mix; defaults are CPU-sized)")
    for flag, key in (
        ("--chat-streams", "chat_streams"),
        ("--chat-prompt-len", "chat_prompt_len"),
        ("--chat-output-len", "chat_output_len"),
        ("--doc-prompt-len", "doc_prompt_len"),
        ("--doc-output-len", "doc_output_len"),
        ("--doc-count", "doc_count"),
    ):
        w.add_argument(
            flag, type=int, default=None, help=f"default {DEFAULT_WORKLOAD[key]} ({QUICK_WORKLOAD[key]} with --quick)"
        )
    w.add_argument("--doc-rate", type=float, default=None, help="documents/s, Poisson (default: fixed spacing)")
    w.add_argument("--doc-start-s", type=float, default=None, help=f"default {DEFAULT_WORKLOAD['doc_start_s']}")
    w.add_argument("--doc-interval-s", type=float, default=None, help=f"default {DEFAULT_WORKLOAD['doc_interval_s']}")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--quick", action="store_true", help="tiny CI-sized workload (one short document)")
    c = p.add_argument_group("on a cluster (e.g. `pdserve cluster up`; see docs/cluster.md)")
    c.add_argument("--ray-address", default=None, help="an existing Ray cluster (default: a local one)")
    c.add_argument("--prefill-resources", default=None, metavar="JSON", help="as `pdserve serve`")
    c.add_argument("--decode-resources", default=None, metavar="JSON", help="as `pdserve serve`")
    c.add_argument(
        "--link-gbps",
        type=float,
        default=None,
        metavar="G",
        help="the link between the pools: predictions price the KV at G Gbit/s, and each document "
        "is probed alone (TTFT, time to 2nd token, decode wait, transfer, share of TTST)",
    )
    o = p.add_argument_group("SLO, predictions and output")
    o.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    o.add_argument("--slo-tpot-ms", type=float, default=50.0)
    o.add_argument(
        "--calibration",
        default=None,
        help="cost-model calibration JSON for the predictions (default: "
        "<out-dir>/chunks-<model>-<device>.calibration.json from `pdserve bench chunks`)",
    )
    o.add_argument("--duration-limit-s", type=float, default=300.0, help="per timed run")
    o.add_argument("--out", default=None, help="result name (default compare-<model>-<device>)")
    o.add_argument("--out-dir", default=None, help=OUT_DIR_HELP)
    o.add_argument("--json", action="store_true", help="print the result summary as JSON instead of the table")
    o.add_argument("--no-progress", action="store_true")
    o.add_argument(
        "--from-json",
        default=None,
        metavar="RESULT",
        help="redraw the report and plots from an earlier result JSON (no servers)",
    )


def workload_from_args(args: argparse.Namespace) -> WorkloadConfig:
    base = dict(QUICK_WORKLOAD if args.quick else DEFAULT_WORKLOAD)
    for key in (
        "chat_streams",
        "chat_prompt_len",
        "chat_output_len",
        "doc_prompt_len",
        "doc_output_len",
        "doc_count",
        "doc_start_s",
        "doc_interval_s",
    ):
        if getattr(args, key) is not None:
            base[key] = getattr(args, key)
    return WorkloadConfig(workload="article", seed=args.seed, doc_rate=args.doc_rate, **base)


# ----------------------------------------------------------------------------- one mode


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


# A greedy choice whose top-2 logprob margin is below this (nats) is a near-tie: a real model's
# FP8 KV, quantized from activations that differ in the last bits between batch shapes and chunk
# sizes, may flip it, and the two continuations then differ from there on. Random-weight presets
# are scaled so greedy margins are far larger (engine/weights.py), so for them any flip is a bug.
NEAR_TIE_NATS = 0.25


async def equality_pass(base_url: str, model: str, specs: list[RequestSpec]) -> tuple[dict, dict]:
    """Every request at once, non-streamed, greedy: (token ids by request id, top-2 logprob margin
    of each generated token by request id). It runs after the timed run, so with prefix caching on
    its prompts are cached: its KV transfers say nothing, the timed run's are reported."""
    from openai import AsyncOpenAI  # noqa: PLC0415

    client = AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600)

    async def one(s: RequestSpec) -> tuple[str, list[int], list[float | None]]:
        prompt = list(s.prompt) if isinstance(s.prompt, tuple) else s.prompt
        resp = await client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=s.max_tokens,
            temperature=0,
            logprobs=2,
            extra_body={"ignore_eos": True},
        )
        tl = (resp.model_extra or {}).get("pdserve", {}).get("timeline", {})
        lp = resp.choices[0].logprobs
        tops = (lp.top_logprobs or []) if lp is not None else []
        margins = [_margin(t) for t in tops]
        return s.request_id, list(tl.get("token_ids", [])), margins

    try:
        out = await asyncio.gather(*(one(s) for s in specs))
    finally:
        await client.close()
    return {rid: ids for rid, ids, _ in out}, {rid: m for rid, _, m in out}


def _margin(top: dict[str, float] | None) -> float | None:
    """Top-1 minus top-2 logprob (None if two distinct alternatives are not known)."""
    values = sorted((top or {}).values(), reverse=True)
    return values[0] - values[1] if len(values) >= 2 else None


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
        _log(f"  up in {startup:.1f} s at {srv.base_url}; warm-up (the schedule again, other text)")
        warmup = asyncio.run(run_benchmark(replace(bench, client=client), warm))
        _log("  timed run (arrivals on schedule, streamed)")
        with QuietGC() as quiet:  # no full collection of the whole process mid-run
            result = asyncio.run(run_benchmark(replace(bench, client=client), specs))
        _log(f"  equality pass ({len(specs)} requests at once)")
        ids, margins = asyncio.run(equality_pass(srv.base_url, cfg.model_name, specs))
        transfers = [{"request_id": r.request_id, **r.transfer} for r in result.records if r.transfer]
        samples = None
        if cfg.model not in PRESETS:  # a real model: a few answers a person can read
            _log("  real outputs (a few chat questions)")
            samples = demo_samples.ask(srv.base_url, cfg.model_name)
        probes = None
        if probe:
            from benchmarks.link_probe import probe_documents  # noqa: PLC0415 - --link-gbps only

            _log("  link probe (each document alone)")
            probes = probe_documents(srv.url, cfg.model_name, specs)
    return ModeRun(
        spec,
        cfg.to_dict(),
        startup,
        ids,
        transfers,
        result,
        load_average=_load(),
        samples=samples,
        probes=probes,
        margins=margins,
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


def _load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- equality


def check_equality(runs: list[ModeRun]) -> dict[str, Any]:
    """Token ids of every request in every mode against the first mode that ran."""
    ok = [r for r in runs if r.error is None]
    if len(ok) < 2:
        return {
            "reference": ok[0].spec.label if ok else None,
            "identical": None,
            "compared": 0,
            "mismatches": [],
            "note": "fewer than two modes ran: nothing to compare",
        }
    ref = ok[0]
    mismatches, compared = [], 0
    for run in ok[1:]:
        for rid, want in ref.token_ids.items():
            got = run.token_ids.get(rid)
            compared += 1
            if got != want:
                first = next(
                    (i for i, (a, b) in enumerate(zip(want, got or [])) if a != b), min(len(want), len(got or []))
                )
                ref_margins = (ref.margins or {}).get(rid) or []
                margin = ref_margins[first] if first < len(ref_margins) else None
                mismatches.append(
                    {
                        "mode": run.spec.label,
                        "request_id": rid,
                        "first_difference": first,
                        "reference_len": len(want),
                        "got_len": len(got or []),
                        "reference_margin": None if margin is None else round(margin, 4),
                        "near_tie": margin is not None and margin < NEAR_TIE_NATS,
                    }
                )
    # The timed runs' streamed text is a second, weaker witness (lossy for invalid UTF-8 bytes).
    texts = {r.spec.label: {x.request_id: x.text for x in r.bench.records} for r in ok}
    text_diff = [
        (label, rid) for label, t in texts.items() for rid, s in t.items() if s != texts[ref.spec.label].get(rid)
    ]
    return {
        "reference": ref.spec.label,
        "identical": not mismatches,
        # every difference starts at a greedy near-tie of the reference (see NEAR_TIE_NATS)
        "only_near_ties": bool(mismatches) and all(m["near_tie"] for m in mismatches),
        "near_tie_nats": NEAR_TIE_NATS,
        "compared": compared,
        "requests": len(ref.token_ids),
        "modes": [r.spec.label for r in ok],
        "mismatches": mismatches,
        "timed_text_identical": not text_diff,
        "timed_text_differences": len(text_diff),
        "how": "greedy token ids from pdserve.timeline.token_ids of the equality pass (every request of "
        "the workload at once), compared request by request with the reference mode",
    }


def run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Run every mode, predict, check equality; the JSON payload (without provenance)."""
    from cli import CliError  # noqa: PLC0415
    from costmodel import compare_predict as cp  # noqa: PLC0415
    from costmodel.provenance import RESULTS_DIR  # noqa: PLC0415

    modes = build_modes(args.modes, args.chunk_sizes, args.prefill, args.decode)
    device = args.device or _default_device()
    wl = workload_from_args(args)
    try:
        wl.validate()
        specs = build_workload(wl)
    except ValueError as e:
        raise CliError(str(e)) from None
    out_dir = Path(args.out_dir) if args.out_dir else RESULTS_DIR
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
        setup_error = f"no calibration at {cal} (run `pdserve bench chunks --model {args.model}` first)"
    bench = BenchConfig(
        wl,
        ClientConfig(duration_limit_s=args.duration_limit_s, seed=args.seed, show_progress=not args.no_progress),
        args.slo_ttft_ms,
        args.slo_tpot_ms,
    )
    gpus = 0.0 if device == "cpu" else None
    cfg_kw = dict(model=args.model, device=device, num_blocks=args.num_blocks, max_num_seqs=args.max_num_seqs)
    if args.no_prefix_cache:
        cfg_kw["prefix_cache"] = False
    from benchmarks.link_probe import cluster_kwargs, rehearsal_link  # noqa: PLC0415 - keeps this file short

    cfg_kw.update(cluster_kwargs(args))
    if setup is not None and args.link_gbps:
        setup = replace(setup, link=rehearsal_link(args.link_gbps))
    started_ray = ensure_ray(args.ray_address)
    runs: list[ModeRun] = []
    try:
        for i, m in enumerate(modes, 1):
            _log(f"[{i}/{len(modes)}] {m.label}: starting a fresh pdserve server")
            workers = m.decode if m.mode == "colocated" else m.prefill + m.decode
            kw = dict(cfg_kw, gpus_per_worker=gpus if gpus is not None else min(1.0, _gpu_count() / workers))
            if m.mode == "auto":  # decides under the benchmark's SLO pair, with its calibration
                kw.update(calibration=str(cal), slo_ttft_ms=args.slo_ttft_ms, slo_itl_ms=args.slo_tpot_ms)
            try:
                runs.append(run_mode(m, kw, bench, specs, args.startup_timeout_s, probe=bool(args.link_gbps)))
            except Exception as e:  # noqa: BLE001 - one failed mode is reported; the others still run
                _log(f"  FAILED: {type(e).__name__}: {e}")
                runs.append(ModeRun(m, {}, 0.0, {}, [], None, f"{type(e).__name__}: {e}"))
    finally:
        if started_ray:
            import ray  # noqa: PLC0415

            ray.shutdown()
    predictions = {}
    if setup is not None:
        for r in runs:
            if r.spec.mode == "auto":  # the simulator has no auto mode: the router's own predictions stand
                continue
            sc = cp.sim_config(
                r.spec.mode, r.spec.chunk_size, r.spec.prefill, r.spec.decode, args.max_num_seqs, setup.link
            )
            sim_specs = served_prompt_lengths(specs, r)
            hop = (r.serving_overhead or {}).get("hop_ms") or 0.0
            predictions[r.spec.label] = cp.predict(
                r.spec.label, sc, setup, sim_specs, args.slo_ttft_ms, args.slo_tpot_ms, hop / 1e3
            )
            if r.probes is not None:
                from benchmarks.link_probe import predict_documents  # noqa: PLC0415

                r.probes = [
                    {"measured": m, "simulated": p}
                    for m, p in zip(r.probes, predict_documents(setup, sc, sim_specs, args.link_gbps, r.probes))
                ]
    return _payload(args, device, wl, specs, runs, predictions, setup, setup_error, cal, check_equality(runs))


def served_prompt_lengths(specs: list[RequestSpec], run: ModeRun) -> list[RequestSpec]:
    """The workload as the server saw it: each prompt's length in the model's own tokens
    (usage.prompt_tokens of the timed run). A real tokenizer turns a 1024-word document into ~600
    tokens; the simulator must price those, not the workload's nominal length."""
    served = {x.request_id: x.prompt_tokens for x in run.bench.records if x.prompt_tokens} if run.bench else {}
    return [replace(s, prompt_len=served.get(s.request_id, s.prompt_len)) for s in specs]


def find_calibration(given: str | None, out_dir: Path, model: str, device_kind: str) -> Path:
    """--calibration, else `bench chunks`' file for this model and device in --out-dir, else in
    benchmarks/results/local/, else the committed one in benchmarks/results/."""
    from costmodel import compare_predict as cp  # noqa: PLC0415
    from costmodel.provenance import REFERENCE_RESULTS_DIR, RESULTS_DIR  # noqa: PLC0415

    if given:
        return Path(given)
    candidates = [
        cp.default_calibration_path(d, Path(model).name, device_kind)
        for d in (out_dir, RESULTS_DIR, REFERENCE_RESULTS_DIR)
    ]
    return next((c for c in candidates if c.is_file()), candidates[-1])


def _default_device() -> str:
    try:
        import torch  # noqa: PLC0415

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


def _gpu_count() -> int:
    import torch  # noqa: PLC0415

    return max(1, torch.cuda.device_count())


def _payload(args, device, wl, specs, runs, predictions, setup, setup_error, calibration, equality) -> dict[str, Any]:
    from benchmarks.bench_serve import _finite  # noqa: PLC0415
    from costmodel import compare_predict as cp  # noqa: PLC0415

    modes = []
    for r in runs:
        entry: dict[str, Any] = {
            "label": r.spec.label,
            "spec": asdict(r.spec),
            "error": r.error,
            "serve_config": r.serve_config,
            "startup_s": r.startup_s,
            "load_average": r.load_average,
            "samples": r.samples,
            "serving_overhead": r.serving_overhead,
            "gc_timed_run": r.gc,
        }
        if r.bench is not None:
            entry["metrics"] = asdict(r.bench.metrics)
            entry["wall_s"] = r.bench.wall_s
            entry["records"] = [
                {k: (pack(v) if k == "chunk_times_s" else v) for k, v in asdict(x).items() if k != "text"}
                for x in r.bench.records
            ]
            entry["transfers"] = r.transfers
            if r.probes is not None:
                from benchmarks.link_probe import summary  # noqa: PLC0415

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
            from benchmarks import compare_auto as ca  # noqa: PLC0415 - keeps this file short

            entry["per_request"] = ca.per_request(r.bench.records, p.records if p is not None else None)
            entry["headline"] = ca.headline(
                r.bench.records, r.bench.metrics, p.records if p is not None else None,
                p.metrics if p is not None else None, r.spec.mode == "auto",
                (r.serving_overhead or {}).get("client_beyond_router_ms"),
            )  # fmt: skip
            entry["accuracy"] = ca.accuracy_summary(entry["per_request"])
            entry["ttft_by_bucket"] = ca.ttft_by_bucket(r.bench.records)
            entry["dispatch"] = ca.dispatch_summary(entry["per_request"])
            if r.spec.mode == "auto" and setup is not None:
                entry["boundary"] = ca.boundary(
                    calibration, args.model, r.spec.chunk_size, args.slo_ttft_ms, args.slo_tpot_ms,
                    wl.chat_prompt_len + wl.chat_output_len // 2, max(8, wl.chat_streams), 2 * wl.doc_prompt_len,
                    wl.chat_output_len,
                )  # fmt: skip
        modes.append(entry)
    return _finite(
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
            "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
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


def main(args: argparse.Namespace) -> int:
    import json  # noqa: PLC0415

    from benchmarks import compare_report as rep  # noqa: PLC0415
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
        name = args.out or f"compare-{Path(args.model).name}-{payload['device'].split(':')[0]}"
        config = {k: v for k, v in vars(args).items() if not k.startswith("_") and k != "from_json"}
        path = write_result(name, payload, config, out_dir)
        result = json.loads(path.read_text())
    files = rep.write_report(result, out_dir, name, result_path=path)
    table = rep.format_table(result)
    if args.json:
        emit_json(
            {
                "result_file": str(path),
                "report": str(files.markdown),
                "plots": [str(p) for p in files.plots],
                "equality": result["equality"],
                "summary": rep.summary_rows(result),
            }
        )
    else:
        print(table)
        from benchmarks.link_probe import format_table  # noqa: PLC0415

        link_table = format_table(result)
        if link_table:
            print("\nEach document alone on the link (mean over documents):\n" + link_table)
        print(f"result: {path}\nreport: {files.markdown}\nplots:  " + ", ".join(str(p) for p in files.plots))
    eq = result["equality"]
    if eq.get("identical") is False and eq.get("only_near_ties"):
        print(rep.near_tie_note(eq), file=sys.stderr)
    elif eq.get("identical") is False:
        print(rep.mismatch_banner(eq), file=sys.stderr)
        return 1
    if any(m.get("error") for m in result["modes"]):
        print(
            "pdserve bench compare: some modes failed: "
            + "; ".join(f"{m['label']}: {m['error']}" for m in result["modes"] if m.get("error")),
            file=sys.stderr,
        )
        return 1
    return 0
