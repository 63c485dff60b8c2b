"""Driving servers pdserve did not start (`pdserve bench compare --endpoint NAME=URL[,model=M]`).

An endpoint gets what each of pdserve's own modes gets, through the same client
(`benchmarks/bench_serve.run_benchmark`), so its row of the table is measured the same way: the
warm-up (the schedule with the next seed's text), the timed run (the process's objects frozen),
then the equality pass. What differs is what an outside server can give:
- no step log or timeline, so no serving overhead per token, no KV transfers, no worker figures;
- token ids only if it is pdserve (`pdserve.timeline.token_ids`); otherwise the greedy text is
  compared with the reference mode's. Either way the verdict is informational: another model,
  tokenizer or precision legitimately answers differently, so it never fails the run;
- a prediction only from a calibration the user measured on it (`pdserve bench probe`, passed as
  `--endpoint-calibration NAME=FILE`). The serving mode the simulator runs is the probe's
  inferred one (its result JSON beside the calibration), since a calibration prices steps but
  does not say how the server schedules them.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.client.bench_serve import BenchConfig, run_benchmark
from benchmarks.client.gc_pauses import QuietGC
from benchmarks.compare.args import EndpointSpec
from benchmarks.compare.equality import equality_pass
from benchmarks.compare.modes import load_average, log, serving_overhead, warmup_specs
from benchmarks.compare.record import ModeRun
from costmodel.workloads import RequestSpec

# (mode, chunk size, prefill workers, decode workers) as `compare_predict.sim_config` takes them
SimMode = tuple[str, int | None, int, int]


def run_endpoint(ep: EndpointSpec, bench: BenchConfig, specs: list[RequestSpec]) -> ModeRun:
    """The warm-up, the timed run and the equality pass against `ep`. Raises with one line when the
    server cannot serve the workload at all (unreachable, no model, every request refused)."""
    client = replace(bench.client, base_url=ep.url, model=ep.model)
    log(f"  warm-up at {ep.url} (the schedule again, other text)")
    warmup = asyncio.run(run_benchmark(replace(bench, client=client), warmup_specs(bench, specs)))
    if not any(r.ok for r in warmup.records):
        first = next((r.error for r in warmup.records if r.error), "no output")
        raise RuntimeError(f"{ep.url}: every warm-up request failed (first: {first})")
    client = replace(client, model=warmup.model)  # what /v1/models named, when model= was not given
    log("  timed run (arrivals on schedule, streamed)")
    with QuietGC() as quiet:
        result = asyncio.run(run_benchmark(replace(bench, client=client), specs))
    log(f"  equality pass ({len(specs)} requests at once)")
    info: dict[str, Any] = {"url": ep.url, "model": warmup.model, "calibration": ep.calibration}
    try:
        greedy = asyncio.run(equality_pass(ep.url, warmup.model, specs, bench.client.api_key, logprobs=None))
        ids, texts = greedy.token_ids, greedy.texts
    except Exception as e:  # noqa: BLE001 - an outside server may refuse the pass; the row still stands
        ids, texts = {}, None
        info["equality_pass_error"] = f"{type(e).__name__}: {e}"
    return ModeRun(
        ep,
        {"base_url": ep.url, "model": warmup.model},
        None,
        ids if any(ids.values()) else {},
        [],
        result,
        load_average=load_average(),
        serving_overhead=serving_overhead(warmup.records, []),  # no worker timings: no hop
        gc=quiet.summary(),
        greedy_texts=texts,
        endpoint=info,
    )


def prediction_setup(ep: EndpointSpec, served_model: str, fallback_model: str) -> tuple[Any, SimMode | None, dict]:
    """(the simulator's device model or None, the mode to simulate, what the row's JSON says about
    it). The model's shapes (only the KV bytes of a disaggregated pull depend on them once steps
    are fitted) come from the served model when pdserve knows it, else from --model."""
    from costmodel.sim import compare_predict as cp  # noqa: PLC0415

    if not ep.calibration:
        return None, None, {"error": f"no calibration: run `pdserve bench probe --base-url {ep.url}` first"}
    setup, errors = None, []
    for model in dict.fromkeys((served_model, fallback_model)):
        try:
            setup = cp.setup_from_calibration(model, Path(ep.calibration))
            break
        except (ValueError, KeyError, OSError) as e:
            errors.append(f"{model}: {e}")
    if setup is None:
        return None, None, {"error": f"calibration {ep.calibration} unusable: " + "; ".join(errors)}
    sim, basis = simulated_mode(Path(ep.calibration))
    if sim is None:  # the probe could not tell how the server schedules: no mode to simulate
        return setup, None, {"setup": setup.describe(), "error": basis}
    info = {"setup": setup.describe(), "simulated_as": sim[0], "chunk_size": sim[1], "basis": basis}
    if model != served_model:
        info["model_shapes"] = f"{model} (pdserve does not know {served_model})"
    return setup, sim, info


def simulated_mode(calibration: Path) -> tuple[SimMode | None, str]:
    """The serving mode the probe inferred for the server: from the calibration if it says, else
    from the probe's result JSON beside it (`probe-X.calibration.json` -> `probe-X.json`), else
    whole prompts colocated. None where the probe's verdict was "unknown"."""
    found, source = None, None
    for path in (calibration, Path(str(calibration).replace(".calibration.json", ".json"))):
        try:
            found = json.loads(path.read_text()).get("chunking")
        except (OSError, ValueError, AttributeError):
            continue
        if found:
            source = path
            break
    if not found:
        return ("colocated", None, 1, 1), "colocated, whole prompts: no inferred chunking beside the calibration"
    verdict, chunk = found.get("verdict"), found.get("chunk_tokens")
    said = f"the probe inferred '{verdict}' ({source})"
    if verdict == "chunked" and chunk:
        return ("colocated", max(1, round(chunk)), 1, 1), f"chunked at {round(chunk)} tokens: {said}"
    if verdict in ("disaggregated", "no interference"):
        return ("disagg", None, 1, 1), f"disaggregated 1P1D: {said}"
    if verdict == "unknown":  # its evidence fell between the bands: any mode would be a guess
        return None, f"no prediction: {said}, so no serving mode to simulate"
    return ("colocated", None, 1, 1), f"colocated, whole prompts: {said}"
