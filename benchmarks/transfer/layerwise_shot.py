"""One request of `pdserve bench layerwise`: a document sent in one KV transfer mode, and what the
client's stream and the server's timeline say about it (TTFT, the first gap, the exposed transfer).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ARTICLE = Path(__file__).resolve().parents[1] / "data" / "article.md"


@dataclass
class Shot:
    """One request: a document in one mode."""

    doc: int
    mode: str  # what the request asked for
    used: str = ""  # what the server did (under auto: bulk or layerwise)
    ttft_ms: float = 0.0
    gap12_ms: float = 0.0  # first to second token, at the client
    step_ms: float = 0.0  # median gap between later tokens (client)
    first_step_ms: float | None = None  # the request's first decode step (server: admission -> its token)
    exposed_ms: float = 0.0  # gap12 - the first decode step (gap12 - step_ms without a timeline)
    exposed_vs_later_steps_ms: float = 0.0  # gap12 - step_ms
    prompt_tokens: int = 0
    prefill_ms: float = 0.0  # on the prefill worker
    kv_bytes: int = 0
    groups: int = 0
    transfer_ms: float = 0.0  # the pulls' own time (layer-wise: their sum)
    timeline_exposed_ms: float | None = None  # last pull's end - prefill end
    overlap_ms: float | None = None
    decode_wait_ms: float | None = None
    handoff_ms: float | None = None  # on the servers: prefill end -> decode admission (transfer and waits)
    tail_ms: float | None = None  # layer-wise: prefill end - the last group's announcement
    open_ms: float | None = None  # layer-wise: the router's open_stream call
    predicted_exposed_ms: float | None = None  # filled in after the run
    token_ids: list[int] = field(default_factory=list)
    timeline: dict[str, Any] = field(default_factory=dict)  # the server's, as it sent it
    error: str | None = None


def documents(n: int, words: int) -> list[str]:
    """`n` distinct documents of `words` words each: consecutive slices of the article."""
    text = ARTICLE.read_text().split()
    return [" ".join((text * (1 + (i + 1) * words // len(text)))[i * words : (i + 1) * words]) for i in range(n)]


async def send(client: Any, model: str, doc_index: int, text: str, mode: str, output_len: int) -> Shot:
    shot = Shot(doc_index, mode)
    times: list[float] = []
    t0 = time.perf_counter()
    try:
        stream = await client.completions.create(
            model=model,
            prompt=f"Summarize this document.\n\n{text}\n\nSummary:",
            max_tokens=output_len,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "kv_transfer": mode},
        )
        timeline: dict[str, Any] = {}
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                times.append(time.perf_counter())
            extra = chunk.model_extra or {}
            if extra.get("pdserve"):
                timeline = extra["pdserve"].get("timeline") or timeline
    except Exception as e:  # noqa: BLE001 - reported in the table, the run goes on
        shot.error = f"{type(e).__name__}: {e}"
        return shot
    if len(times) < 3 or not timeline:
        shot.error = f"only {len(times)} tokens streamed" if timeline else "no timeline in the response"
        return shot
    gaps = [(b - a) * 1e3 for a, b in zip(times, times[1:])]
    shot.ttft_ms = (times[0] - t0) * 1e3
    shot.gap12_ms = gaps[0]
    shot.step_ms = statistics.median(gaps[1:])
    shot.timeline = timeline
    derive(shot)
    tr = timeline.get("transfer") or {}
    shot.prompt_tokens = int(timeline.get("prompt_tokens", 0))
    shot.prefill_ms = float(timeline.get("prefill_ms") or 0.0)
    shot.kv_bytes = int(tr.get("bytes", 0))
    shot.groups = int(tr.get("groups", 0))
    shot.used = str(tr.get("mode", ""))
    shot.transfer_ms = float(tr.get("ms", 0.0))
    shot.timeline_exposed_ms = tr.get("exposed_ms")
    shot.overlap_ms = tr.get("overlap_ms")
    shot.decode_wait_ms = timeline.get("decode_wait_ms")
    shot.open_ms = timeline.get("kv_stream_open_ms")
    announced = timeline.get("prefill_groups") or []
    if announced and timeline.get("prefill_end_ms") is not None:
        shot.tail_ms = float(timeline["prefill_end_ms"]) - float(announced[-1][2])
    shot.token_ids = list(timeline.get("token_ids", []))
    if mode != "auto" and tr.get("mode") != mode:
        shot.error = f"asked for {mode}, the server used {tr.get('mode') or timeline.get('kv_transfer')}"
    return shot


def derive(shot: Shot) -> None:
    """The exposed transfer from the client's first gap and the server's stamps. The gap holds the
    hand-off and the request's first decode step; that step is taken off as the decode worker
    timed it (its admission to its token), not as the median later step: a freshly admitted
    sequence's first step ran 20-45 ms longer than its later ones, bulk or layer-wise alike."""
    tl = shot.timeline
    shot.exposed_vs_later_steps_ms = shot.gap12_ms - shot.step_ms
    shot.exposed_ms = shot.exposed_vs_later_steps_ms
    admitted, end, token_ms = tl.get("decode_admitted_ms"), tl.get("prefill_end_ms"), tl.get("token_ms") or []
    if admitted is not None and end is not None:
        shot.handoff_ms = float(admitted) - float(end)
    if admitted is not None and len(token_ms) > 1:
        shot.first_step_ms = float(token_ms[1]) - float(admitted)
        shot.exposed_ms = shot.gap12_ms - shot.first_step_ms
