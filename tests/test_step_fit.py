"""The step-cost fit (costmodel/fit/step_fit.py): fitting, online refinement, calibration files, CLI."""

import json
import math
import random
from dataclasses import replace

import pytest

from costmodel.article import cost_model as cm
from costmodel.fit.step_fit import OnlineStepFit, StepCostFit, StepShape, fit
from costmodel.sim.engine import Request, StepModel

# fixed, per token, per prompt pair, per sequence; a decode pair ~30x a prompt pair (50x measured on CPU);
# a prompt step's own path and a prompt item's context read (~14 ms and ~17 us on the 2-core CPU VM)
TRUE = StepCostFit(
    0.005, 90e-6, 0.03e-9 * 1e3, 800e-6, decode_attention_s=1e-6, per_prompt_s=0.004, context_read_s=5e-6
)


def _samples(truth: StepCostFit, n: int = 80, noise: float = 0.03, seed: int = 0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ctxs = [rng.randint(16, 900) for _ in range(rng.choice([0, 1, 4, 8]))]
        chunks = (
            [(rng.choice([0, 256, 1024]), rng.choice([16, 128, 512, 2048]))] if rng.random() < 0.7 or not ctxs else []
        )
        s = StepShape.of(ctxs, chunks)
        out.append((s, truth.seconds(s) * (1 + rng.uniform(-noise, noise))))
    return out


def test_shape_attention_is_the_score_block_each_item_computes():
    whole = StepShape.of((), [(0, 2048)])
    parts = [StepShape.of((), [(s, 512)]) for s in range(0, 2048, 512)]
    assert whole.attention_pairs == 2048**2  # the article's T^2
    assert sum(p.attention_pairs for p in parts) == 512 * (512 + 1024 + 1536 + 2048)  # chunks skip the triangle
    assert StepShape.of([100]).attention_pairs == 101  # a decode token at context 100


def test_decode_pairs_are_priced_apart_from_prompt_pairs():
    """A decode row reads its whole cached context (memory-bound): one price for both kinds of pair,
    pinned by the prompts' millions, prices a long-context decode step short; the split does not."""
    samples = _samples(TRUE, 200)
    shared = [
        (StepShape(s.prefill_tokens, s.attention_pairs, s.decode_seqs, 0.0, s.prefill_seqs, s.prefill_reads), y)
        for s, y in samples
    ]
    long_decode = StepShape.of([1024] * 3)
    assert fit(samples).seconds(long_decode) == pytest.approx(TRUE.seconds(long_decode), rel=0.05)
    assert fit(shared).seconds(long_decode) < 0.9 * TRUE.seconds(long_decode)
    # a worker log without the split: certain only where a step holds no prompt
    assert StepShape.reported(0, 500.0, 4, None).decode_pairs == 500
    assert StepShape.reported(128, 9000.0, 4, None).decode_pairs == 0
    assert StepShape.reported(128, 9000.0, 4, 500).features()[2:4] == (8500.0, 500.0)


def test_a_prompt_step_and_its_context_read_are_priced():
    """Each step of a prompt chunk pays the prompt path and each chunk re-reads its whole context:
    chunking a prompt finer costs more than its tokens and pairs say, most at deep starts."""
    s = StepShape.of([100, 200], [(0, 64), (960, 64)])
    assert (s.prefill_seqs, s.prefill_reads) == (2, 64 + 1024)
    without = replace(TRUE, per_prompt_s=0.0, context_read_s=0.0)

    def finer_costs(f: StepCostFit) -> float:  # 16 chunks of 64 against 4 of 256
        return sum(f.seconds(StepShape.of((), [(st, 64)])) for st in range(0, 1024, 64)) - sum(
            f.seconds(StepShape.of((), [(st, 256)])) for st in range(0, 1024, 256)
        )

    reads = 64 * sum(range(1, 17)) - 256 * sum(range(1, 5))  # context tokens the chunks read
    extra = 12 * TRUE.per_prompt_s + reads * TRUE.context_read_s  # 12 more items, and their reads
    assert finer_costs(TRUE) - finer_costs(without) == pytest.approx(extra)
    # a log without the items (a worker of an earlier version) is read as one item per prompt step
    old = StepShape.reported(64, 64 * 1024 + 300.0, 2, 300.0)
    assert (old.prefill_seqs, old.prefill_reads) == (1, 1024)
    assert StepShape.reported(0, 300.0, 2, 300.0).prefill_seqs == 0


def test_prompts_batched_in_one_step_pay_the_prompt_path_once():
    """Measured on the model's forward (`python -m benchmarks.prompt_items`, 2026-12-06): four
    37-token prompts in one step took what one 148-token prompt did (199 and 205 ms). A fit from
    lone prompts alone cannot tell a per-step cost from a per-prompt one; priced per prompt, four
    chats sent together were predicted at 300 ms where they took ~205."""
    four, one = StepShape.of((), [(0, 37)] * 4), StepShape.of((), [(0, 148)])
    assert four.features()[5] == one.features()[5] == 1.0
    assert StepShape.of([40, 50]).features()[5] == 0.0  # a decode step has no prompt path
    gap = TRUE.seconds(one) - TRUE.seconds(four)  # the whole prompt's extra pairs, nothing per prompt
    assert gap == pytest.approx(TRUE.attention_s * (148**2 - 4 * 37**2) + TRUE.context_read_s * (148 - 4 * 37))
    # the simulator's fast path prices the same
    mixed = StepShape.of([40, 50], [(0, 37)] * 4)
    assert TRUE.step_seconds(2, 92.0, [(0, 37)] * 4) == pytest.approx(TRUE.seconds(mixed))
    assert TRUE.step_seconds(2, 92.0) == pytest.approx(TRUE.seconds(StepShape.of([40, 50])))


def test_fit_recovers_the_terms_within_noise():
    f = fit(_samples(TRUE))
    for got, want in zip(f.coef, TRUE.coef):
        assert got == pytest.approx(want, rel=0.15)
    assert f.rms_rel_error < 0.03
    # and prices a long prompt, the figure a single FLOP rate got wrong by 2.6x
    assert f.prefill_seconds(2048) == pytest.approx(TRUE.prefill_seconds(2048), rel=0.03)


def test_fit_adds_up_to_the_measured_steps_where_they_scatter():
    """Steps jittering +-15% (lognormal, as a shared CPU's do): least squares on relative error alone
    prices them ~4% under their mean; a stream's latency is their sum, so the fit keeps the sum."""
    rng = random.Random(5)
    samples = [(s, y / (1 + rng.uniform(-0.03, 0.03)) * math.exp(rng.gauss(0, 0.15))) for s, y in _samples(TRUE, 400)]
    f = fit(samples)
    assert sum(f.seconds(s) for s, _ in samples) == pytest.approx(sum(y for _, y in samples), rel=1e-9)
    assert f.seconds(StepShape.of([300] * 8)) == pytest.approx(TRUE.seconds(StepShape.of([300] * 8)) * 1.011, rel=0.03)
    assert 0.1 < f.rms_rel_error < 0.2


def test_fit_is_non_negative():
    no_attention = StepCostFit(0.004, 50e-6, 0.0, 300e-6)
    f = fit(_samples(no_attention, noise=0.05, seed=3))
    assert min(f.coef) >= 0


def test_online_fit_follows_recent_steps_and_keeps_unexercised_terms():
    slower = TRUE.scaled(1.5)
    online = OnlineStepFit(TRUE, half_life=100)
    for s, y in _samples(slower, n=400, noise=0.0, seed=1):
        online.observe(s, y)
    f = online.refit()
    probe = StepShape.of([300] * 8, [(0, 512)])
    assert f.seconds(probe) == pytest.approx(slower.seconds(probe), rel=0.1)
    # decode-only steps at one context say nothing about attention: the prior's value stays
    decode_only = OnlineStepFit(TRUE)
    for _ in range(100):
        s = StepShape.of([500] * 8)
        decode_only.observe(s, TRUE.seconds(s))
    assert decode_only.refit().attention_s == pytest.approx(TRUE.attention_s, rel=0.05)


def test_calibration_round_trip_and_validation(tmp_path):
    f = fit(_samples(TRUE))
    cal = cm.Calibration(device="cpu", dtype="fp32", peak_tflops=0.1, step_fit=f.to_dict())
    p = tmp_path / "cal.json"
    p.write_text(json.dumps(cal.to_dict()))
    back = cm.Calibration.load(p).fitted_steps()
    assert back is not None and back.coef == pytest.approx(f.coef)
    with pytest.raises(ValueError, match="step_fit"):
        cm.Calibration.from_dict({"step_fit": {"fixed_ms": 1.0}})
    # a file from before decode pairs were priced apart prices them as it did: at the prompt's rate
    old = {"fixed_ms": 1.0, "per_token_us": 1.0, "attention_ns_per_pair": 2.0, "per_sequence_us": 1.0}
    assert StepCostFit.from_dict(old).decode_attention_s == pytest.approx(2e-9)
    # ... and a prompt item and its context read at nothing, as it did
    assert StepCostFit.from_dict(old).per_prompt_s == StepCostFit.from_dict(old).context_read_s == 0.0
    with pytest.raises(ValueError, match=">= 0"):
        cm.Calibration.from_dict(
            {"step_fit": {"fixed_ms": -1, "per_token_us": 1, "attention_ns_per_pair": 0, "per_sequence_us": 1}}
        )


def test_simulator_prices_steps_with_the_fit():
    steps = StepModel(cm.ModelSpec.resolve("tiny"), cm.HARDWARE["h100"], fit=TRUE)
    batch = [Request(i, "chat", 0, 300, 10) for i in range(8)]
    mixed = steps.step(batch, [(0, 512)])
    assert mixed == pytest.approx(TRUE.seconds(StepShape.of([300] * 8, [(0, 512)])))
    assert steps.prefill(2048) == pytest.approx(TRUE.prefill_seconds(2048))


def test_cost_cli_shows_the_fitted_terms(tmp_path, capsys):
    from cli import main

    cal = cm.Calibration(device="cpu", dtype="fp32", peak_tflops=0.1, step_fit=TRUE.to_dict(), source="test")
    p = tmp_path / "cal.json"
    p.write_text(json.dumps(cal.to_dict()))
    assert main(["cost", "--config", "tiny", "--calibration", str(p), "--weight-dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    assert "Measured step cost" in out and "us/token" in out and "ns/prompt attention pair" in out
    assert main(["cost", "--config", "tiny", "--calibration", str(p), "--weight-dtype", "fp32", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["step_fit"]["terms"]["fixed_ms"] == pytest.approx(5.0)


def test_a_context_read_is_fitted_only_where_prompt_contexts_differ():
    """Chats that all read a 37-token context cannot tell a context token's read from a prompt item's
    own cost: the read is left out, not priced at 387 us a token (which would make a deep chunk dear)."""
    rng = random.Random(7)
    samples = []
    for _ in range(60):
        s = StepShape.of(
            [rng.randint(50, 400) for _ in range(rng.randint(1, 6))], [(0, 37)] if rng.random() < 0.5 else []
        )
        samples.append((s, TRUE.seconds(s) * rng.uniform(0.99, 1.01)))
    f = fit(samples)
    assert f.context_read_s == 0.0 and f.per_prompt_s > 0
    assert f.seconds(StepShape.of([200] * 2, [(0, 37)])) == pytest.approx(
        TRUE.seconds(StepShape.of([200] * 2, [(0, 37)])), rel=0.05
    )


def test_the_simulators_fast_price_is_the_shapes_price():
    """StepCostFit.step_seconds (what the simulator calls per step) prices what seconds(StepShape.of(...)) does."""
    rng = random.Random(3)
    f = StepCostFit.of_coef([5e-3, 1e-4, 3e-9, 2e-9, 1e-3, 4e-4, 2e-8])
    for _ in range(50):
        ctxs = [rng.randint(0, 3000) for _ in range(rng.randint(0, 9))]
        chunks = [(rng.randint(0, 2000), rng.randint(1, 512)) for _ in range(rng.randint(0, 3))]
        pairs = sum(c + 1 for c in ctxs)
        assert f.step_seconds(len(ctxs), pairs, chunks) == pytest.approx(f.seconds(StepShape.of(ctxs, chunks)))
