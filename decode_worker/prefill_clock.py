"""Colocated timelines: each prompt prefilled on the decode worker, timed until its first token.

A colocated worker prefills its own prompts (whole or in chunks, mixed with decode steps), so the
router cannot see where queueing ends and prefill begins; this clock stamps both on the first
token's event: queue = the prompt's arrival at the worker to its first prefill step (one sent
mid-step waits for that step's end, and that wait is queue), prefill = that step to the first
token. The prompt's logprobs (echo) travel on the same event.
"""

from __future__ import annotations

import time

from contracts.worker import StreamEvent
from engine.sequence import Sequence


class PrefillClock:
    """Prompts admitted and not yet at their first token. Loop thread only."""

    def __init__(self) -> None:
        # request id -> (sequence, arrived at, first prefill step at) until its first token
        self._waiting: dict[str, tuple[Sequence, float, float | None]] = {}

    def admitted(self, seq: Sequence, arrived: float | None = None) -> None:
        """`seq` is in the engine; it reached the worker at `arrived` (unix s; None: now)."""
        self._waiting[seq.seq_id] = (seq, time.time() if arrived is None else arrived, None)

    def forget(self, request_id: str) -> None:
        """The request failed before its first token: nothing left to stamp."""
        self._waiting.pop(request_id, None)

    def stamp(self, events: list[StreamEvent], t_start: float) -> None:
        """After a step that started at `t_start`: note prompts whose prefill began in it, drop
        those aborted before their first token, and put queue and prefill times on first tokens
        (all chunks, and the decode steps mixed with them, count as prefill)."""
        for rid, (seq, t_submit, t_first) in list(self._waiting.items()):
            if t_first is None and seq.num_cached:
                self._waiting[rid] = (seq, t_submit, t_start)
            elif seq.finish_reason is not None and not seq.output_ids:  # aborted before its first token
                del self._waiting[rid]
        for ev in events:
            if ev.index == 0 and ev.request_id in self._waiting:
                seq, t_submit, t_first = self._waiting.pop(ev.request_id)
                t_first = t_first or t_submit
                ev.timings = {
                    "queue_ms": (t_first - t_submit) * 1e3,
                    "prefill_ms": (ev.t - t_first) * 1e3,
                    "cached_tokens": seq.cached_tokens,
                }

    def attach_prompt_logprobs(self, events: list[StreamEvent]) -> None:
        """Echo: the prompt's logprobs travel on the first token's event (before `stamp`, which
        forgets the prompt once its first token is out)."""
        for ev in events:
            if ev.index == 0 and ev.request_id in self._waiting:
                seq = self._waiting[ev.request_id][0]
                if seq.params.prompt_logprobs is not None:
                    ev.prompt_logprobs = seq.prompt_logprobs
