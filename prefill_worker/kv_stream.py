"""Layer-wise KV streaming, the prefill side: announce each group of layers as soon as it is written.

A request dispatched with a `StreamTarget` (`--kv-transfer layerwise`) has a decode worker that
already reserved its blocks. While its prompt runs, the engine calls `on_layer` after every layer;
at the end of each group of `layers_per_group` layers this sends the decode worker one
`StreamProgress` message per prefill chunk in the step: "layers [a, b) of these blocks are final".
The decode worker pulls that slice at once (decode_worker/kv_stream.py), while the next group
computes here. A block is announced only once all its tokens are written (a chunk's last, partly
written block waits for the next chunk), except the prompt's own last block in its last chunk;
so no byte is pulled before it is final and none is pulled twice. Once the step that ends the
prompt has sampled the first token, `done` sends it: the decode worker admits the request when
that and every group have landed.

Only messages leave this side (a few hundred bytes each); the bytes move by the decode side's
READs, so the prefill never waits for the link. If the decode side cannot be reached the request
stops streaming (`broken`) and the router falls back to a bulk pull of the parked KV.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from engine.core.scheduler import ScheduledBatch
from transport.base import Transport, TransportError
from transport.wire import StreamProgress, StreamTarget

log = logging.getLogger("pdserve.prefill")


def layer_groups(num_layers: int, layers_per_group: int) -> list[tuple[int, int]]:
    """[first, last) of each group: `layers_per_group` layers each, the last group what is left."""
    n = max(1, min(layers_per_group, num_layers))
    return [(a, min(a + n, num_layers)) for a in range(0, num_layers, n)]


@dataclass
class _Outgoing:
    target: StreamTarget
    group_ends: dict[int, tuple[int, int]]  # last layer of a group -> that group
    sent: dict[tuple[int, int], int] = field(default_factory=dict)  # group -> blocks announced so far
    messages: int = 0
    announced: list[tuple[int, int, float]] = field(default_factory=list)  # (first layer, last + 1, unix)
    broken: str | None = None  # why this request stopped streaming (its decode worker is unreachable)


class StreamSender:
    """The prefill worker's outgoing streams; used on its engine-loop thread only."""

    def __init__(self, transport: Transport, num_layers: int, block_size: int, verify: bool):
        self.transport, self.num_layers, self.block_size, self.verify = transport, num_layers, block_size, verify
        self._streams: dict[str, _Outgoing] = {}

    @property
    def active(self) -> bool:
        return bool(self._streams)

    def open(self, target: StreamTarget) -> None:
        groups = layer_groups(self.num_layers, target.layers_per_group)
        self._streams[target.request_id] = _Outgoing(target, {g[1] - 1: g for g in groups})

    def on_layer(self, batch: ScheduledBatch, layer: int) -> None:
        """Engine hook, after `layer` of the step: at a group's end, announce what it finished."""
        synced = False
        for chunk in batch.prefill:
            out = self._streams.get(chunk.seq.seq_id)
            if out is None or out.broken is not None or layer not in out.group_ends:
                continue
            group = out.group_ends[layer]
            end_tok = chunk.start + chunk.n
            bs = self.block_size
            end_block = -(-end_tok // bs) if chunk.completes else end_tok // bs
            first = out.sent.get(group, out.target.hit_blocks)
            if end_block <= first:
                continue
            if not synced and chunk.seq.block_table and self.transport.layout is not None:
                synced = _sync_device()
            ids = chunk.seq.block_table[first:end_block]
            sums = self.transport.slice_checksums(ids, group) if self.verify else ()
            now = time.time()
            self._send(out, StreamProgress(chunk.seq.seq_id, "group", group, first, tuple(ids), sums, now))
            out.sent[group] = end_block
            out.announced.append((group[0], group[1], now))

    def done(
        self, request_id: str, first_token: int, lease_deadline: float
    ) -> tuple[bool, list[tuple[int, int, float]]]:
        """The prompt is prefilled: send the first token. Returns (True if every message reached
        the decode worker, which then admits the request by itself; False if it was not
        streaming), and when each group was announced (first layer, last + 1, unix), in order."""
        out = self._streams.pop(request_id, None)
        if out is None:
            return False, []
        msg = StreamProgress(request_id, "done", t=time.time(), first_token=first_token, lease_deadline=lease_deadline)
        self._send(out, msg)
        return out.broken is None, out.announced

    def fail(self, request_id: str, error: str) -> None:
        """The prefill gave up on the request (abort, failed step, worker ending): the decode side
        frees its reserved blocks now rather than at its timeout."""
        out = self._streams.pop(request_id, None)
        if out is not None and out.broken is None:
            self._send(out, StreamProgress(request_id, "failed", t=time.time(), error=error))

    def fail_all(self, error: str) -> None:
        for request_id in list(self._streams):
            self.fail(request_id, error)

    def _send(self, out: _Outgoing, msg: StreamProgress) -> None:
        if out.broken is not None:
            return
        try:
            self.transport.send_progress(out.target.peer.agent, msg)
            out.messages += 1
        except TransportError as e:
            out.broken = str(e)
            log.warning("layer-wise stream of %s to %s stopped: %s", msg.request_id, out.target.peer.agent, e)


def _sync_device() -> bool:
    """CUDA runs the layers asynchronously: a group is only written once the queued kernels ran.
    One synchronize per group end (none on CPU, where the hook runs after the layer computed)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return True
