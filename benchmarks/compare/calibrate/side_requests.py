"""The requests `bench compare` sends beside a mode's warm-up, each to measure one thing the
warm-up cannot: the serving hop (`hop_specs`) and a prompt's cost by length (`shape_specs`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from costmodel.workloads import RequestSpec
from engine.config import PROMPT_STEP_TOKENS

SHAPE_FRACTIONS = (0.25, 0.5)
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


def hop_specs(warmup: Sequence[RequestSpec], n: int = 4, spacing_s: float = 0.4) -> list[RequestSpec]:
    """`n` short requests, one at a time, on a warm server: the first chat of the warm-up (its text,
    so no timed prompt lands in the prefix cache), two tokens each."""
    chat = next((s for s in warmup if s.kind == "chat"), warmup[0])
    return [replace(chat, request_id=f"hop-{i}", max_tokens=2, arrival_s=i * spacing_s) for i in range(n)]


def shape_specs(fresh: Sequence[RequestSpec], fractions: Sequence[float] = SHAPE_FRACTIONS) -> list[RequestSpec]:
    """Lone prompts at `fractions` of the longest document's length (the start of its text, or
    of its token ids), and at SHAPE_BELOW_PROMPT_THREADS of PROMPT_STEP_TOKENS where the document
    is longer, `SHAPE_DECODE_TOKENS` output tokens each, to send one at a time inside the
    recording. A warm-up's documents all have one length, so its prompt steps cannot tell a
    prompt's per-token cost from its attention (linear from quadratic): a fit of two 300-token
    steps priced a 512-token prompt at 1.8 s against ~0.9 s. `fresh`: specs whose text the server has not seen (no
    prefix-cache hit)."""
    doc = max(fresh, key=lambda s: s.prompt_len)
    below = [PROMPT_STEP_TOKENS * f / doc.prompt_len for f in SHAPE_BELOW_PROMPT_THREADS]
    out = []
    for i, f in enumerate([*fractions, *(f for f in below if f < min(fractions, default=1.0))]):
        if isinstance(doc.prompt, str):  # text: its first whole words
            words = doc.prompt.split()
            prompt: str | tuple[int, ...] = " ".join(words[: max(1, int(len(words) * f))])
        else:
            prompt = doc.prompt[: max(1, int(len(doc.prompt) * f))]
        n = max(1, int(doc.prompt_len * f))
        out.append(
            replace(
                doc, request_id=f"shape-{i}", prompt=prompt, prompt_len=n, max_tokens=SHAPE_DECODE_TOKENS, arrival_s=0.0
            )
        )
    return out
