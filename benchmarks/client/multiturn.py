"""The multi-turn chat workload: one shared system prompt, conversations whose history grows turn
by turn (each turn's prompt = the previous prompt + its reply + a new user message).

Shared by `pdserve bench serve --workload multiturn` (one server, any pdserve deployment) and
`pdserve bench kvcache --part multiturn` (fresh servers for each cache/routing setting).
Prompts are token ids drawn in 32..126, valid on every model pdserve serves, so lengths are exact
whatever the tokenizer. The conversations of one run go concurrently; the turns of one
conversation go one after another, as a user waits for each reply.

Figures come from pdserve's per-request timeline (returned with each completion), so they are
the server's view: TTFT = arrival at the router to the first token; the prefix-cache hits on
each side; the KV bytes the decode worker pulled. Another server has no timeline: refused.
"""

from __future__ import annotations

import asyncio
import random
import statistics
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MultiTurnWorkload:
    conversations: int = 8
    turns: int = 4
    system_len: int = 384  # tokens of the system prompt every conversation starts with
    user_len: int = 32  # tokens of each new user message
    output_len: int = 32  # tokens of each reply (ignore_eos: exactly this many)
    seed: int = 0

    def validate(self) -> None:
        if min(self.conversations, self.turns, self.system_len, self.user_len, self.output_len) < 1:
            raise ValueError("multiturn: conversations, turns, system/user/output lengths must be >= 1")


class NoTimeline(ValueError):
    """The server returned no pdserve timeline (not a pdserve server)."""


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(32, 127) for _ in range(n)]


async def _conversation(client: Any, model: str, wl: MultiTurnWorkload, system: list[int], seed: float) -> list[dict]:
    rng, prompt, out = random.Random(seed), list(system), []
    for turn in range(1, wl.turns + 1):
        prompt += _tokens(rng, wl.user_len)
        resp = await client.completions.create(
            model=model, prompt=prompt, max_tokens=wl.output_len, temperature=0, extra_body={"ignore_eos": True}
        )
        tl = ((resp.model_extra or {}).get("pdserve") or {}).get("timeline")
        if tl is None:
            raise NoTimeline("--workload multiturn reads each request's pdserve timeline; this server sent none")
        out.append(
            {
                "turn": turn,
                "prompt_tokens": tl["prompt_tokens"],
                "ttft_ms": tl["first_token_ms"],
                # colocated: one pool, its hit is "cached_tokens"; disaggregated: one per side
                "prefill_cached_tokens": tl.get("prefill_cached_tokens", tl.get("cached_tokens", 0)),
                "decode_cached_tokens": tl.get("decode_cached_tokens", 0),
                "kv_blocks_pulled": tl.get("kv_blocks_pulled", 0),
                "kv_bytes": (tl.get("transfer") or {}).get("bytes", 0),
                "workers": [tl.get("prefill_worker"), tl.get("decode_worker")],
            }
        )
        prompt += tl["token_ids"]
    return out


async def run_chats(
    base_url: str, wl: MultiTurnWorkload, model: str | None = None, api_key: str = "none"
) -> list[dict]:
    """Every conversation against one server; one row per request (see _conversation)."""
    from openai import AsyncOpenAI  # noqa: PLC0415 - only the benchmarks that run it need the client

    rng = random.Random(wl.seed)
    system = _tokens(rng, wl.system_len)
    seeds = [rng.random() for _ in range(wl.conversations)]
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600)
    model = model or (await client.models.list()).data[0].id
    convs = await asyncio.gather(*(_conversation(client, model, wl, system, s) for s in seeds))
    return [r for c in convs for r in c]


def summarize(rows: list[dict], turns: int) -> dict[str, Any]:
    """TTFT p50 and KV bytes per request by turn and from turn 2 on; prefix hit rate per side."""
    by_turn = {}
    for t in range(1, turns + 1):
        rs = [r for r in rows if r["turn"] == t]
        by_turn[t] = {
            "ttft_p50_ms": statistics.median(r["ttft_ms"] for r in rs),
            "bytes_per_request": statistics.fmean(r["kv_bytes"] for r in rs),
        }
    later = [r for r in rows if r["turn"] >= 2] or rows
    prompt_tokens = sum(r["prompt_tokens"] for r in rows)
    return {
        "by_turn": by_turn,
        "ttft_p50_ms_turn2plus": statistics.median(r["ttft_ms"] for r in later),
        "bytes_per_request_turn2plus": statistics.fmean(r["kv_bytes"] for r in later),
        "prefill_hit_rate": sum(r["prefill_cached_tokens"] for r in rows) / prompt_tokens,
        "decode_hit_rate": sum(r["decode_cached_tokens"] for r in rows) / prompt_tokens,
        "requests": len(rows),
    }


def table(runs: list[tuple[str, dict[str, Any]]], turns: int) -> list[str]:
    """One row per (label, summary): TTFT p50 by turn, KV bytes/request from turn 2, hit rates."""
    head = (
        f"{'run':<22}"
        + "".join(f"{'TTFT p50 t' + str(t):>14}" for t in range(1, turns + 1))
        + f"{'bytes/req t2+':>15}{'hit P':>8}{'hit D':>8}"
    )
    return [head] + [
        f"{label:<22}"
        + "".join(f"{s['by_turn'][t]['ttft_p50_ms']:>12.1f}ms" for t in range(1, turns + 1))
        + f"{s['bytes_per_request_turn2plus']:>15,.0f}{s['prefill_hit_rate']:>8.2f}{s['decode_hit_rate']:>8.2f}"
        for label, s in runs
    ]
