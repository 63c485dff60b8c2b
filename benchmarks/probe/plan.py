"""What a probe measures: the batches, contexts, prompt lengths and repeats, from the CLI's flags.

Sized to what each measurement pays for (a full probe of SmolLM2 on 2 CPU cores took 539 s with 3
repeats everywhere and every batch at both contexts): the per-context-token term needs only two
batches at the long context, since the fit's other terms come from the short one; repeats are pooled
(the streams' paces of every repeat, median) rather than one run kept; the decode points are run in
passes over all of them, four in a full probe (a lone stream's step wandered 29-44 ms from run to
run, and the per-context-token term is the difference of two such steps); the stall's spread comes
from the decode runs' gaps (probe_fit.stall_forecast), so the tax runs are a check and an anchor,
not the only evidence.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass

from costmodel.workloads import WorkloadConfig


def doubling(lo: int, hi: int) -> list[int]:
    out, x = [], lo
    while x <= hi:
        out.append(x)
        x *= 2
    return out


# the largest batch run at the long context (decode and tax points): sixteen 1,024-token streams
# outlasted a 60 s request timeout and then a stream's KV on a 2-core VM (2026-12-07), and two
# batches pin the per-context-token term; the batch range itself is covered at the short context
LONG_BATCH = 8


@dataclass(frozen=True)
class ProbePlan:
    max_context: int = 2048
    # decode batches 1 doubling up to it at the short context: a fit over 1-8 priced a chat's decode
    # steps of 12-23 sequences 1.15-1.25x what they took (a sequence's share falls with the batch)
    max_batch: int = 16
    quick: bool = False
    short_prompt: int = 16  # the decode streams' prompt at the short context
    # the article mix whose stall is predicted (not measured): `bench serve --workload article`'s
    # defaults, so the prediction can be checked against that command on the same server
    mix_streams: int = WorkloadConfig.chat_streams
    mix_context: int = WorkloadConfig.chat_prompt_len + WorkloadConfig.chat_output_len // 2
    mix_doc_tokens: int = WorkloadConfig.doc_prompt_len
    mix_docs: int = 8  # documents in the printed `bench serve` command: enough for a median and a p90

    def validate(self) -> None:
        if self.max_context < 128:
            raise ValueError("--max-context must be >= 128 (prefill is probed from 128 tokens up)")
        if self.max_batch < 1:
            raise ValueError("--max-batch must be >= 1")
        if min(self.mix_streams, self.mix_context, self.mix_doc_tokens) < 1:
            raise ValueError("--mix-streams, --mix-context and --mix-doc-tokens must be >= 1")
        if self.mix_docs < 1:
            raise ValueError("--mix-docs must be >= 1")

    @property
    def batches(self) -> list[int]:
        return doubling(1, min(self.max_batch, 4) if self.quick else self.max_batch)

    @property
    def contexts(self) -> list[int]:
        """Two prompt lengths for the decode streams, so the per-context-token term is fitted."""
        long = min(self.max_context // 2, 512) if self.quick else self.max_context // 2
        return [self.short_prompt, max(long, 2 * self.short_prompt)]

    def decode_points(self) -> list[tuple[int, int]]:
        """(batch, prompt tokens): every batch at the short context; at the long one only the
        smallest and `long_batch` (they pin the per-context-token term; the batches between
        would cost each a prefill of b long prompts for a term already fitted)."""
        short, long = self.contexts
        ends = sorted({self.batches[0], self.long_batch})
        return [(b, short) for b in self.batches] + [(b, long) for b in ends]

    @property
    def long_batch(self) -> int:
        """The largest batch run at long contexts: the largest probed, up to LONG_BATCH (batches start at 1)."""
        return max(b for b in self.batches if b <= LONG_BATCH)

    @property
    def decode_tokens(self) -> int:
        return 24 if self.quick else 32

    @property
    def decode_passes(self) -> int:
        """Passes over the decode points (measure.decode_passes): four, forward and back twice,
        put every point at the same mean time, and a lone stream's pace is a median of four."""
        return 1 if self.quick else 4

    @property
    def tax_repeats(self) -> int:
        return 1 if self.quick else 2

    @property
    def prefill_tokens(self) -> list[int]:
        return doubling(128, self.max_context)

    @property
    def prefill_repeats(self) -> int:
        # the shortest prompt anchors every difference the prefill fit is made of: it gets more
        return 2 if self.quick else 3

    def prefill_repeats_at(self, tokens: int) -> int:
        return self.prefill_repeats + (2 if tokens == self.prefill_tokens[0] else 0)

    @property
    def overhead_repeats(self) -> int:
        return 5 if self.quick else 8

    @property
    def prefix_pairs(self) -> int:
        return 1 if self.quick else 2

    @property
    def tax_points(self) -> list[tuple[int, int]]:
        """(batch, prompt tokens): stall against T at `long_batch` (chunking shows there), and
        (full probe) one smaller batch at the longest prompt."""
        b = self.long_batch
        ts = [t for t in self.prefill_tokens if t >= 256] or self.prefill_tokens
        points = [(b, t) for t in ts[-2:]]
        if not self.quick and len(self.batches) > 2:
            points.append((self.batches[1], ts[-1]))
        return points

    @property
    def prefix_tokens(self) -> int:
        return min(self.max_context, 1024)

    @property
    def cached_chunks(self) -> list[tuple[int, int]]:
        """(start, tokens) of the chunks measured after a cached prefix: starts far enough apart
        (4x and more) for the fit to tell a chunk's read of its context from its own cost, a small
        and a large chunk at each."""
        starts = doubling(256, max(256, self.max_context // 2))
        starts = sorted({starts[0], starts[-1]}) if self.quick else starts
        sizes = [64] if self.quick else [64, 256]
        return [(s, n) for s in starts for n in sizes]

    @property
    def cached_chunk_repeats(self) -> int:
        return 1 if self.quick else 2


@dataclass(frozen=True)
class ArticleCheck:
    """The `pdserve bench serve --workload article` run that measures the stall the probe
    predicted, like with like: the mix's streams, at (on average) the mix's context when each
    document arrives, and `docs` documents, each arriving while the streams decode alone (the
    last one's first token well before the streams end), so each one's stall is a fresh sample of
    the same distribution whose median and p90 the probe printed. No --seed: `bench serve` draws
    fresh documents each run, so a rerun is not served from the prefix cache."""

    chat_streams: int
    chat_prompt_len: int
    chat_output_len: int
    doc_prompt_len: int
    doc_count: int
    doc_start_s: float
    doc_interval_s: float
    context: int  # the streams' mean context when a document arrives: the forecast's

    def command(self, base_url: str, model: str | None, token_ids: bool) -> str:
        args = ["pdserve", "bench", "serve", "--base-url", base_url]
        args += ["--model", model] if model else []
        args += ["--workload", "article"] + (["--prompt-token-ids"] if token_ids else [])
        args += ["--chat-streams", str(self.chat_streams), "--chat-prompt-len", str(self.chat_prompt_len)]
        args += ["--chat-output-len", str(self.chat_output_len), "--doc-prompt-len", str(self.doc_prompt_len)]
        args += ["--doc-output-len", "1", "--doc-count", str(self.doc_count)]
        args += ["--doc-start-s", f"{self.doc_start_s:g}", "--doc-interval-s", f"{self.doc_interval_s:g}"]
        return shlex.join(args)


def _round_up(x: float) -> float:
    """Seconds a person can read: up to 0.05 s below a second, 0.5 s above."""
    q = 0.05 if x < 1 else 0.5
    return round(math.ceil(x / q - 1e-9) * q, 2)


def article_check(plan: ProbePlan, step_s: float, doc_ttft_s: float) -> ArticleCheck:
    """The check run for `plan`'s mix on a server whose decode step (the mix's batch) is `step_s`
    and whose document TTFT beside the streams is `doc_ttft_s` (both the probe's predictions).

    Documents are spaced by twice their TTFT plus a few steps (one is out of the server, and the
    streams back at their pace, before the next arrives), and never closer than 20 steps; the
    first waits for the streams' own prompts and a few steps. The streams decode through the last
    document with a quarter to spare; their prompt is what leaves them at the mix's context, on
    average, when the documents arrive (at least 16 tokens)."""
    step = max(step_s, 1e-4)
    start = _round_up(max(1.0, doc_ttft_s + 10 * step))
    interval = _round_up(max(2 * doc_ttft_s + 4 * step, 20 * step, 0.25))
    last = start + (plan.mix_docs - 1) * interval
    output = math.ceil(1.25 * (last + doc_ttft_s + 10 * step) / step)
    decoded = (start + last) / 2 / step  # tokens each stream has decoded when the mean document arrives
    prompt = max(16, round(plan.mix_context - decoded))
    return ArticleCheck(
        plan.mix_streams,
        prompt,
        output,
        plan.mix_doc_tokens,
        plan.mix_docs,
        start,
        interval,
        round(prompt + decoded),
    )
