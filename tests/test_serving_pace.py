"""`bench compare --transfer-from`: a server's pace against the source run's, from the same side
prompts timed on both (benchmarks/compare/calibrate/serving_pace.py)."""

from benchmarks.compare.calibrate.logged_step import LoggedStep
from benchmarks.compare.calibrate.serving_pace import MIN_MATCHED, pace_ratio
from costmodel.fit.step_fit import StepShape


def _prompt(tokens: int, seconds: float, threads: int = 1, decoding: int = 0) -> LoggedStep:
    shape = StepShape.of([100] * decoding, [(0, tokens)])
    return LoggedStep("w", "colocated", shape, seconds, 0.0, threads)


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
