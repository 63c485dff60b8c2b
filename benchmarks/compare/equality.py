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
from dataclasses import dataclass
from typing import Any

from benchmarks.compare.record import ModeRun
from costmodel.workloads import RequestSpec

# A greedy choice whose top-2 logprob margin is below this (nats) is a near-tie: a real model's
# FP8 KV, quantized from activations that differ in the last bits between batch shapes and chunk
# sizes, may flip it, and the two continuations then differ from there on. Random-weight presets
# are scaled so greedy margins are far larger (engine/checkpoint/weights.py), so for them any flip is a bug.
NEAR_TIE_NATS = 0.25


@dataclass
class GreedyPass:
    """What the equality pass got back, by request id."""

    token_ids: dict[str, list[int]]  # from pdserve.timeline.token_ids; [] where the server sends none
    margins: dict[str, list[float | None]]  # top-2 logprob margin of each generated token
    texts: dict[str, str]  # the text: the only witness a server without token ids gives


async def equality_pass(
    base_url: str, model: str, specs: list[RequestSpec], api_key: str = "none", logprobs: int | None = 2
) -> GreedyPass:
    """Every request at once, non-streamed, greedy. It runs after the timed run, so with prefix
    caching on its prompts are cached: its KV transfers say nothing, the timed run's are reported.
    `logprobs=None` for servers pdserve did not start: the margins only matter for a reference."""
    from openai import AsyncOpenAI  # noqa: PLC0415

    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600)

    async def one(s: RequestSpec) -> tuple[str, list[int], list[float | None], str]:
        prompt = list(s.prompt) if isinstance(s.prompt, tuple) else s.prompt
        resp = await client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=s.max_tokens,
            temperature=0,
            # logprobs rides in the body: the same JSON as the parameter, and absent when None
            extra_body={"ignore_eos": True, **({"logprobs": logprobs} if logprobs is not None else {})},
        )
        tl = ((resp.model_extra or {}).get("pdserve") or {}).get("timeline") or {}
        lp = resp.choices[0].logprobs
        tops = (lp.top_logprobs or []) if lp is not None else []
        margins = [_margin(t) for t in tops]
        return s.request_id, list(tl.get("token_ids") or []), margins, resp.choices[0].text or ""

    try:
        out = await asyncio.gather(*(one(s) for s in specs))
    finally:
        await client.close()
    return GreedyPass({o[0]: o[1] for o in out}, {o[0]: o[2] for o in out}, {o[0]: o[3] for o in out})


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


def check_endpoints(reference: ModeRun | None, endpoints: list[ModeRun]) -> dict[str, dict[str, Any]]:
    """Each server pdserve did not start against the reference mode, by token ids where it sent
    them (a pdserve server does), else by greedy text. Informational: another model, tokenizer or
    precision answers differently and is not wrong, so this never fails the run."""
    out = {}
    for run in endpoints:
        row: dict[str, Any] = {"reference": reference.spec.label if reference else None, "identical": None}
        pass_error = (run.endpoint or {}).get("equality_pass_error")
        if run.error is not None:
            row["note"] = "the endpoint failed"
        elif reference is None:
            row["note"] = "no pdserve mode ran to compare with"
        elif pass_error:
            row["note"] = f"its equality pass failed: {pass_error}"
        else:
            mine: dict[str, Any]
            theirs: dict[str, Any]
            if run.token_ids:
                mine, theirs = run.token_ids, reference.token_ids
                row["how"] = "greedy token ids (pdserve.timeline.token_ids), request by request"
            else:
                mine, theirs = run.greedy_texts or {}, reference.greedy_texts or {}
                row["how"] = "greedy text, request by request (the server returns no token ids)"
            differ = [rid for rid, want in theirs.items() if mine.get(rid) != want]
            row.update(identical=not differ, compared=len(theirs), differing=len(differ), examples=differ[:10])
        out[run.spec.label] = row
    return out
