"""`--kv-transfer {bulk,layerwise,auto}`: which requests stream their KV layer by layer.

bulk: the decode worker pulls a prompt's KV whole once its prefill has ended (all of the transfer
sits between the first and second token). layerwise: every remote prefill streams
(prefill_worker/kv_stream.py, decode_worker/kv_stream.py). auto: a prompt streams when the cost
model (costmodel/article/layerwise.py) says it gains: its bulk pull is longer than what streaming leaves
exposed (the last group, or the backlog on a link slower than the prefill) plus the stream's fixed
cost and, on a CPU host, the prefill's own slowdown beside its transfer (about 3% measured on 2
cores: at 1 Gbit/s that is as much as a 1.7k-token document's transfer). The link rate is
`--link-gbps` when given, else the rate measured on this server's pulls so far; the prefill rate is
measured on its prefills. Until both are known auto pulls whole.
"""

from __future__ import annotations

from dataclasses import dataclass

from costmodel.article.layerwise import DEFAULT_OPEN_S, LinkSpec, groups_of, layerwise_gain_s

KV_TRANSFERS = ("bulk", "layerwise", "auto")


@dataclass
class KVTransferPolicy:
    mode: str  # one of KV_TRANSFERS
    layers_per_group: int
    num_layers: int
    bytes_per_token: float  # KV bytes per prompt token (the KV layout's)
    link_gbps: float | None = None  # nominal link rate between the pools, if known
    open_s: float = DEFAULT_OPEN_S
    # the prefill's slowdown beside its own transfer, a fraction (CPU_OVERLAP_COST on a CPU host)
    overlap_cost: float = 0.0
    # what this server measured: pulls (bytes, seconds) and remote prefills (tokens, seconds)
    pulled_bytes: float = 0.0
    pulled_s: float = 0.0
    prefilled_tokens: float = 0.0
    prefill_s: float = 0.0

    def __post_init__(self) -> None:
        if self.mode not in KV_TRANSFERS:
            raise ValueError(f"kv_transfer must be one of {', '.join(KV_TRANSFERS)}, got {self.mode!r}")

    @property
    def groups(self) -> int:
        return groups_of(self.num_layers, self.layers_per_group)

    def link(self) -> LinkSpec | None:
        if self.link_gbps:
            return LinkSpec.gbits(self.link_gbps)
        if self.pulled_s > 0 and self.pulled_bytes > 0:
            return LinkSpec(self.pulled_bytes / self.pulled_s)
        return None

    def observe_pull(self, nbytes: int, seconds: float) -> None:
        self.pulled_bytes += nbytes
        self.pulled_s += seconds

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.prefilled_tokens += tokens
            self.prefill_s += seconds

    def gain_s(self, prompt_tokens: int) -> float | None:
        """Predicted time saved by streaming this prompt (None: not enough measured yet)."""
        link = self.link()
        if link is None or self.prefilled_tokens <= 0:
            return None
        per_token = self.prefill_s / self.prefilled_tokens
        kv = prompt_tokens * self.bytes_per_token
        return layerwise_gain_s(kv, prompt_tokens * per_token, self.groups, link, self.open_s, self.overlap_cost)

    def streams(self, prompt_tokens: int, requested: str | None = None) -> bool:
        """Whether this prompt streams; `requested`: the request's own mode, over the server's."""
        mode = requested or self.mode
        if mode != "auto":
            return mode == "layerwise"
        gain = self.gain_s(prompt_tokens)
        return gain is not None and gain > 0
