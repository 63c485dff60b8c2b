"""What many test modules share that is not a fake: waiting on a condition, and reading /metrics.

- `wait_until(condition, timeout, what)`: every test that polls (a worker replaced, blocks back in
  the pool, a span exported) waits on a condition with a deadline, never a fixed sleep, and fails
  saying what it waited for and what it last saw. `async_wait_until` is the same inside an event
  loop (a scenario that must let the server's tasks run while it waits).
- `samples(text, name)` / `value(text, name, **labels)`: a /metrics text read with
  `prometheus_client.parser`, the parser of the library that wrote it, not by splitting lines.
- `run_to_completion(engine, seqs)`: sequences through an in-process engine until done, checking
  that every KV block came back; their output ids (the oracle many tests compare a server with).
- `greedy_reference(prompts, max_tokens)`: that oracle for the serving tests, per prompt text.
- `flags(**values)`: a command's options written as keywords (`out_dir=tmp` -> `--out-dir tmp`).
- `stream_completion(client, prompt, max_tokens)`: one greedy stream through the openai client, as a
  serving test reads it (its text, and the timeline pdserve sends with the last chunk).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from prometheus_client.parser import text_string_to_metric_families

if TYPE_CHECKING:
    from openai import AsyncOpenAI

    from engine.core.llm_engine import LLMEngine
    from engine.sequence import Sequence

T = TypeVar("T")


What = str | Callable[[], str]  # what is awaited; a callable is asked at the timeout (it can say what it saw)


def _timed_out(what: What, timeout: float, last: object) -> AssertionError:
    seen = "" if last is None or last is False else f" (last: {last!r})"
    return AssertionError(f"timed out after {timeout:g} s waiting for {what() if callable(what) else what}{seen}")


def wait_until(condition: Callable[[], T], timeout: float, what: What, interval: float = 0.05) -> T:
    """Call `condition` until it returns something truthy, and return that; AssertionError after
    `timeout` seconds, naming `what`. The condition is called at least once."""
    deadline = time.monotonic() + timeout
    while True:
        last = condition()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise _timed_out(what, timeout, last)
        time.sleep(interval)


async def async_wait_until(
    condition: Callable[[], T | Awaitable[T]], timeout: float, what: What, interval: float = 0.005
) -> T:
    """`wait_until` for a coroutine: the event loop runs between polls. `condition` may be async."""
    deadline = time.monotonic() + timeout
    while True:
        last = condition()
        if asyncio.iscoroutine(last) or isinstance(last, asyncio.Future):
            last = await last
        if last:
            return last  # type: ignore[return-value]  # awaited above when it was awaitable
        if time.monotonic() >= deadline:
            raise _timed_out(what, timeout, last)
        await asyncio.sleep(interval)


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every sample called `name` (a counter's `_total`, a histogram's `_count`,
    `_bucket` and `_sum` included) in a Prometheus text exposition."""
    return [(s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]


def value(text: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`; AssertionError if there is none."""
    got = [v for ls, v in samples(text, name) if all(ls.get(k) == want for k, want in labels.items())]
    if not got:
        raise AssertionError(f"{name}{labels or ''} not in the metrics")
    return sum(got)


def exported_names(text: str) -> set[str]:
    """Every sample name a Prometheus text exposes, and the series names of every metric it
    declares (a counter's `_total`, a histogram's `_bucket`, `_sum`, `_count`) even before they
    have a sample."""
    names: set[str] = set()
    for f in text_string_to_metric_families(text):
        names |= {s.name for s in f.samples}
        names.add(f.name + "_total" if f.type == "counter" else f.name)
        if f.type == "histogram":
            names |= {f"{f.name}_bucket", f"{f.name}_sum", f"{f.name}_count"}
    return names


def run_to_completion(engine: LLMEngine, seqs: list[Sequence]) -> list[list[int]]:
    """Add `seqs` to `engine`, step until it has no work, check no KV block leaked; their output ids."""
    for s in seqs:
        engine.add_request(s)
    while engine.has_work:
        engine.step()
    assert engine.blocks.num_free == engine.blocks.num_blocks, "KV blocks leaked"
    return [s.output_ids for s in seqs]


def greedy_reference(prompts: list[str], max_tokens: int, **engine_kw: object) -> dict[str, list[int]]:
    """Greedy tokens of the tiny model in an engine alone (no Ray, no transport), a fresh engine per
    distinct prompt: the reference a serving test compares every mode's tokens with."""
    from engine.checkpoint.tokenizer import ByteTokenizer  # imported here: most users of this module need no torch
    from engine.config import PRESETS, CacheConfig
    from engine.core.llm_engine import LLMEngine
    from engine.runner.model_runner import ModelRunner
    from engine.sequence import SamplingParams, Sequence

    runner = ModelRunner(PRESETS["tiny"], CacheConfig(num_blocks=64), "fp8", "cpu")
    out = {}
    for i, prompt in enumerate(dict.fromkeys(prompts)):
        seq = Sequence(f"ref-{i}", ByteTokenizer().encode(prompt), SamplingParams(max_tokens, ignore_eos=True))
        (out[prompt],) = run_to_completion(LLMEngine(runner, **engine_kw), [seq])  # type: ignore[arg-type]
    return out


async def stream_completion(client: AsyncOpenAI, prompt: str | list[int], max_tokens: int) -> tuple[str, dict]:
    """A greedy streamed completion of `max_tokens` tokens (EOS ignored, usage asked for): the text
    of its chunks, and the timeline pdserve sends with the last one."""
    stream = await client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    texts, last = [], None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            texts.append(chunk.choices[0].text)
        last = chunk
    assert last is not None and last.model_extra is not None
    return "".join(texts), last.model_extra["pdserve"]["timeline"]


def flags(**values: object) -> list[str]:
    """Command-line options from keywords, in order: `decode_batch=2` -> `--decode-batch 2`, and
    `json=True` -> `--json` (a flag without a value), so a test's argv reads as its options."""
    out: list[str] = []
    for name, v in values.items():
        out += ["--" + name.replace("_", "-")] if v is True else ["--" + name.replace("_", "-"), str(v)]
    return out


def attention_shapes(
    name: str,
    *,
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    vocab: int = 16,
    inter: int = 16,
    ctx: int = 4096,
):  # -> engine.config.ModelConfig
    """A two-layer model config of one attention shape: what the kernel tests need (shapes, not a model)."""
    from engine.config import ModelConfig  # noqa: PLC0415 - the router-only tests import this module too

    # ModelConfig's fields in order: name, vocab, hidden, intermediate, layers, heads, kv heads, head dim, context
    return ModelConfig(name, vocab, hidden, inter, 2, heads, kv_heads, head_dim, ctx)
