"""What the simulator simulates (costmodel/sim/engine.py runs it): a request and its token times,
what each step costs (`StepModel`, from the cost model or a measured step fit), and the serving
configuration (`SimConfig`: mode, pool sizes, chunk, batch limit, KV link, and how the KV crosses
the link: whole after the prefill, or layer by layer while it runs, priced by costmodel/article/layerwise.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from costmodel.article import cost_model as cm
from costmodel.article.layerwise import DEFAULT_GROUP_OVERHEAD_S, LinkSpec, groups_of
from costmodel.fit.step_fit import StepCostFit, StepShape
from engine.config import PROMPT_STEP_TOKENS

MODES = ("colocated", "chunked", "disagg", "auto")
# As pdserve's --kv-transfer: "auto" streams a request when costmodel/article/layerwise.py says it gains.
KV_TRANSFERS = ("bulk", "layerwise", "auto")


@dataclass
class Request:
    rid: int
    kind: str  # "chat" | "doc"
    arrival: float
    prompt: int
    output: int  # tokens to generate, the first (from prefill) included
    prefilled: int = 0
    token_times: list[float] = field(default_factory=list)
    # disagg only: the KV bytes' own time on the link (streamed or not), and when a decode
    # worker's batch took the request in (what pdserve's timeline calls decode_admitted; decode
    # wait = admitted - first token - the pull, the link's queue included: `decode_wait_s`)
    transfer_s: float | None = None
    admitted: float | None = None
    prefill_start: float | None = None  # when its first prefill step began
    # disagg only: how its KV crossed ("bulk" or "layerwise"), and what of the crossing was left
    # once its prefill had ended (the link's queue included), as pdserve's timeline says exposed_ms
    kv_transfer: str | None = None
    exposed_transfer_s: float | None = None
    # a shared prompt prefix (a system prompt, a document asked about again): its first
    # `prefix_len` tokens are the same as every other request's with this `prefix_key`, so a
    # worker whose KV cache holds them computes (and a decode worker pulls) only the rest
    prefix_key: str | None = None
    prefix_len: int = 0
    cached: int = 0  # prompt tokens its prefill found in the worker's prefix cache (whole blocks)

    @property
    def done(self) -> bool:
        return len(self.token_times) >= self.output

    @property
    def decode_wait_s(self) -> float | None:
        """Prefill end to decode join, less the pull, as router/observe/timeline.py counts it: a streamed
        request's pulls overlapped the prefill, so only their exposed part is taken off."""
        if self.admitted is None or not self.token_times:
            return None
        pull = self.exposed_transfer_s if self.kv_transfer == "layerwise" else self.transfer_s
        return self.admitted - self.token_times[0] - (pull or 0.0)

    @property
    def ctx(self) -> int:
        return self.prompt + len(self.token_times)


@dataclass(frozen=True)
class StepModel:
    """Step durations from the cost model. `fixed_ctx` pins every decode sequence's context (the
    article's "every stream at 4k"); None uses each sequence's real context."""

    model: cm.ModelSpec
    hw: cm.HardwareSpec
    mfu: float = cm.ARTICLE_MFU
    weight_dtype: str = "fp8"
    kv_dtype: str = "fp8"
    fixed_ctx: float | None = None
    # A measured step-cost fit (costmodel/fit/step_fit.py): when set it prices every step from its
    # shape, and a colocated whole prompt runs *with* the decode batch, as the engine does.
    fit: StepCostFit | None = None
    # A disaggregated run's prefill pool priced apart (fitted on its own steps: on a CPU the two
    # pools share cores, so each pool's steps cost what they cost beside the other); None: `fit`.
    prefill_fit: StepCostFit | None = None
    # Steps carrying PROMPT_STEP_TOKENS prompt tokens or more, where the server runs them on more
    # intra-op threads than its decode steps (a colocated CPU worker's --prompt-threads): fitted
    # on those steps alone; None: `fit` prices them too.
    prompt_fit: StepCostFit | None = None
    # A step that decodes alone (no prompt tokens) priced this many times the fit's; a step that
    # carries prompt tokens stays at the fit's, decode rows and all: a verified candidate's steps
    # read before its timed pass, decode steps at one pace and steps with prompt tokens at another
    # (benchmarks/verify_steps.py `step_pace`). Not split inside a step: on 2026-12-06 a chat's
    # mixed steps ran 1.03x their price beside decode steps at 0.91x, and pricing a mixed step's
    # decode rows at the decode pace put its re-priced goodput 31% off where whole steps by kind
    # put it within 1% (docs/plan.md). 1: the fit's.
    decode_pace: float = 1.0

    def step(self, batch: list[Request], parts: list[tuple[int, int]]) -> float:
        """One engine step: the decode batch plus prompt chunks (start, n)."""
        if self.fit is not None:
            f = self._fit_for(sum(n for _, n in parts))
            pairs = self._decode_pairs(batch)
            t = f.step_seconds(len(batch), pairs, parts)
            return t if parts else self.decode_pace * t
        return (self.decode(batch) if batch else 0.0) + sum(self.chunk(s, n) for s, n in parts)

    def decode_run(self, batch: list[Request], k: int) -> list[float]:
        """`decode(batch)` for each of `k` steps in a row, every context one token longer a step:
        the same figures as pricing the steps one by one (the sums are whole numbers)."""
        n = len(batch)
        if self.fit is not None:
            p = self.decode_pace
            if self.fixed_ctx is not None:
                return [p * self.fit.step_seconds(n, float((int(self.fixed_ctx) + 1) * n))] * k
            s0 = sum(r.prompt + len(r.token_times) for r in batch)
            return [p * self.fit.step_seconds(n, float(s0 + i * n + n)) for i in range(k)]
        if self.fixed_ctx is not None:
            return [self.decode(batch)] * k
        s0 = sum(r.ctx for r in batch)
        return [
            cm.decode_step_tokens(self.model, self.hw, n, s0 + i * n, self.mfu, self.weight_dtype, self.kv_dtype).time_s
            for i in range(k)
        ]

    def _decode_pairs(self, batch: list[Request]) -> float:
        """The decode rows' attention pairs: each row's context and its new token."""
        if self.fixed_ctx is not None:
            return (int(self.fixed_ctx) + 1) * len(batch)
        return float(sum(r.prompt + len(r.token_times) for r in batch) + len(batch))

    def _fit_for(self, prompt_tokens: int) -> StepCostFit:
        """The fit that prices a step carrying `prompt_tokens` prompt tokens (with `fit` set)."""
        assert self.fit is not None
        if self.prompt_fit is not None and prompt_tokens >= PROMPT_STEP_TOKENS:
            return self.prompt_fit
        return self.fit

    def fit_of(self, role: str, prompt_tokens: int) -> StepCostFit | None:
        """The fit that prices a step of a worker in `role` ("colocated", "prefill", "decode")
        carrying `prompt_tokens` prompt tokens; None for a datasheet model."""
        if self.fit is None:
            return None
        if role == "prefill":
            return self.prefill_fit or self.fit
        return self._fit_for(prompt_tokens)

    def prefill_pool_step(self, parts: list[tuple[int, int]]) -> float:
        """One step of a disaggregated prefill worker: these prompts (start, n), batched; a prompt
        whose prefix was cached starts past it."""
        f = self.prefill_fit or self.fit
        if f is not None:
            return f.seconds(StepShape.of((), parts))
        start, n = parts[0]
        return self.prefill(n) if start == 0 else self.chunk(start, n)

    def decode(self, batch: list[Request]) -> float:
        if self.fit is not None:
            return self.decode_pace * self.fit.step_seconds(len(batch), self._decode_pairs(batch))
        kv = self.fixed_ctx * len(batch) if self.fixed_ctx is not None else sum(r.ctx for r in batch)
        return cm.decode_step_tokens(
            self.model, self.hw, len(batch), kv, self.mfu, self.weight_dtype, self.kv_dtype
        ).time_s

    def prefill(self, tokens: int) -> float:
        if self.fit is not None:
            return self._fit_for(tokens).prefill_seconds(tokens)
        return cm.prefill(self.model, self.hw, tokens, self.mfu, self.weight_dtype).time_s

    def chunk(self, start: int, n: int) -> float:
        if self.fit is not None:
            return self.fit.chunk_extra_seconds(start, n)
        return cm.prefill_chunk_seconds(self.model, self.hw, start, n, self.mfu, self.weight_dtype)

    def transfer(self, tokens: int, link: cm.Link) -> float:
        return cm.kv_transfer_seconds(self.model, tokens, link, self.kv_dtype)

    def kv_bytes(self, tokens: int) -> float:
        return tokens * cm.kv_bytes_per_token(self.model, self.kv_dtype)


@dataclass(frozen=True)
class SimConfig:
    mode: str = "colocated"
    workers: int = 1  # colocated workers (GPUs or nodes)
    prefill_workers: int = 1
    decode_workers: int = 1
    chunk: int = 512  # prompt tokens per step in chunked mode
    max_batch: int = 256
    link: cm.Link = cm.LINKS["nvlink"]
    max_prefill_tokens: int = 8192  # whole prompts batched into one step, as the engine's default
    # disagg: what a request waits beyond the pull and the next step boundary before a decode
    # worker takes it in (router and Ray hops, the worker's inbox); measured, not modelled
    admit_s: float = 0.0
    # disagg with both pools on one host's CPU cores: a decode step costs this many times its
    # price for the share of it during which a prefill step runs (1 on separate GPUs; measured)
    decode_slowdown: float = 1.0
    # ... and a prefill step this many times its price for the share of it during which a decode
    # worker is decoding (its price: a lone prefill step's)
    prefill_slowdown: float = 1.0
    # an idle worker starts its step once no request has arrived for this long, with whatever
    # arrived meanwhile, at most `batch_wait_max_s` after the first (pdserve's engine loop,
    # engine/config.py BATCH_WAIT_S and BATCH_WAIT_MAX_S; 0: at once, the first alone; None: a
    # fixed window of batch_wait_s from the first)
    batch_wait_s: float = 0.0
    batch_wait_max_s: float | None = None
    # a worker's decode-only steps between two changes to its batch run as one event (the same
    # results, fewer events: costmodel/sim/workers.py); False: every step its own event
    fast_forward: bool = True
    # disagg: how the KV crosses the link (pdserve's --kv-transfer): "bulk" pulls it whole after
    # the prefill; "layerwise" pulls `kv_stream_layers` layers at a time while the prefill runs,
    # each pull costing `kv_group_overhead_s` beyond its bytes, so only what the link has not
    # caught up with by the prefill's end is left; "auto" streams when that gains
    kv_transfer: str = "bulk"
    kv_stream_layers: int = 1
    kv_group_overhead_s: float = DEFAULT_GROUP_OVERHEAD_S
    # prefix caching, as the engine does it: a prompt reuses the whole `block_size`-token blocks
    # of its shared prefix a worker already holds (no eviction: the pools are taken to hold every
    # prefix). `prefix_policy`: requests go to the worker holding most of their prefix, ties and
    # misses to the least loaded (pdserve's --policy prefix); else to the least loaded.
    block_size: int = 16
    prefix_policy: bool = False
    # auto (pdserve's --mode auto: prefill and decode pools, each request prefilled in `chunk`-token
    # chunks on its decode worker or whole on a prefill worker, costmodel/sim/auto.py): the SLOs the
    # router decides under (--slo-ttft-ms, --slo-itl-ms), in s; None: not a constraint
    slo_ttft_s: float | None = None
    slo_itl_s: float | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if min(self.workers, self.prefill_workers, self.decode_workers, self.chunk, self.max_batch) < 1:
            raise ValueError("workers, chunk and max_batch must be positive")
        if self.kv_transfer not in KV_TRANSFERS:
            raise ValueError(f"kv_transfer must be one of {KV_TRANSFERS}, got {self.kv_transfer!r}")
        if self.kv_stream_layers < 1 or self.kv_group_overhead_s < 0:
            raise ValueError("kv_stream_layers must be positive and kv_group_overhead_s non-negative")

    def kv_link(self) -> LinkSpec:
        """The link as costmodel/article/layerwise.py prices it: its rate, and each group's pull overhead."""
        return cm.stream_link(self.link, self.kv_group_overhead_s)

    def kv_groups(self, model: cm.ModelSpec) -> int:
        return groups_of(model.num_layers, self.kv_stream_layers)

    @property
    def gpus(self) -> int:
        return self.prefill_workers + self.decode_workers if self.mode in ("disagg", "auto") else self.workers

    @property
    def label(self) -> str:
        if self.mode == "disagg":
            streamed = "" if self.kv_transfer == "bulk" else f" {self.kv_transfer}/{self.kv_stream_layers}"
            return f"disagg {self.prefill_workers}P{self.decode_workers}D {self.link.name}{streamed}"
        if self.mode == "auto":
            return f"auto {self.prefill_workers}P{self.decode_workers}D chunks of {self.chunk}"
        return f"chunked {self.chunk}" if self.mode == "chunked" else "colocated"
