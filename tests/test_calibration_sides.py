"""What a `bench compare` calibration reads beside its fit: a decode step's slowdown beside a
prefill (against lone steps of the same batch), and the lone prompts sent beside the warm-up to give
the fit prompts of other lengths and thread counts. Hand-made steps and request specs."""

from __future__ import annotations

import pytest

from benchmarks.client.logged_step import LoggedStep
from costmodel.fit.step_fit import StepCostFit, StepShape
from costmodel.workloads import RequestSpec


def test_the_slowdown_beside_a_prefill_is_read_against_lone_steps_of_the_same_batch():
    from benchmarks.compare.calibrate.calibration import beside_prefill_slowdown

    # one and two streams both run 15 ms alone (as the demo's did); a fit linear in the batch
    # prices two at 18 ms, so their steps beside a prefill at 16.5 ms would read 0.92x, not 1.1x
    linear = StepCostFit(0.006, 0.0, 0.0, 0.006)  # 12 ms for one stream, 18 for two
    steps, t = [], 100.0
    for seqs in (1, 2):
        for _ in range(5):
            t += 0.015
            steps.append(LoggedStep("decode-0", "decode", StepShape.of([50] * seqs), 0.015, t))
    for _ in range(5):
        t += 0.0165
        steps.append(LoggedStep("decode-0", "decode", StepShape.of([50] * 2), 0.0165, t))
        steps.append(LoggedStep("prefill-0", "prefill", StepShape.of((), [(0, 300)]), 0.0165, t))
    assert beside_prefill_slowdown(steps, linear) == pytest.approx(1.1, rel=0.01)
    no_lone_kin = [x for x in steps if x.role == "prefill" or x.shape.decode_seqs == 2 and x.seconds > 0.015]
    assert beside_prefill_slowdown(no_lone_kin, linear) == 1.0  # against the fit: 0.92x, floored at 1


def test_shape_requests_are_excerpts_of_the_longest_document_none_a_prefix_of_another():
    from benchmarks.compare.calibrate.side_requests import shape_specs

    chat = RequestSpec("chat-0", "hi there", 2, 8, 0.0, "chat")
    doc = RequestSpec("doc-0", " ".join(f"w{i}" for i in range(400)), 400, 4, 1.5, "doc")
    got = shape_specs([chat, doc])
    assert [(s.prompt_len, len(str(s.prompt).split()), s.max_tokens, s.arrival_s) for s in got] == [
        (100, 100, 16, 0.0),
        (200, 200, 16, 0.0),
        (360, 360, 16, 0.0),
        (400, 400, 16, 0.0),  # the document's length alone, other text: the prompt threads' steps
        (64, 64, 16, 0.0),  # under the prompt threads' 256 tokens, shorter than the fractions give
    ]
    # cut from one start, each shorter prompt was a cached prefix of a longer one sent before it
    firsts = [str(s.prompt).split()[0] for s in got]
    assert len(set(firsts)) == len(got)
    ids = shape_specs([RequestSpec("doc-1", tuple(range(64)), 64, 4, 0.0, "doc")], fractions=(0.5,))
    assert ids[0].prompt == tuple(range(32)) and ids[0].request_id == "shape-0" and len(ids) == 1
    # a long document's fractions all run on the prompt threads: one-thread prompts beside them
    long = shape_specs([RequestSpec("doc-2", tuple(range(2048)), 2048, 4, 0.0, "doc")])
    assert [s.prompt_len for s in long] == [512, 1024, 1843, 2048, 64, 128, 192]
    assert [len(s.prompt) for s in long] == [512, 1024, 1843, 2048, 64, 128, 192]
    assert len({s.prompt[0] for s in long}) == len(long)  # type: ignore[index]


def test_prefix_requests_extend_one_cached_prompt_alone_then_several_at_once():
    from benchmarks.compare.calibrate.side_requests import PREFIX_BASE, PREFIX_TOGETHER, prefix_specs

    doc = RequestSpec("doc-0", tuple(range(2048)), 2048, 4, 0.0, "doc")
    base, alone, together = prefix_specs([doc])
    assert [s.request_id for s in base] == ["prefix-base"] and len(alone) == 1 and len(together) == PREFIX_TOGETHER
    head = base[0].prompt
    assert len(head) == base[0].prompt_len == PREFIX_BASE
    for s in alone + together:
        assert s.prompt[: len(head)] == head and s.prompt_len == len(s.prompt) > len(head)  # type: ignore[index]
        assert s.arrival_s == 0.0 and s.max_tokens == 16
    assert len({s.prompt for s in alone + together}) == 1 + PREFIX_TOGETHER  # each its own tail
    text = RequestSpec("doc-1", " ".join(f"w{i}" for i in range(1000)), 1000, 4, 0.0, "doc")
    base, alone, _ = prefix_specs([text])
    assert str(alone[0].prompt).startswith(str(base[0].prompt) + " ")


def test_a_prompt_fit_on_a_handful_of_steps_drops_one_disturbed_step():
    from costmodel.fit.step_fit import fit_beside

    base = StepCostFit(0.014, 0.0012, 0.0, 0.0005, per_prompt_s=0.015)
    two_threads = StepCostFit(0.014, 0.0007, 5e-10, 0.0005, per_prompt_s=0.015)
    steps = [
        (StepShape.of([], [(0, n)]), two_threads.seconds(StepShape.of([], [(0, n)]))) for n in (300, 560, 1300, 1500)
    ]
    clean = fit_beside(steps, base)
    shape = StepShape.of([], [(0, 300)])
    disturbed = [(steps[0][0], steps[0][1] * 1.58), *steps[1:]]  # the router's core was busy for one
    assert fit_beside(disturbed, base).seconds(shape) == pytest.approx(clean.seconds(shape), rel=0.02)
    assert fit_beside(disturbed, base).samples == 3
    # fewer steps than that: each is kept (nothing to tell a disturbed one from)
    kept = fit_beside(disturbed[:3], base)
    assert kept.samples == 3 and kept.seconds(shape) > 1.05 * clean.seconds(shape)
