"""What a probe measures: the batches, contexts, prompt lengths and repeats, from the CLI's flags."""

from __future__ import annotations

from dataclasses import dataclass

from costmodel.workloads import WorkloadConfig


def doubling(lo: int, hi: int) -> list[int]:
    out, x = [], lo
    while x <= hi:
        out.append(x)
        x *= 2
    return out


@dataclass(frozen=True)
class ProbePlan:
    max_context: int = 2048
    max_batch: int = 8
    quick: bool = False
    short_prompt: int = 16  # the decode streams' prompt at the short context
    # the article mix whose stall is predicted (not measured): `bench serve --workload article`'s
    # defaults, so the prediction can be checked against that command on the same server
    mix_streams: int = WorkloadConfig.chat_streams
    mix_context: int = WorkloadConfig.chat_prompt_len + WorkloadConfig.chat_output_len // 2
    mix_doc_tokens: int = WorkloadConfig.doc_prompt_len

    def validate(self) -> None:
        if self.max_context < 128:
            raise ValueError("--max-context must be >= 128 (prefill is probed from 128 tokens up)")
        if self.max_batch < 1:
            raise ValueError("--max-batch must be >= 1")
        if min(self.mix_streams, self.mix_context, self.mix_doc_tokens) < 1:
            raise ValueError("--mix-streams, --mix-context and --mix-doc-tokens must be >= 1")

    @property
    def batches(self) -> list[int]:
        return doubling(1, min(self.max_batch, 4) if self.quick else self.max_batch)

    @property
    def contexts(self) -> list[int]:
        """Two prompt lengths for the decode streams, so the per-context-token term is fitted."""
        long = min(self.max_context // 2, 512) if self.quick else self.max_context // 2
        return [self.short_prompt, max(long, 2 * self.short_prompt)]

    @property
    def decode_tokens(self) -> int:
        return 24 if self.quick else 48

    @property
    def decode_repeats(self) -> int:
        return 1 if self.quick else 3

    @property
    def tax_repeats(self) -> int:
        return 1 if self.quick else 3

    @property
    def prefill_tokens(self) -> list[int]:
        return doubling(128, self.max_context)

    @property
    def prefill_repeats(self) -> int:
        return 3 if self.quick else 5

    @property
    def overhead_repeats(self) -> int:
        return 5 if self.quick else 10

    @property
    def tax_points(self) -> list[tuple[int, int]]:
        """(batch, prompt tokens): stall against T at the largest batch (chunking shows there), and
        against batch at the longest prompt."""
        b = self.batches[-1]
        ts = [t for t in self.prefill_tokens if t >= 256] or self.prefill_tokens
        ts = ts[-2:] if self.quick else ts[-3:]
        points = [(b, t) for t in ts]
        if not self.quick and len(self.batches) > 2:
            points.append((self.batches[1], ts[-1]))
        return points

    @property
    def prefix_tokens(self) -> int:
        return min(self.max_context, 1024)
