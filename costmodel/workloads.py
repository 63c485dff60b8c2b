"""Seeded request workloads for `pdserve bench serve`: what to send, and when.

A workload is a list of `RequestSpec`s sorted by arrival offset. Everything random comes from one
`random.Random(seed)`, so the same config always gives the same prompts, lengths and times, and
two servers (colocated, chunked, disaggregated) can be compared on exactly the same requests.

Prompt lengths are in tokens. pdserve's random-weight models use a byte tokenizer (one token per
byte), so a prompt of N tokens is sent as N ASCII characters. For servers with a real tokenizer
(vLLM/SGLang on a Hugging Face model), `prompt_token_ids=True` sends a list of N ids instead,
which the OpenAI completions API accepts as `prompt` and which pins the length exactly.

Workloads:
- random: `num_requests` prompts of length uniform in input_len * [1-r, 1+r], outputs likewise.
- article: the article's scene. `chat_streams` chats with long outputs start at t=0 (or
  staggered), then `doc_count` long-prompt documents arrive, either at Poisson times (`doc_rate`)
  or every `doc_interval_s`, starting at `doc_start_s` (so the chats are already decoding).
- sharegpt: first human turn of each conversation in a ShareGPT JSON file; max_tokens from the
  first reply's length in UTF-8 bytes (the byte tokenizer's count), capped.

Arrivals (random, sharegpt): Poisson at `request_rate` (exponential gaps, first request at t=0),
or all at t=0 when the rate is infinite; the client's `max_concurrency` then gives a fixed
concurrency load.
"""

from __future__ import annotations

import json
import math
import random
import string
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

RequestKind = Literal["chat", "document", "random", "sharegpt"]
WorkloadName = Literal["random", "article", "sharegpt"]

# Letters and spaces: one byte each under the byte tokenizer, printable in logs.
_TEXT_ALPHABET = string.ascii_lowercase + " "


@dataclass(frozen=True)
class RequestSpec:
    """One request to send. `prompt` is text, or token ids in prompt_token_ids mode."""

    request_id: str
    prompt: str | tuple[int, ...]
    prompt_len: int  # intended prompt length in tokens (exact for byte tokenizer / ids)
    max_tokens: int
    arrival_s: float  # offset from benchmark start at which the request is sent
    kind: RequestKind
    # a shared prompt prefix: the first `prefix_len` tokens are those of every request with this
    # id (a system prompt), so a server's prefix cache can reuse them; None: nothing shared
    prefix_id: str | None = None
    prefix_len: int = 0


@dataclass(frozen=True)
class WorkloadConfig:
    workload: WorkloadName = "random"
    seed: int = 0
    prompt_token_ids: bool = False
    token_id_low: int = 32  # ids drawn from [low, high): printable bytes by default,
    token_id_high: int = 127  # which are ordinary tokens in byte and BPE vocabularies alike
    # random / sharegpt
    num_requests: int = 16
    request_rate: float = math.inf  # requests/s, Poisson; inf = all at t=0
    random_input_len: int = 128
    random_output_len: int = 64
    random_range_ratio: float = 0.0
    # random: the first prefix_share x random_input_len tokens of each prompt are one of
    # `prefix_count` shared prefixes (request i takes prefix i mod count; a system prompt), the
    # rest its own; 0 = nothing shared. A prompt keeps at least one token of its own.
    prefix_share: float = 0.0
    prefix_count: int = 1
    sharegpt_file: str | None = None
    sharegpt_max_output_len: int = 256
    # article mix
    chat_streams: int = 8
    chat_prompt_len: int = 64
    chat_output_len: int = 256
    chat_stagger_s: float = 0.0  # chat i starts at i * stagger
    doc_prompt_len: int = 1024
    doc_output_len: int = 8
    doc_count: int = 2
    doc_rate: float | None = None  # documents/s (Poisson); None = fixed spacing below
    doc_start_s: float = 2.0
    doc_interval_s: float = 2.0

    def validate(self) -> None:
        """Raise ValueError with a user-facing message for impossible settings."""
        checks = [
            (self.workload in ("random", "article", "sharegpt"), f"unknown workload {self.workload!r}"),
            (self.num_requests >= 1, "--num-requests must be >= 1"),
            (self.request_rate > 0, "--request-rate must be > 0 (use inf for all at once)"),
            (self.random_input_len >= 1 and self.random_output_len >= 1, "random lengths must be >= 1"),
            (0.0 <= self.random_range_ratio < 1.0, "--random-range-ratio must be in [0, 1)"),
            (0.0 <= self.prefix_share < 1.0 and self.prefix_count >= 1, "--prefix-share in [0, 1), --prefixes >= 1"),
            (self.chat_streams >= 0 and self.doc_count >= 0, "--chat-streams/--doc-count must be >= 0"),
            (self.chat_prompt_len >= 1 and self.doc_prompt_len >= 1, "prompt lengths must be >= 1"),
            (self.chat_output_len >= 1 and self.doc_output_len >= 1, "output lengths must be >= 1"),
            (self.doc_rate is None or self.doc_rate > 0, "--doc-rate must be > 0"),
            (
                self.doc_start_s >= 0 and self.doc_interval_s >= 0 and self.chat_stagger_s >= 0,
                "article-mix times must be >= 0",
            ),
            (0 <= self.token_id_low < self.token_id_high, "token id range must satisfy 0 <= low < high"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)
        if self.workload == "article" and self.chat_streams + self.doc_count == 0:
            raise ValueError("the article mix needs at least one chat stream or document")
        if self.workload == "sharegpt":
            if not self.sharegpt_file:
                raise ValueError("--workload sharegpt needs --sharegpt-file")
            if self.prompt_token_ids:
                raise ValueError("--prompt-token-ids does not apply to sharegpt (its prompts are text)")


def build_workload(cfg: WorkloadConfig) -> list[RequestSpec]:
    """The requests of `cfg`, sorted by arrival time. Same cfg, same list."""
    cfg.validate()
    rng = random.Random(cfg.seed)
    if cfg.workload == "random":
        specs = _random_workload(cfg, rng)
    elif cfg.workload == "article":
        specs = _article_workload(cfg, rng)
    else:
        specs = _sharegpt_workload(cfg, rng)
    return sorted(specs, key=lambda s: (s.arrival_s, s.request_id))


def make_prompt(n: int, rng: random.Random, cfg: WorkloadConfig) -> str | tuple[int, ...]:
    """A random prompt of n tokens: n characters of text, or n token ids."""
    if cfg.prompt_token_ids:
        return tuple(rng.randrange(cfg.token_id_low, cfg.token_id_high) for _ in range(n))
    # Random text (not a repeated phrase) so no two prompts share a cacheable prefix.
    return "".join(rng.choices(_TEXT_ALPHABET, k=n))


def poisson_arrivals(n: int, rate: float, rng: random.Random, start_s: float = 0.0) -> list[float]:
    """n arrival offsets: the first at start_s, then exponential gaps of mean 1/rate (inf: all at start)."""
    times, t = [], start_s
    for i in range(n):
        if i > 0 and math.isfinite(rate):
            t += rng.expovariate(rate)
        times.append(t)
    return times


def _length(rng: random.Random, mean: int, ratio: float) -> int:
    lo, hi = max(1, math.floor(mean * (1 - ratio))), max(1, math.ceil(mean * (1 + ratio)))
    return rng.randint(lo, hi)


def _random_workload(cfg: WorkloadConfig, rng: random.Random) -> list[RequestSpec]:
    arrivals = poisson_arrivals(cfg.num_requests, cfg.request_rate, rng)
    shared = round(cfg.prefix_share * cfg.random_input_len)
    # the prefixes from their own stream: the lengths and times are those of the same workload unshared
    prefix_rng = random.Random(f"{cfg.seed}-prefixes")
    prefixes = [make_prompt(shared, prefix_rng, cfg) for _ in range(cfg.prefix_count)] if shared else []
    specs = []
    for i, t in enumerate(arrivals):
        n_in = _length(rng, cfg.random_input_len, cfg.random_range_ratio)
        n_out = _length(rng, cfg.random_output_len, cfg.random_range_ratio)
        prompt = make_prompt(n_in, rng, cfg)
        spec = RequestSpec(f"random-{i}", prompt, n_in, n_out, t, "random")
        if prefixes:
            k, own = i % len(prefixes), min(shared, n_in - 1)
            head, tail = prefixes[k][:own], prompt[own:]
            joined: str | tuple[int, ...]
            if isinstance(head, str) and isinstance(tail, str):
                joined = head + tail
            else:
                joined = tuple(int(x) for x in head) + tuple(int(x) for x in tail)
            spec = replace(spec, prompt=joined, prefix_id=f"prefix-{k}", prefix_len=own)
        specs.append(spec)
    return specs


def _article_workload(cfg: WorkloadConfig, rng: random.Random) -> list[RequestSpec]:
    specs = [
        RequestSpec(
            f"chat-{i}",
            make_prompt(cfg.chat_prompt_len, rng, cfg),
            cfg.chat_prompt_len,
            cfg.chat_output_len,
            i * cfg.chat_stagger_s,
            "chat",
        )
        for i in range(cfg.chat_streams)
    ]
    if cfg.doc_rate is not None:
        # Poisson process started at doc_start_s: the first document waits one exponential gap too,
        # so document times do not all share the fixed start.
        doc_times, t = [], cfg.doc_start_s
        for _ in range(cfg.doc_count):
            t += rng.expovariate(cfg.doc_rate)
            doc_times.append(t)
    else:
        doc_times = [cfg.doc_start_s + i * cfg.doc_interval_s for i in range(cfg.doc_count)]
    specs += [
        RequestSpec(
            f"doc-{i}", make_prompt(cfg.doc_prompt_len, rng, cfg), cfg.doc_prompt_len, cfg.doc_output_len, t, "document"
        )
        for i, t in enumerate(doc_times)
    ]
    return specs


def load_sharegpt(path: str | Path) -> list[tuple[str, str]]:
    """(first human turn, first reply) pairs from a ShareGPT-format JSON file."""
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"ShareGPT file not found: {p}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"ShareGPT file {p} is not valid JSON: {e}") from None
    if not isinstance(data, list):
        raise ValueError(f"ShareGPT file {p}: expected a JSON list of conversations")
    pairs = []
    for entry in data:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        first, reply = turns[0], turns[1]
        if not (isinstance(first, dict) and isinstance(reply, dict)):
            continue
        prompt, answer = first.get("value"), reply.get("value")
        if first.get("from") in ("human", "user") and isinstance(prompt, str) and prompt and isinstance(answer, str):
            pairs.append((prompt, answer))
    if not pairs:
        raise ValueError(f"ShareGPT file {p}: no conversation with a human turn followed by a reply")
    return pairs


def _sharegpt_workload(cfg: WorkloadConfig, rng: random.Random) -> list[RequestSpec]:
    pairs = load_sharegpt(cfg.sharegpt_file)  # type: ignore[arg-type]
    rng.shuffle(pairs)
    # Cycle through the file if it has fewer conversations than requests asked for.
    chosen = [pairs[i % len(pairs)] for i in range(cfg.num_requests)]
    arrivals = poisson_arrivals(cfg.num_requests, cfg.request_rate, rng)
    specs = []
    for i, ((prompt, answer), t) in enumerate(zip(chosen, arrivals)):
        n_out = min(max(1, len(answer.encode("utf-8"))), cfg.sharegpt_max_output_len)
        specs.append(RequestSpec(f"sharegpt-{i}", prompt, len(prompt.encode("utf-8")), n_out, t, "sharegpt"))
    return specs


def workload_specs(wl: WorkloadConfig) -> list[RequestSpec]:
    """`wl` checked and built, for a command: impossible settings are a one-line CLI error."""
    from cli import CliError  # noqa: PLC0415 - only commands call this

    try:
        wl.validate()
        return build_workload(wl)
    except ValueError as e:
        raise CliError(str(e)) from None
