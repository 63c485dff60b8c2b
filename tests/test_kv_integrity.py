"""KV integrity (--verify-kv): the holder's per-block checksums travel in the KVHandle and the
puller checks what arrived. A block corrupted at the source after it was summed, or in flight
(flipped in the destination as the pull lands), fails that request with a clear error, every
time, for every block and byte position tried; the blocks return to both pools and the next
request decodes the same greedy tokens as before. Real NIXL (two agents in this process)."""

from __future__ import annotations

import pytest
import torch

from contracts.worker import GenerateRequest, StreamEvent, WorkerConfig
from decode_worker.worker import DecodeWorker
from engine.kv.layout import KVLayout
from engine.sequence import SamplingParams
from prefill_worker.worker import PrefillWorker
from tests.helpers import wait_until
from transport import KVChecksumMismatch, make_transport
from transport.integrity import block_checksums
from transport.nixl_backend import NixlTransport

pytestmark = pytest.mark.timeout(120)
PROMPT = list(b"a prompt long enough for three KV blocks of sixteen")  # 51 tokens: 4 blocks


def test_checksums_per_block_in_id_order():
    pool = torch.randint(0, 256, (8, 96), dtype=torch.uint8)
    sums = block_checksums(pool, [5, 1, 2, 3, 7])
    assert sums == tuple(block_checksums(pool, [b])[0] for b in [5, 1, 2, 3, 7])
    assert len(set(sums)) == 5
    for b, byte in [(2, 0), (2, 95), (7, 40)]:
        pool[b, byte] ^= 1
        after = block_checksums(pool, [5, 1, 2, 3, 7])
        assert [i for i in range(5) if after[i] != sums[i]] == [[5, 1, 2, 3, 7].index(b)]
        pool[b, byte] ^= 1
    odd = torch.randint(0, 256, (4, 36), dtype=torch.uint8)  # not a multiple of 8 bytes: 32-bit words
    before = block_checksums(odd, [0, 3])
    odd[3, 35] ^= 128
    assert block_checksums(odd, [0, 3])[1] != before[1]


def _layout(num_blocks: int) -> KVLayout:
    return KVLayout(
        num_layers=2, block_size=16, num_kv_heads=2, head_dim=8, dtype="fp8", scale_layout="none",
        num_blocks=num_blocks,
    )  # fmt: skip


def test_corruption_detected_at_every_block_and_position():
    """Holder blocks [9, 10, 4] pulled into [0, 1, 2]: one flipped bit in any block, at its first,
    middle or last byte, after the holder summed it, is caught; the clean pull passes."""
    layout = _layout(16)
    src_pool = torch.randint(0, 256, (layout.num_blocks, layout.block_bytes), dtype=torch.uint8)
    dst_pool = torch.zeros_like(src_pool)
    holder, puller = make_transport("nixl", "kvi-holder"), make_transport("nixl", "kvi-puller", progress_thread=False)
    try:
        holder.register(src_pool, layout)
        puller.register(dst_pool, layout)
        handle = holder.make_handle("req", [9, 10, 4], 40, lease_s=60, checksum=True)
        stats = puller.read(handle, [0, 1, 2])
        assert stats.verify_s > 0 and torch.equal(dst_pool[:3], src_pool[[9, 10, 4]])
        caught = 0
        for pos, block in enumerate(handle.block_ids):
            for byte in (0, layout.block_bytes // 2, layout.block_bytes - 1):
                src_pool[block, byte] ^= 0x10
                with pytest.raises(KVChecksumMismatch, match=rf"KV integrity check failed: 1 of 3 blocks .*#{pos} "):
                    puller.read(handle, [0, 1, 2])
                caught += 1
                src_pool[block, byte] ^= 0x10
        assert caught == 9
        puller.read(handle, [0, 1, 2])  # clean again
        unsummed = holder.make_handle("req2", [9, 10, 4], 40, lease_s=60)  # --verify-kv off: no check
        assert unsummed.checksums == () and puller.read(unsummed, [0, 1, 2]).verify_s == 0.0
    finally:
        puller.close()
        holder.close()


def _events(d: DecodeWorker, rid: str, timeout_s: float = 30.0) -> list[StreamEvent]:
    out: list[StreamEvent] = []

    def finished() -> bool:
        out.extend(e for e in d.poll_events(0.05) if e.request_id == rid)  # waits up to 50 ms itself
        return any(e.finished for e in out)

    wait_until(finished, timeout_s, f"{rid} to finish", interval=0)
    return out


def _run(p: PrefillWorker, d: DecodeWorker, rid: str) -> list[StreamEvent]:
    req = GenerateRequest(rid, list(PROMPT), SamplingParams(max_tokens=6, ignore_eos=True))
    result = p.prefill(req)
    d.submit_prefilled(req, result)
    events = _events(d, rid)
    if events[-1].kind == "error":  # what the router does on an error: abort on both sides
        p.abort(rid)
        d.abort(rid)
    return [result.first_token, *[e.token_id for e in events if e.kind == "token"]], events


def test_block_corrupted_mid_pull_fails_only_that_request(monkeypatch):
    # the same prompt twice: without the prefix cache the second request pulls every block again
    cfg = WorkerConfig(model="tiny", transport="nixl", num_blocks=32, verify_kv=True, enable_prefix_caching=False)
    p, d = PrefillWorker(cfg, "kvi-prefill"), DecodeWorker(cfg, "kvi-decode")
    try:
        clean, _ = _run(p, d, "before")
        assert len(clean) == 6
        assert isinstance(d.transport, NixlTransport)
        real = d.transport._read_group

        def corrupting(peer, runs, deadline, request_id, yielding=False):  # the copy lands, then a bit flips
            real(peer, runs, deadline, request_id, yielding)
            if request_id == "corrupt":
                d.transport._pool.view(-1)[runs[0].local_offset + 100] ^= 0x01

        monkeypatch.setattr(d.transport, "_read_group", corrupting)
        _, events = _run(p, d, "corrupt")
        assert [e.kind for e in events] == ["error"]
        assert "KV integrity check failed: 1 of 4 blocks pulled from 'kvi-prefill'" in events[0].error
        wait_until(
            lambda: all(w.stats().blocks_free == w.stats().blocks_total for w in (p, d)),
            5,
            "every block back after the corrupt pull (leaked?)",
            interval=0.02,
        )
        again, _ = _run(p, d, "after")
        assert again == clean
    finally:
        d.shutdown()
        p.shutdown()
