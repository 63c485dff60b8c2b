"""Sequence and SamplingParams: the per-request state an engine carries between steps."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # keep the k most likely tokens (0 = all)
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k >= 0: each generated token's logprob + its top k
    prompt_logprobs: int | None = None  # the same for every prompt token (the first has none)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0 (0 = off)")


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log probability under the model, and the `top` alternatives (id, logprob),
    most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class Status(str, Enum):
    WAITING = "waiting"  # admitted, prompt not (fully) prefilled
    RUNNING = "running"  # decoding
    FINISHED = "finished"


@dataclass
class Sequence:
    seq_id: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose K/V is in the pool
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    output_logprobs: list[TokenLogprob] = field(default_factory=list)  # when params.logprobs is set
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)  # params.prompt_logprobs; [0] is None
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of the full blocks in the pool
    cached_tokens: int = 0  # prompt tokens found in the prefix cache (not computed) at the last admission
    preemptions: int = 0  # times its blocks were taken back (recomputed on readmission)
    admitted: int = -1  # admission order among sequences holding blocks (the newest is preempted first)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prefill_target(self) -> int:
        """Tokens to compute before decoding: the prompt; after a preemption also every generated
        token but the last (which is still to be decoded, so nothing is sampled twice)."""
        return len(self.prompt_ids) + max(0, len(self.output_ids) - 1)

    @property
    def prefill_remaining(self) -> int:
        return max(0, self.prefill_target - self.num_cached)

    def tokens(self, start: int, end: int) -> list[int]:
        """all_ids[start:end] without copying the whole sequence."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.prompt_ids[start:] + self.output_ids[: end - n]

    @property
    def num_sampled(self) -> int:
        """Sampling steps done so far: also the per-request seed offset, so a seeded request
        draws the same tokens whichever worker, batch or process samples it."""
        return len(self.output_ids)
