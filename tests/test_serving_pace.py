"""A server's pace against the servers a fit was measured on, from lone steps of one shape timed on
both (benchmarks/compare/calibrate/serving_pace.py): `bench compare --transfer-from` reads it from the
side prompts both warm-ups sent, `plan --verify` sends each candidate prompts of the calibration's
lengths (benchmarks/plan_calibration.py `serving_pace`; against a real server in
tests/test_bench_probe.py, whose server it shares)."""

from benchmarks.client.logged_step import LoggedStep
from benchmarks.compare.calibrate.serving_pace import MIN_MATCHED, pace_prompt_lengths, pace_ratio
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


def test_a_verified_candidate_of_another_role_is_paced_by_its_lone_prompts_and_decodes():
    """A prefill worker's lone prompt is one forward of the model, as a colocated one's is; a lone
    decode step of one stream at one context too. Steps decoding several streams stay out."""
    source = [_prompt(n, n * 1e-3) for n in (40, 80, 120)] + [_decode(c, 0.02) for c in (41, 42, 43)]
    source.append(_decode(50, 0.02, streams=3))
    here = [_prompt(n, n * 1.2e-3, role="prefill") for n in (40, 80, 120)]
    here += [_decode(c, 0.024, role="decode") for c in (41, 42, 43)] + [_decode(50, 0.1, streams=3, role="decode")]
    assert pace_ratio(source, here) is None  # by role (the transfer's rule): nothing matches
    assert pace_ratio(source, here, by_role=False) is None  # prompts alone: too few
    ratio, matched = pace_ratio(source, here, by_role=False, decode=True)
    assert matched == 6 and abs(ratio - 1.2) < 1e-9


def test_the_lengths_sent_are_those_computed_whole_alone_and_uncached():
    cached = LoggedStep("w", "colocated", StepShape.of([], [(128, 64)]), 0.1, 0.0, 1)  # 64 past a 128 prefix
    two = LoggedStep("w", "colocated", StepShape.of([], [(0, 30), (0, 30)]), 0.1, 0.0, 1)  # two in one step
    steps = [_prompt(300, 0.3, threads=2), _prompt(40, 0.04), _prompt(40, 0.05), _prompt(9, 0.01, decoding=2)]
    assert pace_prompt_lengths([*steps, cached, two]) == [40, 300]


def test_a_probes_calibration_brings_the_probed_servers_steps(tmp_path):
    """`bench probe` of a pdserve server on this host keeps its steps in the result beside the
    calibration file; `plan --verify` reads them from there (and nothing from anything else)."""
    import argparse
    import json

    from benchmarks.client.logged_step import steps_table
    from benchmarks.plan_calibration import probe_steps

    steps = [_prompt(40, 0.04), _decode(41, 0.02)]
    (tmp_path / "probe-x.json").write_text(json.dumps({"server_steps": steps_table(steps)}))
    (tmp_path / "probe-x.calibration.json").write_text("{}")
    (tmp_path / "probe-y.calibration.json").write_text("{}")  # no result beside it
    read = probe_steps(argparse.Namespace(calibration=str(tmp_path / "probe-x.calibration.json")))
    assert [(s.shape.prefill_tokens, s.shape.decode_seqs) for s in read] == [(40, 0), (0, 1)]
    assert probe_steps(argparse.Namespace(calibration=str(tmp_path / "probe-y.calibration.json"))) == ()
    assert probe_steps(argparse.Namespace(calibration=str(tmp_path / "probe-x.json"))) == ()  # not a calibration file
