"""What many test modules share that is not a fake: waiting on a condition, and reading /metrics.

- `wait_until(condition, timeout, what)`: every test that polls (a worker replaced, blocks back in
  the pool, a span exported) waits on a condition with a deadline, never a fixed sleep, and fails
  saying what it waited for and what it last saw. `async_wait_until` is the same inside an event
  loop (a scenario that must let the server's tasks run while it waits).
- `samples(text, name)` / `value(text, name, **labels)`: a /metrics text read with
  `prometheus_client.parser`, the parser of the library that wrote it, not by splitting lines.
- `run_to_completion(engine, seqs)`: sequences through an in-process engine until done, checking
  that every KV block came back; their output ids (the oracle many tests compare a server with).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from prometheus_client.parser import text_string_to_metric_families

if TYPE_CHECKING:
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
