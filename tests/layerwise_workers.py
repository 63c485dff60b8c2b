"""In-process prefill and decode workers for the layer-wise KV streaming tests (the "local"
transport or real NIXL/UCX, no Ray): the prompts they stream, the `workers` fixture, a request
served the way the router serves it (a stream opened first, or a bulk pull), and the check that
every KV block came back. Shared by tests/test_layerwise.py (streamed == bulk) and
tests/test_layerwise_faults.py (faults mid-stream); tests/test_layerwise_policy.py and
tests/test_layerwise_server.py read its shapes.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Any

import pytest

from contracts.worker import GenerateRequest, PrefillResult, StreamEvent, WorkerConfig
from decode_worker.worker import DecodeWorker
from engine.config import PRESETS, CacheConfig
from engine.kv.layout import KVLayout
from engine.sequence import SamplingParams
from prefill_worker.worker import PrefillWorker
from tests.helpers import wait_until
from transport.wire import TransferStats

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
_names = itertools.count()  # the local transport registers each worker by name, process-wide


class Workers:
    """In-process workers made by one test, all shut down after it."""

    def __init__(self) -> None:
        self.made: list[PrefillWorker | DecodeWorker] = []

    def prefill(self, **kw: Any) -> PrefillWorker:
        w = PrefillWorker(worker_cfg(**kw), f"lw-prefill-{next(_names)}")
        self.made.append(w)
        return w

    def decode(self, **kw: Any) -> DecodeWorker:
        w = DecodeWorker(worker_cfg(**kw), f"lw-decode-{next(_names)}")
        self.made.append(w)
        return w

    def pair(self, **kw: Any) -> tuple[PrefillWorker, DecodeWorker]:
        """A prefill and a decode worker with the same settings."""
        return self.prefill(**kw), self.decode(**kw)


def workers_fixture():
    """The `workers` fixture of a module, declared as `workers = workers_fixture()`: a `Workers`
    for the test, every worker it made shut down after it (the last made first)."""

    @pytest.fixture
    def workers():
        made = Workers()
        yield made
        for w in reversed(made.made):
            w.shutdown()

    return workers


def worker_cfg(**kw: Any) -> WorkerConfig:
    return WorkerConfig(**{"model": "tiny", "transport": "local", "num_blocks": 64, **kw})


def make_request(rid: str, prompt: list[int] = PROMPT, max_tokens: int = MAX_TOKENS, **kw: Any) -> GenerateRequest:
    return GenerateRequest(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True), **kw)


def collect_events(d: DecodeWorker, rids: set[str], timeout_s: float = 30.0) -> dict[str, list[StreamEvent]]:
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


def serve_request(p: PrefillWorker, d: DecodeWorker, req: GenerateRequest, layers_per_group: int | None) -> Served:
    """What the router does: with `layers_per_group`, open a stream first and let the decode worker
    admit the request by itself; else (or if it did not stream) pull it whole."""
    target = None
    if layers_per_group is not None:
        target = d.open_stream(req, p.describe(), layers_per_group)
        assert target is not None, "the decode worker had no room for the stream"
    result = p.prefill(req, target)
    if not result.streamed:
        d.submit_prefilled(req, result)
    events = collect_events(d, {req.request_id})[req.request_id]
    assert [e.kind for e in events if e.kind != "token"] == ["admitted"], events
    return Served([result.first_token, *[e.token_id for e in events if e.kind == "token"]], result, events)


def wait_until_clean(*ws: PrefillWorker | DecodeWorker, timeout_s: float = 10.0) -> None:
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


def hold_forward_pass(
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
