"""Layer-wise KV streaming (issue 39 item 6): a fault mid-stream ends that request alone.

Faults mid-stream, over real in-process prefill and decode workers (the "local" transport and real
NIXL/UCX): a prefill step that fails after the first chunk's groups; a prefill worker shut down
(its "failed" message sent, or lost: the decode side's transfer timeout); the decode worker shut
down (the prefill's blocks come back at their lease); a group corrupted after it was announced
under --verify-kv; an abort on either side; a prefill worker the decode side cannot reach. The
request ends with a clear error (or silently, when aborted), its blocks come back on both sides,
other requests are unaffected and the workers serve the next one. And the timeout that is not a
fault: a prompt queued at the prefill side longer than --transfer-timeout-s still streams.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from contracts.worker import PrefillResult, WorkerError
from decode_worker.worker import DecodeWorker
from prefill_worker.worker import PrefillWorker
from router.dispatch.kv_transfer_policy import KVTransferPolicy
from router.lifecycle.orchestrator import Orchestrator
from router.workers.handle import WorkerHandle
from tests.helpers import wait_until
from tests.layerwise_workers import (
    LAYERS,
    LAYOUT,
    MAX_TOKENS,
    PROMPT_BLOCKS,
    TINY,
    collect_events,
    hold_forward_pass,
    make_request,
    serve_request,
    wait_until_clean,
    workers_fixture,
)
from transport.wire import KVHandle, TransferStats

pytestmark = pytest.mark.timeout(180)

workers = workers_fixture()


def _reads(monkeypatch: pytest.MonkeyPatch, d: DecodeWorker) -> list[KVHandle]:
    """Every handle `d`'s transport is asked to read (a failing read too), in order."""
    real, seen = d.transport.read, []

    def read(handle: KVHandle, local_blocks: list[int], *args: Any, **kw: Any) -> TransferStats:
        seen.append(handle)
        return real(handle, local_blocks, *args, **kw)

    monkeypatch.setattr(d.transport, "read", read)
    return seen


class _Background(threading.Thread):
    """`fn(*args)` on a thread; its result or exception kept."""

    def __init__(self, fn: Callable[..., Any], *args: Any):
        super().__init__(daemon=True)
        self.fn, self.args = fn, args
        self.result: Any = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.result = self.fn(*self.args)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            self.error = e

    def outcome(self, timeout_s: float = 30.0) -> Any:
        self.join(timeout_s)
        assert not self.is_alive(), f"{self.fn.__qualname__} did not return within {timeout_s:g} s"
        return self.result


def _pulled_groups(reads: list[KVHandle], rid: str) -> int:
    return sum(1 for h in reads if h.request_id == rid and h.layers is not None)


@pytest.mark.parametrize("transport", ["local", "nixl"])
def test_prefill_step_failure_after_the_first_chunk(workers, monkeypatch, transport):
    """The victim's second chunk raises on its prefill worker, after the first chunk's groups were
    pulled: the decode worker ends the victim with the prefill's error and frees its blocks, while a
    bystander streamed at the same time from another prefill worker into the same decode worker
    decodes its tokens; the failing prefill worker then serves the next request."""
    kw = dict(transport=transport, chunk_size=32, enable_prefix_caching=False, verify_kv=True)
    bad, good, d = workers.prefill(**kw), workers.prefill(**kw), workers.decode(**kw)
    want = serve_request(good, d, make_request("warm-up"), 1).tokens
    reads = _reads(monkeypatch, d)
    real, calls = bad.engine.runner.execute, itertools.count(1)

    def execute(decode, items, on_layer=None):
        if next(calls) == 2:
            raise RuntimeError("injected: the second chunk failed")
        return real(decode, items, on_layer)

    monkeypatch.setattr(bad.engine.runner, "execute", execute)
    victim, bystander = make_request("victim"), make_request("bystander")
    v_target = d.open_stream(victim, bad.describe(), 1)
    b_target = d.open_stream(bystander, good.describe(), 1)
    v_call = _Background(bad.prefill, victim, v_target)
    b_call = _Background(good.prefill, bystander, b_target)
    events = collect_events(d, {"victim", "bystander"})
    v_call.outcome()
    assert isinstance(v_call.error, WorkerError) and "the second chunk failed" in str(v_call.error)
    assert [e.kind for e in events["victim"]] == ["error"]
    error = events["victim"][0].error or ""
    assert f"KV stream failed on {bad.name}: prefill step failed on {bad.name}" in error, error
    assert "the second chunk failed" in error
    assert _pulled_groups(reads, "victim") == LAYERS  # the first chunk's groups landed before the failure
    b_result = b_call.outcome()
    assert b_result.streamed
    assert [b_result.first_token, *[e.token_id for e in events["bystander"] if e.kind == "token"]] == want
    wait_until_clean(bad, good, d)
    monkeypatch.setattr(bad.engine.runner, "execute", real)
    assert serve_request(bad, d, make_request("after"), 1).tokens == want  # the failing worker serves on
    wait_until_clean(bad, good, d)


def _stopped(w: PrefillWorker) -> bool:
    """True once `w` is shutting down (its loop will not start another step)."""
    try:
        w.ping()
    except WorkerError:
        return True
    return False


@pytest.mark.parametrize("how", ["failed-message", "silent"])
@pytest.mark.parametrize("transport", ["local", "nixl"])
def test_prefill_worker_shut_down_mid_stream(workers, monkeypatch, transport, how):
    """The prefill worker shuts down during the second chunk, once the first chunk's groups were
    pulled. It tells the decode worker ("failed"), or (silent: as if it died) says nothing and the
    decode worker gives up after --transfer-timeout-s (2 s) of silence. Either way the request ends
    with a clear error naming the prefill worker and its reserved blocks come back; the decode
    worker then serves a request from another prefill worker."""
    kw = dict(transport=transport, chunk_size=32, enable_prefix_caching=False)
    p = workers.prefill(**kw)
    d = workers.decode(**kw, transfer_timeout_s=2.0)
    reads = _reads(monkeypatch, d)
    reached, go = hold_forward_pass(monkeypatch, p, at_call=2, announce=False)
    if how == "silent":
        monkeypatch.setattr(p.streams, "fail_all", lambda error: None)
    req = make_request("victim")
    call = _Background(p.prefill, req, d.open_stream(req, p.describe(), 2))
    try:
        assert reached.wait(30), "the second chunk never started"
        wait_until(lambda: _pulled_groups(reads, "victim") == 2, 10, "the first chunk's two groups pulled")
        assert d.stats().blocks_used == PROMPT_BLOCKS  # reserved for the whole prompt
        shutdown = _Background(p.shutdown)
        wait_until(lambda: _stopped(p), 10, f"{p.name} to start shutting down")
    finally:
        go.set()
    shutdown.outcome()
    call.outcome()
    assert isinstance(call.error, WorkerError) and "shut down" in str(call.error)
    events = collect_events(d, {"victim"}, timeout_s=10)["victim"]
    assert [e.kind for e in events] == ["error"]
    error = events[0].error or ""
    timed_out = f"KV transfer failed: no progress from {p.name} for 2 s"
    if how == "failed-message":
        assert f"KV stream failed on {p.name}: worker {p.name} is shut down" in error, error
    else:
        assert timed_out in error, error
    assert _pulled_groups(reads, "victim") == 2  # nothing pulled after the first chunk
    wait_until_clean(d)
    other = workers.prefill(**kw)
    assert len(serve_request(other, d, make_request("after"), 2).tokens) == MAX_TOKENS
    wait_until_clean(other, d)


@pytest.mark.parametrize("transport", ["local", "nixl"])
def test_decode_worker_shut_down_mid_stream(workers, monkeypatch, transport):
    """The decode worker shuts down after the first chunk's groups were pulled: the prefill still
    returns its result (maybe no longer `streamed`: its messages find nobody) and its blocks come
    back when their lease runs out; it then serves a new decode worker."""
    kw = dict(transport=transport, chunk_size=32, enable_prefix_caching=False)
    p = workers.prefill(**kw, lease_s=2.0)
    d = workers.decode(**kw)
    reads = _reads(monkeypatch, d)
    reached, go = hold_forward_pass(monkeypatch, p, at_call=2)
    req = make_request("orphan")
    call = _Background(p.prefill, req, d.open_stream(req, p.describe(), 1))
    try:
        assert reached.wait(30), "the second chunk never started"
        wait_until(lambda: _pulled_groups(reads, "orphan") == LAYERS, 10, "the first chunk's groups pulled")
        d.shutdown()
    finally:
        go.set()
    result = call.outcome()
    assert call.error is None and isinstance(result, PrefillResult) and result.request_id == "orphan"
    assert p.stats().blocks_used == PROMPT_BLOCKS  # parked under its lease...
    wait_until_clean(p, timeout_s=10)  # ...until it runs out
    assert p.leases_expired == 1
    d2 = workers.decode(**kw)
    assert len(serve_request(p, d2, make_request("after"), 1).tokens) == MAX_TOKENS
    wait_until_clean(p, d2)


@pytest.mark.parametrize("where", ["data", "scales"])
@pytest.mark.parametrize("transport", ["local", "nixl"])
def test_group_corrupted_after_its_announcement(workers, monkeypatch, transport, where):
    """--verify-kv: one byte of the first group's slice (its K/V data, or its FP8 scales) flips in
    the prefill worker's pool after the group was announced with its checksums, before the decode
    worker pulls it. The request fails with the integrity error naming the layers, through the
    Orchestrator (which aborts it on both sides); every block comes back; the next request decodes
    the tokens it decoded before."""
    kw = dict(transport=transport, enable_prefix_caching=False, verify_kv=True)
    p, d = workers.pair(**kw)
    policy = KVTransferPolicy("layerwise", 1, LAYERS, LAYOUT.bytes_per_token)
    handles = [WorkerHandle(p.name, "prefill", p, is_ray=False)], [WorkerHandle(d.name, "decode", d, is_ray=False)]
    real, flipped = d.transport.read, []
    ranges = LAYOUT.layer_ranges(0, 1)
    offset = ranges[0][0] + 100 if where == "data" else ranges[1][0] + 3  # inside layer 0's slice

    def corrupting_read(handle: KVHandle, local_blocks: list[int], *args: Any, **kw: Any) -> TransferStats:
        if handle.request_id != "corrupt" or flipped:
            return real(handle, local_blocks, *args, **kw)
        assert handle.layers == (0, 1) and handle.checksums  # announced with its slice's checksums
        pool = p.engine.runner.cache.raw  # the prefill worker's pool, reachable in this process
        block = handle.block_ids[0]
        pool[block, offset] ^= 0x20
        flipped.append(block)
        try:
            return real(handle, local_blocks, *args, **kw)
        finally:
            pool[block, offset] ^= 0x20  # only this pull sees it

    monkeypatch.setattr(d.transport, "read", corrupting_read)

    async def main() -> tuple[list[int], str, list[int]]:
        orch = Orchestrator("disagg", TINY, *handles, "round_robin", kv_policy=policy)
        await orch.start()
        try:
            before = [ev.token_id async for ev in orch.generate(make_request("before"))]
            with pytest.raises(WorkerError) as err:
                [ev async for ev in orch.generate(make_request("corrupt"))]
            after = [ev.token_id async for ev in orch.generate(make_request("after"))]
            assert orch.timeline("corrupt").finish_reason == "error"
            return before, str(err.value), after
        finally:
            await orch.shutdown()

    before, error, after = asyncio.run(main())
    assert flipped, "the corrupting read never ran"
    assert "KV integrity check failed" in error and "layers 0-0 of 1 of" in error, error
    assert repr(p.name) in error and "not decoded" in error
    assert after == before and len(after) == MAX_TOKENS
    wait_until_clean(p, d)


@pytest.mark.parametrize("side", ["decode", "prefill", "both"])
def test_abort_mid_stream(workers, monkeypatch, side):
    """An abort while the prompt streams (after the first chunk's groups were pulled). On the
    decode side: the stream closes, its blocks come back, nothing more is emitted for it, and the
    prefill's copy goes at its lease. On the prefill side: the prefill call fails, its blocks come
    back, and its "failed" message ends the decode side's stream with an error. Both: what the
    router does; nothing at all is emitted."""
    kw = dict(chunk_size=32, enable_prefix_caching=False, lease_s=2.0)
    p, d = workers.pair(**kw)
    reads = _reads(monkeypatch, d)
    reached, go = hold_forward_pass(monkeypatch, p, at_call=3)
    req = make_request("aborted")
    call = _Background(p.prefill, req, d.open_stream(req, p.describe(), 2))
    aborts = []
    try:
        assert reached.wait(30), "the third chunk never started"
        wait_until(lambda: _pulled_groups(reads, "aborted") == 4, 10, "the first two chunks' groups pulled")
        if side in ("decode", "both"):
            assert d.abort("aborted") is True
        if side in ("prefill", "both"):  # answered on the prefill's loop thread, once the held chunk ran
            aborts.append(_Background(p.abort, "aborted"))
    finally:
        go.set()
    for a in aborts:
        assert a.outcome() is True
    call.outcome()
    if side == "decode":
        assert call.error is None and call.result.streamed  # its messages still reached the decode side
    else:
        assert isinstance(call.error, WorkerError) and "aborted" in str(call.error)
    wait_until_clean(p, d, timeout_s=10)
    # what the decode worker emitted for it: an error, only when it did not abort it itself (the
    # error comes with the blocks' release, which wait_until_clean waited for)
    if side == "prefill":
        (ev,) = collect_events(d, {"aborted"})["aborted"]
        assert ev.kind == "error" and f"KV stream failed on {p.name}: request aborted was aborted" in (ev.error or "")
    else:
        assert [e for e in d.poll_events(0.05) if e.request_id == "aborted"] == []
    assert len(serve_request(p, d, make_request("after"), 2).tokens) == MAX_TOKENS
    wait_until_clean(p, d)


def test_a_prompt_queued_longer_than_the_transfer_timeout_still_streams(workers, monkeypatch):
    """The decode side's silence timeout runs from the prefill side's first message: a prompt may
    wait in the prefill queue (here: a slow first step) longer than --transfer-timeout-s and still
    stream, as a bulk pull of it would."""
    p, d = workers.pair(transfer_timeout_s=1.0)
    real = p.engine.runner.execute

    def slow(decode, items, on_layer=None):
        time.sleep(1.5)
        return real(decode, items, on_layer)

    monkeypatch.setattr(p.engine.runner, "execute", slow)
    streamed = serve_request(p, d, make_request("slow-lw"), layers_per_group=1)
    monkeypatch.setattr(p.engine.runner, "execute", real)
    assert streamed.transfer.mode == "layerwise"
    assert streamed.tokens == serve_request(p, d, make_request("slow-bulk"), None).tokens
    wait_until_clean(p, d)


def test_a_prefill_worker_the_decode_side_cannot_reach_is_a_worker_error(workers):
    """open_stream to a prefill worker that is gone: a WorkerError naming both (the router then
    fails the request and checks both workers' health), not a bare transport error (a 500)."""
    p, d = workers.pair()
    source = p.describe()
    p.shutdown()
    with pytest.raises(WorkerError, match=f"{d.name} cannot reach {p.name}"):
        d.open_stream(make_request("gone"), source, 1)
    wait_until_clean(d)
