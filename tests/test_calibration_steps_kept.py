"""A `bench compare` calibration keeps the warm-up steps its fits were made from
(benchmarks/client/logged_step.py), and a later step model refits them on load."""

from __future__ import annotations

import json
import random

import pytest

from benchmarks.client.logged_step import LoggedStep
from benchmarks.compare.calibrate.calibration import PoolFit, SelfCalibration
from benchmarks.compare.calibrate.calibration import build as build_self_calibration
from costmodel.fit.step_fit import StepCostFit, StepShape

TRUE = StepCostFit(fixed_s=0.030, per_token_s=0.0004, attention_s=2e-9, per_sequence_s=0.004)


def _steps(n: int, rng: random.Random) -> list[StepShape]:
    """Decode steps of 1-8 streams, some with a prompt chunk at one of several starts."""
    out = []
    for _ in range(n):
        ctxs = [rng.randint(64, 600) for _ in range(rng.randint(1, 8))]
        chunks = [(rng.choice((0, 128, 256)), rng.choice((64, 128, 512)))] if rng.random() < 0.3 else []
        out.append(StepShape.of(ctxs, chunks))
    return out


def test_a_calibration_keeps_its_warm_up_steps_and_is_refitted_from_them():
    """A result keeps the steps its fit was made from, so a later step model refits them (transfer.load)
    instead of trusting a fit an earlier version made; rows written before the prompt items were
    logged are read as one item per prompt step."""
    rng = random.Random(4)
    truth = StepCostFit(0.030, 0.0004, 2e-9, 0.004, per_prompt_s=0.012)
    steps = []
    for i, s in enumerate(_steps(120, rng)):
        steps.append(LoggedStep("colocated-0", "colocated", s, truth.seconds(s) * rng.uniform(0.98, 1.02), 100.0 + i))
    cal = build_self_calibration(steps, [], [], 1)
    back = SelfCalibration.from_dict(json.loads(json.dumps(cal.to_dict())))
    assert [s.shape for s in back.logged] == [s.shape for s in steps]
    assert [s.seconds for s in back.logged] == pytest.approx([s.seconds for s in steps], abs=1e-7)  # kept to 0.1 us
    stale = SelfCalibration({"colocated": PoolFit("colocated", TRUE, 120, 0)}, None, 0, None, logged=back.logged)
    refit = stale.refitted().pools["colocated"].fit
    chunk = StepShape.of([300] * 4, [(0, 128)])
    assert refit.seconds(chunk) == pytest.approx(truth.seconds(chunk), rel=0.05)
    assert refit.per_prompt_s == pytest.approx(0.012, rel=0.2)
    old_row = steps[0].to_row()[:9]  # a row of a result written before the prompt items were kept
    prompt = next(s for s in steps if s.shape.prefill_tokens)
    assert LoggedStep.from_row(prompt.to_row()[:9]).shape == prompt.shape  # one item: derived exactly
    assert LoggedStep.from_row(old_row).shape.prefill_seqs == (1 if steps[0].shape.prefill_tokens else 0)
