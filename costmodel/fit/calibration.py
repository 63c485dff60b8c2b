"""The calibration file: what a benchmark measured about one device, in the form the cost model
reads it. Kept apart from the datasheets it overrides and the arithmetic that uses the result.

JSON, written by benchmarks that measure a device (`costmodel/provenance.save_calibration`); every
field but `schema` optional, a missing field keeps the datasheet value::

    {
      "schema": "pdserve.calibration/1",
      "device": "NVIDIA H200",              # what was measured
      "dtype": "fp8",                       # compute dtype the FLOP figures refer to
      "mem_bandwidth_gbps": 4300.0,         # measured achievable HBM read bandwidth, GB/s (1e9)
      "peak_tflops": 1500.0,                # measured dense GEMM peak, TFLOP/s (1e12)
      "mfu": 0.55,                          # achieved / datasheet peak in prefill, or instead:
      "achieved_tflops": 1088.0,            #   achieved TFLOP/s in prefill (mfu = this / peak)
      "decode_step_overhead_ms": 0.4,       # fixed cost per decode step (launches, sampling)
      "prefill_overhead_ms": 1.0,           # fixed cost per prefill / chunk
      "links_gbps": {"nvlink": 700.0},      # measured transfer bandwidth per link, GB/s
      "step_fit": {                         # measured step cost (costmodel/fit/step_fit.py), from
        "fixed_ms": 5.2,                    #   every step `pdserve bench chunks` timed: per step,
        "per_token_us": 95.0,               #   per new token, per attention pair (quadratic in
        "attention_ns_per_pair": 0.03,      #   context), per decode sequence; when present it
        "per_sequence_us": 900.0            #   prices steps instead of the FLOP/bandwidth terms
      },
      "torch_threads": 2,                   # intra-op threads the measured steps ran with (CPU)
      "pace_gflops": 110.0,                 # a one-thread GEMM's GFLOP/s then (benchmarks/pace.py)
      "step_scatter_ms": [0.4, -1.2, ...],  # decode steps over/under their price (a stall's draws)
      "prompt_thread_speedup": {            # CPU, `bench probe` of a server on this host: a whole
        "from_threads": 1, "to_threads": 2, #   prompt's forward on the threads a colocated whole
        "speedup_by_prompt_tokens": {"256": 1.72, "1024": 1.84}, ...  # server gives it, against
      },                                    #   the decode steps' (benchmarks/prompt_threads.py)
      "source": "pdserve bench gpu, commit abc123",
      "provenance": {"git_commit": "...", "cpu": "...", "cores": 2, "torch": "2.13.0",
                     "date_utc": "...", "load_average": [0.1, 0.2, 0.3]}
    }

`Calibration.apply(hw)` returns the effective `HardwareSpec` (measured bandwidth replaces the
datasheet's, measured peak replaces the datasheet's, overheads attached) and
`Calibration.effective_mfu(hw, default)` the MFU to use.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from costmodel.datasheets import GB, TFLOP, HardwareSpec, Link
from costmodel.fit.step_fit import StepCostFit


@dataclass(frozen=True)
class Calibration:
    """Measured figures for one device; see the module docstring for the JSON schema."""

    device: str = "unknown"
    dtype: str = "fp8"
    mem_bandwidth_gbps: float | None = None
    peak_tflops: float | None = None
    mfu: float | None = None
    achieved_tflops: float | None = None
    decode_step_overhead_ms: float = 0.0
    prefill_overhead_ms: float = 0.0
    links_gbps: dict[str, float] = field(default_factory=dict)
    source: str = ""
    step_fit: dict[str, Any] | None = None  # StepCostFit.to_dict()
    # where and when it was measured (costmodel/provenance.calibration_provenance): commit, CPU,
    # cores, torch, date, load; `origin_warning` compares it with this machine
    provenance: dict[str, Any] | None = None
    # intra-op torch threads the measured steps ran with (None: not recorded). On a CPU a step's
    # price depends on it (--threads-per-worker); the simulator reports it beside its prediction
    torch_threads: int | None = None
    # a whole prompt's forward on more threads than the measured steps ran with, by prompt length
    # (benchmarks/prompt_threads.py): what a colocated whole deployment's prompt steps gain there
    prompt_thread_speedup: dict[str, Any] | None = None
    # the machine's pace when it was measured: a one-thread GEMM's GFLOP/s (benchmarks/pace.py;
    # None: not recorded). `plan --verify` re-prices the steps at the pace it measures before each server
    pace_gflops: float | None = None
    # the most sequences a measured decode step ran at once (None: not recorded): beyond it the fit
    # extrapolates, and on a CPU a batch's per-sequence cost falls as it grows (a probe of batches
    # 1-8 priced a chat's decode steps of 12-19 sequences 1.15-1.2x what they took, docs/plan.md)
    largest_batch: int | None = None
    # ms each measured decode step ran over or under its price (costmodel/sim/stall_jitter.py; None:
    # not measured): a predicted stall, the longest of many steps, is drawn with it
    step_scatter_ms: list[float] | None = None

    SCHEMA = "pdserve.calibration/1"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Calibration:
        schema = d.get("schema", cls.SCHEMA)
        if schema != cls.SCHEMA:
            raise ValueError(f"calibration schema {schema!r} is not {cls.SCHEMA!r}")
        known = {k for k in cls.__dataclass_fields__}
        unknown = set(d) - known - {"schema"}
        if unknown:
            raise ValueError(f"unknown calibration fields: {', '.join(sorted(unknown))}")
        cal = cls(**{k: v for k, v in d.items() if k in known})
        for k in ("mem_bandwidth_gbps", "peak_tflops", "achieved_tflops", "pace_gflops"):
            v = getattr(cal, k)
            if v is not None and v <= 0:
                raise ValueError(f"calibration {k} must be positive, got {v}")
        for k in ("torch_threads", "largest_batch"):
            v = getattr(cal, k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"calibration {k} must be a positive integer, got {v}")
        if cal.step_scatter_ms is not None and not all(
            isinstance(v, (int, float)) and math.isfinite(v) for v in cal.step_scatter_ms
        ):
            raise ValueError("calibration step_scatter_ms must be a list of finite numbers (ms)")
        if cal.mfu is not None and not 0 < cal.mfu <= 1:
            raise ValueError(f"calibration mfu must be in (0, 1], got {cal.mfu}")
        if cal.step_fit is not None:
            cal.fitted_steps()  # validates
        if cal.prompt_thread_speedup is not None:
            by = cal.prompt_thread_speedup.get("speedup_by_prompt_tokens") or {}
            if not by or any(not str(n).isdigit() or not float(v) > 0 for n, v in by.items()):
                raise ValueError("calibration prompt_thread_speedup needs speedup_by_prompt_tokens {tokens: ratio > 0}")
        return cal

    def fitted_steps(self) -> StepCostFit | None:
        """The measured step-cost fit, if this calibration has one."""
        return None if self.step_fit is None else StepCostFit.from_dict(self.step_fit)

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read calibration {path}: {e}") from e

    def to_dict(self) -> dict[str, Any]:
        return {"schema": self.SCHEMA, **asdict(self)}

    def origin_warning(self, path: str | Path) -> str | None:
        """One line if this calibration was measured on another CPU or commit, or says not where."""
        from costmodel.machine import calibration_mismatch  # noqa: PLC0415

        return calibration_mismatch(path, self.provenance)

    def apply(self, hw: HardwareSpec) -> HardwareSpec:
        peaks = dict(hw.peak_flops)
        if self.peak_tflops is not None:
            peaks[self.dtype] = self.peak_tflops * TFLOP
        return replace(
            hw,
            name=f"{hw.name} (calibrated: {self.device})",
            mem_bw=self.mem_bandwidth_gbps * GB if self.mem_bandwidth_gbps else hw.mem_bw,
            peak_flops=peaks,
            step_overhead_s=self.decode_step_overhead_ms / 1e3,
            prefill_overhead_s=self.prefill_overhead_ms / 1e3,
            source=f"calibration {self.source or self.device}; datasheet: {hw.source}",
        )

    def effective_mfu(self, hw: HardwareSpec, default: float) -> float:
        """MFU against the (calibrated) peak of `hw`; achieved TFLOP/s wins over a bare mfu."""
        if self.achieved_tflops is not None:
            return min(1.0, self.achieved_tflops * TFLOP / hw.peak(self.dtype))
        return self.mfu if self.mfu is not None else default

    def link(self, link: Link) -> Link:
        gbps = self.links_gbps.get(link.name)
        return link if gbps is None else Link(link.name, f"{link.label} (measured {gbps:g} GB/s)", gbps * GB)


__all__ = ["Calibration"]
