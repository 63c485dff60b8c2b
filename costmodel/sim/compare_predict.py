"""Predictions for `pdserve bench compare`: the simulator run on exactly the benchmark's workload.

Every request of the seeded workload (same arrival offsets, prompt lengths and max_tokens) is fed
to the discrete-event simulator (`costmodel/sim/engine.py`) for each serving mode, with step
times from the cost model evaluated on a calibrated device spec (`costmodel/article/cost_model.py`
Calibration, e.g. the one `pdserve bench chunks` writes for this device). The simulated token
times are turned into `RequestRecord`s and go through the same `compute_metrics` as the measured
run, so a predicted TTFT/ITL/stall is computed by the same formula as the measured one. A
disaggregated server's `--kv-transfer` and `--kv-stream-layers` reach the simulator too, so a
layer-wise server is predicted with its KV crossing while the prefill runs.

What the simulator does not model (so the prediction error includes it): HTTP/SSE and Ray call
latency per token, the router's event pump, Python scheduling, and on a CPU the prefill and
decode processes of a disaggregated run sharing the same cores.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from costmodel.article import cost_model as cm
from costmodel.fit.step_fit import StepCostFit
from costmodel.serve_metrics import RequestRecord, ServeMetrics, compute_metrics, percentile
from costmodel.sim.engine import Request, Sim, SimConfig, StepModel, Workload
from costmodel.sim.stall_jitter import with_scatter
from costmodel.workloads import RequestSpec


@dataclass(frozen=True)
class PredictionSetup:
    """The device model the simulator prices steps with."""

    steps: StepModel
    link: cm.Link
    source: str  # where the numbers come from (calibration file, or datasheet)
    # "self": fitted to this server's own steps in this run; "file": a calibration file
    kind: str = "file"
    fitted_steps: int | None = None  # steps the fit was made from
    warning: str | None = None  # a calibration file measured on another CPU or commit
    admit_s: float = 0.0  # disagg: decode admission beyond pull and step boundary (SimConfig.admit_s)
    decode_slowdown: float = 1.0  # disagg: a decode step beside a prefill step (SimConfig.decode_slowdown)
    prefill_slowdown: float = 1.0  # disagg: a prefill step beside decoding (SimConfig.prefill_slowdown)
    torch_threads: int | None = None  # intra-op threads the priced steps were measured with (None: unknown)
    prompt_threads: int | None = None  # threads of the prompt steps priced by steps.prompt_fit (None: no such fit)
    longest_prompt: int | None = None  # the longest prompt (tokens) the fit saw: beyond it, it extrapolates
    largest_batch: int | None = None  # the most sequences a step it saw decoded: beyond it, likewise
    # every token reaches the client this long after its worker emits it (router and HTTP hops,
    # measured by `bench compare`; 0: not known). `bench compare` passes its own run's hop apart.
    hop_s: float = 0.0
    # the machine's pace when the fitted steps ran: a one-thread GEMM's GFLOP/s (benchmarks/pace.py;
    # None: not recorded). `plan --verify` re-prices at the pace it measures before each server.
    pace_gflops: float | None = None
    # a whole prompt's forward on more threads than the priced steps' (Calibration.prompt_thread_speedup;
    # costmodel/plan/pricing.py threaded_whole prices colocated whole candidates with it)
    prompt_speedup: dict[str, Any] | None = None
    # seconds the decode steps ran over or under their price, as measured (costmodel/sim/stall_jitter.py):
    # a predicted stall is the longest of its window's steps drawn with it; (): priced as they are
    step_scatter_s: tuple[float, ...] = ()

    def describe(self) -> dict[str, Any]:
        hw = self.steps.hw
        return {
            "source": self.source,
            "kind": self.kind,
            "fitted_steps": self.fitted_steps,
            "torch_threads": self.torch_threads,
            "prompt_threads": self.prompt_threads,
            "prompt_step_fit": self.steps.prompt_fit.to_dict() if self.steps.prompt_fit else None,
            "prompt_thread_speedup": self.prompt_speedup,
            "warning": self.warning,
            "decode_admission_ms": self.admit_s * 1e3,
            "decode_slowdown_beside_prefill": self.decode_slowdown,
            "prefill_slowdown_beside_decode": self.prefill_slowdown,
            "prefill_pool_step_fit": self.steps.prefill_fit.to_dict() if self.steps.prefill_fit else None,
            "hardware": hw.name,
            "mem_bw_gbps": hw.mem_bw / cm.GB,
            "peak_tflops": {k: v / cm.TFLOP for k, v in hw.peak_flops.items()},
            "mfu": self.steps.mfu,
            "weight_dtype": self.steps.weight_dtype,
            "kv_dtype": self.steps.kv_dtype,
            "decode_step_overhead_ms": hw.step_overhead_s * 1e3,
            "prefill_overhead_ms": hw.prefill_overhead_s * 1e3,
            "step_fit": self.steps.fit.to_dict() if self.steps.fit is not None else None,
            "link": {"name": self.link.name, "label": self.link.label, "gbytes_per_s": self.link.bw / cm.GB},
            "step_scatter_ms": _scatter_summary(self.step_scatter_s),
        }


def _scatter_summary(scatter_s: tuple[float, ...]) -> dict[str, Any] | None:
    if not scatter_s:
        return None
    ms = [v * 1e3 for v in scatter_s]
    return {"samples": len(ms), **{f"p{q}": round(percentile(ms, q) or 0.0, 3) for q in (10, 50, 90)}}


def default_calibration_path(results_dir: Path, model: str, device_kind: str) -> Path:
    """Where `pdserve bench chunks` leaves its calibration for this model and device kind."""
    return results_dir / f"chunks-{model}-{device_kind}.calibration.json"


def setup_from_calibration(model: str, calibration: Path, kv_dtype: str = "fp8") -> PredictionSetup:
    """A StepModel for `model` on the calibrated device.

    The calibration carries the measured bandwidth, GEMM peak, achieved prefill TFLOP/s and the
    fixed per-step/per-chunk overheads; the base spec below only supplies the field layout. The
    KV link is priced at the calibrated memory bandwidth unless the calibration measured links:
    on one host the transfer is a memory copy.
    """
    cal = cm.Calibration.load(calibration)
    fit = cal.fitted_steps()
    # a step fit prices every step by itself (a probe of a server whose model pdserve does not
    # know has no peak FLOP/s to give); the peak only matters where no fit does the pricing
    if cal.peak_tflops is None and fit is None:
        raise ValueError(f"calibration {calibration} has neither peak_tflops nor a step fit; cannot price prefill")
    base = cm.HardwareSpec(cal.device, (cal.mem_bandwidth_gbps or 1.0) * cm.GB, {}, 0.0, "calibration only")
    hw = cal.apply(base)
    has_peak = cal.peak_tflops is not None
    mfu = cal.effective_mfu(hw, cm.ARTICLE_MFU) if has_peak else cal.mfu or cm.ARTICLE_MFU
    spec = cm.ModelSpec.resolve(model)
    if cal.links_gbps:
        name, gbps = next(iter(cal.links_gbps.items()))
        link = cm.Link(name, f"{name} (measured {gbps:g} GB/s)", gbps * cm.GB)
    else:
        link = cm.Link("host-memory", f"host memory copy at {hw.mem_bw / cm.GB:.1f} GB/s (calibrated)", hw.mem_bw)
    # On a CPU the weights are dequantized and the FLOPs run in the calibration's dtype (fp32).
    steps = StepModel(spec, hw, mfu, weight_dtype=cal.dtype, kv_dtype=kv_dtype, fit=fit)
    return PredictionSetup(
        steps,
        link,
        f"{_shown(calibration)} ({cal.source or cal.device})",
        fitted_steps=fit.samples if fit else None,
        warning=cal.origin_warning(_shown(calibration)),
        torch_threads=cal.torch_threads,
        prompt_speedup=cal.prompt_thread_speedup,
        pace_gflops=cal.pace_gflops,
        largest_batch=cal.largest_batch,
        step_scatter_s=tuple(v / 1e3 for v in cal.step_scatter_ms or ()),
    )


def setup_from_steps(
    model: str,
    decode_fit: StepCostFit,
    prefill_fit: StepCostFit | None,
    link_gbytes_per_s: float | None,
    source: str,
    fitted_steps: int,
    kv_dtype: str = "fp8",
    torch_threads: int | None = None,
    prompt_fit: tuple[StepCostFit, int] | None = None,
) -> PredictionSetup:
    """A StepModel priced by step-cost fits made on the server being predicted (bench compare's
    self-calibration): `decode_fit` for colocated or decode workers, `prefill_fit` for a
    disaggregated prefill pool, `prompt_fit` (fit, threads) for a colocated worker's prompt steps
    that ran on more threads; the KV link at the rate the warm-up's pulls ran."""
    spec = cm.ModelSpec.resolve(model)
    if link_gbytes_per_s:
        link = cm.Link("measured", f"KV pulls of the warm-up ({link_gbytes_per_s:.2f} GB/s)", link_gbytes_per_s * cm.GB)
    else:  # no pull in the warm-up (colocated): nothing crosses a link
        link = cm.Link("none", "no KV pull measured", 10 * cm.GB)
    hw = cm.HardwareSpec("this server (fitted steps)", link.bw, {}, 0.0, source)
    pf, prompt_threads = prompt_fit if prompt_fit else (None, None)
    steps = StepModel(
        spec, hw, weight_dtype="fp32", kv_dtype=kv_dtype, fit=decode_fit, prefill_fit=prefill_fit, prompt_fit=pf
    )
    return PredictionSetup(
        steps, link, source, "self", fitted_steps, torch_threads=torch_threads, prompt_threads=prompt_threads
    )


def _shown(path: Path) -> str:
    """The path relative to the repository when it is inside it (result files travel between machines)."""
    root = Path(__file__).resolve().parents[2]
    try:
        return str(Path(path).resolve().relative_to(root))
    except ValueError:
        return str(path)


def reference_points(
    setup: PredictionSetup, calibration: Path, doc_prompt_len: int, chat_streams: int, chat_ctx: int
) -> dict[str, Any]:
    """The two step times that decide the comparison, as the cost model prices them, beside what
    `bench chunks` measured for the same prompt (its JSON next to the calibration), if it did."""
    r = Request(0, "chat", 0.0, chat_ctx, 1)
    out: dict[str, Any] = {
        "doc_prefill_ms_predicted": setup.steps.prefill(doc_prompt_len) * 1e3,
        "decode_step_ms_predicted": setup.steps.decode([r] * chat_streams) * 1e3,
        "decode_step_context": chat_ctx,
        "decode_step_batch": chat_streams,
    }
    sweep = Path(str(calibration).replace(".calibration.json", ".json"))
    try:
        import json  # noqa: PLC0415

        points = json.loads(sweep.read_text()).get("points", [])
        hit = next((p for p in points if p.get("chunk") == doc_prompt_len), None)
        if hit is not None:
            out["doc_prefill_ms_measured_by_bench_chunks"] = hit["prefill_s"] * 1e3
            out["bench_chunks_result"] = _shown(sweep)
    except (OSError, ValueError):
        pass
    return out


def sim_config(
    mode: str,
    chunk_size: int | None,
    prefill: int,
    decode: int,
    max_num_seqs: int,
    link: cm.Link,
    admit_s: float = 0.0,
    decode_slowdown: float = 1.0,
    kv_transfer: str = "bulk",
    kv_stream_layers: int = 1,
    prefix_policy: bool = False,
    prefill_slowdown: float = 1.0,
    auto_slos_s: tuple[float, float] | None = None,
    batch_wait_s: float = 0.0,
    batch_wait_max_s: float | None = None,
) -> SimConfig:
    """The simulator's view of one pdserve mode ("colocated" whole or chunked, "disagg", or "auto"
    with `chunk_size` its local chunks and `auto_slos_s` the TTFT and ITL SLOs it decides under;
    the KV transfer settings only matter where KV crosses a link; `batch_wait_s`: pdserve's
    engine loop gathers requests from idle until none has come for that long, at most
    `batch_wait_max_s` from the first, engine/config.py BATCH_WAIT_S and BATCH_WAIT_MAX_S)."""
    shared: dict[str, Any] = {
        "max_batch": max_num_seqs, "link": link, "prefix_policy": prefix_policy, "batch_wait_s": batch_wait_s,
        "batch_wait_max_s": batch_wait_max_s,
    }  # fmt: skip
    if mode in ("disagg", "auto"):
        ttft, itl = auto_slos_s if mode == "auto" and auto_slos_s else (None, None)
        return SimConfig(
            mode,
            prefill_workers=prefill,
            decode_workers=decode,
            admit_s=admit_s,
            decode_slowdown=decode_slowdown,
            prefill_slowdown=prefill_slowdown,
            kv_transfer=kv_transfer,
            kv_stream_layers=kv_stream_layers,
            chunk=chunk_size or SimConfig.chunk,
            slo_ttft_s=ttft,
            slo_itl_s=itl,
            **shared,
        )
    if chunk_size:
        return SimConfig("chunked", workers=decode, chunk=chunk_size, **shared)
    return SimConfig("colocated", workers=decode, **shared)


def simulate_requests(cfg: SimConfig, steps: StepModel, specs: list[RequestSpec]) -> list[Request]:
    """Simulate exactly `specs` (no closed loop, no random arrivals): the simulator's requests, in
    order, with their token times (and, disaggregated, their KV transfer and decode admission)."""
    sim = Sim(cfg, steps, Workload(streams=0, chat_rate=0.0, doc_rate=0.0, duration=1.0))
    reqs: list[Request] = []
    for i, s in enumerate(specs):
        r = Request(i, "doc" if s.kind == "document" else "chat", s.arrival_s, s.prompt_len, s.max_tokens)
        r.prefix_key, r.prefix_len = s.prefix_id, s.prefix_len
        sim.requests.append(r)
        sim.at(s.arrival_s, sim.dispatch, r)
        reqs.append(r)
    sim.run()
    return reqs


def simulate_specs(
    cfg: SimConfig, steps: StepModel, specs: list[RequestSpec], hop_s: float = 0.0
) -> list[RequestRecord]:
    """Simulate exactly `specs` and return client-style records; every token reaches the client
    `hop_s` after the worker emits it (the serving path's hops, measured in bench compare's
    warm-up: not simulated)."""
    records = []
    for s, r in zip(specs, simulate_requests(cfg, steps, specs)):
        t = [x + hop_s for x in r.token_times]
        records.append(
            RequestRecord(
                s.request_id,
                s.kind,
                s.prompt_len,
                s.max_tokens,
                s.arrival_s,
                send_s=s.arrival_s,
                chunk_times_s=list(t),
                end_s=t[-1] if t else None,
                prompt_tokens=s.prompt_len,
                completion_tokens=len(t),
                finish_reason="length" if r.done else None,
                error=None if t else "not finished in the simulation",
                worker_queue_ms=(r.prefill_start - s.arrival_s) * 1e3 if r.prefill_start is not None else None,
                worker_prefill_ms=(r.token_times[0] - r.prefill_start) * 1e3
                if t and r.prefill_start is not None
                else None,
            )
        )
    return records


@dataclass
class Prediction:
    label: str
    records: list[RequestRecord]
    metrics: ServeMetrics


def predict(
    label: str,
    cfg: SimConfig,
    setup: PredictionSetup,
    specs: list[RequestSpec],
    slo_ttft_ms: float | None,
    slo_tpot_ms: float | None,
    hop_s: float = 0.0,
) -> Prediction:
    records = simulate_specs(cfg, setup.steps, specs, hop_s)
    metrics = with_scatter(compute_metrics(records, slo_ttft_ms, slo_tpot_ms), records, setup.step_scatter_s)
    return Prediction(label, records, metrics)


def rel_error(predicted: float | None, measured: float | None) -> float | None:
    """(predicted - measured) / measured; None when either is missing or measured is 0."""
    if predicted is None or measured is None or measured == 0:
        return None
    return (predicted - measured) / measured


# (key, label, getter) for every figure that gets a prediction beside it.
COMPARED: list[tuple[str, str, Any]] = [
    ("stall_max_ms", "max stall (ms)", lambda m: m.stall_ms.max),
    ("tokens_lost_mean", "tokens lost / doc", lambda m: m.tokens_lost.mean),
    ("ttft_chat_p50_ms", "TTFT chat p50 (ms)", lambda m: _kind(m, "chat").p50),
    ("ttft_doc_p50_ms", "TTFT doc p50 (ms)", lambda m: _kind(m, "document").p50),
    ("itl_p50_ms", "ITL p50 (ms)", lambda m: m.itl_ms.p50),
    ("itl_p99_ms", "ITL p99 (ms)", lambda m: m.itl_ms.p99),
    ("tpot_p50_ms", "TPOT p50 (ms)", lambda m: m.tpot_ms.p50),
    ("output_tok_s", "output tok/s", lambda m: m.output_throughput),
]


def _kind(m: ServeMetrics, kind: str) -> Any:
    from costmodel.serve_metrics import Dist  # noqa: PLC0415

    return m.ttft_ms_by_kind.get(kind, Dist(0, None, None, None, None, None))


def compare_figures(measured: ServeMetrics, predicted: ServeMetrics) -> dict[str, dict[str, float | None]]:
    """{key: {measured, predicted, error}} for every figure in COMPARED."""
    out = {}
    for key, _, get in COMPARED:
        m, p = get(measured), get(predicted)
        out[key] = {"measured": m, "predicted": p, "error": rel_error(p, m)}
    return out
