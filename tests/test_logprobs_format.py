"""Logprobs wire formats and the pure tensor function behind them (no model, no server)."""

from __future__ import annotations

import math

import torch

from benchmarks.compare.demo_samples import report_section
from engine.checkpoint.tokenizer import ByteTokenizer
from engine.runner.logprobs import token_logprobs
from engine.sequence import TokenLogprob
from router.openai import logprobs_format as lpf


def test_token_logprobs_against_log_softmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g) * 4
    ids = torch.tensor([7, 0, 49])
    chosen, top_ids, top_lp = token_logprobs(logits, ids, 4)
    ref = torch.log_softmax(logits, -1)
    assert torch.allclose(chosen, ref[torch.arange(3), ids])
    assert torch.equal(top_ids, ref.topk(4, -1).indices) and torch.allclose(top_lp, ref.topk(4, -1).values)
    assert top_ids.device == logits.device and token_logprobs(logits, ids, 0)[1].shape == (3, 0)
    assert math.isclose(float(torch.logsumexp(ref[0], 0)), 0.0, abs_tol=1e-5)


def test_completion_format_with_echo():
    tok = ByteTokenizer()
    prompt = [ord("h"), ord("i")]
    gen = [TokenLogprob(ord("!"), -0.5, ((ord("!"), -0.5), (ord("?"), -1.5)))]
    echo = lpf.merge_completion(
        lpf.first_prompt_entry(prompt, tok),
        lpf.completion_logprobs([None, TokenLogprob(ord("i"), -2.0, ((ord("i"), -2.0),))][1:], tok),
    )
    out = lpf.merge_completion(echo, lpf.completion_logprobs(gen, tok))
    assert out["tokens"] == ["h", "i", "!"]
    assert out["token_logprobs"] == [None, -2.0, -0.5]
    assert out["top_logprobs"] == [None, {"i": -2.0}, {"!": -0.5, "?": -1.5}]


def test_chat_format_bytes_are_exact():
    tok = ByteTokenizer()
    e = "é".encode()  # two byte tokens, each half a character
    content = lpf.chat_logprobs([TokenLogprob(e[0], -0.1, ((e[0], -0.1),)), TokenLogprob(e[1], -0.2)], tok)["content"]
    assert bytes(content[0]["bytes"] + content[1]["bytes"]).decode() == "é"
    assert content[0]["top_logprobs"][0]["logprob"] == -0.1 and content[1]["top_logprobs"] == []


def test_report_section_shows_answers_and_agreement():
    s = [{"question": "Q?", "answer": "A.", "finish_reason": "stop", "tokens": 2}]
    lines = report_section(
        [
            {"label": "colocated", "samples": s},
            {"label": "disagg-1P1D", "samples": s},
            {"label": "tiny-run", "samples": None},
        ]
    )
    text = "\n".join(lines)
    assert "**Q?** A." in text and "Same answers from: disagg-1P1D" in text
    assert report_section([{"label": "x", "samples": None}]) == []
