"""The soak's request streams: `fixed` (a dozen prompts, repeated) and `real` (shaped like real
traffic: every prompt length a new shape, so that a cache kept per shape shows up as growth).

`real` draws prompt lengths over the model's whole range, as traffic does, so the workers meet
ever new shapes (prefill token counts, batch sizes): anything cached per shape shows up as RSS
that keeps growing. Its mix:

- chat: one of a few shared system prompts (prefix sharing: their full blocks are cache hits)
  plus a user message of log-uniform length (8 tokens to a quarter of the range);
- document: a document of log-uniform length (256 tokens to the whole range), half of the time
  one already sent with a new question (prefix sharing again), plus a short question;
- repeats: a share of requests re-send an exact earlier prompt. Greedy decoding must give the
  same tokens every time (batching, chunking, caching and transport change nothing), so the first
  answer is the reference and every later one is checked against it: "wrong" needs no separate
  reference pass (which would warm every shape before the soak starts).

Prompts are token ids (the completions API takes them), so lengths are exact for any tokenizer.
Ids are drawn from 32..255: valid for the byte tokenizer of the presets and for real vocabularies.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

FIXED_PROMPTS = [f"soak prompt {i}: " + "the quick brown fox jumps over the lazy dog " * (1 + i % 6) for i in range(12)]
WORKLOADS = ("real", "fixed")


@dataclass(frozen=True)
class SoakRequest:
    kind: str  # "chat" | "doc" | "fixed"
    key: str  # the same key is the same prompt (the correctness check compares their tokens)
    prompt: list[int] | str

    @property
    def prompt_len(self) -> int | None:
        return len(self.prompt) if isinstance(self.prompt, list) else None


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(max(lo, hi))))))


class RealShapedWorkload:
    def __init__(
        self,
        max_prompt_len: int,
        seed: int = 0,
        doc_share: float = 0.3,
        repeat_share: float = 0.25,
        system_prompts: int = 3,
        documents_kept: int = 8,
    ):
        if max_prompt_len < 300:
            raise ValueError(f"the real-shaped workload needs a context of >= 300 prompt tokens, got {max_prompt_len}")
        self.rng = random.Random(seed)
        self.max_len = max_prompt_len
        self.doc_share, self.repeat_share = doc_share, repeat_share
        self.systems = [self._ids(self.rng.choice((64, 128, 256))) for _ in range(system_prompts)]
        self.documents: list[list[int]] = []  # the last few documents (re-asked about with new questions)
        self.documents_kept = documents_kept
        self.history: list[SoakRequest] = []  # recent requests a repeat may re-send
        self._n = 0

    def _ids(self, n: int) -> list[int]:
        return [self.rng.randrange(32, 256) for _ in range(n)]

    def next(self) -> SoakRequest:
        rng = self.rng
        if self.history and rng.random() < self.repeat_share:
            return rng.choice(self.history)
        self._n += 1
        if rng.random() < self.doc_share:
            question = self._ids(rng.randint(8, 64))
            if self.documents and rng.random() < 0.5:
                doc = rng.choice(self.documents)
            else:
                doc = self._ids(_log_uniform(rng, 256, self.max_len - len(question)))
                self.documents = [*self.documents, doc][-self.documents_kept :]
            req = SoakRequest("doc", f"doc-{self._n}", (doc + question)[: self.max_len])
        else:
            system = rng.choice(self.systems)
            user = self._ids(_log_uniform(rng, 8, max(8, self.max_len // 4)))
            req = SoakRequest("chat", f"chat-{self._n}", (system + user)[: self.max_len])
        self.history = [*self.history, req][-256:]
        return req


class FixedWorkload:
    """The original soak: a dozen prompts, so a dozen prompt lengths (all references taken first)."""

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)

    def next(self) -> SoakRequest:
        p = self.rng.choice(FIXED_PROMPTS)
        return SoakRequest("fixed", p, p)


Workload = RealShapedWorkload | FixedWorkload
