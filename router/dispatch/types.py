"""What `--mode auto` reads and answers (router/dispatch/dispatcher.py): a decoding stream as the router sees
it, one placement's predicted figures, and the decision that pairs them.

The decision's `to_dict` is what a request's timeline carries (`Timeline.dispatch`) and the API
returns, so its keys are part of the JSON contract; the dispatcher adds the "outcome" later.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Stream:
    """A sequence decoding on the decode worker, as the router sees it."""

    context: int  # tokens in its KV (prompt + output so far)
    decoded: int = 0  # output tokens so far
    decode_s: float = 0.0  # seconds since its first token
    max_tokens: int = 0  # its length limit (0: unknown)


@dataclass
class Prediction:
    ttft_s: float
    stall_s: float = 0.0  # per in-flight stream (local only)
    itl_s: float = 0.0  # longest step the in-flight streams see (local) or the admission gap (remote)
    cost_s: float = 0.0
    admissible: bool = True
    queue_s: float = 0.0  # of ttft_s: waiting for the prompts ahead on that worker
    stream_itl_s: float = 0.0  # local: the worst stream's mean inter-token latency with the stall
    decode_step_s: float = 0.0  # the streams' decode step while this prompt prefills
    prefill_s: float = 0.0  # of ttft_s: from its first step to its first token (its own compute)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ttft_ms": round(self.ttft_s * 1e3, 3),
            "queue_ms": round(self.queue_s * 1e3, 3),
            "stall_ms": round(self.stall_s * 1e3, 3),
            "itl_ms": round(self.itl_s * 1e3, 3),
            "stream_itl_ms": round(self.stream_itl_s * 1e3, 3),
            "decode_step_ms": round(self.decode_step_s * 1e3, 3),
            "prefill_ms": round(self.prefill_s * 1e3, 3),
            "cost_ms": round(self.cost_s * 1e3, 3),
            "admissible": self.admissible,
        }


@dataclass
class Decision:
    choice: str  # "local" | "remote"
    local: Prediction
    remote: Prediction
    streams: int  # in flight on the decode worker at the decision
    prompt_tokens: int
    reason: str
    cached: dict[str, int] = field(default_factory=dict)  # cached prefix tokens per side

    def to_dict(self) -> dict[str, Any]:
        return {
            "decision": self.choice,
            "reason": self.reason,
            "streams_in_flight": self.streams,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": dict(self.cached),
            "local": self.local.to_dict(),
            "remote": self.remote.to_dict(),
        }
