"""Layer-wise KV streaming, priced: how much of a prompt's KV transfer is left after its prefill.

Bulk: the decode worker pulls the whole KV once the prefill has ended, so all of it is exposed:

    exposed_bulk = B / R + o

Layer-wise: the prefill announces its L layers in G groups as they are written; group i is ready
at about i/G of the prefill (P) and each is one pull of B/G bytes plus a per-group overhead o
(a message, a READ posted and completed). The link takes the groups in order:

    finish_0 = 0;  finish_i = max(finish_{i-1}, P * i / G) + B / (G R) + o
    exposed_layerwise = max(0, finish_G - P)

When the link keeps up (B/(G R) + o <= P/G) only the last group is exposed: B/(G R) + o. When
it is slower than the prefill produces KV, the backlog adds up: about B/R + G o - P (G-1)/G.
Chunked prefill repeats the groups per chunk; the last chunk's groups are what is left, so the
same recurrence over the last chunk's share of the bytes and time is a close bound. A link still
busy with earlier pulls when the prefill starts (the simulator's FIFO link) starts the recurrence
later: finish_0 = that busy time instead of 0.

Everything is pure arithmetic: the router (`--kv-transfer auto`), `pdserve cost`, the simulator
and `bench compare`'s predictions use the same functions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# The fixed cost of one layer-wise pull beyond its bytes (a progress message, a READ posted and
# waited for, the receiver's poll): what 30 one-layer pulls of a SmolLM2 document took beyond one
# bulk pull of the same 21.3 MB, per pull: 3.3 ms (`pdserve bench layerwise` on the cluster
# rehearsal at 1 Gbit/s over TCP, 2-core CPU VM, 2026-12-03; 1.3 ms with two-layer groups).
DEFAULT_GROUP_OVERHEAD_S = 0.0033
# The cost of opening a stream (the router's open_stream call to the decode worker before the
# prefill starts), paid on the TTFT of every layer-wise request: median 9.9 ms in the same run
# (the timeline's kv_stream_open_ms).
DEFAULT_OPEN_S = 0.010
# What streaming costs the prefill itself when the transfer's CPU work (TCP, the shaper, NIXL's
# progress and the decode side's receiver) shares the cores with a CPU prefill: paired per
# document, layer-wise TTFT over bulk, medians 1.035 at 1 Gbit/s and 1.029 at 10 Gbit/s
# (`pdserve bench layerwise` on the 2-core rehearsal, 2026-12-03 16:49-17:00 UTC): about 3% of the
# prefill, which at 1 Gbit/s is as long as the 184 ms the stream hides. A GPU prefill does not
# share its compute with the transfer: 0 there.
CPU_OVERLAP_COST = 0.03
DEFAULT_LAYERS_PER_GROUP = 1  # the best measured on CPU: every pull hidden at 1 Gbit/s (docs/results.md)


@dataclass(frozen=True)
class LinkSpec:
    """A link between the pools: sustained bytes/s, a fixed cost per pull, and the burst a token
    bucket shaper lets through at line rate after an idle spell (`tc tbf`'s burst: the cluster
    rehearsal's links have one; a plain NIC or NVLink has none)."""

    bytes_per_s: float
    per_pull_s: float = DEFAULT_GROUP_OVERHEAD_S
    burst_bytes: float = 0.0

    @classmethod
    def gbits(cls, gbps: float, per_pull_s: float = DEFAULT_GROUP_OVERHEAD_S, burst_bytes: float = 0.0) -> LinkSpec:
        return cls(gbps * 1e9 / 8, per_pull_s, burst_bytes)

    def pull_s(self, nbytes: float, tokens: float) -> tuple[float, float]:
        """(seconds, bucket left) for a pull of `nbytes` that finds `tokens` bytes in the bucket."""
        free = min(nbytes, tokens)
        return (nbytes - free) / self.bytes_per_s + self.per_pull_s, tokens - free


def groups_of(num_layers: int, layers_per_group: int) -> int:
    return math.ceil(num_layers / max(1, min(layers_per_group, num_layers)))


def bulk_exposed_s(kv_bytes: float, link: LinkSpec) -> float:
    """The whole transfer, after the prefill (the bucket full: the link was idle)."""
    return link.pull_s(kv_bytes, link.burst_bytes)[0]


def layerwise_finish_s(
    kv_bytes: float, prefill_s: float, groups: int, link: LinkSpec, busy_s: float = 0.0, tail_s: float = 0.0
) -> float:
    """When the last group lands, from the prefill's start (the recurrence above); `busy_s`: how
    long after the prefill's start the link is still taken by earlier pulls; `tail_s`: the
    prefill's last stretch after its last layer wrote its KV (final norm, lm_head, sampling), so
    group i is ready at (prefill_s - tail_s) * i / groups."""
    share = kv_bytes / groups
    layers_s = max(0.0, prefill_s - tail_s)
    finish = max(0.0, busy_s)
    tokens = link.burst_bytes if busy_s <= 0 else 0.0
    for i in range(1, groups + 1):
        start = max(finish, layers_s * i / groups)
        tokens = min(link.burst_bytes, tokens + (start - finish) * link.bytes_per_s)  # refilled while idle
        seconds, tokens = link.pull_s(share, tokens)
        finish = start + seconds
    return finish


def layerwise_exposed_s(
    kv_bytes: float, prefill_s: float, groups: int, link: LinkSpec, busy_s: float = 0.0, tail_s: float = 0.0
) -> float:
    """What of the transfer is left once the prefill has ended."""
    return max(0.0, layerwise_finish_s(kv_bytes, prefill_s, groups, link, busy_s, tail_s) - prefill_s)


def layerwise_gain_s(
    kv_bytes: float,
    prefill_s: float,
    groups: int,
    link: LinkSpec,
    open_s: float = DEFAULT_OPEN_S,
    overlap_cost: float = 0.0,
) -> float:
    """Time to the second token saved by streaming (negative: streaming costs more than it hides).
    The stream's opening call is paid before the prefill, and on shared cores the prefill runs
    `overlap_cost` (a fraction, CPU_OVERLAP_COST on a CPU host) longer beside its own transfer:
    both count against the gain."""
    hidden = bulk_exposed_s(kv_bytes, link) - layerwise_exposed_s(kv_bytes, prefill_s, groups, link)
    return hidden - open_s - overlap_cost * prefill_s


def layerwise_threshold_tokens(
    bytes_per_token: float,
    prefill_s_per_token: float,
    groups: int,
    link: LinkSpec,
    open_s: float = DEFAULT_OPEN_S,
    max_tokens: int = 1 << 20,
    overlap_cost: float = 0.0,
) -> int:
    """The shortest prompt that gains from streaming (`--kv-transfer auto` streams prompts at
    least this long); `max_tokens` when none up to it does. The gain grows with the prompt, so a
    bisection finds it."""

    def gains(n: int) -> bool:
        return layerwise_gain_s(n * bytes_per_token, n * prefill_s_per_token, groups, link, open_s, overlap_cost) > 0

    if not gains(max_tokens):
        return max_tokens
    lo, hi = 1, max_tokens
    while lo < hi:
        mid = (lo + hi) // 2
        if gains(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo
