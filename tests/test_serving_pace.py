"""A server's pace: against the servers a fit was measured on, from lone steps of one shape timed on
both (benchmarks/compare/calibrate/serving_pace.py: `bench compare --transfer-from` reads it from the
side prompts both warm-ups sent); and a verified candidate's against the plan's prices, from requests
of the workload's shapes sent before its timed pass (benchmarks/plan_calibration.py `serving_pace`,
benchmarks/verify_steps.py `step_pace`; against a real server in tests/test_bench_probe.py, whose
server it shares)."""

from benchmarks.client.logged_step import LoggedStep
from benchmarks.compare.calibrate.serving_pace import MIN_MATCHED, pace_ratio
from costmodel.fit.step_fit import StepShape


def _prompt(tokens: int, seconds: float, threads: int = 1, decoding: int = 0, role: str = "colocated") -> LoggedStep:
    shape = StepShape.of([100] * decoding, [(0, tokens)])
    return LoggedStep("w", role, shape, seconds, 0.0, threads)


def _decode(context: int, seconds: float, streams: int = 1, role: str = "colocated") -> LoggedStep:
    return LoggedStep("w", role, StepShape.of([context] * streams, []), seconds, 0.0, 1)


def test_the_ratio_is_read_from_prompt_steps_of_the_same_shape():
    lengths = (37, 73, 134, 194, 248, 304)
    source = [_prompt(n, n * 1e-3) for n in lengths] + [_prompt(999, 5.0)]  # no twin here: not read
    here = [_prompt(n, n * 0.8e-3) for n in lengths] + [_prompt(37, 0.5, decoding=4)]  # beside decoding: not read
    ratio, matched = pace_ratio(source, here)
    assert matched == len(lengths) and abs(ratio - 0.8) < 1e-9


def test_steps_on_other_threads_or_too_few_give_no_ratio():
    source = [_prompt(n, 1.0) for n in range(40, 40 + MIN_MATCHED)]
    assert pace_ratio(source, [_prompt(n, 0.5, threads=2) for n in range(40, 40 + MIN_MATCHED)]) is None
    assert pace_ratio(source, [_prompt(n, 0.5) for n in range(40, 40 + MIN_MATCHED - 1)]) is None
    assert pace_ratio(source, [_prompt(n, 0.5) for n in range(40, 40 + MIN_MATCHED)]) == (0.5, MIN_MATCHED)


def test_the_report_shows_the_paced_prediction_beside_the_plain_one():
    from benchmarks.compare.markdown import at_pace_section
    from costmodel.sim.compare_predict import COMPARED

    compared = {k: {"measured": 100.0, "predicted": 110.0, "error": 0.1} for k, _, _ in COMPARED}
    paced = {"ratio": 0.85, "matched_steps": 12, "how": "", "compared": compared}
    result = {"modes": [{"label": "colocated", "metrics": {}, "predicted_at_server_pace": paced}]}
    lines = at_pace_section(result)
    row = next(x for x in lines if x.startswith("| colocated"))
    assert "(0.85x, 12 steps)" in row and row.count("100.0 / 110.0 (+10%)") == len(COMPARED)
    assert at_pace_section({"modes": [{"label": "colocated", "metrics": {}}]}) == []


def _setup(prefill_fit=None):
    from costmodel.fit.step_fit import StepCostFit
    from costmodel.sim.compare_predict import setup_from_steps

    fit = StepCostFit(fixed_s=0.01, per_token_s=1e-4, attention_s=1e-7, per_sequence_s=1e-3)
    return setup_from_steps("tiny", fit, prefill_fit, None, "test", 10)


def _priced(setup, step: LoggedStep, k: float) -> LoggedStep:
    """`step` timed at `k` times the price `setup` gives its shape."""
    f = setup.steps.fit_of(step.role, step.shape.prefill_tokens)
    return LoggedStep(step.worker, step.role, step.shape, k * f.seconds(step.shape), step.end_unix_s, 1)


def test_a_candidates_pace_reads_prompt_and_batched_decode_steps_apart():
    """`plan --verify`'s pace (benchmarks/verify_steps.py `step_pace`): steps that computed prompt
    tokens beside a decoding batch (with the prompt-only ones where too few did), and steps that
    decoded two streams or more alone, each against the plan's price; a lone stream's decode step
    and a decode step beside another worker's prompt step stay out. Too few of a kind: that kind is
    not read."""
    from benchmarks.verify_steps import MIN_DECODE_STEPS, MIN_PROMPT_STEPS, step_pace

    setup = _setup()
    alone = [_priced(setup, _prompt(n, 0.0), 1.25) for n in (40, 120, 300)]
    batched = [_priced(setup, _decode(200 + i, 0.0, streams=8), 0.9) for i in range(MIN_DECODE_STEPS)]
    lone = [_priced(setup, _decode(200, 0.0), 2.0)]
    mixed = [_priced(setup, _prompt(64 + i, 0.0, decoding=4), 1.1) for i in range(MIN_PROMPT_STEPS)]
    found = step_pace(alone + batched + lone + mixed, setup)
    assert found is not None and (found.prompt_steps, found.decode_steps) == (MIN_PROMPT_STEPS, MIN_DECODE_STEPS)
    assert abs(found.prompt - 1.1) < 1e-9 and abs(found.decode - 0.9) < 1e-9  # beside decoding: those alone
    few = step_pace(alone + mixed[:1], setup)  # too few beside decoding: every step with prompt tokens
    assert few.prompt_steps == len(alone) + 1 and 1.1 < few.prompt < 1.25 and few.decode is None
    assert step_pace(alone[:2] + lone, setup) is None  # too few of either

    # disaggregated on one host: a decode step while the prefill worker computes a prompt is left out
    beside = LoggedStep("p", "prefill", StepShape.of([], [(0, 500)]), 1.0, 10.0, 1)
    during = [LoggedStep("d", "decode", s.shape, s.seconds * 3, 9.5, 1) for s in batched]
    found = step_pace([*batched, beside, *during], setup)
    assert found.decode_steps == MIN_DECODE_STEPS and abs(found.decode - 0.9) < 1e-9


def test_a_prediction_repriced_at_two_paces_prices_each_step_whole_by_its_kind():
    """`priced_at(setup, k, decode_k)`: a step that decodes alone at decode_k times the fit, a step
    with prompt tokens at k times, its decode rows too (mixed steps ran at the prompt steps' pace,
    not split: docs/plan.md)."""
    from costmodel.plan.score import priced_at
    from costmodel.sim.model import Request

    setup = _setup()
    paced = priced_at(setup, 1.2, 0.9)
    batch = [Request(i, "chat", 0.0, 100 + i, 8) for i in range(4)]
    parts = [(0, 64)]
    plain, at = setup.steps, paced.steps
    decode_only = plain.step(batch, [])
    assert abs(at.step(batch, []) - 0.9 * decode_only) < 1e-12
    assert abs(at.step([], parts) - 1.2 * plain.step([], parts)) < 1e-12
    assert abs(at.step(batch, parts) - 1.2 * plain.step(batch, parts)) < 1e-12
    assert all(abs(a - 0.9 * b) < 1e-12 for a, b in zip(at.decode_run(batch, 3), plain.decode_run(batch, 3)))
    assert abs(priced_at(setup, 1.2).steps.step(batch, []) - 1.2 * decode_only) < 1e-12  # one pace: every term


def test_the_burst_outlasts_the_prompts_sent_beside_it():
    """A step of the burst's for each step a prompt beside it takes (its chunks, its decode, a turn)."""
    from benchmarks.compare.calibrate.side_requests import SHAPE_DECODE_TOKENS
    from benchmarks.plan_calibration import PACE_BURST_TOKENS, PACE_TURN_STEPS, burst_tokens

    turn = SHAPE_DECODE_TOKENS + PACE_TURN_STEPS
    assert burst_tokens([100, 1000], None) == PACE_BURST_TOKENS + 2 * (1 + turn)  # whole: a step each
    assert burst_tokens([100, 1000], 256) == PACE_BURST_TOKENS + (1 + turn) + (4 + turn)


def test_the_prompts_beside_the_burst_have_the_lengths_the_workload_computes():
    """A shared prefix counts once: after the first request of a prefix, the rest of the prompt."""
    from benchmarks.plan_calibration import pace_lengths
    from costmodel.workloads import RequestSpec

    specs = [RequestSpec(f"r{i}", (), 256, 8, float(i), "chat", prefix_id="a", prefix_len=192) for i in range(9)]
    specs.append(RequestSpec("doc", (), 1000, 8, 20.0, "doc"))
    assert pace_lengths(specs) == [64, 64, 64, 64, 1000]  # one a quantile: 256 is none of them


def test_the_burst_decodes_as_many_streams_as_the_plan_has_a_worker_decode_on_average():
    """Time-weighted over the spells a worker decodes anything, per decode-side worker; not the peak."""
    from types import SimpleNamespace

    from benchmarks.plan_calibration import PACE_BURST_MAX, pace_burst
    from costmodel.serve_metrics import RequestRecord

    def rec(first: float, last: float) -> RequestRecord:
        return RequestRecord("r", "chat", 8, 8, 0.0, chunk_times_s=[first, last])

    # 1 stream for 8 s, 9 at once for 1 s (the peak), then idle, then 1 for 1 s: the mean while decoding is 1.8
    records = [rec(0.0, 8.0)] + [rec(8.0, 9.0) for _ in range(9)] + [rec(20.0, 21.0)]
    one = SimpleNamespace(records=records, candidate=SimpleNamespace(decode=1))
    assert pace_burst(one) == 2
    two = SimpleNamespace(records=[rec(0.0, 1.0) for _ in range(40)], candidate=SimpleNamespace(decode=2))
    assert pace_burst(two) == PACE_BURST_MAX * 2  # 20 a worker, capped, on each of two
