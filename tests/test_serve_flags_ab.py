"""benchmarks/serve_flags_ab.py: the flags of a variant become the settings they give, and a
variant's rounds their means (the servers themselves are `pdserve plan --verify`'s, tested in
tests/test_plan_verify*.py)."""

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
