"""Layer-wise KV streaming (issue 39 item 6): a streamed prompt decodes exactly what a bulk pull
decodes, its blocks always come back, and a fault mid-stream ends that request alone.

- Greedy tokens: the same request streamed group by group (`--kv-transfer layerwise`) and pulled
  whole (bulk) decodes the same tokens, over real in-process prefill and decode workers on the
  "local" transport and on real NIXL/UCX: whole and chunked prefill, prefix cache on and off, 1 and
  3 layers per group (tiny has 4 layers: groups of 1, and of 3 + 1), --verify-kv on. A decode-side
  prefix hit streams only the missing blocks (the stream's bytes are theirs); a prefill-side hit
  streams every block, the cached ones too. 2P2D behind an Orchestrator (round robin), several
  requests at once, each compared with a bulk run.
- The block ledger: every test ends with no KV block in use on any worker it made (cached blocks
  count as free), each worker's ledger consistent.
- Faults mid-stream: a prefill step that fails after the first chunk's groups; a prefill worker shut
  down (its "failed" message sent, or lost: the decode side's transfer timeout); the decode worker
  shut down (the prefill's blocks come back at their lease); a group corrupted after it was
  announced under --verify-kv; an abort on either side. The request ends with a clear error (or
  silently, when aborted), its blocks come back on both sides, other requests are unaffected and
  the workers serve the next one.
- One server end to end (Ray, NIXL, uvicorn, the openai client): per-request `kv_transfer`, the
  timeline's mode and overlap, a 400 for an unknown mode, no block left in use.
- router/dispatch/kv_transfer_policy.py's decisions (fast) and ServeConfig's checks of --kv-transfer and
  --kv-stream-layers.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from contracts.worker import GenerateRequest, PrefillResult, StreamEvent, WorkerConfig, WorkerError
from decode_worker.worker import DecodeWorker
from engine.config import PRESETS, CacheConfig
from engine.kv.layout import KVLayout
from engine.sequence import SamplingParams
from prefill_worker.kv_stream import layer_groups
from prefill_worker.worker import PrefillWorker
from router.dispatch.kv_transfer_policy import KVTransferPolicy
from router.lifecycle.orchestrator import Orchestrator
from router.workers.handle import WorkerHandle
from tests.helpers import wait_until
from transport.wire import KVHandle, TransferStats

pytestmark = pytest.mark.timeout(180)

TINY = PRESETS["tiny"]
LAYERS = TINY.num_layers
BS = 16
LAYOUT = KVLayout.build(TINY, CacheConfig(block_size=BS, num_blocks=1))
BLOCK_BYTES = LAYOUT.block_bytes
TEXT = b"Layer-wise KV streaming pulls each group of layers while the rest of the prompt still prefills. "
PROMPT = list((TEXT * 4)[:300])  # 300 tokens: 18 full blocks of 16 and a partial one
PROMPT_BLOCKS = -(-len(PROMPT) // BS)
SHARED = 160  # tokens (10 full blocks) that HIT_PROMPT shares with PROMPT
HIT_PROMPT = PROMPT[:SHARED] + list(
    (b"Then another question, so that only its last blocks differ from the first. " * 2)[:140]
)
MAX_TOKENS = 6
_names = itertools.count()


# ---- workers and how a request is served over them ---------------------------------------------
class Workers:
    """In-process workers made by one test, all shut down after it."""

    def __init__(self) -> None:
        self.made: list[PrefillWorker | DecodeWorker] = []

    def prefill(self, **kw: Any) -> PrefillWorker:
        w = PrefillWorker(_cfg(**kw), f"lw-prefill-{next(_names)}")
        self.made.append(w)
        return w

    def decode(self, **kw: Any) -> DecodeWorker:
        w = DecodeWorker(_cfg(**kw), f"lw-decode-{next(_names)}")
        self.made.append(w)
        return w

    def pair(self, **kw: Any) -> tuple[PrefillWorker, DecodeWorker]:
        """A prefill and a decode worker with the same settings."""
        return self.prefill(**kw), self.decode(**kw)


@pytest.fixture
def workers():
    made = Workers()
    yield made
    for w in reversed(made.made):
        w.shutdown()


def _cfg(**kw: Any) -> WorkerConfig:
    return WorkerConfig(**{"model": "tiny", "transport": "local", "num_blocks": 64, **kw})


def _req(rid: str, prompt: list[int] = PROMPT, max_tokens: int = MAX_TOKENS, **kw: Any) -> GenerateRequest:
    return GenerateRequest(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True), **kw)


def _collect(d: DecodeWorker, rids: set[str], timeout_s: float = 30.0) -> dict[str, list[StreamEvent]]:
    """Poll `d` until every id in `rids` has a finished event; every event seen, by request."""
    out: dict[str, list[StreamEvent]] = {r: [] for r in rids}

    def all_done() -> bool:
        for ev in d.poll_events(0.05):  # waits up to 50 ms itself
            out.setdefault(ev.request_id, []).append(ev)
        return all(evs and evs[-1].finished for r, evs in out.items() if r in rids)

    wait_until(all_done, timeout_s, lambda: f"{sorted(r for r in rids if not out[r])} to finish", interval=0)
    return out


@dataclass
class Served:
    tokens: list[int]  # the first token (prefill) and every decoded one
    result: PrefillResult
    events: list[StreamEvent]

    @property
    def admitted(self) -> StreamEvent:
        return next(e for e in self.events if e.kind == "admitted")

    @property
    def transfer(self) -> TransferStats:
        stats = self.admitted.transfer
        assert stats is not None
        return stats


def _serve(p: PrefillWorker, d: DecodeWorker, req: GenerateRequest, layers_per_group: int | None) -> Served:
    """What the router does: with `layers_per_group`, open a stream first and let the decode worker
    admit the request by itself; else (or if it did not stream) pull it whole."""
    target = None
    if layers_per_group is not None:
        target = d.open_stream(req, p.describe(), layers_per_group)
        assert target is not None, "the decode worker had no room for the stream"
    result = p.prefill(req, target)
    if not result.streamed:
        d.submit_prefilled(req, result)
    events = _collect(d, {req.request_id})[req.request_id]
    assert [e.kind for e in events if e.kind != "token"] == ["admitted"], events
    return Served([result.first_token, *[e.token_id for e in events if e.kind == "token"]], result, events)


def _clean(*ws: PrefillWorker | DecodeWorker, timeout_s: float = 10.0) -> None:
    """Every block back on every one of `ws` (cached ones count as free), nothing queued, in
    transfer or running, and each ledger consistent (checked on the loop thread, its only user)."""

    def used() -> dict[str, tuple[int, int, int]]:
        out = {}
        for w in ws:
            s = w.stats()
            out[w.name] = (s.blocks_used, s.queue_depth, s.running)
        return out

    wait_until(lambda: not any(any(v) for v in used().values()), timeout_s, lambda: f"no block in use: {used()}")
    for w in ws:
        w.call(w.engine.blocks.check)
    assert all(len(w.receiver) == 0 for w in ws if isinstance(w, DecodeWorker) and w.receiver is not None)


def _reads(monkeypatch: pytest.MonkeyPatch, d: DecodeWorker) -> list[KVHandle]:
    """Every handle `d`'s transport is asked to read (a failing read too), in order."""
    real, seen = d.transport.read, []

    def read(handle: KVHandle, local_blocks: list[int], *args: Any, **kw: Any) -> TransferStats:
        seen.append(handle)
        return real(handle, local_blocks, *args, **kw)

    monkeypatch.setattr(d.transport, "read", read)
    return seen


def _gate(
    monkeypatch: pytest.MonkeyPatch, p: PrefillWorker, at_call: int, announce: bool = True
) -> tuple[threading.Event, threading.Event]:
    """Hold `p`'s `at_call`-th forward pass (chunked: its chunk) until `go` is set; `reached` is set
    when it starts, so the earlier chunks' groups are announced by then. `announce=False`: that
    pass then runs without announcing its groups (the worker is going away meanwhile)."""
    real, calls = p.engine.runner.execute, itertools.count(1)
    reached, go = threading.Event(), threading.Event()

    def gated(decode, items, on_layer=None):
        if next(calls) == at_call:
            reached.set()
            go.wait(30)
            if not announce:
                on_layer = None
        return real(decode, items, on_layer)

    monkeypatch.setattr(p.engine.runner, "execute", gated)
    return reached, go


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


# ---- (1) greedy tokens: layer-wise == bulk ------------------------------------------------------
@pytest.mark.parametrize("layers_per_group", [1, 3])
@pytest.mark.parametrize("prefix_cache", [True, False], ids=["prefix-cache", "no-prefix-cache"])
@pytest.mark.parametrize("chunk_size", [None, 32], ids=["whole", "chunks-of-32"])
@pytest.mark.parametrize("transport", ["local", "nixl"])
def test_layerwise_decodes_the_bulk_tokens(workers, transport, chunk_size, prefix_cache, layers_per_group):
    """Each mode on its own fresh pair (so neither finds the other's blocks in a cache); every
    group of every chunk is pulled once, with its --verify-kv checksums, and together they are
    exactly the bytes a bulk pull moves."""
    kw = dict(transport=transport, chunk_size=chunk_size, enable_prefix_caching=prefix_cache, verify_kv=True)
    pb, db = workers.pair(**kw)
    bulk = _serve(pb, db, _req("bulk"), None)
    p, d = workers.pair(**kw)
    lw = _serve(p, d, _req("layerwise"), layers_per_group)

    assert lw.tokens == bulk.tokens and len(lw.tokens) == MAX_TOKENS
    assert lw.result.streamed and not bulk.result.streamed
    chunks = 1 if chunk_size is None else -(-len(PROMPT) // chunk_size)
    groups = layer_groups(LAYERS, layers_per_group) * chunks  # in the order they were written
    s, b = lw.transfer, bulk.transfer
    assert (s.mode, b.mode) == ("layerwise", "bulk") and s.groups == len(groups)
    assert [g[:2] for g in s.group_spans] == groups  # each pulled once, in order
    assert [g[:2] for g in lw.result.stream_groups] == groups  # each announced once
    assert s.bytes == sum(g[4] for g in s.group_spans) == b.bytes == PROMPT_BLOCKS * BLOCK_BYTES
    assert s.verify_s > 0 and b.verify_s > 0  # both checked their checksums
    assert lw.admitted.timings == {"cached_tokens": 0, "blocks_pulled": PROMPT_BLOCKS}
    _clean(pb, db, p, d)


@pytest.mark.parametrize("chunk_size", [None, 24], ids=["whole", "chunks-of-24"])
@pytest.mark.parametrize("hit", ["decode", "prefill", "both"])
@pytest.mark.parametrize("transport", ["local", "nixl"])
def test_prefix_hits_stream_what_the_decode_side_lacks(workers, transport, hit, chunk_size):
    """A second prompt shares 10 full blocks with the first. A decode-side hit: only the 9 blocks
    past it travel (the stream's bytes are theirs, the hit is not pulled). A prefill-side hit: the
    prefill computes only the rest but announces every block, the cached ones too. Chunks of 24
    end inside blocks and inside the hit: a block is announced only once it is whole."""
    kw = dict(transport=transport, chunk_size=chunk_size, verify_kv=True)
    p = workers.prefill(**kw, enable_prefix_caching=hit in ("prefill", "both"))
    d = workers.decode(**kw, enable_prefix_caching=hit in ("decode", "both"))
    first = _serve(p, d, _req("first"), 1)
    assert first.transfer.bytes == PROMPT_BLOCKS * BLOCK_BYTES
    _clean(p, d)  # the first prompt's blocks are cached now (where the cache is on), none in use
    second = _serve(p, d, _req("second", HIT_PROMPT), 1)
    ref = _serve(*workers.pair(transport=transport, enable_prefix_caching=False), _req("ref", HIT_PROMPT), None)

    assert second.tokens == ref.tokens and second.result.streamed
    decode_hit = SHARED // BS if hit in ("decode", "both") else 0
    missing = PROMPT_BLOCKS - decode_hit
    assert second.admitted.timings == {"cached_tokens": decode_hit * BS, "blocks_pulled": missing}
    assert second.transfer.bytes == missing * BLOCK_BYTES == sum(g[4] for g in second.transfer.group_spans)
    assert second.result.timings["cached_tokens"] == (SHARED if hit in ("prefill", "both") else 0)
    assert second.transfer.mode == "layerwise" and second.transfer.verify_s > 0
    _clean(p, d, *workers.made[2:])


def _orchestrator(workers: Workers, transport: str, kv_transfer: str) -> Orchestrator:
    """2P2D (one prefill worker chunked, one whole), round robin, every remote prefill `kv_transfer`."""
    prefill = [workers.prefill(transport=transport, chunk_size=c) for c in (32, None)]
    decode = [workers.decode(transport=transport) for _ in range(2)]
    policy = KVTransferPolicy(kv_transfer, 1, LAYERS, LAYOUT.bytes_per_token)
    return Orchestrator(
        "disagg",
        TINY,
        [WorkerHandle(w.name, "prefill", w, is_ray=False) for w in prefill],
        [WorkerHandle(w.name, "decode", w, is_ray=False) for w in decode],
        "round_robin",
        kv_policy=policy,
    )


def _generate_all(orch: Orchestrator, reqs: list[GenerateRequest]) -> dict[str, dict]:
    """Every request at once through `orch`; their timelines."""

    async def main() -> dict[str, dict]:
        await orch.start()
        try:

            async def one(req: GenerateRequest) -> None:
                [ev async for ev in orch.generate(req)]

            await asyncio.gather(*(one(r) for r in reqs))
            return {r.request_id: orch.timeline(r.request_id).to_dict() for r in reqs}
        finally:
            await orch.shutdown()

    return asyncio.run(main())


MANY = [PROMPT, list(b"short prompt"), HIT_PROMPT, list(TEXT), PROMPT[:64], list(b"x" * 17)]


@pytest.mark.parametrize("transport", ["local", "nixl"])
def test_2p2d_requests_at_once_decode_the_bulk_tokens(workers, transport):
    """Six prompts (12 to 300 tokens, two sharing 10 blocks) at once over 2P2D, streamed and (on
    other workers) pulled whole: the same tokens for each, every request streamed and moving what
    its decode worker lacked, both workers of each pool used, no block left."""
    reqs = [_req(f"r{i}", prompt) for i, prompt in enumerate(MANY)]
    bulk = _generate_all(_orchestrator(workers, transport, "bulk"), reqs)
    layerwise = _generate_all(_orchestrator(workers, transport, "layerwise"), reqs)
    for r in reqs:
        lw, b = layerwise[r.request_id], bulk[r.request_id]
        assert lw["token_ids"] == b["token_ids"] and len(lw["token_ids"]) == MAX_TOKENS, r.request_id
        assert (lw["kv_transfer"], lw["transfer"]["mode"]) == ("layerwise", "layerwise")
        assert (b["kv_transfer"], b["transfer"]["mode"]) == ("bulk", "bulk")
        for tl in (lw, b):  # what the decode worker lacked (HIT_PROMPT may find PROMPT's blocks there)
            assert tl["kv_blocks_pulled"] == tl["kv_blocks"] - tl["decode_cached_tokens"] // BS
            assert tl["transfer"]["bytes"] == tl["kv_blocks_pulled"] * BLOCK_BYTES, (r.request_id, tl)
        assert lw["finish_reason"] == "length"
    for key in ("prefill_worker", "decode_worker"):
        assert len({tl[key] for tl in layerwise.values()}) == 2, key  # round robin used both of each pool
    _clean(*workers.made)


def test_request_override_and_a_one_token_stream(workers):
    """On a layer-wise server a request may ask for bulk (and on a bulk server for layer-wise); a
    streamed request whose first token is its last (max_tokens 1) leaves no block behind."""
    orch = _orchestrator(workers, "local", "layerwise")
    reqs = [
        _req("asks-bulk", kv_transfer="bulk"),
        _req("default", PROMPT[:100]),
        _req("one-token", HIT_PROMPT, max_tokens=1),
    ]
    tls = _generate_all(orch, reqs)
    assert tls["asks-bulk"]["kv_transfer"] == "bulk" and tls["default"]["kv_transfer"] == "layerwise"
    assert tls["one-token"]["kv_transfer"] == "layerwise" and len(tls["one-token"]["token_ids"]) == 1
    _clean(*workers.made)
    orch = _orchestrator(workers, "local", "bulk")
    tls2 = _generate_all(orch, [_req("asks-layerwise", kv_transfer="layerwise")])
    assert tls2["asks-layerwise"]["kv_transfer"] == "layerwise"
    assert tls2["asks-layerwise"]["token_ids"] == tls["asks-bulk"]["token_ids"]
    _clean(*workers.made)


def test_no_room_on_the_decode_side_falls_back_to_bulk(workers, monkeypatch):
    """Two 300-token prompts at once on a decode worker with room for one: the first to open its
    stream reserves 19 of the 24 blocks, the other finds no room (the prefill is held until both
    asked), so it is prefilled without a stream and pulled whole once the first has finished.
    Both decode their bulk tokens."""
    other = list((b"An unrelated prompt of the same length, sharing no block with the first one. " * 4)[:300])
    reqs = [_req("a", PROMPT), _req("b", other)]
    p, d = workers.prefill(), workers.decode(num_blocks=24)
    _, go = _gate(monkeypatch, p, at_call=1)
    real_open, opened = d.open_stream, []

    def open_stream(req: GenerateRequest, source: Any, layers_per_group: int) -> Any:
        target = real_open(req, source, layers_per_group)
        opened.append(target)
        if len(opened) == len(reqs):
            go.set()
        return target

    monkeypatch.setattr(d, "open_stream", open_stream)
    orch = Orchestrator(
        "disagg",
        TINY,
        [WorkerHandle(p.name, "prefill", p, is_ray=False)],
        [WorkerHandle(d.name, "decode", d, is_ray=False)],
        kv_policy=KVTransferPolicy("layerwise", 1, LAYERS, LAYOUT.bytes_per_token),
    )
    try:
        tls = _generate_all(orch, reqs)
    finally:
        go.set()
    assert sum(t is None for t in opened) == 1
    assert sorted(tl["kv_transfer"] for tl in tls.values()) == ["bulk", "layerwise"]
    for tl in tls.values():
        assert tl["transfer"]["mode"] == tl["kv_transfer"] and tl["finish_reason"] == "length"
    ref = {r.request_id: _serve(*workers.pair(enable_prefix_caching=False), r, None).tokens for r in reqs}
    assert {rid: tl["token_ids"] for rid, tl in tls.items()} == ref
    _clean(*workers.made)


# ---- (3) faults mid-stream ------------------------------------------------------------------------
@pytest.mark.parametrize("transport", ["local", "nixl"])
def test_prefill_step_failure_after_the_first_chunk(workers, monkeypatch, transport):
    """The victim's second chunk raises on its prefill worker, after the first chunk's groups were
    pulled: the decode worker ends the victim with the prefill's error and frees its blocks, while a
    bystander streamed at the same time from another prefill worker into the same decode worker
    decodes its tokens; the failing prefill worker then serves the next request."""
    kw = dict(transport=transport, chunk_size=32, enable_prefix_caching=False, verify_kv=True)
    bad, good, d = workers.prefill(**kw), workers.prefill(**kw), workers.decode(**kw)
    want = _serve(good, d, _req("warm-up"), 1).tokens
    reads = _reads(monkeypatch, d)
    real, calls = bad.engine.runner.execute, itertools.count(1)

    def execute(decode, items, on_layer=None):
        if next(calls) == 2:
            raise RuntimeError("injected: the second chunk failed")
        return real(decode, items, on_layer)

    monkeypatch.setattr(bad.engine.runner, "execute", execute)
    victim, bystander = _req("victim"), _req("bystander")
    v_target = d.open_stream(victim, bad.describe(), 1)
    b_target = d.open_stream(bystander, good.describe(), 1)
    v_call = _Background(bad.prefill, victim, v_target)
    b_call = _Background(good.prefill, bystander, b_target)
    events = _collect(d, {"victim", "bystander"})
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
    _clean(bad, good, d)
    monkeypatch.setattr(bad.engine.runner, "execute", real)
    assert _serve(bad, d, _req("after"), 1).tokens == want  # the failing worker serves on
    _clean(bad, good, d)


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
    reached, go = _gate(monkeypatch, p, at_call=2, announce=False)
    if how == "silent":
        monkeypatch.setattr(p.streams, "fail_all", lambda error: None)
    req = _req("victim")
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
    events = _collect(d, {"victim"}, timeout_s=10)["victim"]
    assert [e.kind for e in events] == ["error"]
    error = events[0].error or ""
    timed_out = f"KV transfer failed: no progress from {p.name} for 2 s"
    if how == "failed-message":
        assert f"KV stream failed on {p.name}: worker {p.name} is shut down" in error, error
    else:
        assert timed_out in error, error
    assert _pulled_groups(reads, "victim") == 2  # nothing pulled after the first chunk
    _clean(d)
    other = workers.prefill(**kw)
    assert len(_serve(other, d, _req("after"), 2).tokens) == MAX_TOKENS
    _clean(other, d)


@pytest.mark.parametrize("transport", ["local", "nixl"])
def test_decode_worker_shut_down_mid_stream(workers, monkeypatch, transport):
    """The decode worker shuts down after the first chunk's groups were pulled: the prefill still
    returns its result (maybe no longer `streamed`: its messages find nobody) and its blocks come
    back when their lease runs out; it then serves a new decode worker."""
    kw = dict(transport=transport, chunk_size=32, enable_prefix_caching=False)
    p = workers.prefill(**kw, lease_s=2.0)
    d = workers.decode(**kw)
    reads = _reads(monkeypatch, d)
    reached, go = _gate(monkeypatch, p, at_call=2)
    req = _req("orphan")
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
    _clean(p, timeout_s=10)  # ...until it runs out
    assert p.leases_expired == 1
    d2 = workers.decode(**kw)
    assert len(_serve(p, d2, _req("after"), 1).tokens) == MAX_TOKENS
    _clean(p, d2)


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
            before = [ev.token_id async for ev in orch.generate(_req("before"))]
            with pytest.raises(WorkerError) as err:
                [ev async for ev in orch.generate(_req("corrupt"))]
            after = [ev.token_id async for ev in orch.generate(_req("after"))]
            assert orch.timeline("corrupt").finish_reason == "error"
            return before, str(err.value), after
        finally:
            await orch.shutdown()

    before, error, after = asyncio.run(main())
    assert flipped, "the corrupting read never ran"
    assert "KV integrity check failed" in error and "layers 0-0 of 1 of" in error, error
    assert repr(p.name) in error and "not decoded" in error
    assert after == before and len(after) == MAX_TOKENS
    _clean(p, d)


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
    reached, go = _gate(monkeypatch, p, at_call=3)
    req = _req("aborted")
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
    _clean(p, d, timeout_s=10)
    # what the decode worker emitted for it: an error, only when it did not abort it itself (the
    # error comes with the blocks' release, which _clean waited for)
    if side == "prefill":
        (ev,) = _collect(d, {"aborted"})["aborted"]
        assert ev.kind == "error" and f"KV stream failed on {p.name}: request aborted was aborted" in (ev.error or "")
    else:
        assert [e for e in d.poll_events(0.05) if e.request_id == "aborted"] == []
    assert len(_serve(p, d, _req("after"), 2).tokens) == MAX_TOKENS
    _clean(p, d)


# ---- (4) end to end: Ray, NIXL, uvicorn, the openai client --------------------------------------
E2E_PROMPTS = [
    "Layer-wise streaming: " + "the KV of each group of layers crosses while the prompt prefills. " * 4,
    "A second, shorter prompt about disaggregated serving and its KV transfer.",
    "Prefill computes, decode generates; between them the KV moves, " * 3,
]


@pytest.mark.ray
@pytest.mark.server
def test_server_serves_bulk_and_layerwise_per_request(ray_cluster):
    """`pdserve serve --mode disagg --kv-transfer layerwise --kv-stream-layers 1` (tiny, chunked
    prefill, --verify-kv, no prefix cache so that both modes move every block): each prompt asked
    with kv_transfer "bulk", then "layerwise", decodes the same tokens; the timelines say which
    mode ran; the streamed pulls overlap the prefill; "fast" is a 400; no block stays in use.

    Cost: one 1P1D server (two Ray actors)."""
    import argparse

    import httpx
    from openai import AsyncOpenAI

    from router.serve_cli import ServerThread, add_arguments, config_from_args
    from tests.helpers import samples

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = "--mode disagg --model tiny --prefill 1 --decode 1 --kv-transfer layerwise --kv-stream-layers 1"
    flags += " --chunk-size 32 --verify-kv --no-prefix-cache --num-blocks 64"
    cfg = config_from_args(parser.parse_args(flags.split()))
    assert (cfg.kv_transfer, cfg.kv_stream_layers, cfg.transport) == ("layerwise", 1, "nixl")

    async def ask(client: AsyncOpenAI, prompt: str, mode: str | None) -> dict:
        body = {"ignore_eos": True} | ({"kv_transfer": mode} if mode else {})
        r = await client.completions.create(
            model="tiny", prompt=prompt, max_tokens=8, temperature=0, extra_body=body
        )  # fmt: skip
        return r.model_extra["pdserve"]["timeline"]

    async def run_all(url: str, mode: str | None) -> list[dict]:
        client = AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
        return await asyncio.gather(*(ask(client, p, mode) for p in E2E_PROMPTS))

    def used(url: str) -> dict[str, float]:
        text = httpx.get(url + "/metrics", timeout=30).text
        return {labels["worker"]: v for labels, v in samples(text, "pdserve_kv_blocks_used")}

    with ServerThread(cfg, startup_timeout_s=180) as srv:
        bulk = asyncio.run(run_all(srv.base_url, "bulk"))
        layerwise = asyncio.run(run_all(srv.base_url, "layerwise"))
        default = asyncio.run(run_all(srv.base_url, None))  # the server's own: layer-wise
        for b, lw, df in zip(bulk, layerwise, default):
            assert b["token_ids"] == lw["token_ids"] == df["token_ids"] and len(b["token_ids"]) == 8
            assert (b["kv_transfer"], b["transfer"]["mode"], b["transfer"]["overlap_ms"]) == ("bulk", "bulk", 0.0)
            for tl in (lw, df):
                tr = tl["transfer"]
                # a short prompt's few chunks may all be pulled after its prefill on a loaded machine
                assert (tl["kv_transfer"], tr["mode"]) == ("layerwise", "layerwise") and tr["overlap_ms"] >= 0
                assert tr["bytes"] == b["transfer"]["bytes"] == tl["kv_blocks"] * BLOCK_BYTES
                assert tr["groups"] == len(tr["group_spans"]) >= LAYERS
        # ...but the pulls overlapped the prefill of at least one of them
        assert any(tl["transfer"]["overlap_ms"] > 0 for tl in layerwise + default)
        bad = httpx.post(
            srv.base_url + "/completions",
            json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "kv_transfer": "fast"},
            timeout=30,
        )
        assert bad.status_code == 400, bad.text
        assert bad.json()["error"]["param"] == "kv_transfer", bad.json()
        wait_until(lambda: set(used(srv.url).values()) == {0.0}, 20, lambda: f"no block in use: {used(srv.url)}")
        assert len(used(srv.url)) == 2


# ---- (5) the policy and the configuration (fast) --------------------------------------------------
LONG = 32_768  # prompt tokens whose streaming gains clearly on a 1 Gbit/s link (whatever the measured costs)


def _policy(mode: str, link_gbps: float | None = None, layers_per_group: int = 1) -> KVTransferPolicy:
    return KVTransferPolicy(mode, layers_per_group, LAYERS, LAYOUT.bytes_per_token, link_gbps)


def test_policy_bulk_and_layerwise_are_fixed():
    for n in (1, 16, 300, 100_000):
        assert _policy("bulk").streams(n) is False
        assert _policy("layerwise").streams(n) is True
    assert _policy("layerwise", layers_per_group=3).groups == 2 and _policy("layerwise").groups == LAYERS
    assert _policy("layerwise", layers_per_group=99).groups == 1
    with pytest.raises(ValueError, match="kv_transfer must be one of bulk, layerwise, auto, got 'fast'"):
        _policy("fast")


def test_policy_auto_pulls_whole_until_it_knows_a_prefill_and_a_link():
    auto = _policy("auto")
    assert auto.gain_s(LONG) is None and not auto.streams(LONG)  # nothing known
    auto.observe_pull(10_000_000, 0.08)  # a link rate (1 Gbit/s), measured
    assert auto.gain_s(LONG) is None and not auto.streams(LONG)  # no prefill measured yet
    auto.observe_prefill(0, 1.0)  # nothing learnt from an empty or instant prefill
    auto.observe_prefill(100, 0.0)
    assert not auto.streams(LONG)
    auto.observe_prefill(1000, 1.0)  # 1 ms a token
    assert auto.gain_s(LONG) is not None and auto.streams(LONG)
    nominal = _policy("auto", link_gbps=1.0)  # a nominal link: still needs a prefill
    assert not nominal.streams(LONG)
    nominal.observe_prefill(1000, 1.0)
    assert nominal.streams(LONG)


def test_policy_auto_streams_long_prompts_not_tiny_ones_on_a_slow_link():
    from costmodel.article.layerwise import LinkSpec, layerwise_threshold_tokens

    slow = _policy("auto", link_gbps=1.0)
    slow.observe_prefill(1000, 1.0)  # 1 ms a token
    assert slow.streams(LONG) and slow.gain_s(LONG) > 0
    assert not slow.streams(16) and slow.gain_s(16) < 0  # the stream's opening costs more than it hides
    # the boundary is the cost model's threshold, to the token
    t = layerwise_threshold_tokens(LAYOUT.bytes_per_token, 1e-3, slow.groups, LinkSpec.gbits(1.0))
    assert 16 < t < LONG and slow.streams(t) and not slow.streams(t - 1)
    # a link that is fast for this KV hides almost nothing: the opening is not worth it
    fast = _policy("auto", link_gbps=1000.0)
    fast.observe_prefill(1000, 1.0)
    assert not fast.streams(LONG)


def test_policy_request_override_wins():
    for server in ("bulk", "layerwise", "auto"):
        p = _policy(server)
        assert p.streams(300, "layerwise") is True
        assert p.streams(300, "bulk") is False
        assert p.streams(300, None) is (server == "layerwise")  # the server's own
    lw = _policy("layerwise")
    assert lw.streams(LONG, "auto") is False  # auto asked: decided by auto (nothing known yet)
    lw.observe_prefill(1000, 1.0)
    lw.link_gbps = 1.0
    assert lw.streams(LONG, "auto") is True and lw.streams(16, "auto") is False


def test_serve_config_checks_kv_transfer_flags():
    import argparse

    from cli import CliError
    from router.config import ConfigError, ServeConfig
    from router.serve_cli import add_arguments, config_from_args

    with pytest.raises(ConfigError, match=r"--kv-transfer 'layerwise': .*needs --mode disagg or auto"):
        ServeConfig.build({"mode": "colocated", "model": "tiny", "kv_transfer": "layerwise"})
    # auto (the default) has nothing to stream in colocated mode: accepted, a no-op there
    assert ServeConfig.build({"mode": "colocated", "model": "tiny"}).kv_transfer == "auto"
    with pytest.raises(ConfigError, match=r"--kv-stream-layers 0: must be >= 1"):
        ServeConfig.build({"mode": "disagg", "model": "tiny", "kv_stream_layers": 0})
    with pytest.raises(ConfigError, match=r"--kv-transfer 'fast': must be one of bulk, layerwise, auto"):
        ServeConfig.build({"mode": "disagg", "model": "tiny", "kv_transfer": "fast"})
    ok = ServeConfig.build({"mode": "colocated", "model": "tiny", "kv_transfer": "bulk"})
    assert ok.kv_transfer == "bulk"
    for mode in ("disagg", "auto"):
        cfg = ServeConfig.build({"mode": mode, "model": "tiny", "kv_transfer": "layerwise", "kv_stream_layers": 3})
        assert (cfg.kv_transfer, cfg.kv_stream_layers) == ("layerwise", 3)
    # the same through the command line: a clear error, not a traceback
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(CliError, match="--kv-transfer 'layerwise': .*needs --mode disagg or auto"):
        config_from_args(parser.parse_args("--mode colocated --model tiny --kv-transfer layerwise".split()))
    with pytest.raises(CliError, match="--kv-stream-layers 0: must be >= 1"):
        config_from_args(parser.parse_args("--mode disagg --model tiny --kv-stream-layers 0".split()))


def test_request_body_kv_transfer_is_checked_and_carried():
    """The body field `kv_transfer` (completions and chat): one of bulk, layerwise, auto, carried to
    the orchestrator's request; anything else is a 400 naming the field; absent: the server's."""
    from engine.checkpoint.tokenizer import ByteTokenizer
    from router.openai import protocol as oa

    tok, lim = ByteTokenizer(), oa.Limits("tiny", frozenset({"tiny"}), 256, 320, 32)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    for mode in ("bulk", "layerwise", "auto"):
        assert oa.prepare_completion({"prompt": "hi", "kv_transfer": mode}, tok, lim).kv_transfer == mode
        assert oa.prepare_chat({**chat, "kv_transfer": mode}, tok, lim).kv_transfer == mode
    assert oa.prepare_completion({"prompt": "hi"}, tok, lim).kv_transfer is None
    for bad in ("fast", "LAYERWISE", 1):
        with pytest.raises(oa.OpenAIError) as e:
            oa.prepare_completion({"prompt": "hi", "kv_transfer": bad}, tok, lim)
        assert e.value.status == 400 and e.value.body()["error"]["param"] == "kv_transfer", bad


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
    streamed = _serve(p, d, _req("slow-lw"), layers_per_group=1)
    monkeypatch.setattr(p.engine.runner, "execute", real)
    assert streamed.transfer.mode == "layerwise"
    assert streamed.tokens == _serve(p, d, _req("slow-bulk"), None).tokens
    _clean(p, d)


def test_a_prefill_worker_the_decode_side_cannot_reach_is_a_worker_error(workers):
    """open_stream to a prefill worker that is gone: a WorkerError naming both (the router then
    fails the request and checks both workers' health), not a bare transport error (a 500)."""
    p, d = workers.pair()
    source = p.describe()
    p.shutdown()
    with pytest.raises(WorkerError, match=f"{d.name} cannot reach {p.name}"):
        d.open_stream(_req("gone"), source, 1)
    _clean(d)
