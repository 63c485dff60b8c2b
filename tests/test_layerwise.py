"""Layer-wise KV streaming (issue 39 item 6): a streamed prompt decodes exactly what a bulk pull
decodes, and its blocks always come back.

- Greedy tokens: the same request streamed group by group (`--kv-transfer layerwise`) and pulled
  whole (bulk) decodes the same tokens, over real in-process prefill and decode workers on the
  "local" transport and on real NIXL/UCX: whole and chunked prefill, prefix cache on and off, 1 and
  3 layers per group (tiny has 4 layers: groups of 1, and of 3 + 1), --verify-kv on. A decode-side
  prefix hit streams only the missing blocks (the stream's bytes are theirs); a prefill-side hit
  streams every block, the cached ones too. 2P2D behind an Orchestrator (round robin), several
  requests at once, each compared with a bulk run; a request's own mode over the server's; no
  room for a stream on the decode side falls back to bulk.
- The block ledger: every test ends with no KV block in use on any worker it made (cached blocks
  count as free), each worker's ledger consistent.

Faults mid-stream: tests/test_layerwise_faults.py; one server end to end:
tests/test_layerwise_server.py; the policy and the configuration: tests/test_layerwise_policy.py.
The workers and the shapes they share: tests/layerwise_workers.py.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from contracts.worker import GenerateRequest
from prefill_worker.kv_stream import layer_groups
from router.dispatch.kv_transfer_policy import KVTransferPolicy
from router.lifecycle.orchestrator import Orchestrator
from router.workers.handle import WorkerHandle
from tests.layerwise_workers import (
    BLOCK_BYTES,
    BS,
    HIT_PROMPT,
    LAYERS,
    LAYOUT,
    MAX_TOKENS,
    PROMPT,
    PROMPT_BLOCKS,
    SHARED,
    TEXT,
    TINY,
    Workers,
    hold_forward_pass,
    make_request,
    serve_request,
    wait_until_clean,
    workers_fixture,
)

pytestmark = pytest.mark.timeout(180)

workers = workers_fixture()


# ---- one prefill and one decode worker ---------------------------------------------------------
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
    bulk = serve_request(pb, db, make_request("bulk"), None)
    p, d = workers.pair(**kw)
    lw = serve_request(p, d, make_request("layerwise"), layers_per_group)

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
    wait_until_clean(pb, db, p, d)


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
    first = serve_request(p, d, make_request("first"), 1)
    assert first.transfer.bytes == PROMPT_BLOCKS * BLOCK_BYTES
    wait_until_clean(p, d)  # the first prompt's blocks are cached now (where the cache is on), none in use
    second = serve_request(p, d, make_request("second", HIT_PROMPT), 1)
    ref = serve_request(
        *workers.pair(transport=transport, enable_prefix_caching=False), make_request("ref", HIT_PROMPT), None
    )

    assert second.tokens == ref.tokens and second.result.streamed
    decode_hit = SHARED // BS if hit in ("decode", "both") else 0
    missing = PROMPT_BLOCKS - decode_hit
    assert second.admitted.timings == {"cached_tokens": decode_hit * BS, "blocks_pulled": missing}
    assert second.transfer.bytes == missing * BLOCK_BYTES == sum(g[4] for g in second.transfer.group_spans)
    assert second.result.timings["cached_tokens"] == (SHARED if hit in ("prefill", "both") else 0)
    assert second.transfer.mode == "layerwise" and second.transfer.verify_s > 0
    wait_until_clean(p, d, *workers.made[2:])


# ---- 2P2D behind an Orchestrator --------------------------------------------------------------
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
    reqs = [make_request(f"r{i}", prompt) for i, prompt in enumerate(MANY)]
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
    wait_until_clean(*workers.made)


def test_request_override_and_a_one_token_stream(workers):
    """On a layer-wise server a request may ask for bulk (and on a bulk server for layer-wise); a
    streamed request whose first token is its last (max_tokens 1) leaves no block behind."""
    orch = _orchestrator(workers, "local", "layerwise")
    reqs = [
        make_request("asks-bulk", kv_transfer="bulk"),
        make_request("default", PROMPT[:100]),
        make_request("one-token", HIT_PROMPT, max_tokens=1),
    ]
    tls = _generate_all(orch, reqs)
    assert tls["asks-bulk"]["kv_transfer"] == "bulk" and tls["default"]["kv_transfer"] == "layerwise"
    assert tls["one-token"]["kv_transfer"] == "layerwise" and len(tls["one-token"]["token_ids"]) == 1
    wait_until_clean(*workers.made)
    orch = _orchestrator(workers, "local", "bulk")
    tls2 = _generate_all(orch, [make_request("asks-layerwise", kv_transfer="layerwise")])
    assert tls2["asks-layerwise"]["kv_transfer"] == "layerwise"
    assert tls2["asks-layerwise"]["token_ids"] == tls["asks-bulk"]["token_ids"]
    wait_until_clean(*workers.made)


def test_no_room_on_the_decode_side_falls_back_to_bulk(workers, monkeypatch):
    """Two 300-token prompts at once on a decode worker with room for one: the first to open its
    stream reserves 19 of the 24 blocks, the other finds no room (the prefill is held until both
    asked), so it is prefilled without a stream and pulled whole once the first has finished.
    Both decode their bulk tokens."""
    other = list((b"An unrelated prompt of the same length, sharing no block with the first one. " * 4)[:300])
    reqs = [make_request("a", PROMPT), make_request("b", other)]
    p, d = workers.prefill(), workers.decode(num_blocks=24)
    _, go = hold_forward_pass(monkeypatch, p, at_call=1)
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
    ref = {r.request_id: serve_request(*workers.pair(enable_prefix_caching=False), r, None).tokens for r in reqs}
    assert {rid: tl["token_ids"] for rid, tl in tls.items()} == ref
    wait_until_clean(*workers.made)
