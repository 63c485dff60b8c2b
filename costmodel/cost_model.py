"""The article's arithmetic as pure functions of (model, hardware, workload). Imports no torch.

Every function follows the article's accounting so its tables come out exactly:

- decode step  = max(memory floor, FLOP time); memory = weights + batch * ctx * KV bytes/token,
  FLOPs = 2 * N * batch (attention FLOPs of decode are ignored, as in the article);
- prefill      = (2 * N * T + 4 * L * H * d_head * T^2) / (MFU * peak): the attention term counts
  the full T x T score matrix (no causal halving), again as the article does;
- a chunk [p, p + c) of a prompt costs prefill(p + c) - prefill(p), so chunks sum to the whole.

N is the parameter count of the config (Llama-3.1-70B: 70,553,706,496). The article's script
rounds it to 70.55e9; the tables it prints need the exact count (reads at batch 64: 113.4997 GB
with 70.55e9, 113.503 GB with the config; the article prints 114).

Calibration file (JSON, written by benchmarks that measure a device; every field but `schema`
optional, a missing field keeps the datasheet value)::

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
      "step_fit": {                         # measured step cost (costmodel/step_fit.py), from
        "fixed_ms": 5.2,                    #   every step `pdserve bench chunks` timed: per step,
        "per_token_us": 95.0,               #   per new token, per attention pair (quadratic in
        "attention_ns_per_pair": 0.03,      #   context), per decode sequence; when present it
        "per_sequence_us": 900.0            #   prices steps instead of the FLOP/bandwidth terms
      },
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
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from costmodel.step_fit import StepCostFit
from engine.config import KV_DTYPE_BYTES, PRESETS, ModelConfig, resolve_model_config

GB = 1e9
TFLOP = 1e12
DTYPE_BYTES = {"fp8": 1, "bf16": 2, "fp16": 2, "fp32": 4, **KV_DTYPE_BYTES}


@dataclass(frozen=True)
class HardwareSpec:
    name: str
    mem_bw: float  # bytes/s
    peak_flops: dict[str, float]  # dense FLOP/s per compute dtype
    mem_bytes: float  # HBM capacity
    source: str
    step_overhead_s: float = 0.0  # per decode step (from a calibration)
    prefill_overhead_s: float = 0.0  # per prefill or chunk (from a calibration)

    def peak(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            raise ValueError(f"{self.name} has no dense {dtype} peak (has: {', '.join(self.peak_flops)})")
        return self.peak_flops[dtype]


HARDWARE: dict[str, HardwareSpec] = {
    "h100-sxm": HardwareSpec(
        "h100-sxm",
        3.35e12,
        {"fp8": 1979e12, "bf16": 989e12},
        80e9,
        "NVIDIA H100 SXM datasheet: 3.35 TB/s HBM3, 1,979 TFLOP/s dense FP8 (3,958 with sparsity)",
    ),
    "h200": HardwareSpec(
        "h200",
        4.8e12,
        {"fp8": 1979e12, "bf16": 989e12},
        141e9,
        "NVIDIA H200 SXM datasheet: 4.8 TB/s HBM3e, 141 GB, same Hopper tensor cores as H100 SXM",
    ),
    "b200": HardwareSpec(
        "b200",
        8.0e12,
        {"fp8": 4500e12, "bf16": 2250e12},
        180e9,
        "NVIDIA DGX B200 datasheet per GPU: 8 TB/s HBM3e, 4.5 PFLOP/s dense FP8, 2.25 dense BF16",
    ),
    "a100-80g": HardwareSpec(
        "a100-80g",
        2.039e12,
        {"bf16": 312e12},
        80e9,
        "NVIDIA A100 80GB SXM datasheet: 2,039 GB/s HBM2e, 312 TFLOP/s dense BF16, no FP8",
    ),
}
HARDWARE["h100"] = HARDWARE["h100-sxm"]
HARDWARE["a100"] = HARDWARE["a100-80g"]


@dataclass(frozen=True)
class Link:
    name: str
    label: str
    bw: float  # bytes/s


LINKS: dict[str, Link] = {
    "nvlink": Link("nvlink", "NVLink 900 GB/s", 900 * GB),
    "ib-400g": Link("ib-400g", "400G InfiniBand", 50 * GB),
    "ib-100g": Link("ib-100g", "100G InfiniBand", 12.5 * GB),
}


def resolve_hardware(name: str) -> HardwareSpec:
    if name not in HARDWARE:
        raise ValueError(f"unknown hardware {name!r}; presets: {', '.join(sorted(HARDWARE))}")
    return HARDWARE[name]


def resolve_link(name: str) -> Link:
    """A preset name, or NAME=GBPS for a custom link (e.g. roce=25)."""
    if "=" in name:
        label, gbps = name.split("=", 1)
        return Link(label, f"{label} {float(gbps):g} GB/s", float(gbps) * GB)
    if name not in LINKS:
        raise ValueError(f"unknown link {name!r}; presets: {', '.join(LINKS)} (or NAME=GBPS)")
    return LINKS[name]


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
        for k in ("mem_bandwidth_gbps", "peak_tflops", "achieved_tflops"):
            v = getattr(cal, k)
            if v is not None and v <= 0:
                raise ValueError(f"calibration {k} must be positive, got {v}")
        if cal.mfu is not None and not 0 < cal.mfu <= 1:
            raise ValueError(f"calibration mfu must be in (0, 1], got {cal.mfu}")
        if cal.step_fit is not None:
            cal.fitted_steps()  # validates
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


@dataclass(frozen=True)
class ModelSpec:
    """What the arithmetic needs from a transformer config."""

    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    params: float

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> ModelSpec:
        return cls(cfg.name, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, float(cfg.num_params()))

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any], name: str = "hf") -> ModelSpec:
        return cls.from_config(ModelConfig.from_hf_config(hf, name=name))

    @classmethod
    def resolve(cls, model: str) -> ModelSpec:
        """A preset name, a registry model already pulled (e.g. smollm2-135m-instruct), a checkpoint
        directory or a config.json path."""
        from engine.model_registry import PullError  # noqa: PLC0415
        from engine.model_registry import resolve as registry_resolve  # noqa: PLC0415

        try:
            return cls.from_config(resolve_model_config(registry_resolve(model, pull_missing=False)))
        except KeyError as e:
            raise ValueError(f"{model}: config.json lacks {e} (a Llama-family config is expected)") from None
        except (PullError, FileNotFoundError) as e:
            raise ValueError(str(e)) from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{model}: not valid JSON ({e})") from None


ARTICLE_MODEL = ModelSpec.from_config(PRESETS["llama-3.1-70b"])
ARTICLE_HW = HARDWARE["h100-sxm"]
ARTICLE_MFU = 0.4


def _bytes(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


def kv_bytes_per_token(m: ModelSpec, kv_dtype: str = "fp8") -> int:
    """K and V, every layer, every KV head (FP8 scales not counted, as in the article)."""
    return 2 * m.num_layers * m.num_kv_heads * m.head_dim * _bytes(kv_dtype)


def weight_bytes(m: ModelSpec, weight_dtype: str = "fp8") -> float:
    return m.params * _bytes(weight_dtype)


@dataclass(frozen=True)
class DecodeStep:
    batch: int
    ctx: float
    read_bytes: float
    memory_s: float
    flop_s: float
    time_s: float
    per_seq_tok_s: float
    tok_s: float


def decode_step(
    m: ModelSpec,
    hw: HardwareSpec,
    batch: int,
    ctx: float,
    mfu: float = ARTICLE_MFU,
    weight_dtype: str = "fp8",
    kv_dtype: str = "fp8",
) -> DecodeStep:
    """One decode step of `batch` sequences at mean context `ctx`."""
    return decode_step_tokens(m, hw, batch, batch * ctx, mfu, weight_dtype, kv_dtype)


def decode_step_tokens(
    m: ModelSpec,
    hw: HardwareSpec,
    batch: int,
    kv_tokens: float,
    mfu: float = ARTICLE_MFU,
    weight_dtype: str = "fp8",
    kv_dtype: str = "fp8",
) -> DecodeStep:
    """One decode step whose sequences hold `kv_tokens` cached tokens in total (the simulator's form)."""
    if batch < 1:
        raise ValueError("batch must be >= 1")
    read = weight_bytes(m, weight_dtype) + kv_tokens * kv_bytes_per_token(m, kv_dtype)
    mem_s = read / hw.mem_bw
    flop_s = 2 * m.params * batch / (mfu * hw.peak(weight_dtype))
    t = max(mem_s, flop_s) + hw.step_overhead_s
    return DecodeStep(batch, kv_tokens / batch, read, mem_s, flop_s, t, 1 / t, batch / t)


def prefill_flops(m: ModelSpec, tokens: float) -> tuple[float, float]:
    """(linear, attention) FLOPs of a `tokens`-long prompt."""
    linear = 2 * m.params * tokens
    attention = 4 * m.num_layers * m.num_heads * m.head_dim * tokens * tokens
    return linear, attention


@dataclass(frozen=True)
class Prefill:
    tokens: int
    linear_flops: float
    attention_flops: float
    attention_share: float
    time_s: float


def prefill(
    m: ModelSpec, hw: HardwareSpec, tokens: int, mfu: float = ARTICLE_MFU, weight_dtype: str = "fp8"
) -> Prefill:
    lin, att = prefill_flops(m, tokens)
    t = (lin + att) / (mfu * hw.peak(weight_dtype)) + hw.prefill_overhead_s
    return Prefill(tokens, lin, att, att / (lin + att), t)


def prefill_chunk_seconds(
    m: ModelSpec, hw: HardwareSpec, start: int, chunk: int, mfu: float = ARTICLE_MFU, weight_dtype: str = "fp8"
) -> float:
    """Prompt tokens [start, start + chunk) after `start` are cached: prefill(end) - prefill(start)."""
    a, b = sum(prefill_flops(m, start)), sum(prefill_flops(m, start + chunk))
    return (b - a) / (mfu * hw.peak(weight_dtype)) + hw.prefill_overhead_s


def crossover_batch(
    m: ModelSpec,
    hw: HardwareSpec,
    ctx: float,
    mfu: float = ARTICLE_MFU,
    weight_dtype: str = "fp8",
    kv_dtype: str = "fp8",
) -> float:
    """Batch where the decode step turns compute-bound at context `ctx`; inf if it never does."""
    w_s = weight_bytes(m, weight_dtype) / hw.mem_bw
    per_seq_mem = ctx * kv_bytes_per_token(m, kv_dtype) / hw.mem_bw
    per_seq_flop = 2 * m.params / (mfu * hw.peak(weight_dtype))
    return math.inf if per_seq_flop <= per_seq_mem else w_s / (per_seq_flop - per_seq_mem)


def break_even_chunk(
    m: ModelSpec,
    hw: HardwareSpec,
    batch: int = 1,
    ctx: float = 4096,
    mfu: float = ARTICLE_MFU,
    weight_dtype: str = "fp8",
    kv_dtype: str = "fp8",
) -> float:
    """Chunk length whose prefill takes exactly one decode step (batch 1 by default, as the article).

    Solves 2 N c + 4 L H d c^2 = step * MFU * peak; the article drops the (0.2%) quadratic term.
    """
    step = decode_step(m, hw, batch, ctx, mfu, weight_dtype, kv_dtype).time_s - hw.prefill_overhead_s
    budget = max(step, 0.0) * mfu * hw.peak(weight_dtype)
    a = 4 * m.num_layers * m.num_heads * m.head_dim
    b = 2 * m.params
    return (-b + math.sqrt(b * b + 4 * a * budget)) / (2 * a)


def prefill_equivalent_tokens(
    m: ModelSpec,
    hw: HardwareSpec,
    tokens: int,
    batch: int = 32,
    ctx: float = 4096,
    mfu: float = ARTICLE_MFU,
    weight_dtype: str = "fp8",
    kv_dtype: str = "fp8",
) -> float:
    """A `tokens` prompt's prefill time, in generated tokens of a batch-`batch` decode."""
    step = decode_step(m, hw, batch, ctx, mfu, weight_dtype, kv_dtype).time_s
    return prefill(m, hw, tokens, mfu, weight_dtype).time_s / step * batch


@dataclass(frozen=True)
class ChunkRow:
    chunk: int
    time_s: float
    decode_steps: float


def chunk_row(
    m: ModelSpec,
    hw: HardwareSpec,
    chunk: int,
    batch: int = 1,
    ctx: float = 4096,
    mfu: float = ARTICLE_MFU,
    weight_dtype: str = "fp8",
    kv_dtype: str = "fp8",
) -> ChunkRow:
    """A first chunk of `chunk` tokens, in decode steps at `batch` (1 in the article's table)."""
    t = prefill(m, hw, chunk, mfu, weight_dtype).time_s
    return ChunkRow(chunk, t, t / decode_step(m, hw, batch, ctx, mfu, weight_dtype, kv_dtype).time_s)


@dataclass(frozen=True)
class CapacityRow:
    prefills_per_s: float
    gpu_share: float
    decode_sequences: float
    per_seq_tok_s: float


def capacity_table(
    m: ModelSpec,
    hw: HardwareSpec,
    rates: Iterable[float],
    prompt: int = 4096,
    batch: int = 32,
    ctx: float = 4096,
    mfu: float = ARTICLE_MFU,
    weight_dtype: str = "fp8",
    kv_dtype: str = "fp8",
) -> list[CapacityRow]:
    """One GPU-second per second: prefills take their share, decode at `batch` gets the rest.

    The sequences that still fit are the decode tokens/s left, divided by the per-sequence speed
    of a batch-`batch` step, i.e. batch * (1 - share).
    """
    p = prefill(m, hw, prompt, mfu, weight_dtype).time_s
    step = decode_step(m, hw, batch, ctx, mfu, weight_dtype, kv_dtype)
    rows = []
    for r in rates:
        share = min(1.0, r * p)
        seqs = (1 - share) / (step.time_s / batch) / step.per_seq_tok_s
        rows.append(CapacityRow(r, share, seqs, step.per_seq_tok_s))
    return rows


def transfer_seconds(nbytes: float, link: Link) -> float:
    return nbytes / link.bw


def kv_transfer_seconds(m: ModelSpec, tokens: int, link: Link, kv_dtype: str = "fp8") -> float:
    return transfer_seconds(tokens * kv_bytes_per_token(m, kv_dtype), link)


__all__ = [
    "GB",
    "HardwareSpec",
    "HARDWARE",
    "Link",
    "LINKS",
    "Calibration",
    "ModelSpec",
    "ARTICLE_MODEL",
    "ARTICLE_HW",
    "ARTICLE_MFU",
    "resolve_hardware",
    "resolve_link",
    "kv_bytes_per_token",
    "weight_bytes",
    "DecodeStep",
    "decode_step",
    "decode_step_tokens",
    "prefill_flops",
    "Prefill",
    "prefill",
    "prefill_chunk_seconds",
    "crossover_batch",
    "break_even_chunk",
    "prefill_equivalent_tokens",
    "ChunkRow",
    "chunk_row",
    "CapacityRow",
    "capacity_table",
    "transfer_seconds",
    "kv_transfer_seconds",
]
