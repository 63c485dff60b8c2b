"""The greedy equality pass of `pdserve bench compare`: the same requests must give the same tokens.

Every serving mode runs the same model with greedy decoding, so a difference in token ids is a
bug in scheduling, chunking or the KV transfer, unless the reference's choice was a near-tie
that FP8 rounding may flip (`NEAR_TIE_NATS`). The pass sends every request of the workload at
once, non-streamed; the token ids come back in `pdserve.timeline.token_ids`. A mismatch is
printed loudly and the command exits 1. The pass runs after the timed run, so its burst and its
prefix-cache hits shape nothing that is timed.
"""

from __future__ import annotations

import asyncio
from typing import Any

from benchmarks.compare_record import ModeRun
from costmodel.workloads import RequestSpec

# A greedy choice whose top-2 logprob margin is below this (nats) is a near-tie: a real model's
# FP8 KV, quantized from activations that differ in the last bits between batch shapes and chunk
# sizes, may flip it, and the two continuations then differ from there on. Random-weight presets
# are scaled so greedy margins are far larger (engine/weights.py), so for them any flip is a bug.
NEAR_TIE_NATS = 0.25


async def equality_pass(base_url: str, model: str, specs: list[RequestSpec]) -> tuple[dict, dict]:
    """Every request at once, non-streamed, greedy: (token ids by request id, top-2 logprob margin
    of each generated token by request id). It runs after the timed run, so with prefix caching on
    its prompts are cached: its KV transfers say nothing, the timed run's are reported."""
    from openai import AsyncOpenAI  # noqa: PLC0415

    client = AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600)

    async def one(s: RequestSpec) -> tuple[str, list[int], list[float | None]]:
        prompt = list(s.prompt) if isinstance(s.prompt, tuple) else s.prompt
        resp = await client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=s.max_tokens,
            temperature=0,
            logprobs=2,
            extra_body={"ignore_eos": True},
        )
        tl = (resp.model_extra or {}).get("pdserve", {}).get("timeline", {})
        lp = resp.choices[0].logprobs
        tops = (lp.top_logprobs or []) if lp is not None else []
        margins = [_margin(t) for t in tops]
        return s.request_id, list(tl.get("token_ids", [])), margins

    try:
        out = await asyncio.gather(*(one(s) for s in specs))
    finally:
        await client.close()
    return {rid: ids for rid, ids, _ in out}, {rid: m for rid, _, m in out}


def _margin(top: dict[str, float] | None) -> float | None:
    """Top-1 minus top-2 logprob (None if two distinct alternatives are not known)."""
    values = sorted((top or {}).values(), reverse=True)
    return values[0] - values[1] if len(values) >= 2 else None


def check_equality(runs: list[ModeRun]) -> dict[str, Any]:
    """Token ids of every request in every mode against the first mode that ran."""
    ok = [r for r in runs if r.error is None]
    if len(ok) < 2:
        return {
            "reference": ok[0].spec.label if ok else None,
            "identical": None,
            "compared": 0,
            "mismatches": [],
            "note": "fewer than two modes ran: nothing to compare",
        }
    ref = ok[0]
    mismatches, compared = [], 0
    for run in ok[1:]:
        for rid, want in ref.token_ids.items():
            got = run.token_ids.get(rid)
            compared += 1
            if got != want:
                first = next(
                    (i for i, (a, b) in enumerate(zip(want, got or [])) if a != b), min(len(want), len(got or []))
                )
                ref_margins = (ref.margins or {}).get(rid) or []
                margin = ref_margins[first] if first < len(ref_margins) else None
                mismatches.append(
                    {
                        "mode": run.spec.label,
                        "request_id": rid,
                        "first_difference": first,
                        "reference_len": len(want),
                        "got_len": len(got or []),
                        "reference_margin": None if margin is None else round(margin, 4),
                        "near_tie": margin is not None and margin < NEAR_TIE_NATS,
                    }
                )
    # The timed runs' streamed text is a second, weaker witness (lossy for invalid UTF-8 bytes).
    texts = {r.spec.label: {x.request_id: x.text for x in r.bench.records} for r in ok}
    text_diff = [
        (label, rid) for label, t in texts.items() for rid, s in t.items() if s != texts[ref.spec.label].get(rid)
    ]
    return {
        "reference": ref.spec.label,
        "identical": not mismatches,
        # every difference starts at a greedy near-tie of the reference (see NEAR_TIE_NATS)
        "only_near_ties": bool(mismatches) and all(m["near_tie"] for m in mismatches),
        "near_tie_nats": NEAR_TIE_NATS,
        "compared": compared,
        "requests": len(ref.token_ids),
        "modes": [r.spec.label for r in ok],
        "mismatches": mismatches,
        "timed_text_identical": not text_diff,
        "timed_text_differences": len(text_diff),
        "how": "greedy token ids from pdserve.timeline.token_ids of the equality pass (every request of "
        "the workload at once), compared request by request with the reference mode",
    }
