"""What `pdserve plan` (benchmarks/plan_verify.py) reads from a `--calibration` beyond a device
model: from `bench compare` results, a device model per deployment kind and the CPU they were
measured on. And the steps a verified candidate's server runs before its timed pass, which read its
serving pace (`serving_pace`; benchmarks/verify_steps.py `step_pace`). A calibration file's device
model is plan_cli's to read."""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from benchmarks.client.bench_serve import BenchConfig
from benchmarks.client.logged_step import LoggedStep
from benchmarks.client.serve_client import ClientConfig, StreamRecord, discover_model, make_client, send_one
from benchmarks.client.step_log import StepLogRecorder
from benchmarks.compare.calibrate import transfer
from benchmarks.compare.calibrate.side_requests import SHAPE_DECODE_TOKENS
from cli import CliError
from costmodel.plan.pricing import computed_parts
from costmodel.plan.score import Scored, decoding_batch
from costmodel.sim.compare_predict import PredictionSetup
from costmodel.workloads import RequestSpec, WorkloadConfig


def paths_of(args: argparse.Namespace) -> list[Path]:
    return [Path(p.strip()) for p in (args.calibration or "").split(",") if p.strip()]


def compare_fits(args: argparse.Namespace) -> dict[str, PredictionSetup] | None:
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
    return transfer.by_kind(found)


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


# the lengths of the prompts sent beside the burst: these quantiles of the prompt tokens the workload's requests compute
PACE_QUANTILES = (0.1, 0.3, 0.5, 0.7, 0.9)
PACE_BURST_MAX = 16  # streams per worker in the burst that reads batched decode steps
PACE_BURST_TOKENS = 32  # tokens each of the burst's streams decodes after the prompts beside it
PACE_TURN_STEPS = 4  # steps the burst may decode between one prompt beside it and the next (the client's turn)


def pace_burst(s: Scored) -> int:
    """The burst's streams: as many a worker as the plan has it decode at once on average while it
    decodes (at least 2, up to PACE_BURST_MAX), on each of its decode-side workers. Not its peak:
    decode steps of long contexts cost more against their price at larger batches (rag, colocated:
    1.07-1.14x at 1-3 streams, 1.25-1.35x at 4-7, `plan-verify-rag-zi`), and a burst at the peak
    priced every step as the largest."""
    mean = decoding_batch(s.records)[1] / max(1, s.candidate.decode)
    return max(2, min(round(mean), PACE_BURST_MAX)) * s.candidate.decode


def pace_lengths(specs: Sequence[RequestSpec]) -> list[int]:
    """The lengths of the prompts sent beside the burst: quantiles of what the workload's requests
    compute (a shared prefix once), each at least one token; one prompt a quantile, a length that is
    several quantiles sent as often (the article's are chats' and documents' alone: deduplicated,
    a colocated server computed two prompts beside the burst, too few to read)."""
    parts = sorted(computed_parts(specs))
    return sorted(max(1, parts[min(len(parts) - 1, int(q * len(parts)))]) for q in PACE_QUANTILES)


def serving_pace(
    bench: BenchConfig,
    url: str,
    api_key: str | None,
    specs: Sequence[RequestSpec],
    streams: int,
    seed: int,
    log: Callable[[str], None] = lambda _: None,
    chunk: int | None = None,
) -> list[LoggedStep]:
    """The steps a candidate's server runs, after its warm-up and before its timed pass, for requests
    that are not the workload's but have its shapes: `streams` fresh prompts of its mean length at
    once, decoding together; once each has its first token, fresh prompts of the lengths its requests
    compute (`pace_lengths`), one at a time, each computed beside that decoding batch as the
    workload's prompts are beside its own (`chunk`: the candidate's, for how many steps a prompt
    takes). Their cost against the plan's prices (benchmarks/verify_steps.py `step_pace`) re-prices
    the prediction: a verified candidate's steps ran 0.84-1.18x their price in the minutes it ran
    (docs/plan.md), and lone prompts read apart from the same lengths beside a decoding batch (1.16-1.39x
    against 1.03-1.09x on one chat, 2026-12-06). Empty from a server that logs no steps."""
    rng = random.Random(seed)
    draw = lambda n: tuple(rng.randrange(WorkloadConfig.token_id_low, WorkloadConfig.token_id_high) for _ in range(n))  # noqa: E731
    lengths = pace_lengths(specs)
    mean = max(1, round(sum(s.prompt_len for s in specs) / len(specs)))
    tokens = burst_tokens(lengths, chunk)
    burst = [RequestSpec(f"pace-b{i}", draw(mean), mean, tokens, 0.0, "chat") for i in range(streams)]
    beside = [RequestSpec(f"pace-{i}", draw(n), n, SHAPE_DECODE_TOKENS, 0.0, "chat") for i, n in enumerate(lengths)]
    log(
        f"  serving pace: {streams} prompts of {mean} tokens decoding {tokens} together; beside them, one at "
        f"a time, prompts of {', '.join(map(str, lengths))} tokens"
    )
    with StepLogRecorder(url, api_key) as recorder:
        decoding_since = asyncio.run(_beside_a_burst(bench.client, burst, beside))
    # from the burst decoding on: its own prompts, computed together (a colocated server's one step of
    # 2,739 tokens, 0.80x its price, outweighed the four prompts beside it at 1.02-1.10x), are not the
    # workload's
    return [s for s in recorder.steps if s.end_unix_s > decoding_since]


def burst_tokens(lengths: Sequence[int], chunk: int | None) -> int:
    """Tokens a burst stream decodes: PACE_BURST_TOKENS, and a step for each step the prompts beside it
    take (a prompt's chunks, its SHAPE_DECODE_TOKENS, a turn between two requests) so that the burst is
    still decoding when the last is computed."""
    each = [-(-n // chunk) if chunk else 1 for n in lengths]
    return PACE_BURST_TOKENS + sum(k + SHAPE_DECODE_TOKENS + PACE_TURN_STEPS for k in each)


async def _beside_a_burst(cfg: ClientConfig, burst: list[RequestSpec], beside: list[RequestSpec]) -> float:
    """Send `burst` at once and, once each stream has its first token, `beside` one at a time; the
    wall-clock time (s since the epoch) the burst was seen decoding."""
    client = make_client(cfg)
    try:
        model = cfg.model or await discover_model(client)
        t0 = time.perf_counter()
        records = [StreamRecord(s.request_id, s.kind, s.prompt_len, s.max_tokens, 0.0) for s in [*burst, *beside]]
        tasks = [asyncio.create_task(send_one(client, model, s, i, cfg, records[i], t0)) for i, s in enumerate(burst)]
        while not all(t.done() for t in tasks) and not all(r.chunk_times_s for r in records[: len(burst)]):
            await asyncio.sleep(0.005)
        decoding_since = time.time()
        for i, s in enumerate(beside, start=len(burst)):
            await send_one(client, model, s, i, cfg, records[i], t0)
        await asyncio.gather(*tasks)
        return decoding_since
    finally:
        await client.close()
