"""The probe's arithmetic (costmodel/probe_fit.py) and its inferences (benchmarks/probe_run.py) on
numbers made up to have known answers: no server."""

from __future__ import annotations

import math

import pytest

from benchmarks.probe_measure import TaxSample
from benchmarks.probe_plan import ProbePlan
from benchmarks.probe_run import infer_chunking
from costmodel import probe_fit as pf
from costmodel.step_fit import StepCostFit


def test_fits_recover_the_terms_that_made_the_points():
    decode = [pf.DecodePoint(b, c, 0.005 + 0.001 * b + 2e-7 * b * c) for b in (1, 2, 4, 8) for c in (16, 1024)]
    d = pf.fit_decode(decode)
    assert (d.fixed_s, d.per_sequence_s, d.per_context_token_s) == pytest.approx((0.005, 0.001, 2e-7), rel=1e-6)
    assert d.rms_rel_error < 1e-9
    prefill = [pf.PrefillPoint(t, 0.004 + 1e-5 * t + 3e-9 * t * t) for t in (128, 256, 512, 1024, 2048)]
    p = pf.fit_prefill(prefill)
    assert (p.fixed_s, p.linear_s, p.quadratic_s) == pytest.approx((0.004, 1e-5, 3e-9), rel=1e-6)


def test_fit_terms_are_never_negative():
    # a prefill that gets cheaper with length (noise) must not fit a negative slope
    p = pf.fit_prefill([pf.PrefillPoint(128, 0.02), pf.PrefillPoint(256, 0.019), pf.PrefillPoint(512, 0.021)])
    assert min(p.fixed_s, p.linear_s, p.quadratic_s) >= 0 and p.fixed_s > 0


def test_the_articles_conversion_and_break_even_chunk():
    # the article's numbers: a 27.5 ms step at batch 32 and a 786 ms prefill make 914 tokens
    d = pf.DecodeFit(0.0275, 0.0, 0.0, 0.0, 1)
    p = pf.PrefillFit(0.0, 0.786 / 4096, 0.0, 0.0, 1)
    assert pf.prompt_in_generated_tokens(p, d, 4096, 32, 4096) == pytest.approx(0.786 / 0.0275 * 32)
    assert pf.break_even_chunk(p, d, 4096) == pytest.approx(0.0275 / (0.786 / 4096))
    assert pf.break_even_chunk(pf.PrefillFit(0.03, 1e-5, 0, 0, 1), d, 4096) == 0.0  # fixed cost > one step
    assert math.isinf(pf.break_even_chunk(pf.PrefillFit(0.0, 0.0, 0.0, 0, 1), d, 4096))
    rows = pf.capacity(p, 4096, 32, shares=(0.5,))
    assert rows[0].prefills_per_s == pytest.approx(0.5 / 0.786) and rows[0].decode_sequences == 16


def test_predicted_stall_whole_against_chunked():
    steps = StepCostFit(0.005, 1e-5, 1e-9, 1e-3)
    whole = pf.predicted_stall(steps, 4, 16, 1024)
    chunked = pf.predicted_stall(steps, 4, 16, 1024, chunk=128)
    # the costliest chunk is the last (it attends to the most context)
    last = steps.seconds(pf.StepShape.of([16] * 4, [(896, 128)]))
    assert chunked == pytest.approx(last) and chunked < whole
    assert pf.predicted_stall(steps, 4, 16, 100, chunk=128) == pytest.approx(pf.predicted_stall(steps, 4, 16, 100))


def _tax(stall_ms: float, steps: float, excess_ms: float, step_ms: float = 10.0, median_gap_ms=None) -> TaxSample:
    gap = None if median_gap_ms is None else median_gap_ms / 1e3
    return TaxSample(4, 1024, stall_ms / 1e3, 0.0, 0.5, step_ms / 1e3, steps, excess_ms / 1e3, gap)


@pytest.mark.parametrize(
    ("tax", "verdict", "chunk"),
    [
        (_tax(stall_ms=210, steps=1, excess_ms=200), "whole", None),
        (_tax(stall_ms=18, steps=32, excess_ms=160), "chunked", 32),  # 5 ms slower per step
        (_tax(stall_ms=11, steps=20, excess_ms=4), "no interference", None),
        # one stream's 150 ms hiccup (shared cores) while the others kept their pace: not a whole prompt
        (_tax(stall_ms=150, steps=20, excess_ms=4, median_gap_ms=12), "no interference", None),
    ],
)
def test_chunking_is_inferred_from_the_spike_and_the_slowdown(tax, verdict, chunk):
    got = infer_chunking([tax], pf.PrefillFit(0.0, 0.2 / 1024, 0.0, 0.0, 1))
    assert got.verdict == verdict
    assert got.chunk_tokens == (None if chunk is None else pytest.approx(chunk))


def test_a_late_second_token_means_disaggregated():
    tax = _tax(stall_ms=30, steps=15, excess_ms=70)  # slowed down, as on shared cores
    fit = pf.PrefillFit(0.0, 0.2 / 1024, 0.0, 0.0, 1)
    assert infer_chunking([tax], fit, handoff_s=0.06, step_s=0.012).verdict == "disaggregated"
    assert infer_chunking([tax], fit, handoff_s=0.0002, step_s=0.012).verdict == "chunked"


def test_plan_quick_is_small_and_full_sweeps_to_the_limits():
    q, f = ProbePlan(1024, 8, quick=True), ProbePlan(2048, 8)
    assert q.batches == [1, 2, 4] and f.batches == [1, 2, 4, 8]
    assert f.prefill_tokens == [128, 256, 512, 1024, 2048]
    assert q.tax_points == [(4, 512), (4, 1024)]
    assert (2, 2048) in f.tax_points
    with pytest.raises(ValueError):
        ProbePlan(64, 4).validate()
