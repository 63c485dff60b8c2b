"""The colocated-kind servers of one `bench compare` run share one step fit when they are priced for
another workload (benchmarks/compare/calibrate/pooled.py): one engine on the same threads."""

from __future__ import annotations

import json
import random

import pytest

from benchmarks.client.logged_step import LoggedStep
from benchmarks.compare.calibrate import transfer
from benchmarks.compare.calibrate.calibration import build as build_self_calibration
from benchmarks.compare.calibrate.calibration import trimmed_fit
from benchmarks.compare.calibrate.pooled import Server, pooled
from costmodel.fit.step_fit import StepCostFit, StepShape

TRUE = StepCostFit(0.014, 0.001, 1e-9, 0.0004, decode_attention_s=5e-6, per_prompt_s=0.007)


def _colocated(rng: random.Random, pace: float) -> list[LoggedStep]:
    """A colocated server's warm-up: decode steps, short prompts beside them on the decode thread
    (some past a cached prefix), and long whole prompts on two threads (their tokens at half price)."""
    out = []
    for i in range(60):
        ctxs = [rng.randint(64, 400) for _ in range(rng.randint(1, 12))]
        chunks = [(rng.choice((0, 128, 192)), rng.choice((32, 64, 128, 200)))] if i % 4 == 0 else []
        shape = StepShape.of(ctxs, chunks)
        secs = TRUE.seconds(shape) * pace * rng.uniform(0.98, 1.02)
        out.append(LoggedStep("c-0", "colocated", shape, secs, 100.0 + i, torch_threads=1))
    for n in (300, 700, 1200):
        shape = StepShape.of([], [(0, n)])
        secs = (TRUE.seconds(shape) - TRUE.per_token_s * n / 2) * pace
        out.append(LoggedStep("c-0", "colocated", shape, secs, 200.0 + n, torch_threads=2))
    return out


def _chunked(rng: random.Random, pace: float, name: str = "k-0") -> list[LoggedStep]:
    """A chunk-256 server's warm-up: decode steps and whole chunks of one to three prompts."""
    out = []
    for i in range(60):
        ctxs = [rng.randint(64, 400) for _ in range(rng.randint(1, 12))]
        k = rng.randint(1, 3)
        chunks = [(256 * j, 256 // k) for j in range(k)] if i % 3 == 0 else []
        shape = StepShape.of(ctxs, chunks)
        secs = TRUE.seconds(shape) * pace * rng.uniform(0.98, 1.02)
        out.append(LoggedStep(name, "colocated", shape, secs, 300.0 + i, torch_threads=1))
    return out


def test_servers_of_one_engine_share_one_fit_and_keep_their_own_prompt_threads():
    rng = random.Random(7)
    col, chk = _colocated(rng, 0.96), _chunked(rng, 1.04)
    chk_x2 = _chunked(rng, 1.3, "k2-0")
    servers = {
        "colocated": Server("colocated", build_self_calibration(col, [], [], 1), 1),
        "chunked-256": Server("chunked-256", build_self_calibration(chk, [], [], 1), 1),
        "chunked-256 x2": Server("chunked-256 x2", build_self_calibration(chk_x2, [], [], 1), 2),
        "bare": Server("bare", build_self_calibration([], [], [], 1), 1),
    }
    got = pooled(servers)
    assert set(got) == {"colocated", "chunked-256"}  # two workers contend: not the same machine; no steps: out
    (c, with_c), (k, with_k) = got["colocated"], got["chunked-256"]
    assert with_c == with_k == ["colocated", "chunked-256"]
    base = [s for s in col if s.torch_threads == 1] + chk
    joint, _ = trimmed_fit([(s.shape, s.seconds) for s in base])
    assert c.pools["colocated"].fit == k.pools["colocated"].fit == joint
    assert c.pools["colocated"].steps + c.pools["colocated"].trimmed == len(base)
    # each server's pace was a sample of the machine's: the shared fit sits between them
    decode = StepShape.of([200] * 8)
    assert 0.96 * TRUE.seconds(decode) < joint.seconds(decode) < 1.04 * TRUE.seconds(decode)
    # the colocated server's two-thread prompts are priced beside the shared fit, not folded into it
    long = StepShape.of([], [(0, 1000)])
    prompt_fit = c.pools["colocated"].prompt_fit
    assert prompt_fit is not None and prompt_fit.seconds(long) < 0.8 * joint.seconds(long)
    assert k.pools["colocated"].prompt_fit is None


def test_transfer_prices_a_run_s_colocated_and_chunked_servers_with_their_shared_fit(tmp_path):
    rng = random.Random(8)

    def mode(label: str, steps: list[LoggedStep], chunk: int | None, pace: float) -> dict:
        cal = build_self_calibration(steps, [], [], 1000)
        return {
            "label": label,
            "spec": {"mode": "colocated", "chunk_size": chunk},
            "self_calibration": json.loads(json.dumps(cal.to_dict())),
            "serving_overhead": {"hop_ms": 10.0},
            "machine_pace": {"gemm_gflops_1thread": pace},
        }

    doc = {
        "provenance": {"config": {"bench_command": "compare", "model": "tiny"}},
        "modes": [
            mode("colocated", _colocated(rng, 1.0), None, 100.0),
            mode("chunked-256", _chunked(rng, 1.0), 256, 110.0),
        ],
    }
    path = tmp_path / "compare-pooled.json"
    path.write_text(json.dumps(doc))
    found, missing = transfer.load(path, "tiny")
    assert not missing
    c, k = found["colocated"].setup, found["chunked-256"].setup
    assert c.steps.fit == k.steps.fit
    # one fit of both servers' 120 one-thread steps; the colocated one adds its 3 prompt steps
    assert "120 steps of the warm-ups of colocated and chunked-256" in k.source
    assert "warm-ups of colocated and chunked-256" in c.source
    assert c.pace_gflops == k.pace_gflops == pytest.approx(105.0)  # the pooled servers' mean pace
    assert found["chunked-256"].kind == "chunked" and found["chunked-256"].chunk == 256
