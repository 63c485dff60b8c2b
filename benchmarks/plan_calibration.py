"""What `pdserve plan` (benchmarks/plan_verify.py) reads from a `--calibration` beyond a device
model: from `bench compare` results, a device model per deployment kind, the CPU they were measured
on and the steps their servers' warm-ups timed; from a `bench probe` calibration of a pdserve server
on this host, that server's steps (`probe_steps`). And a verified candidate's serving pace against
those steps (`serving_pace`; benchmarks/compare/calibrate/serving_pace.py). A calibration file's
device model is plan_cli's to read."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.client.bench_serve import BenchConfig, run_benchmark
from benchmarks.client.logged_step import LoggedStep, from_table
from benchmarks.client.step_log import StepLogRecorder
from benchmarks.compare.calibrate import transfer
from benchmarks.compare.calibrate.serving_pace import pace_prompt_lengths, pace_ratio
from benchmarks.compare.calibrate.side_requests import SHAPE_DECODE_TOKENS
from cli import CliError
from costmodel.sim.compare_predict import PredictionSetup
from costmodel.workloads import RequestSpec, WorkloadConfig


@dataclass(frozen=True)
class CompareFits:
    """The device models `bench compare` results fitted, by deployment kind (transfer.by_kind), and
    the warm-up steps of the servers they were fitted to (each step once)."""

    by_kind: dict[str, PredictionSetup]
    source_steps: tuple[LoggedStep, ...]


def paths_of(args: argparse.Namespace) -> list[Path]:
    return [Path(p.strip()) for p in (args.calibration or "").split(",") if p.strip()]


def compare_fits(args: argparse.Namespace) -> CompareFits | None:
    """The fits when --calibration names `bench compare` results (their fits to each server they
    ran, benchmarks/compare/calibrate/transfer.py; several, comma-separated, pool what each
    measured: one run of 1-worker servers and one of `--decode 2`), else None (a calibration file)."""
    paths = paths_of(args)
    if not paths or (len(paths) == 1 and not transfer.is_compare_result(paths[0])):
        return None
    if args.gpu:
        raise CliError("give one device model: --calibration FILE or --gpu NAME")
    found: dict[str, transfer.Transferred] = {}
    for path in paths:
        if not transfer.is_compare_result(path):
            raise CliError(f"--calibration {path}: several calibrations must each be a `bench compare` result")
        try:
            each, _ = transfer.load(path, args.model)
        except ValueError as e:
            raise CliError(str(e).replace("--transfer-from", "--calibration")) from None
        if not each:
            raise CliError(f"--calibration {path}: no mode of that run has a fit to price from")
        found.update({f"{path}:{label}": t for label, t in each.items()})
    # modes that share one engine's fit (pooled) carry the same steps: each once
    steps = {(s.worker, s.end_unix_s, s.seconds): s for t in found.values() for s in t.source_steps}
    return CompareFits(transfer.by_kind(found), tuple(steps.values()))


def probe_steps(args: argparse.Namespace) -> tuple[LoggedStep, ...]:
    """The probed server's own steps when --calibration is a `bench probe` calibration of a pdserve
    server on this host (the probe's result beside it, `NAME.json` by `NAME.calibration.json`, keeps
    them as `server_steps`); () for any other calibration, or a probe result without them."""
    paths = paths_of(args)
    if len(paths) != 1 or not paths[0].name.endswith(".calibration.json"):
        return ()
    result = paths[0].with_name(paths[0].name.removesuffix(".calibration.json") + ".json")
    try:
        return tuple(from_table(json.loads(result.read_text()).get("server_steps")))
    except (OSError, ValueError, AttributeError, TypeError):
        return ()  # no probe result beside it: the GEMM pace then


def calibrated_elsewhere(args: argparse.Namespace) -> str | None:
    """One line when a `bench compare` result given to --calibration was measured on another CPU
    than this machine's: its prices are that machine's, and so is every prediction made from them
    (machines of one cloud kind differ: on 2026-12-05 the dev VM came back an AMD EPYC whose steps
    ran 0.53-0.57x the prices fitted on the Intel Xeon it was before)."""
    from costmodel.machine import cpu_model  # noqa: PLC0415

    here = cpu_model()
    other = sorted({cpu for p in paths_of(args) if (cpu := transfer.measured_on(p)) and cpu != here})
    if not other:
        return None
    return (
        f"the calibration was measured on {', '.join(repr(c) for c in other)}, this machine is {here!r}: "
        "every figure predicts that machine (calibrate here: bench compare)"
    )


def serving_pace(
    bench: BenchConfig,
    url: str,
    api_key: str | None,
    source: Sequence[LoggedStep],
    seed: int,
    log: Callable[[str], None] = lambda _: None,
) -> tuple[float, int] | None:
    """This server's pace against the calibration's servers: fresh prompts of the lengths they computed
    whole and alone (serving_pace.pace_prompt_lengths), one at a time, each decoding alone after it; the
    median ratio of this server's lone steps to theirs of the same shape and threads (None: too few
    matched, or a server that logs no steps). A verified candidate's steps ran 1.08-1.18x their price in
    the minutes it ran (docs/plan.md), which the GEMM probe before it did not see."""
    rng = random.Random(seed)
    lengths = pace_prompt_lengths(source)
    if not lengths:
        return None
    log(f"  serving pace: {len(lengths)} lone prompts of the calibration's lengths ({lengths[0]}-{lengths[-1]} tokens)")
    with StepLogRecorder(url, api_key) as recorder:
        for i, n in enumerate(lengths):
            ids = tuple(rng.randrange(WorkloadConfig.token_id_low, WorkloadConfig.token_id_high) for _ in range(n))
            one = RequestSpec(f"pace-{i}", ids, n, SHAPE_DECODE_TOKENS, 0.0, "chat")
            asyncio.run(run_benchmark(bench, [one]))
    found = pace_ratio(source, list(recorder.steps), by_role=False, decode=True)
    log(f"  steps {found[0]:.2f}x the calibration's ({found[1]} matched)" if found else "  too few steps matched")
    return found
