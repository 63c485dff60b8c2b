"""The deployments a worker budget allows, and the `pdserve serve` command for each."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

DEFAULT_CHUNKS = (64, 128, 256, 512, 1024, 2048)
# the splits grow as the square of the budget: 64 workers is ~4,400 candidates, minutes of simulation
MAX_BUDGET = 64
# `--mode auto` decides each request under a TTFT and an ITL SLO; where the plan gives none, the
# router's defaults (router/config_fields.py; tests/test_plan_auto.py holds them equal)
AUTO_SLO_TTFT_MS, AUTO_SLO_ITL_MS = 1000.0, 50.0


@dataclass(frozen=True)
class Candidate:
    """One deployment: `mode` "colocated" (whole prompts), "chunked" (colocated, prompts in chunks
    of `chunk` tokens mixed into decode steps) or "disagg" (`prefill` + `decode` workers, the KV
    pulled whole after the prefill, "bulk", or streamed layer by layer while it runs) or "auto"
    (the disaggregated pools, each request prefilled on a prefill worker or in chunks of `chunk`
    tokens on its decode worker, as the router decides under `slo_ttft_ms` and `slo_itl_ms`).
    `prefix_policy`: requests go to the worker that caches most of their shared prefix
    (`--policy prefix`); set where the workload shares prefixes and a pool has several workers."""

    mode: str
    decode: int
    prefill: int = 0
    chunk: int | None = None
    kv_transfer: str = "bulk"
    prefix_policy: bool = False
    slo_ttft_ms: float = AUTO_SLO_TTFT_MS  # auto only: the SLOs its router decides under
    slo_itl_ms: float = AUTO_SLO_ITL_MS
    calibration: str | None = None  # auto only: the calibration whose step fit its router starts from

    @property
    def workers(self) -> int:
        return self.prefill + self.decode

    @property
    def label(self) -> str:
        if self.mode == "disagg":
            return f"disagg {self.prefill}P{self.decode}D" + (" layerwise" if self.kv_transfer == "layerwise" else "")
        if self.mode == "auto":
            return f"auto {self.prefill}P{self.decode}D chunks {self.chunk}"
        n = f" x{self.decode}" if self.decode > 1 else ""
        return f"chunked {self.chunk}{n}" if self.mode == "chunked" else f"colocated{n}"

    @property
    def policy(self) -> str | None:
        """`--policy` of its pools: None where each has one worker (the router's default then)."""
        if self.prefix_policy:
            return "prefix"
        return "least_loaded" if max(self.prefill, self.decode) > 1 else None

    def serve_args(self) -> list[str]:
        """The `pdserve serve` flags that deploy it. A pool of several workers dispatches to the least
        loaded (or by prefix): what the simulator models (costmodel/sim/engine.py `_pick`); the
        router's default, round robin, queues a Poisson arrival behind a busy worker while another
        idles."""
        policy = ["--policy", self.policy] if self.policy else []
        if self.mode == "disagg":
            split = ["--prefill", str(self.prefill), "--decode", str(self.decode)]
            return ["--mode", "disagg", *split, "--kv-transfer", self.kv_transfer, *policy]
        if self.mode == "auto":
            split = ["--prefill", str(self.prefill), "--decode", str(self.decode), "--chunk-size", str(self.chunk)]
            slos = ["--slo-ttft-ms", f"{self.slo_ttft_ms:g}", "--slo-itl-ms", f"{self.slo_itl_ms:g}"]
            cal = ["--calibration", self.calibration] if self.calibration else []
            return ["--mode", "auto", *split, "--kv-transfer", self.kv_transfer, *slos, *cal, *policy]
        chunk = ["--chunk-size", str(self.chunk)] if self.mode == "chunked" else []
        return ["--mode", "colocated", "--decode", str(self.decode), *chunk, *policy]


def enumerate_candidates(
    budget: int,
    chunks: Sequence[int],
    longest_prompt: int,
    shared_prefixes: bool = False,
    auto_slos: tuple[float | None, float | None] | None = None,
    auto_calibration: str | None = None,
) -> list[Candidate]:
    """Every deployment of 1 to `budget` workers: colocated whole; chunked at each size in `chunks`
    shorter than the longest prompt (a chunk no prompt fills is the whole prompt again); every
    xPyD split with x, y >= 1, its KV pulled whole or streamed layer by layer. Smaller deployments
    compete too: ranked by goodput per worker, the fewest workers that meet the SLOs win. With
    `shared_prefixes`, a deployment with several workers in a pool routes by prefix. With
    `auto_slos` (the plan's TTFT and TPOT SLOs, ms, None where not given), every split under
    `--mode auto` too, its local prompts in chunks of each size, deciding under those SLOs from
    the step fit of `auto_calibration`."""
    if not 1 <= budget <= MAX_BUDGET:
        raise ValueError(f"--workers must be 1-{MAX_BUDGET}")
    useful = [c for c in sorted(set(chunks)) if 0 < c < longest_prompt]
    out = []
    for n in range(1, budget + 1):
        out += [Candidate("colocated", n), *(Candidate("chunked", n, chunk=c) for c in useful)]
        out += [Candidate("disagg", n - p, p, kv_transfer=t) for p in range(1, n) for t in ("bulk", "layerwise")]
        if auto_slos is not None:
            ttft, itl = auto_slos[0] or AUTO_SLO_TTFT_MS, auto_slos[1] or AUTO_SLO_ITL_MS
            out += [
                Candidate("auto", n - p, p, c, "bulk", False, ttft, itl, auto_calibration)
                for p in range(1, n)
                for c in useful
            ]
    if shared_prefixes:
        out = [replace(c, prefix_policy=max(c.prefill, c.decode) > 1) for c in out]
    return out
