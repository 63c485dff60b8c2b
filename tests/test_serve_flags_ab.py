"""benchmarks/serve_flags_ab.py: the flags of a variant become the settings they give, a variant's
rounds their means, and a verification's prompt steps are priced by length and thread count (what
the A/B compares; the servers themselves are `pdserve plan --verify`'s, tested in tests/test_plan*.py)."""

import pytest

from benchmarks.serve_flags_ab import parse_variant, summarize_variant, table
from benchmarks.verify_rows import VerifyRow
from cli import CliError
from costmodel.plan.candidates import Candidate
from costmodel.plan.score import Judged


def test_a_variant_gives_only_the_settings_it_names():
    assert parse_variant("") == {}
    got = parse_variant("--prompt-threads 1 --prompt-threads-min-tokens 256")
    assert got == {"prompt_threads": "1", "prompt_threads_min_tokens": 256}
    with pytest.raises(CliError, match="not pdserve serve flags"):
        parse_variant("--no-such-flag 3")


def test_a_variants_rounds_and_their_mean():
    def row(goodput: float, tpot: float) -> VerifyRow:
        r = VerifyRow(Candidate("colocated", 1), 1, Judged({"tpot": 1.0}, True, 3.0), None, {})
        r.measured = Judged({"tpot": 1.0}, True, goodput)
        r.metrics = {"ttft_p90_ms": 200.0, "tpot_p90_ms": tpot}
        return r

    failed = row(0.0, 0.0)
    failed.measured, failed.error = None, "RuntimeError: boom"
    v = summarize_variant("--prompt-threads 1", [row(3.0, 80.0), row(2.0, 100.0), failed])
    assert v["goodput_per_worker"] == pytest.approx(2.5) and v["goodput_per_worker_rounds"] == [3.0, 2.0]
    assert v["tpot_p90_ms"] == pytest.approx(90.0) and v["errors"] == ["RuntimeError: boom"]
    text = table([v])
    assert "--prompt-threads 1" in text and "2.500/s" in text and "90 ms" in text


def test_prompt_steps_are_priced_by_length_and_threads():
    from benchmarks.client.logged_step import LoggedStep
    from benchmarks.verify_steps import step_prices
    from costmodel.fit.step_fit import StepCostFit, StepShape
    from costmodel.sim.compare_predict import setup_from_steps

    fit = StepCostFit(0.002, 1e-4, 0.0, 1e-3)
    setup = setup_from_steps("tiny", fit, None, None, "t", 1)
    decode, short, long = StepShape.of([100] * 2), StepShape.of([100], [(0, 100)]), StepShape.of([100], [(0, 300)])
    steps = [LoggedStep("c-0", "colocated", decode, fit.seconds(decode), torch_threads=1)]
    steps += [LoggedStep("c-0", "colocated", short, fit.seconds(short) * 1.5, torch_threads=1)]
    steps += [LoggedStep("c-0", "colocated", long, fit.seconds(long) * k, torch_threads=2) for k in (0.6, 0.8)]
    got = step_prices(steps, setup)["colocated"]["prompt_steps_by_tokens"]
    assert [(b["tokens"], b["threads"], b["steps"]) for b in got] == [("64-127", 1, 1), ("256-511", 2, 2)]
    assert got[0]["time_ratio"] == pytest.approx(1.5) and got[1]["ratio_p50"] == pytest.approx(0.8)
