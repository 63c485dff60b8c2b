"""Transient unreachability is not death: WorkerHandle retries idempotent calls through a bounded
number of ActorUnavailableError-like failures, then gives up; non-idempotent calls never repeat."""

from __future__ import annotations

import asyncio

import pytest

import router.workers.handle as wh
from router.workers.handle import WorkerHandle, WorkerUnavailable
from tests.fakes import FakeActorTarget


def _handle(monkeypatch, failures: int) -> tuple[WorkerHandle, list[str]]:
    h = WorkerHandle("decode-0", "decode", FakeActorTarget(), is_ray=True)
    calls: list[str] = []

    async def flaky(method, *args, **kwargs):
        calls.append(getattr(method, "__name__", "?"))
        if len(calls) <= failures:
            raise WorkerUnavailable("decode worker decode-0 is unreachable: ActorUnavailableError")
        return "decode-0"

    monkeypatch.setattr(h, "_call", flaky)
    monkeypatch.setattr(wh, "RETRY_PAUSES_S", (0.0, 0.0, 0.0))
    return h, calls


def test_ping_survives_transient_unavailability(monkeypatch):
    h, calls = _handle(monkeypatch, failures=3)
    assert asyncio.run(h.ping()) == "decode-0" and len(calls) == 4 and h.alive


def test_retries_are_bounded(monkeypatch):
    h, calls = _handle(monkeypatch, failures=10)
    with pytest.raises(WorkerUnavailable):
        asyncio.run(h.ping())
    assert len(calls) == 4  # the first try and three retries


def test_submit_is_not_repeated(monkeypatch):
    """A submit that may have reached the worker must not be sent twice."""
    h, calls = _handle(monkeypatch, failures=1)
    with pytest.raises(WorkerUnavailable):
        asyncio.run(h.submit_prompt(None))  # type: ignore[arg-type]
    assert len(calls) == 1
