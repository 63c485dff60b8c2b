"""The probe's arithmetic (costmodel/fit/probe_fit.py) and its inferences (benchmarks/probe/run.py) on
numbers made up to have known answers: no server."""

from __future__ import annotations

import argparse
import math
import shlex

import pytest

from benchmarks.client import bench_serve
from benchmarks.probe.measure import TaxSample, step_residuals
from benchmarks.probe.plan import ProbePlan, article_check
from benchmarks.probe.run import Chunking, infer_chunking, mixed_steps
from costmodel.fit import probe_fit as pf
from costmodel.fit.step_fit import StepCostFit, StepShape
from costmodel.fit.step_fit import fit as fit_steps


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
        (_tax(stall_ms=18, steps=33, excess_ms=160), "chunked", 32),  # 5 ms slower per step
        (_tax(stall_ms=11, steps=20, excess_ms=4), "no interference", None),
        # one stream's 150 ms hiccup (shared cores) while the others kept their pace: not a whole prompt
        (_tax(stall_ms=150, steps=20, excess_ms=4, median_gap_ms=12), "no interference", None),
    ],
)
def test_chunking_is_inferred_from_the_spike_and_the_slowdown(tax, verdict, chunk):
    got = infer_chunking([tax], pf.PrefillFit(0.0, 0.2 / 1024, 0.0, 0.0, 1))
    assert got.verdict == verdict
    assert got.chunk_tokens == (None if chunk is None else pytest.approx(chunk))


def test_a_late_second_token_beside_chunk_shaped_evidence_is_no_verdict():
    """The streams slowed by most of the prompt's 200 ms (chunks rode in their steps), yet a lone
    stream's second token came 5 steps late: the signs disagree, as they did for pdserve's own
    colocated `--chunk-size 128` (237 ms against a 49 ms step), so the verdict is "unknown"."""
    tax = _tax(stall_ms=30, steps=15, excess_ms=150)
    fit = pf.PrefillFit(0.0, 0.2 / 1024, 0.0, 0.0, 1)
    got = infer_chunking([tax], fit, handoff_s=0.06, step_s=0.012)
    assert got.verdict == "unknown" and got.chunk_tokens is None
    assert "chunks of about" in got.why and "no verdict" in got.why
    assert infer_chunking([tax], fit, handoff_s=0.0002, step_s=0.012).verdict == "chunked"


def test_a_late_second_token_with_unslowed_streams_means_disaggregated():
    tax = _tax(stall_ms=11, steps=20, excess_ms=4)  # the streams kept their pace
    fit = pf.PrefillFit(0.0, 0.2 / 1024, 0.0, 0.0, 1)
    got = infer_chunking([tax], fit, handoff_s=0.06, step_s=0.012)
    assert got.verdict == "disaggregated" and "moved between pools" in got.why
    assert infer_chunking([tax], fit, handoff_s=0.0002, step_s=0.012).verdict == "no interference"


def test_plan_quick_is_small_and_full_sweeps_to_the_limits():
    q, f = ProbePlan(1024, 8, quick=True), ProbePlan(2048, 8)
    assert q.batches == [1, 2, 4] and f.batches == [1, 2, 4, 8]
    assert f.prefill_tokens == [128, 256, 512, 1024, 2048]
    assert q.tax_points == [(4, 512), (4, 1024)]
    assert f.tax_points == [(8, 1024), (8, 2048), (2, 2048)]
    # the long context only at the end batches: the per-context-token term needs no more
    assert f.decode_points() == [(1, 16), (2, 16), (4, 16), (8, 16), (1, 1024), (8, 1024)]
    # the default covers batches to 16 at the short context; long contexts stay at batches up to 8
    d = ProbePlan()
    assert d.batches == [1, 2, 4, 8, 16] and d.long_batch == 8
    assert d.decode_points() == [(1, 16), (2, 16), (4, 16), (8, 16), (16, 16), (1, 1024), (8, 1024)]
    assert d.tax_points == [(8, 1024), (8, 2048), (2, 2048)]
    assert f.prefill_repeats_at(128) > f.prefill_repeats_at(256)  # the anchor of every difference
    with pytest.raises(ValueError):
        ProbePlan(64, 4).validate()


# ---- the prefill fit anchored where it is used ------------------------------------------------
# A chunked CPU server, made up: every step pays 6 ms, 50 us per token, 20 ns per attention pair,
# 0.4 ms per decode sequence; prompts run in chunks of 128. A request pays 30 ms besides its
# steps, but the idle 1-token request suggests 40 (the router's polling overlaps a long prefill,
# not a short one): TTFT minus that constant understates short prompts.
TRUE = StepCostFit(0.006, 50e-6, 20e-9, 0.4e-3)
CHUNK, REQUEST_S, IDLE_OVERHEAD_S = 128, 0.030, 0.040
TOKENS = [128, 256, 512, 1024, 2048]


def _alone(tokens: int) -> float:
    return sum(TRUE.seconds(StepShape.of((), [p])) for p in pf.chunks(tokens, CHUNK))


def _ttfts() -> list[pf.TTFTPoint]:
    return [pf.TTFTPoint(t, REQUEST_S + _alone(t)) for t in TOKENS]


def _decode_points() -> list[pf.DecodePoint]:
    return [pf.DecodePoint(b, c, TRUE.decode_seconds([c] * b)) for b in (1, 2, 4, 8) for c in (24, 1024)]


def test_prefill_fitted_on_differences_keeps_its_per_token_term():
    old = pf.fit_prefill([pf.PrefillPoint(p.tokens, p.ttft_s - IDLE_OVERHEAD_S) for p in _ttfts()])
    new = pf.fit_prefill_anchored(_ttfts(), IDLE_OVERHEAD_S)
    # the old points make the curve look convex: 128 tokens cost a quarter of what they do
    assert old.seconds(128) < 0.3 * _alone(128)
    for t in TOKENS:  # chunks of 128 add up to linear + quadratic: recovered exactly
        assert new.seconds(t) == pytest.approx(_alone(t), rel=1e-6)
    # per token: each chunk's step cost spread over its tokens, and the attention's linear part
    assert new.linear_s == pytest.approx(TRUE.fixed_s / CHUNK + TRUE.per_token_s + CHUNK / 2 * TRUE.attention_s)


def test_joint_step_fit_prices_a_chunk_where_the_old_one_priced_it_free():
    decode = _decode_points()
    old = fit_steps(
        [(StepShape.of([round(p.context)] * p.batch), p.step_s) for p in decode]
        + [(StepShape.of((), [(0, p.tokens)]), p.ttft_s - IDLE_OVERHEAD_S) for p in _ttfts()]
    )
    new = pf.fit_joint(decode, _ttfts(), [], CHUNK)
    truth = TRUE.chunk_extra_seconds(0, CHUNK)  # a 128-token chunk beside a decode step: 6.7 ms
    assert old.per_token_s == 0.0 and old.chunk_extra_seconds(0, CHUNK) < 0.2 * truth  # "priced as free"
    assert new.coef == pytest.approx(TRUE.coef, rel=1e-6)
    assert new.chunk_extra_seconds(0, CHUNK) == pytest.approx(truth, rel=1e-6)


# The same server with a prompt chunk's own path (2 ms an item) and its read of its context (3 us a
# token) priced: whole prompts' TTFTs fold both into the attention term, so a chunk size other than
# the server's is mispriced; chunks timed after a cached prefix tell them apart.
TRUE7 = StepCostFit(0.006, 50e-6, 20e-9, 0.4e-3, per_prompt_s=2e-3, context_read_s=3e-6)


def _alone7(tokens: int, chunk: int | None) -> float:
    return sum(TRUE7.seconds(StepShape.of((), [p])) for p in pf.chunks(tokens, chunk))


def test_chunks_after_a_cached_prefix_price_a_smaller_chunk_size_the_server_never_ran():
    decode = [pf.DecodePoint(b, c, TRUE7.decode_seconds([c] * b)) for b in (1, 2, 4, 8) for c in (24, 1024)]
    ttfts = [pf.TTFTPoint(t, REQUEST_S + _alone7(t, 256)) for t in TOKENS]  # the server chunks at 256
    cached = [
        pf.CachedChunk(s, n, REQUEST_S + TRUE7.seconds(StepShape.of((), [(s, n)])))
        for s in (256, 512, 1024)
        for n in (64, 256)
    ]
    outside, told = pf.fit_joint(decode, ttfts, [], 256), pf.fit_joint(decode, ttfts, [], 256, cached=cached)
    truth = _alone7(1024, 64)  # a 1,024-token prompt in chunks of 64
    assert outside.per_prompt_s == 0.0 and outside.context_read_s == 0.0  # the five outside terms
    assert sum(outside.seconds(StepShape.of((), [p])) for p in pf.chunks(1024, 64)) < 0.9 * truth
    assert told.coef == pytest.approx(TRUE7.coef, rel=1e-6)
    # one start only: a read cannot be told from an item's own cost, so the five terms again
    assert pf.fit_joint(decode, ttfts, [], 256, cached=cached[:2]).context_read_s == 0.0


def test_joint_fit_takes_the_taxs_mixed_steps_as_they_were_measured():
    mixed = [pf.MixedStep(8, 24, 1024, 0.0)]  # nothing measured: ignored
    decode = _decode_points()
    assert pf.fit_joint(decode, _ttfts(), mixed, CHUNK).samples == len(decode) + len(TOKENS) - 1
    # a mixed step is the mean of the steps that carried the chunks beside the batch
    steps = [TRUE.seconds(StepShape.of([24] * 8, [p])) for p in pf.chunks(1024, CHUNK)]
    mixed = [pf.MixedStep(8, 24, 1024, sum(steps) / len(steps))]
    got = pf.fit_joint(decode, _ttfts(), mixed, CHUNK)
    assert got.samples == len(decode) + len(TOKENS) and got.coef == pytest.approx(TRUE.coef, rel=1e-6)
    tax = TaxSample(8, 1024, 0.03, 0.0, 0.5, 0.01, 9, 0.08)  # 80 ms lost over 8 chunks: 10 ms each
    (m,) = mixed_steps([tax], Chunking("chunked", 128.0, ""), 24)
    assert m.seconds == pytest.approx(0.02)
    assert mixed_steps([tax], Chunking("disaggregated", None, ""), 24) == []  # not in the decode steps


def test_prompts_under_the_latency_floor_are_left_out():
    # a router that hands no first token over before 60 ms: 128 and 256 tokens answer at the floor
    floor = 0.06
    ttfts = [pf.TTFTPoint(p.tokens, max(floor, p.ttft_s)) for p in _ttfts()]
    assert [p.tokens for p in pf.clear_of_floor(ttfts, floor)] == [512, 1024, 2048]
    got = pf.fit_prefill_anchored(ttfts, IDLE_OVERHEAD_S, floor)
    assert got.anchor_tokens == 512 and got.points == 3
    for t in TOKENS:
        assert got.seconds(t) == pytest.approx(_alone(t), rel=1e-6)
    assert pf.fit_joint(_decode_points(), ttfts, [], CHUNK, IDLE_OVERHEAD_S, floor).coef == pytest.approx(
        TRUE.coef, rel=1e-6
    )
    # the tiny model on a fast CPU (its probe at commit 8988f81): only 1024 tokens clear the floor,
    # so its TTFT less the overhead is the prefill, taken as linear in T
    tiny = [pf.TTFTPoint(t, s) for t, s in ((128, 0.0469), (256, 0.0471), (512, 0.0510), (1024, 0.0896))]
    got = pf.fit_prefill_anchored(tiny, 0.0464, 0.0471)
    assert (got.anchor_tokens, got.points, got.fixed_s, got.quadratic_s) == (1024, 1, 0.0, 0.0)
    assert got.seconds(1024) == pytest.approx(0.0896 - 0.0464)


def test_anchored_fit_with_no_slope_is_all_fixed():
    # a server whose TTFT does not grow with the prompt (a fake): no per-token term, no error
    got = pf.fit_prefill_anchored([pf.TTFTPoint(128, 0.05), pf.TTFTPoint(256, 0.049)], 0.04)
    assert (got.linear_s, got.quadratic_s) == (0.0, 0.0) and got.fixed_s == pytest.approx(0.01)


# ---- the chunk, inferred ----------------------------------------------------------------------
# SmolLM2 on 2 cores, numbers of the shape the run showed: a 79 ms batch-1 step, 170 ms
# at batch 8, a 2048-token prompt prefilled alone in 16 chunks of 128 in about 1.5 s.
SMOL_PREFILL = pf.PrefillFit(0.0, 1.5 / 2048, 0.0, 0.0, 1)


def _smol_tax(tokens: int, steps: float, slowdown: float, batch: int = 8, step: float = 0.17) -> TaxSample:
    excess = steps * step * slowdown
    return TaxSample(batch, tokens, step * (1 + slowdown) + 0.05, 0.0, 1.0, step, steps, excess, step * (1 + slowdown))


def test_colocated_chunks_of_128_are_inferred():
    """As measured (SmolLM2, `--mode colocated --chunk-size 128`, 2 cores): a 2048-token prompt
    alone in 7.3 s; 17 stream steps while it ran, 4.7x slower than their 88 ms pace."""
    prefill = pf.PrefillFit(0.0, 7.3 / 2048, 0.0, 0.0, 1)
    tax = [_smol_tax(1024, 9, 3.5, step=0.084), _smol_tax(2048, 17, 4.68, step=0.088)]
    tax.append(_smol_tax(2048, 17, 5.8, batch=2, step=0.071))
    got = infer_chunking(tax, prefill, handoff_s=0.06, step_s=0.053, floor_step_s=0.053)
    assert got.verdict == "chunked" and got.chunk_tokens == pytest.approx(128)  # 8 + 1 and 16 + 1 steps


def test_the_step_under_way_when_the_prompt_arrives_is_not_one_of_its_chunks():
    """As measured (SmolLM2, `--mode colocated --chunk-size 256`, 2 cores, probe zl, 2026-12-07): the
    streams got 5 tokens while a 1,024-token prompt ran (4 chunks and the step under way when it
    came), 9 and 10 while a 2,048-token one did (8 chunks). T / steps read 205 tokens."""
    prefill = pf.PrefillFit(0.0, 7.9 / 2048, 0.0, 0.0, 1)
    tax = [_smol_tax(1024, 5, 7.4, step=0.094), _smol_tax(2048, 9, 10.3, step=0.087)]
    tax.append(_smol_tax(2048, 10, 20.0, batch=2, step=0.043))
    got = infer_chunking(tax, prefill, handoff_s=0.04, step_s=0.034, floor_step_s=0.034)
    assert got.verdict == "chunked" and got.chunk_tokens == pytest.approx(256), got.why
    assert "T / (steps - 1)" in got.why


def test_prefill_in_another_pool_on_shared_cores_is_not_read_as_small_chunks():
    """`pdserve serve --chunk-size 128` is disagg by default: the chunks ran in the prefill pool
    while the decode pool's streams kept stepping, slowed by the shared cores: 82 steps during a
    2048-token prompt (T / steps = 25: the "chunks of about 25 tokens" the issue saw)."""
    tax = [_smol_tax(1024, 41, 0.6), _smol_tax(2048, 82, 0.6), _smol_tax(2048, 82, 0.6, batch=2)]
    # the KV handoff is too short against an 85 ms step to show in the second token
    got = infer_chunking(tax, SMOL_PREFILL, handoff_s=0.1, step_s=0.085, floor_step_s=0.079)
    assert got.verdict == "disaggregated" and got.chunk_tokens is None, got.why
    # the streams lost 82 x 85 ms x 0.6 = 4.2 s, most of the lone prefill: that sign alone would not tell
    assert "room for at most" in got.why


def test_streams_that_lose_far_less_than_the_prompts_prefill_did_not_carry_it():
    """SmolLM2 1P1D on 2 cores, measured: 74 stream steps during a 2048-token prompt, 18% slower
    than their pace (T / steps = 28, well inside the lone prefill's room), but the streams lost
    1.1 s while the prompt's prefill alone takes 6.2 s: it ran in the other pool."""
    prefill = pf.PrefillFit(0.0, 6.2 / 2048, 0.0, 0.0, 1)
    tax = [_smol_tax(1024, 28, 0.15, step=0.086), _smol_tax(2048, 74, 0.18, step=0.083)]
    tax.append(_smol_tax(2048, 90, 0.22, batch=2, step=0.068))
    got = infer_chunking(tax, prefill, handoff_s=0.1, step_s=0.053, floor_step_s=0.053)
    assert got.verdict == "disaggregated" and "did not ride in their steps" in got.why, got.why


# ---- the stall as a distribution --------------------------------------------------------------
def test_stall_forecast_without_jitter_is_the_costliest_step():
    f = pf.stall_forecast([0.1, 0.3, 0.2], [])
    assert (f.median_s, f.p90_s, f.step_s, f.steps, f.jitter_samples) == (0.3, 0.3, 0.3, 3, 0)


def test_stall_forecast_adds_the_jitter_and_grows_with_the_window():
    jitter = [0.0] * 85 + [0.01] * 10 + [0.1] * 5  # mostly nothing, one step in 20 100 ms late
    one = pf.stall_forecast([0.2], jitter)
    many = pf.stall_forecast([0.2] * 32, jitter)
    assert one.median_s == pytest.approx(0.2) and one.p90_s == pytest.approx(0.21)
    # the longest of 32 steps: most documents meet a late one (1 - 0.95^32 = 81%)
    assert many.median_s == pytest.approx(0.3) and many.p90_s == pytest.approx(0.3)
    assert pf.stall_forecast([0.2] * 32, jitter) == many  # seeded: the same probe, the same forecast
    with pytest.raises(ValueError):
        pf.stall_forecast([], jitter)


def test_window_is_the_step_under_way_then_each_chunk_beside_the_streams():
    w = pf.window_steps(TRUE, 8, 192, 1024, 128)
    assert len(w) == 1 + 8 and w[0] == pytest.approx(TRUE.decode_seconds([192] * 8))
    assert w[-1] == max(w) == pytest.approx(pf.predicted_stall(TRUE, 8, 192, 1024, 128))
    assert len(pf.window_steps(TRUE, 8, 192, 1024)) == 2  # whole: one step carries it


def test_step_residuals_are_each_steps_longest_gap_over_the_streams_less_the_pace():
    a = [0.0, 0.1, 0.2, 0.35]
    b = [0.0, 0.12, 0.2, 0.3, 0.4]  # one token more: only the steps both saw count
    assert step_residuals([a, b], 0.1) == pytest.approx([0.02, 0.0, 0.05])
    assert step_residuals([], 0.1) == []


# ---- the run that checks the forecast ---------------------------------------------------------
@pytest.mark.parametrize(("step_s", "ttft_s"), [(0.17, 1.8), (0.01, 0.1)])  # SmolLM2 on CPU; the tiny model
def test_article_check_spaces_eight_documents_inside_the_streams(step_s, ttft_s):
    plan = ProbePlan()
    chk = article_check(plan, step_s, ttft_s)
    assert chk.doc_count >= 8 and chk.chat_streams == plan.mix_streams
    assert chk.doc_interval_s >= 2 * ttft_s  # one document out before the next arrives
    last = chk.doc_start_s + (chk.doc_count - 1) * chk.doc_interval_s
    assert chk.chat_output_len * step_s > last + ttft_s  # the streams decode through the last one
    assert chk.context == pytest.approx(plan.mix_context, abs=2) or chk.chat_prompt_len == 16
    # the printed command is one `bench serve` accepts, and its workload is the one described
    cmd = chk.command("http://127.0.0.1:8000/v1", "m", token_ids=True)
    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    args = parser.parse_args(shlex.split(cmd)[3:])
    assert (args.workload, args.doc_count, args.prompt_token_ids) == ("article", chk.doc_count, True)
    assert (args.chat_prompt_len, args.chat_output_len) == (chk.chat_prompt_len, chk.chat_output_len)
    assert (args.doc_start_s, args.doc_interval_s) == (chk.doc_start_s, chk.doc_interval_s)


def test_a_timed_out_probe_request_says_which_flag_to_raise():
    """A batch of long prompts can outlast the request timeout (16 of 1,024 tokens did, on the 2-core
    VM): the one-line error names --request-timeout-s and --max-batch; other failures stay as they were."""
    from benchmarks.client.serve_client import StreamRecord
    from benchmarks.probe.client import ProbeError, checked

    rec = StreamRecord("probe-90", "probe", 1024, 40, 0.0)
    rec.error = "APITimeoutError: Request timed out."
    with pytest.raises(ProbeError, match=r"probe-90 \(1024-token prompt\) failed: .*raise it, or lower --max-batch"):
        checked(rec)
    rec.error = "APIConnectionError: Connection refused"
    with pytest.raises(ProbeError) as e:
        checked(rec)
    assert "--max-batch" not in str(e.value)
