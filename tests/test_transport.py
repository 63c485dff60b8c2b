"""KV transport: a prefill process ships a real engine's FP8 KV blocks to a decode process.

Oracle: the decode side, after pulling the blocks over NIXL (or the local backend), continues to
exactly the greedy tokens one process produces for the whole generation. Processes are spawned
(torch and NIXL do not survive fork); PeerInfo/KVHandle travel over a multiprocessing pipe, as the
router would carry them.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from engine.config import PRESETS, CacheConfig
from engine.core.llm_engine import LLMEngine
from engine.kv.layout import KVLayout
from engine.runner.model_runner import ModelRunner
from engine.sequence import SamplingParams, Sequence
from tests.helpers import flags, wait_until
from transport import LayoutMismatch, TransferTimeout, TransportError, make_transport
from transport.coalesce import Run, coalesce, split_for_streams
from transport.local_backend import registered_agents

pytestmark = pytest.mark.timeout(120)

CACHE = CacheConfig(block_size=16, num_blocks=48)
PROMPT = [(7 * i + 3) % 250 for i in range(45)]  # 45 tokens: 3 blocks, the last one partial
MAX_TOKENS = 6
# Free-list orders that make the pools hand out non-contiguous, non-ascending block ids.
SENDER_ORDER = [20, 21, 5]
RECEIVER_ORDER = [30, 31, 32, 40]


def _engine(prefill_only: bool) -> LLMEngine:
    return LLMEngine(ModelRunner(PRESETS["tiny"], CACHE, "fp8", "cpu", seed=0), prefill_only=prefill_only)


def _fragment(engine: LLMEngine, first: list[int]) -> None:
    """Make `first` the next blocks the engine allocates, in that order (public API only)."""
    everything = engine.blocks.allocate(engine.blocks.num_blocks)
    engine.blocks.free(first + [b for b in everything if b not in first])


def _params() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


def _whole_generation() -> list[int]:
    engine = _engine(prefill_only=False)
    seq = Sequence("ref", list(PROMPT), _params())
    engine.add_request(seq)
    while engine.has_work:
        engine.step()
    return seq.output_ids


def _prefill(engine: LLMEngine, transport) -> tuple:
    """Prefill PROMPT on a fragmented pool; returns (handle, first token, the blocks' bytes)."""
    _fragment(engine, SENDER_ORDER)
    engine.add_request(Sequence("req-1", list(PROMPT), _params()))
    (event,) = engine.step()
    seq = engine.parked["req-1"]
    blocks = seq.block_table[: engine.runner.layout.blocks_for(len(PROMPT))]
    assert blocks == SENDER_ORDER
    handle = transport.make_handle("req-1", blocks, len(PROMPT), lease_s=60)
    return handle, event.token_id, engine.runner.cache.block_bytes_view(blocks).clone()


def _decode_after_pull(transport, handle, first_token: int, sent_bytes: torch.Tensor) -> tuple[list[int], object]:
    engine = _engine(prefill_only=False)
    transport.register(engine.runner.cache.raw, engine.runner.layout)
    _fragment(engine, RECEIVER_ORDER)
    local = engine.reserve(len(PROMPT), MAX_TOKENS)
    assert local[:3] == RECEIVER_ORDER[:3]
    stats = transport.read(handle, local[: len(handle.block_ids)], timeout_s=10)
    assert torch.equal(engine.runner.cache.block_bytes_view(local[:3]), sent_bytes)
    seq = Sequence("req-1", list(PROMPT), _params(), output_ids=[first_token], block_table=local)
    engine.add_prefilled(seq)
    while engine.has_work:
        engine.step()
    return seq.output_ids, stats


def _sender_main(conn) -> None:
    """Prefill process: prefill, hand out the KV, free it once notified, close, report."""
    engine = _engine(prefill_only=True)
    transport = make_transport("nixl", "prefill-0")
    transport.register(engine.runner.cache.raw, engine.runner.layout)
    conn.send(_prefill(engine, transport))
    try:
        notified: list[str] = wait_until(transport.poll_notifications, 30, "the decode side's notice", interval=0.005)
    except AssertionError:
        notified = []  # nothing freed: the parent's check of the report says so
    freed = [engine.release(rid) for rid in notified]
    transport.close()
    conn.send(
        {
            "notified": notified,
            "freed": freed,
            "free_blocks": engine.blocks.num_free,
            "registered": transport.registered,
            "final_metadata": transport.final_metadata,
        }
    )
    conn.poll(30)  # stay alive while the parent checks the closed agent's metadata


@pytest.fixture(scope="module")
def reference_tokens() -> list[int]:
    return _whole_generation()


@pytest.mark.slow  # child processes (NIXL peers, a benchmark run): seconds each
def test_nixl_two_processes_ship_engine_kv_and_decode_matches(reference_tokens):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_sender_main, args=(child,), daemon=True)
    proc.start()
    receiver = make_transport("nixl", "decode-0", progress_thread=False)
    try:
        assert parent.poll(60), "prefill process sent nothing"
        handle, first_token, sent_bytes = parent.recv()
        tokens, stats = _decode_after_pull(receiver, handle, first_token, sent_bytes)
        assert tokens == reference_tokens
        # blocks 20,21 -> 30,31 coalesce; 5 -> 32 is its own range
        assert stats.descriptors == 2 and stats.bytes == 3 * receiver.layout.block_bytes
        assert stats.seconds > 0 and set(stats.link_ms) == {"nvlink", "ib-400g", "ib-100g"}
        receiver.notify(handle.agent, handle.request_id)
        assert parent.poll(30), "prefill process never confirmed the release"
        report = parent.recv()
        assert report["notified"] == ["req-1"] and report["freed"] == [True]
        assert report["free_blocks"] == CACHE.num_blocks and report["registered"] is False
        # A closed agent is gone: its last metadata (taken after deregistration) lists no pool and
        # no live endpoint, so connecting to it is refused.
        from dataclasses import replace

        with pytest.raises(TransportError, match="prefill-0"):
            receiver.connect(replace(handle.source, metadata=report["final_metadata"]))
        parent.send("done")
    finally:
        receiver.close()
        proc.join(10)
    assert not receiver.registered
    receiver.close()  # idempotent


def test_local_backend_is_equivalent(reference_tokens):
    sender_engine = _engine(prefill_only=True)
    sender = make_transport("local", "local-prefill")
    receiver = make_transport("local", "local-decode")
    try:
        sender.register(sender_engine.runner.cache.raw, sender_engine.runner.layout)
        handle, first_token, sent_bytes = _prefill(sender_engine, sender)
        tokens, stats = _decode_after_pull(receiver, handle, first_token, sent_bytes)
        assert tokens == reference_tokens and stats.descriptors == 2
        receiver.notify("local-prefill", "req-1")
        assert sender.poll_notifications() == ["req-1"] and sender.poll_notifications() == []
    finally:
        sender.close()
        receiver.close()
    assert "local-prefill" not in registered_agents() and "local-decode" not in registered_agents()
    with pytest.raises(TransportError, match="closed"):
        sender.describe()


def _layout(**kw) -> KVLayout:
    base = dict(
        num_layers=4,
        num_kv_heads=2,
        head_dim=32,
        block_size=16,
        dtype="fp8",
        scale_layout="per_token_head_fp32",
        num_blocks=8,
    )
    return KVLayout(**{**base, **kw})


@pytest.mark.parametrize("backend", ["local", "nixl"])
def test_layout_mismatch_is_refused_naming_fields(backend):
    a, b = make_transport(backend, f"{backend}-a"), make_transport(backend, f"{backend}-b")
    try:
        la, lb = _layout(), _layout(block_size=32, dtype="bf16", scale_layout="none", num_blocks=4)
        a.register(torch.zeros(la.num_blocks, la.block_bytes, dtype=torch.uint8), la)
        b.register(torch.zeros(lb.num_blocks, lb.block_bytes, dtype=torch.uint8), lb)
        with pytest.raises(LayoutMismatch) as err:
            b.connect(a.describe())
        msg = str(err.value)
        assert "block_size: 32 != 16" in msg and "dtype" in msg and "num_blocks" not in msg
    finally:
        a.close()
        b.close()


def _stopped_sender_main(conn) -> None:
    layout = _layout(num_blocks=64)
    transport = make_transport("nixl", "frozen-prefill")
    pool = torch.full((layout.num_blocks, layout.block_bytes), 7, dtype=torch.uint8)
    transport.register(pool, layout)
    conn.send(transport.make_handle("req-x", list(range(64)), 64 * layout.block_size))
    time.sleep(60)


@pytest.mark.slow  # child processes (NIXL peers, a benchmark run): seconds each
def test_nixl_timeout_releases_and_dead_peer_is_detected():
    """A peer that cannot answer the handshake (stopped) times out; a killed peer is an error."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_stopped_sender_main, args=(child,), daemon=True)
    proc.start()
    layout = _layout(num_blocks=64)
    receiver = make_transport("nixl", "patient-decode", progress_thread=False)
    try:
        receiver.register(torch.zeros(layout.num_blocks, layout.block_bytes, dtype=torch.uint8), layout)
        assert parent.poll(60)
        handle = parent.recv()
        os.kill(proc.pid, signal.SIGSTOP)
        t0 = time.perf_counter()
        with pytest.raises(TransferTimeout, match="released"):
            receiver.read(handle, list(range(64)), timeout_s=1.0)
        assert time.perf_counter() - t0 < 5
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.join(10)
        with pytest.raises(TransportError, match="dead or unreachable"):
            receiver.read(handle, list(range(64)), timeout_s=5.0)
    finally:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        receiver.close()


def test_bad_block_ids_are_refused_before_any_transfer():
    lay = _layout()
    a, b = make_transport("local", "ids-a"), make_transport("local", "ids-b")
    try:
        for t in (a, b):
            t.register(torch.zeros(lay.num_blocks, lay.block_bytes, dtype=torch.uint8), lay)
        handle = a.make_handle("r", [0, 1], 20)
        with pytest.raises(ValueError, match="outside the pool"):
            b.read(handle, [7, 8])
        with pytest.raises(ValueError, match="repeat"):
            b.read(handle, [3, 3])
    finally:
        a.close()
        b.close()


def test_coalesce_and_stream_split():
    assert coalesce([4, 5, 6, 9], [0, 1, 2, 3], 10) == [Run(40, 0, 30), Run(90, 30, 10)]
    assert len(coalesce([4, 5, 6, 9], [0, 1, 2, 3], 10, enabled=False)) == 4
    assert coalesce([3, 2], [0, 1], 10) == [Run(30, 0, 10), Run(20, 10, 10)]  # descending: no merge
    groups = split_for_streams([Run(0, 0, 8 << 20)], 2)
    assert [sum(r.nbytes for r in g) for g in groups] == [4 << 20, 4 << 20]
    assert groups[1][0] == Run(4 << 20, 4 << 20, 4 << 20)
    assert len(split_for_streams([Run(0, 0, 1000)], 4)) == 1  # small transfers stay one stream


@pytest.mark.slow  # child processes (NIXL peers, a benchmark run): seconds each
def test_bench_transfer_small_sweep_verifies_every_byte(tmp_path, capsys):
    """`pdserve bench transfer --json` on a tiny sweep: schema, verification, provenance file."""
    import json

    from cli import main as cli_main

    argv = flags(size_mb=1, block_tokens="16,64", repeats=1, json=True, no_plot=True, out_dir=tmp_path)
    rc = cli_main(["bench", "transfer", *argv])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert {r["backend"] for r in out["rows"]} == {"nixl", "local"} and out["memcpy_gbytes_per_s"] > 0
    assert len(out["rows"]) == 2 * 2 * 2  # backends x block sizes x coalescing on/off
    for r in out["rows"]:
        assert r["verified"] and r["bytes"] == 1 << 20 and r["gbytes_per_s"] > 0
        assert set(r) >= {"backend", "bytes", "block_tokens", "coalesced", "descriptors", "ms", "gbytes_per_s"}
    uncoalesced = {r["block_tokens"]: r["descriptors"] for r in out["rows"] if not r["coalesced"]}
    assert uncoalesced == {16: 4, 64: 1}  # one descriptor per 256 KiB / 1 MiB block
    saved = json.loads((tmp_path / "transfer.json").read_text())
    assert saved["provenance"]["git_commit"] and saved["rows"] == out["rows"]
