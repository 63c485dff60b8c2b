"""The simulator's prediction beside each of `bench compare`'s measurements, and which device
model it ran on.

Each pdserve mode has up to two candidate device models:
- **self**: step-cost fits to the steps that very server ran in its warm-up, in this run
  (`benchmarks/compare/calibrate/calibration.py`);
- **file**: a calibration file (`--calibration FILE`, else `pdserve bench chunks`' file for this
  model and device), possibly made on another machine or at another commit.

`--calibration FILE` wins when given. Otherwise both candidates predict the mode's warm-up (the
same schedule and shapes as the timed run, other text) and the one whose prediction lands nearer
the warm-up's measurement predicts the timed run; the report says which, on how many steps, and
both scores. The timed run itself never chooses: its prediction stays out of sample.

The SLOs goodput is counted under come from the calibration too unless given
(`derive_slos`): a fixed 50 ms TPOT is out of reach on a 2-core CPU and in reach of every mode on
a GPU, and in neither case tells the modes apart.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import Any

from benchmarks.compare.args import EndpointSpec, ModeSpec
from benchmarks.compare.calibrate.calibration import prediction_setup as self_setup
from benchmarks.compare.record import ModeRun
from costmodel.serve_metrics import compute_metrics
from costmodel.sim import compare_predict as cp
from costmodel.sim.compare_predict import PredictionSetup
from costmodel.sim.engine import Request
from costmodel.workloads import RequestSpec, WorkloadConfig
from engine.config import BATCH_WAIT_MAX_S, BATCH_WAIT_S

# The figures a candidate is scored on (compare_predict.COMPARED keys): the ones the report leads with.
SCORED = ("stall_max_ms", "ttft_chat_p50_ms", "ttft_doc_p50_ms", "itl_p50_ms")
# Default SLOs, as multiples of what the chosen calibration predicts (see derive_slos).
TPOT_SLO_FACTOR = 1.5
TTFT_SLO_FACTOR = 2.0


def served_prompt_lengths(specs: list[RequestSpec], records: list[Any] | None) -> list[RequestSpec]:
    """The workload as the server saw it: each prompt's length in the model's own tokens
    (usage.prompt_tokens). A real tokenizer turns a 1024-word document into ~600 tokens; the
    simulator must price those, not the workload's nominal length."""
    served = {x.request_id: x.prompt_tokens for x in records or [] if x.prompt_tokens}
    return [replace(s, prompt_len=served.get(s.request_id, s.prompt_len)) for s in specs]


def sim_config_of(
    spec: ModeSpec, max_num_seqs: int, setup: PredictionSetup, kv_transfer: str = "bulk", kv_stream_layers: int = 1
) -> Any:
    """The simulator's view of `spec`; `kv_transfer`, `kv_stream_layers`: the server's own flags,
    so a layer-wise server is predicted with its KV crossing while the prefill runs."""
    return cp.sim_config(
        spec.mode, spec.chunk_size, spec.prefill, spec.decode, max_num_seqs, setup.link, setup.admit_s,
        setup.decode_slowdown, kv_transfer, kv_stream_layers, prefill_slowdown=setup.prefill_slowdown,
        # the engine loop's defaults, which bench compare's servers run
        batch_wait_s=BATCH_WAIT_S, batch_wait_max_s=BATCH_WAIT_MAX_S,
    )  # fmt: skip


def warmup_specs(run: ModeRun, specs: list[RequestSpec]) -> list[RequestSpec]:
    """The mode's warm-up as the server saw it (its schedule and shapes are the timed run's)."""
    assert run.warmup is not None
    warm_ids = {r.request_id for r in run.warmup.records}
    return served_prompt_lengths([s for s in specs if s.request_id in warm_ids], run.warmup.records)


def with_admission(
    setup: PredictionSetup,
    run: ModeRun,
    specs: list[RequestSpec],
    max_num_seqs: int,
    kv_transfer: str = "bulk",
    kv_stream_layers: int = 1,
) -> PredictionSetup:
    """Disagg: `setup` with the decode admission delay the simulator lacks, fitted on the warm-up:
    the median measured decode wait (prefill end to decode join, less the pull) minus the median
    the simulator gives the same requests without it (its wait for a step boundary). On 2 CPU
    cores this was 100-400 ms a request (router and Ray hops, the decode worker's inbox, the
    prefill process competing for the cores): a chat's first-to-second-token gap."""
    if not isinstance(run.spec, ModeSpec) or run.spec.mode != "disagg" or run.warmup is None:
        return setup
    measured = [r.decode_wait_ms for r in run.warmup.records if r.ok and r.decode_wait_ms is not None]
    if not measured:
        return setup
    sc = sim_config_of(run.spec, max_num_seqs, replace(setup, admit_s=0.0), kv_transfer, kv_stream_layers)
    sim = cp.simulate_requests(sc, setup.steps, warmup_specs(run, specs))
    # as the server's timeline counts it: a streamed pull's exposed part, a bulk pull's whole time
    waits = [w for r in sim if (w := r.decode_wait_s) is not None]
    sim_ms = statistics.median(waits) * 1e3 if waits else 0.0
    return replace(setup, admit_s=max(0.0, statistics.median(measured) - sim_ms) / 1e3)


def hop_s(run: ModeRun) -> float:
    return ((run.serving_overhead or {}).get("hop_ms") or 0.0) / 1e3


def warmup_errors(
    setup: PredictionSetup,
    run: ModeRun,
    specs: list[RequestSpec],
    max_num_seqs: int,
    kv_transfer: str = "bulk",
    kv_stream_layers: int = 1,
) -> dict[str, float | None]:
    """`setup`'s relative error on each SCORED figure of the mode's warm-up."""
    if run.warmup is None:
        return {}
    assert isinstance(run.spec, ModeSpec)  # only pdserve's own modes are calibrated (choose() asserts it)
    warm_specs = warmup_specs(run, specs)
    sc = sim_config_of(run.spec, max_num_seqs, setup, kv_transfer, kv_stream_layers)
    p = cp.predict("warm-up", sc, setup, warm_specs, None, None, hop_s(run))
    figs = cp.compare_figures(run.warmup.metrics, p.metrics)
    return {k: figs[k]["error"] for k in SCORED}


def score(errors: dict[str, float | None]) -> float | None:
    """Mean |relative error| over the figures both sides have."""
    errs = [abs(e) for e in errors.values() if e is not None]
    return statistics.fmean(errs) if errs else None


@dataclass
class Choice:
    setup: PredictionSetup | None
    basis: dict[str, Any]


def choose(
    model: str,
    run: ModeRun,
    file_setup: PredictionSetup | None,
    file_error: str | None,
    file_given: bool,
    specs: list[RequestSpec],
    max_num_seqs: int,
    kv_transfer: str = "bulk",
    kv_stream_layers: int = 1,
) -> Choice:
    """The device model that predicts this mode, and the record of why (the report's basis);
    `kv_transfer`, `kv_stream_layers`: the server's, for the warm-up predictions that choose it."""
    assert isinstance(run.spec, ModeSpec)
    own, own_error = self_setup(model, run.spec.mode, run.self_calibration)
    basis: dict[str, Any] = {"self_error": own_error, "file_error": file_error}
    if file_given and file_setup is not None:
        return Choice(file_setup, basis | {"used": "file", "why": "--calibration given", **_about(file_setup)})
    found = (("self", own), ("file", file_setup), ("probe", _probe_setup(model, run, basis)))
    kv = (kv_transfer, kv_stream_layers)
    candidates = {k: with_admission(s, run, specs, max_num_seqs, *kv) for k, s in found if s is not None}
    if not candidates:
        return Choice(None, basis | {"used": None, "why": "no calibration could be fitted or found"})
    errors = {k: warmup_errors(s, run, specs, max_num_seqs, *kv) for k, s in candidates.items()}
    scores = {k: score(e) for k, e in errors.items()}
    basis["warmup_scores"], basis["warmup_errors"] = scores, errors
    ranked = sorted(candidates, key=lambda k: (scores[k] is None, scores[k] or 0.0, k != "self"))
    used = ranked[0]
    shown = ", ".join(f"{k} {scores[k]:.0%}" for k in ranked if scores[k] is not None)
    why = (
        "the only candidate"
        if len(candidates) == 1
        else f"predicted the warm-up best (mean |error|: {shown})"
        if scores[used] is not None and scores[ranked[1]] is not None
        else "the warm-up scored only this one"
    )
    return Choice(candidates[used], basis | {"used": used, "why": why, **_about(candidates[used])})


def _probe_setup(model: str, run: ModeRun, basis: dict[str, Any]) -> PredictionSetup | None:
    """The quick probe's calibration of this server (--probe-calibration), priced in the mode
    pdserve knows it ran (the probe's own inference is not needed here)."""
    if not run.probe_calibration:
        return None
    from pathlib import Path  # noqa: PLC0415

    try:
        setup = cp.setup_from_calibration(model, Path(run.probe_calibration))
    except (ValueError, KeyError, OSError) as e:
        basis["probe_error"] = f"{run.probe_calibration}: {e}"
        return None
    return replace(setup, kind="probe", source=f"bench probe --quick of this server ({run.probe_calibration})")


def _about(setup: PredictionSetup) -> dict[str, Any]:
    return {
        "source": setup.source,
        "fitted_steps": setup.fitted_steps,
        "warning": setup.warning,
        "decode_admission_ms": setup.admit_s * 1e3,
        "decode_slowdown_beside_prefill": setup.decode_slowdown,
        "prefill_slowdown_beside_decode": setup.prefill_slowdown,
    }


def describe_basis(basis: dict[str, Any] | None) -> str:
    """One line for the table and the report: which calibration predicted a mode, on how many steps."""
    if not basis or not basis.get("used"):
        return "no prediction: " + ((basis or {}).get("self_error") or (basis or {}).get("file_error") or "-")
    steps = f", {basis['fitted_steps']} steps" if basis.get("fitted_steps") else ""
    admit = f", decode admission {basis['decode_admission_ms']:.0f} ms" if basis.get("decode_admission_ms") else ""
    if (basis.get("decode_slowdown_beside_prefill") or 1.0) > 1.0:
        admit += f", decode {basis['decode_slowdown_beside_prefill']:.2f}x beside a prefill"
    if (basis.get("prefill_slowdown_beside_decode") or 1.0) > 1.0:
        admit += f", prefill {basis['prefill_slowdown_beside_decode']:.2f}x beside decoding"
    return f"{basis['used']}{steps}{admit}: {basis['why']}"


def derive_slos(setup: PredictionSetup, wl: WorkloadConfig, hop_ms: float) -> tuple[float, float, str]:
    """(TTFT SLO, TPOT SLO, how) from a calibration: a token every TPOT_SLO_FACTOR x the predicted
    decode step of the workload's chats (their batch, their mid-answer context), and a first
    token within TTFT_SLO_FACTOR x a document's predicted prefill alone, plus the serving hop.
    So goodput counts the requests a mode served close to what the hardware allows: a chat frozen
    behind a document prefill misses TPOT, a document queued behind another misses TTFT."""
    ctx = wl.chat_prompt_len + wl.chat_output_len // 2
    batch = [Request(i, "chat", 0.0, ctx, wl.chat_output_len) for i in range(max(1, wl.chat_streams))]
    step_ms = setup.steps.step(batch, []) * 1e3
    prefill_ms = setup.steps.prefill(wl.doc_prompt_len) * 1e3
    tpot = TPOT_SLO_FACTOR * step_ms
    ttft = TTFT_SLO_FACTOR * prefill_ms + hop_ms
    how = (
        f"derived: TPOT {TPOT_SLO_FACTOR:g} x the predicted {len(batch)}-stream decode step ({step_ms:.0f} ms), "
        f"TTFT {TTFT_SLO_FACTOR:g} x a {wl.doc_prompt_len}-token prefill alone ({prefill_ms:.0f} ms) "
        f"+ the serving hop ({hop_ms:.0f} ms)"
    )
    return ttft, tpot, how


def apply_slos(runs: list[ModeRun], slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> None:
    """Recount every measured run's goodput under the SLOs the report uses."""
    for r in runs:
        if r.bench is not None:
            metrics = compute_metrics(r.bench.records, slo_ttft_ms, slo_tpot_ms)
            config = replace(r.bench.config, slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms)
            r.bench = replace(r.bench, metrics=metrics, config=config)


def is_endpoint(run: ModeRun) -> bool:
    return isinstance(run.spec, EndpointSpec)
