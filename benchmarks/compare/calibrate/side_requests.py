"""The requests `bench compare` sends beside a mode's warm-up, each to measure one thing the
warm-up cannot: the serving hop (`hop_specs`), a prompt's cost by length (`shape_specs`) and a
prompt's cost past a cached prefix, alone and several in one step (`prefix_specs`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from costmodel.workloads import RequestSpec
from engine.config import PROMPT_STEP_TOKENS

# lone prompts at these fractions of the longest document: the longer two give a colocated server's
# prompt threads steps alone, beside the warm-up's few documents (the demo's warm-up had two such
# steps, one of them disturbed: `step_fit.fit_beside`)
SHAPE_FRACTIONS = (0.25, 0.5, 0.9, 1.0)
# ... and lone prompts shorter than the steps a server runs on its prompt threads (a colocated
# server gives steps of PROMPT_STEP_TOKENS or more the router's core too): a warm-up whose every
# prompt is that long leaves the one-thread price of a prompt token to the decode steps, and a
# workload whose cached prefixes leave 64-255 tokens to compute then ran its prompt steps at
# 0.62-0.79x that price (plan-verify-chat-prefix-warm-u, 2026-12-06)
SHAPE_BELOW_PROMPT_THREADS = (0.25, 0.5, 0.75)
# tokens each lone prompt generates: its decode steps run alone at a long context, which the
# warm-up's own steps rarely do (the article's documents answer in a few tokens, its chats are
# short), so they tell a decode row's attention over its context (~5 us a pair on the 2-core CPU)
# from its fixed per-row cost. A fit without them priced a 1,024-token context's decode pairs
# at 2x (two workers' calibration, 2026-12-05)
SHAPE_DECODE_TOKENS = 16
# prompts past a cached prefix (`prefix_specs`): the prefix's tokens, the tails' (one alone, then
# PREFIX_TOGETHER at once)
PREFIX_BASE = 192
PREFIX_TAILS = (64, 32, 96, 48)
PREFIX_TOGETHER = 3


def hop_specs(warmup: Sequence[RequestSpec], n: int = 4, spacing_s: float = 0.4) -> list[RequestSpec]:
    """`n` short requests, one at a time, on a warm server: the first chat of the warm-up (its text,
    so no timed prompt lands in the prefix cache), two tokens each."""
    chat = next((s for s in warmup if s.kind == "chat"), warmup[0])
    return [replace(chat, request_id=f"hop-{i}", max_tokens=2, arrival_s=i * spacing_s) for i in range(n)]


def shape_specs(fresh: Sequence[RequestSpec], fractions: Sequence[float] = SHAPE_FRACTIONS) -> list[RequestSpec]:
    """Lone prompts at `fractions` of the longest document's length, and at SHAPE_BELOW_PROMPT_THREADS
    of PROMPT_STEP_TOKENS where the document is longer, `SHAPE_DECODE_TOKENS` output tokens each, to
    send one at a time inside the recording. A warm-up's documents all have one length, so its prompt
    steps cannot tell a prompt's per-token cost from its attention (linear from quadratic): a fit of
    two 300-token steps priced a 512-token prompt at 1.8 s against ~0.9 s. Each starts at another
    place in the document's text (`_excerpt`): cut from its start, every shorter one was a prefix of
    a longer one sent before it, and the prefix cache left it a few tokens to compute (the 64-192
    token prompts of `compare-chat24-v` computed 3-16). `fresh`: specs whose text the server has not
    seen."""
    doc = max(fresh, key=lambda s: s.prompt_len)
    below = [PROMPT_STEP_TOKENS * f / doc.prompt_len for f in SHAPE_BELOW_PROMPT_THREADS]
    lengths = [*fractions, *(f for f in below if f < min(fractions, default=1.0))]
    return [
        _lone(doc, f"shape-{i}", _excerpt(doc.prompt, i / len(lengths), f), max(1, int(doc.prompt_len * f)))
        for i, f in enumerate(lengths)
    ]


def prefix_specs(fresh: Sequence[RequestSpec]) -> list[list[RequestSpec]]:
    """Prompts past a cached prefix, in groups to send one after another inside the recording: a
    lone prompt of PREFIX_BASE tokens, then alone one that extends it by a tail, then PREFIX_TOGETHER
    at once that extend it by other tails (one step, several prompt items, each reading the cached
    prefix). A warm-up without shared prefixes gives the fit no such step, and its price of a prompt
    item and of a cached context read is a guess: a shared-prefix chat's prompt steps ran at
    0.74-0.86x that price (`plan-verify-chat-prefix-warm-{w,x}`, 2026-12-06)."""
    doc = max(fresh, key=lambda s: s.prompt_len)
    f = min(1.0, PREFIX_BASE / doc.prompt_len)
    base = _excerpt(doc.prompt, 0.5, f)
    tails = [_excerpt(doc.prompt, 0.1 * (i + 1), t / doc.prompt_len) for i, t in enumerate(PREFIX_TAILS)]
    n = max(1, int(doc.prompt_len * f))
    whole = [
        _lone(doc, f"prefix-{i}", _joined(base, tail), n + t) for i, (tail, t) in enumerate(zip(tails, PREFIX_TAILS))
    ]
    return [[_lone(doc, "prefix-base", base, n)], whole[:1], whole[1 : 1 + PREFIX_TOGETHER]]


def _lone(doc: RequestSpec, request_id: str, prompt: str | tuple[int, ...], n: int) -> RequestSpec:
    return replace(
        doc, request_id=request_id, prompt=prompt, prompt_len=n, max_tokens=SHAPE_DECODE_TOKENS, arrival_s=0.0
    )


def _excerpt(prompt: str | tuple[int, ...], at: float, share: float) -> str | tuple[int, ...]:
    """`share` of `prompt` starting `at` (a share) of the way in, wrapping round: text by whole words,
    token ids by ids."""
    if isinstance(prompt, str):
        words = prompt.split()
        start, k = int(len(words) * at), max(1, int(len(words) * share))
        return " ".join((words[start:] + words[:start])[:k])
    start, k = int(len(prompt) * at), max(1, int(len(prompt) * share))
    return (prompt[start:] + prompt[:start])[:k]


def _joined(head: str | tuple[int, ...], tail: str | tuple[int, ...]) -> str | tuple[int, ...]:
    if isinstance(head, str) and isinstance(tail, str):
        return f"{head} {tail}"
    assert isinstance(head, tuple) and isinstance(tail, tuple)  # one document's excerpts: one kind
    return head + tail
