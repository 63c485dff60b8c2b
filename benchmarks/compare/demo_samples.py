"""A few real answers from a served model, for `bench compare`'s report (and `make demo`).

Numbers alone do not say the server serves a real model; a person reads answers. Each mode's
server is asked the same short questions (chat, greedy), so the report shows the answers and
whether every mode gave the same ones.
"""

from __future__ import annotations

import asyncio
from typing import Any

QUESTIONS = ("What is the capital of France?", "Name the three primary colors.", "In one sentence, what is a GPU?")
MAX_TOKENS = 48


async def _ask_all(base_url: str, model: str, questions: tuple[str, ...]) -> list[dict[str, Any]]:
    from openai import AsyncOpenAI  # noqa: PLC0415

    client = AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600)
    try:
        out = []
        for q in questions:  # one at a time: the answers, not the load, are the point
            r = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": q}], temperature=0, max_tokens=MAX_TOKENS
            )
            out.append(
                {
                    "question": q,
                    "answer": r.choices[0].message.content,
                    "finish_reason": r.choices[0].finish_reason,
                    "tokens": r.usage.completion_tokens if r.usage else None,
                }
            )
        return out
    finally:
        await client.close()


def ask(base_url: str, model: str, questions: tuple[str, ...] = QUESTIONS) -> list[dict[str, Any]]:
    return asyncio.run(_ask_all(base_url, model, questions))


def report_section(modes: list[dict[str, Any]]) -> list[str]:
    """Markdown lines: the first mode's answers, and whether every other mode answered the same."""
    with_samples = [m for m in modes if m.get("samples")]
    if not with_samples:
        return []
    ref = with_samples[0]
    same = [m["label"] for m in with_samples[1:] if m["samples"] == ref["samples"]]
    differ = [m["label"] for m in with_samples[1:] if m["samples"] != ref["samples"]]
    lines = [
        "## Real outputs",
        "",
        f"Chat completions (greedy, at most {MAX_TOKENS} tokens) from the {ref['label']} server, asked before "
        "its timed run:",
        "",
    ]
    for s in ref["samples"]:
        answer = " ".join(str(s["answer"]).split())
        lines += [f"- **{s['question']}** {answer} *({s['tokens']} tokens, {s['finish_reason']})*"]
    lines.append("")
    if same or differ:
        lines.append(
            f"Same answers from: {', '.join(same) or 'none'}."
            + (f" Different answers from: {', '.join(differ)}." if differ else "")
        )
        lines.append("")
    return lines


__all__ = ["QUESTIONS", "ask", "report_section"]
